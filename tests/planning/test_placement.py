"""Placements (issue 18): the placement-aware bound is a true lower bound of every placement's simulated
step, equals the all-on-the-CPU bound when nothing fits on the device, and shrinks as the budget grows; the
simulator's device AdamW lane."""

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload import BudgetTooSmallError
from offload.errors import InvariantError
from offload.planning.device_optimizer import least_live_bytes_of, restrict
from offload.planning.greedy import Greedy, compute_times
from offload.planning.hw import PRESETS, HardwareModel
from offload.planning.placement import Placement, least_live_bytes, placement_bound, placement_bytes, state_nbytes
from offload.planning.schedule import (
    BufferKind,
    build_plan,
    least_traffic,
    plan_bound,
    program_of,
    validate_plan,
)
from offload.planning.simulate import physical_bound, simulate, simulate_reference
from offload.tools.baselines import Case, twin_flow, zero_offload

from .test_greedy_kernel import _C, _compare
from tests.support.planning import chain_trace, draw_compute, flat_hw, lane_program, machines, plan_that_fits, traces


def test_presets_model_the_device_adamw_from_memory_bandwidth():
    for hw in PRESETS.values():
        assert hw.device_adam_rate == pytest.approx(hw.device_bytes_per_s / 28)
        assert "modelled" in hw.notes and not hw.measured
    # a probe file written before the field existed still loads, and derives the rate
    d = PRESETS["pcie4"].to_dict()
    del d["device_adam_params_per_s"]
    assert HardwareModel.from_dict(d).device_adam_rate == pytest.approx(1.5e12 / 28)


def test_bound_by_hand():
    """A chain of 10 buckets of 100 fp32 elements (400 B each; 8 B/param of state: 1200 B per device bucket).
    compute 1 s; each bucket: H2D and D2H 0.4 s (1000 B/s), CPU AdamW 1 s (100/s), device AdamW 0.1 s.
    All on the CPU: 10 s of CPU AdamW. With k buckets on the device: max(1 + 0.1 k, 4 - 0.4 k, 10 - k), least
    where 1 + 0.1 k = 10 - k: k = 9/1.1, 1.818... s; that needs 9/1.1 * 1200 B of capacity.
    Every plan holds one bucket (512 B aligned) at each use, or the grad slot (512 B) it fills just after:
    below 512 B of capacity no placement fits; at 512 B, 512/1200 of a bucket's updates can leave the CPU."""
    trace, buckets = chain_trace(10, 100)
    hw = flat_hw(device_adam=1000.0)
    compute = 1.0
    assert least_live_bytes(trace, buckets, 4) == 512
    nothing = placement_bound(trace, buckets, 4, 511, compute, hw)
    assert nothing.limit == "memory" and nothing.seconds == float("inf")
    tight = placement_bound(trace, buckets, 4, 512, compute, hw)
    assert tight.limit == "cpu_adam" and tight.seconds == pytest.approx(10.0 - 512 / 1200)
    k = 9 / 1.1
    best = placement_bound(trace, buckets, 4, 10**9, compute, hw)
    assert best.seconds == pytest.approx(1 + 0.1 * k) and best.parts["device_bytes"] == pytest.approx(k * 1200)
    half = placement_bound(trace, buckets, 4, 3 * 1200, compute, hw)  # room for 3 buckets
    assert half.seconds == pytest.approx(7.0) and half.limit == "cpu_adam"


