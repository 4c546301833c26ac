"""Plain PyTorch code on a wrapped model: ``p.grad`` after backward (``model.state_dict()`` and
``model.load_state_dict()`` during training: module_state.py). Each works as in plain PyTorch or raises a clear
error; none silently does nothing (issue 19).

[Note: gradients in p.grad] Gradients never stay on the device: each bucket's go to the host as soon as
they are final (offload/runtime/grads.py), where, with ``overlap_optimizer=False``, they are summed in a flat
fp32 buffer per bucket until ``step()`` (``HostState.grad``). After each backward the runtime *exposes*
them: every parameter that got a gradient gets ``param.grad = ExposedGrad(...)``, a tensor subclass
(``_make_wrapper_subclass``, as FSDP2's DTensor grads) whose metadata are what autograd and torch expect of
that parameter's grad (its shape, and the parameter's dtype and device: the compute dtype, on the device)
and whose data is the parameter's slice of the host fp32 sum. Every op on it runs on that host data:

* before the first op, the copies and CPU-lane additions that produce the sums are waited for, and the
  factors the engine would apply at ``step()`` are applied to the sums (``Exposure.materialize``): the
  inverse float16 loss scale and any ``engine.clip_grad_norm_`` coefficient. So ``p.grad`` holds the
  gradient the update will use: unscaled, as after ``GradScaler.unscale_`` in plain PyTorch (the point
  where a torch loop clips), and clipped if the engine clipped;
* in-place ops (``mul_``, ``clamp_``, ``copy_``, ``torch.nn.utils.clip_grad_norm_`` and
  ``clip_grad_value_``) write the host sum the update reads; the engine's cached norms of written
  parameters are recomputed before the engine next uses them;
* views (``view``, ``detach``, indexing) are ``ExposedGrad`` again, over the same host bytes;
* anything else comes back as a plain tensor on the parameter's device, with the dtype torch would give
  for the parameter's dtype (computed from the fp32 data, then rounded: with bf16 compute, ``p.grad.norm()``
  is a bf16 number, as with bf16 grads in plain PyTorch; in fp32 every result is bit for bit torch's).

Before the engine itself uses the sums again (``step()``, ``engine.clip_grad_norm_``, the next forward, whose
backward adds to them), the loss scale is put back (``Exposure.to_engine_form``): loss scales are powers of
two, so both multiplications are exact. A user's ``p.grad = None`` drops that parameter's gradient (as
torch's optimizers skip a parameter without one: no update, no weight decay, no step count); ``p.grad = t``
puts ``t``'s values into the sum. Both are picked up at ``step()``, ``engine.clip_grad_norm_`` and when the
next backward begins. Exposed grads are taken away (``param.grad = None``) at ``step()``, at ``zero_grad()``
and when the backward of the next forward with grad enabled reaches that forward's outputs: a hook on each
output tensor that requires grad (FSDP2's pre-backward hook) fires before autograd accumulates into any
parameter of the module, so AccumulateGrad never adds into an exposed grad, while a forward with no backward
after it (a validation loss computed with grad enabled) leaves ``p.grad`` as it was, as in plain PyTorch. The
hook acts once per forward: a second backward of a graph kept with ``retain_graph=True`` meets the grads the
first exposed and raises (its grads would otherwise be lost); after a ``step()`` (nothing exposed) the grad
pipeline raises instead, when it meets a bucket whose grads this forward's backward already sent (grads.py). An exposed grad still held by the user after it
was taken away raises when used.

With ``overlap_optimizer=True`` the grads were consumed during backward (each bucket's AdamW ran as soon as
its grads were in): ``p.grad`` is then an ``ExposedGrad`` without data, so ``p.grad is None`` is False (code
that checks it goes on) but any op on it raises an :class:`OffloadError` naming the supported way, before
any silent result (``torch.nn.utils.clip_grad_norm_`` raises instead of returning 0).

[Note: grads left for the exposure] (issue 17, the hot path) Where a fast step's whole buckets are sent at the
end of backward ([Note: sent after backward] in fast_path.py), the one routine (bucket_send.py) leaves each grad
it copied in ``p.grad`` instead of setting it to None: the exposure that follows in the same end of backward
(``GradPipeline.backward_done``) gives every one of those parameters its ``ExposedGrad``, which replaces (and
frees) the grad. Nothing runs between the two that reads ``p.grad`` (no user code, no hook: the backward is
over), and a fault between them goes through ``GradPipeline.abort``, which sets every ``p.grad`` to None. Only
there: a bucket sent during backward (a departure's, CUDA's, lanes mode's) still sets its grads to None at
once, as a later hook of the same backward could see them. It saves 200 writes of ``p.grad`` a step of the
200-module MLP (the grads are freed in ``expose`` instead); beside the same engine without it, in one process, no
difference was measurable on our CPU (benchmarks/results/cpu-2026-11-26/overhead-profile.md, section 15).

[Note: exposed at C speed] (issue 17, the hot path) With overlapped updates every step exposes a data-less grad
for every parameter and ``step()`` takes them back: two writes of each ``p.grad`` that plain torch does not make
(it writes each once, in ``zero_grad``). Where every parameter's spare is there, in the order of the pending
parameters ([Note: reusing a data-less grad]), ``expose`` sets them all with one ``map`` of torch's grad setter
and the spares' dict becomes ``exposed`` as it is; ``_take_back_consumed`` sets them to None with one ``map`` and
keeps the unheld ones as spares in that order again. A data-less grad has no epoch to renew: it is current while
``exposed`` holds it for its parameter (taking back empties ``exposed``, so one taken back, or held by the user
and replaced by a new one, is stale and says so); a grad with data, and its views, keep their epoch. Measured
on the 200-module MLP, one engine with the old and new code swapped per block (benchmarks/results/cpu-2026-11-26/
overhead-profile.md, section 18): ``expose`` 224 -> 154 us a step. What is left is mostly torch's setter on
metadata the batch's AdamW pass has just evicted, and the grads autograd left there, which it frees (plain
torch frees them in ``zero_grad``).
"""

