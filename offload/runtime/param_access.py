"""Where the runtime learns that a parameter is read, and makes it readable: tensor ops of the forward
(a ``TorchFunctionMode``, the use detector) and autograd's saved tensors in backward (the pack/unpack
hooks, registered by the Runtime, resolve parameter views here). It also owns which buckets views in use
point into (module calls running, the autograd node running, recomputed calls), which eviction skips.

[Note: saved parameters] Autograd saves views of weights for backward (``linear`` saves ``weight.t()``).
Those views point into a device slot that may hold another bucket by the time backward runs. The
saved-tensor pack hook therefore turns any tensor living in a bucket slot into a reference (parameter,
byte offset, size, stride, dtype), and the unpack hook rebuilds it from wherever the bucket is then,
fetching it first if needed. The pack hook also sees every other saved tensor: those are the
activations, counted (once per storage) until autograd frees them.

[Note: one accumulator per parameter] Autograd gives a parameter one AccumulateGrad node, alive while a
graph holds it; ``param.data = x`` drops it when ``x``'s device or dtype differs from the current value's
(``VariableHooks::set_data``). A weight used twice in one forward (a tied embedding / LM head, a module
called twice) whose ``.data`` moved between the uses would then get two accumulators: its
post-accumulate-grad hook fires twice with partial grads, the trace has two GRAD events for it, and the
planned steps depart from the plan. So while a graph may be alive the runtime only ever rebinds a
parameter between tensors of its compute dtype on the device: slot views and placeholders of that dtype
(``RuntimeContext.placeholders``), never its host original (fp32, on the CPU) or another dtype. Host
tensors come only before the first forward and at ``close()``. (The simulated GPU, tests/support/fake_cuda.py,
drops the accumulator on a host/device change as CUDA does, so a break of this rule fails its tests.)

[Note: knowing where we are] Forward progress is module calls (pre/post hooks on every module); a
``TorchFunctionMode`` sees every tensor op of the forward and reports which parameters it touches (so a
parent reading a child's weight, tied weights and functional uses are all handled, and a parameter that
is somehow not on the device is fetched instead of read as garbage). Backward progress is autograd nodes
reading saved parameters (unpack hook) and gradient accumulation (post-accumulate-grad hooks); the end of
backward is a callback queued on the autograd engine.

[Note: parameters written in forward] An op of the forward that writes a parameter in place (``nn.Embedding(
max_norm=...)`` renormalizes the rows it looks up, under ``no_grad``; a clamp of a weight inside ``forward``)
would write the device slot only: the engine's fp32 master never sees it, the next fetch or refresh brings the
old values back, and the model trains differently from plain PyTorch, silently (session 25: the loss 1.6 % off
at the second step with ``max_norm=1``). The use detector therefore refuses such an op before it runs, with an
``OffloadError`` naming the parameter and the way. It sees the parameter itself as the op's first argument (or
in a list there) or as ``out=``; a write through a view taken in the forward (``w = self.weight[0]``, then
``w.zero_()``) is not seen. Fast steps run without the detector, so a write that begins after the first steps
is not seen either; one present from the start is refused at the first forward (the traced step).
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from ..errors import OffloadError
from .idle_params import written_by
from .phases import Lifecycle
from .residency import ParamRef, Residency
from .saved_hooks import check_on_top

if TYPE_CHECKING:
    from .context import Busy, RuntimeContext
    from .executor import PlanExecutor
    from .slots import SlotTable
    from .warmup import TracedWarmup


class UseDetector(TorchFunctionMode):
    """Reports the parameters each tensor op of the forward touches (see [Note: knowing where we are])."""

    def __init__(self, access: ParamAccess) -> None:
        super().__init__()
        self._index = access.ctx.param_index
        self._busy: Busy = access.ctx.busy
        self._touch: Callable[[], Callable[[int], None] | None] = weakref.WeakMethod(access.on_touch)
        self._module = weakref.ref(access.ctx.module)

    def _params(self) -> dict[int, str]:
        module = self._module()
        return {} if module is None else {id(q): n for n, q in module.named_parameters(remove_duplicate=False)}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        touch = self._touch()
        if touch is not None and not self._busy.depth:
            index = self._index
            if args and (id(args[0]) in index or isinstance(args[0], (list, tuple))) or kwargs and "out" in kwargs:
                written = written_by(func, args, kwargs or {})  # [Note: parameters written in forward]
                if written and any(w in index for w in written):
                    raise _written_in_forward(func, [w for w in written if w in index], self._params())
            lookup = _LOOKUPS.get(func)
            if lookup is not None:
                _check_lookup(func, lookup, args, kwargs or {}, index, self._params)
            for a in args:
                _scan(touch, index, a)
            if kwargs:
                for a in kwargs.values():
                    _scan(touch, index, a)
        if kwargs:
            return func(*args, **kwargs)
        return func(*args)


# F.embedding and F.embedding_bag: the positions of their max_norm and sparse arguments. Seen whole by the
# detector (a mode is off while it handles a call), so their in-place renorm of the weight is not seen by itself.
_LOOKUPS: dict[Any, tuple[int, int]] = {
    torch.nn.functional.embedding: (3, 6), torch.nn.functional.embedding_bag: (3, 7)}


def _check_lookup(func: Any, at: tuple[int, int], args: tuple, kwargs: dict, index: dict[int, int],
                  names: Callable[[], dict[int, str]]) -> None:
    """Refuse an embedding lookup of a parameter with ``max_norm`` ([Note: parameters written in forward]) or
    ``sparse=True`` (a sparse gradient: offload.AdamW, as torch.optim.AdamW, updates dense weights only)."""
    weight = args[1] if len(args) > 1 else kwargs.get("weight")
    if id(weight) not in index:
        return

    def arg(i: int, key: str) -> Any:
        return args[i] if len(args) > i else kwargs.get(key)

    if arg(at[0], "max_norm") is not None:
        raise _written_in_forward(torch.embedding_renorm_, [id(weight)], names())
    if arg(at[1], "sparse"):
        name = names().get(id(weight), "a parameter")
        raise OffloadError(
            f"{func.__name__}(..., sparse=True) of parameter {name} inside the forward of a model wrapped by "
            f"offload: it makes a sparse gradient, and offload.AdamW (as torch.optim.AdamW, which refuses them "
            f"too) updates dense fp32 weights. Construct the module with sparse=False (the default)")


def _written_in_forward(func: Any, written: list[int], names: dict[int, str]) -> OffloadError:
    """The error for an op of the forward that writes parameters in place: [Note: parameters written in forward]."""
    name = getattr(func, "__name__", "an op")
    which = ", ".join(names.get(w, "a parameter") for w in written)
    why = ""
    if name == "embedding_renorm_":
        why = (" (nn.Embedding or nn.EmbeddingBag with max_norm=..., or F.embedding(..., max_norm=...): it "
               "renormalizes the looked-up rows of the weight in place)")
    return OffloadError(
        f"{name}() writes parameter {which} in place inside the forward of a model wrapped by offload{why}. The "
        f"engine keeps the weights as fp32 masters in its own memory and updates them only in optimizer.step(), "
        f"so the write would be lost and training would silently differ from plain PyTorch. Remove the in-place "
        f"write from the forward (for max_norm: construct the module with max_norm=None, or rescale the "
        f"looked-up vectors out of place, e.g. e * (max_norm / e.norm(dim=-1, keepdim=True)).clamp(max=1)); to "
        f"set weights between steps use engine.load_state_dict(...)")


def _scan(touch: Callable[[int], None], index: dict[int, int], a: Any) -> None:
    """Report ``a`` (or the tensors in a list or tuple ``a``) if it is a parameter. A live non-tensor's id() is
    never a live parameter's (the runtime holds them), so the lookup needs no isinstance check first."""
    p = index.get(id(a))
    if p is not None:
        touch(p)
    elif isinstance(a, (list, tuple)):
        for t in a:
            p = index.get(id(t))
            if p is not None:
                touch(p)


