"""How the numerics tests compare the engine with plain PyTorch (helpers, not tests).

[Note: exact, or within the kernel's bound] Adam divides each update by the gradient's own running scale.
A parameter whose true gradient is zero (an attention key bias: softmax ignores a shift shared by all keys;
a bias right before a norm) gets rounding noise (~1e-9) for a gradient, and Adam turns that noise into
lr-sized steps in a random direction: a last-bit difference anywhere upstream becomes a large difference
there, so no fixed tolerance can compare such a parameter (issue 21: transformers 5.24's ViT, k_proj.bias
1.04e-6 off at atol 1e-6). So the comparisons are built not to depend on one:

* exactness: the engine runs ``offload.AdamW(..., fused=False)``, torch's operations in torch's order, and
  every loss, weight and buffer must equal plain PyTorch + ``torch.optim.AdamW(foreach=False)`` bit for bit
  (``assert_bitwise``). Noise gradients are then the same noise, and any difference is a bug.
* the default fused kernel (``cpp/cpu_adam.h``, [Note: AdamW op order]) gives Adam's m and v bit for bit
  and the master within a few roundings of torch's (``assert_within_fused_bound``), *for the same inputs*. Over several
  steps differences feed back through the gradients, so ``FusedStepChecker`` compares step by step: before
  each step it gives plain PyTorch the engine's own weights and AdamW state, both take the step on the same
  batch, and the engine's m and v must be torch's bit for bit and its master within that bound, per element.
  The bound holds whatever the gradient is, noise included.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch


def ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of fp32 numbers at |x| (the distance to the next one away from zero)."""
    x = x.abs()
    return torch.nextafter(x, torch.full_like(x, float("inf"))) - x


def _first_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    if not want.is_floating_point():
        return f"{got.flatten()[:4].tolist()} vs {want.flatten()[:4].tolist()}"
    differ = got.ne(want) & ~(got.isnan() & want.isnan())
    diff = (got.double() - want.double()).abs()[differ]
    return f"{int(differ.sum())} of {want.numel()} elements differ, by up to {float(diff.max()):.3g}"


def assert_bitwise(got: dict, want: dict, what: str = "") -> None:
    """``got`` has ``want``'s keys and every tensor is ``torch.equal`` to ``want``'s (dtype included), or
    equal as a Python value (losses)."""
    assert got.keys() == want.keys(), (what, sorted(set(got) ^ set(want)))
    bad = []
    for key, w in want.items():
        g = got[key]
        if isinstance(w, torch.Tensor):
            w = w.detach().cpu()
            if not (isinstance(g, torch.Tensor) and g.dtype == w.dtype and torch.equal(g.detach().cpu(), w)):
                bad.append(f"{key}: {_first_difference(g.detach().cpu(), w) if isinstance(g, torch.Tensor) else g}")
        elif g != w:
            bad.append(f"{key}: {g!r} != {w!r}")
    assert not bad, f"{what}: not bit for bit equal to plain PyTorch: " + "; ".join(bad[:6]) + (
        f" (and {len(bad) - 6} more)" if len(bad) > 6 else "")


def assert_losses_bitwise(got: list, want: list) -> None:
    assert len(got) == len(want), (len(got), len(want))
    differ = [(i, a, b) for i, (a, b) in enumerate(zip(got, want)) if a != b]
    assert not differ, f"losses differ from plain PyTorch at steps {differ[:4]}"


UPDATE_RTOL = 2.0**-21  # 4 units of fp32's relative precision (2**-23): see assert_within_fused_bound


