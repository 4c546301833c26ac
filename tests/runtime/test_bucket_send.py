"""A fast step's bucket sent by one routine (offload/runtime/bucket_send.py, [Note: one routine per fast bucket]),
and, where the CPU lane runs on the issuing thread, sent after backward ([Note: sent after backward] in
fast_path.py). Each test trains the engine beside plain PyTorch + torch.optim.AdamW (foreach=False; the engine's
AdamW with fused=False) bit for bit, and checks that the routine under test really ran."""

import copy

import pytest
import torch

import offload
from offload.testing.chaos import ChaosConfig
from tests.support.compare import assert_bitwise, assert_losses_bitwise
from tests.support.fake_cuda import simulated_gpu, with_chaos  # noqa: F401 (a fixture)
from tests.support.loops import finish_step
from tests.support.models import tanh_mlp

ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
STEPS = 8


def _pair(chaos=None, depth=12, width=32, **kw):
    """(engine, opt, ref, ref_opt): an MLP all resident (budget 4x its weights) in buckets of ~a tenth of it."""
    model = tanh_mlp(depth, width)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    opt = offload.AdamW(model.parameters(), fused=False, **ADAMW)
    with with_chaos(chaos):
        engine = offload.wrap(model, opt, budget=4 * nbytes, bucket_bytes=max(256, nbytes // 10),
                              dtype=torch.float32, device="cpu", **kw)
    return engine, opt, ref, ref_opt


def _x(step: int, width: int = 32) -> torch.Tensor:
    return torch.randn(8, width, generator=torch.Generator().manual_seed(step))


def _train(engine, opt, ref, ref_opt, steps=STEPS, width=32):
    losses, ref_losses = [], []
    for step in range(steps):
        losses.append(finish_step(engine(_x(step, width)).square().mean(), opt))
        ref_losses.append(finish_step(ref(_x(step, width)).square().mean(), ref_opt))
    assert_losses_bitwise(losses, ref_losses)
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "model")


def _lanes(engine) -> list[tuple[str, int, int]]:
    """What the last step issued, as the lane log shows it: (lane, bucket, bytes) in issue order."""
    _, _, entries, _ = engine._runtime.ctx.lane_log.last_step
    return [(lane, b, nbytes) for lane, b, nbytes, _, _ in entries]


def _records(engine) -> tuple[list[tuple[str, int, int]], list[tuple[str, int, int]]]:
    """``_lanes``, the refreshes apart and sorted: ``step()`` issues those of updates already ended first, so
    their order depends on the lane's timing ([Note: the refresh pipelined] in runtime/executor.py)."""
    lanes = _lanes(engine)
    return [x for x in lanes if x[0] != "h2d"], sorted(x for x in lanes if x[0] == "h2d")


@pytest.mark.parametrize("chaos", [None, ChaosConfig(seed=5)], ids=["plain", "chaos"])
def test_a_fast_steps_buckets_go_by_one_routine_and_leave_the_records_the_general_chain_leaves(chaos):
    """Every bucket of every fast step is sent by ``FastSend.send``, bit for bit torch (with random delays on
    the lanes too: a missing wait shows as wrong numbers). Beside an engine whose routine is switched off (the
    general chain: gather_bucket -> finish -> _copy_piece -> _submit_update) it issues the same copies and
    updates, in the same order, with the same byte counts and counters."""
    engine, opt, ref, ref_opt = _pair(chaos)
    general, general_opt, _, _ = _pair(chaos)
    general._runtime.grads.fast_send.route = lambda *args: None
    try:
        _train(engine, opt, ref, ref_opt)
        for step in range(STEPS):
            finish_step(general(_x(step)).square().mean(), general_opt)
        rt = engine._runtime
        fast, buckets = rt.ctx.stats["fast_steps"], len(rt.slots.buckets)
        assert fast >= STEPS - 3 and buckets > 2
        assert rt.grads.fast_send.sent == fast * buckets  # every bucket of every fast step
        assert general._runtime.grads.fast_send.sent == 0
        assert _records(engine) == _records(general)
        assert dict(engine.memory_stats()["counters"]) == dict(general.memory_stats()["counters"])
        assert_bitwise(engine.state_dict()["model"], general.state_dict()["model"], "model")
    finally:
        engine.close()
        general.close()


def test_a_slot_with_padding_is_cleared_by_the_routine():
    """Parameters padded apart in the slot (width 5: 20-byte rows aligned to 16 bytes): the routine clears the
    slot first (its padding sends zeros, not the previous occupant's bytes), bit for bit torch."""
    engine, opt, ref, ref_opt = _pair(width=5, depth=6)
    try:
        _train(engine, opt, ref, ref_opt, width=5)
        rt = engine._runtime
        assert rt.grads.fast_send.sent > 0
        assert not all(r is None or r.whole for r in rt.grads.fast_send._routes.values())
    finally:
        engine.close()


