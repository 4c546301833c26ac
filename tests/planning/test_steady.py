"""[Note: the refresh pipelined, modelled] (offload/planning/simulate.py, steady.py): a resident bucket's refresh
issued in the previous step as its CPU AdamW ends (those ended at step() first, in first-use order, then the
others in the CPU lane's order), and the step as the period of the
steady state. Programs worked out by hand for both models, the C++ lanes against the Python reference, the
period against many chained steps, the plans that keep the old model, and the runtime's refresh order."""

import dataclasses
import itertools
import time
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import offload
from offload.planning import simulate as simulate_module
from offload.planning import refresh_candidates, steady
from offload.planning.schedule import DEFAULT_HW, build_plan, program_of
from offload.planning.simulate import STEP_START, simulate, simulate_reference
from tests.support.models import CASES, run
from tests.support.planning import chain_trace, flat_hw, lane_program

needs_cpp = pytest.mark.skipif(simulate_module._C is None, reason="the C++ extension is not built")


def _three_resident(compute: float, pipelined: bool, adam: int = 100):
    """Forward uses buckets 0, 1, 2 (events 0-2), backward 2, 1, 0 (events 3-5), each event ``compute`` s. All
    three resident: a refresh each (400 B: 0.4 s on flat_hw), grads of 100 B (0.1 s) at their backward event,
    AdamW of ``adam`` params (100: 1 s) each, in the lane's order 2, 1, 0."""
    return lane_program(compute_s=(compute,) * 6, h2d_event=(STEP_START,) * 3, h2d_bucket=(0, 1, 2),
                        h2d_bytes=(400,) * 3, waits=((0,), (1,), (2,), (2,), (1,), (0,)), d2h_event=(3, 4, 5),
                        d2h_bucket=(2, 1, 0), d2h_bytes=(100,) * 3, adam_numel=(adam,) * 3,
                        refresh_pipelined=pipelined)


def _both(program):
    """The result, checked equal (every field, floats bitwise) in C++ and in the Python reference."""
    got = simulate(program, flat_hw())
    assert got == simulate_reference(program, flat_hw())
    return got


def test_a_step_bound_by_the_cpu_adamw_hides_every_refresh_but_the_last():
    # Old model: the three refreshes at 0 in bucket order end at 0.4, 0.8, 1.2: event 0 waits 0.4, event 1 0.3
    # (0.5 -> 0.8), event 2 0.3 (0.9 -> 1.2); backward 1.2 -> 1.6, grads at 1.3, 1.4, 1.5, each 0.1 s, AdamW
    # 1.4-2.4, 2.4-3.4, 3.4-4.4: the step ends at 4.4.
    old = _both(_three_resident(0.1, pipelined=False))
    assert old.step_s == pytest.approx(4.4) and old.stall_s == pytest.approx(1.0) and old.refresh_passes == 0
    # Pipelined: bucket 2's refresh is issued as its AdamW ends (1 s before the step's end), bucket 1's too, both
    # land before it; only bucket 0's, issued at the end (R), is left: the next forward waits 0.4 s at event 0,
    # then 0.3 s of forward, the first grad copy 0.1 s, three AdamW 3 s: 3.8 s, the period of every step.
    new = _both(_three_resident(0.1, pipelined=True))
    assert new.step_s == pytest.approx(3.8) and new.refresh_passes == 1  # the first guess is the steady state
    assert new.stall_per_event == pytest.approx((0.4, 0, 0, 0, 0, 0))
    assert new.copy_credit == pytest.approx((0.4, 0, 0))  # bucket 0's refresh, carried in, caused it
    assert new.h2d_busy_s == pytest.approx(1.2) and new.tail_s == pytest.approx(3.8 - 1.0)


