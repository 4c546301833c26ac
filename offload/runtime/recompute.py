"""Activation checkpointing, executed for the runtime: chosen modules run under non-reentrant
``torch.utils.checkpoint``, entered and left from forward hooks (as ``torch.distributed._composable``'s
``checkpoint`` does), so the model's code and module tree stay as they are.

[Note: recompute and the parameter buckets] A checkpointed call saves nothing for backward but its
inputs (checkpoint's own saved-tensor hooks sit above the engine's). In backward, the first node that
needs one of its tensors makes checkpoint run the module's forward again under *its* saved-tensor hooks,
so the weight views the recomputed ops save bypass the engine's pack hook and point straight into the
device slots of their buckets. The engine therefore (1) runs the use detector during the recompute, so the
weights it reads are fetched and recorded as one RECOMPUTE event of the trace, (2) keeps those buckets
where they are until the call's backward is over, which a pass-through autograd function on the call's
inputs reports (its backward runs once the grads of all the inputs are made, i.e. after every node of
the call; see ``_RegionEnd``), and the planner's need interval of the RECOMPUTE event ends there too
(off plan, see [Note: recomputed weights off plan]),
and (3) counts the recomputed tensors as device memory from the recompute until then (an upper bound:
autograd frees them one by one as it goes).

[Note: recomputed weights off plan] Off plan (the warm-up step of "auto", which checkpoints every block, the
on-demand step after a choice, a departure) nothing is laid out ahead, and holding a block's buckets through
its whole backward costs what a step without checkpointing never holds: the buckets of every call of the
block at once, beside the grad slots its backward opens. So a recompute that starts off plan hands checkpoint
a stand-in for each weight view it saves (a one-element tensor expanded to the view's shape, dtype and device,
which is all checkpoint checks a recomputed tensor against, carrying the view's parameter reference), and
the unpack hook above checkpoint's turns the stand-in back into the view when a node of the call's backward
asks for it, fetching the bucket first if it was evicted (as the engine's own unpack does, [Note: saved
parameters]). The buckets are then held only while the recompute runs and go back to the on-demand cache at
its end. On plan, (2) above holds: the plan laid out the RECOMPUTE event's needs until the call's backward is
over, so there is no stand-in, and the trace records the same events either way.

[Note: buffers a recompute updates] A checkpointed call's forward runs twice, so whatever it updates in
place runs twice: BatchNorm's running statistics and ``num_batches_tracked``, a counter or an EMA buffer of the
user's. Plain PyTorch without checkpointing (what the engine's option must train like) updates them once. The
forward hooks therefore note which buffers of the block the call's forward changed (a version counter moved, the
module holds another tensor under that name, or it is a norm layer's running statistics in training, which
the native kernel updates without moving the counter), and the recompute runs on clones of exactly those: each
clone is put in the module's place when the recompute begins, and the buffer the forward left is put back
when it ends (also when checkpoint stops it early), untouched, so no version counter of it moves either. The
clones hold the values the forward left, so a forward that reads a buffer it updated (``self.count`` used in
the output) reads the updated value when recomputed, as under ``torch.utils.checkpoint``; BatchNorm in
training normalizes by the batch's statistics and reads none. Before session 25 the statistics were updated
twice (a momentum of 0.1 gave 0.19 of the batch's mean), silently.

The bytes a checkpointed call would have saved are measured in forward by a pack hook placed above
checkpoint's own (it passes every tensor on), so a step that checkpoints a block still measures what not
checkpointing it would cost (see ``offload/planning/activations.py``).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterable, Literal, Protocol, Sequence, Union

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

# The implementation of torch.utils.checkpoint.checkpoint(..., use_reentrant=False), as a generator that a
# forward pre-hook enters and a forward hook finishes (what torch.distributed._composable.checkpoint does).
from torch.utils.checkpoint import _checkpoint_without_reentrant_generator

from ..errors import InvariantError
from ..planning.activations import AUTO
from .saved_hooks import engine_hook

# activation_checkpointing other than None: "auto", module names, or a predicate of (name, module)
CheckpointSpec = Union[str, Sequence[str], Callable[[str, nn.Module], bool]]


def find_blocks(model: nn.Module) -> dict[int, str]:
    """The blocks ``activation_checkpointing="auto"`` may checkpoint: children of an ``nn.ModuleList`` or
    ``nn.Sequential`` that are repeated (two or more of one class) and have submodules of their own
    (transformer blocks, not single layers); the outermost such, by module index -> name."""
    index = {id(m): i for i, m in enumerate(model.modules())}
    names = {id(m): n for n, m in model.named_modules()}
    found: dict[int, str] = {}
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        kids = list(container.children())
        for child in kids:
            same = sum(type(k) is type(child) for k in kids)
            if same >= 2 and any(True for _ in child.children()):
                found[index[id(child)]] = names[id(child)]
    return _outermost(model, found)


def resolve(spec: CheckpointSpec, model: nn.Module) -> dict[int, str]:
    """The modules a non-auto ``activation_checkpointing`` names, by module index -> name."""
    named = list(model.named_modules())
    chosen: dict[int, str] = {}
    if callable(spec):
        for i, (name, m) in enumerate(named):
            if i and spec(name, m):
                chosen[i] = name
    else:
        where = {name: i for i, (name, _) in enumerate(named)}
        missing = [n for n in spec if n not in where]
        if missing:
            some = ", ".join(repr(n) for n, _ in named[1:6])
            raise ValueError(f"activation_checkpointing names modules the model does not have: {missing}; "
                             f"names are as in model.named_modules(), e.g. {some}")
        if "" in spec:
            raise ValueError("activation_checkpointing cannot checkpoint the wrapped model itself (name ''); "
                             "name its blocks")
        chosen = {where[n]: n for n in spec}
    kept = _outermost(model, chosen)
    if len(kept) != len(chosen):
        inner = sorted(set(chosen.values()) - set(kept.values()))
        raise ValueError(f"activation_checkpointing names modules inside other named modules: {inner}; "
                         "name either the outer or the inner ones")
    return kept


def candidates(spec: CheckpointSpec | None, model: nn.Module) -> dict[int, str]:
    """Blocks that may be checkpointed under ``spec`` (None: the auto blocks, for error hints only)."""
    if spec is None or spec == AUTO:
        return find_blocks(model)
    return resolve(spec, model)


def _outermost(model: nn.Module, chosen: dict[int, str]) -> dict[int, str]:
    names = set(chosen.values())
    return {i: n for i, n in chosen.items()
            if not any(n.startswith(o + ".") for o in names if o != n)}


class _RegionEnd(torch.autograd.Function):
    """Identity on a checkpointed call's inputs; its backward runs after every node of the call (they all
    lie between the call's outputs and these inputs, and come later in creation order, which autograd
    runs first), so it reports that the call's backward is over."""

    @staticmethod
    def forward(ctx: Any, done: Callable[[], None], *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.done = done
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.done()
        return (None, *grads)


class _AboveCheckpoint:
    """Saved-tensor hooks pushed above the ones on top when entered (checkpoint's): ``seen(x)`` for every
    saved tensor, then checkpoint's own pack with what ``seen`` returned in place of ``x`` (``x`` if None),
    and checkpoint's own unpack, its result passed through ``unpacked`` if given."""

    def __init__(self, seen: Callable[[torch.Tensor], torch.Tensor | None],
                 unpacked: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.seen = seen
        self.unpacked = unpacked
        self.ctx: torch.autograd.graph.saved_tensors_hooks | None = None

    def __enter__(self) -> None:
        below = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if below is None:
            raise InvariantError("entered outside torch.utils.checkpoint's saved-tensor hooks")
        pack_below, unpack_below = below
        seen, unpacked = self.seen, self.unpacked

        @engine_hook  # the engine's, above checkpoint's: [Note: a user's saved-tensor hooks] in saved_hooks.py
        def pack(x: torch.Tensor) -> Any:
            y = seen(x)
            return pack_below(x if y is None else y)

        if unpacked is None:
            self.ctx = torch.autograd.graph.saved_tensors_hooks(pack, unpack_below)
        else:
            after = unpacked

            def unpack(h: Any) -> torch.Tensor:
                return after(unpack_below(h))

            self.ctx = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self.ctx.__enter__()

    def __exit__(self, *exc: Any) -> Literal[False]:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
        return False


class RecomputeCallbacks(Protocol):
    """What the Checkpointer calls back into (offload/runtime/recompute_hooks.py's RecomputeCoordinator)."""

    def recompute_begin(self, region: int, module: int) -> list: ...
    def recompute_saved(self, region: int, t: torch.Tensor) -> torch.Tensor | None: ...
    def recompute_end(self, region: int) -> None: ...
    def recomputed_unpacked(self, x: torch.Tensor) -> torch.Tensor: ...
    def region_saved(self, block: int, region: int, t: torch.Tensor) -> None: ...
    def region_done(self, region: int) -> None: ...


class Checkpointer:
    """Runs the chosen modules checkpointed and measures, per block, what its forward saves.

    The recompute coordinator owns it; it calls back into it (held weakly) at the moments the runtime must
    know of: ``region_saved`` (a checkpointed call's forward saves a tensor: measured, not kept),
    ``recompute_begin``/``recompute_saved``/``recompute_end`` (backward recomputes the call),
    ``recomputed_unpacked`` (the call's backward unpacks what the recompute saved) and ``region_done``
    (its backward is over).
    """

    def __init__(self, model: nn.Module, runtime: RecomputeCallbacks, blocks: dict[int, str]):
        self.modules = list(model.modules())
        self.blocks = dict(blocks)  # module index -> name: what is measured (and may be checkpointed)
        self.block_of: dict[int, int] = {}  # module index -> the block containing it (itself included)
        for i, m in enumerate(self.modules):
            if i in blocks:
                for sub in m.modules():
                    self.block_of[self._index(sub)] = i
        self.rt = weakref.ref(runtime)
        self.active: frozenset = frozenset()  # module indices checkpointed now
        self.handles: dict[int, list] = {}
        self.gens: list = []  # (generator, region, buffers at its start) per checkpointed call in progress
        # block -> its modules that have buffers
        self.buffer_modules: dict[int, list[nn.Module]] = {
            i: [sub for sub in m.modules() if sub._buffers] for i, m in enumerate(self.modules) if i in blocks}
        self.updated: dict[int, list[tuple[dict, str]]] = {}  # region -> buffers its forward changed
        self.recomputing: int | None = None  # region being recomputed
        self.reset()

    def _index(self, m: nn.Module) -> int:
        return next(i for i, x in enumerate(self.modules) if x is m)

    def reset(self) -> None:
        """A new step: measurements start over."""
        self.saved: dict[int, int] = {}  # block -> bytes its calls saved (or would have, if checkpointed)
        self.inputs: dict[int, int] = {}  # block -> bytes of its calls' tensor inputs
        self.regions: list[int] = []  # region id -> module index
        self.region_bytes: dict[int, int] = {}  # region -> bytes its forward saved (what recompute makes)
        self._seen: dict[int, dict[int, weakref.ref]] = {}  # region -> address -> tensor counted there
        self.updated = {}

    def set_active(self, modules: Iterable[int]) -> None:
        """Checkpoint exactly ``modules`` (module indices) from the next forward on."""
        chosen = frozenset(modules)
        for i in self.active - chosen:
            for h in self.handles.pop(i):
                h.remove()
        for i in sorted(chosen - self.active):
            m = self.modules[i]
            self.handles[i] = [m.register_forward_pre_hook(self._pre(i), with_kwargs=True),
                               m.register_forward_hook(self._post, prepend=True, always_call=True)]
        self.active = chosen

    def close(self) -> None:
        self.set_active(())

    # -- measuring --------------------------------------------------------------------------------------

    def count(self, block: int, region: int | None, x: torch.Tensor) -> None:
        """``x`` is saved inside ``block``: count its storage once per region (or per step).

        A checkpointed forward keeps none of what it saves, so an address can come back for another tensor:
        an address counts as seen only while the tensor first seen there is alive (a storage that outlives
        that tensor through another view is then counted twice: the error is on the high side)."""
        seen = self._seen.setdefault(-1 if region is None else region, {})
        storage = x.untyped_storage()
        ptr = storage.data_ptr()
        earlier = seen.get(ptr)
        if earlier is not None and earlier() is not None:
            return
        seen[ptr] = weakref.ref(x)
        self.saved[block] = self.saved.get(block, 0) + storage.nbytes()
        if region is not None:
            self.region_bytes[region] = self.region_bytes.get(region, 0) + storage.nbytes()

    # -- the hooks --------------------------------------------------------------------------------------

    def _pre(self, index: int) -> Callable[[nn.Module, tuple, dict], tuple[tuple, dict] | None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            rt = self.rt()
            if rt is None or self.recomputing is not None or not torch.is_grad_enabled():
                self.gens.append((None, -1, []))
                return None
            region = len(self.regions)
            self.regions.append(index)
            self.inputs[index] = self.inputs.get(index, 0) + sum(
                _nbytes(x) for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor))
            args, kwargs = _mark_inputs(args, kwargs, _Done(rt, region))
            gen = _checkpoint_without_reentrant_generator(
                module, True, lambda: self._contexts(rt, region, index), "default", False, True,
                *args, **kwargs)
            next(gen)
            self.gens.append((gen, region, _buffer_versions(self.buffer_modules.get(index, ()))))
            return args, kwargs
        return hook

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        gen, region, before = self.gens.pop() if self.gens else (None, -1, [])
        if gen is None:
            return None
        changed = [(table, name) for table, name, t, version in before
                   if version < 0 or table.get(name) is not t or t._version != version]
        if changed:  # [Note: buffers a recompute updates]
            self.updated[region] = changed
        try:
            next(gen)
        except StopIteration:
            return None
        raise InvariantError("torch.utils.checkpoint's context generator did not finish with the checkpointed "
                             "forward: a bug in offload (or a torch it does not know), please report it")

    def _contexts(self, rt: RecomputeCallbacks, region: int, index: int) -> tuple[_AboveCheckpoint, _RecomputeScope]:
        forward = _AboveCheckpoint(lambda x: rt.region_saved(index, region, x), rt.recomputed_unpacked)
        return forward, _RecomputeScope(self, rt, region, index)


class _RecomputeScope:
    """Entered by checkpoint around the recomputed forward of one call (in backward)."""

    def __init__(self, owner: Checkpointer, rt: RecomputeCallbacks, region: int, index: int) -> None:
        self.owner, self.rt, self.region, self.index = owner, rt, region, index
        self.stack = contextlib.ExitStack()
        self.kept: list[tuple[dict, str, torch.Tensor]] = []  # the buffers the forward left, put back at exit

    def __enter__(self) -> None:
        self.owner.recomputing = self.region
        # [Note: buffers a recompute updates]: the recompute updates clones
        for table, name in self.owner.updated.get(self.region, ()):
            t = table.get(name)
            if isinstance(t, torch.Tensor):
                self.kept.append((table, name, t))
                table[name] = t.detach().clone()
        try:
            for ctx in self.rt.recompute_begin(self.region, self.index):
                self.stack.enter_context(ctx)
            self.stack.enter_context(_AboveCheckpoint(lambda x: self.rt.recompute_saved(self.region, x)))
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> Literal[False]:
        try:
            self.stack.close()  # also when checkpoint stops the recompute early (_StopRecomputationError)
        finally:
            for table, name, t in self.kept:
                table[name] = t
            self.kept = []
            self.owner.recomputing = None
            self.rt.recompute_end(self.region)
        return False


class _Done:
    """Callback of ``_RegionEnd``; holds the runtime weakly (the autograd graph may outlive it)."""

    def __init__(self, rt: RecomputeCallbacks, region: int) -> None:
        self.rt, self.region = weakref.ref(rt), region

    def __call__(self) -> None:
        rt = self.rt()
        if rt is not None:
            rt.region_done(self.region)


def _mark_inputs(args: tuple, kwargs: dict, done: _Done) -> tuple[tuple, dict]:
    """Route the tensor inputs that require grad through one ``_RegionEnd``."""
    keys = [("a", i) for i, x in enumerate(args) if isinstance(x, torch.Tensor) and x.requires_grad]
    keys += [("k", k) for k, x in kwargs.items() if isinstance(x, torch.Tensor) and x.requires_grad]
    if not keys:
        return args, kwargs
    new_args, new_kwargs = list(args), dict(kwargs)
    outs = _RegionEnd.apply(done, *[new_args[k] if kind == "a" else new_kwargs[k] for kind, k in keys])
    for (kind, k), y in zip(keys, outs):
        if kind == "a":
            new_args[k] = y
        else:
            new_kwargs[k] = y
    return tuple(new_args), new_kwargs


def _buffer_versions(modules: Iterable[nn.Module]) -> list[tuple[dict, str, torch.Tensor, int]]:
    """Every tensor buffer of ``modules`` with its table (the module's ``_buffers``) and its version counter now;
    -1 for a norm layer's running statistics in training, which its native kernel updates without moving the
    version counter (checked with BatchNorm1d on the CPU)."""
    return [(m._buffers, name, t, -1 if name in _RUNNING and m.training and isinstance(m, _NormBase) else t._version)
            for m in modules for name, t in m._buffers.items() if isinstance(t, torch.Tensor)]


_RUNNING = frozenset(("running_mean", "running_var", "num_batches_tracked"))


def _nbytes(x: torch.Tensor) -> int:
    return x.untyped_storage().nbytes() if x.layout == torch.strided else 0
