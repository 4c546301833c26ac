"""The greedy's move sequences (``offload/planning/greedy.py``): which of their points a capacity keeps
([Note: points over the capacity])."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload.planning.greedy import Greedy, compute_times
from tests.support.planning import draw_compute, machines, traces

UNBOUNDED = 2**62


def _key(p):
    return (p.mode, p.resident, p.peak, p.step_s, p.flat.tobytes())


def _fitting(points, capacity):
    return [_key(p) for p in points if p.peak <= capacity]


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), machines(), st.data())
def test_a_capacity_keeps_every_point_of_the_sequences_that_fits(case, hw, data):
    """A point over the capacity does not end its mode's sequence: every point of the whole (capacity-free)
    sequences that fits is kept, in order, by the C++ loop and by the Python reference alike."""
    trace, buckets = case
    g = Greedy.of(trace, buckets, 4, hw, compute_times(trace, draw_compute(data.draw, trace)))
    every = g.candidates_reference(UNBOUNDED)
    peaks = sorted({p.peak for p in every})
    capacity = data.draw(st.sampled_from(peaks)) - data.draw(st.sampled_from([0, 0, 1])) if peaks else 0
    want = _fitting(every, capacity)
    assert [_key(p) for p in g.candidates_reference(capacity)] == want
    assert [_key(p) for p in g.candidates(capacity)] == want


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), machines(), st.data())
def test_the_stop_rules_least_peak_is_just_in_times_peak_and_under_every_later_point(case, hw, data):
    """``least_peak(R)`` is the live bytes, at their most, of holding R and every other bucket for its need
    intervals only, which is just-in-time streaming's peak with R resident (exactly); and every point of a
    sequence is at least the ``least_peak`` of every earlier point's resident buckets (what lets the
    sequence stop)."""
    trace, buckets = case
    g = Greedy.of(trace, buckets, 4, hw, compute_times(trace, draw_compute(data.draw, trace)))
    x = g.inputs
    resident = frozenset(data.draw(st.sets(st.sampled_from(range(x.nb)))) if x.nb else set())
    jit = g.profile(resident, None, g.placed("just in time", resident, frozenset()))
    assert g.least_peak(resident) == (int(jit.max()) if len(jit) else 0)
    for mode in ("latest", "lookahead", "just in time"):
        seq = [p for p in g.candidates_reference(UNBOUNDED) if p.mode == mode]
        for k, p in enumerate(seq):
            assert all(q.peak >= g.least_peak(p.resident) for q in seq[k:]), (mode, k)
