"""A forward after an inner autograd pass of the same step ([Note: a forward after an inner pass] in
offload/runtime/step_passes.py): WGAN-GP's critic (its penalty's ``torch.autograd.grad(..., create_graph=True)``
on interpolates, then its forwards of real and fake samples) and adversarial training (FGSM: the input's gradient,
then a forward of the adversarial example). Before, each forward began a step, so the plan never saw the inner
pass and such steps departed every time (session 25: 17 departures and 11 re-plans in 6 WGAN-GP steps). Every
test trains the engine and plain PyTorch + ``torch.optim.AdamW`` side by side, compares every weight bit for bit,
and checks that the plan settles (at most two departures and re-plans, none after) and that a streamed plan's
device peak stays within the budget where nothing unplanned is kept (FGSM; the penalty's graph copies are not
planned: README, gradient penalty row)."""

import warnings

import pytest
import torch
from torch import nn
from torch.nn.functional import cross_entropy

from tests.support.compare import assert_bitwise
from tests.support.loops import PLAIN_ADAMW, wrap_on_cpu

WIDTH = 64


def _mlp(seed: int, inputs: int, outputs: int, depth: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(inputs, WIDTH), nn.Tanh(),
                         *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(depth - 2)],
                         nn.Linear(WIDTH, outputs))


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _torch_opt(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), foreach=False, **PLAIN_ADAMW)


def _counters(engine) -> dict:
    return dict(engine.memory_stats()["counters"])


def _settled(engine, at: dict, most: int = 2) -> None:
    """At most ``most`` departures and re-plans in all, none since ``at`` (the counters some steps before the end)."""
    c = _counters(engine)
    assert c["plan_departures"] <= most and c["replans"] <= most, c
    assert all(c[k] == at[k] for k in ("plan_departures", "replans")), (at, c)


# -- WGAN-GP (Gulrajani et al. 2017, the reference code's loop) ---------------------------------------------------

def _critic_step(g, d, d_opt, i: int) -> float:
    """The critic's step: the penalty on interpolates first, then its forwards of real and fake samples."""
    d_opt.zero_grad()
    real = _randn(1000 + i, 8, 8)
    with torch.no_grad():
        fake = g(_randn(i, 8, 16))
    alpha = torch.rand(8, 1, generator=torch.Generator().manual_seed(2000 + i))
    x_hat = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    d_hat = d(x_hat)
    grad, = torch.autograd.grad(d_hat.sum(), x_hat, create_graph=True)
    gp = ((grad.norm(2, dim=1) - 1) ** 2).mean()
    d_real = d(real)
    d_fake = d(fake)
    loss = d_fake.mean() - d_real.mean() + 10 * gp
    loss.backward()
    d_opt.step()
    return loss.item()


def _generator_step(g, d, g_opt, i: int) -> float:
    """The generator's step, the critic frozen as the reference code freezes it (its pass gathers no grad)."""
    for p in d.parameters():
        p.requires_grad_(False)
    g_opt.zero_grad()
    loss = -d(g(_randn(500 + i, 8, 16))).mean()
    loss.backward()
    g_opt.step()
    for p in d.parameters():
        p.requires_grad_(True)
    return loss.item()


def _wgan(budget: float, overlap: bool):
    g, d, g_ref, d_ref = _mlp(0, 16, 8), _mlp(1, 8, 1), _mlp(0, 16, 8), _mlp(1, 8, 1)
    g_engine, g_opt = wrap_on_cpu(g, budget, overlap_optimizer=overlap)
    d_engine, d_opt = wrap_on_cpu(d, budget, overlap_optimizer=overlap)
    return (g, d, g_engine, d_engine, g_opt, d_opt), (g_ref, d_ref, _torch_opt(g_ref), _torch_opt(d_ref))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "deferred"])
@pytest.mark.parametrize("budget", [10.0, 1.4], ids=["resident", "streamed"])
def test_wgan_gp_critic_and_generator_settle_on_their_plans_bit_for_bit(budget, overlap):
    """Two critic steps and a generator step per iteration, 6 iterations: the critic's steps (penalty pass between
    its forwards) keep one plan, and so does the generator's; every loss and weight is torch's."""
    (g, d, g_engine, d_engine, g_opt, d_opt), (g_ref, d_ref, g_ref_opt, d_ref_opt) = _wgan(budget, overlap)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "steps that keep departing" warning
            for it in range(6):
                for k in range(2):
                    i = 2 * it + k
                    assert _critic_step(g, d, d_opt, i) == _critic_step(g_ref, d_ref, d_ref_opt, i), (it, k)
                assert _generator_step(g, d, g_opt, it) == _generator_step(g_ref, d_ref, g_ref_opt, it), it
                if it == 2:
                    at = [_counters(e) for e in (g_engine, d_engine)]
        assert_bitwise(d_engine.state_dict()["model"], d_ref.state_dict(), "critic")
        assert_bitwise(g_engine.state_dict()["model"], g_ref.state_dict(), "generator")
        for engine, counters_at in zip((g_engine, d_engine), at):
            _settled(engine, counters_at)
        stats = d_engine.memory_stats()
        assert (stats["plan"]["streamed_buckets"] > 0) == (budget < 2), stats["plan"]
        if budget < 2:
            assert stats["counters"]["planned_fetches"] > 0, stats["counters"]
    finally:
        g_engine.close()
        d_engine.close()


