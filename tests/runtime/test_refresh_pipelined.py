"""[Note: the refresh pipelined] (offload/runtime/executor.py): with overlapped updates, ``step()`` copies each
resident bucket's new weights to the device as soon as that bucket's update on the CPU lane has ended (those
ended at step() first, in the order the next forward uses them, then the others in the order the lane runs
them), instead of after the last one. Checked with the lane slowed (its updates still run when ``step()`` is
called) and with the lane drained before ``step()``, on the CPU backend and on the simulated GPU (which checks
every copy against the events that order it): the first refresh copy begins before the last update ends, the
copies follow that order, a step that plans (the first, and one whose batch outgrew its plan) issues no copy
before the lane's last update (its old plan's slots go), and the next training forward, which reads the
refreshed slots, gives plain torch's output after torch.optim.AdamW's step, bit for bit."""

import threading
import time

import pytest
import torch

import offload
from offload.backend.base import HostEvent
from tests.support.fake_cuda import simulated_gpu  # noqa: F401 (a fixture)
from tests.support.loops import ADAMW
from tests.support.models import CASES, Batch, run

LANE_DELAY_S = 0.02  # before and after each CPU-lane item: the lane, not backward, is the wall
REPLAN_AT = 2  # the step whose larger batch makes step() plan again


def _step_lanes(engine, since: float) -> tuple[list[tuple[int, float, float]], list[tuple[int, float]]]:
    """The last step()'s work: (bucket, issued, began) of each host-to-device copy issued from ``since`` on, in
    issue order, and (bucket, finished) of each update of the step, in the lane's order. ``began``: when the
    copy started (the CPU backend's copy lane says; on the simulated GPU, its issue: the host waited for the
    update before it enqueued the copy)."""
    recorder, _, entries, _ = engine._runtime.ctx.lane_log.last_step
    engine._runtime.ctx.backend.synchronize()  # every copy ran: its lane's times are set
    copies = [(b, issued, getattr(ev, "started", None) or issued) for lane, b, _, issued, ev in entries
              if lane == "h2d" and issued >= since]
    updates = [(b, ev.finished) for lane, b, _, _, ev in entries if lane == "cpu_adam"]
    return copies, updates


def first_use(plan) -> dict[int, int]:
    """Per bucket: the first event of ``plan`` that needs it (the order the next forward uses them)."""
    first: dict[int, int] = {}
    for i, actions in enumerate(plan.actions):
        for b in actions.need:
            first.setdefault(b, i)
    return first


