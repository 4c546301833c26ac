"""A discrete-event simulator of one training step (pure): compute, host-to-device, device-to-host and
CPU lanes, from a :class:`Program` (what the step does, in lane terms) and a :class:`HardwareModel`.

The lanes follow the runtime's rules (``offload/runtime/core.py``):

* compute runs the trace's events in order; at event ``i`` it first issues the copies the plan hangs
  there, then waits for the copies of the buckets event ``i`` needs, then computes for ``compute_s[i]``;
* each copy lane is one FIFO queue: a copy starts when it has been issued and the copy before it is done,
  and takes ``nbytes / bandwidth(nbytes)``; a copy that starts while the other direction is busy runs at
  ``duplex_factor`` times its bandwidth (sampled when it starts: an approximation of a shared link);
* a bucket's gradient copy to the host is issued when its last gradient is produced (or at the end of
  backward for a bucket flushed then), and its AdamW runs on the CPU lane as soon as that copy is done
  (or, for the baseline policies that do so, only after backward);
* at a bucket's first gradient event, compute waits for the gradient copy of the grad slot whose bytes
  its slot reuses ([Note: waits on a reused grad slot]), after the host-to-device waits;
* resident buckets updated in the previous step are copied in again (their *refresh*): with
  ``Program.refresh_pipelined`` as the runtime pipelines it, each once its bucket's AdamW of the previous step
  ended, and the step is the period of the steady state ([Note: the refresh pipelined, modelled]); otherwise
  at the start of the step, ahead of any prefetch (deferred updates, data parallel, the baselines).

Without the pipelined refresh the step ends when every lane is idle: ``optimizer.step()`` waits for the CPU
lane and the refresh follows. Copies are issued
when compute *reaches* their event, which is what the CPU backend does; a CUDA host thread runs ahead of
the device, so on a GPU a copy may start earlier: the simulator is conservative there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .flat_waits import flat_waits
from .hw import HardwareModel

try:
    from .. import _C
except ImportError:  # a source tree without the built extension: the Python reference runs
    _C = None  # type: ignore[assignment]  # mypy types _C by its stub (offload/_C.pyi)

STEP_START = -1  # Copy.event of a copy issued before event 0 (a resident bucket's refresh)


@dataclass(frozen=True)
class Program:
    """What one step does, in lane terms. Copies are listed in issue order (the queue order)."""

    compute_s: tuple[float, ...]  # per event
    h2d_event: tuple[int, ...]  # per host-to-device copy: the event that issues it (STEP_START: before 0)
    h2d_bucket: tuple[int, ...]
    h2d_bytes: tuple[int, ...]
    waits: Sequence[tuple[int, ...]]  # per event: the host-to-device copies compute waits for (a tuple of
    # tuples, or the same as a FlatWaits)
    d2h_event: tuple[int, ...]  # per device-to-host copy: issuing event (len(compute_s): end of backward)
    d2h_bucket: tuple[int, ...]
    d2h_bytes: tuple[int, ...]
    adam_numel: tuple[int, ...]  # per device-to-host copy: parameters its AdamW updates afterwards
    adam_after_backward: bool = False  # True: AdamW waits for the whole backward (DeepSpeed, Gemini)
    device_adam_numel: tuple[int, ...] = ()  # per event and one more (after backward), or empty: parameters
    # a device AdamW updates there, on the compute lane (device-optimizer buckets: [Note: device AdamW lane])
    device_return_bytes: tuple[int, ...] = ()  # deferred updates: per device-optimizer bucket, the bytes of
    # its grads summed on the host that come back to the device in step() before its update there ([Note:
    # the deferred round trip])
    grad_waits: Sequence[tuple[int, ...]] = ()  # per event, or empty (none): the device-to-host copies
    # compute waits for before it (after ``waits``): [Note: waits on a reused grad slot]
    refresh_pipelined: bool = False  # True: the STEP_START copies are refreshes the runtime issues in the
    # previous step's ``step()`` as each bucket's AdamW ends ([Note: the refresh pipelined, modelled]); each
    # needs a grad copy of its bucket (its update). False: issued at the step start, after every lane is idle


# [Note: waits on a reused grad slot]
# The runtime gathers a bucket's grads in its grad slot (a plan buffer) and, before the first copy into
# it, makes compute wait for the device-to-host copy of every earlier occupant of those bytes
# (``Buffer.after``; ``runtime/grads.py``'s ``_grad_slot``). When the arena packs consecutive buckets' grad
# slots into the same bytes, backward stalls at each bucket for the previous bucket's copy to the host.
# ``Program.grad_waits`` lists, per event, those copies; the lanes wait for them after the host-to-device
# waits and count the time in ``stall_per_event``/``stall_s`` and in ``SimResult.grad_stall_s`` (never in
# ``copy_credit``: that credit ranks host-to-device copies for residency). Which copy it is:
# * a laid-out plan (``schedule.program_of``, ``simulate_plan``, the plan ``build_plan`` keeps): its
#   layout's, the grad buffers in a GRAD buffer's ``after`` (``layout.grad_slot_waits``), exactly; ``build_plan``
#   adds to each the dominating wait ([Note: dominating grad-slot waits] in schedule.py), which makes the
#   step the same for every layout of a point;
# * the greedy's candidate points, scored before any layout: a rule from the grad-slot intervals alone
#   (``intervals.grad_slot_reuse``): a slot reuses the most recently issued slot among those ended by its
#   start and not yet reused, which is what a tight packer does with equal slots.
# The wait is placed at the slot's first grad event (its interval's start), where the runtime's slow path
# takes the slot; the fast path takes it at the bucket's last grad, later: the model is conservative there.
# Host-to-device copies into bytes a grad slot held also wait for its copy on the runtime's copy stream;
# that copy-lane wait is not modelled (compute's is the one on the critical path of backward).


# [Note: the refresh pipelined, modelled]
# With overlapped updates and one GPU, the runtime's ``step()`` copies each resident bucket's new weights in as
# soon as that bucket's CPU AdamW ends, those already ended first, then waits for the lane to drain ([Note: the
# refresh pipelined] in runtime/executor.py); the next forward waits for a bucket's copy where it first uses
# it. A step's refreshes so run into the next step. For a program with ``refresh_pipelined`` (steady.py):
# * ``step()`` runs at compute end (a CUDA host thread running ahead may run it earlier: conservative); it
#   issues first the refreshes whose AdamW has ended by then, in first-use order (the first event that waits
#   for the copy, then copy index), then the others in the CPU lane's order (``GradPipeline.lane_order``: their
#   grad copies', by (event, index); a bucket's last copy is its update), the first used first where its AdamW
#   is the lane's next (``steady.issue_order``), each at max(compute end, the end of its AdamW), queued on the
#   FIFO host-to-device lane, at the duplex rate if the device-to-host lane is busy when it starts;
# * the step ends at R, when ``step()`` returns: compute ended (the device AdamW after backward included),
#   the device-to-host and CPU lanes idle, every earlier host-to-device copy done. The refreshes still in
#   flight at R are the *carry*: in issue order, per refresh, its end minus R and its duration;
# * the next step starts at R with the carry on its host-to-device lane: compute waits for a carried copy as
#   for any copy, and the step's own copies queue behind the last one;
# * step time is R of a step whose carry out equals its carry in (the order, ends to 1e-9 of the step): the
#   period of the steady state. Passes iterate to it from a guess, the carry of a step bound by the CPU AdamW
#   (only the last refresh in flight, for its solo copy time, lane order); a pass whose carry out matches its
#   carry in is the answer, else the next starts from that carry out; after ``MAX_PASSES`` the last is taken
#   (``SimResult.refresh_passes``: how many ran). The C++ lanes run the same passes, bitwise.
# A carried copy's stall belongs to the step it lands in (the same step, in the steady state) and is credited
# like any copy's within the busy period the carried copies open (``copy_credit``; the credit scan runs in the
# issue order); ``h2d_busy_s`` counts each refresh once, as issued at R's side of the step. Device-optimizer
# and streamed buckets have no refresh. Deferred updates, re-planning steps and data parallel keep the refresh
# after the drain: their programs leave ``refresh_pipelined`` False (``build_plan(deferred=True)``, the
# data-parallel modules), and so do the baselines (offload/tools/baselines.py): DeepSpeed ZeRO-Offload copies a
# param group's fp16 partition back only after that group's whole CPU step (``stage_1_and_2.py`` ``step()``:
# ``self._optimizer_step(i)``, then ``bit16_partitions[partition_id].data.copy_(fp32_partition.data)``).
# test_steady.py's hand cases: where the CPU AdamW outlasts backward, every refresh but the last hides beside
# a later update (4.4 s -> 3.8 s). Where backward outlasts it, ``step()`` finds the updates done; in the lane's
# order alone (the first layers last) the next forward waited for the whole queue (6.4 s -> 7.2 s), and the
# planner streamed those buckets (on the CPU backend's tests, pcie4 preset, 44 tests' resident plans and fast
# path went); in first-use order, for the first copy only (6.4 s stays 6.4 s). The first layer's AdamW, last,
# may not have ended at compute end: its refresh then goes first, not behind the others (7.2 s -> 6.5 s).


@dataclass(frozen=True)
class SimResult:
    step_s: float
    compute_s: float  # sum of compute over the step
    stall_s: float  # time compute waited for copies
    stall_per_event: tuple[float, ...]
    h2d_bytes: int
    d2h_bytes: int
    h2d_busy_s: float
    d2h_busy_s: float
    adam_s: float
    tail_s: float  # step end minus compute end: copies and AdamW not hidden behind compute
    copy_credit: tuple[float, ...]  # per host-to-device copy: the share of stall it caused (see simulate)
    device_adam_s: float = 0.0  # device AdamW seconds on the compute lane (included in compute_s)
    grad_stall_s: float = 0.0  # time compute waited for grad copies to the host (included in stall_s):
    # [Note: waits on a reused grad slot]
    refresh_passes: int = 0  # passes run to the steady state (0: no pipelined refresh): [Note: the refresh
    # pipelined, modelled]

    @property
    def copy_stall_s(self) -> float:
        """Time compute waited for host-to-device copies (what residency can remove)."""
        return self.stall_s - self.grad_stall_s

    def stall_by_bucket(self, program: Program) -> dict[int, float]:
        out: dict[int, float] = {}
        for b, c in zip(program.h2d_bucket, self.copy_credit):
            out[b] = out.get(b, 0.0) + c
        return out


def with_device_adam(program: Program, hw: HardwareModel) -> tuple[tuple[float, ...], float, float]:
    """The compute lane's seconds per event with the device AdamW folded in, the device AdamW seconds after
    backward (the tail), and the device AdamW's total.

    [Note: device AdamW lane] A device-optimizer bucket is updated by a fused AdamW on the compute stream,
    issued by the hook that sees its grads complete: it delays the compute after it, like any kernel, and
    overlaps with the copy lanes and the CPU. The simulator adds its seconds to the compute of the event
    where the bucket's grads complete. An update after backward (entry ``len(compute_s)``: a bucket flushed
    at the end of backward, or a policy that updates in ``step()``) runs on the compute lane after compute
    ends, beside the copies and the CPU AdamW issued then: the step lasts at least compute end + tail."""
    extra = program.device_adam_numel
    if not extra or not any(extra):
        return tuple(program.compute_s), 0.0, 0.0
    n = len(program.compute_s)
    if len(extra) != n + 1:
        raise ValueError(f"device_adam_numel has {len(extra)} entries for {n} events (needs events + 1)")
    compute = list(program.compute_s)
    total = 0.0
    for i, numel in enumerate(extra[:n]):
        if numel:
            s = hw.device_adam_seconds(numel)
            compute[i] += s
            total += s
    tail = hw.device_adam_seconds(extra[n]) if extra[n] else 0.0
    return tuple(compute), tail, total + tail


def device_return_seconds(program: Program, hw: HardwareModel) -> float:
    """Seconds of the deferred round trip's copies back to the device (see [Note: the deferred round trip]).

    [Note: the deferred round trip] With updates deferred to ``step()`` (``overlap_optimizer=False``:
    accumulation, clipping, float16) a device-optimizer bucket's grads go to the host like any bucket's
    (summed there: its grad copy stays in the program, with no CPU AdamW), and in ``step()`` come back as fp32
    sums, a piece at a time, each piece copied and then updated on the device (the runtime's
    ``DeviceOptimizer.update_summed``). The simulator runs those copies and the device AdamW (entry
    ``len(compute_s)`` of ``device_adam_numel``) one after the other after compute ends: the step lasts at
    least compute end + the copies + the device AdamW. (It does not wait for the last grad copy to land
    first, nor share the link with the host lanes' copies then: a slight under-estimate, where the copies
    back are already the larger term.)"""
    return sum(seconds_each(hw.h2d_seconds, program.device_return_bytes))


def simulate(program: Program, hw: HardwareModel) -> SimResult:
    """Run the four lanes over one step (see :func:`simulate_reference` for the rules).

    The lane loop runs in C++ (``cpp/lane_sim.cpp``: the reference's arithmetic in the same order, so the
    result is bitwise the same; tested against it); the per-copy seconds come from ``hw`` here.
    """
    if _C is None:
        return simulate_reference(program, hw)
    compute, tail, device_adam = with_device_adam(program, hw)
    back_s, back_bytes = device_return_seconds(program, hw), sum(program.device_return_bytes)
    wait_ptr, wait_copy = flat_waits(program.waits)
    grad_ptr, grad_copy = flat_waits(program.grad_waits)
    after: list[int] = []
    if program.refresh_pipelined and STEP_START in program.h2d_event:
        from .steady import refresh_after  # (steady.py builds on this module's lanes)

        if back_bytes:
            return simulate_reference(program, hw)  # (raises its ValueError)
        after = refresh_after(program)
    out = simulate_arrays(
        compute, program.h2d_event, seconds_each(hw.h2d_seconds, program.h2d_bytes), wait_ptr, wait_copy,
        program.d2h_event, seconds_each(hw.d2h_seconds, program.d2h_bytes),
        seconds_each(hw.adam_seconds, program.adam_numel),
        program.adam_after_backward, hw.duplex_factor, sum(program.h2d_bytes), sum(program.d2h_bytes), lazy=True,
        grad_wait_ptr=grad_ptr, grad_wait_copy=grad_copy, refresh_after=after, tail=tail)
    if out is None:
        return simulate_reference(program, hw)
    if isinstance(out, LaneResult):
        return out.with_device_adam(tail, device_adam, back_s, back_bytes).result()
    return out


def simulate_arrays(compute_s, h2d_event, h2d_solo, wait_ptr, wait_copy, d2h_event, d2h_solo, adam_s,
                    adam_after_backward: bool, duplex: float, h2d_bytes: int, d2h_bytes: int,
                    lazy: bool = False, grad_wait_ptr=(), grad_wait_copy=(), refresh_after=(),
                    tail: float = 0.0) -> SimResult | LaneResult | None:
    """:func:`simulate` on a program already in lane terms (numpy arrays or sequences; the scheduler keeps
    its points as arrays): per-copy seconds instead of bytes, waits as ``wait_copy[wait_ptr[i]:wait_ptr[i +
    1]]``, and the byte totals the result reports. Needs the C++ lanes (``_C``). None where a stall lands
    on a zero-length copy: the caller runs :func:`simulate_reference`, which raises its ZeroDivisionError.
    ``lazy``: a :class:`LaneResult` (the per-event and per-copy results stay arrays until ``result()``).
    ``grad_wait_*``: :attr:`Program.grad_waits` the same way (empty: none). ``refresh_after``, ``tail``: the
    pipelined refresh's (``steady.refresh_after``; the device AdamW after compute ends; empty: none)."""
    out = _C.simulate_lanes(compute_s, h2d_event, h2d_solo, wait_ptr, wait_copy, d2h_event, d2h_solo, adam_s,
                            adam_after_backward, duplex, grad_wait_ptr, grad_wait_copy, refresh_after, tail)
    if out[-1]:  # divided by zero
        return None
    step, compute, stall, h2d_busy, d2h_busy, adam, compute_end, per_event, credit, grad_stall, passes, _ = out
    lanes = LaneResult(step, compute, stall, h2d_busy, d2h_busy, adam, compute_end, per_event, credit, h2d_bytes,
                       d2h_bytes, grad_stall_s=grad_stall, refresh_passes=passes)
    return lanes if lazy else lanes.result()


