"""Offline byte offsets for the device buffers a plan creates (the C++ arena planner, ``offload._C``), so the
device side is one ``torch.empty`` that never fragments. Three heuristics run and the smallest arena wins.
Pure: data in, frozen dataclass out, no ``torch.cuda``. Its Python reference is ``_reference.py``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .. import _C

__all__ = ["ARENA_HEURISTICS", "ArenaLayout", "Interval", "plan_arena", "plan_arena_columns"]

ARENA_HEURISTICS = ("greedy_by_size", "greedy_by_breadth", "best_fit_by_lifetime",
                    "greedy_by_size+size_classes", "greedy_by_breadth+size_classes",
                    "best_fit_by_lifetime+size_classes")
"""What ``plan_arena`` tries (see ``cpp/arena_planner.h``): three orderings, each with exact sizes and with
sizes rounded up to size classes; on equal arena size the first wins."""


def _require_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def _require_power_of_two(name: str, value: int) -> None:
    _require_int(name, value)
    if value <= 0 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value}")


@dataclass(frozen=True)
class Interval:
    """One device buffer the plan needs for a span of events."""

    size: int  # bytes (> 0)
    start: int  # first event index at which it is live
    end: int  # first event index at which it is no longer live (end > start)

    def __post_init__(self) -> None:
        for name in ("size", "start", "end"):
            _require_int(f"Interval.{name}", getattr(self, name))
        if self.size <= 0:
            raise ValueError(f"Interval.size must be positive, got {self.size}")
        if self.end <= self.start:
            raise ValueError(
                f"Interval.end ({self.end}) must be greater than start ({self.start}): "
                "intervals are half-open [start, end)"
            )


@dataclass(frozen=True)
class ArenaLayout:
    """Where each interval's buffer lives in one arena."""

    offsets: tuple[int, ...]  # byte offset of each interval's buffer, input order
    total_bytes: int  # arena size
    lower_bound_bytes: int  # max over time of live bytes: no layout can be smaller
    heuristic: str = "greedy_by_size"  # the ordering that produced this layout (one of ARENA_HEURISTICS)
    candidates: tuple[tuple[str, int], ...] = ()  # (heuristic, arena bytes) for every heuristic tried

    @property
    def overhead(self) -> float:
        """Arena bytes over the lower bound (1.0 is optimal; 1.0 for an empty plan)."""
        return self.total_bytes / self.lower_bound_bytes if self.lower_bound_bytes else 1.0


def plan_arena(intervals: Sequence[Interval], alignment: int = 256, heuristic: str = "best") -> ArenaLayout:
    """Offsets for ``intervals``: best fit under each of ``ARENA_HEURISTICS``, the smallest arena kept
    (``heuristic`` names one to run only that one). See ``cpp/arena_planner.h``.
    ``total_bytes`` is at least ``lower_bound_bytes``; ``overhead`` is their ratio.

    Every offset is a multiple of ``alignment`` (a power of two) and sizes are rounded up to it;
    two buffers live at the same event never overlap in memory.
    """
    _check_options(alignment, heuristic)
    for i, interval in enumerate(intervals):
        if not isinstance(interval, Interval):
            raise TypeError(f"intervals[{i}] must be an Interval, got {type(interval).__name__}")
    return _plan([iv.size for iv in intervals], [iv.start for iv in intervals], [iv.end for iv in intervals],
                 alignment, heuristic)


def plan_arena_columns(sizes: Sequence[int], starts: Sequence[int], ends: Sequence[int], alignment: int = 256,
                       heuristic: str = "best", *, stop_at_bound: bool = False) -> ArenaLayout:
    """:func:`plan_arena` for intervals given as three columns (``Interval(sizes[i], starts[i], ends[i])``),
    checked at once with numpy instead of one ``Interval`` per buffer: the same layout, the same errors
    (for the first bad interval). For planners that lay out tens of thousands of buffers.

    ``stop_at_bound`` (with ``"best"``): where the first heuristic's arena already equals the lower bound,
    the others are not run (no layout is smaller, and ties keep the earlier): the same offsets, total and
    heuristic, but ``candidates`` lists only the heuristics run."""
    _check_options(alignment, heuristic)
    cols = {}
    for name, values in (("size", sizes), ("start", starts), ("end", ends)):
        a = np.asarray(values)
        if len(a) and (a.dtype.kind not in "iu" or a.ndim != 1):  # bools, floats, objects (huge ints)
            bad = next((i for i, v in enumerate(values) if not isinstance(v, (int, np.integer)) or isinstance(v, bool)),
                       0)
            _require_int(f"Interval.{name}", values[bad])
            raise TypeError(f"Interval.{name} must be an int, got {a.dtype}")
        cols[name] = a
    if not len(cols["size"]) == len(cols["start"]) == len(cols["end"]):
        raise ValueError(f"sizes, starts and ends must have the same length, got {len(cols['size'])}, "
                         f"{len(cols['start'])} and {len(cols['end'])}")
    invalid = np.flatnonzero((cols["size"] <= 0) | (cols["end"] <= cols["start"]))
    if len(invalid):
        i = int(invalid[0])
        Interval(int(cols["size"][i]), int(cols["start"][i]), int(cols["end"][i]))  # raises its error
    # int64 columns go to the C++ planner as they are (no Python int per value); other dtypes as lists
    size, start, end = (a if a.dtype == np.int64 else a.tolist() for a in (cols["size"], cols["start"], cols["end"]))
    return _plan(size, start, end, alignment, heuristic, stop_at_bound)


def _check_options(alignment: int, heuristic: str) -> None:
    _require_power_of_two("alignment", alignment)
    if heuristic != "best" and heuristic not in ARENA_HEURISTICS:
        raise ValueError(f"heuristic must be 'best' or one of {ARENA_HEURISTICS}, got {heuristic!r}")


def _plan(sizes: Sequence[int] | np.ndarray, starts: Sequence[int] | np.ndarray, ends: Sequence[int] | np.ndarray,
          alignment: int, heuristic: str, stop_at_bound: bool = False) -> ArenaLayout:
    lower_bound = _C.arena_lower_bound(sizes, starts, ends, alignment)
    offsets, total, winner, totals = _C.plan_arena(sizes, starts, ends, alignment, heuristic,
                                                   lower_bound if stop_at_bound and heuristic == "best" else -1)
    return ArenaLayout(offsets=tuple(offsets), total_bytes=total, lower_bound_bytes=lower_bound, heuristic=winner,
                       candidates=tuple((h, totals[h]) for h in ARENA_HEURISTICS if h in totals))
