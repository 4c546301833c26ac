"""Plain PyTorch calls on a wrapped model (issue 19; offload/runtime/plain_grads.py, [Note: gradients in
p.grad]): each works as in plain PyTorch or raises a clear error, never silently does nothing.

The loops here are written as a user's loop is (nanoGPT's): ``loss.backward()`` on the module's own output,
then ``torch.nn.utils`` calls on ``model.parameters()``. fp32 runs use ``offload.AdamW(fused=False)`` and
must equal plain PyTorch + ``torch.optim.AdamW(foreach=False)`` bit for bit (tests/support/compare.py).

Before issue 19, ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` returned 0.0 after backward and
clipped nothing (every ``p.grad`` was None). Checked by running this file on the commit before issue 19
(816d025, with this tests/support/fake_cuda.py): 50 of its 52 CPU tests fail there (the first clipping test
with "assert 0.0 == 15.229..."); the two that pass check what already worked (parameters() and
named_parameters() are the model's own; model.cuda() raises on a machine without CUDA)."""

import copy

import pytest
import torch

import offload
from tests.support.budgets import with_headroom
from tests.support.compare import assert_bitwise
from tests.support.fake_cuda import simulated_gpu  # noqa: F401 (a fixture)
from tests.support.models import CASES, run

ADAMW = dict(lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _pair(name, dtype=torch.float32, budget_frac=0.6, device="cpu", **wrap_kw):
    """(case, engine, opt, reference, reference opt): buckets stream (budget 0.6x the fp32 weights)."""
    case = CASES[name]()
    ref = copy.deepcopy(case.model).to(device)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    nbytes = sum(p.numel() * 4 for p in case.model.parameters())
    opt = offload.AdamW(case.model.parameters(), fused=False, **ADAMW)
    engine = offload.wrap(case.model, opt, budget=with_headroom(budget_frac * nbytes, device),
                          bucket_bytes=nbytes // 10, dtype=dtype, device=device, **wrap_kw)
    return case, engine, opt, ref, ref_opt


def _backward(case, model, i, k=1, device="cpu"):
    """A user's ``loss.backward()`` on the model's own forward (no engine call); the loss value."""
    b = case.make_batch(i).to(device)
    loss = case.loss_fn(run(model, b), b) / k
    loss.backward()
    return loss.item()


def _lockstep(case, engine, opt, ref, ref_opt, steps, user, accumulate=1):
    """Train the wrapped model and the reference side by side; ``user(model, step)`` runs the same plain
    PyTorch code on each after the step's backward passes and before ``optimizer.step()``."""
    model = engine.module
    for step in range(steps):
        for i in range(accumulate):
            got = _backward(case, model, step * accumulate + i, accumulate)
            want = _backward(case, ref, step * accumulate + i, accumulate)
            assert got == want, (step, i, got, want)
        assert user(model, step) == user(ref, step), step
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()


def _micro_steps_with_torch_clip(model, opt, ref, ref_opt, steps, accumulate, micro, max_norm):
    """``steps`` steps of ``accumulate`` micro-batches (``micro(m, i)`` runs one's backward on ``m``) on the
    wrapped model and the reference side by side, torch's clip_grad_norm_ on each before its step; the norms
    must agree."""
    for step in range(steps):
        for i in range(accumulate):
            micro(model, step * accumulate + i)
            micro(ref, step * accumulate + i)
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) == \
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()


def _same_state(engine, ref):
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "weights")


def _host_grad(engine, param) -> torch.Tensor:
    """White box: ``param``'s fp32 gradient sum as the host holds it (waiting for its copies first)."""
    rt = engine._runtime
    for _, ready in rt.grads.pending.values():
        ready.synchronize()
    p = rt.ctx.param_index[id(param)]
    b, off = rt.slots.host.bucket_of[p], rt.slots.host.offset[p]
    return rt.slots.host.grad[b][off: off + param.numel()].view(param.shape).clone()


# -- deferred updates (overlap_optimizer=False): p.grad is the gradient ------------------------------------

@pytest.mark.parametrize("accumulate,foreach", [(1, None), (2, None), (2, True)])
def test_clip_grad_norm_of_model_parameters_is_plain_torch_bit_for_bit(accumulate, foreach):
    """nanoGPT's line ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` after ``loss.backward()``
    (``foreach=True``: torch's _foreach_norm / _foreach_mul_ on the grads, lists of ExposedGrad)."""
    case, engine, opt, ref, ref_opt = _pair("gpt", overlap_optimizer=False)
    clipped = []

    def clip(model, step):
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=foreach)  # below the typical norm
        if model is ref:
            clipped.append(norm.item() > 0.5)
        return norm.item()

    _lockstep(case, engine, opt, ref, ref_opt, 8, clip, accumulate)
    assert sum(clipped) >= 6, "the test must exercise clipping"
    _same_state(engine, ref)
    engine.close()


