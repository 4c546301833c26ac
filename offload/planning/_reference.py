"""Pure-Python references: the specs the fast code (C++ or numpy) must match, tested against each other.

* the arena planner (``cpp/arena_planner``): :func:`plan`, :func:`lower_bound` and their pieces, slow
  (quadratic Python) and only for checking (``tests/planning/test_arena_planner.py``,
  ``benchmarks/arena_planner.py``);
* the schedule's sweeps: :func:`buffer_waits_reference` (``layout.buffer_waits``, C++ ``last_occupants``)
  and :func:`latest_issue_reference` (``arrays.latest_issue``, C++ ``latest_issue``), also the fallbacks
  where the extension is not built; :func:`grad_info_reference` (``intervals.grad_info``, numpy).

The greedy search's own reference is :meth:`offload.planning.greedy.Greedy.candidates_reference` (it is
built from the same pieces as the search and is its fallback); the lane simulator's is
:func:`offload.planning.simulate.simulate_reference`.
"""

from __future__ import annotations

import bisect
from typing import Sequence

from .buckets import Bucket
from .trace import EventKind, Trace

ORDERINGS = ("greedy_by_size", "greedy_by_breadth", "best_fit_by_lifetime")
HEURISTICS = ORDERINGS + tuple(f"{o}+size_classes" for o in ORDERINGS)  # tie order: first wins