class ParamAccess:
    """Forward uses of parameters, saved parameter views, and the buckets those pin on the device."""

    def __init__(self, ctx: RuntimeContext, slots: SlotTable, executor: PlanExecutor,
                 warmup: TracedWarmup) -> None:
        self.ctx = ctx
        self.slots = slots
        self.executor = executor
        self.warmup = warmup
        self._phases, self._busy = ctx.phases, ctx.busy  # read on every parameter use
        self.users: list[dict[int, None]] = []  # per active module call: what it touched (param or bucket ids)
        self.active: dict[int, int] = {}  # param (tracing) or bucket -> number of active calls using it
        self.node_buckets: set[int] = set()  # buckets the current backward node reads
        self.held: dict[int, set[int]] = {}  # recomputed call (region) -> buckets its weight views point into
        self.recompute_region: int | None = None  # the region being recomputed now
        # Weight copies handed to a graph built in backward (create_graph=True): (bytes, storage) while counted
        self.copies: list[tuple[int, StorageWeakRef]] = []

    def reset_step(self) -> None:
        self.sweep_copies()
        self.users = []
        self.active = {}
        self.node_buckets = set()
        self.held = {}
        self.recompute_region = None

    def pinned(self) -> Iterable[int]:
        """Buckets views in use point into: eviction must skip them."""
        return itertools.chain(self.active, self.node_buckets, *self.held.values())

    def detector(self) -> UseDetector:
        return UseDetector(self)

    # -- forward: uses ------------------------------------------------------------------------------------

    def on_touch(self, p: int) -> None:
        """A tensor op of the forward reads parameter ``p`` (called by the use detector). Only fetching or
        waiting runs tensor ops (and needs ``Busy``); a bucket already on the device is bookkeeping only."""
        if torch.is_grad_enabled():
            check_on_top()  # issue 19: [Note: a user's saved-tensor hooks] entered inside the forward
        executor = self.executor
        executor.recorder.touch(p)
        if executor.on_plan:  # a read its plan did not foresee: [Note: a departed step's updates wait]
            executor.check_use(p)
        if self._phases.lifecycle is Lifecycle.TRACING:
            with self._busy:
                self.warmup.fetch(p, executor.recorder, self.slots.boundary)
            key = p
        else:
            key = self.slots.bucket_of[p]
            if self.slots.state[key] is not Residency.DEVICE:
                with self._busy:
                    executor.need(key)
        users = self.users
        if users and key not in users[-1]:
            users[-1][key] = None
            self.active[key] = self.active.get(key, 0) + 1
        if self.recompute_region is not None:
            self.held.setdefault(self.recompute_region, set()).add(key)

    def call_begins(self) -> None:
        self.users.append({})

    def call_ends(self) -> None:
        for key in self.users.pop() if self.users else ():
            self._unuse(key)

    def _unuse(self, key: int) -> None:
        n = self.active[key] - 1
        if n:
            self.active[key] = n
            return
        del self.active[key]
        if self._phases.lifecycle is Lifecycle.TRACING:  # a parameter's copy lives only while a call uses it
            self.warmup.release(key)

    # -- saved tensors -------------------------------------------------------------------------------------

    def locate(self, t: torch.Tensor) -> ParamRef | None:
        """The parameter view ``t`` is (see [Note: saved parameters]); None for any other tensor."""
        if t.device != self.ctx.backend.device or t.layout != torch.strided:
            return None
        key = t.untyped_storage().data_ptr()
        byte = int(t.storage_offset()) * t.element_size()
        p = self.warmup.storage.get(key)
        if p is not None:
            return ParamRef(p, byte, tuple(t.shape), t.stride(), t.dtype)
        entry = self.slots.index.get(key)
        if entry is None:
            return None
        return self.slots.locate(entry, byte, t)

    def new_node(self) -> None:
        """A new autograd node runs: the buckets the previous one read may go."""
        self.node_buckets = set()
        if self.copies:
            self.sweep_copies()

    def graph_copy(self, view: torch.Tensor) -> torch.Tensor:
        """A copy of the weight view ``view`` for an autograd node unpacking it with grad enabled (a backward
        with ``create_graph=True``, ``torch.autograd.grad(..., create_graph=True)``): the graph that backward
        builds saves what the unpack returns, and a view would point into a slot that holds other weights by
        the time that graph's backward reads it. The copy is device memory the engine is responsible for: it
        is counted (``memory_stats()["device_parts"]["graph_copies"]``, and in the device peak) until the graph
        frees it, and off plan, where such a step runs, buckets cached on demand are evicted to make room for
        it as for a saved activation. A freed copy is noticed at the next autograd node, forward or copy
        (``sweep_copies``), so the count errs high, never low. Not planned: the plan's activation estimate
        leaves them out (issue 19; README, *Plain PyTorch calls*)."""
        copy = view.clone()
        self.sweep_copies()
        nbytes = copy.untyped_storage().nbytes()
        self.copies.append((nbytes, StorageWeakRef(copy.untyped_storage())))
        memory = self.ctx.memory
        memory.add("graph_copies", nbytes)
        if memory.on_activations is not None:
            memory.on_activations()  # off plan: evict cached buckets to make room, as for an activation
        return copy

    def sweep_copies(self) -> None:
        """Stop counting the weight copies (``graph_copy``) whose graph freed them."""
        if not self.copies:
            return
        live, freed = [], 0
        for nbytes, ref in self.copies:
            if ref.expired():
                freed += nbytes
            else:
                live.append((nbytes, ref))
        self.copies = live
        if freed:
            self.ctx.memory.add("graph_copies", -freed)

    def param_view(self, saved: ParamRef) -> torch.Tensor:
        """The weight view ``saved`` names, in its bucket's slot: the bucket is fetched first if it is not on
        the device, and kept while the autograd node running reads it (``node_buckets``)."""
        b = self.slots.bucket_of[saved.param]
        self.node_buckets.add(b)
        self.executor.need(b)
        return self.slots.view(saved)

    # -- recomputed calls (offload/runtime/recompute_hooks.py) ------------------------------------------------

    def begin_recompute(self, region: int) -> None:
        self.recompute_region = region

    def end_recompute(self) -> None:
        self.recompute_region = None

    def hold(self, region: int, b: int) -> None:
        self.held.setdefault(region, set()).add(b)

    def unhold(self, region: int) -> None:
        self.held.pop(region, None)