@pytest.mark.parametrize("name", ["frozen_layers", "reused_module", "cnn_batchnorm", "bert"])
def test_clip_grad_norm_on_other_models_is_plain_torch_bit_for_bit(name):
    """Frozen parameters (p.grad stays None, as in torch), a module called twice, BatchNorm buffers, a masked
    encoder."""
    case = CASES[name]()
    ref = copy.deepcopy(case.model)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], foreach=False, **ADAMW)
    nbytes = sum(p.numel() * 4 for p in case.model.parameters())
    opt = offload.AdamW([p for p in case.model.parameters() if p.requires_grad], fused=False, **ADAMW)
    engine = offload.wrap(case.model, opt, budget=int(0.6 * nbytes), bucket_bytes=nbytes // 10, device="cpu",
                          overlap_optimizer=False)

    def clip(model, step):
        return (torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1).item(),
                [p.grad is None for p in model.parameters()])

    _lockstep(case, engine, opt, ref, ref_opt, 4, clip)
    _same_state(engine, ref)
    engine.close()


def test_clip_grad_value_and_clip_grads_with_norm_are_plain_torch_bit_for_bit():
    case, engine, opt, ref, ref_opt = _pair("mlp", overlap_optimizer=False)
    clamped = []

    def clip(model, step):
        if model is ref:
            clamped.append(sum(int((p.grad.abs() > 0.01).sum()) for p in model.parameters()))
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
        grads = [p.grad for p in model.parameters()]
        total = torch.nn.utils.get_total_norm(grads, 2.0)
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.05, total)
        return total.item()

    _lockstep(case, engine, opt, ref, ref_opt, 5, clip)
    assert min(clamped) > 0, "clip_grad_value_ must clamp something"
    _same_state(engine, ref)
    engine.close()


def test_per_parameter_norms_and_in_place_scaling_are_plain_torch_bit_for_bit():
    """Per-layer grad-norm logging reads torch's numbers; ``p.grad.mul_``/``div_`` change the update; the
    engine's own clip_grad_norm_ afterwards sees the scaled grads (its cached norms are renewed)."""
    case, engine, opt, ref, ref_opt = _pair("gpt", overlap_optimizer=False)

    def user(model, step):
        logged = []
        for i, (name, p) in enumerate(model.named_parameters()):
            logged.append((name, p.grad.norm().item(), p.grad.abs().max().item(),
                           torch.linalg.vector_norm(p.grad, float("inf")).item()))
            if i % 2:
                p.grad.mul_(0.5)
            else:
                p.grad.div_(3.0)
        if model is engine.module:
            norm = engine.clip_grad_norm_(0.5)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        return logged, norm.item()

    _lockstep(case, engine, opt, ref, ref_opt, 6, user)
    _same_state(engine, ref)
    engine.close()


def test_engine_clip_grad_norm_shows_in_p_grad():
    """After ``engine.clip_grad_norm_`` p.grad holds the clipped grads, as after torch's clip_grad_norm_."""
    case, engine, opt, ref, ref_opt = _pair("mlp", overlap_optimizer=False)

    def user(model, step):
        if model is engine.module:
            norm = engine.clip_grad_norm_(0.1)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        return norm.item(), [p.grad.clone() for p in model.parameters()]

    def compare(model, step):
        got = user(model, step)
        return got[0], [g.tolist() for g in got[1]]

    _lockstep(case, engine, opt, ref, ref_opt, 4, compare)
    _same_state(engine, ref)
    engine.close()


def test_deleting_or_replacing_p_grad_is_honoured():
    """``p.grad = None`` drops that parameter's gradient (AdamW skips it: no decay, no step count) and
    ``p.grad = t`` updates with ``t``, between backward and step and between accumulated backward passes."""
    case, engine, opt, ref, ref_opt = _pair("gpt", overlap_optimizer=False)
    model = engine.module

    def edit(m, step):
        params = list(m.parameters())
        params[[0, 5, 9, 2, 7][step]].grad = None
        params[3].grad = torch.full_like(params[3], 1e-3 * (step + 1))
        return [p.grad is None for p in params]

    for step in range(5):
        _backward(case, model, 2 * step, 2)
        _backward(case, ref, 2 * step, 2)
        list(model.parameters())[1].grad = None  # between micro-batches: the next backward starts afresh
        list(ref.parameters())[1].grad = None
        _backward(case, model, 2 * step + 1, 2)
        _backward(case, ref, 2 * step + 1, 2)
        assert edit(model, step) == edit(ref, step)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    _same_state(engine, ref)
    steps = {int(s["step"]) for s in opt.state.values()}
    assert len(steps) > 1  # dropped grads skipped their step counts, as torch's
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == \
        [int(ref_opt.state[p]["step"]) for p in ref.parameters()]
    engine.close()