def test_causal_bound_by_hand():
    """The same chain, forward 0.5 s of compute: no grad before backward starts, and backward starts only
    once the forward's 4000 B crossed the link beyond what the arena held at the start: capacity less the
    device state, 2/3 of each device bucket's 1200 B (link 1000 B/s). So the CPU AdamW ends no earlier than
    max(0.5, (4000 - capacity + 2/3 sigma) / 1000) + 10 - sigma / 1200."""
    trace, buckets = chain_trace(10, 100)
    hw = flat_hw(device_adam=1000.0)
    # 3600 B: for sigma > 150 B the transfer sets the start; the sum falls by sigma / 6000: least at 3600 B
    roomy = placement_bound(trace, buckets, 4, 3600, 1.0, hw, forward_s=0.5)
    assert roomy.seconds == pytest.approx(0.4 + 3600 / 1500 + 10.0 - 3) and roomy.limit == "cpu_adam"
    assert roomy.parts["device_bytes"] == pytest.approx(3600)
    # 2000 B: the transfer sets the start from sigma = 0
    tight = placement_bound(trace, buckets, 4, 2000, 1.0, hw, forward_s=0.5)
    assert tight.seconds == pytest.approx(12.0 - 2000 / 6000) and tight.limit == "cpu_adam"
    # without forward_s: the issue's formula, lanes free to overlap the forward
    assert placement_bound(trace, buckets, 4, 3600, 1.0, hw).seconds == pytest.approx(7.0)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_least_live_bytes_from_the_greedys_arrays_is_the_same_and_below_every_plan(case):
    trace, buckets = case
    least = least_live_bytes(trace, buckets, 4)
    g = Greedy.of(trace, buckets, 4, PRESETS["pcie4"], compute_times(trace, None))
    assert least_live_bytes_of(g.inputs) == least
    plan = plan_that_fits(trace, buckets, 0, PRESETS["pcie4"], None)  # the leanest plan there is
    assert plan.lower_bound_bytes >= least


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), machines(), st.data())
def test_bound_below_the_least_live_bytes_is_infinite_and_more_room_never_raises_it(case, hw, data):
    trace, buckets = case
    compute = sum(draw_compute(data.draw, trace))
    least_bytes = least_live_bytes(trace, buckets, 4)
    if least_bytes:
        assert placement_bound(trace, buckets, 4, least_bytes - 1, compute, hw).seconds == float("inf")
    else:  # nothing to hold: without room the bound is today's (every update on the CPU)
        least = least_traffic(trace, buckets, 4, 0)
        cpu = physical_bound(compute, least["h2d"], least["d2h"], least["adam_numel"], hw)
        assert placement_bound(trace, buckets, 4, 0, compute, hw).seconds == pytest.approx(cpu.seconds, rel=1e-12)
    caps = sorted(data.draw(st.lists(st.integers(0, 60000), min_size=2, max_size=4)) + [least_bytes])
    got = [placement_bound(trace, buckets, 4, c, compute, hw).seconds for c in caps]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(got, got[1:]))
    # and it never exceeds today's bound at the same capacity, where a placement fits
    least = least_traffic(trace, buckets, 4, caps[-1])
    cpu = physical_bound(compute, least["h2d"], least["d2h"], least["adam_numel"], hw)
    assert got[-1] <= cpu.seconds * (1 + 1e-12)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), machines(), st.data())
def test_bound_is_below_the_greedy_plan(case, hw, data):
    trace, buckets = case
    compute = draw_compute(data.draw, trace)
    budget = data.draw(st.integers(0, 60000))
    try:
        plan = build_plan(trace, buckets, itemsize=4, budget_bytes=budget, fixed_bytes=0, hw=hw, compute_s=compute)
    except BudgetTooSmallError as e:
        plan = build_plan(trace, buckets, itemsize=4, budget_bytes=e.min_budget_bytes, fixed_bytes=0, hw=hw,
                          compute_s=compute)
    bound = placement_bound(trace, buckets, 4, plan.capacity_bytes, sum(compute), hw)
    assert plan.simulated.step_s >= bound.seconds * (1 - 1e-9)
    assert bound.seconds <= plan_bound(plan, hw, compute).seconds * (1 + 1e-12)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), machines(), st.data())
