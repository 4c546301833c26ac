"""The C++ PinnedArena (and its Python face HostArena) against a pure-Python free list."""

from __future__ import annotations

import gc
import itertools
import platform
import re
import sys
from pathlib import Path

import psutil
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from offload import _C
from offload.host.arena import HostArena, numa_node_of_pci_device

pytestmark = pytest.mark.intra_op_threads  # [Note: the suite's intra-op threads] in tests/conftest.py

MiB = 1 << 20
HUGE_PAGE = 2 * MiB


def round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


# --- reference ------------------------------------------------------------------------------


class ReferenceFreeList:
    """The allocator spec in a few lines: gaps are recomputed as the complement of the live
    allocations, so coalescing is true by construction rather than re-implemented."""

    def __init__(self, size_bytes: int, base: int) -> None:
        self.size_bytes = size_bytes
        self.base = base  # alignment is of the address, as in C++
        self.live: dict[int, int] = {}  # offset -> size

    def gaps(self) -> list[tuple[int, int]]:
        out, cursor = [], 0
        for offset, size in sorted(self.live.items()):
            if offset > cursor:
                out.append((cursor, offset - cursor))
            cursor = offset + size
        if cursor < self.size_bytes:
            out.append((cursor, self.size_bytes - cursor))
        return out

    def allocate(self, size: int, alignment: int) -> int:
        best = None  # (gap size, aligned offset): smallest gap wins, ties keep the lowest offset
        for offset, gap in self.gaps():
            padding = -(self.base + offset) % alignment
            if padding + size <= gap and (best is None or gap < best[0]):
                best = (gap, offset + padding)
        if best is None:
            raise MemoryError
        self.live[best[1]] = size
        return best[1]

    def reserve(self, offset: int, size: int) -> None:
        if not any(g <= offset and offset + size <= g + n for g, n in self.gaps()):
            raise ValueError
        self.live[offset] = size

    def release(self, offset: int) -> None:
        if offset not in self.live:
            raise ValueError
        del self.live[offset]

    def stats(self) -> dict[str, int]:
        gaps = self.gaps()
        return {
            "in_use_bytes": sum(self.live.values()),
            "largest_free_bytes": max((n for _, n in gaps), default=0),
            "num_allocations": len(self.live),
            "num_free_gaps": len(gaps),
        }


# --- exactness and the mapping ---------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 4096, HUGE_PAGE - 1, HUGE_PAGE, HUGE_PAGE + 1, 5 * MiB + 123])
def test_exact_size_and_2mib_alignment(size):
    arena = _C.PinnedArena(size, 2)
    assert arena.size_bytes == size
    assert arena.reserved_bytes == round_up(size, HUGE_PAGE)
    assert arena.data_ptr % HUGE_PAGE == 0
    assert arena.stats() == {
        "size_bytes": size,
        "reserved_bytes": round_up(size, HUGE_PAGE),
        "in_use_bytes": 0,
        "largest_free_bytes": size,
        "num_allocations": 0,
        "num_free_gaps": 1,
        "num_os_allocations": 1,
    }


HAS_NODE_0 = Path("/sys/devices/system/node/node0/cpulist").exists()
KERNEL = tuple(int(x) for x in re.findall(r"\d+", platform.release())[:2])


@pytest.mark.parametrize("populate", [True, False])
@pytest.mark.parametrize("touch_threads", [0, 1, 3, 64])
def test_first_touch_backs_every_page(touch_threads, populate):
    size = 24 * MiB + 4096
    rss_before = psutil.Process().memory_info().rss
    arena = HostArena(size, touch_threads, populate=populate)
    rss_growth = psutil.Process().memory_info().rss - rss_before
    assert rss_growth >= size - MiB  # backed now, not at first use
    assert int(arena.tensor.count_nonzero()) == 0  # touching writes zeros over zeroed pages
    if not populate:
        assert arena.touch_method == "write"
    elif KERNEL >= (5, 14):  # older kernels lack MADV_POPULATE_WRITE: writes are the fallback
        assert arena.touch_method == "populate"


@pytest.mark.skipif(not HAS_NODE_0, reason="no NUMA information in sysfs")
def test_touch_on_a_numa_node_backs_every_page():
    rss_before = psutil.Process().memory_info().rss
    arena = HostArena(16 * MiB, 2, numa_node=0)
    assert psutil.Process().memory_info().rss - rss_before >= 15 * MiB
    assert arena.stats()["num_free_gaps"] == 1