@dataclass(frozen=True)
class LaneResult:
    """What the C++ lanes return, before it becomes a :class:`SimResult` (``result()``): the scheduler
    simulates ~25 points per mode and keeps one, so the other points' 10^4-long per-event stalls and
    per-copy credits never become tuples of Python floats."""

    step_s: float
    compute_s: float
    stall_s: float
    h2d_busy_s: float
    d2h_busy_s: float
    adam_s: float
    compute_end: float
    stall_per_event: np.ndarray
    copy_credit: np.ndarray
    h2d_bytes: int
    d2h_bytes: int
    device_adam_s: float = 0.0  # included in compute_s (see [Note: device AdamW lane])
    grad_stall_s: float = 0.0  # included in stall_s (see [Note: waits on a reused grad slot])
    refresh_passes: int = 0  # see SimResult

    @property
    def copy_stall_s(self) -> float:
        return self.stall_s - self.grad_stall_s

    def with_device_adam(self, tail: float, total: float, back_s: float = 0.0, back_bytes: int = 0) -> "LaneResult":
        """This result with ``tail`` seconds of device AdamW after compute end (on the compute lane,
        beside the other lanes) and ``total`` device AdamW seconds in all (the rest already in compute);
        ``back_s`` seconds (``back_bytes``) of deferred grads copied back before that tail ([Note: the
        deferred round trip])."""
        if not total and not back_s:
            return self
        return dataclasses.replace(self, step_s=max(self.compute_end + back_s + tail, self.step_s),
                                   compute_s=self.compute_s + tail, device_adam_s=total,
                                   h2d_busy_s=self.h2d_busy_s + back_s, h2d_bytes=self.h2d_bytes + back_bytes)

    def result(self) -> SimResult:
        return SimResult(
            step_s=self.step_s, compute_s=self.compute_s, stall_s=self.stall_s,
            stall_per_event=tuple(self.stall_per_event.tolist()), h2d_bytes=self.h2d_bytes,
            d2h_bytes=self.d2h_bytes, h2d_busy_s=self.h2d_busy_s, d2h_busy_s=self.d2h_busy_s, adam_s=self.adam_s,
            tail_s=self.step_s - self.compute_end, copy_credit=tuple(self.copy_credit.tolist()),
            device_adam_s=self.device_adam_s, grad_stall_s=self.grad_stall_s, refresh_passes=self.refresh_passes)


