"""offload C++ core: pinned host arena, offline arena planner, fused CPU AdamW (no torch, no CUDA).

Hand-written stub for the pybind11 module built from cpp/. C++ errors arrive as ``ValueError``
(bad arguments) or ``MemoryError`` (the OS or the arena is out of memory).
"""

from collections.abc import Sequence
from typing import TypedDict

import numpy as np
import numpy.typing as npt

IntColumn = Sequence[int] | npt.NDArray[np.int64]  # int64 numpy columns are read as they are

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

    def __init__(self, size_bytes: int, touch_threads: int = 0, numa_node: int = -1, populate: bool = False) -> None:
        """Map and touch ``size_bytes`` bytes (0 = no mapping). ``touch_threads=0`` uses every core.

        ``numa_node >= 0`` runs the touching threads on that node's CPUs (first touch puts the pages
        there). ``populate`` backs each thread's range with ``madvise(MADV_POPULATE_WRITE)`` where the
        kernel has it, else (and by default) a write per page. Releases the GIL while touching. Raises ``MemoryError``
        if the OS refuses the mapping, ``ValueError`` for a NUMA node the machine does not have.
        """
    @property
    def touch_method(self) -> str:
        """"populate", "write" or "none" (zero size): how the pages were backed."""
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
    sizes: IntColumn, starts: IntColumn, ends: IntColumn, alignment: int = 256,
    heuristic: str = "best", stop_at: int = -1,
) -> tuple[list[int], int, str, dict[str, int]]:
    """Offsets for buffers with known lifetimes: best fit under three orderings, smallest arena kept.

    Buffer ``i`` needs ``sizes[i]`` bytes (> 0, rounded up to ``alignment``, a power of two)
    during events ``[starts[i], ends[i])`` (``end > start``). Each ordering ("greedy_by_size":
    largest first; "greedy_by_breadth": buffers of the step with most live bytes first;
    "best_fit_by_lifetime": longest-lived first; ties by earlier start, then lower index) places
    each buffer in the smallest gap between the already-placed buffers live at the same time, else
    just above the highest of them. ``heuristic="best"`` runs all three and keeps the smallest
    arena (ties: that order); a name runs only that one. Returns the offsets in input order, the
    total bytes (max of offset + aligned size), the heuristic that produced them and the total of
    every heuristic run. Deterministic; releases the GIL. Raises ``ValueError`` on bad input.
    With ``"best"`` and ``stop_at >= 0`` (a lower bound on the total), the first heuristic runs alone
    first and is returned where its total is ``<= stop_at`` (the others are then not run).
    C-contiguous int64 numpy columns are read as they are (an overload); other input is converted per value.
    """

def arena_lower_bound(sizes: IntColumn, starts: IntColumn, ends: IntColumn, alignment: int = 256) -> int:
    """Max over time of the sum of live aligned sizes: no layout can be smaller than this. Takes int64 numpy
    columns as they are, like ``plan_arena``."""

def adamw_step(
    param: int, exp_avg: int, exp_avg_sq: int, grad: int, grad_dtype: str, lowp_out: int, lowp_dtype: str,
    numel: int, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
    grad_scale: float = 1.0, check_finite: bool = False, num_threads: int = 1, isa: str = "auto",
) -> bool:
    """Fused AdamW over raw buffers given by address (use ``offload.cpu_adam.adamw_step``, which checks
    its tensors). ``grad_dtype``/``lowp_dtype``: "float32", "bfloat16" or "float16"; ``lowp_out`` 0 for
    none. ``isa``: "auto", "avx512", "avx2" or "baseline" (``ValueError`` if the CPU lacks it). Returns
    found_inf: with ``check_finite``, True (and nothing written) if any grad * grad_scale is not finite.
    Releases the GIL.
    """

def adamw_step_segments(
    table: int, first: int, count: int, grads: int, n_grads: int, hypers: int, n_hypers: int, grad_dtype: str,
    lowp_dtype: str, check_finite: bool = False, num_threads: int = 1, isa: str = "auto",
) -> int:
    """``adamw_step`` over rows ``[first, first + count)`` of ``table`` in one call ([Note: segmented AdamW] in
    cpp/cpu_adam.h), bit for bit one ``adamw_step`` a row. Tables by address: ``table`` int64 rows of 7 (param,
    exp_avg, exp_avg_sq addresses, index of the grad in ``grads``, the 16-bit copy's address or 0, numel, index
    of the row in ``hypers``), ``grads`` ``n_grads`` int64 addresses, ``hypers`` float64 rows of 7 (step, lr,
    beta1, beta2, eps, weight_decay, grad_scale). Returns the first row that found an inf (it and later rows
    unwritten), or -1. Use ``offload.host.segments``, which builds the tables. Releases the GIL.
    """