def test_model_zero_grad_between_backward_and_step_updates_nothing():
    case, engine, opt, ref, ref_opt = _pair("mlp", overlap_optimizer=False)
    model = engine.module
    _backward(case, model, 0)
    opt.step()
    opt.zero_grad()
    before = engine.state_dict()
    _backward(case, model, 1)
    assert all(p.grad is not None for p in model.parameters())
    model.zero_grad()  # torch: p.grad = None for every parameter
    assert all(p.grad is None for p in model.parameters())
    opt.step()  # torch's AdamW skips parameters without a grad: nothing changes
    after = engine.state_dict()
    assert_bitwise(after["model"], before["model"], "weights")
    assert [int(s["step"]) for s in after["optimizer"]["state"].values()] == [1] * len(list(model.parameters()))
    engine.close()


@pytest.mark.parametrize("how", ["optimizer", "engine"])
def test_zero_grad_sets_p_grad_to_none(how):
    case, engine, opt, _, _ = _pair("mlp", overlap_optimizer=False)
    model = engine.module
    _backward(case, model, 0)
    g = next(model.parameters()).grad
    {"optimizer": lambda: opt.zero_grad(set_to_none=True), "engine": engine.zero_grad}[how]()
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(offload.OffloadError, match="no longer current"):
        g.norm()  # a grad held across zero_grad() refuses to work instead of showing dropped numbers
    engine.close()


def test_zero_grad_without_set_to_none_keeps_zero_grads_as_torch():
    """``optimizer.zero_grad(set_to_none=False)`` zeroes p.grad in place: a step right after it updates with
    zero gradients (weight decay, Adam's momentum) and a backward after it adds to zeros, as in torch."""
    case, engine, opt, ref, ref_opt = _pair("gpt", overlap_optimizer=False)
    model = engine.module
    for step in range(3):
        _backward(case, model, 2 * step)
        _backward(case, ref, 2 * step)
        held = next(model.parameters()).grad
        opt.zero_grad(set_to_none=False)
        ref_opt.zero_grad(set_to_none=False)
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
        assert not held.any()  # the same tensor, zeroed in place
        if step == 1:  # and a backward after it
            _backward(case, model, 2 * step + 1)
            _backward(case, ref, 2 * step + 1)
        if step == 2:  # clipping zeros: norm 0
            assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item() == 0.0
        opt.step()
        ref_opt.step()
        _same_state(engine, ref)  # the zero-gradient step moved the weights as torch's did
    engine.close()


def test_a_grad_held_after_step_or_the_next_forward_raises():
    case, engine, opt, _, _ = _pair("mlp", overlap_optimizer=False)
    model = engine.module
    _backward(case, model, 0)
    g = next(model.parameters()).grad
    g.norm()
    opt.step()
    assert next(model.parameters()).grad is None
    with pytest.raises(offload.OffloadError, match="no longer current"):
        g.norm()
    _backward(case, model, 1)
    g = next(model.parameters()).grad
    b = case.make_batch(2)
    loss = case.loss_fn(run(model, b), b)  # a forward: p.grad stays until its backward begins
    assert next(model.parameters()).grad is g
    g.sum()
    loss.backward()  # adds to the sums; p.grad was taken back as it began, then exposed anew
    assert next(model.parameters()).grad is not g
    with pytest.raises(offload.OffloadError, match="no longer current"):
        g.sum()
    engine.close()


def test_a_forward_with_grad_and_no_backward_between_backward_and_clip_keeps_p_grad():
    """A validation loss computed with grad enabled (no backward after it) between backward and a torch clip:
    p.grad is left as it was, as in plain PyTorch (it was taken back at that forward, so the clip clipped
    nothing: silently wrong weights)."""
    case, engine, opt, ref, ref_opt = _pair("mlp", overlap_optimizer=False)

    def user(m, step):
        b = case.make_batch(100 + step)
        case.loss_fn(run(m, b), b)  # with grad enabled; dropped without a backward
        return float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01))

    _lockstep(case, engine, opt, ref, ref_opt, 3, user, accumulate=2)
    _same_state(engine, ref)
    engine.close()


def test_views_and_out_of_place_results():
    """Views write through to the host sum; out-of-place results are plain tensors like the parameter's."""
    case, engine, opt, ref, ref_opt = _pair("mlp", overlap_optimizer=False)

    def user(model, step):
        p = next(model.parameters())
        row = p.grad[0]
        row.mul_(2.0)  # through a view
        p.grad.view(-1)[:5].zero_()
        copy_ = p.grad.clone()
        doubled = p.grad * 2
        assert type(copy_) is torch.Tensor and type(doubled) is torch.Tensor
        assert doubled.dtype == p.dtype and doubled.device == p.device
        ema = torch.zeros_like(p)
        ema.lerp_(p.grad, 0.1)  # an EMA of grads
        return copy_.tolist(), doubled.sum().item(), ema.sum().item(), p.grad.sum().item()

    _lockstep(case, engine, opt, ref, ref_opt, 3, user)
    _same_state(engine, ref)
    engine.close()