def _all_resident_mlp():
    """The mlp twice (engine and plain torch), wrapped with room for every bucket in ten: (case, reference
    case, torch's AdamW, the engine's, the engine)."""
    case, ref = CASES["mlp"](), CASES["mlp"]()
    ref_opt = torch.optim.AdamW(ref.model.parameters(), foreach=False, **ADAMW)
    opt = offload.AdamW(case.model.parameters(), fused=False, **ADAMW)
    nbytes = sum(p.numel() * 4 for p in case.model.parameters())
    engine = offload.wrap(case.model, opt, budget=4 * nbytes, bucket_bytes=nbytes // 10, device="cpu")
    return case, ref, ref_opt, opt, engine


def _forward_backward_beside_torch(case, ref, ref_opt, engine, step: int, batch=None) -> None:
    """Step ``step``'s batch (or ``batch``) through the engine (forward and backward: its ``step()`` is the
    caller's) and through plain torch with its AdamW step; the forwards agree bit for bit."""
    batch = case.make_batch(step) if batch is None else batch
    got, want = run(engine, batch), run(ref.model, batch)
    assert torch.equal(got, want), (step, (got - want).abs().max())
    engine.backward(case.loss_fn(got, batch))
    ref.loss_fn(want, batch).backward()
    ref_opt.step()
    ref_opt.zero_grad()


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu_backend", "simulated_gpu"])
def test_step_refreshes_each_resident_bucket_as_its_update_ends(simulated_gpu, gpu):
    if gpu:
        simulated_gpu()
    case, ref, ref_opt, opt, engine = _all_resident_mlp()
    rt = engine._runtime
    rt.ctx.cpu._before = lambda: time.sleep(LANE_DELAY_S)  # read when the lane's thread starts: now
    with engine:
        for step in range(6):
            batch = case.make_batch(step)
            if step == REPLAN_AT:  # twice the activations: the plan is stale, step() plans again
                more = case.make_batch(50 + step)
                batch = Batch((torch.cat([batch.args[0], more.args[0]]),), target=torch.cat([batch.target,
                                                                                             more.target]))
            # The training forward reads the resident slots, as step() refreshed them (an evaluation forward
            # would not: its own plan brings every bucket in afresh)
            _forward_backward_beside_torch(case, ref, ref_opt, engine, step, batch)
            replans, called = rt.ctx.stats["replans"], time.perf_counter()
            opt.step()
            opt.zero_grad()
            copies, updates = _step_lanes(engine, called)
            last_update = max(t for _, t in updates)
            plan = rt.executor.train_plan
            assert plan is not None and len(plan.resident) == len(rt.slots.buckets) > 2  # all resident
            assert {b for b, _ in updates} == set(range(len(rt.slots.buckets))), (step, updates)
            assert rt.ctx.stats["replans"] == replans + (step == REPLAN_AT), step
            if step in (0, REPLAN_AT):  # a step that plans: its resident buckets come in once its plan is built
                assert copies and all(began > last_update for _, _, began in copies), step
            else:
                lane_order = list(dict.fromkeys(b for b, _ in updates))
                issued = [b for b, _, _ in copies]
                # every bucket once: those whose update had ended at step() (a prefix of the lane's order, not
                # the lane's last) in first-use order, then the others in the lane's order; but the bucket used
                # first (the lane's last) first where its update was the only one left
                first, want = first_use(plan), []
                for k in range(len(lane_order)):
                    ended, rest = sorted(lane_order[:k], key=first.__getitem__), lane_order[k:]
                    head = k and rest[0] == min(lane_order, key=first.__getitem__)
                    want.append(rest[:1] + ended + rest[1:] if head else ended + rest)
                assert issued in want, (step, issued, lane_order)
                first = min(began for _, _, began in copies)
                assert first < last_update, (step, first - last_update)  # the point: before the lane's end


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu_backend", "simulated_gpu"])
def test_updates_ended_before_step_are_refreshed_in_first_use_order(simulated_gpu, gpu):
    """A fast lane, a slow backward: every update has ended when ``step()`` is called (here: the lane drained
    before it), so the refreshes go in the order the next forward uses the buckets, not the lane's (which puts
    the first layers last); the next forward still gives plain torch's output, bit for bit."""
    if gpu:
        simulated_gpu()
    case, ref, ref_opt, opt, engine = _all_resident_mlp()
    rt = engine._runtime
    checked = 0
    with engine:
        for step in range(5):
            _forward_backward_beside_torch(case, ref, ref_opt, engine, step)
            rt.ctx.cpu.drain()  # backward outlasted the lane: every update has ended
            replans, called = rt.ctx.stats["replans"], time.perf_counter()
            opt.step()
            opt.zero_grad()
            if rt.ctx.stats["replans"] != replans:
                continue  # a step that plans refreshes nothing early
            copies, updates = _step_lanes(engine, called)
            plan = rt.executor.train_plan
            assert plan is not None and len(plan.resident) == len(rt.slots.buckets) > 2  # all resident
            first = first_use(plan)
            lane_order = list(dict.fromkeys(b for b, _ in updates))
            issued = [b for b, _, _ in copies]
            assert issued == sorted(lane_order, key=first.__getitem__), (step, issued, lane_order)
            assert issued != lane_order  # the lane's order differs (the first layers' grads come last)
            checked += 1
        batch = case.make_batch(99)
        assert torch.equal(run(engine, batch), run(ref.model, batch))  # the forward after the last step
    assert checked >= 3


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu_backend", "simulated_gpu"])
def test_the_bucket_used_first_goes_first_where_its_update_is_the_lanes_next(simulated_gpu, gpu):
    """Every update has ended at ``step()`` but the first layer's (the lane's last: its grads come last), which
    ends 30 ms later (its event, as ``step()`` sees it, is set then): its refresh goes first, as its update ends,
    then the others in first-use order; queued behind them it would land last, and the next forward needs it
    first ([Note: the refresh pipelined], session 23). Bit for bit torch after every step."""
    if gpu:
        simulated_gpu()
    case, ref, ref_opt, opt, engine = _all_resident_mlp()
    rt = engine._runtime
    checked = 0
    with engine:
        for step in range(5):
            _forward_backward_beside_torch(case, ref, ref_opt, engine, step)
            rt.ctx.cpu.drain()
            plan = rt.executor.train_plan
            head = min(first_use(plan), key=first_use(plan).__getitem__) if plan is not None else None
            if head in rt.slots.adam_event:  # its update, as step() sees it, ends 30 ms from now
                real, late = rt.slots.adam_event[head], HostEvent()
                threading.Timer(0.03, lambda real=real, late=late: (real.synchronize(), late.set())).start()
                rt.slots.adam_event[head] = late
            replans, called = rt.ctx.stats["replans"], time.perf_counter()
            opt.step()
            opt.zero_grad()
            if rt.ctx.stats["replans"] != replans or plan is None:
                continue  # a step that plans refreshes nothing early
            copies, updates = _step_lanes(engine, called)
            first = first_use(plan)
            lane_order = list(dict.fromkeys(b for b, _ in updates))
            issued = [b for b, _, _ in copies]
            assert lane_order[-1] == head and len(plan.resident) == len(lane_order) > 2, (lane_order, head)
            assert issued == [head] + sorted(lane_order[:-1], key=first.__getitem__), (step, issued, lane_order)
            checked += 1
        batch = case.make_batch(99)
        assert torch.equal(run(engine, batch), run(ref.model, batch))  # the forward after the last step
    assert checked >= 3