def test_the_refresh_used_first_goes_first_where_its_update_is_the_lanes_next():
    # Compute 1 s an event: at compute end (6.0) buckets 2's and 1's AdamW have ended (4.1, 5.1), bucket 0's, the
    # lane's next, ends at 6.1. Issued first, 1 and 2 (first-use order) held bucket 0's copy, which the next
    # forward needs first, behind them: 6.0-6.4, 6.4-6.8, then 0 at 6.8-7.2, 1.1 s after the step's end (R = 6.1),
    # a 7.2 s step (the model before session 23). So step() issues 0 first, as its AdamW ends: 6.1-6.5, then 1
    # and 2 (6.5-6.9, 6.9-7.3); event 0 waits 0.4 s, event 1 (at 1.4 after R) finds 1 landed (0.8): 0.4 + 6 s of
    # compute + the last AdamW's 0.1 s after compute end = 6.5 s, the step with the refreshes after the drain.
    old = _both(_three_resident(1.0, pipelined=False))
    assert old.step_s == pytest.approx(6.5) and old.stall_s == pytest.approx(0.4)
    new = _both(_three_resident(1.0, pipelined=True))
    assert new.step_s == pytest.approx(6.5) and new.stall_per_event == pytest.approx((0.4, 0, 0, 0, 0, 0))
    assert new.refresh_passes == 2  # the guess (only the last in flight, in the lane's order) is not the steady state
    assert new.copy_credit == pytest.approx((0.4, 0, 0))
    program, hw = _three_resident(1.0, pipelined=True), flat_hw()
    _, carry = steady.steady_state(program, hw)
    assert [program.h2d_bucket[k] for k in carry.order] == [0, 1, 2]
    assert carry.done == pytest.approx((6.5 - 6.1, 6.9 - 6.1, 7.3 - 6.1))


def test_refreshes_of_updates_ended_at_step_go_in_first_use_order():
    # Compute 1 s an event, AdamW 0.5 s: each AdamW ends 0.6 s after its grads are issued (3.6, 4.6, 5.6), all
    # before compute ends (6.0), so step() finds every update ended and issues the refreshes in the order the next
    # forward uses them, 0, 1, 2 (the lane's order 2, 1, 0 put bucket 0's last: 1.2 s after R, a 7.2 s step).
    # Bucket 0 lands 0.4 s after R = 6.0; event 1 (at 1.4) and event 2 find theirs landed (0.8, 1.2): 6.4 s,
    # the old model's step (the refreshes after the drain, in bucket order).
    old = _both(_three_resident(1.0, pipelined=False, adam=50))
    assert old.step_s == pytest.approx(6.4) and old.stall_s == pytest.approx(0.4)
    new = _both(_three_resident(1.0, pipelined=True, adam=50))
    assert new.step_s == pytest.approx(6.4) and new.stall_per_event == pytest.approx((0.4, 0, 0, 0, 0, 0))
    program, hw = _three_resident(1.0, pipelined=True, adam=50), flat_hw()
    _, carry = steady.steady_state(program, hw)
    assert [program.h2d_bucket[k] for k in carry.order] == [0, 1, 2]
    assert carry.done == pytest.approx((0.4, 0.8, 1.2))


def test_refreshes_of_updates_not_ended_at_step_go_in_the_lanes_order_after_the_others():
    # AdamW 2 s: in the steady state event 0 waits 0.4 s for bucket 0's refresh, so grads go at 3.4, 4.4, 5.4
    # (0.1 s each) and the AdamW of 2, 1, 0 run 3.5-5.5, 5.5-7.5, 7.5-9.5. At compute end (6.4) only 2's has ended;
    # the next update, 1's, is not that of bucket 0 (used first): step() issues 2 (6.4-6.8), then 1 (7.5-7.9) and
    # 0 (9.5-9.9) as their AdamW end, R = 9.5; the old model's step is the same (bound by the CPU lane)
    program, hw = _three_resident(1.0, pipelined=True, adam=200), flat_hw()
    got = _both(program)
    assert got.step_s == pytest.approx(9.5) and got.stall_per_event == pytest.approx((0.4, 0, 0, 0, 0, 0))
    assert _both(_three_resident(1.0, pipelined=False, adam=200)).step_s == pytest.approx(9.5)
    _, carry = steady.steady_state(program, hw)
    assert [program.h2d_bucket[k] for k in carry.order] == [2, 1, 0]
    assert carry.done == pytest.approx((6.8 - 9.5, 7.9 - 9.5, 9.9 - 9.5))


