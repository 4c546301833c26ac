"""``offload.AdamW``: a torch.optim.Optimizer whose state lives in the engine's host arena.

Before it is bound to an engine (``offload.wrap``) it is an ordinary AdamW over ``param.grad``. Once
bound, the engine runs the update of each bucket on flat fp32 host buffers (during backward, by
default), ``step()`` waits for those updates, and ``state[p]`` holds views of the host arena, so
``state_dict()``/``load_state_dict()`` and LR schedulers work as with any torch optimizer.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Iterable

import torch

from .errors import KernelUnavailableError, OffloadError, OptimizerBoundError
from .host.cpu_adam import KERNEL_AVAILABLE, adamw_step


def adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
           step: int, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW update of fp32 tensors in place; ``step`` is the 1-based step count after this update.

    The same operations, in the same order, as ``torch.optim.AdamW(foreach=False)``, so results agree to
    the bit on the same inputs (elementwise ops do not care that the tensors here are flat and span
    several parameters). Six passes over memory: the engine runs the fused C++ kernel
    (``offload.host.cpu_adam.adamw_step``) instead unless ``offload.AdamW(fused=False)``.
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
    weight_decay. torch.optim.AdamW's other keywords are taken where they mean the arithmetic done here, and
    refused otherwise ([Note: torch's AdamW options]).

    ``fused``: run the update with the fused C++ kernel (``offload.host.cpu_adam.adamw_step``: one pass over
    memory, the 16-bit copy for the next host-to-device copy written in the same pass). ``None`` (default):
    the kernel when it is built (``offload.host.cpu_adam.KERNEL_AVAILABLE``), else torch ops. ``False``: torch
    ops (``adamw_``), the same operations as ``torch.optim.AdamW(foreach=False)``, so bit for bit the same
    numbers. See [Note: fused and torch numerics].

    [Note: fused and torch numerics] The kernel does torch's operations in torch's order, so Adam's m and
    v agree with ``torch.optim.AdamW`` bit for bit, but its square root is IEEE (correctly rounded) while
    torch's, on tensors of more than a few elements, is MKL's vector sqrt, 1 ulp low on about 0.6 % of
    elements on x86. So one step's master can differ from torch's by 1 ulp (2 where the update is larger
    than the weight); over many steps training amplifies that like any other rounding difference.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None) -> None:
        _check_hparams(lr, betas, eps, weight_decay)
        _check_torch_options(dict(amsgrad=amsgrad, maximize=maximize, capturable=capturable,
                                  differentiable=differentiable), "offload.AdamW(...)")
        del foreach  # [Note: torch's AdamW options]: how torch's update loops, not what it computes
        if fused is None:
            fused = KERNEL_AVAILABLE
        elif not isinstance(fused, bool):
            raise TypeError(f"fused must be None, True or False; got {fused!r}")
        elif fused and not KERNEL_AVAILABLE:
            raise KernelUnavailableError("offload.AdamW(fused=True) needs the C++ kernel, which this build of "
                                         "offload._C lacks (offload.host.cpu_adam.KERNEL_AVAILABLE is False). "
                                         "Rebuild the package, or pass fused=None to use torch ops when it is "
                                         "missing")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            _check_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        self.fused: bool = fused
        """Whether updates run on the C++ kernel (resolved: never None). Not part of ``state_dict()``."""
        self._engine = None  # set by offload.wrap; the engine owns the optimizer's state from then on
        self._layout: list[tuple[int, int]] | None = None  # the groups' params lists at wrap (_bind)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, until the optimizer is bound: then refused. The engine lays out its buckets and their
        optimizer state from the param groups at wrap, so a group added later would never be updated, silently
        (session 24: progressive unfreezing with add_param_group trained nothing new)."""
        if getattr(self, "_engine", None) is not None:
            raise OffloadError(
                "add_param_group on an offload.AdamW bound to an engine: the engine lays out its buckets and "
                "optimizer state at wrap, so the new group's parameters would never be updated. engine.close(), "
                "build the optimizer with every group, their parameters trainable, and wrap again; lr and other "
                "hyperparameters of existing groups may be changed at any time")
        super().add_param_group(param_group)

    def _bind(self, engine) -> None:
        if self._engine is not None:
            raise OptimizerBoundError("this offload.AdamW is already bound to an engine; make one optimizer per "
                                      "engine")
        self._engine = engine
        self._layout = self._group_layout()
        self.state = _BoundState(self.state)

    def _group_layout(self) -> list[tuple[int, int]]:
        """Each group's params list and its length: what the engine laid out at wrap (a cheap check, not the
        parameters themselves: a list edited in place to another parameter at the same length is not seen)."""
        return [(id(g["params"]), len(g["params"])) for g in self.param_groups]
    def _unbind(self) -> None:
        self._engine = None
        self._layout = None
        self.state = defaultdict(dict, self.state)

    def hparams(self) -> list[tuple[float, float, float, float, float]]:
        """(lr, beta1, beta2, eps, weight_decay) per param group, read now. A group whose torch option asks for
        other arithmetic raises ([Note: torch's AdamW options])."""
        if self._engine is not None and type(self.state) is not _BoundState:
            raise OffloadError(f"optimizer.state was replaced after wrap: {_HOW_TO_RESET}")
        if self._layout is not None and self._group_layout() != self._layout:
            raise OffloadError(
                "optimizer.param_groups[...][\"params\"] changed after wrap (a parameter removed, added or moved "
                "between groups): the engine laid out its buckets and optimizer state from the groups at wrap and "
                "would go on updating every parameter it had, silently. To stop training a parameter, set its "
                "requires_grad=False (works as in torch); otherwise engine.close(), build the optimizer with the new "
                "groups and wrap again")
        out = []
        for i, g in enumerate(self.param_groups):
            if any(g.get(k, v) != v for k, v in _TORCH_OPTIONS.items()):
                _check_torch_options(g, f"optimizer.param_groups[{i}]")
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
            self._engine._run_step()
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
                step = int(state["step"].item())
                hp = dict(lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd)
                if self.fused and _kernel_can_take(p, p.grad, state["exp_avg"], state["exp_avg_sq"]):
                    adamw_step(p.view(-1), p.grad.view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1),
                               step=step, **hp)
                else:
                    adamw_(p, p.grad, state["exp_avg"], state["exp_avg_sq"], step, **hp)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._engine is not None:
            self._engine.zero_grad(set_to_none)
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

    def state_dict(self) -> dict:
        if self._engine is not None:  # the host state is final (issue 18: device-optimizer state copied back)
            self._engine.wait_for_updates()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        for i, g in enumerate(state_dict.get("param_groups", ())):  # before anything changes
            _check_torch_options(g, f"the loaded state_dict's param_groups[{i}]")
        self.check_state_shapes(state_dict)
        if self._engine is not None:
            self._engine.wait_for_updates()
        super().load_state_dict(state_dict)
        if self._engine is not None:
            # torch starts a parameter without loaded state afresh (m, v zeros, step 0); the engine's arena would
            # otherwise keep what it held (session 25: sd["state"] = {} reset nothing, silently)
            zero = torch.zeros(())
            for p in (p for g in self.param_groups for p in g["params"] if p not in self.state and p.requires_grad):
                self.state[p] = {"step": zero, "exp_avg": zero.expand(p.shape), "exp_avg_sq": zero.expand(p.shape)}
            self.state = _BoundState(self.state)  # torch's load replaced it
            self._engine._adopt_optimizer_state()


