"""Pure-Python reference of ``cpp/arena_planner``: the spec the C++ must match offset for offset.

Slow (quadratic Python) and only for checking: ``tests/planning/test_arena_planner.py`` and
``benchmarks/arena_planner.py`` compare the C++ planner against it.
"""

from __future__ import annotations

import bisect

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
