"""Compute's waits on a reused grad slot ([Note: waits on a reused grad slot] in simulate.py) and the plans
that double-buffer grad slots to hide them ([Note: double-buffered grad slots] in schedule.py): the
intervals' rule, the layout's waits, the plan kept, and the minimum budget."""

import dataclasses

import numpy as np
import pytest

from offload.errors import BudgetTooSmallError
from offload.planning.buckets import ParamSpec, make_buckets
from offload.planning import schedule
from offload.planning.hw import PRESETS
from offload.planning.intervals import double_buffered_ends, grad_slot_reuse
from offload.planning.plan import BufferKind
from offload.planning.schedule import build_plan, program_of, simulate_plan, validate_plan
from offload.planning.simulate import simulate
from offload.planning.trace import EventKind
from tests.support.planning import chain_trace, flat_hw


def _ints(*xs):
    return np.asarray(xs, dtype=np.int64)


def test_the_intervals_rule_takes_over_the_most_recently_issued_free_slot():
    # three slots one after the other: each takes over the one before it
    start, end, issue = _ints(0, 2, 4), _ints(2, 4, 6), _ints(1, 3, 5)
    assert grad_slot_reuse(start, end, issue).tolist() == [-1, 0, 1]
    # double-buffered: each slot held until the next one's end, so a slot takes over the one two before it
    ends = double_buffered_ends(start, end, 6)
    assert ends.tolist() == [4, 6, 6]
    assert grad_slot_reuse(start, ends, issue).tolist() == [-1, -1, 0]
    # two slots free at 5 (issued at 1 and at 3): the later issued is taken, then the other one
    assert grad_slot_reuse(_ints(0, 1, 5, 6), _ints(2, 4, 7, 8), _ints(1, 3, 6, 7)).tolist() == [-1, -1, 1, 0]
    # a slot never takes over one still live
    assert grad_slot_reuse(_ints(0, 1), _ints(3, 2), _ints(2, 1)).tolist() == [-1, -1]


def _copy_bound_chain(n=24, per_bucket=4, numel=4096):
    """A chain of ``n`` layers, ``per_bucket`` to a bucket: a bucket's backward (1 ms per layer) takes longer
    than its grads' copy to the host (3 ms), but where consecutive slots share bytes the next bucket's first
    grad waits for that copy: backward takes about compute + copies instead of their max."""
    trace, _ = chain_trace(n, numel)
    buckets = make_buckets([ParamSpec(numel, 0)] * n, list(range(n)), per_bucket * numel * 4, 4)
    hw = flat_hw(bw=per_bucket * numel * 4 / 3e-3, adam=1e9)
    compute = [1e-3 if ev.kind in (EventKind.PRE, EventKind.UNPACK) else 0.0 for ev in trace.events]
    return trace, buckets, hw, compute


def _grad_buffers(plan):
    return {x.bucket: k for k, x in enumerate(plan.buffers) if x.kind is BufferKind.GRAD}


def _waits_on_the_previous_slot(plan) -> int:
    """GRAD buffers whose ``after`` names the GRAD buffer of the bucket whose grads came just before."""
    grads = sorted(_grad_buffers(plan).values(), key=lambda k: plan.buffers[k].start)
    return sum(prev in plan.buffers[k].after for prev, k in zip(grads, grads[1:]))


def _plan(trace, buckets, hw, compute, budget, **kw):
    return build_plan(trace, buckets, itemsize=4, budget_bytes=budget, fixed_bytes=0, hw=hw, compute_s=compute, **kw)


def test_a_plan_with_room_double_buffers_its_grad_slots_and_is_simulated_no_slower(monkeypatch):
    trace, buckets, hw, compute = _copy_bound_chain()
    plan = _plan(trace, buckets, hw, compute, 10**8)
    validate_plan(plan)
    assert "double-buffered grads" in plan.strategy
    assert _waits_on_the_previous_slot(plan) == 0
    # the plan's simulated step is its layout's (simulate_plan reads the waits from its buffers)
    assert simulate_plan(plan, hw, compute) == plan.simulated
    monkeypatch.setattr(schedule, "DOUBLE_BUFFER_GRAD_SLOTS", False)
    single = _plan(trace, buckets, hw, compute, 10**8)
    assert "double" not in single.strategy
    assert _waits_on_the_previous_slot(single) == len(buckets) - 1  # one byte range for every slot
    assert simulate_plan(single, hw, compute) == single.simulated
    assert single.simulated.grad_stall_s > 0
    assert plan.simulated.step_s < single.simulated.step_s
    assert plan.simulated.grad_stall_s < single.simulated.grad_stall_s
    assert plan.arena_bytes > single.arena_bytes  # the price: about one more grad slot