def test_the_device_adamw_after_backward_delays_the_end_and_not_the_refresh():
    # a device AdamW of 5,000 params (at 1,000/s: 5 s) on the compute lane after backward: step() returns after
    # it, while each refresh still follows its CPU AdamW. From the guess (bucket 0's refresh 0.4 s in flight):
    # compute ends at 1.0, R = 1.0 + 5 = 6.0, the refreshes end at 2.2, 3.2, 4.2: all land before R. So the
    # steady step waits for none: compute 0.6 + the device AdamW 5.0 = 5.6 s (the CPU lane ends at 3.4)
    hw = flat_hw(device_adam=1000.0)
    p = dataclasses.replace(_three_resident(0.1, pipelined=True), device_adam_numel=(0,) * 6 + (5000,))
    got = simulate(p, hw)
    assert got == simulate_reference(p, hw)
    assert got.step_s == pytest.approx(5.6) and got.stall_s == pytest.approx(0.0) and got.refresh_passes == 2
    assert got.device_adam_s == pytest.approx(5.0) and got.compute_s == pytest.approx(5.6)


def test_without_refreshes_the_pipelined_model_is_the_old_one():
    p = lane_program(h2d_event=(0,), h2d_bucket=(1,), h2d_bytes=(500,), waits=((), (0,), ()),
                     d2h_event=(1,), d2h_bucket=(0,), d2h_bytes=(100,), adam_numel=(100,))
    assert _both(dataclasses.replace(p, refresh_pipelined=True)) == _both(p)


def test_a_pipelined_refresh_needs_an_update_and_overlapped_updates():
    no_update = dataclasses.replace(_three_resident(0.1, pipelined=True), d2h_event=(3, 4), d2h_bucket=(2, 1),
                                    d2h_bytes=(100, 100), adam_numel=(100, 100))
    for sim in (simulate, simulate_reference):
        with pytest.raises(ValueError, match="no grad copy"):
            sim(no_update, flat_hw())
    deferred = dataclasses.replace(_three_resident(0.1, pipelined=True), device_return_bytes=(100,))
    for sim in (simulate, simulate_reference):
        with pytest.raises(ValueError, match="deferred"):
            sim(deferred, flat_hw())


@st.composite
def _pipelined_programs(draw):
    """Random programs with pipelined refreshes: grad copies anywhere (end of backward too), some of their
    buckets resident (a refresh each, listed in any order), streamed copies, waits on any copy, both AdamW
    rules, a device AdamW after backward or none."""
    n = draw(st.integers(1, 10))
    compute = draw(st.lists(st.sampled_from([0.0, 0.25, 1.0, 1e-5, 3.0]), min_size=n, max_size=n))
    nd = draw(st.integers(1, 6))
    d2h_bucket = draw(st.lists(st.integers(0, 4), min_size=nd, max_size=nd))  # a bucket may have several pieces
    d2h_event = draw(st.lists(st.integers(0, n), min_size=nd, max_size=nd))
    refresh = draw(st.lists(st.sampled_from(sorted(set(d2h_bucket))), min_size=1, unique=True))
    streamed = draw(st.lists(st.integers(0, n - 1), max_size=5))
    h2d_event = (STEP_START,) * len(refresh) + tuple(sorted(streamed))
    nh = len(h2d_event)
    waits = tuple(tuple(draw(st.lists(st.integers(0, nh - 1), max_size=3))) for _ in range(n))
    return lane_program(compute_s=tuple(compute), h2d_event=h2d_event,
                        h2d_bucket=tuple(refresh) + tuple(range(10, 10 + len(streamed))),
                        h2d_bytes=tuple(draw(st.lists(st.integers(1, 5000), min_size=nh, max_size=nh))),
                        waits=waits, d2h_event=tuple(d2h_event), d2h_bucket=tuple(d2h_bucket),
                        d2h_bytes=tuple(draw(st.lists(st.integers(1, 5000), min_size=nd, max_size=nd))),
                        adam_numel=tuple(draw(st.lists(st.integers(0, 500), min_size=nd, max_size=nd))),
                        adam_after_backward=draw(st.booleans()), refresh_pipelined=True,
                        device_adam_numel=draw(st.sampled_from([(), (0,) * n + (700,)])))


