"""``offload.AdamW``: a torch.optim.Optimizer whose state lives in the engine's host arena.

Before it is bound to an engine (``offload.wrap``) it is an ordinary AdamW over ``param.grad``. Once
bound, the engine runs the update of each bucket on flat fp32 host buffers (during backward, by
default), ``step()`` waits for those updates, and ``state[p]`` holds views of the host arena, so
``state_dict()``/``load_state_dict()`` and LR schedulers work as with any torch optimizer.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch


def adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
           step: int, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW update of fp32 tensors in place; ``step`` is the 1-based step count after this update.

    The same operations, in the same order, as ``torch.optim.AdamW(foreach=False)``, so results agree to
    the bit on the same inputs (elementwise ops do not care that the tensors here are flat and span
    several parameters). The fused C++ SIMD kernel will replace this six-pass version.
    """
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step = float(step)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


class AdamW(torch.optim.Optimizer):
    """AdamW with decoupled weight decay; fp32 state on the host. Param groups may set lr, betas, eps,
    weight_decay."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        _check_hparams(lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            _check_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        self._engine = None  # set by offload.wrap; the engine owns the optimizer's state from then on

    def _bind(self, engine) -> None:
        if self._engine is not None:
            raise RuntimeError("this offload.AdamW is already bound to an engine; make one optimizer per engine")
        self._engine = engine

    def _unbind(self) -> None:
        self._engine = None

    def hparams(self) -> list[tuple[float, float, float, float, float]]:
        """(lr, beta1, beta2, eps, weight_decay) per param group, read now."""
        out = []
        for g in self.param_groups:
            lr = float(g["lr"])
            b1, b2 = (float(b) for b in g["betas"])
            out.append((lr, b1, b2, float(g["eps"]), float(g["weight_decay"])))
        return out

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._engine is not None:
            self._engine.step()
            return loss
        for (lr, b1, b2, eps, wd), group in zip(self.hparams(), self.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("offload.AdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                adamw_(p, p.grad, state["exp_avg"], state["exp_avg_sq"], int(state["step"].item()),
                       lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._engine is not None:
            self._engine.zero_grad()
        else:
            super().zero_grad(set_to_none=set_to_none)

    def check_state_shapes(self, state_dict: dict) -> None:
        """Raise a ValueError naming every parameter whose saved ``exp_avg``/``exp_avg_sq`` has another number
        of elements than the parameter (torch's Optimizer.load_state_dict checks only the group sizes)."""
        params = [p for g in self.param_groups for p in g["params"]]
        index = [i for g in state_dict.get("param_groups", ()) for i in g.get("params", ())]
        wrong = []
        for i, p in zip(index, params):
            for key in ("exp_avg", "exp_avg_sq"):
                value = state_dict.get("state", {}).get(i, {}).get(key)
                if isinstance(value, torch.Tensor) and value.numel() != p.numel():
                    wrong.append(f"state[{i}][{key!r}] has {tuple(value.shape)}, the parameter {tuple(p.shape)}")
        if wrong:
            raise ValueError("optimizer state does not match the parameters: " + "; ".join(wrong[:8])
                             + (f" (and {len(wrong) - 8} more)" if len(wrong) > 8 else ""))

    def load_state_dict(self, state_dict: dict) -> None:
        self.check_state_shapes(state_dict)
        if self._engine is not None:
            self._engine.wait_for_updates()
        super().load_state_dict(state_dict)
        if self._engine is not None:
            self._engine._adopt_optimizer_state()


def _check_hparams(lr, betas, eps, weight_decay) -> None:
    if isinstance(lr, torch.Tensor):
        raise TypeError("lr must be a float for offload.AdamW (tensor lr is not supported)")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
        raise ValueError(f"invalid learning rate {lr!r}: must be a finite float >= 0")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"invalid betas {betas!r}: must be two floats in [0, 1)")
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"invalid eps {eps!r}: must be >= 0")
    if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
        raise ValueError(f"invalid weight_decay {weight_decay!r}: must be >= 0")
