"""Checks that turn a hostile or mistaken use into a clear error instead of wrong numbers.

The engine owns every wrapped parameter's storage: its fp32 master lives in the host arena and the
parameter points at a device slot or a placeholder. A parameter replaced or added after wrapping, a
``.data`` the user reassigned, or an in-place write to a parameter would otherwise be silently ignored
(the next refresh overwrites it) or read as garbage. :class:`ParamGuard` checks all three at the start
of every forward, in one pass over the parameters (pointer and version-counter compares, no tensor made).
"""

from __future__ import annotations

import operator
import weakref
from itertools import chain
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..config import format_bytes
from ..errors import BudgetTooSmallError, OffloadError
from .idle_params import show
from .module_state import describe_conversion

if TYPE_CHECKING:
    from .context import Backend, RuntimeContext
    from .executor import PlanExecutor
    from .slots import SlotTable
    from .warmup import TracedWarmup

_HOW_TO_SET = ("To change weights of a wrapped model, use engine.load_state_dict(...) or engine.load(path); to "
               "change the model itself, engine.close() it, change it, and wrap it again")


class ParamGuard:
    """Start-of-forward checks of one runtime's parameters (see the module docstring)."""

    def __init__(self, ctx: RuntimeContext, slots: SlotTable, executor: PlanExecutor, warmup: TracedWarmup) -> None:
        self.ctx, self.slots, self.executor, self.warmup = ctx, slots, executor, warmup
        self.versions: list[int] | None = None  # version counters, once the engine owns the storage
        self.names = [f"parameter {p}" for p in range(len(ctx.params))]  # as named when wrapped
        for name, param in ctx.module.named_parameters():
            self.names[ctx.param_index[id(param)]] = name
        self._tree: _Tree | None = None  # the module tree the last walk accepted ([Note: the tree stamp])
        # (the host state, weakly; slot base per bucket; where each parameter should point): see ``_moved``
        self._wants: tuple[weakref.ref, list[int | None], list[int]] | None = None
        # parameters frozen when wrapped: the engine keeps no optimizer state for them (``_unfrozen``)
        self._frozen = [param for param, spec in zip(ctx.params, ctx.specs) if spec.group is None]

    def check(self) -> None:
        with torch._C.DisableTorchFunctionSubclass():  # idle parameters' metadata read at C speed (idle_params.py)
            self._check()

    def check_at_step(self) -> None:
        """``step()`` begins: a parameter's ``.data`` reassigned since the forward is refused here,
        before the update: ``step()``'s refresh of a resident bucket rebinds its parameters to the slot, which
        hid the reassignment from the next forward's check, and the user's value was dropped silently (session
        24). The module tree and the version counters are left to the next forward (the walk is the costly part
        of ``check``; a device update in backward bumps the counters, device_optim.py)."""
        with torch._C.DisableTorchFunctionSubclass():
            self._check_params(versions=False)  # a device update in backward bumps them (device_optim.py)

    def _check(self) -> None:
        ctx = self.ctx
        if self._tree is None or not self._tree.unchanged():
            current = list(ctx.module.parameters())
            if len(current) != len(ctx.params) or any(id(p) not in ctx.param_index for p in current):
                self._changed_set(current)
            self._tree = _Tree.of(ctx.module)
        self._check_params()

    def _check_params(self, versions: bool = True) -> None:
        """``versions``: also refuse parameters written in place since the last snapshot (at a forward; a user's
        write outside one raises at once: [Note: parameters between forwards] in idle_params.py)."""
        ctx = self.ctx
        if self._frozen and any(map(_REQUIRES_GRAD, self._frozen)):
            self._unfrozen()
        moved = self._moved()
        written: list[int] = []
        snapshot = self.versions if versions else None
        # the usual case (nothing written) is one compare of two lists of counters read at C speed
        if snapshot is not None and list(map(_VERSION, ctx.params)) != snapshot:
            written = [p for p, param in enumerate(ctx.params) if param._version != snapshot[p] and p not in moved]
        if moved or written:
            # issue 19: model.to()/.half()/... named (dtype/device read before the restore rebinds)
            conversion = describe_conversion(ctx, self.warmup.original, moved, self.names)
            self._restore(moved, written)
            if conversion is not None:
                raise OffloadError(conversion)
            names = self.names
            parts = []
            if moved:
                parts.append(f"had .data reassigned: {', '.join(names[p] for p in moved[:8])}"
                             + (f" (and {len(moved) - 8} more)" if len(moved) > 8 else ""))
            if written:
                parts.append(f"were written in place (e.g. under torch.no_grad()): "
                             f"{', '.join(names[p] for p in written[:8])}"
                             + (f" (and {len(written) - 8} more)" if len(written) > 8 else ""))
            raise OffloadError(f"parameters of the wrapped model changed outside the engine after wrapping: "
                               f"{'; '.join(parts)}. The engine keeps the weights in its own memory (fp32 masters "
                               f"on the host), so the change was not used and has been undone. {_HOW_TO_SET}.")
        if self.versions is None:  # else every version counter was just found equal to the snapshot's
            self.snapshot()

    def snapshot(self) -> None:
        """Remember the parameters' version counters (from the first step on; before it the user's writes go
        to the original tensors, which the traced first forward reads)."""
        if self.slots.host is not None:
            with torch._C.DisableTorchFunctionSubclass():  # idle parameters' counters at C speed
                self.versions = list(map(_VERSION, self.ctx.params))

    def _unfrozen(self) -> None:
        """A parameter frozen when wrapped (``requires_grad=False``) requires grad now: its grads would reach no
        optimizer state and it would never be updated, silently (session 24; plain torch trains it if it is in the
        optimizer). Refused at every forward and step() until it is frozen again or the model wrapped again."""
        names = [self.names[p] for p, (param, spec) in enumerate(zip(self.ctx.params, self.ctx.specs))
                 if spec.group is None and param.requires_grad]
        raise OffloadError(
            f"parameter(s) {', '.join(names[:8])}{f' (and {len(names) - 8} more)' if len(names) > 8 else ''} were "
            "frozen (requires_grad=False) when the model was wrapped, so the engine keeps no optimizer state for "
            "them and would never update them; they require grad now. To train them: engine.close(), make them "
            "trainable, build the optimizer with them and wrap again (the model keeps the trained weights after "
            "close()); else set requires_grad=False on them again")

    def _changed_set(self, current: list[nn.Parameter]) -> None:
        ctx = self.ctx
        ours = set(map(id, current))
        added = [n for n, p in ctx.module.named_parameters() if id(p) not in ctx.param_index]
        gone = [self.names[p] for p, param in enumerate(ctx.params) if id(param) not in ours]
        swapped = ""
        new = [p for p in current if id(p) not in ctx.param_index]
        if added and set(added) == set(gone) and not any(isinstance(p, nn.Parameter) for p in new):
            swapped = (" Plain tensors in the parameters' places, under their names: torch.func.functional_call (or "
                       "torch.nn.utils.stateless) with tensors of your own runs the model on them, outside the engine; "
                       "call it on a model that is not wrapped (e.g. one built and loaded from model.state_dict()).")
        raise OffloadError(f"the wrapped model's parameters changed after wrapping (new: {added or 'none'}; no longer "
                           f"in the model: {gone or 'none'}). A parameter replaced or added after offload.wrap is not "
                           f"offloaded or trained by the engine.{swapped} {_HOW_TO_SET}.")

    def _restore(self, moved: list[int], written: list[int]) -> None:
        """Point reassigned parameters back at what the engine gave them; copy the buckets written in place
        on the device afresh from their host masters."""
        ctx = self.ctx
        with torch.no_grad():
            self.executor.refresh({self.slots.bucket_of[p] for p in written})
        original = self.warmup.original
        for p in moved:
            if original is not None:
                show(ctx.params[p])
                ctx.params[p].data = original[p]
            else:
                self.slots.rebind(p)
        self.versions = [param._version for param in ctx.params] if self.slots.host is not None else None

    def _moved(self) -> list[int]:
        """Parameters whose data no longer points where the engine put it (``_expected``). This runs at every
        forward: once the buckets exist, where each parameter should point is computed again only when a
        bucket's slot changed (``_wants``), and nothing moved is one compare of two address lists."""
        ctx = self.ctx
        if self.warmup.original is not None:
            return [p for p, param in enumerate(ctx.params)
                    if param.numel() and param.data_ptr() not in self._expected(p)]
        slots = self.slots
        host = slots.hosted()
        shown, bucket_of, offset, itemsize = slots.shown, slots.bucket_of, host.offset, ctx.itemsize
        placeholders = ctx.placeholders
        bases: list[int | None] = []
        for b in range(len(slots.state)):
            slot = shown(b)  # [Note: parameters show landed slots] in slots.py
            bases.append(None if slot is None else slot.storage.data_ptr() + slot.offset)
        # Where every parameter should point follows from the buckets' slots alone: kept while they are the
        # same, so that the usual case (nothing moved) is one compare of two lists of addresses at C speed
        wants = self._wants
        if wants is None or wants[0]() is not host or wants[1] != bases:
            want = [placeholders[p].data_ptr() if base is None else base + offset[p] * itemsize
                    for p, base in enumerate(bases[b] for b in bucket_of)]
            wants = self._wants = (weakref.ref(host), bases, want)  # weak: close() frees the host arena
        want = wants[2]
        params = ctx.params
        if list(map(_DATA_PTR, params)) == want:
            return []
        return [p for p, param in enumerate(params) if param.data_ptr() != want[p] and param.numel()]

    def _expected(self, p: int) -> tuple[int, ...]:
        """Where parameter ``p``'s data may point right now: its slot, its placeholder, or (before the first
        forward is traced) its original tensor."""
        original = self.warmup.original
        if original is not None:
            return original[p].data_ptr(), self.ctx.placeholders[p].data_ptr()
        return (self.slots.address(p),)