def test_bound_is_below_every_twin_flow_ratio_that_fits(case, hw, data):
    """Twin-Flow plans put optimizer state on the device: the bound must hold for them too."""
    trace, buckets = case
    compute = tuple(draw_compute(data.draw, trace))
    params = sum(b.nbytes(4) for b in buckets)
    budget = data.draw(st.integers(0, 4 * params + 20000))
    c = Case(trace, tuple(buckets), 4, hw, compute, budget)
    for ratio in (0.0, 0.3, 0.7, 1.0):
        r = twin_flow(c, ratios=(ratio,))
        if r.fits:
            for fwd in (0.0, sum(compute[:trace.num_forward])):  # the causal form too
                bound = placement_bound(trace, buckets, 4, budget - c.extra, sum(compute), hw, forward_s=fwd)
                assert r.step_s >= bound.seconds * (1 - 1e-9)


# --- the simulator's device AdamW lane -------------------------------------------------------------------


def test_device_adamw_runs_on_the_compute_lane():
    hw = flat_hw(device_adam=100.0)
    # 50 params at event 1 (0.5 s, delays event 2), 200 after backward (2 s, beside a 1 s CPU AdamW)
    p = lane_program(device_adam_numel=(0, 50, 0, 200), d2h_event=(3,), d2h_bucket=(0,), d2h_bytes=(0,),
                 adam_numel=(100,))
    for sim in (simulate, simulate_reference):
        r = sim(p, hw)
        assert r.device_adam_s == pytest.approx(2.5)
        assert r.compute_s == pytest.approx(5.5)
        assert r.step_s == pytest.approx(3.5 + 2.0)  # compute ends at 3.5; the tail 2 s outlasts the CPU's 1 s
        assert r.adam_s == pytest.approx(1.0)
    assert simulate(p, hw) == simulate_reference(p, hw)
    with pytest.raises(ValueError, match="events \\+ 1"):
        simulate(lane_program(device_adam_numel=(1, 2, 3)), hw)


def test_deferred_round_trip_on_the_lanes():
    """[Note: the deferred round trip]: 200 params updated on the device after backward (2 s) once their
    800 B of summed grads came back (0.8 s at 1000 B/s): the step lasts compute end + 0.8 + 2 s."""
    hw = flat_hw(device_adam=100.0)
    p = lane_program(device_adam_numel=(0, 0, 0, 200), device_return_bytes=(800,), d2h_event=(3,), d2h_bucket=(0,),
                     d2h_bytes=(800,), adam_numel=(0,))
    for sim in (simulate, simulate_reference):
        r = sim(p, hw)
        assert r.step_s == pytest.approx(3.0 + 0.8 + 2.0)
        assert r.h2d_bytes == 800 and r.h2d_busy_s == pytest.approx(0.8) and r.d2h_bytes == 800
        assert r.device_adam_s == pytest.approx(2.0) and r.adam_s == 0
    assert simulate(p, hw) == simulate_reference(p, hw)


