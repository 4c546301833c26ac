"""A user's saved-tensor hooks (``torch.autograd.graph.save_on_cpu()``, ``saved_tensors_hooks(pack, unpack)``,
``disable_saved_tensors_hooks``) around and inside a wrapped model's forward (issue 19).

[Note: a user's saved-tensor hooks] Autograd applies only the innermost saved-tensor hooks. The engine's
own (``Runtime._pack``/``_unpack``: weight views saved as references, [Note: saved parameters] in
param_access.py) are pushed when a forward begins, so:

* hooks of the user's entered **around** the call (``with save_on_cpu(): loss = model(x)``) lie below the
  engine's. Left alone they would do nothing (before: ``save_on_cpu`` kept every activation on the device,
  silently; a pack hook that changes values, e.g. one that stores activations in bf16, was skipped, so the
  numbers differed from plain PyTorch). The engine therefore composes with them (:class:`UnderUserHooks`):
  an activation goes to the user's pack as in plain PyTorch (and is not counted as the engine's device
  memory: the user's hooks hold it); a weight view is still saved as a reference, and when backward reads
  it the user's pack and unpack are applied to the view rebuilt then. The weights do not change between a
  forward and its backward, so that is the value plain PyTorch's unpack gives, bit for bit (the user's
  pack runs in backward rather than in forward for weight views: a hook with side effects sees them then).
* hooks entered **inside** the forward (in the model's code) lie above the engine's: the weight views
  autograd saves under them would bypass the engine and point into device slots that hold other weights by
  backward time (before: 1.6e-2 off plain PyTorch after 4 steps with ``save_on_cpu`` on the CPU backend,
  silently). The use detector sees every op of the forward that reads a parameter; if the innermost hooks
  are not the engine's then, the forward is refused (:func:`check_on_top`) before that op runs, naming the
  way that works: the same hooks around the call. (Not seen: a view of a weight made before the hooks were
  entered and used only under them, e.g. ``w = self.weight.t()`` then ``with save_on_cpu(): y = x @ w``.)
* ``disable_saved_tensors_hooks(msg)``: torch refuses to enter it while any saved-tensor hooks are active,
  so inside a wrapped forward it raises torch's ``RuntimeError(msg)`` (the engine's hooks are active
  there; the fault handling leaves the engine usable). Around the call, the engine cannot push its own
  hooks: the forward is refused with an :class:`OffloadError` before it changes anything
  (:func:`check_enabled`).

The engine's own hooks are marked (:func:`engine_hook`) so that the check knows them: the forward's, the
ones of its activation checkpointing (above torch's checkpoint's) and of a user's reentrant recompute.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch

from ..errors import OffloadError
from .residency import ParamRef

if TYPE_CHECKING:
    from .core import Runtime

_MARK = "_offload_saved_tensor_hook"
F = TypeVar("F", bound=Callable[..., Any])

_top = torch._C._autograd._top_saved_tensors_default_hooks


def engine_hook(fn: F) -> F:
    """Mark ``fn`` as a pack hook of the engine's (see [Note: a user's saved-tensor hooks])."""
    setattr(fn, _MARK, True)
    return fn


def user_hooks() -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None:
    """The innermost saved-tensor hooks if they are not the engine's (a user's, entered around the call)."""
    top = _top(False)
    if top is None or getattr(top[0], _MARK, False):
        return None
    return top


def check_on_top() -> None:
    """Called for each op of a forward with grad enabled that reads a parameter: the innermost saved-tensor
    hooks must be the engine's, or what the op saves of the weight bypasses the engine."""
    top = _top(False)
    if top is not None and (getattr(top[0], _MARK, False) or _is_checkpoints(top[0])):
        return
    raise OffloadError(
        "saved-tensor hooks were entered inside the forward of a model wrapped by offload (e.g. "
        "torch.autograd.graph.save_on_cpu() or torch.autograd.graph.saved_tensors_hooks(pack, unpack) in the "
        "model's code), and an op under them reads a parameter: the weight views it saves would bypass the "
        "engine, whose device slots hold other weights by the time backward reads them (silently wrong "
        "gradients). Enter the hooks around the call instead (with save_on_cpu(): loss = model(x)): the engine "
        "then applies them to what the forward saves, as PyTorch does. The weights live on the host already; "
        "to save device memory on activations, wrap with activation_checkpointing=[...] or \"auto\"")


def _is_checkpoints(pack: Any) -> bool:
    """``pack`` is non-reentrant ``torch.utils.checkpoint``'s forward hook: it keeps no tensor (its backward
    recomputes them), so weight views cannot go stale under it; its recompute is refused when it begins
    (``guards.refuse_forward_in_backward``, naming the engine's ``activation_checkpointing``)."""
    return getattr(pack, "__qualname__", "").startswith("_checkpoint_hook.")


def check_enabled() -> None:
    """A forward that needs the engine's saved-tensor hooks under ``disable_saved_tensors_hooks``: refused."""
    if torch._C._autograd._saved_tensors_hooks_is_enabled():  # type: ignore[attr-defined]
        return
    why = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() or ""
    raise OffloadError(
        "a model wrapped by offload was called under torch.autograd.graph.disable_saved_tensors_hooks"
        f"({why!r}): the engine needs saved-tensor hooks during the forward (autograd saves views of weights "
        "whose device memory is reused before backward; the engine saves them as references). Call the "
        "wrapped model outside disable_saved_tensors_hooks")


class _UserPacked:
    """An activation as the user's pack hook returned it."""

    __slots__ = ("packed",)

    def __init__(self, packed: Any) -> None:
        self.packed = packed


class UnderUserHooks:
    """The engine's saved-tensor hooks composed with the user's below them (see [Note: a user's saved-tensor
    hooks]): ``pack``/``unpack`` are pushed in place of the runtime's own."""

    def __init__(self, rt: Runtime, below: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]):
        self.rt = rt
        self.user_pack, self.user_unpack = below

    @engine_hook
    def pack(self, t: torch.Tensor) -> Any:
        ref = self.rt.access.locate(t)
        if ref is not None:
            return ref
        return _UserPacked(self.user_pack(t))

    def unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, ParamRef):
            view = self.rt.unpack_saved(saved)
            return self.user_unpack(self.user_pack(view))
        return self.user_unpack(saved.packed)
