"""Device-homed buckets (issue 18, [Note: device-homed buckets] in offload/host/state.py): a bucket whose
optimizer the training plan keeps on the device has no master, 16-bit copy, m or v in the host arena; its
state is copied to a host copy only while the host needs one, and a re-plan that changes placements lays
the exact-size host arena out again. Numbers stay plain PyTorch + torch.optim.AdamW's, bit for bit.

Plans are pinned as in tests/runtime/test_device_optimizer.py (a steady trace clock, a slow CPU AdamW in
the hardware model), so the tiny GPT's plan has device-optimizer buckets in every run.
"""

import pytest
import torch

import offload.host.state
import offload.planning.trace
import offload.runtime.plan_builder
from offload.planning.buckets import GRAD_RING_SLOTS, host_layout
from offload.runtime.device_optim import read_after_update
from tests.runtime.test_device_optimizer import (MIXED_BF16, _SteadyClock, assert_optimizer_state_bitwise, reference,
                                                 step, wrap)
from tests.support.compare import assert_bitwise, assert_losses_bitwise
from tests.support.fake_cuda import simulated_gpu  # noqa: F401 (a fixture)
from tests.support.models import CASES, run


@pytest.fixture(autouse=True)
def _steady_trace_clock(monkeypatch):
    """As in test_device_optimizer.py: the same events give the same times, so every run plans the same mix."""
    monkeypatch.setattr(offload.planning.trace, "time", _SteadyClock())


def homed(engine) -> set[int]:
    plan = engine._runtime.executor.train_plan
    return set(plan.device_optimizer) - read_after_update(plan)


def arena_bytes(engine, away) -> int:
    """The exact-size host arena the engine should hold with ``away`` device-homed."""
    rt = engine._runtime
    host = rt.slots.host
    lowp = host.lowp_dtype.itemsize if host.lowp_dtype is not None else 0
    return host_layout(host.buckets, lowp, host.accumulate, ring=GRAD_RING_SLOTS, away=frozenset(away)).total_bytes


def state_bytes(engine, buckets) -> int:
    """Master, 16-bit copy, m and v of ``buckets`` (unaligned)."""
    host = engine._runtime.slots.host
    lowp = host.lowp_dtype.itemsize if host.lowp_dtype is not None else 0
    return sum(host.master_numel[b] * 4 + host.buckets[b].numel * lowp + host.buckets[b].trainable_numel * 8
               for b in buckets)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_device_homed_buckets_keep_no_host_state(dtype):
    case = CASES["gpt"]()
    ref, ref_opt = reference(case.model)
    frac = {torch.float32: 1.5, torch.bfloat16: MIXED_BF16}[dtype]
    engine, opt = wrap(case.model, dtype=dtype, frac=frac)
    rt = engine._runtime
    losses, ref_losses = [], []
    try:
        for i in range(4):
            losses.append(step(engine, opt, case, i))
            ref_losses.append(step(ref, ref_opt, case, i))
        away = homed(engine)
        host = rt.slots.host
        assert away and host.away == away
        stats = engine.memory_stats()
        # the arena is the layout without the device-homed buckets' state, and nothing is parked
        assert stats["host_pinned_bytes"] == host.nbytes == arena_bytes(engine, away)
        assert arena_bytes(engine, ()) - host.nbytes >= state_bytes(engine, away)
        dev = stats["device_optimizer"]
        assert dev["host_bytes"]["device-optimizer"] == 0 and dev["host_parked_bytes"] == 0
        assert dev["device_homed_buckets"] == len(away) and dev["host_grad_sum_bytes_device_homed"] == 0
        per_param = 12 if dtype == torch.float32 else 14  # every parameter of the tiny GPT is trainable
        assert dev["host_bytes_per_param"] == {k: per_param for k in dev["host_bytes_per_param"] if k != "device-optimizer"} | {"device-optimizer": 0.0}
        # optimizer.state shows no stale m and v for them: only the step
        params = {p for b in away for run in host.buckets[b].runs for p in run.params}
        assert all(set(opt.state[rt.ctx.params[p]]) == {"step"} for p in params)
        if dtype == torch.float32:
            assert_losses_bitwise(losses, ref_losses)
            # a read parks a host copy (module.state_dict() waits for the updates) ...
            assert_bitwise(engine.module.state_dict(), ref.state_dict(), "weights")
            assert engine.memory_stats()["device_optimizer"]["host_parked_bytes"] == state_bytes(engine, away)
            assert_optimizer_state_bitwise(opt.state_dict(), ref_opt.state_dict())
            # ... which the next device update frees; training goes on exactly
            losses.append(step(engine, opt, case, 4))
            ref_losses.append(step(ref, ref_opt, case, 4))
            assert engine.memory_stats()["device_optimizer"]["host_parked_bytes"] == 0
            assert_losses_bitwise(losses, ref_losses)
            assert_optimizer_state_bitwise(opt.state_dict(), ref_opt.state_dict())
            assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "weights")
    finally:
        engine.close()
    assert engine.memory_stats()["host_pinned_bytes"] == 0


