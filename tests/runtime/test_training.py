"""Training features under offload: gradient accumulation, clipping, bf16/fp16 compute with fp32 masters,
dynamic loss scaling. Each against plain PyTorch (torch.optim.AdamW, clip_grad_norm_, autocast, GradScaler)."""

import contextlib
import copy

import pytest
import torch
from torch import nn

import offload
from tests.support.compare import assert_bitwise
from tests.support.loops import lockstep
from tests.support.models import CASES, Batch, run
from tests.support.warnings_filters import DEPARTING

# The fp32 comparisons run the engine with offload.AdamW(fused=False) and are bit for bit (see [Note: exact,
# or within the kernel's bound] in tests/support/compare.py); the mixed-precision curves use lr 1e-3 so that 100
# steps visibly learn.
ADAMW = dict(lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
MIXED_LR = 1e-3


def _wrap(model, budget_frac=0.6, lr=ADAMW["lr"], fused=None, **kw):
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    opt = offload.AdamW(model.parameters(), fused=fused, **(ADAMW | {"lr": lr}))
    engine = offload.wrap(model, opt, budget=int(budget_frac * nbytes), bucket_bytes=nbytes // 10, device="cpu", **kw)
    return engine, opt


def _reference(model, lr=ADAMW["lr"]):
    ref = copy.deepcopy(model)
    return ref, torch.optim.AdamW(ref.parameters(), foreach=False, **(ADAMW | {"lr": lr}))


def _pair(model, **wrap_kw):
    """(engine, its optimizer, reference, its optimizer): the reference is copied from ``model`` before it is
    wrapped by ``_wrap(model, fused=False, **wrap_kw)``: torch's AdamW arithmetic, so bit for bit."""
    ref, ref_opt = _reference(model)
    engine, opt = _wrap(model, fused=False, **wrap_kw)
    return engine, opt, ref, ref_opt


def _train(engine, opt, case, steps: int, after_step=None) -> list[float]:
    """``steps`` plain steps of the engine alone (backward, step, zero_grad) on ``case``'s first batches, then
    ``after_step()`` after each if given; the losses."""
    losses = []
    for step in range(steps):
        b = case.make_batch(step)
        loss = case.loss_fn(run(engine, b), b)
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if after_step is not None:
            after_step()
    return losses


def _masters(engine):
    return engine.state_dict()["model"]


def _assert_same_state(engine, ref):
    assert_bitwise(_masters(engine), ref.state_dict())


def _loss(case, batch: Batch, k: int = 1):
    """The loss function of one micro-batch of ``k`` (for loops.lockstep): ``case``'s loss on ``batch`` / ``k``."""
    return lambda model: case.loss_fn(run(model, batch), batch) / k


def _cat(batches: list[Batch]) -> Batch:
    return Batch(tuple(torch.cat(parts) for parts in zip(*(b.args for b in batches))),
                 {k: torch.cat([b.kwargs[k] for b in batches]) for k in batches[0].kwargs},
                 None if batches[0].target is None else torch.cat([b.target for b in batches]))


# -- gradient accumulation --------------------------------------------------------------------------------

def _gathered_grads(engine) -> dict[str, torch.Tensor]:
    """The fp32 grads the engine has gathered on the host since the last step (white box: no public API
    hands them out, since they live only until the update)."""
    rt = engine._runtime
    rt.wait_for_updates()
    out = {}
    for name, param in engine.module.named_parameters():
        p = rt.ctx.param_index[id(param)]
        b, off = rt.slots.host.bucket_of[p], rt.slots.host.offset[p]
        out[name] = rt.slots.host.grad[b][off: off + param.numel()].view(param.shape).clone()
    return out


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_accumulation_equals_plain_accumulation_and_one_large_batch(name):
    """Three backward passes of loss/3 before each step: the same weights as plain PyTorch doing the same,
    and the same gathered gradient as one batch three times as large (rounding only)."""
    case = CASES[name]()
    big, _ = _reference(case.model)
    engine, opt, ref, ref_opt = _pair(case.model, overlap_optimizer=False)
    k = 3

    def micro(step):
        return [case.make_batch(step * k + i) for i in range(k)]

    def compare_with_one_large_batch(step):
        big.load_state_dict(ref.state_dict())
        whole = _cat(micro(step))
        case.loss_fn(run(big, whole), whole).backward()
        gathered = _gathered_grads(engine)
        # A sum of three micro-batch grads and one big reduction round differently: 1e-5 of the model's
        # largest grad entry (not each parameter's own: a zero-true-grad parameter's grad is noise).
        atol = 1e-5 * max(float(p.grad.abs().max()) for p in big.parameters())
        for n, p in big.named_parameters():
            torch.testing.assert_close(gathered[n], p.grad, rtol=1e-5, atol=atol, msg=lambda m, n=n: f"{n}: {m}")
            p.grad = None

    lockstep(engine, opt, ref, ref_opt, 8, lambda step: [_loss(case, b, k) for b in micro(step)],
             before_step=compare_with_one_large_batch)
    _assert_same_state(engine, ref)
    assert engine.memory_stats()["counters"]["backwards"] == 8 * k
    engine.close()


class TwoHeads(nn.Module):
    """A shared trunk and two heads; ``head`` picks one, so a micro-batch leaves the other without grads."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x, head):
        return (self.a if head == "a" else self.b)(torch.tanh(self.trunk(x)))


@pytest.mark.filterwarnings(DEPARTING)  # each step departs, as this test means: [Note: steps that keep departing]
def test_accumulation_when_micro_batches_use_different_parameters():
    torch.manual_seed(0)
    model = TwoHeads()
    engine, opt, ref, ref_opt = _pair(model, budget_frac=1.0, overlap_optimizer=False)

    def micro_losses(step):
        return [lambda m, x=torch.randn(4, 64), head=head: m(x, head).square().mean() for head in ("a", "b", "a")]

    lockstep(engine, opt, ref, ref_opt, 6, micro_losses)
    _assert_same_state(engine, ref)
    engine.close()


def test_zero_grad_before_step_drops_gathered_grads():
    case = CASES["mlp"]()
    engine, opt, ref, ref_opt = _pair(case.model, overlap_optimizer=False)
    for step in range(4):
        b, c = case.make_batch(2 * step), case.make_batch(2 * step + 1)
        engine.backward(case.loss_fn(run(engine, b), b))
        opt.zero_grad()  # the first micro-batch's grads are dropped, as with plain PyTorch
        engine.backward(case.loss_fn(run(engine, c), c))
        opt.step()
        opt.zero_grad()
        case.loss_fn(run(ref, b), b).backward()
        ref_opt.zero_grad()
        case.loss_fn(run(ref, c), c).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    _assert_same_state(engine, ref)
    engine.close()


# -- clipping ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("accumulate", [1, 2])
def test_clip_grad_norm_matches_torch(accumulate):
    case = CASES["gpt"]()
    engine, opt, ref, ref_opt = _pair(case.model, overlap_optimizer=False)
    clipped = []

    def clip_both(step):
        max_norm = 0.5  # below the typical norm here, so most steps really clip
        norm = engine.clip_grad_norm_(max_norm)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
        clipped.append(bool(want > max_norm))

    lockstep(engine, opt, ref, ref_opt, 12,
             lambda step: [_loss(case, case.make_batch(step * accumulate + i), accumulate) for i in range(accumulate)],
             before_step=clip_both)
    assert sum(clipped) >= 6, "the test must exercise clipping"
    _assert_same_state(engine, ref)
    engine.close()


def test_clip_grad_norm_other_orders_and_no_grads():
    case = CASES["mlp"]()
    engine, _, ref, _ = _pair(case.model, overlap_optimizer=False)
    assert engine.clip_grad_norm_(1.0).item() == 0.0  # nothing gathered yet, as torch with no grads
    b = case.make_batch(0)
    engine.backward(case.loss_fn(run(engine, b), b))
    case.loss_fn(run(ref, b), b).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, norm_type=float("inf"))
    torch.testing.assert_close(engine.clip_grad_norm_(1e9, norm_type=float("inf")), want, rtol=1e-6, atol=0)
    engine.close()


def test_overlapped_engine_refuses_clipping_with_the_fix():
    case = CASES["mlp"]()
    engine, _ = _wrap(case.model)
    b = case.make_batch(0)
    engine.backward(case.loss_fn(run(engine, b), b))
    with pytest.raises(offload.OffloadError, match="overlap_optimizer=False"):
        engine.clip_grad_norm_(1.0)
    engine.close()


# -- mixed precision --------------------------------------------------------------------------------------
#
# [Note: mixed-precision tolerance] The engine computes from 16-bit copies of *every* parameter (the
# residual stream, LayerNorm weights and embeddings are 16-bit too), while the reference, torch.autocast over
# fp32 parameters, keeps non-matmul ops and the residual stream in fp32. The two curves are different
# roundings of one training run, so they agree loosely and drift apart slowly. Measured on the tiny GPT,
# lr 1e-3, 100 steps, 10-step mean losses: autocast vs fp32 differ by <= 2.1 %, the engine vs autocast by
# <= 5.8 % (bf16) and 6.7 % (fp16) when first measured; 7.0 % and 7.6 % on the AMD EPYC VM with two threads (session
# 25, next Note); 5.9 % and 7.8 % with the engine at one thread (session 26, the suite's count). The test allows 12 %. A wrong gradient or a stale bucket shows up at
# once in the first update, which must agree in sign with autocast's on >= 95 % of the weights.
#
# [Note: the reference on one thread] The autocast reference runs with one intra-op thread (torch.set_num_threads(1)
# while it runs; the engine runs with the suite's count: one since [Note: the suite's intra-op threads] in
# tests/conftest.py, two on this VM when this Note's figures were measured). The tiny GPT's ops are so small that two
# threads meeting at every op cost far more than they share: on this 2-core VM under load (8-10), the 100 reference
# steps took 30-44 s of CPU with two threads and 1.3-1.8 s with one, and each curve test 17-22 s. The reference is the
# same torch computation with another rounding of its parallel ops, so it is another sample of the noise this Note
# allows for: measured against two threads (session 25), the first update bit for bit (fp16) or with every sign equal
# (bf16), the 10-step means within 3.0 % (bf16) and 1.4 % (fp16), and the engine's largest window gap to it 7.0 -> 6.9 %
# (bf16) and 7.6 -> 7.5 % (fp16): as far from the 12 % allowed as before.

CURVE_RTOL = 0.12
SIGN_AGREEMENT = 0.95


@contextlib.contextmanager
def _one_intra_op_thread():
    """torch's intra-op thread count 1 inside, as it was after: [Note: the reference on one thread]."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _autocast_reference(case, dtype, steps):
    model, opt = _reference(case.model, lr=MIXED_LR)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    losses, first = [], None
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    with _one_intra_op_thread():
        for step in range(steps):
            b = case.make_batch(step)
            with torch.autocast("cpu", dtype=dtype):
                loss = case.loss_fn(run(model, b), b)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
            losses.append(loss.item())
            if first is None and any(not torch.equal(p, initial[n]) for n, p in model.named_parameters()):
                first = {n: p.detach() - initial[n] for n, p in model.named_parameters()}
    return losses, first


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_mixed_precision_loss_curve_follows_autocast(dtype):
    case = CASES["gpt"]()
    steps = 100
    want, want_first = _autocast_reference(case, dtype, steps)
    initial = {n: p.detach().clone() for n, p in case.model.named_parameters()}
    engine, opt = _wrap(case.model, dtype=dtype, lr=MIXED_LR)
    updates = []

    def first_update():
        if not updates and not engine.memory_stats()["optimizer"]["last_step_skipped"]:
            updates.append({n: w - initial[n] for n, w in _masters(engine).items() if n in initial})

    losses = _train(engine, opt, case, steps, after_step=first_update)
    first = updates[0] if updates else None
    stats = engine.memory_stats()
    assert stats["device_peak_bytes"] <= stats["budget_bytes"]
    assert stats["counters"]["plan_departures"] == 0  # the 16-bit warm-up traces the same order as later steps
    assert stats["plan"]["streamed_buckets"] > 0
    windows = [(sum(losses[i:i + 10]) / 10, sum(want[i:i + 10]) / 10) for i in range(0, steps, 10)]
    for ours, theirs in windows:
        assert abs(ours - theirs) <= CURVE_RTOL * theirs, windows
    assert windows[-1][0] < 0.9 * windows[0][0], "the model must learn"
    same = total = 0
    for n, d in want_first.items():
        same += int((torch.sign(first[n]) == torch.sign(d)).sum())
        total += d.numel()
    assert same / total >= SIGN_AGREEMENT, same / total
    # masters stay fp32 on the host; the module gets them back on close
    assert all(v.dtype == torch.float32 for v in _masters(engine).values() if v.is_floating_point())
    engine.close()
    assert all(p.dtype == torch.float32 for p in case.model.parameters())


def test_fp16_overflow_skips_exactly_one_step_and_lowers_the_scale():
    case = CASES["mlp"]()
    engine, opt = _wrap(case.model, dtype=torch.float16,
                        loss_scale=offload.LossScaleConfig(init_scale=1024.0, growth_interval=1000))
    _train(engine, opt, case, 3)
    stats = engine.memory_stats()["optimizer"]
    assert stats == {"overlap": False, "loss_scale": 1024.0, "skipped_steps": 0, "last_step_skipped": False}
    before = _masters(engine)
    adam_before = {k: {n: t.clone() for n, t in v.items() if torch.is_tensor(t)} for k, v in opt.state.items()}
    b = case.make_batch(3)
    engine.backward(case.loss_fn(run(engine, b), b) * float("inf"))  # injected overflow
    opt.step()
    opt.zero_grad()
    stats = engine.memory_stats()["optimizer"]
    assert stats == {"overlap": False, "loss_scale": 512.0, "skipped_steps": 1, "last_step_skipped": True}
    after = _masters(engine)
    for n in before:
        assert torch.equal(before[n], after[n]), n  # nothing moved
    for p, state in opt.state.items():
        for k, t in adam_before[p].items():
            assert torch.equal(state[k], t), k  # nor did the AdamW state or its step count
    b = case.make_batch(4)
    engine.backward(case.loss_fn(run(engine, b), b))
    opt.step()
    stats = engine.memory_stats()["optimizer"]
    assert stats["skipped_steps"] == 1 and not stats["last_step_skipped"] and stats["loss_scale"] == 512.0
    assert any(not torch.equal(after[n], v) for n, v in _masters(engine).items())
    engine.close()


def test_fp16_scale_grows_after_growth_interval_clean_steps():
    case = CASES["mlp"]()
    engine, opt = _wrap(case.model, dtype=torch.float16,
                        loss_scale=offload.LossScaleConfig(init_scale=256.0, growth_interval=3))
    _train(engine, opt, case, 7)
    assert engine.memory_stats()["optimizer"]["loss_scale"] == 1024.0  # grew after steps 3 and 6
    engine.close()


def test_fp16_plain_backward_warns_once():
    case = CASES["mlp"]()
    engine, opt = _wrap(case.model, dtype=torch.float16)
    b = case.make_batch(0)
    with pytest.warns(UserWarning, match="engine.backward"):
        case.loss_fn(run(engine, b), b).backward()
    opt.step()
    engine.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_and_torch_updates_train_alike(dtype):
    """The engine's two host updates (the fused kernel, the default, and torch ops) in a 16-bit engine: each
    leaves the 16-bit host copy equal to its master rounded, and the two runs agree (they differ only by
    the kernel's IEEE sqrt: [Note: fused and torch numerics] in offload/optim.py)."""
    if not offload.host.cpu_adam.KERNEL_AVAILABLE:
        pytest.skip("the C++ kernel is not built")
    results = []
    for fused in (True, False):
        case = CASES["mlp"]()
        nbytes = sum(p.numel() * 4 for p in case.model.parameters())
        opt = offload.AdamW(case.model.parameters(), **(ADAMW | {"lr": MIXED_LR}), fused=fused)
        engine = offload.wrap(case.model, opt, budget=int(0.6 * nbytes), bucket_bytes=nbytes // 10, device="cpu",
                              dtype=dtype)
        losses = _train(engine, opt, case, 6)
        host = engine._runtime.slots.host
        assert host.fused == fused
        for b in range(len(host.buckets)):
            assert torch.equal(host.lowp[b], host.master[b].to(dtype)), b
        results.append((losses, _masters(engine)))
        engine.close()
    (losses_f, masters_f), (losses_t, masters_t) = results
    torch.testing.assert_close(losses_f, losses_t, rtol=1e-3, atol=0)
    for name, want in masters_t.items():
        torch.testing.assert_close(masters_f[name], want, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_bf16_with_a_loss_scale_trains_as_without_one_bit_for_bit():
    """bf16 with an explicit loss scale (a power of two: scaling and unscaling are exact): the same weights as
    bf16 without one, bit for bit. Before, the scale left the updates overlapped, and they never unscaled:
    AdamW's scale invariance hid all but its eps term (weights off by up to 2.4e-4 after these 4 steps)."""
    runs = {}
    for name, kw in (("plain", {}), ("scaled", {"loss_scale": offload.LossScaleConfig(init_scale=1024.0)})):
        case = CASES["mlp"]()
        engine, opt = _wrap(case.model, dtype=torch.bfloat16, **kw)
        _train(engine, opt, case, 4)
        runs[name] = _masters(engine)
        assert engine.memory_stats()["optimizer"]["overlap"] is (name == "plain")
        engine.close()
    for n, v in runs["plain"].items():
        assert torch.equal(v, runs["scaled"][n]), n
