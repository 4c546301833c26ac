"""Plain PyTorch code on a wrapped model's modules (issue 19): ``module.state_dict()`` gives the real fp32
weights, ``module.load_state_dict()`` after the first forward, ``copy.deepcopy(module)`` and pickling raise a
clear error naming the engine's way, and the guard names a model converted after wrapping. (Moved out of
plain_grads.py, which keeps ``p.grad``: [Note: gradients in p.grad].)"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..errors import OffloadError

if TYPE_CHECKING:
    from .context import RuntimeContext
    from .core import Runtime


# -- state dicts ------------------------------------------------------------------------------------------------

def module_hooks(rt: Runtime) -> list[RemovableHandle]:
    """``module.state_dict()`` (of the wrapped model or any submodule) returns the real fp32 weights (the
    parameters themselves are placeholders outside forward), and ``module.load_state_dict()`` after the first
    forward raises, naming the engine's way; ``copy.deepcopy(module)`` and pickling raise (``_StateDictHook``).
    The runtime registers them (``Runtime._register_hooks``) and
    removes them at close; they hold it weakly (an engine dropped without close() must still be freed)."""
    ref = weakref.ref(rt)
    handles = []
    for module in rt.ctx.module.modules():
        handles.append(module.register_state_dict_pre_hook(_saving(ref)))
        handles.append(module.register_state_dict_post_hook(_StateDictHook(ref)))
        handles.append(module.register_load_state_dict_pre_hook(_load_hook(ref)))
    return handles


_HOW_TO_COPY = (
    "copy.deepcopy (or pickling, e.g. torch.save(model)) of a module wrapped by offload is refused: outside a "
    "forward its parameters point at the engine's placeholders and device memory (the weights live in the engine's "
    "host memory) and its hooks belong to this engine, so the copy would drive this engine's hooks. Copy the weights "
    "instead: build a new model and new.load_state_dict(model.state_dict()) (model.state_dict() and "
    "engine.state_dict()[\"model\"] give the real fp32 weights), or engine.close() first (the module gets its "
    "trained weights back, unwrapped). Save with engine.save(path) or torch.save(model.state_dict(), path)")


class EngineHook(functools.partial):
    """A module hook of the engine's (the runtime's forward pre/post hooks): pickling it, as ``torch.save(model)``
    or ``copy.deepcopy(model)`` of the module it is registered on do, raises the engine's error naming the way
    (issue 19; before: pickle's "Can't pickle local object 'Runtime._post_hook.<locals>.hook'"). A partial
    calls its function at C speed: these hooks run at every module call."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise OffloadError(_HOW_TO_COPY)

    def __deepcopy__(self, memo: dict) -> None:
        raise OffloadError(_HOW_TO_COPY)


class _StateDictHook:
    """``module.state_dict()``'s post-hook (see :func:`module_hooks`). It sits in every wrapped module's
    hooks, so it also turns ``copy.deepcopy(module)`` and pickling, which copy a module's hooks with its
    placeholder parameters, into a clear error (issue 19) rather than a copy that drives this engine's hooks."""

    def __init__(self, ref: weakref.ref[Runtime]) -> None:
        self.ref = ref

    def __deepcopy__(self, memo: dict) -> None:
        raise OffloadError(_HOW_TO_COPY)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise OffloadError(_HOW_TO_COPY)

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        rt = self.ref()
        if rt is not None:
            rt.saving = max(rt.saving - 1, 0)  # counted by _saving
        if rt is None or rt.slots.host is None:  # before the first forward the parameters hold their values
            return
        rt.wait_for_updates()
        ctx = rt.ctx
        with torch.no_grad(), ctx.backend.compute():
            for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
                key = prefix + name
                p = ctx.param_index.get(id(param))
                if p is not None and key in state_dict and state_dict[key] is not param:  # not keep_vars=True
                    state_dict[key] = rt.weights.read(p)
            for name, buf in module.named_buffers(recurse=False, remove_duplicate=False):
                key = prefix + name
                if key in state_dict and state_dict[key] is not buf:
                    state_dict[key] = buf.detach().to("cpu", copy=True)  # as engine.state_dict()["model"]


def _saving(ref: weakref.ref[Runtime]) -> Callable[..., None]:
    """``module.state_dict()``'s pre-hook: idle parameters pass ``detach()`` through while it saves (no device copy
    of each weight, which the post-hook replaces by its fp32 master): [Note: parameters between forwards]."""
    def hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        rt = ref()
        if rt is not None:
            rt.saving += 1
    return hook


def _load_hook(ref: weakref.ref[Runtime]) -> Callable[..., None]:
    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        rt = ref()
        if rt is None or rt.slots.host is None:  # before the first forward: loads into the parameters as usual
            return
        raise OffloadError(
            "load_state_dict on a module wrapped by offload after its first step: its parameters are "
            "placeholders and the weights live in the engine's host memory, so a plain load would not reach "
            "them. Use engine.load_state_dict({\"model\": state_dict, \"optimizer\": optimizer.state_dict()}) "
            "(names as in model.state_dict()), or engine.load(path) for a checkpoint written by engine.save")
    return hook


def describe_conversion(ctx: RuntimeContext, original: Sequence[torch.Tensor] | None, moved: list[int],
                        names: Sequence[str]) -> str | None:
    """For the guard: a message when reassigned parameters changed dtype or device, as ``model.to(...)``,
    ``.cuda()``, ``.half()``, ``.float()`` or ``.double()`` after wrapping do; None otherwise. ``original``:
    the parameters' own tensors while the first forward is not yet traced (``TracedWarmup.original``)."""
    def before(p: int) -> tuple[torch.dtype, torch.device]:  # what the engine gave the parameter
        if original is not None:  # before the first forward: its own (fp32, CPU) tensor
            return original[p].dtype, original[p].device
        return ctx.placeholders[p].dtype, ctx.placeholders[p].device  # a slot view's or its placeholder's

    changed = [p for p in moved if (ctx.params[p].dtype, ctx.params[p].device) != before(p)]
    if not changed:
        return None
    param = ctx.params[changed[0]]
    dtype, device = before(changed[0])
    return (f"the wrapped model was converted after offload.wrap (e.g. model.to(...), .cuda(), .half(), "
            f".float(), .double()): parameter {names[changed[0]]} is now {param.dtype} on "
            f"{param.device}, where the engine keeps it as {dtype} on {device}. The engine owns where "
            f"and in what precision the model runs (fp32 masters on the host): pass dtype=/device= to "
            f"offload.wrap instead (engine.close(), convert, wrap again). The conversion was undone.")