from __future__ import annotations

import operator
import sys
import weakref
from collections import deque
from itertools import compress, repeat
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
from torch.utils import _pytree as pytree

from ..errors import InvariantError, OffloadError

if TYPE_CHECKING:
    from .context import RuntimeContext
    from .grads import GradPipeline

_UNHELD = 2  # sys.getrefcount of an object referenced by one local name only (the call adds one)
_GRAD = operator.attrgetter("grad")
# runs an iterator (a ``map`` of setters) to its end at C speed ([Note: exposed at C speed])
_drain: Callable[[Iterable[Any]], None] = deque(maxlen=0).extend
_HOW_TO_READ_GRADS = ("To read, clip or scale gradients in p.grad (torch.nn.utils.clip_grad_norm_, "
                      "clip_grad_value_, p.grad.norm()), wrap with overlap_optimizer=False: gradients then stay "
                      "readable in p.grad until step(); engine.clip_grad_norm_(max_norm) needs it too")


# issue 20, [Note: no_sync] in offload/runtime/distributed.py: inside no_sync() p.grad is this rank's own sum;
# a norm of it would differ per rank (and clip each rank by another factor): refused, never silently local
_NORMS = frozenset({"linalg_vector_norm", "norm", "_foreach_norm", "linalg_norm", "frobenius_norm"})
_LOCAL_NORM = ("a norm of p.grad ({}) inside engine.no_sync() (model.no_sync()): there p.grad holds this rank's own "
               "gradient sum, not the average over the ranks that the update uses, so its norm would differ per rank "
               "and torch.nn.utils.clip_grad_norm_ would clip each rank by another factor. Clip after the last "
               "micro-batch's backward, outside no_sync() (p.grad is then the average over the ranks, as with DDP), "
               "or call engine.clip_grad_norm_(max_norm) before step() (collective, over every rank)")