def test_deferred_device_buckets_send_their_grads_to_the_host_and_get_them_back_in_step():
    """With updates deferred to step(), a device-optimizer bucket's grads go to the host (4 ms each here)
    and its fp32 sums come back (4 ms) before its device update after backward: the plan's simulated step
    counts both, and the choice still puts every bucket on the device where the CPU AdamW is the wall.
    Its grad copies (4 ms each) outrun backward (2 ms per bucket), so backward waits for them to free the
    grad slots it reuses, double-buffered or not ([Note: waits on a reused grad slot] in simulate.py): the
    step counts that stall too."""
    trace, buckets, hw, compute = _cpu_bound_chain()
    budget = 10**7
    over = plan_that_fits(trace, buckets, budget, hw, compute, device_optimizer=True)
    plan = plan_that_fits(trace, buckets, budget, hw, compute, device_optimizer=True, deferred=True)
    assert plan.deferred and not over.deferred
    assert len(plan.device_optimizer) == len(buckets) == len(over.device_optimizer)
    validate_plan(plan)
    program = program_of(plan, compute)
    numel = sum(b.trainable_numel for b in buckets)
    assert set(program.d2h_bucket) == set(range(len(buckets))) and sum(program.adam_numel) == 0
    assert program.device_return_bytes == tuple(4 * b.trainable_numel for b in buckets)
    assert sum(program.device_adam_numel) == program.device_adam_numel[-1] == numel  # all after backward
    sim = plan.simulated
    assert sim.step_s == pytest.approx(simulate(program, hw).step_s, rel=1e-12)
    assert sim.adam_s == 0 and sim.d2h_bytes == 4 * numel and sim.h2d_bytes == 4 * numel
    back = len(buckets) * hw.h2d_seconds(4000)
    assert sim.grad_stall_s > 0 and sim.grad_stall_s == sim.stall_s
    assert sim.step_s == pytest.approx(sum(compute) + sim.grad_stall_s + back + hw.device_adam_seconds(numel),
                                       rel=1e-9)
    assert sim.step_s > over.simulated.step_s + back * 0.99  # the round trip is not free


# --- Twin-Flow -------------------------------------------------------------------------------------------


def test_twin_flow_sweep():
    """Ratio 0 is ZeRO-Offload; the sweep's best is never slower than it; the device share costs its
    optimizer state in device memory; with no room for state it falls back to ratio 0."""
    trace, buckets = chain_trace(10, 100)
    hw = flat_hw(device_adam=1000.0)
    compute = tuple(0.1 for _ in trace.events)
    zo = zero_offload(Case(trace, buckets, 4, hw, compute, 10**9))
    state = -(-state_nbytes(buckets[0], 4) // 256) * 256  # each bucket's state, arena-aligned
    roomy = Case(trace, buckets, 4, hw, compute, zo.peak_bytes + 10 * state)
    zero = twin_flow(roomy, ratios=(0.0,))
    assert zero.step_s == zo.step_s and zero.ratio == 0.0 and zero.peak_bytes == zo.peak_bytes
    best = twin_flow(roomy)
    assert best.fits and 0 < best.ratio <= 1 and best.step_s < zo.step_s
    assert best.peak_bytes == zo.peak_bytes + round(best.ratio * 10) * state
    # a larger ratio's state must fit: with room for 3 buckets' state, at most 3 go to the device
    tight = twin_flow(Case(trace, buckets, 4, hw, compute, zo.peak_bytes + 3 * state))
    assert tight.fits and tight.ratio <= 0.3 + 1e-12 and tight.step_s >= best.step_s
    none = twin_flow(Case(trace, buckets, 4, hw, compute, zo.peak_bytes - 1))
    assert not none.fits and none.ratio == 0.0


# --- device-optimizer placements in the planner ------------------------------------------------------------


def _check_device_placement(plan, hw, compute):
    """What a plan with device-optimizer buckets promises: valid (every bucket resident when used, no two
    live buffers overlap, peak within the budget, placements agree with the buffers); each device bucket
    resident with a whole-step STATE buffer in the arena; the simulated step is the plan's own program's;
    device buckets have no copy, no grad copy and no CPU AdamW there, and their device AdamW is counted."""
    validate_plan(plan)
    assert plan.peak_bytes <= plan.budget_bytes
    n = len(plan.trace.events)
    device = set(plan.device_optimizer)
    for b in device:
        assert plan.placement_of(b) is Placement.DEVICE_OPTIMIZER and b in plan.resident
        x = plan.buffers[plan.state_buffer[b]]
        assert x.kind is BufferKind.STATE and (x.start, x.end) == (0, n)
        assert x.size == state_nbytes(plan.buckets[b], 4)
        assert plan.resident_buffer[b] is not None
        assert not any(plan.buffers[k].bucket == b for act in plan.actions for k in act.prefetch)
    for b in set(range(len(plan.buckets))) - device:
        assert plan.state_buffer[b] is None
    program = program_of(plan, compute)
    assert not device & set(program.h2d_bucket)
    assert plan.deferred or not device & set(program.d2h_bucket)  # deferred: summed on the host
    assert sum(program.device_adam_numel) == sum(plan.buckets[b].trainable_numel for b in device)
    again = simulate(program, hw)
    assert again.step_s == pytest.approx(plan.simulated.step_s, rel=1e-9, abs=1e-15)
    assert again.device_adam_s == pytest.approx(plan.simulated.device_adam_s, rel=1e-9, abs=1e-15)


def _device_case(case, hw, data):
    """A drawn case for the device-optimizer searches: (trace, buckets, compute times, hardware), the hardware's
    CPU AdamW made slow half the time (where device optimizer state pays)."""
    trace, buckets = case
    compute = draw_compute(data.draw, trace)
    if data.draw(st.booleans()):
        hw = hw.with_(adam_params_per_s=data.draw(st.floats(1e2, 1e5)))
    return trace, buckets, compute, hw


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), machines(), st.data())
def test_device_optimizer_plans_are_valid_bounded_and_never_slower(case, hw, data):
    trace, buckets, compute, hw = _device_case(case, hw, data)
    params = sum(b.nbytes(4) for b in buckets)
    least = plan_that_fits(trace, buckets, 0, hw, compute, device_optimizer=False).budget_bytes
    budget = least + data.draw(st.integers(0, 5 * params + 20000))
    deferred = data.draw(st.booleans())  # updates in step(): the round trip through the host
    plan = plan_that_fits(trace, buckets, budget, hw, compute, device_optimizer=True, deferred=deferred)
    _check_device_placement(plan, hw, compute)
    # the search includes today's plan (no device state): never slower than it at the same budget
    today = plan_that_fits(trace, buckets, plan.budget_bytes, hw, compute, device_optimizer=False)
    assert not today.device_optimizer
    assert plan.simulated.step_s <= today.simulated.step_s * (1 + 1e-9) + 1e-15
    # both placement bounds hold for it
    forward = sum(compute[:trace.num_forward])
    for fwd in (0.0, forward):
        bound = placement_bound(trace, buckets, 4, plan.capacity_bytes, sum(compute), hw, forward_s=fwd)
        assert plan.simulated.step_s >= bound.seconds * (1 - 1e-9)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), machines(), st.data())