def test_unknown_numa_node_is_a_value_error():
    with pytest.raises(ValueError, match="NUMA node 4096 does not exist"):
        _C.PinnedArena(MiB, 1, 4096)
    with pytest.raises(ValueError, match="NUMA node 4096 does not exist"):
        _C.PinnedArena(0, 1, 4096)  # even when nothing is mapped
    with pytest.raises(ValueError, match="numa_node must be >= 0 or None"):
        HostArena(MiB, numa_node=-2)


def test_numa_node_of_pci_device():
    assert numa_node_of_pci_device("not-a-device") is None
    for dev in sorted(Path("/sys/bus/pci/devices").glob("*"))[:3]:
        node = numa_node_of_pci_device(dev.name)
        assert node is None or node >= 0


def test_steady_state_makes_no_os_allocation():
    # A step's worth of bucket-sized allocate/release, repeated: after a warm-up the process's memory
    # map (every mmap, munmap and brk shows in it) must not change at all.
    arena = _C.PinnedArena(64 * MiB, 1)
    sizes = [3 * MiB + 4096 * k for k in range(12)]

    def one_step():
        offsets = [arena.allocate(size, 4096) for size in sizes]
        for offset in offsets[::2] + offsets[1::2]:
            arena.release(offset)

    for _ in range(50):
        one_step()
    maps_before = Path("/proc/self/maps").read_text()
    for _ in range(500):
        one_step()
    assert Path("/proc/self/maps").read_text() == maps_before
    assert arena.stats()["num_os_allocations"] == 1 and arena.stats()["num_free_gaps"] == 1


def test_zero_size_arena():
    arena = HostArena(0)
    assert arena.size_bytes == arena.reserved_bytes == arena.data_ptr == 0
    assert arena.tensor.numel() == 0 and arena.tensor.dtype == torch.uint8
    assert set(arena.stats().values()) == {0}
    assert arena.view(0, 0, torch.float32).numel() == 0
    with pytest.raises(MemoryError, match="largest free gap is 0 bytes"):
        arena.allocate(1)
    with pytest.raises(ValueError, match="past the end"):
        arena.reserve(0, 1)


@pytest.mark.parametrize(
    ("size", "error", "match"),
    [
        (-1, ValueError, "size_bytes must be >= 0"),
        (1 << 60, MemoryError, "could not map"),  # beyond any user address space
        ((1 << 63) - 1, MemoryError, "could not map"),  # the largest size Python can pass
    ],
)
def test_bad_arena_sizes(size, error, match):
    with pytest.raises(error, match=match):
        _C.PinnedArena(size)


# --- tensor views ---------------------------------------------------------------------------


def test_frombuffer_round_trip_and_shared_memory():
    arena = HostArena(3 * MiB)
    assert arena.tensor.data_ptr() == arena.data_ptr
    assert arena.tensor.numel() == 3 * MiB
    arena.tensor[:16] = torch.arange(16, dtype=torch.uint8)
    assert bytes(memoryview(arena._arena)[:16]) == bytes(range(16))

    floats = arena.view(64, 4, torch.float32)
    floats.copy_(torch.tensor([1.0, -2.0, 3.5, 0.25]))
    assert arena.tensor[64:80].view(torch.float32).tolist() == [1.0, -2.0, 3.5, 0.25]
    halves = arena.view(3 * MiB - 4, 2, torch.bfloat16)  # the very last bytes
    halves.fill_(1.5)
    assert halves.data_ptr() == arena.data_ptr + 3 * MiB - 4
    assert arena.view(8, 1, torch.int64).dtype == torch.int64


def test_exact_view_owns_exactly_its_bytes_and_shares_the_arena():
    """exact_view (what checkpoints save) is a view over those bytes alone: its storage is numel * itemsize
    bytes, not the arena, and writes through it show in view()'s tensor of the same range."""
    arena = HostArena(MiB)
    exact = arena.exact_view(4096, 10, torch.float32)
    assert exact.untyped_storage().nbytes() == 40 and exact.data_ptr() == arena.data_ptr + 4096
    exact.copy_(torch.arange(10, dtype=torch.float32))
    assert torch.equal(arena.view(4096, 10, torch.float32), torch.arange(10, dtype=torch.float32))