def test_retained_graph_backward_without_a_forward_raises():
    case, engine, opt, _, _ = _pair("mlp", overlap_optimizer=False)
    model = engine.module
    b = case.make_batch(0)
    loss = case.loss_fn(run(model, b), b)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()
    engine.close()


def test_engine_backward_twice_on_a_retained_graph_raises_too():
    """``engine.backward(loss, retain_graph=True)`` then ``engine.backward(loss)`` raises like ``loss.backward()``
    does: the engine gathers one backward's grads per forward, and a second backward of the same forward's
    graph would find its buckets' grads already sent (they would be dropped, silently, without the error:
    that is what happened before issue 19 exposed p.grad)."""
    case, engine, opt, _, _ = _pair("mlp", overlap_optimizer=False)
    model = engine.module
    b = case.make_batch(0)
    loss = case.loss_fn(run(model, b), b)
    engine.backward(loss, retain_graph=True)
    with pytest.warns(offload.OffloadWarning), pytest.raises(offload.OffloadError, match="forward before each backward"):
        engine.backward(loss)
    engine.close()


@pytest.mark.parametrize("budget_frac", [4.0, 0.6], ids=["resident", "streamed"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_gradient_penalty_before_backward_is_plain_torch_bit_for_bit(accumulate, budget_frac):
    """``torch.autograd.grad`` between forward and backward (a gradient penalty) reaches the engine's end of
    backward but accumulates nothing: p.grad stays None for the backward that follows (it raised before).
    Streamed: the graph ``create_graph=True`` builds saves the weights its nodes unpack, which the unpack hook
    then hands out as copies (the slot is reused before the second backward reads them: before, a
    version-counter error)."""
    case, engine, opt, ref, ref_opt = _pair("mlp", budget_frac=budget_frac, overlap_optimizer=False)
    model = engine.module

    def micro(m, i):
        b = case.make_batch(i)
        x = b.args[0].clone().requires_grad_(True)
        out = m(x).sum()
        g, = torch.autograd.grad(out, x, create_graph=True)
        (out + (g.norm() - 1) ** 2).backward()

    _micro_steps_with_torch_clip(model, opt, ref, ref_opt, 3, accumulate, micro, 0.5)
    _same_state(engine, ref)
    engine.close()


def test_an_inference_mode_forward_between_backward_and_clip_keeps_p_grad():
    """A forward under ``torch.inference_mode()`` is a no-grad forward: it leaves p.grad alone (the runtime's
    own code leaves inference mode inside the forward, which turned grad mode on and took p.grad back, so a
    torch clip after it clipped nothing: silently wrong weights), and it follows a forward-only plan."""
    case, engine, opt, ref, ref_opt = _pair("mlp", overlap_optimizer=False)

    def user(m, step):
        b = case.make_batch(100 + step)
        with torch.inference_mode():
            run(m, b)
        return float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01))

    _lockstep(case, engine, opt, ref, ref_opt, 3, user)
    _same_state(engine, ref)
    assert engine.memory_stats()["counters"]["eval_plans_built"] >= 1
    engine.close()


# -- 16-bit compute ------------------------------------------------------------------------------------------

def test_bf16_p_grad_is_the_host_sum_in_the_parameters_dtype():
    case, engine, opt, _, _ = _pair("gpt", dtype=torch.bfloat16, overlap_optimizer=False)
    model = engine.module
    _backward(case, model, 0, 2)
    _backward(case, model, 1, 2)
    for p in model.parameters():
        want = _host_grad(engine, p)
        assert p.grad.dtype == torch.bfloat16 and p.grad.shape == p.shape and p.grad.device == p.device
        assert torch.equal(p.grad.float(), want)  # .float() reads the fp32 sum itself, not a bf16 rounding
        assert p.grad.norm().dtype == torch.bfloat16  # as a bf16 grad's norm in plain PyTorch
        assert torch.equal(p.grad.norm(), want.norm().to(torch.bfloat16))
    engine.close()


def test_bf16_clip_grad_norm_follows_the_engines_clip():
    """torch's clip_grad_norm_ on bf16 grads computes its norms in bf16 (as plain PyTorch does for bf16 grads):
    the total norm and the training that follows agree with engine.clip_grad_norm_ (fp32 norms) within bf16's
    rounding (2**-8 relative)."""
    runs = []
    for use_torch in (True, False):
        case, engine, opt, _, _ = _pair("gpt", dtype=torch.bfloat16, overlap_optimizer=False)
        initial = {n: p.detach().clone() for n, p in case.model.named_parameters()}
        norms, losses = [], []
        for step in range(6):
            losses.append(_backward(case, engine.module, step))
            if use_torch:
                norms.append(torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 0.5).item())
            else:
                norms.append(engine.clip_grad_norm_(0.5).item())
            opt.step()
            opt.zero_grad()
        runs.append((norms, losses, engine.state_dict()["model"]))
        engine.close()
    (tn, tl, tw), (en, el, ew) = runs
    assert min(en) > 0.5, "the test must exercise clipping"
    torch.testing.assert_close(tn, en, rtol=2**-7, atol=0)
    torch.testing.assert_close(tl, el, rtol=1e-3, atol=0)
    # The updates agree to 1 % of their size (an element whose true gradient is ~0 may differ by up to lr a
    # step: see [Note: exact, or within the kernel's bound] in tests/support/compare.py).
    for name, w0 in initial.items():
        diff, update = (tw[name] - ew[name]).norm(), (ew[name] - w0).norm()
        assert diff <= 0.01 * update, (name, float(diff), float(update))


