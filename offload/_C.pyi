"""offload C++ core: pinned host arena and offline arena planner (no torch, no CUDA).

Hand-written stub for the pybind11 module built from cpp/. C++ errors arrive as ``ValueError``
(bad arguments) or ``MemoryError`` (the OS or the arena is out of memory).
"""

from collections.abc import Sequence
from typing import TypedDict

class ArenaStatsDict(TypedDict):
    size_bytes: int
    """Exactly the size asked for."""
    reserved_bytes: int
    """Bytes mapped: ``size_bytes`` rounded up to 2 MiB."""
    in_use_bytes: int
    """Sum of live allocations (alignment padding excluded)."""
    largest_free_bytes: int
    """Largest free gap, before alignment padding."""
    num_allocations: int
    """Live ``reserve`` and ``allocate`` results."""
    num_free_gaps: int
    """Free gaps; neighbouring gaps are always merged."""
    num_os_allocations: int
    """mmaps made: 1, or 0 for a zero-size arena."""

class PinnedArena:
    """One exact-size host region, sub-allocated by byte offset.

    The region is mmap'd 2 MiB-aligned, advised for transparent huge pages and first-touched by
    ``touch_threads`` threads (so every page is backed, near the thread that touched it). It is not
    pinned here: register ``data_ptr``/``size_bytes`` with ``cudaHostRegister`` from Python.
    Supports the buffer protocol (1-D, writable, ``uint8``, ``size_bytes`` long), so
    ``torch.frombuffer(arena, dtype=torch.uint8)`` shares its memory and keeps it alive.
    All methods are thread-safe.
    """

    def __init__(self, size_bytes: int, touch_threads: int = 0) -> None:
        """Map and touch ``size_bytes`` bytes (0 = no mapping). ``touch_threads=0`` uses every core.

        Releases the GIL while touching. Raises ``MemoryError`` if the OS refuses the mapping.
        """
    @property
    def size_bytes(self) -> int:
        """Exactly the size asked for."""
    @property
    def reserved_bytes(self) -> int:
        """Bytes mapped: ``size_bytes`` rounded up to 2 MiB."""
    @property
    def data_ptr(self) -> int:
        """Address of byte 0 (2 MiB-aligned), or 0 for a zero-size arena."""
    def reserve(self, offset: int, size: int) -> None:
        """Claim ``[offset, offset + size)``, chosen by the caller (for example a planned offset).

        Raises ``ValueError`` if ``size`` is 0, the range is past the end, or it overlaps a live
        allocation.
        """
    def allocate(self, size: int, alignment: int = 64) -> int:
        """Best fit: place ``size`` bytes in the smallest free gap that holds them at an address
        aligned to ``alignment`` (a power of two; ties go to the lowest offset). Returns the offset.

        Raises ``ValueError`` for ``size`` 0 or a bad alignment, ``MemoryError`` (stating the
        request and the largest free gap) when no gap fits.
        """
    def release(self, offset: int) -> None:
        """Free the allocation (reserved or allocated) starting at ``offset`` and merge it with
        neighbouring free gaps. Raises ``ValueError`` if ``offset`` is not a live allocation."""
    def stats(self) -> ArenaStatsDict:
        """A consistent snapshot of the counters."""
    def __buffer__(self, flags: int, /) -> memoryview: ...

def plan_arena(
    sizes: Sequence[int], starts: Sequence[int], ends: Sequence[int], alignment: int = 256
) -> tuple[list[int], int]:
    """Offsets for buffers with known lifetimes: greedy by size, best fit.

    Buffer ``i`` needs ``sizes[i]`` bytes (> 0, rounded up to ``alignment``, a power of two)
    during events ``[starts[i], ends[i])`` (``end > start``). Buffers are placed largest first
    (ties: earlier start, then lower index), each in the smallest gap between the already-placed
    buffers live at the same time, else just above the highest of them. Returns the offsets in
    input order and the total bytes (max of offset + aligned size). Deterministic; releases the
    GIL. Raises ``ValueError`` on bad input.
    """

def arena_lower_bound(
    sizes: Sequence[int], starts: Sequence[int], ends: Sequence[int], alignment: int = 256
) -> int:
    """Max over time of the sum of live aligned sizes: no layout can be smaller than this."""