def test_on_the_simulated_gpu_a_fast_steps_buckets_go_by_the_routine_as_by_the_cpu_backend(simulated_gpu):
    """On the CUDA backend (a simulated GPU, as late as CUDA allows: a missing wait is a race it reports) fast
    steps send their buckets by the routine, during backward (its CPU lane is a thread: nothing is held to the
    end of backward), and train as the CPU backend does."""
    def run():
        engine, opt, ref, ref_opt = _pair(depth=4, width=16)
        _train(engine, opt, ref, ref_opt, steps=6, width=16)
        rt = engine._runtime
        out = rt.grads.fast_send.sent, rt.fast.at_end, engine.state_dict()["model"]
        engine.close()
        return out

    _, _, want = run()
    made = simulated_gpu()
    sent, at_end, state = run()
    assert sent > 0 and not at_end
    assert_bitwise(state, want, "model")
    assert made[0]._api.copies > 0 and made[0]._api.pending() == 0


@pytest.mark.parametrize("mode", ["inline", "lanes"])
def test_where_the_cpu_lane_runs_inline_a_fast_steps_grads_wait_in_p_grad_to_the_end_of_backward(mode, monkeypatch):
    """[Note: sent after backward]: in the CPU backend's inline mode (the users' default) a fast step's buckets
    are sent once autograd is done, so a user's grad hook on the backward's last parameter still finds every
    parameter's grad in ``p.grad``, as plain torch shows them; bit for bit torch. With the lanes on threads
    (``OFFLOAD_CPU_COPIES=lanes``, and on a GPU) each bucket goes at its last grad, overlapped with backward."""
    monkeypatch.setenv("OFFLOAD_CPU_COPIES", mode)
    engine, opt, ref, ref_opt = _pair()
    params = list(engine.module.parameters())
    held = []  # per grad hook (after the engine's): how many parameters show a grad in p.grad

    def count(_):
        held.append(sum(p.grad is not None for p in params))
    for p in params:
        p.register_post_accumulate_grad_hook(count)
    try:
        most, losses, ref_losses = [], [], []
        for step in range(STEPS):
            held.clear()
            losses.append(finish_step(engine(_x(step)).square().mean(), opt))
            ref_losses.append(finish_step(ref(_x(step)).square().mean(), ref_opt))
            most.append(max(held))
        assert_losses_bitwise(losses, ref_losses)
        assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "model")
        rt = engine._runtime
        fast = rt.ctx.stats["fast_steps"]
        assert fast >= STEPS - 3 and rt.grads.fast_send.sent == fast * len(rt.slots.buckets)
        assert rt.fast.at_end is (mode == "inline")
        if mode == "inline":  # at the backward's last grad every parameter holds its own
            assert most[-fast:] == [len(params)] * fast, most
        else:  # the first buckets went before the last grads came
            assert all(n < len(params) for n in most[-fast:]), most
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["inline", "lanes"])
def test_grads_sent_at_the_end_of_backward_stay_in_p_grad_until_the_exposure_replaces_them(mode, monkeypatch):
    """[Note: grads left for the exposure] (plain_grads.py): where a fast step's buckets are sent after backward
    (inline mode), the routine leaves each grad it copied in ``p.grad``, and the exposure that follows gives every
    parameter its data-less ``ExposedGrad`` in their place; sent during backward (lanes mode), each bucket's grads
    are out of ``p.grad`` at once, as before. Either way the user sees the same ``p.grad`` after backward, and
    training is bit for bit torch."""
    from offload.runtime.plain_grads import ExposedGrad

    monkeypatch.setenv("OFFLOAD_CPU_COPIES", mode)
    engine, opt, ref, ref_opt = _pair()
    rt = engine._runtime
    params = list(engine.module.parameters())
    exposure = rt.grads.exposure
    expose, seen = exposure.expose, []

    def spy():  # what p.grad holds when the exposure begins: a real grad, or None
        seen.append([type(p.grad) for p in params])
        expose()
    exposure.expose = spy
    try:
        _train(engine, opt, ref, ref_opt)
        fast = rt.ctx.stats["fast_steps"]
        assert fast >= STEPS - 3 and rt.grads.fast_send.sent == fast * len(rt.slots.buckets)
        kinds = {t for step in seen[-fast:] for t in step}
        assert kinds == ({torch.Tensor} if mode == "inline" else {type(None)}), kinds
        engine(_x(0)).square().mean().backward()  # after backward, as before: every p.grad an ExposedGrad
        assert all(type(p.grad) is ExposedGrad for p in params)
        opt.step()
        assert all(p.grad is None for p in params)
    finally:
        engine.close()