def add_up(xs) -> float:
    """The sum of ``xs`` added left to right, as the C++ lanes add (cpp/lane_sim.cpp). Python 3.12's ``sum()``
    of floats compensates its rounding, so it can differ from that in the last bit (seen on the GPU machine's
    3.12: 1.0 + 1e-05 + 1e-05), and the simulators must agree bit for bit."""
    total = 0.0
    for x in xs:
        total += x
    return total


def seconds_each(f: Callable[[int], float], xs: Sequence[int]) -> list[float]:
    """``[f(x) for x in xs]``, calling the pure ``f`` once per distinct value."""
    memo = {x: f(x) for x in set(xs)}
    return list(map(memo.__getitem__, xs))


def simulate_reference(program: Program, hw: HardwareModel, record: list | None = None) -> SimResult:
    """Run the four lanes over one step, in Python (the reference :func:`simulate` is tested against), on
    :class:`Lanes`.

    ``record``: a list that gets one ``(lane, index, start, end)`` per piece of work (lanes ``"compute"``,
    ``"stall"``: event index; ``"h2d"``, ``"d2h"``, ``"adam"``: copy index), for a timeline of the step
    (offload/tools/timeline.py). The result does not depend on it.

    A program with ``refresh_pipelined`` and refreshes runs :func:`offload.planning.steady.simulate_steady`
    ([Note: the refresh pipelined, modelled]).
    """
    if program.refresh_pipelined and STEP_START in program.h2d_event:
        from .steady import simulate_steady  # (steady.py builds on this module's lanes)

        return simulate_steady(program, hw, record)
    compute_s, device_tail, device_adam = with_device_adam(program, hw)
    lanes = Lanes(program, [hw.h2d_seconds(x) for x in program.h2d_bytes], program.d2h_bytes,
                  program.adam_numel, hw, hw, record)
    compute_end = lanes.run(compute_s)
    back_s = device_return_seconds(program, hw)
    if device_tail or back_s:  # (not recorded: a timeline's compute spans are per event)
        step = max(compute_end + back_s + device_tail, lanes.idle_at(compute_end))
    else:
        step = lanes.idle_at(compute_end)
    out = lanes.result(step, add_up(compute_s) + device_tail if device_tail else add_up(compute_s),
                       sum(program.h2d_bytes) + sum(program.device_return_bytes), sum(program.d2h_bytes),
                       device_adam)
    return dataclasses.replace(out, h2d_busy_s=out.h2d_busy_s + back_s) if back_s else out


