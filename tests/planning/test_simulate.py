"""The simulator on programs small enough to work out by hand, and the hardware model."""

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.planning import simulate as simulate_module
from offload.planning.hw import PRESETS, latency_curve, load_hw
from offload.planning.flat_waits import FlatWaits
from offload.planning.simulate import (
    STEP_START,
    Program,
    physical_bound,
    simulate,
)
from tests.support.planning import flat_hw, lane_program


def test_compute_only():
    r = simulate(lane_program(), flat_hw())
    assert r.step_s == 3.0 and r.stall_s == 0.0


def test_a_prefetch_hides_behind_compute_and_a_late_one_stalls():
    # copy 0 (500 B = 0.5 s) issued at event 0 and needed at event 1: hidden. Copy 1 (2000 B = 2 s) issued
    # at event 1, needed at event 2: it arrives at 1 + 2 = 3 s, compute reaches event 2 at 2 s: 1 s stall.
    p = lane_program(h2d_event=(0, 1), h2d_bucket=(0, 1), h2d_bytes=(500, 2000), waits=((), (0,), (1,)))
    r = simulate(p, flat_hw())
    assert r.stall_s == pytest.approx(1.0)
    assert r.stall_per_event == pytest.approx((0.0, 0.0, 1.0))
    assert r.step_s == pytest.approx(4.0)
    assert r.h2d_bytes == 2500
    # the stall is credited to the copies of the busy period it waited on, in proportion to their time:
    # copy 0 ended before copy 1 started (separate busy periods), so copy 1 gets all of it
    assert r.copy_credit == pytest.approx((0.0, 1.0))


def test_fifo_queue_and_credit_sharing():
    # both copies issued at the start; compute needs copy 1 at event 0: it waits for copy 0 then copy 1
    p = lane_program(h2d_event=(STEP_START, STEP_START), h2d_bucket=(0, 1), h2d_bytes=(1000, 3000),
                 waits=((1,), (), ()))
    r = simulate(p, flat_hw())
    assert r.stall_s == pytest.approx(4.0)
    assert r.copy_credit == pytest.approx((1.0, 3.0))  # 4 s shared 1:3 by duration
    assert r.step_s == pytest.approx(7.0)


def test_grads_adam_and_duplex():
    # grads of 1000 B go to the host at event 1 (1 s), then AdamW of 100 params (1 s): done at 1 + 1 + 1 = 3 s
    p = lane_program(d2h_event=(1,), d2h_bucket=(0,), d2h_bytes=(1000,), adam_numel=(100,))
    assert simulate(p, flat_hw()).step_s == pytest.approx(3.0)
    # after backward (the baselines' rule): AdamW starts at 3 s, ends at 4 s
    late = lane_program(d2h_event=(1,), d2h_bucket=(0,), d2h_bytes=(1000,), adam_numel=(100,), adam_after_backward=True)
    assert simulate(late, flat_hw()).step_s == pytest.approx(4.0)
    # a host-to-device copy that starts while the grads are copying runs at half speed
    both = lane_program(h2d_event=(1,), h2d_bucket=(1,), h2d_bytes=(1000,), waits=((), (), (0,)),
                    d2h_event=(0,), d2h_bucket=(0,), d2h_bytes=(2000,), adam_numel=(0,))
    r = simulate(both, flat_hw(duplex=0.5))
    assert r.h2d_busy_s == pytest.approx(2.0)
    assert r.stall_s == pytest.approx(1.0)  # issued at 1 s, done at 3 s, needed at 2 s


def test_compute_waits_for_a_reused_grad_slots_copy_and_not_for_a_fresh_one():
    # grads of 2000 B (2 s) go to the host at event 0; event 1's grad slot reuses their bytes: compute reaches
    # it at 1 s and waits till 2 s ([Note: waits on a reused grad slot]). With a fresh slot: no wait.
    base = dict(d2h_event=(0, 1), d2h_bucket=(0, 1), d2h_bytes=(2000, 500), adam_numel=(0, 0))
    fresh = lane_program(**base)
    reused = lane_program(**base, grad_waits=((), (0,), ()))
    hw = flat_hw()
    for sim in (simulate, simulate_module.simulate_reference):
        r = sim(reused, hw)
        assert r.stall_per_event == (0.0, 1.0, 0.0) and r.stall_s == r.grad_stall_s == 1.0
        assert r.step_s == 4.0 and r.copy_credit == () and r.copy_stall_s == 0.0
        f = sim(fresh, hw)
        assert f.stall_s == f.grad_stall_s == 0.0 and f.step_s == 3.0
    # behind a host-to-device wait: only the time past that copy's arrival is the grad copy's
    both = lane_program(**base, h2d_event=(STEP_START,), h2d_bucket=(5,), h2d_bytes=(1500,), waits=((), (0,), ()),
                        grad_waits=((), (0,), ()))
    for sim in (simulate, simulate_module.simulate_reference):
        r = sim(both, hw)
        assert r.stall_per_event == (0.0, 1.0, 0.0) and r.grad_stall_s == 0.5 and r.copy_stall_s == 0.5
        assert r.copy_credit == (0.5,)  # the grad copy's share is no host-to-device copy's credit