class _Tree:
    """[Note: the tree stamp] ``module.parameters()`` is a function of each module's ``_parameters`` and
    ``_modules`` dicts, walked from the root (as long as no module's class overrides the walk). Walking it
    through those generators cost ~0.5 ms per forward for a 200-module model (issue 17, the hot path), while
    comparing each module's two dicts with what they held when a walk was last accepted costs a fifth of
    that: the same dict objects holding the same objects (compared by identity) give the same parameters, so
    the walk is repeated only after a change (a parameter or submodule set, replaced or deleted). ``of`` gives
    None where a class overrides the walk."""

    _WALK = ("parameters", "named_parameters", "_named_members", "named_modules")

    def __init__(self, modules: list[nn.Module]) -> None:
        # Per module, in walk order: its two dicts, how many entries each held, and every entry, dict after
        # dict. Equal lengths dict by dict and the same objects in that order mean the same contents in
        # every dict; each comparison runs at C speed (``map``), with no tuple built per dict.
        self.modules = modules
        self.dicts: tuple[list[dict], ...] = ([m._parameters for m in modules], [m._modules for m in modules])
        self.lengths = [list(map(len, d)) for d in self.dicts]
        # dict.values itself where every dict is a plain one (a third faster; the dicts read are these ones)
        plain = all(type(x) is dict for d in self.dicts for x in d)
        self.values: Callable[[dict], Any] = dict.values if plain else operator.methodcaller("values")
        # the entries are compared in the dicts that held any (most modules' dicts are empty, and stay so while
        # every length is the same: a sixth less time for a 200-module model)
        self.full = [[x for x in d if len(x)] for d in self.dicts]
        self.held = [list(chain.from_iterable(map(self.values, d))) for d in self.full]

    @classmethod
    def of(cls, root: nn.Module) -> _Tree | None:
        modules = list(root.modules())
        for m in modules:
            if any(getattr(type(m), name) is not getattr(nn.Module, name) or name in m.__dict__ for name in cls._WALK):
                return None
        return cls(modules)

    def unchanged(self) -> bool:
        is_, modules, values = operator.is_, self.modules, self.values
        for attr, dicts, lengths, full, held in zip(_DICTS, self.dicts, self.lengths, self.full, self.held):
            if (not all(map(is_, map(attr, modules), dicts)) or list(map(len, dicts)) != lengths
                    or not all(map(is_, chain.from_iterable(map(values, full)), held))):
                return False
        return True


