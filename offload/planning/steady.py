"""The steady state of a step whose refreshes run into the next step (pure): [Note: the refresh pipelined,
modelled] in simulate.py. The Python reference of what ``cpp/lane_sim.cpp`` does for a program with
``Program.refresh_pipelined``: the same passes, the same arithmetic in the same order (bitwise the same).

[Note: the refresh order when the lane is behind] (issue 18, session 24) The refreshes go on ONE in-order copy
stream, each after its own bucket's update: a copy queued behind one whose update has not ended waits too. The
next forward runs its events in order, so it ends at max over refreshes j of (C_j + the compute from j's first
use to the forward's end): minimising it is minimising the latest refresh's lateness max_j (C_j - due_j), due_j
the compute before j's first use, with release times (update ends) and the stream's durations: 1|r_j|L_max,
NP-hard in general. Where two or more updates are pending at step() and the bucket used first (the first layer:
the lane's LAST update) is not the lane's next, the order before session 24 (the ended ones in first-use order,
then the pending ones in the lane's) copied the first layer last, and the next forward's first event waited for
every copy (test_steady.py's hand case: 3.2 s against the 2.7 s of the best order, found by trying all 24).
Putting it first idles the stream until its update ends and delays every other copy: worse where updates are
long (the CPU AdamW the wall). So there ``issue_order`` takes the costs of the plan's model (:class:`Timing`)
and ``least_late`` compares that order with each order that keeps its first q refreshes and issues the rest in
first-use order, q = m-1 .. 0, by the lateness above, and keeps the least late (the order before where none is
less late). Releases are estimated pessimistically from what the runtime knows at ``step()`` (which updates
ended; the model computes the same from its own ``ended``): each pending update whole, after all the pending
grads' copies before it. Only where the plan streams nothing (every copy a refresh): the lateness counts the
refreshes alone, not the forward's prefetches queued behind them on the same stream, and on a plan that streams
(schedule_sim's gpt3-6.7b, 40 GiB, pcie4: 160 refreshes, 8 updates ended at step(), 156 streamed copies) the
order it chose made the model's step 1.4 ms longer (3.3797 -> 3.3810 s). Not optimal (the brute force finds
orders outside that family: 3.2 against 3.4 s on a 5-layer case), but on 1,200 random all-resident chains (3-9
layers, test_steady.py's shapes) never slower in the model than the order before, and faster in 187 (16 %); it
only runs in that case, in O(m^2) for m refreshes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence, TypeVar

from .hw import HardwareModel
from .plan import Plan
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


class Timing(NamedTuple):
    """One refresh as the plan's cost model sees it at ``step()`` ([Note: the refresh order when the lane is
    behind])."""

    grad_s: float  # its bucket's grads' copy to the host, which the update waits for
    update_s: float  # its bucket's update on the CPU lane
    copy_s: float  # its copy on the link
    due_s: float  # the next forward's compute before the event that uses it first (no wait)


def issue_order(lane: Sequence[T], ended: Callable[[T], bool], key: Callable[[T], tuple[int, int]],
                timing: Callable[[T], Timing | None] | None = None) -> list[T]:
    """The order ``step()`` issues refreshes in, the runtime's (``runtime/executor.py``) and the model's: ``lane``
    in the CPU lane's order, ``ended(x)`` whether x's update has ended (asked once each), ``key`` the order the
    next forward uses them in (distinct keys). Those ended in that order, then the others in the lane's; but
    where the first used is the lane's next update (the first not ended) it goes first, the ended ones after it:
    queued ahead they would delay it, and the forward needs them later ([Note: the refresh pipelined]). Where
    it is a later one (two or more pending), ``timing`` (the plan's costs) chooses ([Note: the refresh order
    when the lane is behind])."""
    flags = [ended(x) for x in lane]
    done = sorted((x for x, f in zip(lane, flags) if f), key=key)
    rest = [x for x, f in zip(lane, flags) if not f]
    first = min(lane, key=key) if lane else None
    if done and rest and first == rest[0]:
        return rest[:1] + done + rest[1:]
    if timing is None or len(rest) < 2 or first == rest[0] or first not in rest:
        return done + rest
    cost = [timing(x) for x in done + rest]
    return done + rest if None in cost else least_late(done + rest, len(done), cost, key)  # type: ignore[arg-type]


def least_late(base: list[T], ended: int, cost: Sequence[Timing], key: Callable[[T], tuple[int, int]]) -> list[T]:
    """[Note: the refresh order when the lane is behind]: of ``base`` (the order above: its first ``ended``
    updates have ended, the others end in that order) and each order ``base[:q]`` + the rest in first-use
    order, the one whose latest refresh is least late for the next forward (the first found of equals, from
    ``base`` down to q = 0)."""
    m = len(base)
    release, t, grads = [0.0] * m, 0.0, 0.0
    for i in range(ended, m):  # pessimistic: every pending update whole, after its grads, all yet to copy
        grads += cost[i].grad_s
        t = max(t, grads) + cost[i].update_s
        release[i] = t
    used = sorted(range(m), key=lambda i: key(base[i]))

    def lateness(order: Sequence[int]) -> float:
        t, worst = 0.0, float("-inf")
        for i in order:
            t = max(t, release[i]) + cost[i].copy_s
            worst = max(worst, t - cost[i].due_s)
        return worst

    best, least = list(range(m)), lateness(range(m))
    taken = [True] * m  # base[:q] for the q below
    for q in range(m - 1, -1, -1):
        taken[q] = False
        order = list(range(q)) + [i for i in used if not taken[i]]
        late = lateness(order)
        if late < least:
            best, least = order, late
    return [base[i] for i in best]


def refresh_costs(program: Program, hw: HardwareModel) -> dict[int, tuple[int, Timing]]:
    """Per bucket a pipelined ``program`` refreshes: its first use (event) and its :class:`Timing`, as
    :meth:`PipelinedLanes.finish` gives them to :func:`issue_order` (the runtime's, from its plan); none where it
    streams a copy (those get no costs: the order before session 24)."""
    compute_s = with_device_adam(program, hw)[0]
    before = [0.0]
    for c in compute_s:
        before.append(before[-1] + c)
    first, out = first_use(program), {}
    refreshes = [k for k, e in enumerate(program.h2d_event) if e == STEP_START]
    if len(refreshes) < len(program.h2d_event):  # [Note: the refresh order when the lane is behind]: all resident
        return {}
    for k, a in zip(refreshes, refresh_after(program)):
        out[program.h2d_bucket[k]] = (first[k], Timing(hw.d2h_seconds(program.d2h_bytes[a]), hw.adam_seconds(
            program.adam_numel[a]), hw.h2d_seconds(program.h2d_bytes[k]), before[first[k]]))
    return out


def plan_costs(plan: Plan | None, hw: HardwareModel | None) -> dict[int, tuple[int, Timing]]:
    """:func:`refresh_costs` of ``plan``'s pipelined program on the hardware model it was planned with (``hw``;
    None: the planner's default), as the runtime asks (none where it has no plan)."""
    from .schedule import DEFAULT_HW, program_of  # schedule imports this module

    try:
        return refresh_costs(program_of(plan, refresh_pipelined=True), hw or DEFAULT_HW) if plan else {}
    except ValueError:  # a refreshed bucket with no update to follow (refresh_after): today's order
        return {}


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

    def run(self, compute_s: Sequence[float]) -> float:
        self.before = [0.0]  # per event: the compute before it (its due for a refresh it is the first use of)
        for c in compute_s:
            self.before.append(self.before[-1] + c)
        return super().run(compute_s)

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
        adam, d2h, before = self.cpu.adam_seconds, self.hw.d2h_seconds, self.before
        timing = None if len(self.lane) < len(solo) else (  # streamed copies too: no costs (see refresh_costs)
            lambda x: Timing(d2h(self.d2h_bytes[x[1]]), adam(self.adam_numel[x[1]]), solo[x[0]], before[first[x[0]]]))
        issue = issue_order(self.lane, lambda x: adam_end[x[1]] <= compute_end, lambda x: (first[x[0]], x[0]), timing)
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
