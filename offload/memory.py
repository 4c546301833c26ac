"""The Python face of the C++ memory core (``offload._C``).

Two things live here:

* ``plan_arena``: offline byte offsets for the device buffers a plan creates, so the device side
  is one ``torch.empty`` that never fragments. Three heuristics run and the smallest arena wins.
  Pure: data in, frozen dataclass out, no ``torch.cuda``.
* ``HostArena``: one exact-size host region (mmap'd, 2 MiB-aligned, first-touched) with typed
  tensor views. Pinning it (``cudaHostRegister``) is the CUDA backend's job, not this module's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from offload import _C

__all__ = ["ARENA_HEURISTICS", "ArenaLayout", "HostArena", "Interval", "numa_node_of_pci_device", "plan_arena",
           "plan_arena_columns"]

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
    bad = np.flatnonzero((cols["size"] <= 0) | (cols["end"] <= cols["start"]))
    if len(bad):
        i = int(bad[0])
        Interval(int(cols["size"][i]), int(cols["start"][i]), int(cols["end"][i]))  # raises its error
    # int64 columns go to the C++ planner as they are (no Python int per value); other dtypes as lists
    sizes, starts, ends = (a if a.dtype == np.int64 else a.tolist() for a in (cols["size"], cols["start"], cols["end"]))
    return _plan(sizes, starts, ends, alignment, heuristic, stop_at_bound)


def _check_options(alignment: int, heuristic: str) -> None:
    _require_power_of_two("alignment", alignment)
    if heuristic != "best" and heuristic not in ARENA_HEURISTICS:
        raise ValueError(f"heuristic must be 'best' or one of {ARENA_HEURISTICS}, got {heuristic!r}")


def _plan(sizes: Sequence[int], starts: Sequence[int], ends: Sequence[int], alignment: int, heuristic: str,
          stop_at_bound: bool = False) -> ArenaLayout:
    lower_bound = _C.arena_lower_bound(sizes, starts, ends, alignment)
    offsets, total, winner, totals = _C.plan_arena(sizes, starts, ends, alignment, heuristic,
                                                   lower_bound if stop_at_bound and heuristic == "best" else -1)
    return ArenaLayout(offsets=tuple(offsets), total_bytes=total, lower_bound_bytes=lower_bound, heuristic=winner,
                       candidates=tuple((h, totals[h]) for h in ARENA_HEURISTICS if h in totals))


class HostArena:
    """Exact-size host region (C++ PinnedArena) with typed tensor views.

    ``touch_threads`` threads back its pages at construction (0: one per core); ``numa_node`` runs them
    on that node's CPUs so the pages land there (for a GPU, its node: ``numa_node_of_pci_device``);
    ``populate`` backs each thread's range with one ``madvise(MADV_POPULATE_WRITE)`` instead of a write
    per page, where the kernel has it (``touch_method`` says which happened). Off by default: no
    consistent gain where measured (see ``cpp/pinned_arena.h``).
    """

    def __init__(self, size_bytes: int, touch_threads: int = 0, numa_node: int | None = None,
                 populate: bool = False) -> None:
        _require_int("size_bytes", size_bytes)
        _require_int("touch_threads", touch_threads)
        if size_bytes < 0 or touch_threads < 0:
            raise ValueError(
                f"size_bytes and touch_threads must be >= 0, got {size_bytes} and {touch_threads}"
            )
        if numa_node is not None:
            _require_int("numa_node", numa_node)
            if numa_node < 0:
                raise ValueError(f"numa_node must be >= 0 or None, got {numa_node}")
        self._arena = _C.PinnedArena(size_bytes, touch_threads, -1 if numa_node is None else numa_node,
                                     bool(populate))
        # Made once. frombuffer holds a reference to the C++ arena, so views outlive this object
        # safely; it rejects empty buffers, hence the special case.
        if size_bytes == 0:
            self.tensor = torch.empty(0, dtype=torch.uint8)
        else:
            self.tensor = torch.frombuffer(self._arena, dtype=torch.uint8)

    @property
    def touch_method(self) -> str:
        """How the pages were backed: "populate" (madvise), "write" (a store per page) or "none" (empty)."""
        return self._arena.touch_method

    @property
    def size_bytes(self) -> int:
        return self._arena.size_bytes

    @property
    def reserved_bytes(self) -> int:
        """Bytes mapped: ``size_bytes`` rounded up to 2 MiB."""
        return self._arena.reserved_bytes

    @property
    def data_ptr(self) -> int:
        """Address of byte 0 (2 MiB-aligned; 0 for an empty arena), e.g. for cudaHostRegister."""
        return self._arena.data_ptr

    def view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D ``dtype`` tensor of ``numel`` elements starting at byte ``offset``."""
        _require_int("offset", offset)
        _require_int("numel", numel)
        itemsize = dtype.itemsize
        if offset < 0 or numel < 0:
            raise ValueError(f"offset and numel must be >= 0, got {offset} and {numel}")
        if offset % itemsize:
            raise ValueError(f"offset {offset} is not aligned to {dtype} (itemsize {itemsize})")
        end = offset + numel * itemsize
        if end > self.size_bytes:
            raise ValueError(
                f"view [{offset}, {end}) is past the end of the arena ({self.size_bytes} bytes)"
            )
        return self.tensor[offset:end].view(dtype)

    def reserve(self, offset: int, size: int) -> None:
        """Claim ``[offset, offset + size)`` (for example a planned offset)."""
        self._arena.reserve(offset, size)

    def allocate(self, size: int, alignment: int = 64) -> int:
        """Best-fit allocation; returns the offset. ``MemoryError`` if no free gap fits."""
        return self._arena.allocate(size, alignment)

    def release(self, offset: int) -> None:
        """Free a ``reserve``d or ``allocate``d range and merge it with its free neighbours."""
        self._arena.release(offset)

    def stats(self) -> dict[str, int]:
        return self._arena.stats()

    def __repr__(self) -> str:
        return f"HostArena({self._arena!r})"


def numa_node_of_pci_device(bus_id: str) -> int | None:
    """The NUMA node of a PCI device (for example a GPU, ``"0000:3b:00.0"``), or None where the machine
    has no NUMA or does not say."""
    from pathlib import Path

    try:
        node = int(Path(f"/sys/bus/pci/devices/{bus_id.lower()}/numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None