@needs_cpp
@settings(max_examples=300, deadline=None)
@given(program=_pipelined_programs(), duplex=st.sampled_from([1.0, 0.7]))
def test_cpp_lanes_equal_the_python_reference_bitwise(program, duplex):
    hw = flat_hw(duplex=duplex, device_adam=1000.0)
    try:
        want = simulate_reference(program, hw)
    except ZeroDivisionError:  # a stall on a zero-length busy period: the C++ lanes hand it to the reference
        with pytest.raises(ZeroDivisionError):
            simulate(program, hw)
        return
    assert simulate(program, hw) == want
    assert want.refresh_passes >= 1


@settings(max_examples=200, deadline=None)
@given(program=_pipelined_programs(), duplex=st.sampled_from([1.0, 0.7]))
def test_the_step_is_the_period_of_consecutive_steps(program, duplex):
    """Chained passes from a cold start (nothing in flight) settle on the step the passes from the guess found."""
    hw = flat_hw(duplex=duplex, device_adam=1000.0)
    try:
        got = simulate_reference(program, hw)
    except ZeroDivisionError:
        return
    if got.refresh_passes == steady.MAX_PASSES:
        return  # not settled (then the last pass is taken): no period to compare with
    compute_s, tail, _ = simulate_module.with_device_adam(program, hw)
    solo = [hw.h2d_seconds(x) for x in program.h2d_bytes]
    guess = steady.first_carry(program, solo)
    carry = dataclasses.replace(guess, done=(0.0,) * len(guess.done))  # every refresh landed: a cold start
    steps = []
    for _ in range(60):
        lanes = steady.PipelinedLanes(program, solo, hw, None, carry)
        step, carry = lanes.finish(lanes.run(compute_s), tail)
        steps.append(step)
    assert steps[-1] == pytest.approx(got.step_s, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("asked, deferred", [(True, False), (True, True), (False, False)])
def test_a_plan_models_the_pipelined_refresh_where_asked_and_updates_overlap(asked, deferred):
    """build_plan(refresh_pipelined=True) models the pipelined refresh unless updates are deferred (the runtime
    refreshes after the drain there); the plan records which, program_of follows it, and the plan's prediction
    is that model's."""
    trace, buckets = chain_trace(12, 256)
    compute = [1e-5] * len(trace.events)
    plan = build_plan(trace, buckets, itemsize=4, budget_bytes=10**9, fixed_bytes=0, compute_s=compute,
                      deferred=deferred, refresh_pipelined=asked)
    want = asked and not deferred
    program = program_of(plan, compute)
    assert plan.refresh_pipelined is want and program.refresh_pipelined is want
    assert STEP_START in program.h2d_event  # a resident bucket's refresh (the budget holds every bucket)
    assert plan.simulated == simulate(program, DEFAULT_HW)
    assert (plan.simulated.refresh_passes > 0) is want
    assert program_of(plan, compute, refresh_pipelined=not want).refresh_pipelined is (not want and not deferred)


@pytest.mark.parametrize("drained", [True, False], ids=["updates_ended", "lane_slowed"])
def test_the_simulators_refresh_order_is_the_runtimes(drained):
    """On the CPU backend, every bucket resident: the order step() issues the refreshes in is the order the
    simulator issues them in for the plan it executes (planned for a CPU AdamW slow enough to be the wall, where
    keeping every bucket is the fastest plan). ``drained``: backward outlasted the lane (it drained before
    step()), and the simulator's step() comes after every AdamW: both in first-use order. Else the lane is
    slowed 20 ms an item: the simulator's step() finds no AdamW ended (the lane's order), the runtime's those of
    a prefix of the lane, issued first in first-use order."""
    case = CASES["mlp"]()
    opt = offload.AdamW(case.model.parameters(), fused=False, lr=1e-3)
    nbytes = sum(p.numel() * 4 for p in case.model.parameters())
    hw = DEFAULT_HW.with_(adam_params_per_s=1e6)
    engine = offload.wrap(case.model, opt, budget=4 * nbytes, bucket_bytes=nbytes // 10, device="cpu", hw=hw)
    rt = engine._runtime
    if not drained:
        rt.ctx.cpu._before = lambda: time.sleep(0.02)
    with engine:
        for step in range(3):
            batch = case.make_batch(step)
            engine.backward(case.loss_fn(run(engine, batch), batch))
            if drained:
                rt.ctx.cpu.drain()
            opt.step()
            opt.zero_grad()
            _, _, entries, _ = rt.ctx.lane_log.last_step
            rt.ctx.backend.synchronize()
        refreshed = [b for lane, b, _, _, _ in entries if lane == "h2d"]  # the last step's, in issue order
        plan = rt.executor.train_plan
    assert plan is not None and len(plan.resident) == len(plan.buckets) > 2
    program = program_of(plan, refresh_pipelined=True)
    solo = [hw.h2d_seconds(x) for x in program.h2d_bytes]
    sim_hw = hw if drained else hw.with_(adam_params_per_s=1.0)  # the slowed lane: no AdamW ends in backward
    compute_s, tail, _ = simulate_module.with_device_adam(program, sim_hw)
    lanes = steady.PipelinedLanes(program, solo, sim_hw, None, steady.first_carry(program, solo))
    compute_end = lanes.run(compute_s)
    lane = [program.h2d_bucket[k] for k in steady.first_carry(program, solo).order]  # the lane's order
    if drained:
        compute_end = max(lanes.adam_end) + 1.0  # step() after every AdamW
    order = [program.h2d_bucket[k] for k in lanes.finish(compute_end, tail)[1].order]
    if drained:
        assert order == refreshed == sorted(lane)  # first-use order: bucket order here
    else:
        assert order == lane  # none ended at the simulator's step()
        assert refreshed in [sorted(order[:k]) + order[k:] for k in range(len(order))]
    assert lane != sorted(lane)  # the two orders differ: the check can fail


@pytest.mark.parametrize("compute", [0.1, 1.0])
def test_a_pass_from_the_settled_carry_changes_nothing(compute):
    program = _three_resident(compute, pipelined=True)
    hw = flat_hw()
    got = simulate_reference(program, hw)
    compute_s = program.compute_s
    solo = [hw.h2d_seconds(x) for x in program.h2d_bytes]
    carry = steady.first_carry(program, solo)
    for _ in range(got.refresh_passes):
        lanes = steady.PipelinedLanes(program, solo, hw, None, carry)
        step, out = lanes.finish(lanes.run(compute_s), 0.0)
        settled = carry.settled(out, step)
        carry = out
    assert settled and step == got.step_s


def test_an_all_resident_chain_whose_copies_outlast_their_updates_stays_resident():
    """Session 23 (issue 18): 8 layers of 16,512 params on pcie4, 10 us of compute an event: each refresh (12.6 us)
    outlasts its AdamW (8.3 us), backward (10 us an event) outlasts both. At compute end every AdamW but the first
    layer's (the lane's last, 10.9 us away) has ended; issued first, those seven refreshes (88 us) held the first
    layer's behind them and the next forward waited 82 us for it at event 1 (a 433 us step against 353 us with the
    refreshes after the drain), so the planner streamed 7 of the 8 layers. Issued first as its AdamW ends, the
    first layer's refresh lands 12.6 us after the step, as after the drain: every layer stays resident."""
    trace, buckets = chain_trace(8, 16512)
    compute = [1e-5] * len(trace.events)
    plans = {pipelined: build_plan(trace, buckets, itemsize=4, budget_bytes=10**9, fixed_bytes=0, compute_s=compute,
                                   refresh_pipelined=pipelined) for pipelined in (False, True)}
    assert len(plans[False].resident) == len(plans[True].resident) == len(buckets)
    program = program_of(plans[True], compute)
    got = simulate(program, DEFAULT_HW)
    assert got == simulate_reference(program, DEFAULT_HW)
    assert got.step_s == pytest.approx(plans[False].simulated.step_s, rel=1e-12)
    assert got.stall_per_event[1] == pytest.approx(DEFAULT_HW.h2d_seconds(16512 * 4) - 1e-5)
    assert [program.h2d_bucket[k] for k in steady.steady_state(program, DEFAULT_HW)[1].order] == list(range(8))


def _resident_chain(n: int, compute: float, adam: int):
    """Forward uses buckets 0..n-1 (events 0..n-1), backward n-1..0, each event ``compute`` s. All resident: a
    refresh each (400 B: 0.4 s on flat_hw, longer than its AdamW: pcie4-like), grads of 100 B (0.1 s) at their
    backward event, AdamW of ``adam`` params (at 100/s) each, in the lane's order n-1..0."""
    return lane_program(compute_s=(compute,) * (2 * n), h2d_event=(STEP_START,) * n, h2d_bucket=tuple(range(n)),
                        h2d_bytes=(400,) * n, waits=tuple((i,) for i in range(n)) + tuple((i,) for i in
                                                                                           reversed(range(n))),
                        d2h_event=tuple(range(n, 2 * n)), d2h_bucket=tuple(reversed(range(n))),
                        d2h_bytes=(100,) * n, adam_numel=(adam,) * n, refresh_pipelined=True)


def _every_order(program, hw):
    """The exact reference for a small chain: the steady step (Python model) of each fixed issue order (a
    permutation of the lane's refreshes, the same in every pass), by bucket order."""
    n = sum(1 for e in program.h2d_event if e == STEP_START)
    out = {}
    for perm in itertools.permutations(range(n)):
        def fixed(lane, ended, key, perm=perm):
            [ended(x) for x in lane]
            return [lane[i] for i in perm]
        with mock.patch.object(steady, "issue_order", fixed):
            result, carry = steady.steady_state(program, hw)
        out[tuple(program.h2d_bucket[k] for k in carry.order)] = result.step_s
    return out


def test_with_two_updates_pending_the_first_layer_is_copied_last_which_the_model_says_costs_0_5_s():
    """[Note: the refresh order when the lane is behind] (planning/refresh_candidates.py), the model's answer
    pinned: 4 layers, 0.2 s an event, AdamW 0.3 s, copies 0.4 s. Compute ends at 2.7 with layers 3's and 2's
    AdamW ended (2.3, 2.6), 1's and 0's pending (2.9, 3.2 = R); step() issues 2, 3 (ended, first-use order), then
    1, 0 (the lane's): 2.7-3.1, 3.1-3.5, 3.5-3.9 and layer 0 at 3.9-4.3, so the next forward's event 0 waits
    1.1 s: a 3.2 s step. The best of the 24 orders (each in every pass to its steady state) is 2.7 s, and so is
    the candidate's: 2 first, then 0 as its AdamW ends (2.7-3.1: event 0 waits 0.4 s), 1 (3.1-3.5: event 1 at
    0.6 waits 0.2 s), 3 (3.5-3.9). Not adopted: measured on the runtime it was not faster (the Note)."""
    program, hw = _resident_chain(4, 0.2, 30), flat_hw()
    got = _both(program)
    assert got.step_s == pytest.approx(3.2) and got.stall_per_event[0] == pytest.approx(1.1)
    assert [program.h2d_bucket[k] for k in steady.steady_state(program, hw)[1].order] == [2, 3, 1, 0]
    with mock.patch.object(steady, "issue_order", refresh_candidates.in_the_model(program, hw)):
        cand, carry = steady.steady_state(program, hw)
    assert cand.step_s == pytest.approx(2.7) and cand.stall_per_event == pytest.approx((0.4, 0.2) + (0.0,) * 6)
    assert [program.h2d_bucket[k] for k in carry.order] == [2, 0, 1, 3]
    every = _every_order(program, hw)
    assert min(every.values()) == pytest.approx(2.7) and every[(2, 0, 1, 3)] == pytest.approx(2.7)
    assert every[(2, 3, 1, 0)] == pytest.approx(3.2) and every[(0, 1, 2, 3)] == pytest.approx(3.1)  # all first-use


@pytest.mark.parametrize("n, compute, adam, before, candidate, best", [
    (5, 0.2, 30, 4.0, 3.4, 3.2),  # the best is outside the orders least_late compares
    (6, 0.1, 20, 3.6, 3.3, 3.1),
    (5, 0.1, 35, 3.0, 3.0, 2.9),  # nothing better found: the order before kept
    (4, 0.05, 30, 2.2, 2.2, 2.2),  # no update ended at step(): the lane's order is the best
    (3, 1.0, 200, 9.5, 9.5, 9.5),  # the CPU AdamW the wall
])
def test_the_order_against_the_candidate_and_every_order_on_small_chains(n, compute, adam, before, candidate, best):
    """The model's step with ``issue_order`` (Python and C++ bitwise), with the candidate, and the best of every
    order (the exact reference): how far the order is from the best on these chains."""
    program, hw = _resident_chain(n, compute, adam), flat_hw()
    assert _both(program).step_s == pytest.approx(before)
    with mock.patch.object(steady, "issue_order", refresh_candidates.in_the_model(program, hw)):
        assert steady.steady_state(program, hw)[0].step_s == pytest.approx(candidate)
    assert min(_every_order(program, hw).values()) == pytest.approx(best)


def test_a_chain_whose_lane_is_two_updates_behind_is_streamed_by_the_model():
    """The planner's side, pinned: 8 layers of 16,512 params on pcie4, 6 us of compute an event; each refresh
    12.6 us, its AdamW 8.3 us (+ its grad copy): at compute end the first two layers' updates are pending. All
    resident, step() lands layer 0's refresh last (ended 2..7 in first-use order, then 1, 0): event 1 waits 78 us
    in the model, a 301 us step, so the greedy streams 6 of the 8 layers (240.9 us). The candidate's order would
    make the all-resident plan 238.7 us in the model (event 1 waits 14.9 us), not adopted ([Note: the refresh
    order when the lane is behind]: measured on the runtime, not faster)."""
    trace, buckets = chain_trace(8, 16512)
    compute = [6e-6] * len(trace.events)
    plan = build_plan(trace, buckets, itemsize=4, budget_bytes=10**9, fixed_bytes=0, compute_s=compute,
                      refresh_pipelined=True)
    assert len(plan.resident) == 2 and plan.simulated.step_s == pytest.approx(240.94e-6, abs=1e-8)
    everything = build_plan(trace, buckets, itemsize=4, budget_bytes=10**9, fixed_bytes=0, compute_s=compute,
                            refresh_pipelined=False)  # the refresh after the drain: all resident
    assert len(everything.resident) == len(buckets)
    program = program_of(everything, compute, refresh_pipelined=True)
    got = simulate(program, DEFAULT_HW)
    assert got == simulate_reference(program, DEFAULT_HW)
    assert got.step_s == pytest.approx(301.16e-6, abs=1e-8) and got.stall_per_event[1] > 77e-6
    assert [program.h2d_bucket[k] for k in steady.steady_state(program, DEFAULT_HW)[1].order] == [2, 3, 4, 5, 6, 7,
                                                                                                  1, 0]
    with mock.patch.object(steady, "issue_order", refresh_candidates.in_the_model(program, DEFAULT_HW)):
        cand, carry = steady.steady_state(program, DEFAULT_HW)
    assert cand.step_s == pytest.approx(238.69e-6, abs=1e-8)
    assert cand.stall_per_event[1] == pytest.approx(14.89e-6, abs=1e-8)
    assert [program.h2d_bucket[k] for k in carry.order] == [2, 3, 0, 1, 4, 5, 6, 7]