def _fp16_pair(**kw):
    return _pair("mlp", dtype=torch.float16, overlap_optimizer=False,
                 loss_scale=offload.LossScaleConfig(init_scale=1024.0, growth_interval=1000), **kw)


def test_fp16_p_grad_is_unscaled_and_reading_it_changes_nothing():
    """With float16 loss scaling the host sums are scaled; p.grad shows them unscaled (as plain PyTorch shows
    grads after GradScaler.unscale_, where a torch loop clips), and reading them (which unscales the sums and
    scales them back: powers of two, exact) leaves training bit for bit as without reading."""
    runs = []
    for read in (False, True):
        case, engine, opt, _, _ = _fp16_pair()
        model = engine.module
        for step in range(4):
            for i in range(2):
                b = case.make_batch(2 * step + i)
                engine.backward(case.loss_fn(run(model, b), b) / 2)
                if read:
                    scaled = [_host_grad(engine, p) for p in model.parameters()]  # before p.grad is read
                    for p, want in zip(model.parameters(), scaled):
                        assert torch.equal(p.grad.float(), want / engine._runtime.grads.step_scale)
                        p.grad.norm()
            opt.step()
            opt.zero_grad()
        assert engine.memory_stats()["optimizer"]["skipped_steps"] == 0
        runs.append(engine.state_dict()["model"])
        engine.close()
    assert_bitwise(runs[1], runs[0], "reading p.grad")


def test_fp16_torch_clip_grad_norm_matches_the_engines_clip():
    runs = []
    for use_torch in (True, False):
        case, engine, opt, _, _ = _fp16_pair()
        model, norms = engine.module, []
        for step in range(4):
            b = case.make_batch(step)
            engine.backward(case.loss_fn(run(model, b), b))
            if use_torch:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
            else:
                norms.append(engine.clip_grad_norm_(0.5).item())
            opt.step()
            opt.zero_grad()
        runs.append((norms, engine.state_dict()["model"]))
        engine.close()
    (tn, tw), (en, ew) = runs
    assert min(en) > 0.5, "the test must exercise clipping"
    torch.testing.assert_close(tn, en, rtol=2**-10, atol=0)  # torch's norms are float16 numbers here
    # The clip coefficients differ in their last bits (torch's norm is a float16 number, the engine's an fp32
    # one). AdamW is scale-invariant except through eps, so almost every weight agrees closely; an element whose
    # grad is near eps in size turns the tiny difference into up to an lr-sized step per update (seen on an AMD
    # EPYC: 1 of 16384 elements of one tensor 2.3e-4 apart, 0.8 lr). So: every element within 4 updates of lr,
    # and at most 0.1 % of a tensor's elements outside the close tolerance.
    for name, want in ew.items():
        got = tw[name].float()
        diff = (got - want.float()).abs()
        assert diff.max().item() <= 4 * ADAMW["lr"], f"{name}: {diff.max().item()}"
        close = diff <= 1e-4 + 1e-2 * want.float().abs()
        assert (~close).sum().item() <= max(1, want.numel() // 1000), f"{name}: {(~close).sum().item()} elements"


# -- overlapped updates: p.grad raises when used --------------------------------------------------------------

def test_overlapped_updates_refuse_every_use_of_p_grad():
    case, engine, opt, ref, ref_opt = _pair("mlp")  # overlap_optimizer=True (the fp32 default)
    model = engine.module
    _backward(case, model, 0)
    p = next(model.parameters())
    assert p.grad is not None and p.grad.shape == p.shape  # metadata only: no error
    for use in (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0),
                lambda: torch.nn.utils.clip_grad_value_(model.parameters(), 1.0),
                lambda: torch.nn.utils.get_total_norm([q.grad for q in model.parameters()]),
                lambda: p.grad.norm(), lambda: p.grad.mul_(0.5), lambda: p.grad.clone(), lambda: p.grad.sum().item()):
        with pytest.raises(offload.OffloadError, match="overlap_optimizer=False"):
            use()
    assert "consumed" in repr(p.grad)  # a repr never raises
    opt.step()
    opt.zero_grad()
    engine.close()