def test_tensor_keeps_arena_alive():
    arena = _C.PinnedArena(MiB)
    refs = sys.getrefcount(arena)
    tensor = torch.frombuffer(arena, dtype=torch.uint8)
    assert sys.getrefcount(arena) == refs + 1  # the tensor's storage holds the arena

    host = HostArena(MiB)
    view = host.view(0, 1024, torch.int32)
    del arena, host
    gc.collect()
    tensor.fill_(7)
    view.copy_(torch.arange(1024, dtype=torch.int32))
    assert int(tensor.sum()) == 7 * MiB
    assert view.sum().item() == sum(range(1024))


@pytest.mark.parametrize(
    ("offset", "numel", "dtype", "match"),
    [
        (2, 1, torch.float32, "not aligned"),
        (4, 1, torch.float64, "not aligned"),
        (MiB - 4, 2, torch.float32, "past the end"),
        (MiB, 1, torch.uint8, "past the end"),
        (-4, 1, torch.float32, ">= 0"),
        (0, -1, torch.float32, ">= 0"),
    ],
)
def test_view_rejects_bad_ranges(offset, numel, dtype, match):
    with pytest.raises(ValueError, match=match):
        HostArena(MiB).view(offset, numel, dtype)


# --- sub-allocation ---------------------------------------------------------------------------


def fragmented_arena() -> _C.PinnedArena:
    """1000 bytes: gaps of 300 at 100, 100 at 500 and 200 at 700, between reserved blocks."""
    arena = _C.PinnedArena(1000, 1)
    for offset in (0, 400, 600, 900):
        arena.reserve(offset, 100)
    return arena


def test_best_fit_chooses_smallest_fitting_gap():
    arena = fragmented_arena()
    assert arena.allocate(150, 1) == 700  # 200-byte gap, not the first (300) one
    assert arena.allocate(100, 1) == 500  # exact fit
    assert arena.allocate(50, 1) == 850  # the 50-byte tail of the 200 gap beats the 300 gap
    assert arena.allocate(250, 1) == 100
    assert arena.stats()["largest_free_bytes"] == 50


def test_allocate_aligns_the_address_and_padding_stays_free():
    arena = _C.PinnedArena(10_000, 1)
    assert arena.allocate(10, 1) == 0
    offset = arena.allocate(100, 256)
    assert offset == 256 and (arena.data_ptr + offset) % 256 == 0
    stats = arena.stats()
    assert stats["in_use_bytes"] == 110
    assert stats["num_free_gaps"] == 2  # [10, 256) stays usable
    assert arena.allocate(200, 1) == 10  # best fit: 246-byte padding gap, not the large tail
    for off in (0, 10, 256):
        arena.release(off)
    assert arena.stats()["num_free_gaps"] == 1


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_coalescing_three_neighbours_in_every_order(order):
    arena = _C.PinnedArena(3000, 1)
    arena.reserve(0, 500)  # guards: the three are bounded by live allocations on both sides
    arena.reserve(2500, 500)
    offsets = [arena.allocate(size, 1) for size in (700, 600, 700)]
    assert sorted(offsets) == [500, 1200, 1800]
    for i in order:
        arena.release(offsets[i])
    assert arena.stats()["num_free_gaps"] == 1
    assert arena.stats()["largest_free_bytes"] == 2000
    arena.release(0)
    arena.release(2500)
    assert arena.stats()["num_free_gaps"] == 1
    assert arena.stats()["largest_free_bytes"] == 3000


def test_reserve_and_allocate_interplay():
    arena = HostArena(4096)
    arena.reserve(1024, 1024)
    assert arena.allocate(1024, 1024) == 0  # fits the smaller gap before the reservation
    assert arena.allocate(2048, 1024) == 2048
    with pytest.raises(ValueError, match="overlaps an allocation in use"):
        arena.reserve(2048, 1)  # inside an allocate()d range
    with pytest.raises(MemoryError):
        arena.allocate(1)
    arena.release(1024)  # release works for reserved ranges too
    assert arena.allocate(512, 512) == 1024
    arena.reserve(1536, 512)  # the rest of the freed range
    assert arena.stats()["in_use_bytes"] == 4096


