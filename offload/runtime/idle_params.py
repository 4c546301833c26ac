"""A wrapped model's parameters between forwards (issue 19): reading one gives its real value; writing one,
or using it where autograd would need its gradient, raises an :class:`OffloadError` naming the way.

[Note: parameters between forwards] A bucket that is not on the device has its parameters pointing at
placeholders (one NaN expanded to the parameter's shape: no device memory, see ``Backend.placeholder``).
Inside a forward nothing reads them: the use detector and the plan land every bucket before its weights are
used. Outside one, ``p.norm()`` for logging, an EMA of weights or ``p.detach().cpu()`` read NaN. Nothing sees
such a read on a plain tensor (no hook fires, and a placeholder that refuses to be read crashes the process:
see the README's table), so the *parameter's class* changes instead, as FSDP2's parameters become DTensors:
while its bucket is not shown on the device, a wrapped ``nn.Parameter`` is an :class:`IdleParameter`, an
``nn.Parameter`` subclass whose ``__torch_function__`` sees every torch call on it. The slot table swaps the
class whenever it binds a parameter to a slot or to its placeholder (``show`` / ``bind_placeholder``, ~0.1 us
each), so a landed parameter is a plain ``nn.Parameter`` again and a forward pays nothing for any of this.
The engine's own code reads idle parameters as plain ones (``engine_code``, ``Runtime._grad_hook``): a training
step calls the handler not once (tested).

While no forward of its engine runs, a call on an idle parameter is handled so:

* its metadata and autograd attributes (``shape``, ``dtype``, ``device``, ``grad``, ``requires_grad``,
  ``is_leaf``, ``numel()``, ``data_ptr()``, hooks, setters such as ``p.grad = None``) are the parameter's own;
* a read of its values (``p.norm()``, ``p.detach()``, ``p.data``, ``p.cpu()``, ``print(p)``, ``p == q``, and
  ``ema.lerp_(p, 0.01)`` or ``torch.cat`` with it among the arguments) runs on a copy of its current weights
  made for that call: the bucket's host copy in the compute dtype (``HostState.source``), i.e. exactly what
  the parameter shows once its bucket lands, after the pending updates (``Runtime.wait_for_updates``), on the
  parameter's device. Each call makes its own copy, freed with the result (device memory outside the budget
  meanwhile: holding ``p.detach()`` of every parameter holds a device copy of the model, as plain PyTorch
  would). Where plain PyTorch would alias the parameter (``p.data``, ``p.detach()``, ``p[0]``, ``p.view()``) the
  result aliases that copy, so a write through it (``p.data.clamp_()``, WGAN-style clipping,
  ``p.detach().zero_()``) would change a copy nobody reads: such a result is a :class:`ParamCopy`, a tensor
  subclass that raises an :class:`OffloadError` naming the parameter on an in-place write, and hands the same
  class to its own views; any other result is a plain tensor. (Tried first: torch's flag that makes a tensor
  refuse writes, ``torch._C._set_throw_on_mutable_data_ptr``: it also refuses ``numpy()``, ``torch.save`` and
  every other reader of the data pointer, with a message about ``torch.compile``. Then a check of the copies'
  version counters at the next forward: the copy a write like ``p.data.clamp_()`` goes to is freed at once,
  so nothing is left to check.) A write through ``numpy()`` of such a result is not seen;
* a write to the parameter itself (an in-place method such as ``p.mul_()`` or ``p.copy_(x)``, ``torch.nn.init``,
  ``p[i] = x``, ``out=p``) raises, naming ``engine.load_state_dict``: the weights live in the engine's fp32 masters;
* with grad mode on, a call autograd would record for a parameter that requires grad (``loss + (p ** 2).sum()``
  after the forward) raises: its result would carry no gradient to the parameter (the copy is not part of the
  graph), so an L2 term computed outside the forward would silently do nothing. A comparison, ``print``,
  ``.item()``, ``.detach()``, ``.data`` and the like record nothing and read as above;
* a conversion that plain PyTorch answers with the parameter itself (``p.to(p.device)``, ``p.float()`` of an
  fp32 parameter, ``model.to(device)`` after wrapping) returns the parameter itself; one that converts
  (``p.cpu()`` from a GPU, ``p.to(torch.float64)``) converts the copy;
* under data parallel (``process_group=``) each rank reads its own device-dtype copy: no collective runs;
* with ``overlap_optimizer=True``, from the start of a backward to ``step()``, a read raises: the updates run
  during backward, while landed buckets still show the old weights.

This holds inside a backward too (a user's ``autograd.Function`` whose backward reads ``module.weight`` rather
than a saved tensor: before, NaN gradients). Inside a forward or a recompute the call passes through
untouched: the use detector, a mode, sees the op first and lands the bucket, so only the engine's own code
could meet an idle parameter there.
``module.state_dict()`` also passes (``saving`` is counted by its pre/post hooks): its post-hook replaces the
placeholders' detached values by the fp32 masters (plain_grads.py) without a device copy of every weight.
A parameter of a user's ``nn.Parameter`` subclass ``C`` becomes an ``IdleC`` (``idle_class``); one whose class
defines its own ``__torch_function__`` keeps its class, and reads its placeholder outside a forward (README).
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable, TypeVar

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import OffloadError
from .phases import Lifecycle, Pass

if TYPE_CHECKING:
    from .context import RuntimeContext
    from .core import Runtime

F = TypeVar("F", bound=Callable[..., Any])

# id(parameter) -> (its runtime, its index, its idle class), for every parameter that may become idle; filled at
# wrap and emptied at close. Keyed by id: a tensor's == is elementwise, so it cannot key a weak dictionary.
_OWNERS: dict[int, tuple[weakref.ref[Runtime], int, type]] = {}

_HOW_TO_WRITE = ("To change the weights of a wrapped model use engine.load_state_dict({\"model\": ..., "
                 "\"optimizer\": ...}) or engine.load(path); to change the model itself, engine.close() it, change "
                 "it and wrap it again")

# What registering a parametrization after wrap runs into (session 25: weight_norm, spectral_norm, orthogonal,
# register_parametrization, the old weight_norm hook); nn.Parameter(p) is what parametrizations.weight_norm calls.
_PARAMETRIZE = ("If this comes from a parametrization registered after offload.wrap (torch.nn.utils.parametrize, "
                "parametrizations.weight_norm / spectral_norm / orthogonal, torch.nn.utils.weight_norm): register "
                "it before wrapping, or engine.close() the engine, register it and wrap again.")
_PARAMETER_NEW = nn.Parameter.__new__.__code__

# Attributes (getters) that read values; every other getter and every setter reads or sets metadata.
_VALUE_ATTRIBUTES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})
# Methods about the parameter itself, not its values: run on it.
_METADATA = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset", "element_size",
    "is_contiguous", "is_floating_point", "is_complex", "is_signed", "is_inference", "get_device", "data_ptr",
    "untyped_storage", "storage", "_typed_storage", "requires_grad_", "retain_grad", "register_hook",
    "register_post_accumulate_grad_hook", "__hash__", "__len__", "_is_view", "is_pinned", "is_shared",
    "share_memory_", "dim_order", "__dir__", "__sizeof__", "has_names", "is_set_to", "__reduce_ex__",
    "__deepcopy__", "__setstate__", "__getstate__", "__class__", "_has_compatible_shallow_copy_type",
    "is_same_size", "is_tensor", "_is_functional_tensor", "is_conj", "is_neg", "_is_zerotensor",
    # new tensors of the parameter's shape, dtype and device, not of its values
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like", "new_zeros",
    "new_ones", "new_empty", "new_full", "new_tensor",
})
# In-place dunders: a write to their first argument.
_INPLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__", "__delitem__",
})
# Calls autograd does not record (or whose result does not require grad): allowed with grad mode on.
_PARAM_GRADS = (
    "{} with respect to parameter {} of a model wrapped by offload (torch.autograd.grad(loss, params), "
    "loss.backward(inputs=params)): the engine gathers parameters' gradients through its own hooks over a whole "
    "backward. Call loss.backward() and read or replace p.grad before optimizer.step() (wrap with "
    "overlap_optimizer=False to use p.grad); gradients with respect to inputs alone work")
_NOT_RECORDED = frozenset({
    "__repr__", "__str__", "__format__", "item", "tolist", "__bool__", "__int__", "__float__", "__index__",
    "__complex__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "eq", "ne", "lt", "le", "gt",
    "ge", "equal", "allclose", "isclose", "isnan", "isinf", "isfinite", "isposinf", "isneginf", "isreal",
    "argmax", "argmin", "argsort", "nonzero", "count_nonzero", "detach", "numpy", "__array__", "__contains__",
    "all", "any", "signbit", "logical_not", "logical_and", "logical_or", "logical_xor", "data",
})
# Passes in which an idle parameter's reads are handled. In a forward (and a recompute) the use detector lands
# every bucket an op reads before the op runs; a read that still meets an idle parameter is the engine's own.
_READABLE = frozenset({Pass.IDLE, Pass.BACKWARD})
# Conversions that return the tensor itself when they would not change it.
_CONVERSIONS = frozenset({"to", "cuda", "cpu", "float", "double", "half", "bfloat16"})
_DTYPE_OF = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}


class IdleParameter(nn.Parameter):
    """A wrapped model's ``nn.Parameter`` while its bucket is not on the device (see the module docstring,
    [Note: parameters between forwards]). ``isinstance(p, nn.Parameter)`` holds; ``type(p)`` is this class
    until the bucket lands. A parameter of a user's subclass ``C`` of ``nn.Parameter`` becomes an ``IdleC``,
    a subclass of both (so ``isinstance(p, C)`` holds too; see :func:`idle_class`)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            return _handle(func, args, kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        owner = _OWNERS.get(id(self))
        if owner is None or owner[0]() is None:
            return super().__reduce_ex__(protocol)
        raise OffloadError("pickling a parameter of a model wrapped by offload (e.g. torch.save(param)) is refused: "
                           "between forwards its weights live in the engine's host memory. Save "
                           "model.state_dict() (the fp32 weights) or use engine.save(path)")

    def __deepcopy__(self, memo: dict) -> Any:
        """A parameter of the class it had when wrapped, holding the current value (its own memory)."""
        with torch.no_grad():
            value = self.detach().clone()  # the read above: a copy of the current weights
        result = PLAIN_OF[type(self)](value, self.requires_grad)
        memo[id(self)] = result
        return result


# idle class -> the class it stands for (public: the slot table inlines show()), and back
PLAIN_OF: dict[type, type] = {IdleParameter: nn.Parameter}
_IDLE: dict[type, type] = {nn.Parameter: IdleParameter}


def idle_class(cls: type) -> type | None:
    """The idle class of parameters of class ``cls``: ``IdleParameter`` for ``nn.Parameter``, a subclass of
    ``IdleParameter`` and ``cls`` for a user's subclass of it; None where ``cls`` has its own
    ``__torch_function__`` (ours would hide it: such a parameter keeps its class and reads its placeholder)."""
    idle = _IDLE.get(cls)
    if idle is None and issubclass(cls, nn.Parameter) and cls.__torch_function__ is nn.Parameter.__torch_function__:
        idle = type(f"Idle{cls.__name__}", (IdleParameter, cls), {"__module__": __name__})
        _IDLE[cls], PLAIN_OF[idle] = idle, cls
    return idle


def adopt(rt: Runtime, params: Iterable[nn.Parameter]) -> None:
    """``params`` (the runtime's) may become idle from now on: those that have an :func:`idle_class`.
    Forgotten at close, or when the runtime is garbage collected without it."""
    ref = weakref.ref(rt)
    ids = []
    for p, param in enumerate(params):
        idle = idle_class(type(param))
        if idle is not None:
            _OWNERS[id(param)] = (ref, p, idle)
            ids.append(id(param))
    weakref.finalize(rt, _forget, ref, ids)


def _forget(ref: weakref.ref[Runtime], ids: list[int]) -> None:
    for i in ids:
        if i in _OWNERS and _OWNERS[i][0] is ref:
            del _OWNERS[i]


def disown(params: Iterable[nn.Parameter]) -> None:
    """The engine closed: every parameter has its own class again."""
    for param in params:
        show(param)
        _OWNERS.pop(id(param), None)


def bind_placeholder(ctx: RuntimeContext, p: int) -> None:
    """Point parameter ``p`` at its placeholder: it is idle from now on (if it has an idle class)."""
    param = ctx.params[p]
    show(param)  # bound already: the backend's bind reads it as a plain parameter
    ctx.backend.bind(param, ctx.placeholders[p])
    owner = _OWNERS.get(id(param))
    if owner is not None:
        param.__class__ = owner[2]


def engine_code(method: F) -> F:
    """Decorates an entry point of the engine's own code (``step()``, the end of backward): idle parameters
    read as plain ones there (their metadata at C speed, ~2 us less per access, and never a copy)."""
    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            return method(*args, **kwargs)
    return run  # type: ignore[return-value]


def show(param: torch.Tensor) -> None:
    """``param`` is about to point at real values (call before binding it)."""
    plain = PLAIN_OF.get(type(param))
    if plain is not None:
        param.__class__ = plain


# -- the handler ----------------------------------------------------------------------------------------------

def _name(func: Any) -> tuple[str | None, str]:
    """(``"get"``/``"set"``/``"delete"`` for an attribute's accessor, else None; the attribute's or function's name)."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        owner = getattr(func, "__self__", None)
        return name[2:-2], getattr(owner, "__name__", "")
    return None, name


def _idle(args: Any, kwargs: dict) -> list[tuple[torch.Tensor, Runtime, int]]:
    """The idle parameters among the arguments whose engine is between forwards or in a backward (``_READABLE``)
    and not saving a state dict."""
    found: list[tuple[torch.Tensor, Runtime, int]] = []
    for a in pytree.tree_leaves((args, kwargs)):
        if isinstance(a, IdleParameter):
            owner = _OWNERS.get(id(a))
            if owner is None:
                continue
            rt = owner[0]()
            if rt is None or rt.saving or rt.ctx.phases.current not in _READABLE:
                continue
            if rt.ctx.phases.lifecycle is Lifecycle.CLOSED:
                continue
            found.append((a, rt, owner[1]))
    return found


def _handle(func: Any, args: Any, kwargs: dict) -> Any:
    kind, name = _name(func)
    if (kind is not None and (kind != "get" or name not in _VALUE_ATTRIBUTES)) or name in _METADATA:
        return func(*args, **kwargs)
    idle = _idle(args, kwargs)
    if not idle:
        return func(*args, **kwargs)
    if name in _CONVERSIONS and args and isinstance(args[0], IdleParameter) and _unchanged(name, args, kwargs):
        return args[0]
    if name == "detach" and _in_parameter_new():  # nn.Parameter(p): it needs p's class back from detach()
        param, rt, p = idle[0]
        raise OffloadError(
            f"nn.Parameter() of parameter {rt.guard.names[p]} of a model wrapped by offload: its weights live in "
            f"the engine's memory, so a new parameter made from it would be neither offloaded nor trained by the "
            f"engine. {_PARAMETRIZE} {_HOW_TO_WRITE}")
    written = _written(name, args, kwargs)
    _refuse_copy_writes(func, kind, name, args, kwargs, written)  # ParamCopy's own check does not run here
    for param, rt, p in idle:
        if id(param) in written:
            raise OffloadError(
                f"{_called(func, kind, name)} writes parameter {rt.guard.names[p]} of a model wrapped by offload, "
                f"outside its forward: between forwards its weights live in the engine's host memory (fp32 "
                f"masters), so the write would not reach them. {_HOW_TO_WRITE}")
    if torch.is_grad_enabled() and name not in _NOT_RECORDED:
        for param, rt, p in idle:
            if param.requires_grad and name in ("grad", "backward"):  # session 25: autograd.grad(loss, params)
                raise OffloadError(_PARAM_GRADS.format(_called(func, kind, name), rt.guard.names[p]))
            if param.requires_grad:
                raise OffloadError(
                    f"{_called(func, kind, name)} on parameter {rt.guard.names[p]} of a model wrapped by offload, "
                    f"outside its forward, with grad mode on: between forwards its weights live in the engine's host "
                    f"memory, so the result could carry no gradient to the parameter (a term such as an L2 "
                    f"penalty added to the loss after the forward would silently do nothing). Compute it inside "
                    f"the model's forward (for weight decay, use the optimizer's weight_decay), or read the "
                    f"value under torch.no_grad() or from p.detach(). {_PARAMETRIZE}")
    for param, rt, p in idle:
        if not rt.grads.deferred and rt.grads.backward_seen:
            raise OffloadError(
                f"{_called(func, kind, name)} reads parameter {rt.guard.names[p]} of a model wrapped by offload "
                f"between backward() and step() with overlap_optimizer=True: each bucket's update runs as soon "
                f"as its grads are in, during backward, while the buckets kept on the device still show the "
                f"weights before it, so the model would read half old, half new. Read the weights after "
                f"optimizer.step(), or wrap with overlap_optimizer=False (updates at step(), as in plain PyTorch)")
    copies = {}
    with torch.no_grad():
        for param, rt, p in idle:
            if id(param) not in copies:
                copies[id(param)] = _copy_of(rt, p, param)
    if name in ("__repr__", "__str__", "__format__"):  # shows requires_grad=True, as the parameter's own repr
        for value in copies.values():
            value.requires_grad_(True)
    args, kwargs = pytree.tree_map_only(IdleParameter, lambda a: copies.get(id(a), a), (args, kwargs))
    out = func(*args, **kwargs)
    return _mark_aliases(out, {copies[id(param)].untyped_storage()._cdata: rt.guard.names[p]
                               for param, rt, p in idle})


def _in_parameter_new() -> bool:
    """Whether the call being handled comes from ``nn.Parameter.__new__`` (frames: this, ``_handle``,
    ``IdleParameter.__torch_function__``, its caller)."""
    try:
        return sys._getframe(3).f_code is _PARAMETER_NEW
    except ValueError:  # called with fewer Python frames above (from C++)
        return False


def _refuse_copy_writes(func: Any, kind: str | None, name: str, args: Any, kwargs: dict, written: set[int]) -> None:
    for a in pytree.tree_leaves((args, kwargs)):
        if type(a) is ParamCopy and id(a) in written:
            raise OffloadError(
                f"{_called(func, kind, name)} writes a copy of parameter {a._offload_param} that a read outside the "
                f"forward gave (p.data, p.detach() or a view of them): in plain PyTorch that writes the parameter, "
                f"but between forwards the weights live in the engine's host memory, so the write would be lost. "
                f"{_HOW_TO_WRITE}")


def _mark_aliases(out: Any, storages: dict[int, str]) -> Any:
    """``out`` with every tensor that aliases one of ``storages`` (a copy's) as a :class:`ParamCopy`."""
    def mark(t: torch.Tensor) -> torch.Tensor:
        if type(t) is ParamCopy or t.layout is not torch.strided or t.is_meta:  # one already (a method that
            return t  # returns its tensor itself, as requires_grad_(), keeps it)
        name = storages.get(t.untyped_storage()._cdata)
        if name is None:
            return t
        alias = t.as_subclass(ParamCopy)
        alias._offload_param = name
        return alias
    return pytree.tree_map_only(torch.Tensor, mark, out)


class ParamCopy(torch.Tensor):
    """What a read of an idle parameter gives where plain PyTorch would alias the parameter (``p.data``,
    ``p.detach()``, views): its values (a copy of the weights), refusing in-place writes, which in plain
    PyTorch would write the parameter ([Note: parameters between forwards]). Everything else is a plain
    tensor's; its views are ``ParamCopy`` again, other results plain tensors."""

    _offload_param: str

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, IdleParameter) for t in types):  # its handler first: it reads the parameter and
            return NotImplemented  # checks writes to copies too
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            kind, name = _name(func)
            if kind is None and name not in _METADATA:
                _refuse_copy_writes(func, kind, name, args, kwargs, _written(name, args, kwargs))
            out = func(*args, **kwargs)
            if kind == "set" or kind == "delete":
                return out
            storages = {a.untyped_storage()._cdata: a._offload_param
                        for a in pytree.tree_leaves((args, kwargs)) if type(a) is ParamCopy}
            return _mark_aliases(out, storages)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        with torch._C.DisableTorchFunctionSubclass():
            return repr(self.as_subclass(torch.Tensor))

    def __reduce_ex__(self, protocol: Any) -> Any:  # saved (torch.save, pickle) as the plain tensor it is
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