_HOW_TO_RESET = (
    "the engine keeps AdamW's state in its host arena, so entries taken out of optimizer.state would not reset "
    "it. To start AdamW afresh (m, v zeros, step 0), load a state_dict without state: sd = opt.state_dict(); "
    "sd[\"state\"] = {}; opt.load_state_dict(sd)")


class _BoundState(defaultdict):
    """``optimizer.state`` of a bound offload.AdamW: entries can be read and replaced (the engine re-points them),
    not removed (``opt.state.clear()``, ``del opt.state[p]``): the arena's m, v and step would stay as they were,
    silently, where torch starts those parameters afresh (session 25). :data:`_HOW_TO_RESET` names the way."""

    def __init__(self, *args) -> None:  # (state) here; (factory[, state]) from copy.copy, deepcopy and pickle
        super().__init__(dict, args[-1] if args and not callable(args[-1]) else ())

    def _refuse(self, *args, **kwargs):
        raise OffloadError(f"removing entries of optimizer.state of an offload.AdamW bound to an engine: "
                           f"{_HOW_TO_RESET}")

    clear = pop = popitem = __delitem__ = _refuse  # type: ignore[assignment]


def _kernel_can_take(*tensors: torch.Tensor) -> bool:
    """The kernel takes contiguous fp32 CPU buffers; anything else (a CUDA parameter, a strided one, a
    16-bit one) takes the torch path."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


# [Note: torch's AdamW options] torch.optim.AdamW's other options, with the value under which it computes what
# offload.AdamW computes. offload.AdamW takes them (as keywords, and in param groups: a torch checkpoint loaded
# with load_state_dict brings them, a user may set them later), and refuses any other value, at construction, at
# load_state_dict and whenever the hyperparameters are read (each backward with overlap_optimizer=True, each
# step()): an option ignored silently would train something else (session 25: a torch AdamW(amsgrad=True)
# checkpoint loaded into offload.AdamW trained on without AMSGrad). ``foreach`` (torch's loop over tensors, the
# same arithmetic) has no meaning here and is accepted; ``fused`` is offload's own (the C++ kernel).
# ``decoupled_weight_decay=False`` is torch.optim.Adam's L2 penalty, the same as AdamW only without weight decay.
_TORCH_OPTIONS = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False,
                  "decoupled_weight_decay": True}
_TORCH_OPTION_WAY = {
    "amsgrad": "offload's updates (the host kernel, the device update) keep Adam's m and v only, no running maximum "
               "of v. Use amsgrad=False; to go on from a checkpoint trained with AMSGrad as plain AdamW, set "
               "amsgrad=False in its param_groups before loading it (its max_exp_avg_sq is then dropped)",
    "maximize": "negate the objective instead (loss = -objective): the same update",
    "capturable": "offload's updates run on the host (or inside its own device step), never in a captured CUDA "
                  "graph; use capturable=False",
    "differentiable": "offload's updates run outside autograd; use differentiable=False",
    "decoupled_weight_decay": "that is torch.optim.Adam's L2 penalty (weight decay added to the gradient), not "
                              "AdamW's decoupled decay; use weight_decay=0 with it, or train with AdamW's decay",
}


def _check_torch_options(options: dict, where: str) -> None:
    for key, value in _TORCH_OPTIONS.items():
        got = options.get(key, value)
        if key == "decoupled_weight_decay" and not options.get("weight_decay", 0):
            continue
        if got != value:
            raise OffloadError(f"{where} has {key}={got!r}, which offload.AdamW does not implement: "
                               f"{_TORCH_OPTION_WAY[key]}")


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