_DICTS = (operator.attrgetter("_parameters"), operator.attrgetter("_modules"))
_DATA_PTR = torch.Tensor.data_ptr
_VERSION = operator.attrgetter("_version")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def refuse_forward_in_backward(ctx: RuntimeContext, module: int) -> None:
    """A forward of the wrapped model (or of one of its modules) that begins inside a backward under
    saved-tensor hooks of someone else's is refused (issue 19): ``torch.utils.checkpoint(..., use_reentrant=
    False)`` recomputing a checkpointed call of the user's. Its recompute runs under checkpoint's own hooks,
    which the engine's would hide (torch's CheckpointError: "0 tensors saved during recomputation"), and may
    stop early inside the call. A reentrant one is followed ([Note: a user's reentrant checkpoint] in
    recompute_hooks.py); the engine's own activation checkpointing runs the non-reentrant recompute for it."""
    name = next((n for i, (n, _) in enumerate(ctx.module.named_modules()) if i == module), "")
    what = f"module {name!r} of the wrapped model" if name else "the wrapped model"
    raise OffloadError(
        f"a forward of {what} ran inside a backward under other saved-tensor hooks: that is "
        "torch.utils.checkpoint.checkpoint(..., use_reentrant=False) recomputing a call during backward, which "
        "offload cannot follow (the recompute must run under checkpoint's own saved-tensor hooks, above the "
        "engine's, and may stop early inside the call). Let the engine checkpoint those modules instead: remove "
        "the torch.utils.checkpoint call and wrap with activation_checkpointing=[\"blocks.0\", \"blocks.1\", "
        "...] (names as in model.named_modules()) or activation_checkpointing=\"auto\", which recompute them "
        "the same way (non-reentrant), with the same numbers and within the plan; or pass use_reentrant=True, "
        "which offload follows")