def test_larger_budget_is_never_slower_with_device_optimizer(case, hw, data):
    """test_schedule.py's test_larger_budget_is_never_slower with device-optimizer placements searched."""
    trace, buckets, compute, hw = _device_case(case, hw, data)
    deferred = data.draw(st.booleans())
    small = plan_that_fits(trace, buckets, data.draw(st.integers(0, 30000)), hw, compute, device_optimizer=True,
                           deferred=deferred)
    larger = small.budget_bytes + data.draw(st.integers(1, 30000))
    big = build_plan(trace, buckets, itemsize=4, budget_bytes=larger, fixed_bytes=0, hw=hw, compute_s=compute,
                     device_optimizer=True, deferred=deferred)
    assert big.simulated.step_s <= small.simulated.step_s * (1 + 1e-9) + 1e-15


def _cpu_bound_chain(n=12, numel=1000):
    trace, buckets = chain_trace(n, numel)
    hw = flat_hw(bw=1e6, adam=1e4, device_adam=1e7)  # CPU AdamW 0.1 s per bucket; copies 4 ms; device AdamW 0.1 ms
    compute = [1e-3] * len(trace.events)
    return trace, buckets, hw, compute


def test_where_the_cpu_adamw_is_the_wall_the_first_layers_keep_their_optimizer_on_the_device():
    trace, buckets, hw, compute = _cpu_bound_chain()
    budget = 10**7
    plan = plan_that_fits(trace, buckets, budget, hw, compute, device_optimizer=True)
    _check_device_placement(plan, hw, compute)
    today = plan_that_fits(trace, buckets, budget, hw, compute, device_optimizer=False)
    assert len(plan.device_optimizer) == len(buckets)  # room for all: every update leaves the CPU
    assert plan.simulated.adam_s == 0 and plan.simulated.step_s < today.simulated.step_s / 10
    # room for a third of them (weights 4 kB + state 8 kB, aligned, per bucket; plus the grad slot and the
    # streamed ones): it takes the first layers, whose grads complete last
    streamed = plan_that_fits(trace, buckets, 0, hw, compute, device_optimizer=False)
    small = plan_that_fits(trace, buckets, streamed.peak_bytes + 4 * 12288, hw, compute, device_optimizer=True)
    _check_device_placement(small, hw, compute)
    assert 0 < len(small.device_optimizer) <= 4 and 0 in small.device_optimizer
    assert set(small.device_optimizer) == set(range(len(small.device_optimizer)))
    assert small.simulated.step_s < plan_that_fits(trace, buckets, small.budget_bytes, hw, compute,
                                          device_optimizer=False).simulated.step_s