def assert_within_fused_bound(got: torch.Tensor, want: torch.Tensor, decayed: torch.Tensor, what: str) -> None:
    """``got``: the kernel's master after a step; ``want``: torch's from the same inputs; ``decayed``: the
    master before the step times (1 - lr * weight_decay), so ``want - decayed`` is torch's update term u.

    Per element, |got - want| <= max(ulp(got), ulp(want)) + 2**-21 |u|. The two updates divide the same
    s * m by denominators that differ by the kernel's correctly rounded sqrt (torch's MKL sqrt is up to 1
    ulp low), its multiply by a rounded reciprocal of the bias correction (torch divides: 1 ulp) and the
    rounding of each: a relative difference of at most ~3 units of 2**-23 in u, allowed 4; each side then
    rounds its own sum (half an ulp each). cpp/cpu_adam.h states this as ulp(master) + 3 ulp(u); counted
    in ulps of u that is not enough where u's significand is near the top of its binade (a 2-unit relative
    difference is then 4 ulps of u: seen once per ~50k elements on the hf models), so the bound here is
    relative. A real defect (a stale or misplaced bucket, a lost weight decay, a wrong lr) is off by a
    fraction of u itself, ~10**5 times more."""
    update = (want.double() - decayed.double()).abs()
    diff = (got.double() - want.double()).abs()
    bound = torch.maximum(ulp(got), ulp(want)).double() + UPDATE_RTOL * update
    over = diff > bound
    assert not over.any(), (f"{what}: {int(over.sum())} of {want.numel()} elements outside the fused kernel's "
                            f"bound, by up to {float((diff - bound).max()):.3g}")


class FusedStepChecker:
    """Step-by-step check of an engine that runs the default fused kernel (see [Note: exact, or within the
    kernel's bound]). Call ``before_step(engine)`` between steps, then ``after_step(engine, loss_of)`` once
    the engine has taken the step, where ``loss_of(model)`` computes the step's loss on a plain module.
    ``model``: the engine's module or a copy of it (the checker keeps its own copy and reloads it every
    step); ``params(model)``: its trainable parameters, in the order the engine's optimizer was given them.
    Buffers (BatchNorm statistics) and untrained parameters must stay bit for bit torch's."""

    def __init__(self, model: torch.nn.Module, adamw: dict,
                 params: Callable[[torch.nn.Module], list] | None = None) -> None:
        self.model = copy.deepcopy(model)
        self.adamw = adamw
        self.params = params or (lambda m: [p for p in m.parameters() if p.requires_grad])
        self.checked = 0  # elements compared, over all steps
        self.differing = 0  # of them, masters not bit for bit torch's (the kernel's IEEE sqrt and reciprocal)
        self._before: dict | None = None

    def before_step(self, engine) -> None:
        state = engine.state_dict()
        self._before = {"model": copy.deepcopy(state["model"]), "optimizer": copy.deepcopy(state["optimizer"])}

    def after_step(self, engine, loss_of: Callable[[torch.nn.Module], torch.Tensor], what: str = "") -> None:
        before = self._before
        self.model.load_state_dict(before["model"])
        self.model.zero_grad(set_to_none=True)
        opt = torch.optim.AdamW(self.params(self.model), foreach=False, **self.adamw)
        opt.load_state_dict(before["optimizer"])  # the engine's m, v, step count and group hyper-parameters
        loss_of(self.model).backward()
        opt.step()
        after = engine.state_dict()
        # Every state_dict key of a stepped parameter, aliases of a tied weight included.
        stepped = {k for k, v in self.model.state_dict(keep_vars=True).items()
                   if isinstance(v, torch.nn.Parameter) and v.grad is not None}
        assert_bitwise({k: v for k, v in after["model"].items() if k not in stepped},
                       {k: v for k, v in self.model.state_dict().items() if k not in stepped}, f"{what} buffers")
        names = {id(p): n for n, p in self.model.named_parameters()}
        index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
        for group in opt.param_groups:
            decay = 1 - group["lr"] * group["weight_decay"]
            for p in group["params"]:
                name, i = names[id(p)], index[id(p)]
                if p.grad is None:
                    continue
                for key in ("exp_avg", "exp_avg_sq"):
                    got, want = after["optimizer"]["state"][i][key], opt.state[p][key]
                    assert torch.equal(got, want), f"{what} {name} {key}: {_first_difference(got, want)}"
                decayed = before["model"][name] * decay if group["weight_decay"] else before["model"][name]
                got = after["model"][name]
                assert_within_fused_bound(got, p.detach(), decayed, f"{what} {name}")
                self.checked += got.numel()
                self.differing += int(got.ne(p.detach()).sum())
        self._before = None
