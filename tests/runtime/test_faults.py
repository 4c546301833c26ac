"""Faults mid-step (offload/runtime/faults.py): an exception or KeyboardInterrupt inside forward or backward leaves
the engine usable. After the fault a warning says what was discarded; device slots, gradient slots, saved
activations and in-flight copies are all released; ``zero_grad()`` and the next steps give what plain
PyTorch + torch.optim.AdamW gives after the same fault (the reference raises in the same place and is
zeroed the same way)."""

import copy
import gc
import math
import threading
import warnings

import pytest
import torch
from torch import nn

import offload

ADAMW = dict(lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
TOL = dict(rtol=0, atol=0)  # bit for bit: the engine runs offload.AdamW(fused=False), torch's arithmetic (tests/support/compare.py)
WIDTH = 48
DEPTH = 8


class Bomb(torch.autograd.Function):
    """Identity in forward; in backward raises ``trigger[0]`` if it is set."""

    @staticmethod
    def forward(ctx, x, trigger):
        ctx.trigger = trigger
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.trigger[0] is not None:
            raise ctx.trigger[0]
        return grad, None


class Net(nn.Module):
    """Layers with a fault that can be armed: raised in forward after layer ``at``, or in backward where
    the gradient passes the output of layer ``at``."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))
        for layer in self.layers:
            nn.init.normal_(layer.weight, std=1.2 / math.sqrt(WIDTH))
        self.at = DEPTH // 2
        self.forward_fault = None
        self.backward_fault = [None]

    def forward(self, x):
        h = x
        for i, layer in enumerate(self.layers):
            h = layer(h).tanh()
            if i == self.at:
                if self.forward_fault is not None:
                    raise self.forward_fault
                h = Bomb.apply(h, self.backward_fault)
        return h


def make(overlap=True, at=DEPTH // 2):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = Net()
    model.at = at
    ref = copy.deepcopy(model)
    ref.backward_fault = [None]
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    opt = offload.AdamW(model.parameters(), fused=False, **ADAMW)
    engine = offload.wrap(model, opt, budget=int(0.6 * nbytes), bucket_bytes=nbytes // 10, device="cpu",
                          overlap_optimizer=overlap)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    return model, engine, opt, ref, ref_opt


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(3, WIDTH, generator=g), torch.randn(3, WIDTH, generator=g)


def loss_of(out, y):
    return (out - y).square().mean()


def normal_step(engine, opt, ref, ref_opt, step):
    x, y = batch(step)
    loss = loss_of(engine(x), y)
    engine.backward(loss)
    opt.step()
    opt.zero_grad()
    ref_loss = loss_of(ref(x), y)
    ref_loss.backward()
    ref_opt.step()
    ref_opt.zero_grad()
    return loss.item(), ref_loss.item()


def assert_nothing_held(engine):
    """Between steps: no on-demand or gradient slot, no gradient or saved activation counted, no copy
    pending, no gradient gathered, no .grad on any parameter."""
    gc.collect()
    rt = engine._runtime
    parts = rt.ctx.memory.parts
    assert (parts["slots"], parts["grads"], parts["activations"]) == (0, 0, 0), dict(parts)
    assert not rt.grads.gathering and not rt.slots.freeing and not rt.grads.pending and not rt.in_backward
    assert not rt.warmup.views and not rt.access.active and rt.executor.pos == 0
    assert all(p.grad is None for p in engine.module.parameters())
    want = len(rt.executor.plan.resident) if rt.executor.plan is not None and rt.executor.arena is not None else 0
    assert len(rt.slots.slot) == want  # only the plan's resident buckets are on the device


def check_final(engine, ref, losses):
    state = engine.state_dict()["model"]
    for key, want in ref.state_dict().items():
        torch.testing.assert_close(state[key], want, **TOL, msg=lambda m, key=key: f"{key}: {m}")
    for got, want in losses:
        assert got == want


CASES = [
    # phase, fault, overlap_optimizer, step of the fault, where (layer) the fault is
    ("forward", RuntimeError, True, 0, DEPTH // 2),  # during the traced first step
    ("forward", KeyboardInterrupt, True, 3, DEPTH // 2),
    ("forward-plain", RuntimeError, True, 3, DEPTH // 2),  # the module called directly, not through the engine
    ("forward-plain", KeyboardInterrupt, False, 2, DEPTH // 2),
    ("backward", RuntimeError, False, 3, DEPTH // 2),
    ("backward", KeyboardInterrupt, False, 0, DEPTH // 2),
    ("backward", KeyboardInterrupt, True, 3, DEPTH - 1),  # overlap, before any bucket's grads are complete
    ("backward-plain", RuntimeError, False, 3, DEPTH // 2),  # loss.backward(), noticed by zero_grad()
    ("backward-plain", KeyboardInterrupt, True, 2, DEPTH - 1),  # noticed by the next forward
]


@pytest.mark.parametrize("phase,fault,overlap,at_step,at", CASES,
                         ids=[f"{c[0]}-{c[1].__name__}-{'overlap' if c[2] else 'deferred'}-step{c[3]}" for c in CASES])
def test_fault_leaves_engine_usable_and_correct(phase, fault, overlap, at_step, at):
    model, engine, opt, ref, ref_opt = make(overlap, at)
    threads_before = None
    losses = []
    for step in range(6):
        if step == at_step:
            x, y = batch(100 + step)
            _fault(phase, fault, model, engine, opt, ref, ref_opt, x, y)
            assert_nothing_held(engine)
        losses.append(normal_step(engine, opt, ref, ref_opt, step))
        if step == 0:
            threads_before = threading.active_count()
            pinned = engine.memory_stats()["host_pinned_bytes"]
        assert_nothing_held(engine)
    check_final(engine, ref, losses)
    assert threading.active_count() == threads_before
    assert engine.memory_stats()["host_pinned_bytes"] == pinned
    assert engine.memory_stats()["device_peak_bytes"] <= engine.memory_stats()["budget_bytes"]
    engine.close()


def _fault(phase, fault, model, engine, opt, ref, ref_opt, x, y):
    """Raise ``fault`` in ``phase`` in the engine, and the same fault in the same place in the reference."""
    if phase.startswith("forward"):
        model.forward_fault = fault("boom")
        if phase == "forward":
            with pytest.raises(fault, match="boom"), pytest.warns(offload.OffloadWarning, match="forward raised"):
                engine(x)
        elif fault is KeyboardInterrupt:  # the module called directly: noticed by the next forward
            with pytest.raises(fault, match="boom"):
                model(x)
            model.forward_fault = None
            with pytest.warns(offload.OffloadWarning, match="forward did not finish"), torch.no_grad():
                engine(x)
        else:  # the module called directly: an exception is seen as it leaves the module
            with pytest.raises(fault, match="boom"), pytest.warns(offload.OffloadWarning, match="forward raised"):
                model(x)
        model.forward_fault = None
        opt.zero_grad()
        return
    loss = loss_of(engine(x), y)
    model.backward_fault[0] = fault("boom")
    # A fault at the output side raises before autograd reaches anything of the engine's: nothing to discard,
    # nothing to warn about. Elsewhere the engine's part of the backward had begun.
    began = model.at != DEPTH - 1
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        if phase == "backward":
            with pytest.raises(fault, match="boom"):
                engine.backward(loss)
        else:
            with pytest.raises(fault, match="boom"):
                loss.backward()
            if fault is KeyboardInterrupt:
                with torch.no_grad():
                    engine(x)  # the next forward notices
            else:
                opt.zero_grad()  # zero_grad() notices
    messages = [str(m.message) for m in w if issubclass(m.category, offload.OffloadWarning)]
    assert len(messages) == int(began) and len(w) == len(messages), [str(m.message) for m in w]
    if began:
        start = "backward raised" if phase == "backward" else "backward did not finish"
        assert start in messages[0] and "Discarded" in messages[0] and "No weight was changed" in messages[0]
    model.backward_fault[0] = None
    del loss
    opt.zero_grad()
    ref.backward_fault[0] = fault("boom")
    with pytest.raises(fault, match="boom"):
        loss_of(ref(x), y).backward()
    ref.backward_fault[0] = None
    ref_opt.zero_grad()


def test_backward_fault_with_overlap_keeps_only_complete_updates():
    """overlap_optimizer=True: buckets whose grads were all in before the fault were updated (from complete,
    correct grads); the rest were not touched. The warning names the updated buckets. Every parameter ends
    either exactly as before the step or exactly as one plain AdamW step with the full gradient leaves it."""
    model, engine, opt, ref, ref_opt = make(overlap=True, at=1)  # fault near the input: most grads are in
    normal_step(engine, opt, ref, ref_opt, 0)
    before = engine.state_dict()["model"]
    x, y = batch(7)
    loss_of(ref(x), y).backward()
    ref_opt.step()  # the step the engine would take without the fault
    after = ref.state_dict()
    loss = loss_of(engine(x), y)
    model.backward_fault[0] = RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"), pytest.warns(offload.OffloadWarning, match="Kept: AdamW updates"):
        engine.backward(loss)
    model.backward_fault[0] = None
    del loss
    opt.zero_grad()
    assert_nothing_held(engine)
    state = engine.state_dict()["model"]
    updated = [k for k in state if not torch.equal(state[k], before[k])]
    kept = [k for k in state if torch.equal(state[k], before[k])]
    assert updated and kept
    assert all(k.startswith(("layers.0.", "layers.1.")) for k in kept), kept  # no grads reached them
    for k in updated:
        torch.testing.assert_close(state[k], after[k], **TOL)
    # and the engine trains on
    for step in range(1, 4):
        x, y = batch(step)
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        opt.step()
        assert math.isfinite(loss.item())
    assert_nothing_held(engine)
    engine.close()


def test_failed_second_backward_drops_gathered_grads_as_zero_grad_would():
    """Accumulation (overlap_optimizer=False): the second micro-batch's backward fails; everything
    gathered since the last step() is dropped and no weight changed; training then matches plain PyTorch."""
    model, engine, opt, ref, ref_opt = make(overlap=False)
    losses = [normal_step(engine, opt, ref, ref_opt, 0)]
    x, y = batch(50)
    engine.backward(loss_of(engine(x), y))  # first micro-batch: fine
    loss = loss_of(engine(x * 2), y)
    model.backward_fault[0] = ValueError("boom")
    with pytest.raises(ValueError), pytest.warns(offload.OffloadWarning, match="every gradient gathered"):
        engine.backward(loss)
    model.backward_fault[0] = None
    del loss
    opt.zero_grad()
    assert_nothing_held(engine)
    for step in range(1, 4):
        losses.append(normal_step(engine, opt, ref, ref_opt, step))
    check_final(engine, ref, losses)
    engine.close()


def test_step_during_backward_is_refused_not_mistaken_for_a_fault():
    model, engine, opt, ref, ref_opt = make()
    normal_step(engine, opt, ref, ref_opt, 0)
    x, y = batch(1)
    x.requires_grad_()  # its grad hook runs inside autograd, after the engine's part of the backward began
    out = engine(x)
    seen = []

    def hook(grad):
        with pytest.raises(offload.OffloadError, match="during backward"):
            opt.step()
        seen.append(1)
        return grad

    x.register_hook(hook)
    engine.backward(loss_of(out, y))
    opt.step()
    assert seen == [1]
    assert_nothing_held(engine)
    engine.close()


def test_an_error_filter_on_the_warning_never_hides_the_fault():
    """With OffloadWarning turned into an error (as this test suite does), the fault itself still propagates,
    the warning's text attached to it as a note."""
    model, engine, opt, ref, ref_opt = make()
    normal_step(engine, opt, ref, ref_opt, 0)
    model.forward_fault = RuntimeError("boom")
    with warnings.catch_warnings():
        warnings.simplefilter("error", offload.OffloadWarning)
        with pytest.raises(RuntimeError, match="boom") as info:
            engine(batch(1)[0])
    model.forward_fault = None
    assert any("Discarded" in note for note in info.value.__notes__)
    del info
    assert_nothing_held(engine)
    engine.close()