class ExposedGrad(torch.Tensor):
    """``param.grad`` of a wrapped model's parameter between backward and ``step()``: see [Note: gradients
    in p.grad]. Shape, dtype and device are the parameter's; the data is a view of the host fp32 gradient
    sum (None with overlapped updates, where every op raises)."""

    _exposure: weakref.ref
    _p: int
    _data: torch.Tensor | None
    _epoch: int

    @staticmethod
    def __new__(cls, exposure: "Exposure", p: int, data: torch.Tensor | None, like: torch.Tensor,
                shape=None, strides=None):
        shape = like.shape if shape is None else shape
        if strides is None:
            strides = data.stride() if data is not None else torch.empty(shape, device="meta").stride()
        g = torch.Tensor._make_wrapper_subclass(cls, shape, strides, dtype=like.dtype, device=like.device,
                                                requires_grad=False)
        g._exposure = weakref.ref(exposure)  # weak: param.grad is held on the C++ side, out of gc's sight
        g._p, g._data, g._epoch = p, data, exposure.epoch
        return g

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    # ``p.grad.data = t`` (torch.nn.utils.vector_to_parameters on grads, old code that rescales grads): torch's
    # setter rebinds the tensor's storage, which for this wrapper never reaches the host sum the update reads, so
    # the assignment was dropped silently (session 25). The values go into the sum instead, as ``copy_`` does;
    # the getter stays torch's. (Torch's grad would alias ``t`` afterwards; here later writes to ``t`` are not seen.)
    @property
    def data(self) -> torch.Tensor:
        return torch._C.TensorBase.data.__get__(self)  # type: ignore[attr-defined]

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if isinstance(value, torch.Tensor) and (value.dtype, value.device) != (self.dtype, self.device):
            exposure = self._exposure()
            param = exposure.ctx.params[self._p] if exposure is not None else None
            if param is not None and (param.dtype, param.device) != (self.dtype, self.device):
                return  # nn.Module._apply converting the model (model.half()): refused and undone, grads included
        if not isinstance(value, torch.Tensor) or (value.shape, value.dtype, value.device) != (
                self.shape, self.dtype, self.device):
            got = (f"{tuple(value.shape)} {value.dtype} on {value.device}" if isinstance(value, torch.Tensor)
                   else type(value).__name__)
            raise OffloadError(f"p.grad.data = t with t {got} for a gradient {tuple(self.shape)} {self.dtype} on "
                               f"{self.device}: a wrapped model's p.grad holds the host's gradient sum of its "
                               "parameter, so only its values can change (p.grad.data = t of the same shape, dtype "
                               "and device, p.grad.copy_(t) or p.grad = t)")
        with torch.no_grad():
            torch.Tensor.copy_(self, value)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        if self._data is None:  # a repr never raises (debuggers and error messages call it)
            return (f"ExposedGrad(consumed: overlap_optimizer=True applied the update during backward; "
                    f"shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})")
        return f"{torch.Tensor.clone(self)!r} (offload: the host's fp32 gradient sum)"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        exposed = [a for a in leaves if isinstance(a, ExposedGrad)]
        exposure_of = {id(g): g._usable(func) for g in exposed}
        owners = {id(e): e for e in exposure_of.values()}
        for owner in owners.values():
            owner.materialize()
        host = exposed[0]._host_data().device
        moved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the caller's tensor, its copy on the host)

        def unwrap(a):
            if isinstance(a, ExposedGrad):
                return a._data
            if isinstance(a, torch.Tensor) and a.device != host:
                m = a.to(host)
                moved.append((a, m))
                return m
            return a

        uargs, ukwargs = pytree.tree_map(unwrap, (args, kwargs))
        out = func(*uargs, **ukwargs)
        for t in _written(func, uargs, ukwargs):
            for g in exposed:
                if t is g._data:
                    exposure_of[id(g)].written(g._p)
            for orig, m in moved:
                if t is m:
                    orig.copy_(m)  # an in-place op on a tensor of the device: write its result back
        back = {id(g._data): g for g in exposed} | {id(m): orig for orig, m in moved}
        # What a view of the host sums is a view of: ``self`` for view ops (the arena is one storage, so its
        # pointer alone cannot say which parameter's gradient a view shows).
        base = args[0] if args and isinstance(args[0], ExposedGrad) else exposed[0]
        arena = base._host_data().untyped_storage().data_ptr()
        dtypes = _result_dtypes(func, args, kwargs) if any(g.dtype != g._host_data().dtype for g in exposed) else None
        device = kwargs.get("device") if func is torch.ops.aten._to_copy.default else None
        device = device if device is not None else exposed[0].device
        leaves_out, spec = pytree.tree_flatten(out)
        result = []
        for i, t in enumerate(leaves_out):
            if not isinstance(t, torch.Tensor):
                result.append(t)
            elif id(t) in back:  # an in-place op returns its argument
                result.append(back[id(t)])
            elif t.untyped_storage().data_ptr() == arena:  # a view of the host gradient
                result.append(ExposedGrad(exposure_of[id(base)], base._p, t, base, shape=t.shape, strides=t.stride()))
            else:
                dtype = dtypes[i] if dtypes is not None and i < len(dtypes) and dtypes[i] is not None else t.dtype
                result.append(t.to(device=device, dtype=dtype))
        return pytree.tree_unflatten(result, spec)

    def _usable(self, func) -> "Exposure":
        """The exposure this grad belongs to, if it may be used now; else a clear error."""
        exposure = self._exposure()
        if exposure is None or exposure.closed:
            raise OffloadError("this gradient belonged to an offload engine that is closed; its gradients are gone")
        # A data-less grad is current while it is the one exposed for its parameter (given again as it is, it
        # keeps no epoch: [Note: exposed at C speed]); one with data, or a view of it, by its epoch
        if (exposure.exposed.get(self._p) is not self) if self._data is None else exposure.epoch != self._epoch:
            raise OffloadError("this gradient is no longer current: step(), zero_grad() or the next forward took "
                               "it back (the engine sums gradients on the host). Read p.grad again after the "
                               "next backward")
        if self._data is None:
            raise OffloadError(f"p.grad of a model wrapped with overlap_optimizer=True cannot be used ({func}): "
                               "each bucket's AdamW update ran during backward and consumed its gradients, so a "
                               "result computed from p.grad would silently not affect the update. "
                               f"{_HOW_TO_READ_GRADS}.")
        if exposure.ctx.phases.in_backward or torch._C._current_autograd_node() is not None:
            raise OffloadError("a backward reached a gradient exposed in p.grad by the previous backward without a "
                               "forward in between (e.g. loss.backward(retain_graph=True), then loss.backward() "
                               "again): the engine cannot add into it. Run a forward before each backward (the "
                               "engine gathers one backward's gradients per forward), or add the losses and call "
                               "backward once")
        if exposure.local and func.overloadpacket.__name__ in _NORMS:
            raise OffloadError(_LOCAL_NORM.format(func))
        if exposure.graph_asked and torch.is_grad_enabled():
            raise OffloadError(f"p.grad after backward(create_graph=True) used with grad mode on ({func}): torch's "
                               "p.grad would carry the graph of the gradient (for a penalty on it), but a wrapped "
                               "model's p.grad is the host's sum of its values, so a term computed from it would "
                               "silently get no gradient. Gradients of a gradient with respect to the inputs work "
                               "(torch.autograd.grad(out, x, create_graph=True)); to read p.grad, use "
                               "torch.no_grad() or backward() without create_graph")
        return exposure

    def _host_data(self) -> torch.Tensor:
        """The host data of a grad :meth:`_usable` accepted."""
        if self._data is None:
            raise InvariantError("an exposed gradient without host data was used: a bug in offload, please report it")
        return self._data


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors ``func`` writes in place (its schema's ``Tensor(a!)`` arguments)."""
    out: list[torch.Tensor] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            out.extend(t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))
    return out


