"""The C++ arena planner against its pure-Python reference (offload/planning/_reference.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload import _C
from offload.planning import _reference as arena_reference
from offload.planning.arena import ARENA_HEURISTICS, ArenaLayout, Interval, plan_arena

# Deterministic (same examples every run) and no .hypothesis/ database in the working tree.
PROPERTY_SETTINGS = settings(max_examples=200, derandomize=True, database=None, deadline=None)


# --- reference: offload/planning/_reference.py ----------------------------------------------------------


def reference_plan(sizes, starts, ends, alignment, heuristic="best"):
    return arena_reference.plan(sizes, starts, ends, alignment, heuristic)


def reference_lower_bound(sizes, starts, ends, alignment):
    return arena_reference.lower_bound(sizes, starts, ends, alignment)


def round_up(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment


# --- checks ----------------------------------------------------------------------------------


def count_conflicts(offsets, sizes, starts, ends, alignment: int, rows: int = 1024) -> int:
    """Pairs of buffers live at the same time whose memory overlaps (vectorised, all pairs)."""
    lo = torch.tensor(offsets, dtype=torch.int64)
    hi = lo + torch.tensor([round_up(s, alignment) for s in sizes], dtype=torch.int64)
    t0, t1 = torch.tensor(starts, dtype=torch.int64), torch.tensor(ends, dtype=torch.int64)
    conflicts = 0
    for r in range(0, len(offsets), rows):
        sl = slice(r, r + rows)
        in_time = (t0[sl, None] < t1[None, :]) & (t0[None, :] < t1[sl, None])
        in_memory = (lo[sl, None] < hi[None, :]) & (lo[None, :] < hi[sl, None])
        both = in_time & in_memory
        both[torch.arange(both.shape[0]), torch.arange(r, r + both.shape[0])] = False  # self
        conflicts += int(both.sum())
    return conflicts // 2


def check_layout(intervals: list[Interval], alignment: int, heuristic: str = "best") -> ArenaLayout:
    sizes = [iv.size for iv in intervals]
    starts = [iv.start for iv in intervals]
    ends = [iv.end for iv in intervals]
    layout = plan_arena(intervals, alignment, heuristic)

    offsets, total, winner, totals = reference_plan(sizes, starts, ends, alignment, heuristic)
    assert layout.offsets == tuple(offsets)
    assert layout.total_bytes == total
    assert layout.heuristic == winner
    assert dict(layout.candidates) == totals
    assert layout.total_bytes == min(totals.values())
    assert layout.lower_bound_bytes == reference_lower_bound(sizes, starts, ends, alignment)

    assert count_conflicts(layout.offsets, sizes, starts, ends, alignment) == 0
    assert all(o % alignment == 0 for o in layout.offsets)
    assert layout.total_bytes >= layout.lower_bound_bytes
    assert layout.total_bytes == max(
        (o + round_up(s, alignment) for o, s in zip(layout.offsets, sizes)), default=0
    )
    return layout


# --- properties ------------------------------------------------------------------------------


@st.composite
def intervals_strategy(draw, max_buffers: int = 40, max_time: int = 30):
    n = draw(st.integers(0, max_buffers))
    # Few distinct sizes make ties (same size, same start) common, which exercises the tie-breaks.
    size = st.one_of(st.sampled_from([1, 256, 512, 1000, 4096]), st.integers(1, 10_000))
    out = []
    for _ in range(n):
        start = draw(st.integers(-5, max_time))
        out.append(Interval(draw(size), start, start + draw(st.integers(1, 12))))
    return out


@PROPERTY_SETTINGS
@given(intervals=intervals_strategy(), alignment=st.sampled_from([1, 2, 64, 256, 4096]))
def test_matches_reference_and_is_valid(intervals, alignment):
    check_layout(intervals, alignment)


@settings(PROPERTY_SETTINGS, max_examples=100)
@given(intervals=intervals_strategy(), alignment=st.sampled_from([1, 256]),
       heuristic=st.sampled_from(ARENA_HEURISTICS))
def test_each_heuristic_matches_reference_and_is_valid(intervals, alignment, heuristic):
    layout = check_layout(intervals, alignment, heuristic)
    assert layout.heuristic == heuristic and [h for h, _ in layout.candidates] == [heuristic]


@settings(PROPERTY_SETTINGS, max_examples=50)
@given(intervals=intervals_strategy())
def test_deterministic(intervals):
    assert plan_arena(intervals) == plan_arena(intervals)


# Small cases (found by searching random ones with the reference) where each heuristic alone is best:
# together they do better than any one of them. Totals in ARENA_HEURISTICS order.
WINS = {
    "greedy_by_size": ([3001, 1000, 3001, 1001, 2000, 1003], [1, 2, 6, 0, 6, 0], [2, 7, 7, 5, 9, 2],
                       (6005, 7002, 7002, 6008, 6008, 7005)),
    "greedy_by_breadth": ([1002, 1002, 1003, 1002, 2000], [3, 0, 1, 1, 2], [5, 2, 2, 6, 7],
                          (4009, 4004, 4005, 4014, 4007, 4007)),
    "best_fit_by_lifetime": ([1001, 2001, 1003, 1003, 2000, 1002], [0, 0, 6, 4, 3, 6], [5, 3, 9, 7, 6, 9],
                             (4005, 4005, 4004, 4015, 5005, 4007)),
    "greedy_by_size+size_classes": ([1003, 1001, 3001, 1003, 1000, 1000], [2, 4, 6, 1, 2, 1], [5, 8, 8, 5, 6, 6],
                                    (6002, 6008, 6005, 5012, 6013, 6009)),
    "greedy_by_breadth+size_classes": ([1001, 1001, 1003, 1000, 1001, 1000], [2, 2, 6, 6, 1, 3],
                                       [4, 4, 10, 11, 3, 7], (4003, 4003, 4004, 4012, 3009, 5009)),
    "best_fit_by_lifetime+size_classes": ([1000, 1002, 1002, 2000, 3001], [3, 1, 0, 1, 6], [8, 4, 2, 5, 11],
                                          (5004, 6001, 5003, 5008, 5008, 4008)),
}


@pytest.mark.parametrize("winner", list(WINS))
def test_each_heuristic_wins_somewhere(winner):
    sizes, starts, ends, totals = WINS[winner]
    layout = check_layout([Interval(*x) for x in zip(sizes, starts, ends)], 1)
    assert layout.heuristic == winner
    assert dict(layout.candidates) == dict(zip(ARENA_HEURISTICS, totals))


def test_size_classes_let_near_equal_buffers_share_slots():
    # Never more than two live at once, but buffer 2 is 4 KiB larger than the others: with exact sizes it
    # fits no slot another buffer left, and every ordering needs three slots; size classes make the
    # sizes equal and two slots do.
    mib = 1 << 20
    a, b = 19 * mib + 1024, 19 * mib + 5120
    intervals = [Interval(a, 3, 5), Interval(a, 3, 8), Interval(b, 8, 9), Interval(a, 6, 9)]
    layout = check_layout(intervals, 256)
    assert layout.heuristic == "best_fit_by_lifetime+size_classes"
    assert min(total for h, total in layout.candidates if "+" not in h) == 3 * a  # three slots
    assert layout.total_bytes == arena_reference.size_class(a) + a  # two: the top one holds an a


def test_size_class_rounding():
    assert [arena_reference.size_class(s) for s in (1, 255, 256, 257, 1000, 1 << 20, (1 << 20) + 1)] == \
        [1, 255, 256, 258, 1000, 1 << 20, (1 << 20) + 8192]


def test_ties_go_to_the_first_heuristic():
    layout = check_layout([Interval(1000, t, t + 1) for t in range(10)], 256)
    assert set(dict(layout.candidates).values()) == {1024} and len(layout.candidates) == 6
    assert layout.heuristic == "greedy_by_size"
    assert layout.overhead == 1.0


def test_breadth_places_the_widest_step_first():
    # Step 0 holds 3 KiB live (a, b), step 5 holds 4 KiB (c, d): breadth places c and d first (largest
    # first), then the buffers of step 0; by size, the 2 KiB buffer a would go first.
    intervals = [Interval(2048, 0, 3), Interval(1024, 0, 3), Interval(1536, 5, 8), Interval(2560, 5, 8)]
    layout = check_layout(intervals, 512, "greedy_by_breadth")
    assert layout.offsets == (0, 2048, 2560, 0)


def test_chain_reuses_memory():
    # Buffers that never coexist all share offset 0.
    layout = check_layout([Interval(1000, t, t + 1) for t in range(10)], 256)
    assert layout.offsets == (0,) * 10
    assert layout.total_bytes == layout.lower_bound_bytes == 1024


def test_best_fit_picks_smallest_gap():
    # Buffers 1 and 3 die at event 2, leaving two gaps among the buffers live at events [5, 10):
    # 1024 bytes at 2048 and 512 bytes at 4096. Buffer 5 (512) must take the smaller one, although
    # the larger one comes first in offset order.
    intervals = [
        Interval(2048, 0, 10),  # 0: placed first at 0
        Interval(1024, 0, 2),  # 1: at 2048, dies at 2
        Interval(1024, 0, 10),  # 2: at 3072
        Interval(512, 0, 2),  # 3: at 4096, dies at 2
        Interval(512, 0, 10),  # 4: at 4608
        Interval(512, 5, 10),  # 5: gaps [2048, 3072) (1024) and [4096, 4608) (512) -> 4096
    ]
    layout = check_layout(intervals, 256)
    assert layout.offsets == (0, 2048, 3072, 4096, 4608, 4096)


def test_no_fit_goes_above_highest():
    layout = check_layout([Interval(512, 0, 4), Interval(256, 1, 3), Interval(256, 2, 6)], 256)
    assert layout.offsets == (0, 512, 768)
    assert layout.total_bytes == 1024


# --- edge cases ------------------------------------------------------------------------------


def test_empty():
    layout = plan_arena([])
    assert (layout.offsets, layout.total_bytes, layout.lower_bound_bytes) == ((), 0, 0)
    assert layout.candidates == tuple((h, 0) for h in ARENA_HEURISTICS) and layout.overhead == 1.0
    assert _C.plan_arena([], [], []) == ([], 0, "greedy_by_size", dict.fromkeys(ARENA_HEURISTICS, 0))
    assert _C.arena_lower_bound([], [], []) == 0


def test_one_buffer_rounds_up_to_alignment():
    layout = plan_arena([Interval(1, 3, 4)], alignment=256)
    assert layout == ArenaLayout(offsets=(0,), total_bytes=256, lower_bound_bytes=256, heuristic="greedy_by_size",
                                 candidates=tuple((h, 256) for h in ARENA_HEURISTICS))


def test_unknown_heuristic():
    with pytest.raises(ValueError, match="heuristic must be 'best' or one of"):
        plan_arena([Interval(8, 0, 1)], heuristic="first_fit")
    with pytest.raises(ValueError, match="unknown arena heuristic 'first_fit'"):
        _C.plan_arena([8], [0], [1], 256, "first_fit")


def test_identical_intervals_stack_in_input_order():
    layout = check_layout([Interval(300, 0, 5)] * 4, 128)
    assert layout.offsets == (0, 384, 768, 1152)
    assert layout.total_bytes == layout.lower_bound_bytes == 1536


def test_half_open_intervals_share_memory():
    layout = check_layout([Interval(256, 0, 3), Interval(256, 3, 5)], 256)
    assert layout.offsets == (0, 0)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Interval(0, 0, 1), "size must be positive"),
        (lambda: Interval(-4, 0, 1), "size must be positive"),
        (lambda: Interval(8, 3, 3), "must be greater than start"),
        (lambda: Interval(8, 4, 2), "must be greater than start"),
        (lambda: plan_arena([Interval(8, 0, 1)], alignment=3), "power of two"),
        (lambda: plan_arena([Interval(8, 0, 1)], alignment=2**40 + 1), "power of two"),
        (lambda: plan_arena([Interval(8, 0, 1)], alignment=0), "power of two"),
    ],
)
def test_bad_input_raises_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_non_intervals_raise_type_error():
    with pytest.raises(TypeError, match="must be an Interval"):
        plan_arena([(8, 0, 1)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="must be an int"):
        Interval(8.0, 0, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([1, 2], [0], [1, 1]), "same length"),
        (([0], [0], [1]), "buffer 0: size must be positive"),
        (([8, 8], [0, 5], [1, 5]), r"buffer 1: end \(5\) must be greater than start \(5\)"),
        (([2**62, 2**62], [0, 0], [1, 1]), "overflows"),
        (([2**63 - 1], [0], [1]), "too large"),
    ],
)
def test_bad_input_to_c_raises_value_error(args, match):
    for columns in (args, [np.asarray(x, dtype=np.int64) for x in args]):  # lists, and the int64 overloads
        with pytest.raises(ValueError, match=match):
            _C.plan_arena(*columns)
        with pytest.raises(ValueError, match=match):
            _C.arena_lower_bound(*columns)


def test_int64_columns_give_what_lists_give():
    """The int64 numpy overloads of plan_arena / arena_lower_bound (what plan_arena_columns passes) return
    what the list ones do; other dtypes and non-contiguous arrays take the list path."""
    rng = np.random.default_rng(3)
    for n in (0, 1, 50, 3000):
        starts = rng.integers(0, 200, n)
        sizes, ends = rng.integers(1, 5000, n), starts + rng.integers(1, 40, n)
        lists = [x.tolist() for x in (sizes, starts, ends)]
        for heuristic, stop_at in (("best", -1), ("best", 0), ("greedy_by_breadth", -1)):
            want = _C.plan_arena(*lists, 256, heuristic, stop_at)
            assert _C.plan_arena(sizes, starts, ends, 256, heuristic, stop_at) == want
            assert _C.plan_arena(*(x.astype(np.int32) for x in (sizes, starts, ends)), 256, heuristic, stop_at) == want
        assert _C.arena_lower_bound(sizes, starts, ends, 256) == _C.arena_lower_bound(*lists, 256)
    wide = np.stack([sizes, sizes], axis=1)  # a strided column
    assert not wide[:2, 0].flags.c_contiguous
    assert _C.plan_arena(wide[:2, 0], starts[:2], ends[:2]) == _C.plan_arena(sizes[:2].tolist(), starts[:2].tolist(),
                                                                           ends[:2].tolist())
    with pytest.raises(TypeError):
        _C.plan_arena(np.array([8.5]), np.array([0]), np.array([1]))  # floats are refused, as in a list


def test_c_rejects_bad_alignment():
    with pytest.raises(ValueError, match="power of two, got 48"):
        _C.plan_arena([8], [0], [1], 48)


def test_ten_thousand_buffers():
    # A scale check, not a timed test: the planner is O(n^2) with a tiny constant and should
    # take well under a second here. Lifetimes look like a training step: short-lived buffers
    # around a time axis, sizes spread over three orders of magnitude.
    rng = random.Random(0)
    sizes, starts, ends = [], [], []
    for _ in range(10_000):
        start = rng.randrange(0, 20_000)
        sizes.append(rng.choice([1 << 20, 4 << 20, 16 << 20]) + rng.randrange(0, 1 << 20))
        starts.append(start)
        ends.append(start + rng.randrange(1, 400))
    lower = _C.arena_lower_bound(sizes, starts, ends, 256)
    for heuristic in ARENA_HEURISTICS:
        offsets, total, _, _ = _C.plan_arena(sizes, starts, ends, 256, heuristic)
        assert all(o % 256 == 0 for o in offsets)
        assert count_conflicts(offsets, sizes, starts, ends, 256) == 0
        assert total >= lower


@PROPERTY_SETTINGS
@given(st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 40), st.integers(1, 30)), max_size=60),
       st.sampled_from([1, 64, 256]))
def test_columns_give_the_interval_layout(rows, alignment):
    """plan_arena_columns (what the scheduler calls, without Interval objects) is plan_arena."""
    from offload.planning.arena import plan_arena_columns
    intervals = [Interval(size, start, start + length) for size, start, length in rows]
    assert plan_arena_columns([iv.size for iv in intervals], [iv.start for iv in intervals],
                              [iv.end for iv in intervals], alignment) == plan_arena(intervals, alignment)


def test_columns_raise_the_interval_errors():
    from offload.planning.arena import plan_arena_columns
    for cols, err, match in [(([8, 0], [0, 0], [1, 1]), ValueError, "size must be positive"),
                             (([8, 8], [0, 3], [1, 3]), ValueError, "must be greater than start"),
                             (([8.0], [0], [1]), TypeError, "must be an int"),
                             (([True], [0], [1]), TypeError, "must be an int"),
                             (([8, 8], [0], [1]), ValueError, "same length"),
                             (([8], [0], [1]), ValueError, "power of two")]:
        with pytest.raises(err, match=match):
            plan_arena_columns(*cols, alignment=48 if match == "power of two" else 256)
    assert plan_arena_columns([], [], []) == plan_arena([])


@settings(PROPERTY_SETTINGS, max_examples=60)
@given(st.lists(st.tuples(st.integers(0, 300), st.sampled_from([1, 2, 3, 5, 40, 150, 400]),
                          st.sampled_from([256, 512, 1024, 300])), max_size=80),
       st.booleans())
def test_mixed_lifetimes_match_reference(rows, equal_sizes):
    """Short and long lifetimes together (the placer indexes placed buffers per lifetime class); with equal
    power-of-two sizes every size is its own size class (those heuristics are not rerun)."""
    check_layout([Interval(256 if equal_sizes else size, start, start + length) for start, length, size in rows], 256)


def test_many_buffers_on_threads_match_reference():
    """Over 2,000 buffers: the heuristics run on threads; equal sizes, short buffers and a few long ones."""
    rng = random.Random(7)
    intervals = []
    for _ in range(2500):
        start = rng.randrange(0, 5000)
        intervals.append(Interval(1024, start, start + (rng.choice([1, 2, 4, 8]) if rng.random() < 0.97
                                                        else rng.randrange(500, 3000))))
    check_layout(intervals, 256)


def check_stop_at_bound(intervals: list[Interval], alignment: int = 256) -> tuple[ArenaLayout, ArenaLayout]:
    """plan_arena_columns(stop_at_bound=True) against the reference with the same stop and against the
    full run: the same offsets, total and heuristic; only the heuristics run are listed."""
    from offload.planning.arena import plan_arena_columns
    cols = [[iv.size for iv in intervals], [iv.start for iv in intervals], [iv.end for iv in intervals]]
    full = plan_arena_columns(*cols, alignment)
    fast = plan_arena_columns(*cols, alignment, stop_at_bound=True)
    offsets, total, winner, totals = arena_reference.plan(*cols, alignment, "best", full.lower_bound_bytes)
    assert (fast.offsets, fast.total_bytes, fast.heuristic, dict(fast.candidates)) == (tuple(offsets), total,
                                                                                      winner, totals)
    assert (fast.offsets, fast.total_bytes, fast.heuristic, fast.lower_bound_bytes) == (
        full.offsets, full.total_bytes, full.heuristic, full.lower_bound_bytes)
    stopped = totals == {ARENA_HEURISTICS[0]: full.lower_bound_bytes}
    assert stopped == (dict(full.candidates)[ARENA_HEURISTICS[0]] == full.lower_bound_bytes)
    assert fast.candidates == (full.candidates[:1] if stopped else full.candidates)
    return full, fast


@PROPERTY_SETTINGS
@given(intervals=intervals_strategy(), alignment=st.sampled_from([1, 64, 256]))
def test_stop_at_bound_keeps_the_best_layout(intervals, alignment):
    check_stop_at_bound(intervals, alignment)


def test_stop_at_bound_stops_only_at_the_bound():
    # the WINS cases where greedy_by_size is not optimal run every heuristic; a chain stops after the first
    for winner, (sizes, starts, ends, _) in WINS.items():
        full, fast = check_stop_at_bound([Interval(*x) for x in zip(sizes, starts, ends)], 1)
        assert len(fast.candidates) == len(ARENA_HEURISTICS)
    full, fast = check_stop_at_bound([Interval(1024, i, i + 2) for i in range(3000)])  # threads, if not stopped
    assert fast.total_bytes == fast.lower_bound_bytes == 2048 and len(fast.candidates) == 1
    # above 2,000 buffers, not stopped: the other heuristics on threads
    check_stop_at_bound([Interval(x, s, s + 3) for s, x in zip(range(0, 6000, 2), [300, 1000, 3001] * 1000)], 1)
    _, _, _, totals = _C.plan_arena([8], [0], [1], 256, "greedy_by_breadth", 0)  # stop_at: "best" only
    assert list(totals) == ["greedy_by_breadth"]
