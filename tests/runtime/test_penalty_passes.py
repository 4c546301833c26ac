"""Two backward passes in one step ([Note: a backward pass inside a step] in offload/runtime/step_passes.py): a gradient
penalty runs ``torch.autograd.grad(out, x, create_graph=True)`` (it accumulates nothing), then the loss's
backward. The plan is built from a record of both passes, so the first pass's end is not the step's: the step
stays on its plan. Before, that end left the plan: every penalty step departed, was planned again and fetched
its buckets on demand (measured on the resident MLP below: 5 departures and 5 re-plans in 6 steps, 84 on-demand
fetches, never a fast step). Every test trains the engine and plain PyTorch + torch.optim.AdamW side by side,
bit for bit, and checks the counters, so that none passes by departing."""

import copy

import pytest
import torch

import offload
from offload.testing.chaos import ChaosConfig
from tests.support.compare import assert_bitwise, assert_losses_bitwise
from tests.support.fake_cuda import with_chaos
from tests.support.loops import finish_step
from tests.support.models import tanh_mlp

ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _blocks(depth: int = 6, width: int = 32) -> torch.nn.Sequential:
    """``depth`` blocks of (Linear, Tanh), each its own Sequential: blocks the engine measures for activation
    checkpointing (``ckpt.block_of``), as in most transformers."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                 for _ in range(depth)])


def _pair(budget_frac, chaos=None, model=None, **kw):
    """(engine, opt, ref, ref_opt); ``chaos``: random delays on the copy and AdamW lanes (a wait missing across
    the passes' boundary shows up as wrong numbers)."""
    model = tanh_mlp(depth=8) if model is None else model
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    opt = offload.AdamW(model.parameters(), fused=False, **ADAMW)
    with with_chaos(chaos):
        engine = offload.wrap(model, opt, budget=int(budget_frac * nbytes), bucket_bytes=max(256, nbytes // 8),
                              dtype=torch.float32, device="cpu", **kw)
    return engine, opt, ref, ref_opt


def _x(step: int) -> torch.Tensor:
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(step))


def _penalty_step(forward, opt, step: int, penalty: bool = True) -> float:
    x = _x(step).requires_grad_(penalty)
    out = forward(x)
    loss = out.square().mean()
    if penalty:
        g, = torch.autograd.grad(loss, x, create_graph=True)
        loss = loss + g.square().sum()
    return finish_step(loss, opt)


def _counters(engine) -> dict:
    return dict(engine.memory_stats()["counters"])


@pytest.mark.parametrize("budget_frac, streamed, chaos", [(4.0, False, None), (0.6, True, None),
                                                          (0.6, True, ChaosConfig(seed=5))],
                         ids=["resident", "streamed", "streamed-chaos"])
def test_gradient_penalty_steps_stay_on_their_plan(budget_frac, streamed, chaos):
    engine, opt, ref, ref_opt = _pair(budget_frac, chaos)
    try:
        losses = [_penalty_step(engine, opt, s) for s in range(7)]
        ref_losses = [_penalty_step(ref, ref_opt, s) for s in range(7)]
        assert_losses_bitwise(losses, ref_losses)
        assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "gradient penalty")
        c = _counters(engine)
        assert c["plan_departures"] == 0 and c["replans"] == 0, c
        plan = engine.memory_stats()["plan"]
        assert (plan["streamed_buckets"] > 0) == streamed, plan
        if streamed:
            assert c["planned_fetches"] > 0, c
        else:  # all resident: the steps after the one that verified the plan run fast
            assert c["fast_steps"] >= 4, c
    finally:
        engine.close()


def test_a_step_whose_planned_second_pass_does_not_come_departs_and_trains_right():
    """Planned from penalty steps (two passes), then a step with the first pass only before the next forward
    (its grads are never accumulated: the update after it applies nothing), then plain steps: the forward that
    comes instead of the planned second pass departs, the engine plans again, and every number stays torch's."""
    engine, opt, ref, ref_opt = _pair(0.6)
    try:
        losses, ref_losses = [], []
        for s in range(3):
            losses.append(_penalty_step(engine, opt, s))
            ref_losses.append(_penalty_step(ref, ref_opt, s))
        for f in (engine, ref):  # the first pass alone: input grads for, say, an adversarial example
            x = _x(50).requires_grad_(True)
            g, = torch.autograd.grad(f(x).square().mean(), x)
            assert torch.isfinite(g).all()
        before = _counters(engine)["plan_departures"]
        for s in range(3, 7):
            losses.append(_penalty_step(engine, opt, s, penalty=False))
            ref_losses.append(_penalty_step(ref, ref_opt, s, penalty=False))
        assert _counters(engine)["plan_departures"] > before
        assert_losses_bitwise(losses, ref_losses)
        assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "after a lone autograd.grad pass")
    finally:
        engine.close()


def _input_grad_step(forward, opt, step: int) -> float:
    """The input's gradient first (a saliency map, say: no create_graph), then the loss's backward: two passes."""
    x = _x(step).requires_grad_(True)
    loss = forward(x).square().mean()
    g, = torch.autograd.grad(loss, x, retain_graph=True)
    assert torch.isfinite(g).all()
    return finish_step(loss, opt)


@pytest.mark.parametrize("first_pass", ["penalty", "input grad"])
@pytest.mark.parametrize("budget_frac, streamed", [(4.0, False), (0.8, True)], ids=["resident", "streamed"])
def test_two_pass_steps_of_a_model_with_blocks_stay_on_their_plan(budget_frac, streamed, first_pass):
    """The same, where the engine measures blocks for checkpointing (without checkpointing any): before, a
    measured block counted as checkpointing here, and every such step departed and was planned again (an
    input-grad step on a 6-block MLP: 5 departures in 6 steps)."""
    engine, opt, ref, ref_opt = _pair(budget_frac, model=_blocks(depth=8))
    try:
        assert engine._runtime.recompute.ckpt.block_of and not engine._runtime.recompute.ckpt.active
        step = _penalty_step if first_pass == "penalty" else _input_grad_step
        losses = [step(engine, opt, s) for s in range(7)]
        ref_losses = [step(ref, ref_opt, s) for s in range(7)]
        assert_losses_bitwise(losses, ref_losses)
        assert_bitwise(engine.state_dict()["model"], ref.state_dict(), f"{first_pass}, blocks")
        c = _counters(engine)
        assert c["plan_departures"] == 0 and c["replans"] == 0, c
        assert (engine.memory_stats()["plan"]["streamed_buckets"] > 0) == streamed
    finally:
        engine.close()