def _result_dtypes(func, args, kwargs) -> list[torch.dtype | None] | None:
    """The dtypes ``func`` gives for the grads' nominal dtypes (run on the meta device), per output leaf."""
    def meta(a):
        if isinstance(a, ExposedGrad):
            return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
        if isinstance(a, torch.Tensor):
            return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
        return a
    try:
        margs, mkwargs = pytree.tree_map(meta, (args, kwargs))
        if func is torch.ops.aten._to_copy.default:
            mkwargs = {k: v for k, v in mkwargs.items() if k != "device"}
        out = func(*margs, **mkwargs)
    except (NotImplementedError, RuntimeError, TypeError):
        return None  # no meta kernel (e.g. .item()): the result keeps the dtype computed
    return [t.dtype if isinstance(t, torch.Tensor) else None for t in pytree.tree_leaves(out)]


class Exposure:
    """The grad pipeline's side of [Note: gradients in p.grad]: which parameters' ``grad`` it set, and the
    state of the host sums they show. Owned by :class:`offload.runtime.grads.GradPipeline` (``grads.exposure``),
    which owns the sums, their norms and the clip factor: it changes them only through ``grads.sums``
    (grad_sums.py). The pipeline calls :meth:`expose` at the end of backward, :meth:`drop` when gathered grads
    are cleared and :meth:`zero_grad`; the runtime calls :meth:`before_backward_of`, :meth:`before_step`,
    :meth:`to_engine_form` (before ``engine.clip_grad_norm_``) and :meth:`close`."""

    def __init__(self, ctx: RuntimeContext, grads: GradPipeline) -> None:
        self.ctx = ctx
        self.grads = grads
        self.epoch = 0  # bumped whenever exposed grads are taken back: older ExposedGrads refuse to work
        self.exposed: dict[int, ExposedGrad] = {}  # param -> the grad given to it
        self.materialized_scale: float | None = None  # the loss scale divided out of the sums, while it is
        self.final = False  # the sums were waited for since the last expose
        self.dirty: set[int] = set()  # params whose sum changed since the engine computed its norm
        self.closed = False
        self.graph_asked = False  # the latest exposure came from a backward(create_graph=True) (see expose)
        self.local = False  # issue 20: inside no_sync() the sums are this rank's own (their norms raise)
        self._stride_cache: dict[int, tuple[torch.Size, tuple[int, ...]]] = {}  # param -> (shape, its strides)
        # param -> a data-less grad taken back that nobody else held: given to it again ([Note: reusing a
        # data-less grad])
        self._spare: dict[int, ExposedGrad] = {}
        self._owners: tuple[list[int], list[torch.nn.Parameter]] = ([], [])  # pending params -> their parameters

    # -- the runtime's calls ------------------------------------------------------------------------------

    def expose(self) -> None:
        """End of backward: every parameter that has a gathered gradient gets it in ``param.grad`` (replacing
        what the grad pipeline left there: [Note: grads left for the exposure])."""
        grads = self.grads
        self.final = False
        # backward(create_graph=True) runs with grad mode on: torch's p.grad would then carry a graph, which the
        # sums here cannot ([Note: gradients in p.grad], session 25)
        self.graph_asked = torch.is_grad_enabled()
        params, exposed = self.ctx.params, self.exposed
        if grads.deferred:
            for p in grads.sums.pending_params():
                param = params[p]
                g = ExposedGrad(self, p, grads.sums.grad_sum(p).view(param.shape), param)
                param.grad = g
                exposed[p] = g
            return
        spare = self._spare
        ps = grads.sums.pending_params()
        if not exposed and len(spare) == len(ps) and list(spare) == ps:
            # [Note: exposed at C speed] every parameter has its spare, in this order (every step after the first
            # of a run of overlapped steps): the spares' dict becomes ``exposed`` as it is and the grads are set
            # by ``map``, no Python loop, no dict built (~70 us of a step of the 200-module MLP less; issue 17,
            # the hot path). torch's grad setter checks each grad before setting it; one refused (a spare of
            # another shape) stops the map, and the loop below sets them all
            cached = self._owners
            if cached[0] != ps:
                cached = self._owners = (ps, list(map(params.__getitem__, ps)))
            given = list(spare.values())
            try:
                _drain(map(setattr, cached[1], repeat("grad"), given))
            except RuntimeError:
                pass
            else:
                self.exposed, self._spare = spare, {}
                return
        for p in ps:
            param = params[p]
            again: ExposedGrad | None = spare.pop(p, None)
            if again is not None:
                try:
                    # torch's grad setter checks that a grad has its parameter's shape, dtype and device
                    # before it sets anything: a spare made for another shape is refused there (a parameter's
                    # shape read and compared here cost a third of this loop; issue 17, the hot path)
                    param.grad = again
                except RuntimeError:
                    again = None
            if again is None:
                again = ExposedGrad(self, p, None, param, strides=self._strides(p, param.shape))
                param.grad = again
            exposed[p] = again

    def _strides(self, p: int, shape: torch.Size) -> tuple[int, ...]:
        """The contiguous strides of ``shape``, a data-less grad's (cached per parameter: the meta tensor that
        computes them cost most of an expose)."""
        hit = self._stride_cache.get(p)
        if hit is None or hit[0] != shape:
            hit = self._stride_cache[p] = (shape, torch.empty(shape, device="meta").stride())
        return hit[1]

    def before_backward_of(self, output: object) -> None:
        """A forward with grad enabled ended while grads are exposed: when its backward reaches its outputs
        (before autograd adds into any parameter's grad), take them back; the user's edits of p.grad go into
        the sums first. Once per forward (see [Note: gradients in p.grad])."""
        if not self.exposed:
            return
        me = weakref.ref(self)  # the graph may outlive the engine
        pending = [True]  # shared by this forward's output hooks: the first to fire acts

        def hook(grad: torch.Tensor) -> None:
            exposure = me()
            if pending[0] and exposure is not None:
                pending[0] = False
                exposure.sync()
                exposure.take_back()

        hooked = False
        for t in pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(hook)
                hooked = True
        if not hooked:  # outputs pytree cannot see into (an unregistered class): take them back now, as a
            self.sync()  # backward of this forward must not meet them
            self.take_back()

    def before_step(self) -> None:
        """``step()``: the user's changes to p.grad are in, the sums are back in the engine's form."""
        if self.grads.deferred:
            self.sync()
            self.take_back()
        else:
            self._take_back_consumed()

    def _take_back_consumed(self) -> None:
        """:meth:`sync` then :meth:`take_back` with overlapped updates, in one pass over the exposed grads:
        each ``param.grad`` is read once, then set to None (issue 17, the hot path: the two passes cost ~0.1 ms a
        step of a 200-parameter model on our CPU). Nothing can be honoured there, so a grad dropped or replaced
        since :meth:`expose` raises after every grad was taken back, as :meth:`sync` raises after its
        ``take_back``; the grads no one else holds are kept to be given again, as :meth:`_retire` keeps them."""
        self._unmaterialize()
        exposed, self.exposed = self.exposed, {}
        ps = list(exposed)
        gs = list(exposed.values())
        del exposed
        cached = self._owners  # [Note: exposed at C speed]: the parameters of these pending ones, if expose cached them
        owners = cached[1] if cached[0] == ps else list(map(self.ctx.params.__getitem__, ps))
        now = list(map(_GRAD, owners))
        changed = not all(map(operator.is_, now, gs))
        dropped = [p for p, t, g in zip(ps, now, gs) if t is None] if changed else []
        replaced = [p for p, t, g in zip(ps, now, gs) if t is not None and t is not g] if changed else []
        del now
        _drain(map(setattr, owners, repeat("grad"), repeat(None)))  # [Note: exposed at C speed]
        # a grad that only ``gs`` holds now is one sys.getrefcount sees as _UNHELD (the list, the call's
        # argument), as _retire sees one only its local name holds: kept to be given again. Every grad here is
        # data-less (overlapped updates: ``expose`` gives no other)
        held = list(map(sys.getrefcount, gs))
        self._spare.update(compress(zip(ps, gs), map(operator.le, held, repeat(_UNHELD))))
        del gs
        self.epoch += 1
        if dropped or replaced:  # named in the order they were exposed, the dropped first (as sync names them)
            names = _names(self.ctx, dropped + replaced)
            raise OffloadError(f"p.grad was set to None or replaced ({', '.join(names)}) between backward and "
                               "step(), but this engine applied each bucket's AdamW update during backward "
                               "(overlap_optimizer=True), so the change cannot be honoured. Wrap with "
                               "overlap_optimizer=False to drop or change gradients before step()")

    def to_engine_form(self) -> None:
        """Before ``engine.clip_grad_norm_``: user changes in, loss scale back in, norms fresh; p.grad stays."""
        self.sync()
        self._unmaterialize()

    def zero_grad(self, set_to_none: bool) -> bool:
        """``zero_grad()`` between backward and step: True if handled here (zeroed in place), False if the
        pipeline is to drop the gathered grads (p.grad is None then)."""
        grads = self.grads
        if not grads.deferred and grads.awaiting_step:
            raise OffloadError("zero_grad() was called between backward and step(), but this engine applied each "
                               "bucket's AdamW update during backward (overlap_optimizer=True): the gradients it "
                               "would drop were already used. Call zero_grad() after step() (or before the "
                               "forward), or wrap with overlap_optimizer=False to drop gradients before step()")
        if set_to_none or not (grads.deferred and grads.pending):
            self.drop()
            return False
        self._zero_in_place()
        return True

    def _zero_in_place(self) -> None:
        """``set_to_none=False`` (torch zeroes each grad in place): the sums become zeros, still gathered, so a
        ``step()`` now updates with zero gradients (weight decay and Adam's momentum), and the next backward
        adds to zeros; p.grad shows the zeros."""
        self.sync()
        self.grads.sums.wait_gathered()
        self.final = True
        self.grads.sums.zero_sums()
        self.materialized_scale = None
        self.dirty = set()

    def drop(self) -> None:
        """The gathered grads are dropped (``zero_grad()``, a failed backward): take exposed grads back."""
        self._retire()
        self.materialized_scale = None
        self.dirty = set()
        self.final = False
        self.epoch += 1

    def close(self) -> None:
        self.drop()
        self._spare = {}
        self.closed = True

    # -- what ops on exposed grads call --------------------------------------------------------------------

    def materialize(self) -> None:
        """Make the host sums final (their copies and additions done) and what the update will use: the
        loss scale divided out and the engine's clipping coefficient applied."""
        grads = self.grads
        if not self.final:
            grads.sums.wait_gathered()  # the D2H copy, or the CPU lane's widening / accumulation, of each bucket
            self.final = True
        factor = grads.sums.take_clip_factor()
        scale = grads.step_scale if self.materialized_scale is None else None
        if scale is not None and scale != 1.0:
            factor /= scale
        if factor != 1.0:
            grads.sums.scale_sums(factor)
            self.dirty |= set(grads.sums.pending_params())
        if scale is not None and scale != 1.0:
            self.materialized_scale = scale

    def written(self, p: int) -> None:
        self.dirty.add(p)

    # -- internals -------------------------------------------------------------------------------------------

    def sync(self) -> None:
        """Honour what the user did to ``param.grad`` since :meth:`expose`: None drops that parameter's
        gradient; another tensor replaces it."""
        grads = self.grads
        dropped, replaced = [], []
        for p, g in self.exposed.items():
            now = self.ctx.params[p].grad
            if now is None:
                dropped.append(p)
            elif now is not g:
                replaced.append((p, now))
        if not (dropped or replaced):
            return
        if not grads.deferred:
            names = _names(self.ctx, dropped + [p for p, _ in replaced])
            self.take_back()  # raised once: a retried step() goes on (the updates already ran)
            raise OffloadError(f"p.grad was set to None or replaced ({', '.join(names)}) between backward and "
                               "step(), but this engine applied each bucket's AdamW update during backward "
                               "(overlap_optimizer=True), so the change cannot be honoured. Wrap with "
                               "overlap_optimizer=False to drop or change gradients before step()")
        self.materialize()
        with torch.no_grad():
            for p, t in replaced:
                src = t.detach()
                if isinstance(src, ExposedGrad):
                    src._usable("p.grad = ...")
                    src = src._host_data()
                grads.sums.grad_sum(p).copy_(src.reshape(-1))
                self.dirty.add(p)
        for p in dropped:
            grads.sums.drop_param(p)
            self.dirty.discard(p)
            del self.exposed[p]

    def take_back(self) -> None:
        """Set every exposed grad to None (autograd must not add into one) and put the sums back in the
        engine's form."""
        self._unmaterialize()
        self._retire()
        self.epoch += 1

    def _retire(self) -> None:
        """Every exposed grad out of ``param.grad`` (the caller makes them stale: ``epoch``); a data-less one
        that nobody else holds is kept to be given again.

        [Note: reusing a data-less grad] With overlapped updates every parameter gets a data-less
        ``ExposedGrad`` after each backward; making one and freeing it cost ~10 us, about 2 ms per step of a
        200-parameter model (issue 17, the hot path). One that no one but this loop references once
        ``param.grad`` let go of it (``sys.getrefcount``: the local name and the call's argument) cannot be
        observed by anyone: giving it again at the next ``expose`` is the same as giving a new one (a data-less
        grad is current while it is the one exposed for its parameter: [Note: exposed at C speed]). One the user
        still holds (a name, a list, a closure) is left to go stale, and raises "no longer current" if used, as
        before. Grads with data (``overlap_optimizer=False``) are made anew: each
        shows this step's sums."""
        params, spare = self.ctx.params, self._spare
        exposed, self.exposed = self.exposed, {}
        while exposed:
            p, g = exposed.popitem()
            params[p].grad = None
            if g._data is None and sys.getrefcount(g) <= _UNHELD:
                spare[p] = g
            del g

    def _unmaterialize(self) -> None:
        """Multiply the loss scale back into the sums (exact: a power of two), refresh the norms of changed
        sums (the engine's clip_grad_norm_ and float16 overflow check read them)."""
        if self.materialized_scale is not None:
            self.grads.sums.scale_sums(self.materialized_scale)
            self.materialized_scale = None
        if self.dirty:
            self.grads.sums.refresh_norms(self.dirty)
            self.dirty = set()


def _names(ctx: RuntimeContext, params: list[int], most: int = 4) -> list[str]:
    """The names of (the first ``most`` of) ``params`` in the wrapped module (for error messages)."""
    name = {ctx.param_index.get(id(param)): n for n, param in ctx.module.named_parameters()}
    return [name.get(p, f"parameter {p}") for p in params[:most]]
