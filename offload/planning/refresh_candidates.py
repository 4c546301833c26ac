"""A candidate refresh order studied in session 24 and NOT adopted (pure): neither the runtime nor the planner
uses it. ``steady.issue_order`` stays session 23's rule; ``tests/planning/test_steady.py`` and
``benchmarks/refresh_order.py`` compare this candidate with it and with every order (small chains).

[Note: the refresh order when the lane is behind] (issue 18) The refreshes go on ONE in-order copy stream, each
after its own bucket's update: a copy queued behind one whose update has not ended waits too. Where two or more
updates are pending at ``step()`` and the bucket used first (the first layer: the lane's LAST update) is not the
lane's next, ``issue_order`` issues the ended ones in first-use order, then the pending ones in the lane's: the
first layer's copy goes last.

What the model says. The pipelined model ([Note: the refresh pipelined, modelled] in simulate.py) has the next
forward wait per event for the refreshes it uses, so its end is max over refreshes j of (C_j + the compute from
j's first use to the forward's end): minimising it is minimising the latest refresh's lateness max_j (C_j -
due_j), due_j the compute before j's first use, with release times (the update ends) and the stream's
durations, 1|r_j|L_max (NP-hard in general). On a 4-layer hand case the order before gives 3.2 s and the best
of all 24 orders 2.7 s; on an 8-layer chain on ``pcie4`` at 6 us an event the all-resident plan is 301 us with
the order before, so the greedy streams 6 of the 8 layers (240.9 us). :func:`candidate_order` keeps that
order where the first used is not among the pending ones or is the lane's next, and else compares it with each
order that keeps its first q refreshes and issues the rest in first-use order (:func:`least_late`, by the
lateness above, releases estimated pessimistically from what the runtime knows at ``step()``: each pending
update whole, after all the pending grads' copies before it). In the model: 2.7 s on the hand case (the best),
238.7 us on the chain (which stays resident); on 1,200 random all-resident chains (3-9 layers) never slower
than the order before and faster in 187 (16 %); not optimal (3.4 s against the best 3.2 s on a 5-layer chain).

Why it is not used. (1) Measured, it is not faster: ``refresh_order.py --candidate --lane-delay 1.3`` (CPU backend,
copies throttled to 1 GB/s, 8 x Linear(1024) all resident, the lane slowed 1.3 ms an item so that two or more
updates are pending at ``step()``; load 2.2-2.3, three runs,
benchmarks/results/cpu-2026-11-28/refresh_order_s24_weak_*.json): median step 117.8 / 92.2 / 94.2 ms with the
candidate against 117.0 / 92.1 / 91.9 ms with ``issue_order``, where the model predicted 83.2 / 78.2 / 78.3 against
83.2 / 87.8 / 86.4 (three earlier runs of the same candidate, files not kept, load 2.1-2.6: 95.1 / 90.0 / 96.5
against 86.4 / 88.8 / 91.0). Why is not established. What the lanes of single steps showed: the lane runs two items
a layer (weight and bias), each slowed, so the first layer's update ends later than the plan's AdamW rate says and
the candidate's stream waits for it while ready copies queue behind; the forward, the lane and both copy threads
share this VM's two vCPUs with other jobs, so a copy's length varies (4.3 to 9.5 ms in one step) and the model's
separate lanes do not hold; in some steps ``step()`` returned only as the last refresh landed, in others right
after the lane's last update. (The fast path's ``settle``, which would make the next forward wait for every
refresh, was NOT on in these runs: ``lands_at_once()`` False.) Not checked on a GPU. (2) On plans that stream, the
lateness counts the refreshes alone, not the forward's prefetches queued behind them: on ``schedule_sim``'s
gpt3-6.7b 40 GiB ``pcie4`` plan (160 refreshes, 8 updates ended at step(), 156 streamed copies) the candidate made
the model's step 1.4 ms longer (3.3797 -> 3.3810 s). So the weak case is real in the model, and the model's exact
answer is pinned in test_steady.py, but no measured gain backs changing the runtime's order; a GPU run of
``refresh_order.py --candidate --lane-delay`` is the check that would decide it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence, TypeVar

from .hw import HardwareModel
from .plan import Plan
from .simulate import STEP_START, Program, with_device_adam
from .steady import first_use, issue_order, refresh_after

T = TypeVar("T")


class Timing(NamedTuple):
    """One refresh as the plan's cost model sees it at ``step()``."""

    grad_s: float  # its bucket's grads' copy to the host, which the update waits for
    update_s: float  # its bucket's update on the CPU lane
    copy_s: float  # its copy on the link
    due_s: float  # the next forward's compute before the event that uses it first (no wait)


def candidate_order(lane: Sequence[T], ended: Callable[[T], bool], key: Callable[[T], tuple[int, int]],
                    timing: Callable[[T], Timing]) -> list[T]:
    """``steady.issue_order``'s arguments (``lane`` in the CPU lane's order, ``ended``, ``key`` the next
    forward's order of use) and the plan's costs: the order the Note's candidate issues."""
    flags = [ended(x) for x in lane]
    before = issue_order(lane, dict(zip(lane, flags)).__getitem__, key)  # ``ended`` asked once each
    done = [x for x, f in zip(lane, flags) if f]
    rest = [x for x, f in zip(lane, flags) if not f]
    first = min(lane, key=key) if lane else None
    if len(rest) < 2 or first not in rest or first == rest[0]:
        return before
    return least_late(before, len(done), [timing(x) for x in before], key)


def least_late(base: list[T], ended: int, cost: Sequence[Timing], key: Callable[[T], tuple[int, int]]) -> list[T]:
    """Of ``base`` (its first ``ended`` updates have ended, the others end in that order) and each order
    ``base[:q]`` + the rest in first-use order, the one whose latest refresh is least late for the next forward
    (the first found of equals, from ``base`` down to q = 0); O(m^2) for m refreshes."""
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


def refresh_costs(program: Program, hw: HardwareModel) -> dict[int, Timing]:
    """Per bucket a pipelined ``program`` refreshes: its :class:`Timing` in the model."""
    compute_s = with_device_adam(program, hw)[0]
    before = [0.0]
    for c in compute_s:
        before.append(before[-1] + c)
    first, out = first_use(program), {}
    refreshes = [k for k, e in enumerate(program.h2d_event) if e == STEP_START]
    for k, a in zip(refreshes, refresh_after(program)):
        out[program.h2d_bucket[k]] = Timing(hw.d2h_seconds(program.d2h_bytes[a]), hw.adam_seconds(
            program.adam_numel[a]), hw.h2d_seconds(program.h2d_bytes[k]), before[first[k]])
    return out


def in_the_model(program: Program, hw: HardwareModel) -> Callable:
    """A stand-in for ``steady.issue_order`` in the model's passes (``PipelinedLanes.finish``, whose lane items
    are (copy, grad copy)) that issues :func:`candidate_order` with ``program``'s costs."""
    cost = refresh_costs(program, hw)
    return lambda lane, ended, key: candidate_order(lane, ended, key, lambda x: cost[program.h2d_bucket[x[0]]])


def in_the_runtime(plan: Plan, hw: HardwareModel) -> Callable:
    """A stand-in for ``steady.issue_order`` in ``executor.refresh_as_updated`` (lane items are buckets) that
    issues :func:`candidate_order` with ``plan``'s costs on ``hw``."""
    from .schedule import program_of  # schedule imports steady

    cost = refresh_costs(program_of(plan, refresh_pipelined=True), hw)
    return lambda lane, ended, key: candidate_order(lane, ended, key, cost.__getitem__)