def test_device_optimizer_is_off_by_default_and_validate_plan_checks_placements():
    trace, buckets, hw, compute = _cpu_bound_chain()
    plan = build_plan(trace, buckets, itemsize=4, budget_bytes=10**7, fixed_bytes=0, hw=hw, compute_s=compute)
    assert not plan.device_optimizer and not any(x.kind is BufferKind.STATE for x in plan.buffers)
    assert set(plan.placement) == {Placement.RESIDENT}
    validate_plan(plan)
    # a placement the buffers do not back is refused
    lie = dataclasses.replace(plan, placement=(Placement.DEVICE_OPTIMIZER,) + plan.placement[1:])
    with pytest.raises(InvariantError, match="state buffer"):
        validate_plan(lie)
    lie = dataclasses.replace(plan, placement=(Placement.STREAMED,) + plan.placement[1:])
    with pytest.raises(InvariantError, match="resident"):
        validate_plan(lie)
    dev = build_plan(trace, buckets, itemsize=4, budget_bytes=10**7, fixed_bytes=0, hw=hw, compute_s=compute,
                     device_optimizer=True)
    k = dev.state_buffer[0]
    short = dataclasses.replace(dev, buffers=dev.buffers[:k] + (dataclasses.replace(dev.buffers[k], end=1),)
                                + dev.buffers[k + 1:])
    with pytest.raises(InvariantError, match="whole step"):
        validate_plan(short)


def test_placement_bytes_per_tier():
    trace, buckets, hw, compute = _cpu_bound_chain()
    plan = plan_that_fits(trace, buckets, 10**7, hw, compute, device_optimizer=True)
    tiers = placement_bytes(plan.buckets, 4, plan.placement)
    assert tiers["device-optimizer"] == 12 * 4000 and tiers["device_optimizer_state"] == 12 * 8000
    assert tiers["streamed"] == tiers["resident"] == 0


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), machines(), st.data())
def test_restricted_greedy_cpp_equals_its_python_loop(case, hw, data):
    """The greedy's inputs with device-optimizer buckets taken out (device_optimizer.restrict): the C++ move
    sequence and the Python loop agree point for point, bit for bit, as they do without them."""
    if _C is None:
        pytest.skip("needs the built extension (offload._C)")
    trace, buckets = case
    compute = compute_times(trace, draw_compute(data.draw, trace))
    g = Greedy.of(trace, buckets, 4, hw, compute)
    updated = sorted(g.inputs.grad_issue)
    device = data.draw(st.lists(st.sampled_from(updated), unique=True) if updated else st.just([]))
    x = restrict(g.inputs, device, buckets, 4, deferred=data.draw(st.booleans()))
    _compare(Greedy(x), data.draw(st.integers(0, 60000)))