def test_reserve_errors():
    arena = _C.PinnedArena(1000, 1)
    arena.reserve(100, 100)
    for offset, size in [(50, 100), (150, 10), (199, 100), (0, 1000)]:
        with pytest.raises(ValueError, match=r"\[\d+, \d+\) overlaps an allocation in use"):
            arena.reserve(offset, size)
    with pytest.raises(ValueError, match="past the end of the arena"):
        arena.reserve(900, 101)
    with pytest.raises(ValueError, match="past the end of the arena"):
        arena.reserve(1001, 1)
    with pytest.raises(ValueError, match="past the end of the arena"):
        arena.reserve(2**63 - 1, 2**63 - 1)  # offset + size would overflow
    with pytest.raises(ValueError, match="size must be positive"):
        arena.reserve(500, 0)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        arena.reserve(-1, 10)
    arena.reserve(0, 100)  # touching neighbours are fine
    arena.reserve(200, 800)
    assert arena.stats()["in_use_bytes"] == 1000


def test_release_errors():
    arena = _C.PinnedArena(1000, 1)
    offset = arena.allocate(100)
    with pytest.raises(ValueError, match="offset 1 is not a live allocation"):
        arena.release(offset + 1)  # inside, but not the start
    arena.release(offset)
    with pytest.raises(ValueError, match="not a live allocation"):
        arena.release(offset)  # double free
    with pytest.raises(ValueError, match="offset must be >= 0"):
        arena.release(-5)


@pytest.mark.parametrize("alignment", [0, 3, 48, 1000])
def test_alignment_must_be_power_of_two(alignment):
    with pytest.raises(ValueError, match=f"power of two, got {alignment}"):
        _C.PinnedArena(1000, 1).allocate(8, alignment)


def test_oversize_and_fragmented_allocate_raise_memory_error():
    arena = _C.PinnedArena(1000, 1)
    with pytest.raises(MemoryError, match="no free gap holds 1001 bytes .* largest free gap is 1000 bytes"):
        arena.allocate(1001, 1)
    arena = fragmented_arena()  # 600 bytes free in total, but the largest gap is 300
    with pytest.raises(MemoryError, match="holds 400 bytes aligned to 1; largest free gap is 300"):
        arena.allocate(400, 1)
    with pytest.raises(ValueError, match="size must be positive"):
        arena.allocate(0)


def test_host_arena_stats_and_repr():
    arena = HostArena(5000, 1)
    a = arena.allocate(1000)
    arena.reserve(3000, 500)
    assert arena.stats() == {
        "size_bytes": 5000,
        "reserved_bytes": HUGE_PAGE,
        "in_use_bytes": 1500,
        "largest_free_bytes": 2000,
        "num_allocations": 2,
        "num_free_gaps": 2,
        "num_os_allocations": 1,
    }
    assert "in_use_bytes=1500" in repr(arena)
    arena.release(a)
    assert arena.stats()["num_allocations"] == 1


# --- random sequences against the reference ----------------------------------------------------


class ArenaMatchesReference(RuleBasedStateMachine):
    """Random reserve/allocate/release sequences: same offsets, same errors, same stats."""

    SIZE = 20_000

    def __init__(self) -> None:
        super().__init__()
        self.arena = _C.PinnedArena(self.SIZE, 1)
        self.ref = ReferenceFreeList(self.SIZE, self.arena.data_ptr)

    @rule(size=st.integers(1, 4000), alignment=st.sampled_from([1, 8, 64, 256, 4096]))
    def allocate(self, size, alignment):
        try:
            expected = self.ref.allocate(size, alignment)
        except MemoryError:
            with pytest.raises(MemoryError):
                self.arena.allocate(size, alignment)
        else:
            assert self.arena.allocate(size, alignment) == expected

    @rule(offset=st.integers(0, SIZE + 10), size=st.integers(1, 3000))
    def reserve(self, offset, size):
        try:
            self.ref.reserve(offset, size)
        except ValueError:
            with pytest.raises(ValueError):
                self.arena.reserve(offset, size)
        else:
            self.arena.reserve(offset, size)

    @precondition(lambda self: self.ref.live)
    @rule(data=st.data())
    def release_live(self, data):
        offset = data.draw(st.sampled_from(sorted(self.ref.live)))
        self.ref.release(offset)
        self.arena.release(offset)

    @rule(offset=st.integers(0, SIZE))
    def release_maybe_bogus(self, offset):
        if offset in self.ref.live:
            self.ref.release(offset)
            self.arena.release(offset)
        else:
            with pytest.raises(ValueError):
                self.arena.release(offset)

    @invariant()
    def stats_match(self):
        stats = self.arena.stats()
        assert {k: stats[k] for k in self.ref.stats()} == self.ref.stats()


ArenaMatchesReference.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, derandomize=True, database=None, deadline=None
)
test_arena_matches_reference = ArenaMatchesReference.TestCase