def size_class(size: int) -> int:
    """``size`` rounded up to 8 significant bits (at most 1/128 more)."""
    quantum = 1 << max(0, size.bit_length() - 8)
    return -(-size // quantum) * quantum


def round_up(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment


def order(heuristic: str, aligned: list[int], starts: list[int], ends: list[int]) -> list[int]:
    """The order in which ordering ``heuristic`` places the buffers (ties broken by start, then index)."""
    n = len(aligned)
    if heuristic == "greedy_by_size":
        return sorted(range(n), key=lambda i: (-aligned[i], starts[i], i))
    if heuristic == "best_fit_by_lifetime":
        return sorted(range(n), key=lambda i: (-(ends[i] - starts[i]), -aligned[i], starts[i], i))
    if heuristic == "greedy_by_breadth":
        # Steps are the distinct start times; the widest step (most live bytes) is visited first, ties
        # earlier first, and a buffer is placed at the first visited step it is live at.
        steps = sorted(set(starts))
        breadth = {t: sum(a for a, s, e in zip(aligned, starts, ends) if s <= t < e) for t in steps}
        rank = {t: r for r, t in enumerate(sorted(steps, key=lambda t: (-breadth[t], t)))}
        first = [min(rank[t] for t in steps if starts[i] <= t < ends[i]) for i in range(n)]
        return sorted(range(n), key=lambda i: (first[i], -aligned[i], starts[i], i))
    raise ValueError(f"unknown heuristic {heuristic!r}")


def place(order_: list[int], aligned: list[int], starts: list[int], ends: list[int]) -> tuple[list[int], int]:
    """Each buffer in turn looks at the placed buffers live at the same time, in offset order, and takes
    the smallest gap between them that fits (ties: lowest offset); if none fits, it goes just above the
    highest of them."""
    placed: list[tuple[int, int]] = []  # (offset, index), sorted by offset
    offsets = [0] * len(aligned)
    for i in order_:
        best_offset, best_gap, prev_end = None, None, 0
        for offset, j in placed:
            if starts[j] >= ends[i] or starts[i] >= ends[j]:
                continue  # never live at the same time: may share memory
            gap = offset - prev_end
            if gap >= aligned[i] and (best_gap is None or gap < best_gap):
                best_offset, best_gap = prev_end, gap
            prev_end = max(prev_end, offset + aligned[j])
        offsets[i] = prev_end if best_offset is None else best_offset
        bisect.insort(placed, (offsets[i], i))
    total = max((o + a for o, a in zip(offsets, aligned)), default=0)
    return offsets, total


def run(heuristic: str, aligned: list[int], starts: list[int], ends: list[int]) -> tuple[list[int], int]:
    """One heuristic: its ordering and best-fit placement on the aligned sizes, or on their size classes
    (then the total still counts the aligned sizes: padding at the top is never touched)."""
    ordering, _, classes = heuristic.partition("+")
    slot = [size_class(a) for a in aligned] if classes else aligned
    offsets, _ = place(order(ordering, slot, starts, ends), slot, starts, ends)
    return offsets, max((o + a for o, a in zip(offsets, aligned)), default=0)


def plan(sizes: list[int], starts: list[int], ends: list[int], alignment: int,
         heuristic: str = "best", stop_at: int = -1) -> tuple[list[int], int, str, dict[str, int]]:
    """Same contract as ``offload._C.plan_arena``: (offsets, total, winning heuristic, totals)."""
    aligned = [round_up(s, alignment) for s in sizes]
    names = HEURISTICS if heuristic == "best" else (heuristic,)
    if heuristic == "best" and stop_at >= 0:  # the first heuristic alone where it reaches stop_at
        offsets, total = run(names[0], aligned, starts, ends)
        if total <= stop_at:
            return offsets, total, names[0], {names[0]: total}
    results = {h: run(h, aligned, starts, ends) for h in names}
    winner = min(names, key=lambda h: (results[h][1], names.index(h)))
    return results[winner][0], results[winner][1], winner, {h: r[1] for h, r in results.items()}


def lower_bound(sizes: list[int], starts: list[int], ends: list[int], alignment: int) -> int:
    """Max over event indices of the live aligned bytes (brute force over every start)."""
    aligned = [round_up(s, alignment) for s in sizes]
    return max((sum(a for a, s, e in zip(aligned, starts, ends) if s <= t < e) for t in set(starts)), default=0)


# ---------------------------------------------------------------------------------------------------------
# the schedule


def buffer_waits_reference(specs, offsets) -> list[tuple[int, ...]]:
    """For each buffer, the last earlier occupants of its memory: see [Note: waits on earlier buffers].

    One sweep over the events, keeping a map from arena byte ranges to the buffer that last released
    them (released buffers paint their range, a newly issued buffer reads the ranges under it): O(n log n)
    plus the size of the answer, which is a few buffers each rather than every earlier one.
    """
    items = []  # (event, 0 release | 1 issue, buffer)
    for k, x in enumerate(specs):
        items.append((x[3], 0, k))
        items.append((x[2], 1, k))
    items.sort()
    bounds = [0]  # segment starts, ascending; segment i is [bounds[i], bounds[i + 1]) (the last one unbounded)
    owner: list[int | None] = [None]  # the buffer that last released each segment
    out: list[tuple[int, ...]] = [()] * len(specs)

    def split(at: int) -> int:
        """Make ``at`` a segment start; return its index."""
        i = bisect.bisect_right(bounds, at) - 1
        if bounds[i] != at:
            bounds.insert(i + 1, at)
            owner.insert(i + 1, owner[i])
            i += 1
        return i

    for _, issue, k in items:
        lo = offsets[k]
        hi = lo + specs[k][4]
        if issue:
            i = bisect.bisect_right(bounds, lo) - 1
            got: set[int] = set()
            while i < len(bounds) and bounds[i] < hi:
                last = owner[i]
                if last is not None:
                    got.add(last)
                i += 1
            out[k] = tuple(sorted(got))
        else:
            i, j = split(lo), split(hi)
            bounds[i:j] = [lo]
            owner[i:j] = [k]
    return out


def latest_issue_reference(deadline: Sequence[float], duration: Sequence[float]) -> list[float]:
    """``arrays.latest_issue``: ``out[q] = min(deadline[q], out[q + 1]) - duration[q]``, backwards."""
    out = [0.0] * len(deadline)
    nxt = float("inf")
    for q in reversed(range(len(deadline))):
        nxt = min(deadline[q], nxt) - duration[q]
        out[q] = nxt
    return out


def grad_info_reference(trace: Trace, buckets: Sequence[Bucket], bucket_of: Sequence[int]):
    """:func:`offload.planning.intervals.grad_info` by a loop over the events (the reference it is tested against)."""
    n = len(trace.events)
    touched = set(trace.touched)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    got: dict[int, set[int]] = {}
    grad = EventKind.GRAD
    for i, key in [(i, ev.key) for i, ev in enumerate(trace.events) if ev.kind == grad]:
        b = bucket_of[key]
        first.setdefault(b, i)
        last[b] = i
        got.setdefault(b, set()).add(key)
    intervals, issue = {}, {}
    for b, s in first.items():
        expected = {p for run in buckets[b].runs for p in run.params if p in touched}
        # A bucket whose grads are not all seen is flushed at the end of backward: keep its slot till then.
        complete = got[b] >= expected
        intervals[b] = [s, last[b] + 1 if complete else n]
        issue[b] = last[b] if complete else n
    return intervals, issue
