"""The greedy scheduler's move sequence in C++ (cpp/greedy.cpp, ``Greedy.candidates``) against its Python
reference (``Greedy.candidates_reference``): the same points, every field equal and every float bitwise
equal, on random traces, machines, compute times and capacities."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload.planning.greedy import MODES, Greedy, compute_times
from offload.planning.hw import PRESETS
from tests.support.planning import chain_trace, draw_compute, machines, traces

try:
    from offload import _C
except ImportError:  # a source tree without the built extension
    _C = None

pytestmark = pytest.mark.skipif(_C is None, reason="needs the built extension (offload._C)")

LANE_FLOATS = ("step_s", "compute_s", "stall_s", "h2d_busy_s", "d2h_busy_s", "adam_s", "compute_end", "grad_stall_s")


def _bits(x) -> bytes:
    return np.asarray(x, dtype=np.float64).tobytes()


def _assert_same_points(got, want):
    assert [p.mode for p in got] == [p.mode for p in want]
    for k, (a, b) in enumerate(zip(got, want)):
        where = f"point {k} ({a.mode})"
        assert a.resident == b.resident and type(a.resident) is frozenset, where
        assert a.peak == b.peak and type(a.peak) is int, where
        assert a.rank == b.rank and all(type(x) is int for x in a.rank), where
        assert a.flat.dtype == b.flat.dtype == np.int64 and a.flat.shape == b.flat.shape, where
        assert np.array_equal(a.flat, b.flat), where
        for f in LANE_FLOATS:
            x, y = getattr(a.lanes, f), getattr(b.lanes, f)
            assert type(x) is float and _bits(x) == _bits(y), (where, f, x, y)
        assert a.lanes.h2d_bytes == b.lanes.h2d_bytes and a.lanes.d2h_bytes == b.lanes.d2h_bytes, where
        for f in ("stall_per_event", "copy_credit"):
            x, y = getattr(a.lanes, f), getattr(b.lanes, f)
            assert x.dtype == y.dtype == np.float64 and _bits(x) == _bits(y), (where, f)
        assert a.lanes.refresh_passes == b.lanes.refresh_passes, where
        assert a.sim == b.sim, where  # the SimResult the plan keeps


def _compare(g, capacity):
    got = g._candidates_cpp(capacity)
    assert got is not None, "the C++ loop fell back to Python"
    want = g.candidates_reference(capacity)
    _assert_same_points(got, want)
    return want


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), machines(), st.data())
def test_cpp_points_equal_the_python_loop_on_random_machines(case, hw, data):
    trace, buckets = case
    # both refresh models ([Note: the refresh pipelined, modelled] in simulate.py)
    g = Greedy.of(trace, buckets, 4, hw, tuple(draw_compute(data.draw, trace)), data.draw(st.booleans()))
    everything = _compare(g, 10**12)
    peaks = sorted({p.peak for p in everything})
    # capacities that cut each sequence somewhere (the point at the capacity is in, the next one out)
    for capacity in (data.draw(st.sampled_from(peaks)), data.draw(st.integers(-5, 60000)), -(2**70), 2**70):
        _compare(g, capacity)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_cpp_points_equal_the_python_loop_with_the_default_machine(case):
    trace, buckets = case
    g = Greedy.of(trace, buckets, 4, PRESETS["pcie4"], compute_times(trace, None))
    _compare(g, 10**12)


@pytest.mark.parametrize("n_layers", [1, 40, 300])
@pytest.mark.parametrize("hw", ["pcie4", "pcie5"])
def test_cpp_points_equal_the_python_loop_on_chains(n_layers, hw):
    trace, buckets = chain_trace(n_layers, 1000)
    g = Greedy.of(trace, buckets, 4, PRESETS[hw], compute_times(trace, [1e-5] * len(trace.events)))
    points = _compare(g, 10**12)
    assert {p.mode for p in points} == set(MODES) and len(points) > 3
    assert g.candidates(10**12) is not None


@pytest.mark.parametrize("hw", ["pcie4", "pcie5"])
def test_cpp_points_equal_the_python_loop_where_backward_waits_for_reused_grad_slots(hw):
    """Grads far larger than the weights' share of compute: backward waits for each reused grad slot's copy
    ([Note: waits on a reused grad slot]); the waits and their stall are the same in both loops, and the
    moves are ranked on the host-to-device stall only."""
    trace, buckets = chain_trace(60, 1 << 18)
    g = Greedy.of(trace, buckets, 4, PRESETS[hw], compute_times(trace, [1e-5] * len(trace.events)))
    assert len(g.inputs.grad_wait_copy) == 59  # every slot but the first takes over the one before it
    points = _compare(g, 10**12)
    assert sum(0 < p.lanes.grad_stall_s < p.lanes.stall_s for p in points) > len(points) // 2


def test_a_zero_score_denominator_runs_the_reference_which_raises():
    """Where a score would divide by zero (numpy raises FloatingPointError), the C++ loop hands over to the
    Python one, which raises it: the same error as without the extension."""
    trace, buckets = chain_trace(20, 1000)
    g = Greedy.of(trace, buckets, 4, PRESETS["pcie4"], compute_times(trace, [1e-6] * len(trace.events)))
    size = g.inputs.size.copy()
    size[5] = 0  # a zero-byte bucket: no cost and no size to divide by
    g = Greedy(dataclasses.replace(g.inputs, size=size))
    assert g._candidates_cpp(10**12) is None
    with pytest.raises(FloatingPointError):
        g.candidates_reference(10**12)
    with pytest.raises(FloatingPointError):
        g.candidates(10**12)


def test_inconsistent_constants_are_refused():
    trace, buckets = chain_trace(5, 1000)
    g = Greedy.of(trace, buckets, 4, PRESETS["pcie4"], compute_times(trace, None))
    assert g._candidates_cpp(10**12) is not None
    with pytest.raises(ValueError, match="mode"):
        g._kernel.points(3, 0)
    g = Greedy.of(trace, buckets, 4, PRESETS["pcie4"], compute_times(trace, None))
    g = Greedy(dataclasses.replace(g.inputs, tau=g.inputs.tau[:-1]))
    with pytest.raises(ValueError, match="tau"):
        g._candidates_cpp(10**12)
    g = Greedy.of(trace, buckets, 4, PRESETS["pcie4"], compute_times(trace, None))
    g = Greedy(dataclasses.replace(g.inputs, use_s=g.inputs.use_s[::-1].copy()))
    with pytest.raises(ValueError, match="grouped by bucket"):
        g._candidates_cpp(10**12)