def adamw_memory_traffic(
    param: int, exp_avg: int, exp_avg_sq: int, grad: int, grad_dtype: str, lowp_out: int, numel: int,
    num_threads: int = 1,
) -> None:
    """``adamw_step``'s loads and stores (same blocks, same threads) without its arithmetic: overwrites the
    buffers with meaningless values. Its speed is the kernel's bandwidth bound on this machine."""

def adamw_isa() -> str:
    """The instruction set ``adamw_step`` dispatches to on this CPU: "avx512", "avx2" or "baseline"."""

def adamw_has_openmp() -> bool:
    """Whether ``adamw_step`` runs on OpenMP threads (else on the calling thread only)."""

def simulate_lanes(
    compute: Sequence[float], h2d_event: Sequence[int], h2d_solo: Sequence[float], wait_ptr: Sequence[int],
    wait_copy: Sequence[int], d2h_event: Sequence[int], d2h_solo: Sequence[float], adam_s: Sequence[float],
    adam_after_backward: bool, duplex: float, grad_wait_ptr: Sequence[int] = ..., grad_wait_copy: Sequence[int] = ...,
    refresh_after: Sequence[int] = ..., tail: float = ...,
) -> tuple[float, float, float, float, float, float, float, npt.NDArray[np.float64], npt.NDArray[np.float64], float,
           int, bool]:
    """The step simulator's lane loop (``cpp/lane_sim.h``) over one-dimensional numpy arrays (or sequences,
    converted). ``grad_wait_*``: compute's waits on grad copies, per event (both empty: none). ``refresh_after``:
    per copy at -1, the grad copy its pipelined refresh follows (empty: refreshes at the step start), and
    ``tail``, the device AdamW after compute ends (offload/planning/steady.py). Returns (step, compute, stall,
    h2d busy, d2h busy, adam, compute end, stall per event, copy credit, grad stall, refresh passes, divided
    by zero); the two per-item results are float64 numpy arrays."""

def latest_issue(
    deadline: Sequence[float] | npt.NDArray[np.float64], duration: Sequence[float] | npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    """``out[q] = min(deadline[q], out[q + 1]) - duration[q]`` backwards from +inf (``cpp/schedule_kernels.h``),
    as a float64 numpy array."""

def last_occupants(
    issue: Sequence[int], release: Sequence[int], lo: Sequence[int], hi: Sequence[int]
) -> tuple[list[int], list[int]]:
    """Per buffer, the buffers that last released its bytes ``[lo, hi)`` before it was issued, flattened as
    (ptr, buffers) (``cpp/schedule_kernels.h``)."""

class GreedyKernel:
    """The greedy scheduler's move sequence (``cpp/greedy.h``; ``offload.planning.greedy.Greedy.candidates``): the
    constants of one (trace, buckets, hardware) once, then every simulated point of a copy mode's sequence.
    Its Python reference is ``Greedy.candidates_reference`` (tested field for field, bitwise)."""

    def __init__(
        self, n: int, nb: int, use_b: Sequence[int], use_s: Sequence[int], use_e: Sequence[int],
        size: Sequence[int], nbytes: Sequence[int], dur: Sequence[float], updated_dur: Sequence[float],
        updated: Sequence[int], fwd_row: Sequence[int], bwd_row: Sequence[int], fwd_at: Sequence[int],
        bwd_at: Sequence[int], keepable: Sequence[int], tau: Sequence[float], grad_profile: Sequence[int],
        need_b: Sequence[int], need_e: Sequence[int], compute: Sequence[float], d2h_event: Sequence[int],
        d2h_solo: Sequence[float], adam_s: Sequence[float], grad_wait_ptr: Sequence[int],
        grad_wait_copy: Sequence[int], duplex: float, n_used: int, max_points: int,
        refresh_after: Sequence[int] = ..., tail: float = ...,
    ) -> None:
        """The fields of ``offload.planning.greedy_inputs.GreedyInputs`` (names as there, passed by keyword; numpy arrays or sequences, copied). Raises
        ``ValueError`` naming the first inconsistent length, out-of-range index or unsorted input."""
    def points(self, mode: int, capacity: int) -> tuple[list[tuple], str]:
        """Every point of mode ``mode`` (0 latest, 1 lookahead, 2 just in time) whose peak live bytes are
        ``<= capacity``, in sequence order, each (resident buckets, flat rows (k, 3), step, compute, stall,
        h2d busy, d2h busy, adam, compute end, stall per event, copy credit, h2d bytes, peak, resident
        bytes, grad stall, refresh passes), arrays as numpy; and a fallback reason, non-empty where the Python loop must run instead
        (it raises the reference's error: a stall on a zero-length copy, a score dividing by zero). Releases
        the GIL."""
