"""Trace one training step of a model on the ``meta`` device (no memory, no weights): the same events the
runtime records in its warm-up step, activation bytes from the saved tensors, and a compute time per event
*estimated* from a roofline: each operator takes ``max(FLOPs / device FLOP/s, bytes / device bytes/s)``
with the hardware model's (assumed or measured) device figures.

The events follow the runtime's rules (``offload/runtime/core.py``): a PRE/POST per module call, the
parameters each tensor op touches charged to the innermost active call, an UNPACK per backward node that
reads saved parameters, a GRAD per parameter gradient; saved activations count while autograd holds them,
once per storage, inside the root module's forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ..planning.buckets import ParamSpec
from ..planning.hw import HardwareModel
from ..planning.trace import Recorder, Trace


@dataclass(frozen=True)
class MetaTrace:
    trace: Trace  # seconds: the estimated compute time of each event
    specs: tuple[ParamSpec, ...]  # per parameter (model.parameters() order)
    order: tuple[int, ...]  # parameters in first-use order (how the runtime packs buckets)
    buffer_bytes: int  # module buffers (BatchNorm statistics, ...), on the device for the whole step
    flops: float  # total over the step
    ops: tuple[tuple[tuple[float, int], ...], ...]  # per event: (FLOPs, bytes) of each operator charged to it

    def compute_s(self, hw: HardwareModel) -> tuple[float, ...]:
        """Estimated compute seconds per event on ``hw``'s device roofline."""
        f, m = hw.device_flops_per_s, hw.device_bytes_per_s
        return tuple(sum(max(fl / f, nb / m) for fl, nb in ops) for ops in self.ops)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.specs)


class CountedActivation:
    """A saved activation on the meta device, counted in a :class:`SavedBytes` until autograd drops it (as
    the runtime counts its own, ``runtime.accounting.SavedActivation``: once per storage)."""

    __slots__ = ("tensor", "key", "counter", "__weakref__")

    def __init__(self, tensor, counter):
        self.tensor, self.counter = tensor, counter
        self.key = tensor.untyped_storage()._cdata
        counter.hold(self.key, tensor.untyped_storage().nbytes())

    def __del__(self):
        self.counter.drop(self.key)


class SavedBytes:
    """Bytes of saved activations held now and at most, counted once per storage (``hold``/``drop``)."""

    def __init__(self):
        self.held: dict[int, list[int]] = {}
        self.current = self.peak = 0

    def hold(self, key, nbytes):
        entry = self.held.get(key)
        if entry is None:
            self.held[key] = [1, nbytes]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1

    def drop(self, key):
        entry = self.held.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                del self.held[key]
                self.current -= entry[1]


class _Touches(TorchFunctionMode):
    def __init__(self, index, rec):
        super().__init__()
        self.index, self.rec = index, rec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in (*args, *kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, torch.Tensor):
                    p = self.index.get(id(t))
                    if p is not None:
                        self.rec.touch(p)
        return func(*args, **kwargs)


_FREE = {torch.ops.aten.detach.default, torch.ops.aten.t.default, torch.ops.aten.view.default,
         torch.ops.aten._unsafe_view.default, torch.ops.aten.transpose.int, torch.ops.aten.expand.default,
         torch.ops.aten.permute.default, torch.ops.aten.split.Tensor, torch.ops.aten.slice.Tensor,
         torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim, torch.ops.aten.alias.default}


class _Roofline(TorchDispatchMode):
    """Charges each operator's estimated time to the event being recorded."""

    def __init__(self, rec: Recorder):
        super().__init__()
        self.rec = rec
        self.ops: list[list[tuple[float, int]]] = []
        self.flops = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FREE:
            return out
        pk = func._overloadpacket
        flops = flop_registry[pk](*args, **kwargs, out_val=out) if pk in flop_registry else 0
        nbytes = 0
        for t in (*args, *kwargs.values(), *(out if isinstance(out, (list, tuple)) else (out,))):
            if isinstance(t, torch.Tensor):
                nbytes += t.numel() * t.element_size()
        self.flops += flops
        i = max(0, len(self.rec.events) - 1)
        while len(self.ops) <= i:
            self.ops.append([])
        self.ops[i].append((float(flops), nbytes))
        return out


def trace_meta(model: nn.Module, run: Callable[[nn.Module], torch.Tensor], hw: HardwareModel) -> MetaTrace:
    """Record one forward (``run(model)`` returns the loss) and its backward on meta tensors.

    The model's parameters may be meta tensors of any floating dtype (the compute dtype); every parameter
    that requires grad is trainable (one param group).
    """
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    storage_of = {p.untyped_storage()._cdata: i for i, p in enumerate(params)}
    rec = Recorder()
    counter = SavedBytes()
    roof = _Roofline(rec)
    handles = []
    active: list = []  # the saved-tensor hooks, entered while the root module's forward runs

    def pack(t):
        p = storage_of.get(t.untyped_storage()._cdata) if t.device.type == "meta" else None
        if p is not None:
            return ("param", p, t)
        return CountedActivation(t, counter)

    def unpack(saved):
        if isinstance(saved, CountedActivation):
            return saved.tensor
        _, p, t = saved
        rec.unpack(p, torch._C._current_autograd_node())
        return t

    def pre(i):
        def hook(module, args):
            if not rec.stack:
                ctx = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
                ctx.__enter__()
                active.append(ctx)
            rec.pre(i)
        return hook

    def post(i):
        def hook(module, args, output):
            rec.post(i)
            if not rec.stack and active:
                active.pop().__exit__(None, None, None)
        return hook

    def on_grad(param):
        rec.grad(index[id(param)], param.grad.numel() * param.grad.element_size())
        param.grad = None

    for i, m in enumerate(model.modules()):
        handles.append(m.register_forward_pre_hook(pre(i)))
        handles.append(m.register_forward_hook(post(i)))
    for p in params:
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(on_grad))
    try:
        with roof, _Touches(index, rec):
            loss = run(model)
        with roof:
            loss.backward()
    finally:
        for h in handles:
            h.remove()
        while active:
            active.pop().__exit__(None, None, None)
    del loss
    rec.activation_peak = counter.peak
    base = rec.finish()
    ops = tuple(tuple(x) for x in (roof.ops + [[]] * (len(base.events) - len(roof.ops)))[:len(base.events)])
    result = MetaTrace(base, (), (), 0, roof.flops, ops)
    trace = Trace(base.events, base.num_forward, base.uses, base.ends, base.touched, base.activation_peak_bytes,
                  base.max_grad_bytes, seconds=result.compute_s(hw))
    touched = list(trace.touched)
    seen = set(touched)
    order = tuple(touched + [p for p in range(len(params)) if p not in seen])
    specs = tuple(ParamSpec(p.numel(), 0 if p.requires_grad else None) for p in params)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    return MetaTrace(trace, specs, order, buffer_bytes, roof.flops, ops)