@pytest.mark.parametrize("grad_waits", [
    ((), (), (1,)),  # copy 1 is issued at event 2 itself
    ((), (0,), ()),  # copy 0 is issued at event 1 itself
    ((0,), (), ()),  # before copy 0 is issued
    ((), (), (7,)),  # no such copy
    ((),),  # not one entry per event
])
def test_a_grad_wait_must_name_a_copy_issued_before_its_event(grad_waits):
    p = lane_program(d2h_event=(1, 2), d2h_bucket=(0, 1), d2h_bytes=(10, 10), adam_numel=(0, 0),
                     grad_waits=grad_waits)
    for sim in (simulate, simulate_module.simulate_reference):
        with pytest.raises(ValueError):
            sim(p, flat_hw())


def test_physical_bound_names_its_limit():
    b = physical_bound(1.0, 5000, 0, 10, flat_hw())
    assert b.limit == "h2d" and b.seconds == pytest.approx(5.0)


def test_curve_interpolation_and_hint():
    hw = PRESETS["pcie4"]
    assert hw.h2d_seconds(0) == 0.0
    small, big = hw.h2d_seconds(4096), hw.h2d_seconds(256 << 20)
    assert 4096 / small < 256 * 2**20 / big <= hw.peak_h2d  # bandwidth grows with size
    assert hw.h2d_seconds(1 << 30) == pytest.approx((1 << 30) / hw.h2d[-1][1])  # beyond the curve: its end
    hint = hw.bucket_bytes_hint()
    assert dict(hw.h2d)[hint] >= 0.9 * hw.peak_h2d
    curve = latency_curve(1e9, 1e-5)
    assert curve[0][1] < curve[-1][1] < 1e9


def test_load_hw(tmp_path):
    assert load_hw("PCIE5").name == "pcie5"
    path = tmp_path / "probe.json"
    path.write_text(json.dumps({"hardware_model": PRESETS["pcie3"].to_dict()}))
    assert load_hw(path) == PRESETS["pcie3"]
    with pytest.raises(ValueError, match="pcie3"):
        load_hw("pcie9")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="offload probe"):
        load_hw(bad)
    with pytest.raises(ValueError, match="duplex"):
        flat_hw(duplex=0)


@st.composite
def _programs(draw):
    """Random lane programs: copies issued anywhere (unsorted, before the step, never), waits on any copy,
    grads flushed at the end of backward, both AdamW rules, waits on grad copies issued earlier (or none)."""
    n = draw(st.integers(1, 12))
    compute = draw(st.lists(st.sampled_from([0.0, 0.25, 1.0, 1e-5, 3.0]), min_size=n, max_size=n))
    nh = draw(st.integers(0, 10))
    h2d_event = draw(st.lists(st.integers(STEP_START, n), min_size=nh, max_size=nh))
    h2d_bytes = draw(st.lists(st.integers(1, 5000), min_size=nh, max_size=nh))
    waits = tuple(tuple(draw(st.lists(st.integers(0, nh - 1), max_size=3))) if nh else () for _ in range(n))
    nd = draw(st.integers(0, 6))
    d2h_event = draw(st.lists(st.integers(0, n), min_size=nd, max_size=nd))
    grad_waits: tuple = ()
    if draw(st.booleans()):  # waits on grad copies issued at earlier events
        grad_waits = tuple(tuple(draw(st.lists(st.sampled_from(earlier), max_size=2)))
                           if (earlier := [k for k, e in enumerate(d2h_event) if e < i]) else () for i in range(n))
    return Program(grad_waits=grad_waits, compute_s=tuple(compute), h2d_event=tuple(h2d_event), h2d_bucket=tuple(range(nh)),
                   h2d_bytes=tuple(h2d_bytes), waits=waits, d2h_event=tuple(d2h_event), d2h_bucket=tuple(range(nd)),
                   d2h_bytes=tuple(draw(st.lists(st.integers(1, 5000), min_size=nd, max_size=nd))),
                   adam_numel=tuple(draw(st.lists(st.integers(0, 500), min_size=nd, max_size=nd))),
                   adam_after_backward=draw(st.booleans()))


@pytest.mark.skipif(simulate_module._C is None, reason="the C++ extension is not built")
@settings(max_examples=300, deadline=None)
@given(program=_programs(), duplex=st.sampled_from([1.0, 0.7]), hw_name=st.sampled_from(["flat", "pcie4"]))
def test_cpp_lanes_equal_the_python_reference_bitwise(program, duplex, hw_name):
    hw = flat_hw(duplex=duplex) if hw_name == "flat" else PRESETS["pcie4"]
    assert simulate(program, hw) == simulate_module.simulate_reference(program, hw)


@settings(max_examples=100, deadline=None)
@given(program=_programs())
def test_flat_waits_stand_for_the_tuple_of_tuples(program):
    """A Program whose waits are a FlatWaits (what the scheduler builds) reads, compares, hashes and
    simulates the same as the tuple of tuples it stands for."""
    waits = program.waits
    ptr = [0]
    for w in waits:
        ptr.append(ptr[-1] + len(w))
    flat = FlatWaits(ptr, [k for w in waits for k in w])
    assert len(flat) == len(waits) and list(flat) == list(waits)
    assert [flat[i] for i in range(-len(waits), len(waits))] == list(waits) * 2
    assert flat == waits and waits == flat and hash(flat) == hash(waits) and flat[1:] == waits[1:]
    with pytest.raises(IndexError):
        flat[len(waits)]
    other = dataclasses.replace(program, waits=flat)
    assert other == program and hash(other) == hash(program)
    hw = PRESETS["pcie4"]
    assert simulate(other, hw) == simulate(program, hw) == simulate_module.simulate_reference(other, hw)