@pytest.mark.parametrize("backend", ["cpu", "simulated-gpu"])
def test_a_replan_that_changes_placement_rehomes_the_host_arena_bit_for_bit(backend, monkeypatch, simulated_gpu):
    """Plans with and without device-optimizer buckets in turn: the state moves device -> host (into a new,
    larger arena) and back (a smaller one), bit for bit; on the simulated GPU the pinned range follows."""
    made = simulated_gpu() if backend == "simulated-gpu" else []
    device_optimizer = [True]
    real = offload.runtime.plan_builder.build_plan

    def build(*args, **kwargs):
        return real(*args, **(kwargs | {"device_optimizer": device_optimizer[0]}))

    monkeypatch.setattr(offload.runtime.plan_builder, "build_plan", build)
    case = CASES["gpt"]()
    ref, ref_opt = reference(case.model)
    engine, opt = wrap(case.model)
    rt = engine._runtime
    losses, ref_losses, sizes = [], [], []
    try:
        for i in range(7):
            if i in (3, 5):  # the plan this step's step() builds moves every state home (3), then away again (5)
                device_optimizer[0] = i == 5
                rt.executor.stale = True
            losses.append(step(engine, opt, case, i))
            ref_losses.append(step(ref, ref_opt, case, i))
            host = rt.slots.host
            if i >= 1:
                away = homed(engine)
                assert host.away == away and host.nbytes == arena_bytes(engine, away)
                assert (not away) == (3 <= i < 5)
                sizes.append(host.nbytes)
            if made:
                assert made[0].pinned_bytes == host.nbytes  # the old arena was unpinned, the new one pinned
            if i == 5:  # read right after the state left the host, before any device update: copied back
                assert_optimizer_state_bitwise(opt.state_dict(), ref_opt.state_dict())
        assert min(sizes) < max(sizes)
        assert rt.ctx.stats["replans"] == 2
        assert_losses_bitwise(losses, ref_losses)
        assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "weights")
        assert_optimizer_state_bitwise(opt.state_dict(), ref_opt.state_dict())
    finally:
        engine.close()


def test_deferred_updates_keep_device_homed_grad_sums_on_the_host():
    """``overlap_optimizer=False`` sums every bucket's grads on the host (accumulation, clipping and the
    float16 overflow check need no second mechanism): device-homed buckets keep that fp32 sum, 4 bytes a
    parameter, and memory_stats says so."""
    case = CASES["gpt"]()
    ref, ref_opt = reference(case.model)
    engine, opt = wrap(case.model, overlap_optimizer=False)
    losses, ref_losses = [], []
    try:
        for i in range(4):
            for forward, o, out in ((engine, opt, losses), (ref, ref_opt, ref_losses)):
                for k in range(2):
                    batch = case.make_batch(2 * i + k)
                    loss = case.loss_fn(run(forward, batch), batch) / 2
                    loss.backward()
                o.step()
                o.zero_grad()
                out.append(loss.item())
        away = homed(engine)
        host = engine._runtime.slots.host
        assert away and host.away == away and host.nbytes == arena_bytes(engine, away)
        dev = engine.memory_stats()["device_optimizer"]
        sums = 4 * sum(host.buckets[b].trainable_numel for b in away)
        assert dev["host_grad_sum_bytes_device_homed"] == sums == dev["host_bytes"]["device-optimizer"]
        assert_losses_bitwise(losses, ref_losses)
        assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "weights")
    finally:
        engine.close()


def test_close_after_a_cpu_lane_fault_gives_device_homed_weights_back(monkeypatch):
    """A host update that raises (the CPU lane's fault) must not keep close() from giving every parameter its
    value back: device-homed buckets have no host copy until one is parked from the device."""
    case = CASES["gpt"]()
    engine, opt = wrap(case.model)
    rt = engine._runtime
    for i in range(3):
        step(engine, opt, case, i)
    away = homed(engine)
    assert away and not rt.slots.host.parked

    def broken(*args, **kwargs):
        raise RuntimeError("injected CPU-lane fault")

    monkeypatch.setattr(offload.host.state.HostState, "update", broken)
    with pytest.raises(Exception):
        step(engine, opt, case, 3)  # the lane's error surfaces at step()
    host, dev = rt.slots.host, rt.grads.device
    # what the device (or, if the arena went, the host copy parked from it) holds now: close() must give it back
    want = {b: (dev.state[b].master if b in dev.state else host.master[b]).clone() for b in away}
    where = [(p, host.bucket_of[p], host.offset[p]) for p in range(len(rt.ctx.params))]
    params = list(rt.ctx.params)
    with pytest.raises(Exception):
        engine.close()  # raises the lane's error, after releasing everything
    assert rt.slots.host is None
    assert all(bool(torch.isfinite(p).all()) for p in params)  # no placeholder (NaN) left behind
    checked = 0
    for p, b, off in where:
        if b in want:
            value = params[p].detach().reshape(-1)
            assert torch.equal(value, want[b][off: off + value.numel()]), p
            checked += 1
    assert checked > 0
