"""Clipping the gathered grads by their global norm (``engine.clip_grad_norm_``): the grad pipeline's norms
(computed per parameter as each bucket's grads were gathered or summed), one total over both tiers and, under
data parallel, over every rank; and the factors ``step()`` applies to deferred updates (the loss scale's inverse,
after the float16 overflow check, and the clip coefficient)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import NonFiniteNormError

if TYPE_CHECKING:
    from .grads import GradPipeline


def clip_gathered(grads: GradPipeline, max_norm: float, norm_type: float = 2.0,
                  error_if_nonfinite: bool = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over every grad ``grads`` gathered since the last step: the total
    norm of order ``norm_type`` (over every rank under data parallel, of the unscaled grads with float16 loss
    scaling, after any clip already pending), and the clipping coefficient folded into ``grads.clip_factor``,
    which the next ``step()`` applies. Returns the total norm."""
    max_norm, norm_type = float(max_norm), float(norm_type)
    params = sorted(p for pending in grads.pending.values() for p in pending.params)
    if not params:
        return torch.tensor(0.0)
    grads.ctx.cpu.drain()  # grads (and the norms of accumulated ones) are final
    if grads.ctx.dp is not None:  # issue 20: grads summed over ranks now, their norms over all ranks
        grads.ctx.dp.reduce_pending(grads, norms=True, norm_type=norm_type)
    if norm_type == 2.0:
        norms = norms_on_host([grads.norms[p] for p in params])
    else:
        by_bucket: dict[int, list[int]] = {}
        for p in params:
            by_bucket.setdefault(grads.slots.bucket_of[p], []).append(p)
        found = {}
        for b, ps in by_bucket.items():
            found.update(grads.slots.hosted().grad_norms(b, ps, norm_type))
        norms = torch.stack([found[p] for p in params])
    total = torch.linalg.vector_norm(norms, norm_type)
    if grads.step_scale is not None and grads.step_scale != 1.0:
        total = total / grads.step_scale  # exact: loss scales are powers of two
    if grads.clip_factor != 1.0:
        total = total * grads.clip_factor
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise NonFiniteNormError(f"the total norm of order {norm_type} of the gradients is non-finite, so it "
                                 "cannot be clipped. Pass error_if_nonfinite=False to go on anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads.clip_factor *= float(coef)
    return total


def step_factors(grads: GradPipeline) -> tuple[float, ...] | None:
    """The factors ``step()`` multiplies the gathered grads by before their deferred updates: with float16 loss
    scaling the scale's inverse, once every norm is known finite (None: an inf or NaN, the step is skipped; the
    scaler learns either way), then the clip coefficient."""
    factors = []
    if grads.scaler is not None:
        grads.ctx.cpu.drain()  # the norms of accumulated grads are computed on the CPU lane
        norms = [grads.norms[p] for pending in grads.pending.values() for p in pending.params]
        found_inf = bool(norms) and not bool(torch.isfinite(norms_on_host(norms)).all())
        inv_scale = 1.0 / grads.step_scale if grads.step_scale else 1.0
        grads.scaler.update(found_inf)
        if found_inf:
            grads.ctx.stats["skipped_steps"] += 1
            return None
        factors.append(inv_scale)
    factors.append(grads.clip_factor)
    return tuple(factors)


def norms_on_host(norms: list[torch.Tensor]) -> torch.Tensor:
    """Per-parameter norms (0-d tensors) as one fp32 CPU tensor, in order, read with one device-to-host copy
    per device they are on instead of one per parameter (each a sync on CUDA): the norms of grads gathered
    on the device live there, those of accumulated grads (summed by the CPU lane) on the host."""
    out = torch.empty(len(norms), dtype=torch.float32)
    where: dict[torch.device, list[int]] = {}
    for i, n in enumerate(norms):
        where.setdefault(n.device, []).append(i)
    for device, at in where.items():
        values = torch.stack([norms[i].float() for i in at])
        out[at] = values if device.type == "cpu" else values.cpu()
    return out