# -- adversarial training (FGSM, Goodfellow et al. 2015) ---------------------------------------------------------

def _fgsm_step(model, opt, i: int, clean: bool) -> float:
    """The input's gradient, an adversarial example from its sign, then the loss on it (``clean``: the mean of the
    loss on a fresh clean forward and on the adversarial example)."""
    x = _randn(i, 16, 8).requires_grad_(True)
    y = torch.randint(0, 4, (16,), generator=torch.Generator().manual_seed(3000 + i))
    grad, = torch.autograd.grad(cross_entropy(model(x), y), x)
    x_adv = (x + 0.05 * grad.sign()).detach()
    loss = cross_entropy(model(x_adv), y)
    if clean:
        loss = 0.5 * (cross_entropy(model(x.detach()), y) + loss)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


@pytest.mark.parametrize("clean", [False, True], ids=["adversarial", "clean+adversarial"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "deferred"])
@pytest.mark.parametrize("budget", [10.0, 1.0], ids=["resident", "streamed"])
def test_adversarial_training_steps_settle_on_one_plan_bit_for_bit(budget, overlap, clean):
    model, ref = _mlp(3, 8, 4), _mlp(3, 8, 4)
    engine, opt = wrap_on_cpu(model, budget, overlap_optimizer=overlap)
    ref_opt = _torch_opt(ref)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for i in range(7):
                assert _fgsm_step(model, opt, i, clean) == _fgsm_step(ref, ref_opt, i, clean), i
                if i == 3:
                    at = _counters(engine)
        assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "FGSM")
        _settled(engine, at)
        stats = engine.memory_stats()
        assert (stats["plan"]["streamed_buckets"] > 0) == (budget < 2), stats["plan"]
        if budget < 2:
            assert stats["counters"]["planned_fetches"] > 0, stats["counters"]
            assert stats["device_peak_bytes"] <= stats["budget_bytes"], stats
    finally:
        engine.close()


@pytest.mark.parametrize("budget", [10.0, 0.6], ids=["resident", "streamed"])
def test_adversarial_training_in_bfloat16_settles_on_one_plan(budget):
    """bfloat16 compute with fp32 masters: the plan settles the same way; losses near torch autocast's (the input's
    gradient in 16 bits may flip a sign of the adversarial step, so not bit for bit)."""
    model, ref = _mlp(3, 8, 4), _mlp(3, 8, 4)
    engine, opt = wrap_on_cpu(model, budget, dtype=torch.bfloat16)
    ref_opt = _torch_opt(ref)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for i in range(7):
                loss = _fgsm_step(model, opt, i, clean=True)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    ref_loss = _fgsm_step(ref, ref_opt, i, clean=True)
                assert abs(loss - ref_loss) < 0.05, (i, loss, ref_loss)
                if i == 3:
                    at = _counters(engine)
        _settled(engine, at)
        stats = engine.memory_stats()
        assert (stats["plan"]["streamed_buckets"] > 0) == (budget < 2), stats["plan"]
        assert stats["device_peak_bytes"] <= stats["budget_bytes"], stats
    finally:
        engine.close()


def test_input_gradients_alone_keep_one_record_bounded_then_training_is_torchs():
    """Forwards and ``autograd.grad`` of the input only (a saliency map), never a step: each pass continues the step
    off plan up to ``MAX_FORWARDS`` forwards, then the step ends, so the record stays bounded; the input gradients are
    torch's, and adversarial training after them is torch's bit for bit."""
    from offload.runtime.step_passes import MAX_FORWARDS

    model, ref = _mlp(3, 8, 4), _mlp(3, 8, 4)
    engine, opt = wrap_on_cpu(model, 1.0)
    ref_opt = _torch_opt(ref)
    try:
        events = []
        for i in range(3 * MAX_FORWARDS):
            grads = []
            for m in (model, ref):
                x = _randn(i, 16, 8).requires_grad_(True)
                grads.append(torch.autograd.grad(m(x).square().sum(), x)[0])
            assert torch.equal(*grads), i
            events.append(len(engine._runtime.executor.recorder.events))
        assert max(events) <= MAX_FORWARDS * max(events[:1]), events  # one forward and pass: events[0]
        assert min(events[MAX_FORWARDS:]) < max(events), events  # it ended and began again
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for i in range(4):
                assert _fgsm_step(model, opt, i, True) == _fgsm_step(ref, ref_opt, i, True), i
        assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "after input gradients")
    finally:
        engine.close()
