"""Fused CPU AdamW over flat host buffers (``cpp/cpu_adam``), and its torch reference.

``adamw_step`` does in one pass what ``offload.optim.adamw_`` does in six torch passes, and more: it
reads the grad in fp32, bf16 or fp16, scales it (loss scale, clipping), optionally checks it for inf/nan
first, and writes the bf16/fp16 copy of the new master that the next host-to-device copy sends.

Numerics (see [Note: AdamW op order] in ``cpp/cpu_adam.h``): the same operations, in the same order,
with the same fused multiply-adds, as ``torch.optim.AdamW(foreach=False, fused=False)`` on this CPU, but
one: ``sqrt(v) / bias_correction2_sqrt`` is ``sqrt(v) * (1 / bias_correction2_sqrt)`` with the reciprocal
rounded once (one division per element fewer; that term is then equal or 1 ulp off). m and v agree with
torch bit for bit. The master agrees bit for bit with ``adamw_step_reference(..., exact_sqrt=True)``,
which does the same operations; against torch's formula it can differ by 1 ulp of the master (or, where the
update is not small against the master, by a few ulps of the update), from that reciprocal and because
torch's ``sqrt`` on tensors of more than a handful of elements goes through MKL's vector math, which is not
correctly rounded (1 ulp low on about 0.6 % of elements here), while the kernel's sqrt is IEEE. The
low-precision copy is the new master rounded to nearest even, as ``tensor.to(torch.bfloat16)`` rounds.
"""

from __future__ import annotations

import torch

from .. import _C

__all__ = ["KERNEL_AVAILABLE", "adamw_step", "adamw_step_reference", "kernel_info"]

KERNEL_AVAILABLE: bool = hasattr(_C, "adamw_step")
"""Whether the C++ kernel is built into ``offload._C``; without it ``adamw_step`` runs the torch reference."""

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_LOWP = (torch.bfloat16, torch.float16)


def kernel_info() -> dict:
    """What runs ``adamw_step`` here: whether the C++ kernel is built, the instruction set it dispatched to
    ("avx512", "avx2" or "baseline"), and whether it has OpenMP threads."""
    if not KERNEL_AVAILABLE:
        return {"available": False, "isa": None, "openmp": False}
    return {"available": True, "isa": _C.adamw_isa(), "openmp": _C.adamw_has_openmp()}


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               grad_scale: float = 1.0, lowp_out: torch.Tensor | None = None, check_finite: bool = False,
               num_threads: int | None = None) -> bool:
    """One AdamW update of ``param``, ``exp_avg``, ``exp_avg_sq`` in place; returns found_inf.

    ``param``, ``exp_avg``, ``exp_avg_sq``: contiguous 1-D fp32 CPU tensors (views into a larger buffer are
    fine, at any alignment). ``grad``: the same number of elements, fp32, bf16 or fp16. ``step``: the step
    count after this update (1 on the first). ``grad_scale`` multiplies the grad before use. ``lowp_out``:
    None, or a bf16/fp16 tensor of the same length that receives the new master rounded to nearest even.
    With ``check_finite``, if any ``grad * grad_scale`` is inf or nan nothing is written and True is
    returned. ``num_threads`` defaults to ``torch.get_num_threads()``, so the kernel uses the cores torch
    was told to use and no more; the work is handed out in chunks, so a worker slowed by a busy core takes
    fewer (see [Note: work split under contention] in ``cpp/cpu_adam.cpp``, which also says what that does not
    help). Releases the GIL.
    """
    _check(param, grad, exp_avg, exp_avg_sq, lowp_out, step)
    return adamw_step_unchecked(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                weight_decay=weight_decay, grad_scale=grad_scale, lowp_out=lowp_out,
                                check_finite=check_finite, num_threads=num_threads)


def adamw_step_unchecked(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                         *, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                         grad_scale: float = 1.0, lowp_out: torch.Tensor | None = None, check_finite: bool = False,
                         num_threads: int | None = None) -> bool:
    """:func:`adamw_step` without its argument checks (~9 us a call, on the AdamW lane once per bucket run and
    step: issue 17's hot path), for the engine's host state only, whose tensors are views of its own flat
    fp32 buffers and grad ring: 1-D, contiguous, on the CPU, of the run's length and distinct by
    construction (tested through :func:`adamw_step`'s callers against torch). Anything else calls
    :func:`adamw_step`."""
    if not KERNEL_AVAILABLE:
        return adamw_step_reference(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2,
                                    eps=eps, weight_decay=weight_decay, grad_scale=grad_scale, lowp_out=lowp_out,
                                    check_finite=check_finite, exact_sqrt=True)
    threads = torch.get_num_threads() if num_threads is None else num_threads
    return _C.adamw_step(
        param.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.data_ptr(), _DTYPE_NAMES[grad.dtype],
        0 if lowp_out is None else lowp_out.data_ptr(),
        "bfloat16" if lowp_out is None else _DTYPE_NAMES[lowp_out.dtype],
        param.numel(), int(step), float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
        float(grad_scale), bool(check_finite), int(threads))