class Lanes:
    """The lanes of one step as :func:`simulate_reference` runs them (the rules of this module's docstring),
    in the arithmetic the C++ lanes repeat in the same order (bitwise the same result). One object per
    simulated step; ``offload/planning/data_parallel.py`` extends it with a collective lane.

    Given per copy: ``h2d_solo`` (a host-to-device copy's seconds alone on the link), ``d2h_bytes`` and
    ``adam_numel`` (a device-to-host copy's bytes and the parameters its AdamW updates); ``hw`` prices the
    device-to-host copies and the duplex factor, ``cpu`` the AdamW.

    Stall attribution (``copy_credit``): when compute waits ``s`` seconds for copy ``k``, every copy of the
    host-to-device lane's current busy period up to ``k`` shares ``s`` in proportion to its duration: had
    any of them not been queued, ``k`` would have arrived that much earlier. The scheduler uses the credit
    to rank which bucket to keep on the device.
    """

    def __init__(self, program: Program, h2d_solo: Sequence[float], d2h_bytes: Sequence[int],
                 adam_numel: Sequence[int], hw: HardwareModel, cpu: HardwareModel, record: list | None):
        self.program, self.hw, self.cpu, self.record = program, hw, cpu, record
        self.h2d_solo, self.d2h_bytes, self.adam_numel = h2d_solo, d2h_bytes, adam_numel
        self.duplex = hw.duplex_factor
        n_copies = len(h2d_solo)
        self.h2d_done = [0.0] * n_copies
        self.arrival = self.h2d_done  # per copy: when compute may use its bucket (a subclass may set later)
        self.h2d_dur = [0.0] * n_copies
        self.period_of = [0] * n_copies  # first copy of the busy period each copy belongs to
        self.stall_at = [0.0] * n_copies  # per copy: stall / (busy-period duration up to it), summed
        self.cum = [0.0] * n_copies  # busy-period duration up to and including each copy
        self.h2d_free = self.d2h_free = self.cpu_free = 0.0
        self.h2d_busy = self.d2h_busy = self.adam_total = 0.0
        self.period_start, self.period_len = 0, 0.0
        self.pending_adam: list[tuple[int, float, float]] = []  # (copy, grads on host at, AdamW s), after backward
        self.d2h_done = [-1.0] * len(d2h_bytes)  # per grad copy: when it is done (-1: not issued yet)
        self.adam_end = [0.0] * len(d2h_bytes)  # per grad copy: when its AdamW ends
        self.credit_order: Sequence[int] | None = None  # the copies in lane order for the credit scan (None: index order)
        self.grad_stall = 0.0
        self.stall: list[float] = []
        self.compute_end = 0.0

    def issue_h2d(self, k: int, now: float) -> None:
        """Queue host-to-device copy ``k`` at ``now``."""
        start = max(now, self.h2d_free)
        if start > self.h2d_free or self.opens_period(k):  # the lane was idle: a new busy period
            self.period_start, self.period_len = k, 0.0
        dur = self.h2d_solo[k] / self.duplex if self.d2h_free > start else self.h2d_solo[k]
        self.h2d_free = start + dur
        self.h2d_dur[k] = dur
        self.h2d_done[k] = self.h2d_free
        self.h2d_busy += dur
        self.period_len += dur
        if self.record is not None:
            self.record.append(("h2d", k, start, self.h2d_free))
        self.period_of[k] = self.period_start
        self.cum[k] = self.period_len

    def opens_period(self, k: int) -> bool:
        """Whether copy ``k``, issued while the lane is not idle-with-a-gap, still opens a busy period: the
        step's first copy."""
        return k == 0

    def to_host(self, nbytes: int, ready: float) -> float:
        """Queue ``nbytes`` on the device-to-host lane once ``ready``; returns when the copy starts."""
        start = max(ready, self.d2h_free)
        solo = self.hw.d2h_seconds(nbytes)
        dur = solo / self.duplex if self.h2d_free > start else solo
        self.d2h_free = start + dur
        self.d2h_busy += dur
        return start

    def issue_d2h(self, k: int, now: float) -> None:
        """Queue device-to-host copy ``k`` at ``now``, and its AdamW on the CPU lane after it."""
        record = self.record
        start = self.to_host(self.d2h_bytes[k], now)
        self.d2h_done[k] = self.d2h_free
        adam = self.cpu.adam_seconds(self.adam_numel[k])
        self.adam_total += adam
        if record is not None:
            record.append(("d2h", k, start, self.d2h_free))
        if self.program.adam_after_backward:
            self.pending_adam.append((k, self.d2h_free, adam))
        else:
            self.cpu_free = self.adam_end[k] = max(self.cpu_free, self.d2h_free) + adam
            if record is not None:
                record.append(("adam", k, self.cpu_free - adam, self.cpu_free))

    def run(self, compute_s: Sequence[float]) -> float:
        """The step's events on the compute lane (``compute_s`` seconds each), the copies and AdamW they
        issue, the grads flushed after backward and the AdamW that waited for it; returns compute end."""
        program, record, arrival, stall_at, cum = self.program, self.record, self.arrival, self.stall_at, self.cum
        by_event: dict[int, list[int]] = {}
        for k, e in enumerate(program.h2d_event):
            by_event.setdefault(e, []).append(k)
        d2h_by_event: dict[int, list[int]] = {}
        for k, e in enumerate(program.d2h_event):
            d2h_by_event.setdefault(e, []).append(k)
        n = len(compute_s)
        grad_waits = program.grad_waits if len(program.grad_waits) else None
        check_grad_waits(program.grad_waits, program.d2h_event, n)
        d2h_done = self.d2h_done
        stall = self.stall = [0.0] * n
        t = 0.0
        self.start_step(by_event.get(STEP_START, ()))
        for i in range(n):
            for k in by_event.get(i, ()):
                self.issue_h2d(k, t)
            reached = t
            for k in program.waits[i]:
                done = arrival[k]
                if done > t:
                    s = done - t
                    stall[i] += s
                    stall_at[k] += s / cum[k]
                    t = done
            if grad_waits is not None:
                for k in grad_waits[i]:  # [Note: waits on a reused grad slot]
                    done = d2h_done[k]
                    if done > t:
                        s = done - t
                        stall[i] += s
                        self.grad_stall += s
                        t = done
            if record is not None:
                if t > reached:
                    record.append(("stall", i, reached, t))
                record.append(("compute", i, t, t + compute_s[i]))
            for k in d2h_by_event.get(i, ()):
                self.issue_d2h(k, t)
            t += compute_s[i]
        compute_end = self.compute_end = t
        for k in d2h_by_event.get(n, ()):
            self.issue_d2h(k, t)
        for k, ready, adam in self.pending_adam:
            self.cpu_free = self.adam_end[k] = max(self.cpu_free, ready, compute_end) + adam
            if record is not None:
                record.append(("adam", k, self.cpu_free - adam, self.cpu_free))
        return compute_end

    def start_step(self, step_start: Sequence[int]) -> None:
        """The lanes at the step's start: the ``STEP_START`` copies (refreshes) queued at 0."""
        for k in step_start:
            self.issue_h2d(k, 0.0)

    def idle_at(self, compute_end: float) -> float:
        """When every lane is idle (the step's end) after compute ends at ``compute_end``."""
        return max(compute_end, self.h2d_free, self.d2h_free, self.cpu_free)

    def result(self, step: float, compute_s: float, h2d_bytes: int, d2h_bytes: int,
               device_adam_s: float = 0.0) -> SimResult:
        """The step as a :class:`SimResult`, after :meth:`run` (``step``: its end; the rest: totals)."""
        return SimResult(
            step_s=step, compute_s=compute_s, stall_s=add_up(self.stall), stall_per_event=tuple(self.stall),
            h2d_bytes=h2d_bytes, d2h_bytes=d2h_bytes, h2d_busy_s=self.h2d_busy, d2h_busy_s=self.d2h_busy,
            adam_s=self.adam_total, tail_s=step - self.compute_end,
            copy_credit=_credit(self.h2d_dur, self.period_of, self.stall_at, self.credit_order),
            device_adam_s=device_adam_s,
            grad_stall_s=self.grad_stall)