def test_the_layouts_waits_are_the_ones_the_simulator_runs(monkeypatch):
    """A single-buffered plan's program waits, at each bucket's first grad, for the copy of the bucket whose
    slot it took over (its layout's ``after``); taking those waits out gives a faster (dishonest) step."""
    monkeypatch.setattr(schedule, "DOUBLE_BUFFER_GRAD_SLOTS", False)
    trace, buckets, hw, compute = _copy_bound_chain()
    plan = _plan(trace, buckets, hw, compute, 10**8)
    program = program_of(plan, compute)
    copy_of = {b: k for k, b in enumerate(program.d2h_bucket)}
    want = [()] * len(trace.events)
    for k in _grad_buffers(plan).values():
        x = plan.buffers[k]
        olds = tuple(copy_of[plan.buffers[j].bucket] for j in x.after if plan.buffers[j].kind is BufferKind.GRAD)
        want[x.start] = want[x.start] + olds
    assert tuple(program.grad_waits) == tuple(want) and sum(map(len, want)) == len(buckets) - 1
    honest = simulate(program, hw)
    blind = simulate(dataclasses.replace(program, grad_waits=()), hw)
    assert honest == plan.simulated and honest.grad_stall_s > 0 and blind.grad_stall_s == 0
    assert honest.step_s > blind.step_s


def _min_budget(trace, buckets, hw, compute) -> int:
    with pytest.raises(BudgetTooSmallError) as e:
        _plan(trace, buckets, hw, compute, 1)
    return e.value.min_budget_bytes


def test_at_the_minimum_budget_the_plan_still_builds_single_buffered():
    """The minimum budget is single buffering's (budget.py): the plan builds there, its slots shared."""
    trace, buckets, hw, compute = _copy_bound_chain()
    budget = _min_budget(trace, buckets, hw, compute)
    plan = _plan(trace, buckets, hw, compute, budget)
    validate_plan(plan)
    assert "double" not in plan.strategy and plan.peak_bytes <= budget
    with pytest.raises(BudgetTooSmallError):
        _plan(trace, buckets, hw, compute, budget - 1)


def test_device_optimizer_plans_double_buffer_too():
    """Device-optimizer plans lay out their grad slots the same way; a device bucket's slot is updated from
    on the compute lane and sends nothing to the host, so no one waits for a copy of it."""
    trace, buckets, _, compute = _copy_bound_chain(12, 1000)
    hw = flat_hw(bw=1e6, adam=1e4, device_adam=1e7)  # the CPU AdamW is the wall: every bucket goes on the device
    plan = _plan(trace, buckets, hw, compute, 10**7, device_optimizer=True)
    validate_plan(plan)
    assert plan.device_optimizer
    program = program_of(plan, compute)
    host = set(program.d2h_bucket)
    assert all(program.d2h_bucket[k] in host for ks in program.grad_waits for k in ks)
    assert simulate_plan(plan, hw, compute).step_s == pytest.approx(plan.simulated.step_s, rel=1e-12)


@pytest.mark.parametrize("hw", ["pcie4", "pcie5"])
def test_chain_plans_with_the_nominal_presets_are_valid_and_honest(hw):
    trace, buckets = chain_trace(200, 1 << 16)
    compute = [2e-5 if ev.kind in (EventKind.PRE, EventKind.UNPACK) else 0.0 for ev in trace.events]
    for budget in (200 * (1 << 18) // 8, 200 * (1 << 18)):
        plan = _plan(trace, buckets, PRESETS[hw], compute, budget)
        validate_plan(plan)
        assert simulate_plan(plan, PRESETS[hw], compute) == plan.simulated