def _called(func: Any, kind: str | None, name: str) -> str:
    """How the user wrote the call, roughly: ``.T``, ``Tensor.norm()``, ``torch.cat()``."""
    if kind is not None:
        return f".{name}"
    qualname = getattr(func, "__qualname__", name).replace("TensorBase.", "Tensor.").replace(
        "_VariableFunctionsClass.", "torch.")
    return f"{qualname}()" if "." in qualname else f"torch.{name}()" if hasattr(torch, name) else f"{name}()"


def _written(name: str, args: Any, kwargs: dict) -> set[int]:
    """ids of the tensors the call writes in place: its first argument for an in-place method or dunder, and
    ``out=``."""
    targets: list[Any] = []
    if args and (name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))):
        targets.append(args[0])
    if "out" in kwargs:
        targets.append(kwargs["out"])
    return {id(t) for t in pytree.tree_leaves(targets) if isinstance(t, torch.Tensor)}


def written_by(func: Any, args: Any, kwargs: dict) -> set[int]:
    """ids of the tensors ``func(*args, **kwargs)`` writes in place (none for metadata calls such as
    ``requires_grad_`` and attribute setters): also used inside a forward ([Note: parameters written in forward]
    in param_access.py)."""
    kind, name = _name(func)
    if kind is not None or name in _METADATA:
        return set()
    return _written(name, args, kwargs)