def check_step_has_grads(backward_seen: bool) -> None:
    """``step()`` needs a backward since the last ``step()``: without one it has no gradients to apply."""
    if not backward_seen:
        raise OffloadError("step() was called but no backward ran since the last step() (or since wrapping), so "
                           "there are no gradients to apply. Call loss.backward() (or engine.backward(loss)) "
                           "before optimizer.step()")


def check_budget(budget: int, backend: Backend) -> None:
    """The budget cannot exceed the device's memory, and must leave room for a plan beside the backend's
    runtime headroom (cuBLAS workspaces and allocator rounding on CUDA; [Note: headroom] in backend/cuda.py)."""
    total = backend.total_bytes()
    if budget > total:
        raise OffloadError(f"budget {format_bytes(budget)} is larger than the device's memory "
                           f"({format_bytes(total)} on {backend.device}). Give a budget below that, leaving room "
                           "for other processes, e.g. budget=\"{}\"".format(_suggest(total)))
    headroom = backend.headroom_bytes()
    if budget <= headroom:
        raise BudgetTooSmallError(
            f"the device budget {format_bytes(budget)} is too small: the runtime headroom alone (cuBLAS "
            f"workspaces, allocator rounding, measured on {backend.device}) takes {format_bytes(headroom)} of it, "
            f"which leaves nothing for the model. Give a budget of the model's needs plus {format_bytes(headroom)} "
            "(offload.backend.headroom_bytes(device) measures it)",
            min_budget_bytes=headroom + 1, budget_bytes=budget, breakdown={"headroom": headroom})


def _suggest(total: int) -> str:
    gib = int(total * 0.9 / 2**30)
    return f"{gib}GiB" if gib >= 1 else f"{int(total * 0.9 / 2**20)}MiB"


def refuse_compile() -> None:
    """``torch.compile`` of a wrapped module is refused: the engine swaps parameter storage between calls and
    follows the forward through hooks, a tensor-function mode and saved-tensor hooks, none of which a
    compiled graph would replay. Compile the model's submodules before wrapping instead."""
    if torch.compiler.is_compiling() or _in_compile_region():
        raise OffloadError("torch.compile of a module wrapped by offload is not supported: the engine moves "
                           "parameters between host and device around every module call, which a compiled graph "
                           "would not replay. Call the wrapped module (or the engine) without torch.compile.")


def _in_compile_region() -> bool:
    """True inside a call of a ``torch.compile``d function, also where dynamo fell back to running Python (as
    torch's own ``set_stance`` checks it): the frame-evaluation callback is installed then."""
    if _eval_frame_callback is None:  # a torch without dynamo cannot compile
        return False
    return _eval_frame_callback() not in (None, False)


# Imported once: an import statement in _in_compile_region, which runs for every module call, cost ~6 us a call
_eval_frame_callback: Callable[[], object] | None
try:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _eval_frame_callback
except ImportError:
    _eval_frame_callback = None