def check_grad_waits(grad_waits: Sequence[tuple[int, ...]], d2h_event: Sequence[int], n: int) -> None:
    """Raise ValueError unless ``grad_waits`` is empty or one entry per event, each naming grad copies
    issued at an earlier event (what ``cpp/lane_sim.cpp`` checks too)."""
    if not len(grad_waits):
        return
    if len(grad_waits) != n:
        raise ValueError(f"grad_waits has {len(grad_waits)} entries for {n} events")
    for i, ks in enumerate(grad_waits):
        for k in ks:
            if not 0 <= k < len(d2h_event) or d2h_event[k] >= i:
                raise ValueError(f"event {i} waits for grad copy {k}, which is not issued before it")


def _credit(dur: Sequence[float], period_of: Sequence[int], stall_at: Sequence[float],
            order: Sequence[int] | None = None) -> tuple[float, ...]:
    """credit[j] = dur[j] * sum of stall_at[k] over later copies k of j's busy period (a reverse scan over the
    copies in lane ``order``: index order where None)."""
    seq = range(len(dur)) if order is None else order
    out = [0.0] * len(dur)
    acc = 0.0
    nxt = -1
    for j in reversed(seq):
        if nxt >= 0 and period_of[nxt] != period_of[j]:
            acc = 0.0
        acc += stall_at[j]
        out[j] = dur[j] * acc
        nxt = j
    return tuple(out)


@dataclass(frozen=True)
class Bound:
    """The physical limit of one step: no schedule of these bytes on this hardware can be faster."""

    seconds: float
    limit: str  # which part sets it: compute, h2d, d2h or cpu_adam
    parts: dict


def physical_bound(compute_s: float, h2d_bytes: int, d2h_bytes: int, adam_numel: int,
                   hw: HardwareModel) -> Bound:
    """``max(compute, H2D bytes / peak H2D, D2H bytes / peak D2H, CPU AdamW)`` for the least bytes any
    plan must move (see :func:`offload.planning.schedule.least_traffic`)."""
    parts = {"compute": compute_s, "h2d": h2d_bytes / hw.peak_h2d, "d2h": d2h_bytes / hw.peak_d2h,
             "cpu_adam": hw.adam_seconds(adam_numel)}
    limit = max(parts, key=lambda k: parts[k])
    return Bound(parts[limit], limit, parts)
