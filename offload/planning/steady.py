"""The steady state of a step whose refreshes run into the next step (pure): [Note: the refresh pipelined,
modelled] in simulate.py. The Python reference of what ``cpp/lane_sim.cpp`` does for a program with
``Program.refresh_pipelined``: the same passes, the same arithmetic in the same order (bitwise the same)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

from .hw import HardwareModel
from .simulate import STEP_START, Lanes, Program, SimResult, add_up, with_device_adam

MAX_PASSES = 16  # passes towards the steady state at most; then the last one is taken
SETTLED = 1e-9  # a carry out matches the carry in within this share of the step
T = TypeVar("T")


@dataclass(frozen=True)
class Carry:
    """The refreshes of one step as the next step sees them, in the order ``step()`` issued them (the CPU lane's
    in the first guess)."""

    order: tuple[int, ...]  # the refresh copies (host-to-device copy indices), in issue order
    after: tuple[int, ...]  # per refresh: the grad copy whose AdamW (its bucket's update) it follows
    done: tuple[float, ...]  # per refresh: when it ends, from the step's start (<= 0: landed before it)
    dur: tuple[float, ...]  # per refresh: its seconds on the link

    def settled(self, out: Carry, step: float) -> bool:
        """Whether ``out`` (a pass's carry out; this is its carry in) is the same state to ``SETTLED``: the same
        issue order, and the same ends and durations."""
        if out.order != self.order:
            return False
        tol = SETTLED * step
        for a, b, da, db in zip(self.done, out.done, self.dur, out.dur):
            a, b = max(0.0, a), max(0.0, b)
            if abs(a - b) > tol or ((a > 0.0 or b > 0.0) and abs(da - db) > tol):
                return False
        return True


def refresh_after(program: Program) -> list[int]:
    """Per ``STEP_START`` copy, in copy order: the grad copy its refresh follows, its bucket's last in the CPU
    lane's order (by (event, index)). Raises ValueError where its bucket has none (no update to follow)."""
    last: dict[int, tuple[int, int]] = {}
    for k, (e, b) in enumerate(zip(program.d2h_event, program.d2h_bucket)):
        if b not in last or (e, k) > last[b]:
            last[b] = (e, k)
    out = []
    for e, b in zip(program.h2d_event, program.h2d_bucket):
        if e != STEP_START:
            continue
        if b not in last:
            raise ValueError(f"a pipelined refresh of bucket {b}, which has no grad copy (no update to follow)")
        out.append(last[b][1])
    return out


def first_use(program: Program) -> list[int]:
    """Per host-to-device copy: the first event that waits for it (``len(compute_s)``: none does). The next
    forward's order of first use, which ``step()`` issues the refreshes of updates already ended in."""
    n = len(program.compute_s)
    first = [n] * len(program.h2d_event)
    for i, waits in enumerate(program.waits):
        for k in waits:
            if first[k] == n:
                first[k] = i
    return first


def first_carry(program: Program, h2d_solo: Sequence[float]) -> Carry:
    """The guess the passes start from: the carry of a step bound by the CPU AdamW (the last refresh in flight
    for its solo seconds, every earlier one landed)."""
    after = refresh_after(program)
    refreshes = [k for k, e in enumerate(program.h2d_event) if e == STEP_START]
    lane = sorted(range(len(after)), key=lambda j: (program.d2h_event[after[j]], after[j]))  # stable
    order = tuple(refreshes[j] for j in lane)
    dur = tuple(h2d_solo[k] for k in order)
    done = (0.0,) * (len(order) - 1) + dur[-1:]
    return Carry(order, tuple(after[j] for j in lane), done, dur)


def issue_order(lane: Sequence[T], ended: Callable[[T], bool], key: Callable[[T], tuple[int, int]]) -> list[T]:
    """The order ``step()`` issues refreshes in, the runtime's (``runtime/executor.py``) and the model's: ``lane``
    in the CPU lane's order, ``ended(x)`` whether x's update has ended (asked once each), ``key`` the order the
    next forward uses them in (distinct keys). Those ended in that order, then the others in the lane's; but
    where the first used is the lane's next update (the first not ended) it goes first, the ended ones after it:
    queued ahead they would delay it, and the forward needs them later ([Note: the refresh pipelined])."""
    flags = [ended(x) for x in lane]
    done = sorted((x for x, f in zip(lane, flags) if f), key=key)
    rest = [x for x, f in zip(lane, flags) if not f]
    if done and rest and min(lane, key=key) == rest[0]:
        return rest[:1] + done + rest[1:]
    return done + rest


class PipelinedLanes(Lanes):
    """The lanes of one step that starts with ``carry`` on its host-to-device lane and ends issuing its own
    refreshes (:meth:`finish`)."""

    def __init__(self, program: Program, h2d_solo: Sequence[float], hw: HardwareModel, record: list | None,
                 carry: Carry):
        super().__init__(program, h2d_solo, program.d2h_bytes, program.adam_numel, hw, hw, record)
        self.carry = carry
        self.fresh = True  # no copy on the lane yet: the first one issued opens a busy period
        refreshes = set(carry.order)
        self.credit_order = list(carry.order) + [k for k in range(len(h2d_solo)) if k not in refreshes]
        # the refreshes in the CPU lane's order (that of their updates: (event, index) of the grad copy; then
        # copy order, as first_carry's stable sort)
        self.lane = sorted(zip(carry.order, carry.after), key=lambda x: (program.d2h_event[x[1]], x[1], x[0]))
        self.first_use = first_use(program)

    def start_step(self, step_start: Sequence[int]) -> None:
        """The carried refreshes, instead of ``STEP_START`` copies at 0: landed ones are no wait; those in
        flight keep the lane busy and open its first busy period."""
        c = self.carry
        for k, done, dur in zip(c.order, c.done, c.dur):
            self.h2d_done[k], self.h2d_dur[k] = done, dur
            if done > 0.0:
                if self.fresh:
                    self.period_start, self.period_len, self.fresh = k, 0.0, False
                self.period_len += dur
                self.h2d_free = done
                self.period_of[k], self.cum[k] = self.period_start, self.period_len
            else:
                self.period_of[k], self.cum[k] = k, dur

    def opens_period(self, k: int) -> bool:
        return self.fresh

    def issue_h2d(self, k: int, now: float) -> None:
        super().issue_h2d(k, now)
        self.fresh = False

    def finish(self, compute_end: float, tail: float) -> tuple[float, Carry]:
        """After :meth:`run`: the step's end (``step()`` returns) and its refreshes issued, as the carry out.
        ``tail``: device AdamW seconds on the compute lane after compute ends."""
        step = max(compute_end + tail, self.h2d_free, self.d2h_free, self.cpu_free)
        solo, record, adam_end, first = self.h2d_solo, self.record, self.adam_end, self.first_use
        # step() at compute end: [Note: the refresh pipelined, modelled]
        issue = issue_order(self.lane, lambda x: adam_end[x[1]] <= compute_end, lambda x: (first[x[0]], x[0]))
        done, dur = [], []
        for k, a in issue:
            start = max(compute_end, self.adam_end[a], self.h2d_free)
            d = solo[k] / self.duplex if self.d2h_free > start else solo[k]
            self.h2d_free = start + d
            self.h2d_busy += d
            if record is not None:
                record.append(("h2d", k, start, self.h2d_free))
            done.append(self.h2d_free - step)
            dur.append(d)
        return step, Carry(tuple(k for k, _ in issue), tuple(a for _, a in issue), tuple(done), tuple(dur))


def simulate_steady(program: Program, hw: HardwareModel, record: list | None = None) -> SimResult:
    """:func:`~offload.planning.simulate.simulate_reference` of a program whose refreshes are pipelined: the
    passes of [Note: the refresh pipelined, modelled] (``record``: the last pass's pieces of work)."""
    return steady_state(program, hw, record)[0]


def steady_state(program: Program, hw: HardwareModel, record: list | None = None) -> tuple[SimResult, Carry]:
    """:func:`simulate_steady`, and the last pass's carry out: the refreshes its ``step()`` issues, in order."""
    if program.device_return_bytes:
        raise ValueError("a pipelined refresh with deferred updates (device_return_bytes): the runtime refreshes "
                         "after the drain there")
    compute_s, tail, device_adam = with_device_adam(program, hw)
    h2d_solo = [hw.h2d_seconds(x) for x in program.h2d_bytes]
    carry = first_carry(program, h2d_solo)
    for passes in range(1, MAX_PASSES + 1):
        rec: list | None = [] if record is not None else None
        lanes = PipelinedLanes(program, h2d_solo, hw, rec, carry)
        compute_end = lanes.run(compute_s)
        step, out = lanes.finish(compute_end, tail)
        if carry.settled(out, step):
            break
        carry = out
    if record is not None and rec is not None:
        record.extend(rec)
    result = lanes.result(step, add_up(compute_s) + tail if tail else add_up(compute_s), sum(program.h2d_bytes),
                          sum(program.d2h_bytes), device_adam)
    return dataclasses.replace(result, refresh_passes=passes), out