def test_overlapped_updates_let_code_that_only_checks_for_none_train():
    """Code that counts or skips parameters by ``p.grad is None`` goes on, and training equals torch's."""
    case, engine, opt, ref, ref_opt = _pair("gpt")

    def count(model, step):
        return sum(p.grad is not None for p in model.parameters())

    _lockstep(case, engine, opt, ref, ref_opt, 4, count)
    _same_state(engine, ref)
    engine.close()


def test_overlapped_updates_give_a_data_less_grad_again_only_where_nobody_holds_it():
    """[Note: reusing a data-less grad] in plain_grads.py: a data-less p.grad taken back at step() that nobody
    else references is given to its parameter again after the next backward (no new tensor per parameter per
    step); one the user holds goes stale, as before: it raises "no longer current" and is not given again."""
    case, engine, opt, _, _ = _pair("mlp")  # overlap_optimizer=True (the fp32 default)
    model = engine.module
    exposure = engine._runtime.grads.exposure
    params = list(model.parameters())
    _backward(case, model, 0)
    held = params[0].grad
    opt.step()
    opt.zero_grad()
    spare = dict(exposure._spare)
    assert set(spare) == set(range(1, len(params)))  # every grad but the one held
    _backward(case, model, 1)
    assert all(params[p].grad is g for p, g in spare.items())
    assert params[0].grad is not held
    with pytest.raises(offload.OffloadError, match="no longer current"):
        held.norm()
    with pytest.raises(offload.OffloadError, match="overlap_optimizer=False"):
        params[1].grad.norm()  # the one given again is current
    del spare, held
    opt.step()
    engine.close()


def test_a_spare_data_less_grad_that_torchs_grad_setter_refuses_is_replaced_by_a_new_one():
    """[Note: reusing a data-less grad]: ``expose`` gives a spare through torch's grad setter, which checks shape,
    dtype and device before it sets anything; a spare it refuses (here one of another shape, planted) is
    replaced by a new data-less grad of the parameter's own shape, and the step goes on, bit for bit torch."""
    from offload.runtime.plain_grads import ExposedGrad

    case, engine, opt, ref, ref_opt = _pair("mlp")  # overlap_optimizer=True (the fp32 default)
    model = engine.module
    exposure = engine._runtime.grads.exposure
    params = list(model.parameters())
    for step in range(2):
        assert _backward(case, model, step) == _backward(case, ref, step)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    wrong = ExposedGrad(exposure, 0, None, params[0], shape=torch.Size([params[0].numel() + 1]))
    exposure._spare[0] = wrong
    assert _backward(case, model, 2) == _backward(case, ref, 2)
    assert params[0].grad is not wrong and params[0].grad.shape == params[0].shape
    assert all(params[p].grad is g for p, g in exposure.exposed.items())
    opt.step(), ref_opt.step()
    _same_state(engine, ref)
    engine.close()


def test_overlapped_updates_name_dropped_then_replaced_grads_at_step_and_take_every_grad_back():
    """``step()`` reads and takes back the exposed grads in one pass (``Exposure._take_back_consumed``): a grad
    dropped and one replaced are named as before (the dropped first, each in model order), every p.grad is None
    afterwards, and the next step trains on."""
    case, engine, opt, _, _ = _pair("mlp")
    model = engine.module
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    _backward(case, model, 0)
    params[3].grad = torch.zeros_like(params[3])
    params[1].grad = None
    with pytest.raises(offload.OffloadError, match=f"\\({names[1]}, {names[3]}\\) between backward"):
        opt.step()
    assert all(p.grad is None for p in params)
    opt.step()  # told once; the engine goes on
    _backward(case, model, 1)
    opt.step()
    engine.close()


@pytest.mark.parametrize("how", ["model.zero_grad", "p.grad = None", "p.grad = t", "opt.zero_grad",
                                 "opt.zero_grad(False)"])
def test_overlapped_updates_refuse_dropping_grads_before_step(how):
    """torch would skip (or change) the update, but it ran during backward: refused, naming the fix."""
    case, engine, opt, _, _ = _pair("mlp")
    model = engine.module
    _backward(case, model, 0)
    p = next(model.parameters())
    with pytest.raises(offload.OffloadError, match="overlap_optimizer=False"):
        if how == "model.zero_grad":
            model.zero_grad()
        elif how == "p.grad = None":
            p.grad = None
        elif how == "p.grad = t":
            p.grad = torch.zeros_like(p)
        else:
            opt.zero_grad(set_to_none=how == "opt.zero_grad")
        opt.step()
    opt.step()  # told once; the engine goes on (the update of that backward stands)
    _backward(case, model, 1)
    opt.step()
    engine.close()


# -- state dicts, parameters and conversions ------------------------------------------------------------------