def _unchanged(name: str, args: Any, kwargs: dict) -> bool:
    """Whether conversion ``name`` of ``args[0]`` returns the tensor itself in plain PyTorch (no copy)."""
    param = args[0]
    fmt = kwargs.get("memory_format")
    if (fmt is not None and fmt is not torch.preserve_format) or kwargs.get("copy"):
        return False
    if any(a is True for a in args[1:]):  # a positional non_blocking or copy: a copy is fine either way
        return False
    if name == "to":
        rest = {k: v for k, v in kwargs.items() if k != "copy"}
        try:
            device, dtype, _, fmt = torch._C._nn._parse_to(*args[1:], **rest)
        except (TypeError, RuntimeError):  # a form this parse does not know: converting the copy is right too
            return False
        if fmt is not None and fmt is not torch.preserve_format:
            return False
        return (dtype is None or dtype == param.dtype) and (device is None or _same_device(device, param.device))
    if name == "cpu":
        return param.device.type == "cpu"
    if name == "cuda":
        want = args[1] if len(args) > 1 else kwargs.get("device")
        if want is None:
            return param.device.type == "cuda"
        return _same_device(torch.device("cuda", want) if isinstance(want, int) else torch.device(want), param.device)
    return _DTYPE_OF[name] == param.dtype


def _same_device(want: torch.device, have: torch.device) -> bool:
    """``want`` names ``have`` (an index left out names the current device, which is the engine's)."""
    return want.type == have.type and (want.index is None or have.index is None or want.index == have.index)


def _copy_of(rt: Runtime, p: int, param: torch.Tensor) -> torch.Tensor:
    """A copy of parameter ``p``'s current value as its bucket shows it on the device."""
    rt.wait_for_updates()  # the host copy is final: nothing on a device stream writes it any more
    # On the caller's current stream, not the engine's: the caller frees the copy, and the caching allocator
    # would hand a block allocated on another stream back to that stream while the caller's reads may still run.
    return rt.weights.shown_value(p).to(device=param.device, dtype=param.dtype, copy=True)
