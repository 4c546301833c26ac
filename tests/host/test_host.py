"""HostState.update, the engine's host-side AdamW, on both paths: the fused C++ kernel (the default) and the
torch ops fallback (``fused=False``, and what runs when the kernel is not built). Each against its own
reference, bit for bit: the kernel against ``adamw_step_reference(exact_sqrt=True)`` with the product of the
grad factors as its scale, the torch path against ``offload.optim.adamw_`` after scaling the grads in place."""

import pytest
import torch

from offload.errors import InvariantError, KernelUnavailableError
from offload.host.cpu_adam import KERNEL_AVAILABLE, adamw_step_reference
from offload.host.state import HostState
from offload.optim import adamw_
from offload.planning.buckets import ParamSpec, make_buckets

PATHS = [pytest.param(True, id="fused", marks=pytest.mark.skipif(not KERNEL_AVAILABLE, reason="kernel not built")),
         pytest.param(False, id="torch")]
LOWP = [pytest.param(None, id="fp32"), pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
# two groups, a frozen parameter, odd sizes: buckets with two runs and a frozen tail
SPECS = [ParamSpec(3001, 0), ParamSpec(517, 1), ParamSpec(2048, 0), ParamSpec(77, None), ParamSpec(1500, 1)]
HPARAMS = [(1e-2, 0.9, 0.999, 1e-8, 0.1), (3e-3, 0.8, 0.99, 1e-6, 0.0)]


def _host(lowp, fused, accumulate=False) -> HostState:
    buckets = make_buckets(SPECS, range(len(SPECS)), bucket_bytes=4 * 4000, itemsize=4)
    host = HostState(buckets, SPECS, [torch.Size([s.numel]) for s in SPECS], lowp, fused=fused,
                     accumulate=accumulate)
    gen = torch.Generator().manual_seed(0)
    for b in range(len(buckets)):
        host.master[b].copy_(torch.randn(host.master[b].numel(), generator=gen))
        host.refresh_lowp(b)
        host.exp_avg[b].copy_(torch.randn(host.exp_avg[b].numel(), generator=gen) * 1e-2)
        host.exp_avg_sq[b].copy_(torch.rand(host.exp_avg_sq[b].numel(), generator=gen) * 1e-4)
        host.grad[b].copy_(torch.randn(host.grad[b].numel(), generator=gen) * 256)
    return host


def _expected(host: HostState, b: int, params, factors, fused: bool):
    """What bucket b's buffers must hold after ``update(b, params, HPARAMS, factors)``."""
    master, m, v, grad = (t[b].clone() for t in (host.master, host.exp_avg, host.exp_avg_sq, host.grad))
    lowp = host.lowp[b].clone() if host.lowp is not None else None
    scale = 1.0
    for f in factors:
        scale *= f
    for p in host.buckets[b].params:
        if p not in params:
            continue
        s = host.offset[p]
        e = s + SPECS[p].numel
        lr, b1, b2, eps, wd = HPARAMS[SPECS[p].group]
        hp = dict(lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd)
        step = host.steps[p] + 1
        if fused:
            adamw_step_reference(master[s:e], grad[s:e], m[s:e], v[s:e], step=step, **hp, grad_scale=scale,
                                 lowp_out=None if lowp is None else lowp[s:e], exact_sqrt=True)
        else:
            g = grad[s:e] if grad.dtype == torch.float32 else grad[s:e].float()  # 16-bit grads widen first
            for f in factors:
                g.mul_(f)
            adamw_(master[s:e], g, m[s:e], v[s:e], step, **hp)
            if lowp is not None:
                lowp[s:e].copy_(master[s:e])
    return master, m, v, lowp


@pytest.mark.parametrize("lowp", LOWP)
@pytest.mark.parametrize("fused", PATHS)
@pytest.mark.parametrize("factors", [(), (2.0**-8, 0.37)], ids=["unscaled", "scaled_and_clipped"])
def test_update_matches_its_reference(fused, lowp, factors):
    host = _host(lowp, fused)
    assert host.check_finite == (lowp == torch.float16)
    for b, bucket in enumerate(host.buckets):
        trainable = [p for p in bucket.params if SPECS[p].group is not None]
        for params in (frozenset(trainable), frozenset(trainable[:1])):  # whole runs, then one parameter alone
            want = _expected(host, b, params, factors, fused)
            frozen_before = host.master[b][bucket.trainable_numel:].clone()
            host.update(b, params, HPARAMS, factors)
            got = (host.master[b], host.exp_avg[b], host.exp_avg_sq[b], None if lowp is None else host.lowp[b])
            for name, g, w in zip(("master", "exp_avg", "exp_avg_sq", "lowp"), got, want):
                if w is not None:
                    assert torch.equal(g, w), (b, sorted(params), name)
            assert torch.equal(host.master[b][bucket.trainable_numel:], frozen_before)
            if lowp is not None:  # the copy the next host-to-device copy sends is the master, rounded
                assert torch.equal(host.lowp[b][: bucket.trainable_numel],
                                   host.master[b][: bucket.trainable_numel].to(lowp))
    assert host.steps[0] == 2 and host.steps[3] == 0  # first parameter of bucket 0 stepped twice; frozen never


@pytest.mark.parametrize("lowp", LOWP[1:])
@pytest.mark.parametrize("fused", PATHS)
@pytest.mark.parametrize("factors", [(), (2.0**-8, 0.37)], ids=["unscaled", "scaled_and_clipped"])
def test_16bit_grads_update_exactly_as_the_same_grads_widened(fused, lowp, factors):
    """Without accumulation the host keeps grads in the device's 16-bit dtype (the copy moves them as they
    are); the update is bit for bit the one on the same grads in fp32 (what the host held before: widening
    is exact), on both paths: the numerics of the engine do not change."""
    narrow, wide = _host(lowp, fused), _host(lowp, fused, accumulate=True)
    for b in range(len(narrow.buckets)):
        assert narrow.grad[b].dtype == lowp and wide.grad[b].dtype == torch.float32
        assert torch.equal(wide.master[b], narrow.master[b]) and torch.equal(wide.exp_avg[b], narrow.exp_avg[b])
        wide.grad[b].copy_(narrow.grad[b])
        params = frozenset(p for p in narrow.buckets[b].params if SPECS[p].group is not None)
        narrow.update(b, params, HPARAMS, factors)
        wide.update(b, params, HPARAMS, factors)
        for name in ("master", "exp_avg", "exp_avg_sq", "lowp"):
            assert torch.equal(getattr(narrow, name)[b], getattr(wide, name)[b]), (b, name)


@pytest.mark.parametrize("lowp", LOWP)
def test_accumulation_lands_in_staging_and_sums_in_fp32(lowp):
    """[Note: host grads]: with accumulation the step's first copy lands in the fp32 sum when the device is
    fp32 and in the staging copy otherwise; later copies always in staging; the sum is the fp32 sum of the
    widened grads. Without accumulation every copy lands in the grad the update reads."""
    host = _host(lowp, False, accumulate=True)
    device = lowp or torch.float32
    gen = torch.Generator().manual_seed(1)
    for b in range(len(host.buckets)):
        first = host.landing(b, first=True)
        assert first.dtype == device and (first is host.grad[b]) == (lowp is None)
        grads = [(torch.randn(first.numel(), generator=gen) * 3).to(device) for _ in range(3)]
        first.copy_(grads[0])
        if first is not host.grad[b]:
            host.take_staged(b, first=True)
        for g in grads[1:]:
            later = host.landing(b, first=False)
            assert later is host.staging[b]
            later.copy_(g)
            host.take_staged(b, first=False)
        want = grads[0].float()
        for g in grads[1:]:
            want = want + g.float()
        assert torch.equal(host.grad[b], want)
    plain = _host(lowp, False)
    assert plain.staging is None and plain.landing(0, first=True) is plain.grad[0]
    with pytest.raises(InvariantError, match="accumulation"):
        plain.landing(0, first=False)


@pytest.mark.parametrize("fused", PATHS)
def test_fp16_update_refuses_an_inf_grad_and_writes_nothing(fused):
    host = _host(torch.float16, fused)
    bucket = host.buckets[0]
    host.grad[0][5] = float("inf")
    before = [t[0].clone() for t in (host.master, host.exp_avg, host.exp_avg_sq, host.lowp)]
    params = frozenset(p for p in bucket.params if SPECS[p].group is not None)
    with pytest.raises(InvariantError, match="inf or NaN"):
        host.update(0, params, HPARAMS)
    for t, was in zip((host.master, host.exp_avg, host.exp_avg_sq, host.lowp), before):
        assert torch.equal(t[0], was)


def test_fused_needs_the_kernel(monkeypatch):
    import offload.host.state
    monkeypatch.setattr(offload.host.state, "KERNEL_AVAILABLE", False)
    with pytest.raises(KernelUnavailableError, match="kernel"):
        HostState(make_buckets(SPECS, range(len(SPECS)), 4 * 4000, 4), SPECS,
                  [torch.Size([s.numel]) for s in SPECS], None, fused=True)