@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "deferred"])
def test_model_state_dict_holds_the_real_weights_during_training(overlap):
    case, engine, opt, ref, ref_opt = _pair("gpt", overlap_optimizer=overlap)
    model = engine.module
    before = model.state_dict()
    assert_bitwise(before, ref.state_dict(), "before the first forward")
    for step in range(3):
        _backward(case, model, step)
        _backward(case, ref, step)
        if overlap:  # the updates ran in backward: the state dict waits for them
            ref_opt.step()
        sd = model.state_dict()
        assert_bitwise(sd, engine.state_dict()["model"], "model.state_dict()")
        assert_bitwise(sd, ref.state_dict(), "model.state_dict()")  # no NaN placeholder among them
        if not overlap:
            ref_opt.step()
        opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    block = dict(model.named_children())["blocks"][0]
    ref_block = dict(ref.named_children())["blocks"][0]
    assert_bitwise(block.state_dict(), ref_block.state_dict(), "a submodule's state_dict()")
    kept = model.state_dict(keep_vars=True)
    assert all(kept[n] is p for n, p in model.named_parameters())  # keep_vars=True: the parameters themselves
    engine.close()


def test_parameters_and_named_parameters_are_the_models_own():
    case = CASES["gpt"]()
    names = [n for n, _ in case.model.named_parameters()]
    ids = [id(p) for p in case.model.parameters()]
    nbytes = sum(p.numel() * 4 for p in case.model.parameters())
    opt = offload.AdamW(case.model.parameters(), fused=False, **ADAMW)
    engine = offload.wrap(case.model, opt, budget=int(0.6 * nbytes), device="cpu", bucket_bytes=nbytes // 10)
    _backward(case, engine.module, 0)
    assert [n for n, _ in engine.module.named_parameters()] == names
    assert [id(p) for p in engine.module.parameters()] == ids
    opt.step()
    engine.close()


def test_load_state_dict_before_the_first_forward_works_after_it_raises():
    case, engine, opt, ref, ref_opt = _pair("mlp")
    model = engine.module
    other = CASES["mlp"]().model
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    model.load_state_dict(other.state_dict())  # plain: the parameters hold their values until the first forward
    ref.load_state_dict(other.state_dict())
    _lockstep(case, engine, opt, ref, ref_opt, 2, lambda m, s: None)
    _same_state(engine, ref)
    with pytest.raises(offload.OffloadError, match="engine.load_state_dict"):
        model.load_state_dict(other.state_dict())
    _same_state(engine, ref)  # the refused load changed nothing
    engine.load_state_dict({"model": other.state_dict(), "optimizer": opt.state_dict()})  # the way it names
    assert_bitwise(model.state_dict(), other.state_dict(), "loaded")
    engine.close()


CONVERSIONS = {
    "half": lambda m: m.half(), "double": lambda m: m.double(), "bfloat16": lambda m: m.bfloat16(),
    "to(float64)": lambda m: m.to(torch.float64), "to(dtype=float16)": lambda m: m.to(dtype=torch.float16),
}


@pytest.mark.parametrize("call", list(CONVERSIONS))
@pytest.mark.parametrize("when", ["after_step", "before_step"])
def test_converting_the_wrapped_model_raises_naming_the_fix(call, when):
    """``model.half()`` etc. after wrapping: the next forward raises (or ``step()``, where the conversion came
    between backward and step: ``ParamGuard.check_at_step``), naming the call and offload.wrap's dtype=/device=;
    the conversion is undone and training goes on exactly as torch's without it."""
    case, engine, opt, ref, ref_opt = _pair("mlp", overlap_optimizer=False)
    model = engine.module
    _lockstep(case, engine, opt, ref, ref_opt, 1, lambda m, s: None)
    refused = r"model\.to\(\.\.\.\).*\.half\(\).*dtype=/device= to offload\.wrap"
    if when == "before_step":  # with gradients exposed in p.grad
        _backward(case, model, 1)
        _backward(case, ref, 1)
        CONVERSIONS[call](model)
        with pytest.raises(offload.OffloadError, match=refused):
            opt.step()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()  # again, as the user would
    else:
        CONVERSIONS[call](model)
        with pytest.raises(offload.OffloadError, match=refused):
            _backward(case, model, 2)
    _lockstep(case, engine, opt, ref, ref_opt, 2, lambda m, s: None)
    _same_state(engine, ref)
    engine.close()


def test_converting_before_the_first_forward_raises_too():
    case, engine, opt, ref, ref_opt = _pair("mlp", dtype=torch.bfloat16)
    engine.module.double()
    with pytest.raises(offload.OffloadError, match=r"now torch.float64 on cpu, where the engine keeps it as "
                                                   r"torch.float32 on cpu.*dtype=/device= to offload\.wrap"):
        _backward(case, engine.module, 0)
    _backward(case, engine.module, 0)  # undone: the engine goes on (and computes in bf16, as wrapped)
    opt.step()
    assert next(engine.module.parameters()).dtype == torch.bfloat16
    engine.close()


@pytest.mark.parametrize("call", ["float", "to(cpu)", "to(float32)", "cpu"])
def test_conversions_to_what_the_engine_runs_are_no_ops(call):
    case, engine, opt, ref, ref_opt = _pair("mlp", overlap_optimizer=False)
    model = engine.module
    convert = {"float": lambda: model.float(), "to(cpu)": lambda: model.to("cpu"),
               "to(float32)": lambda: model.to(torch.float32), "cpu": lambda: model.cpu()}[call]
    convert()
    _lockstep(case, engine, opt, ref, ref_opt, 1, lambda m, s: None)
    _backward(case, model, 1)
    _backward(case, ref, 1)
    convert()  # with p.grad exposed too
    assert torch.equal(next(model.parameters()).grad.float(), next(ref.parameters()).grad)
    opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    _same_state(engine, ref)
    engine.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: model.cuda() really moves")
def test_cuda_on_a_machine_without_cuda_raises():
    case, engine, opt, _, _ = _pair("mlp")
    with pytest.raises((AssertionError, RuntimeError)):
        engine.module.cuda()
    engine.close()


# -- the CUDA backend: simulated GPU, and a real one ---------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_simulated_gpu_p_grad_bit_for_bit_like_the_cpu_backend(simulated_gpu, dtype):
    """p.grad read, scaled and clipped between accumulated backward passes and step, through the CUDA
    backend's ordering rules (a device-to-host copy poisons its host buffer until its event: reading p.grad
    without waiting would read NaN): the CPU backend's numbers exactly."""
    def train():
        kw = {} if dtype == torch.float32 else {
            "loss_scale": offload.LossScaleConfig(init_scale=1024.0, growth_interval=1000)}
        case, engine, opt, _, _ = _pair("gpt", dtype=dtype, overlap_optimizer=False, **kw)
        model, seen = engine.module, []
        for step in range(4):
            for i in range(2):
                b = case.make_batch(2 * step + i)
                engine.backward(case.loss_fn(run(model, b), b) / 2)
                seen.append([p.grad.norm().item() for p in model.parameters()])
            next(model.parameters()).grad.mul_(0.5)
            seen.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
            opt.step()
            opt.zero_grad()
        state = engine.state_dict()["model"]
        engine.close()
        return seen, state

    want = train()
    made = simulated_gpu()
    got = train()
    assert made and made[0]._api.copies > 0
    assert got[0] == want[0]
    assert not any(x != x for row in got[0][:-1:3] for x in row)  # no NaN read from a copy in flight
    assert_bitwise(got[1], want[1], "simulated GPU")


@pytest.mark.gpu
def test_cuda_p_grad_lives_on_the_host_but_looks_like_the_parameters(device):
    """On CUDA the parameter (and so p.grad's metadata) is on the GPU and the data in pinned host memory: ops
    take device arguments (clip_grad_norm_'s coefficient) and give device results. Compared with plain
    PyTorch on the same device: bit for bit on the CPU backend; on CUDA norms are reduced on the host, torch's on
    the GPU, so within fp32 rounding."""
    case, engine, opt, ref, ref_opt = _pair("gpt", device=device, overlap_optimizer=False)
    model, norms = engine.module, []
    for step in range(4):
        _backward(case, model, step, device=device)
        _backward(case, ref, step, device=device)
        p = next(model.parameters())
        assert p.grad.device == p.device == device and p.grad.norm().device == device
        norms.append((torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item(),
                      torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item()))
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    got, want = engine.state_dict()["model"], ref.state_dict()
    if device.type == "cpu":
        assert all(a == b for a, b in norms)
        assert_bitwise(got, want, "weights")
    else:
        for a, b in norms:
            assert abs(a - b) <= 1e-5 * b
        for name, w in want.items():
            torch.testing.assert_close(got[name], w.cpu(), rtol=1e-4, atol=1e-5)
    engine.close()


def test_accumulation_with_an_output_class_pytree_cannot_see_into():
    """A model returning an object torch's pytree does not know: no output hook can be placed, so exposed grads
    are taken back when the forward ends and accumulation is still plain torch bit for bit (without that, the
    second micro-batch's backward met the first's exposed grads and raised)."""

    class Out:  # not a pytree node
        def __init__(self, y):
            self.y = y

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

        def forward(self, x):
            return Out(self.b(torch.tanh(self.a(x))))

    torch.manual_seed(0)
    model = Model()
    ref = copy.deepcopy(model)
    opt = offload.AdamW(model.parameters(), fused=False, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    engine = offload.wrap(model, opt, budget=1 << 20, device="cpu", overlap_optimizer=False)

    def micro(m, i):  # micro-batch i = 2 * step + k: the seeds 10 * step + k
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * (i // 2) + i % 2))
        m(x).y.sum().backward()

    _micro_steps_with_torch_clip(model, opt, ref, ref_opt, 3, 2, micro, 0.1)
    _same_state(engine, ref)
    engine.close()
