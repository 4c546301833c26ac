"""Other engines' placement rules, expressed on the same simulator, for an honest comparison (pure).

Each policy turns (trace, buckets, hardware, compute times) into a lane :class:`~offload.planning.simulate.Program`
and a device peak. They model the *rules* of each system at its default settings, on this engine's trace
and buckets; they are not measurements of those systems. What each one simplifies is in its docstring.

* ``zero-offload``: DeepSpeed ZeRO-Offload. Every low-precision parameter on the device; grads go to the
  host during backward; CPU Adam runs after backward; all updated parameters are copied back before the
  next forward.
* ``zero3-offload``: DeepSpeed ZeRO-3 with ``offload_param`` and ``offload_optimizer`` on one GPU.
  Parameters are fetched one by one just in time, prefetching the next ``stage3_prefetch_bucket_size``
  (5e7) elements of the trace; parameters under ``stage3_param_persistence_threshold`` (1e5 elements) stay
  on the device; each is released after use; CPU Adam after backward.
* ``gemini-cpu``: ColossalAI Gemini with host placement: chunks (here: this engine's buckets) are fetched
  synchronously when needed and evicted, when the budget is full, by the farthest next use (OPT); CPU Adam
  after backward; every updated chunk is fetched again next step.
* ``twin-flow``: DeepSpeed ZeRO-Offload++ Twin-Flow (``offload_optimizer.ratio``): ZeRO-Offload with a fixed
  share of the optimizer (fp32 master, m, v) kept and updated on the GPU, the rest on the host. Users tune
  the ratio, so the policy is the best of a sweep (see :func:`twin_flow`).
* ``double-buffer``: MegaTrain-style one-layer double buffering: everything streamed, each bucket's copy
  issued when the previous bucket starts being used, CPU Adam overlapped with backward as here.
* ``greedy``: this engine's scheduler (:func:`offload.planning.schedule.build_plan`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..errors import BudgetTooSmallError
from ..planning.arena import Interval, plan_arena
from ..planning.buckets import Bucket, ParamSpec, locate, make_buckets
from ..planning.hw import HardwareModel
from ..planning.greedy_inputs import grad_waits
from ..planning.intervals import grad_arrays, grad_intervals, grad_issue, grad_slot_reuse, need_intervals, with_prefetch
from ..planning.placement import state_nbytes
from ..planning.plan import ARENA_ALIGN, align
from ..planning.schedule import build_plan
from ..planning.flat_waits import FlatWaits
from ..planning.simulate import STEP_START, Program, SimResult, simulate
from ..planning.trace import Trace

ZERO3_PREFETCH_NUMEL = 50_000_000  # stage3_prefetch_bucket_size default
ZERO3_PERSISTENCE_NUMEL = 100_000  # stage3_param_persistence_threshold default


@dataclass(frozen=True)
class Case:
    """One model step on one machine under one budget."""

    trace: Trace
    buckets: tuple[Bucket, ...]
    itemsize: int
    hw: HardwareModel
    compute_s: tuple[float, ...]
    budget_bytes: int
    fixed_bytes: int = 0

    @property
    def extra(self) -> int:
        """Device bytes outside the parameter arena: activations, module buffers, the largest grad."""
        return self.trace.activation_peak_bytes + self.fixed_bytes + self.trace.max_grad_bytes


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    sim: SimResult | None  # None when the policy cannot run at all in this budget
    peak_bytes: int
    fits: bool  # peak_bytes <= budget
    ratio: float | None = None  # twin-flow: the GPU share of the optimizer it settled on
    plan: Any = None  # greedy: its Plan

    @property
    def step_s(self) -> float | None:
        return self.sim.step_s if self.sim is not None else None


def _param_specs(buckets: Sequence[Bucket]) -> tuple[list[ParamSpec], list[int]]:
    """Per parameter (numel, group), and the parameters in bucket (first-use) order."""
    n = sum(len(b.params) for b in buckets)
    specs: list[ParamSpec | None] = [None] * n
    order = []
    for b in buckets:
        group = {p: run.group for run in b.runs for p in run.params}
        ends = list(b.offsets[1:]) + [b.numel]
        for p, off, end in zip(b.params, b.offsets, ends):
            specs[p] = ParamSpec(end - off, group.get(p))
            order.append(p)
    return specs, order


def _lanes(case: Case, units: Sequence[Bucket], streamed: dict[int, list], resident: Sequence[int],
           refresh: set[int], adam_after_backward: bool, on_device: frozenset = frozenset()) -> Program:
    """A program whose copies are per ``unit`` (buckets of some packing of the same parameters) and whose
    grads go to the host per bucket of ``case.buckets`` at this engine's points, except the buckets
    ``on_device``: their optimizer runs on the device after backward (no grad copy, no CPU AdamW; their
    units are not in ``refresh``)."""
    trace = case.trace
    n = len(trace.events)
    unit_of = locate(units)[0]
    events, owners, nbytes = [], [], []
    copy_of: dict[int, list[tuple[int, int, int]]] = {}
    for u in sorted(resident):
        if u in refresh:
            copy_of[u] = [(0, n, len(events))]
            events.append(STEP_START), owners.append(u), nbytes.append(units[u].nbytes(case.itemsize))
    for p, u, e in sorted((p, u, e) for u, ivs in streamed.items() for p, e in ivs):
        copy_of.setdefault(u, []).append((p, e, len(events)))
        events.append(p), owners.append(u), nbytes.append(units[u].nbytes(case.itemsize))
    waits = []
    for i in range(n):
        w = []
        for u in dict.fromkeys(unit_of[p] for p in trace.uses[i]):
            for s, e, k in copy_of.get(u, ()):
                if s <= i < e:
                    w.append(k)
                    break
        waits.append(tuple(w))
    bucket_of = locate(case.buckets)[0]
    issue = grad_issue(trace, case.buckets, bucket_of)
    d2h = sorted((e, b) for b, e in issue.items() if b not in on_device)
    device_adam = ()
    if on_device:
        device_adam = (0,) * n + (sum(case.buckets[b].trainable_numel for b in on_device),)
    return Program(
        compute_s=case.compute_s, h2d_event=tuple(events), h2d_bucket=tuple(owners), h2d_bytes=tuple(nbytes),
        waits=tuple(waits), grad_waits=_grad_waits(case, [b for _, b in d2h]),
        d2h_event=tuple(e for e, _ in d2h), d2h_bucket=tuple(b for _, b in d2h),
        d2h_bytes=tuple(case.buckets[b].grad_nbytes(case.itemsize) for _, b in d2h),
        adam_numel=tuple(case.buckets[b].trainable_numel for _, b in d2h), adam_after_backward=adam_after_backward,
        device_adam_numel=device_adam)


def _grad_waits(case: Case, d2h_bucket: Sequence[int]) -> FlatWaits | tuple:
    """Compute's waits on reused grad slots ([Note: waits on a reused grad slot] in planning/simulate.py): the
    grad slots are this engine's, packed as ``_peak`` packs them (single-buffered), so the greedy's rule."""
    n = len(case.trace.events)
    b, start, end, issue = grad_arrays(case.trace, case.buckets, locate(case.buckets)[0])
    reuse = grad_slot_reuse(start, end, issue)
    ptr, copies = grad_waits(start[reuse >= 0], b[reuse[reuse >= 0]], d2h_bucket, n)
    return FlatWaits(ptr.tolist(), copies.tolist()) if len(ptr) else ()


def _peak(case: Case, units, streamed, resident, grads_too: bool = True) -> int:
    """Device peak: the arena this engine's planner would lay these buffers out in, plus activations,
    module buffers and the largest grad in flight."""
    n = len(case.trace.events)
    ivs = [Interval(units[u].nbytes(case.itemsize), 0, n) for u in resident if units[u].numel]
    ivs += [Interval(units[u].nbytes(case.itemsize), p, e) for u, spans in streamed.items() for p, e in spans
            if units[u].numel]
    if grads_too:
        for b, (s, e) in grad_intervals(case.trace, case.buckets, locate(case.buckets)[0]).items():
            if case.buckets[b].trainable_numel:
                ivs.append(Interval(case.buckets[b].grad_nbytes(case.itemsize), s, e))
    return plan_arena(ivs, alignment=ARENA_ALIGN).total_bytes + case.extra


def _result(name: str, case: Case, program: Program, peak: int) -> PolicyResult:
    return PolicyResult(name, simulate(program, case.hw), peak, peak <= case.budget_bytes)


def _updated(case: Case, units: Sequence[Bucket]) -> set[int]:
    """Units holding a parameter that gets a gradient this step (their weights change at the update)."""
    unit_of = locate(units)[0]
    got = {ev.key for ev in case.trace.events if ev.kind.name == "GRAD"}
    return {unit_of[p] for p in got}


# ---------------------------------------------------------------------------------------------------------
# the policies


def zero_offload(case: Case) -> PolicyResult:
    """All low-precision parameters resident; the updated ones copied back before the next forward. Grad
    buffers are modelled as this engine's grad slots (smaller than DeepSpeed's 5e8-element reduce bucket)."""
    units = case.buckets
    resident = range(len(units))
    program = _lanes(case, units, {}, resident, _updated(case, units), adam_after_backward=True)
    return _result("zero-offload", case, program, _peak(case, units, {}, resident))


TWIN_FLOW_RATIOS = tuple(k / 20 for k in range(21))  # the sweep: GPU share of the optimizer, 0 to 1 by 0.05


def twin_flow(case: Case, ratios: Sequence[float] = TWIN_FLOW_RATIOS) -> PolicyResult:
    """ZeRO-Offload (:func:`zero_offload`) with the optimizer of a ``ratio`` share of the trainable
    parameters on the GPU: those buckets keep fp32 master, m and v on the device (their state bytes, as
    this engine counts them, :func:`offload.planning.placement.state_nbytes`), send no grads to the host,
    get no CPU AdamW and no copy back; their update runs on the GPU after backward, beside the CPU AdamW
    of the rest (DeepSpeed's ``step()``). The share is whole buckets, taken from the first layers or from
    the last ones (both tried: which sub-groups DeepSpeed keeps is not modelled, so the better side is
    taken). The result is the fastest (ratio, side) that fits the budget, or ratio 0 (ZeRO-Offload, not
    fitting) where none fits."""
    units = case.buckets
    resident = range(len(units))
    updated = _updated(case, units)
    base_peak = _peak(case, units, {}, resident)
    trainable = [b for b in range(len(units)) if b in updated and units[b].trainable_numel]
    total = sum(units[b].trainable_numel for b in trainable)
    best: PolicyResult | None = None
    fallback: PolicyResult | None = None
    tried: set[frozenset] = set()
    for ratio in (0.0, *ratios):  # ratio 0 (ZeRO-Offload) always: the answer where no ratio fits
        for order in (trainable, trainable[::-1]):
            share, numel = [], 0
            for b in order:
                if numel >= ratio * total:
                    break
                share.append(b)
                numel += units[b].trainable_numel
            on_device = frozenset(share)
            if on_device in tried:
                continue
            tried.add(on_device)
            peak = base_peak + sum(align(state_nbytes(units[b], case.itemsize)) for b in on_device)
            program = _lanes(case, units, {}, resident, updated - on_device, adam_after_backward=True,
                             on_device=on_device)
            r = PolicyResult("twin-flow", simulate(program, case.hw), peak, peak <= case.budget_bytes,
                             ratio=numel / total if total else 0.0)
            if not on_device:
                fallback = r
            if (r.fits and (ratio in ratios or not on_device)
                    and (best is None or r.step_s < best.step_s)):
                best = r
    return best if best is not None else fallback


def zero3_offload(case: Case) -> PolicyResult:
    """Per-parameter fetch just in time with a 5e7-element prefetch window and the 1e5-element persistence
    threshold (DeepSpeed defaults); each parameter released after each use."""
    specs, order = _param_specs(case.buckets)
    units = make_buckets(specs, order, bucket_bytes=1, itemsize=case.itemsize)  # one parameter per unit
    unit_of = locate(units)[0]
    persistent = [u for u in range(len(units)) if units[u].numel <= ZERO3_PERSISTENCE_NUMEL]
    pset = set(persistent)
    needs = {u: ivs for u, ivs in need_intervals(case.trace, unit_of, merge_phase=False).items() if u not in pset}
    fetches = sorted((s, u, k) for u, ivs in needs.items() for k, (s, _) in enumerate(ivs))
    streamed: dict[int, list] = {u: [] for u in needs}
    window, lo = 0, 0
    for j, (s, u, k) in enumerate(fetches):  # issued when the fetch 5e7 elements earlier begins its use
        window += units[u].numel
        while window > ZERO3_PREFETCH_NUMEL and lo < j:
            window -= units[fetches[lo][1]].numel
            lo += 1
        issue = fetches[lo][0]
        ivs = streamed[u]
        end = needs[u][k][1]
        if ivs and issue <= ivs[-1][1]:
            ivs[-1][1] = end
        else:
            ivs.append([issue, end])
    program = _lanes(case, units, streamed, persistent, _updated(case, units) & pset, adam_after_backward=True)
    return _result("zero3-offload", case, program, _peak(case, units, streamed, persistent))


def gemini_cpu(case: Case) -> PolicyResult:
    """Synchronous fetch at first need; when the budget is full, evict the chunk whose next use is farthest
    (OPT). Chunks start every step on the host (their masters were updated there)."""
    units = case.buckets
    bucket_of = locate(units)[0]
    n = len(case.trace.events)
    needs = need_intervals(case.trace, bucket_of, merge_phase=False)
    starts = {u: [s for s, _ in ivs] for u, ivs in needs.items()}
    size = [align(u.nbytes(case.itemsize)) for u in units]
    capacity = case.budget_bytes - case.extra
    on: dict[int, int] = {}  # chunk -> event it arrived
    used = 0
    streamed: dict[int, list] = {}
    for i in range(n):
        want = list(dict.fromkeys(bucket_of[p] for p in case.trace.uses[i]))
        for u in want:
            if u in on:
                continue
            while used + size[u] > capacity:
                victims = [v for v in on if v not in want]
                if not victims:
                    break  # over the budget: Gemini would fail here; the peak says so
                v = max(victims, key=lambda v: _next_use(starts[v], i))
                streamed.setdefault(v, []).append([on.pop(v), i])
                used -= size[v]
            on[u] = i
            used += size[u]
    for v, s in on.items():
        streamed.setdefault(v, []).append([s, n])
    program = _lanes(case, units, streamed, (), set(), adam_after_backward=True)
    return _result("gemini-cpu", case, program, _peak(case, units, streamed, (), grads_too=False))


def _next_use(starts: list[int], i: int) -> int:
    k = bisect.bisect_right(starts, i)
    return starts[k] if k < len(starts) else 1 << 60


def double_buffer(case: Case) -> PolicyResult:
    """Everything streamed, each copy issued when the previous bucket's use begins."""
    units = case.buckets
    needs = with_prefetch(need_intervals(case.trace, locate(units)[0], merge_phase=False), lookahead=True)
    program = _lanes(case, units, needs, (), set(), adam_after_backward=False)
    return _result("double-buffer", case, program, _peak(case, units, needs, ()))


def greedy(case: Case, device_optimizer: bool = True) -> PolicyResult:
    """This engine's planner, with device optimizer state allowed (issue 18; the runtime cannot execute
    such plans yet: ``device_optimizer=False`` is what it runs today)."""
    try:
        plan = build_plan(case.trace, case.buckets, itemsize=case.itemsize, budget_bytes=case.budget_bytes,
                          fixed_bytes=case.fixed_bytes, hw=case.hw, compute_s=case.compute_s,
                          device_optimizer=device_optimizer)
    except BudgetTooSmallError as e:
        return PolicyResult("greedy", None, e.min_budget_bytes, False)
    return PolicyResult("greedy", plan.simulated, plan.peak_bytes, True, plan=plan)


POLICIES: dict[str, Callable[[Case], PolicyResult]] = {
    "greedy": greedy, "zero-offload": zero_offload, "twin-flow": twin_flow, "zero3-offload": zero3_offload,
    "gemini-cpu": gemini_cpu, "double-buffer": double_buffer,
}