def adamw_step_at(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  start: int, grad_start: int, numel: int, lowp_out: torch.Tensor | None = None, *, step: int,
                  lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, grad_scale: float = 1.0,
                  check_finite: bool = False) -> bool:
    """:func:`adamw_step_unchecked` of ``param[start:start + numel]`` (and the same elements of ``exp_avg``,
    ``exp_avg_sq``, ``lowp_out``) with ``grad[grad_start:grad_start + numel]``, given by address: no slice is
    made (four or five tensor views a call, ~1-3 us each inside a training step: issue 17's hot path). For the
    host state's flat buffers only (``HostState.update``): ``param``, ``exp_avg``, ``exp_avg_sq`` fp32, all of
    them 1-D and contiguous, the ranges inside them by construction (a slice would not check that either:
    the unchecked call trusts the same lengths). Without the kernel, the reference on slices."""
    end = start + numel
    if not KERNEL_AVAILABLE:
        return adamw_step_unchecked(param[start:end], grad[grad_start:grad_start + numel], exp_avg[start:end],
                                    exp_avg_sq[start:end], step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                    weight_decay=weight_decay, grad_scale=grad_scale, check_finite=check_finite,
                                    lowp_out=None if lowp_out is None else lowp_out[start:end])
    fp32 = 4  # param, exp_avg, exp_avg_sq: the host state's fp32 buffers
    return _C.adamw_step(
        param.data_ptr() + fp32 * start, exp_avg.data_ptr() + fp32 * start, exp_avg_sq.data_ptr() + fp32 * start,
        grad.data_ptr() + grad.element_size() * grad_start, _DTYPE_NAMES[grad.dtype],
        0 if lowp_out is None else lowp_out.data_ptr() + lowp_out.element_size() * start,
        "bfloat16" if lowp_out is None else _DTYPE_NAMES[lowp_out.dtype],
        numel, int(step), float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
        float(grad_scale), bool(check_finite), int(torch.get_num_threads()))


@torch.no_grad()
def adamw_step_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                         exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float, eps: float,
                         weight_decay: float, grad_scale: float = 1.0, lowp_out: torch.Tensor | None = None,
                         check_finite: bool = False, exact_sqrt: bool = False, fused: bool = True,
                         reciprocal: bool = True) -> bool:
    """``adamw_step`` in torch ops: the spec the kernel is tested against.

    The update is ``offload.optim.adamw_`` (torch's single-tensor AdamW) on ``grad.float() * grad_scale``,
    with one change of op: ``sqrt(v) / bias_correction2_sqrt`` becomes ``sqrt(v) * r``, where ``r`` is
    ``1 / float32(bias_correction2_sqrt)`` correctly rounded to float32 (the kernel saves a division per
    element; see [Note: AdamW op order] in ``cpp/cpu_adam.h``). That product is the quotient or 1 ulp from
    it. ``reciprocal=False`` divides, as torch does.
    ``exact_sqrt=True`` takes the square root in float64 and rounds it once (a correctly rounded fp32 sqrt,
    which torch's MKL-backed ``sqrt`` is not). ``fused=False`` spells out torch's lerp and addcmul with
    separately rounded multiplies and adds: what torch computes on an x86 CPU without FMA, and what the
    kernel's "baseline" instruction set is tested against.
    """
    _check(param, grad, exp_avg, exp_avg_sq, lowp_out, step)
    g = grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    if check_finite and not bool(torch.isfinite(g).all()):
        return True
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    if fused:
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    else:
        w = torch.tensor(1 - beta1, dtype=torch.float32)  # torch rounds the Python float once, so do we
        diff = g - exp_avg
        if w < 0.5:
            exp_avg.add_(w * diff)
        else:
            exp_avg.copy_(g - diff * (1 - w))
        exp_avg_sq.mul_(beta2).add_(torch.tensor(1 - beta2, dtype=torch.float32) * g * g)
    bias_correction1 = 1 - beta1 ** float(step)
    bias_correction2 = 1 - beta2 ** float(step)
    step_size = lr / bias_correction1
    root = exp_avg_sq.double().sqrt().float() if exact_sqrt else exp_avg_sq.sqrt()
    if reciprocal:
        bc2_sqrt = torch.tensor(bias_correction2**0.5, dtype=torch.float32)
        inv = (torch.tensor(1.0, dtype=torch.float32) / bc2_sqrt).item()  # a float32 value, rounded once
        denom = (root * inv).add_(eps)
    else:
        denom = (root / bias_correction2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if lowp_out is not None:
        lowp_out.copy_(param)
    return False


def _check(param, grad, exp_avg, exp_avg_sq, lowp_out, step) -> None:
    n = param.numel()
    for name, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise TypeError(f"{name} must be a float32 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if not isinstance(grad, torch.Tensor) or grad.dtype not in _DTYPE_NAMES:
        raise TypeError(f"grad must be a float32, bfloat16 or float16 tensor, got {getattr(grad, 'dtype', grad)}")
    if lowp_out is not None and (not isinstance(lowp_out, torch.Tensor) or lowp_out.dtype not in _LOWP):
        raise TypeError(f"lowp_out must be None or a bfloat16/float16 tensor, got {getattr(lowp_out, 'dtype', lowp_out)}")
    tensors = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if lowp_out is not None:
        tensors["lowp_out"] = lowp_out
    for name, t in tensors.items():
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got {t.device}")
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)} "
                             f"and strides {t.stride()}")
        if t.numel() != n:
            raise ValueError(f"{name} has {t.numel()} elements but param has {n}")
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name} requires grad: pass .detach() or call under torch.no_grad()")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (the count after this update), got {step!r}")
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name)
                   for name, t in tensors.items() if t.numel())
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"{a} and {b} overlap in memory; every buffer must be distinct")
