"""Where the runtime learns that a parameter is read, and makes it readable: tensor ops of the forward
(a ``TorchFunctionMode``, the use detector), autograd's saved tensors in backward (pack/unpack hooks), and
the index from a device address to the bucket slot that holds it.

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
(``Runtime.placeholders``), never its host original (fp32, on the CPU) or another dtype. Host tensors
come only before the first forward and at ``close()``. (The simulated GPU, tests/support/fake_cuda.py, drops the
accumulator on a host/device change as CUDA does, so a break of this rule fails its tests.)

[Note: knowing where we are] Forward progress is module calls (pre/post hooks on every module); a
``TorchFunctionMode`` sees every tensor op of the forward and reports which parameters it touches (so a
parent reading a child's weight, tied weights and functional uses are all handled, and a parameter that
is somehow not on the device is fetched instead of read as garbage). Backward progress is autograd nodes
reading saved parameters (unpack hook) and gradient accumulation (post-accumulate-grad hooks); the end of
backward is a callback queued on the autograd engine.

A part of :class:`offload.runtime.core.Runtime`, split out by concern; its state (``slot_index``,
``trace_views``, ``trace_storage``, ``users``, ``active``, ``held``) is set up in ``Runtime.__init__``
and ``Runtime._reset_step``."""

from __future__ import annotations

import bisect
import weakref
from typing import TYPE_CHECKING

import torch
from torch.overrides import TorchFunctionMode

from ..planning.trace import EventKind
from .accounting import SavedActivation
from .residency import Residency, _Slot

if TYPE_CHECKING:
    from .core import Runtime


class _ParamRef:
    """A saved tensor that is a view of a parameter (see [Note: saved parameters])."""

    __slots__ = ("param", "byte_offset", "size", "stride", "dtype")

    def __init__(self, param, byte_offset, size, stride, dtype):
        self.param, self.byte_offset, self.size, self.stride, self.dtype = param, byte_offset, size, stride, dtype


class _UseDetector(TorchFunctionMode):
    """Reports the parameters each tensor op of the forward touches (see [Note: knowing where we are])."""

    def __init__(self, runtime: "Runtime"):
        super().__init__()
        self._index = runtime.param_index
        self._runtime = weakref.ref(runtime)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rt = self._runtime()
        if rt is not None and not rt.busy:
            index = self._index
            for a in (*args, *kwargs.values()):
                if isinstance(a, torch.Tensor):
                    p = index.get(id(a))
                    if p is not None:
                        rt.on_touch(p)
                elif isinstance(a, (list, tuple)):
                    for t in a:
                        if isinstance(t, torch.Tensor):
                            p = index.get(id(t))
                            if p is not None:
                                rt.on_touch(p)
        return func(*args, **kwargs)


class _Busy:
    """While the runtime's own code runs inside a forward, the use detector ignores its tensor ops. Under
    ``torch.inference_mode()`` that code runs outside it: the arena, slots and views it makes are used by the
    copy threads and by later training steps, which inference tensors would refuse."""

    def __init__(self, rt: "Runtime"):
        self.rt = rt
        self.guard = None

    def __enter__(self):
        self.prev, self.rt.busy = self.rt.busy, True
        if torch.is_inference_mode_enabled():
            self.guard = torch.inference_mode(False)
            self.guard.__enter__()

    def __exit__(self, *exc):
        if self.guard is not None:
            self.guard.__exit__(*exc)
            self.guard = None
        self.rt.busy = self.prev


class ParamAccessMixin:
    """Forward uses, saved-tensor pack/unpack and the slot index of the runtime."""

    # ---------------------------------------------------------------------------------------------------
    # forward: uses

    def on_touch(self, p: int) -> None:
        """A tensor op of the forward reads parameter ``p`` (called by the use detector)."""
        with _Busy(self):
            self.recorder.touch(p)
            if self.original is not None:
                self._trace_fetch(p)
                key = p
            else:
                key = self.bucket_of[p]
                if self.state[key] is not Residency.DEVICE:
                    self._wait(key)
            if self.users and key not in self.users[-1]:
                self.users[-1][key] = None
                self.active[key] = self.active.get(key, 0) + 1
            if self.recompute_region is not None:
                self.held.setdefault(self.recompute_region, set()).add(key)

    def _unuse(self, key: int) -> None:
        n = self.active[key] - 1
        if n:
            self.active[key] = n
            return
        del self.active[key]
        if self.original is not None:  # tracing: a parameter's copy lives only while a call uses it
            self._trace_release(key)

    def _trace_fetch(self, p: int) -> None:
        if p in self.trace_views:
            return
        param = self.params[p]
        nbytes = param.numel() * self.itemsize
        self.recorder.exclude_begin()  # the warm-up's synchronous fetches are not compute (trace.overhead)
        self._make_room(nbytes)
        storage = self.backend.empty(nbytes)
        self.memory.add("slots", nbytes)
        view = storage.view(self.dtype).view(param.shape)
        self.stats["h2d_bytes"] += nbytes
        # Rounded to the device dtype here, so the copy moves the slot's bytes and converts nothing on the
        # device (see [Note: stream-ordered memory] in backend/cuda.py).
        src = self.original[p].detach().to(self.dtype)
        self.backend.wait(self.backend.h2d(view, src, [self.boundary]))
        self.recorder.exclude_end()
        self.backend.bind(param, view)
        self.trace_views[p] = view
        self.trace_storage[storage.untyped_storage().data_ptr()] = p

    def _trace_release(self, p: int) -> None:
        view = self.trace_views.pop(p)
        del self.trace_storage[view.untyped_storage().data_ptr()]
        # A placeholder, never the host original: see [Note: one accumulator per parameter].
        self.backend.bind(self.params[p], self.placeholders[p])
        self.memory.add("slots", -view.numel() * self.itemsize)

    # ---------------------------------------------------------------------------------------------------
    # saved tensors

    def _pack(self, t: torch.Tensor):
        ref = self._locate(t)
        if ref is not None:
            return ref
        stack = self.recorder.stack
        if stack and t.device == self.backend.device and t.layout == torch.strided:
            block = self.ckpt.block_of.get(self.recorder.events[stack[-1]].key)
            if block is not None:  # what this block saves: what checkpointing it would spare
                with _Busy(self):
                    self.ckpt.count(block, None, t)
        return SavedActivation(t, self.memory)

    def _locate(self, t: torch.Tensor) -> _ParamRef | None:
        if t.device != self.backend.device or t.layout != torch.strided:
            return None
        key = t.untyped_storage().data_ptr()
        byte = t.storage_offset() * t.element_size()
        p = self.trace_storage.get(key)
        if p is not None:
            return _ParamRef(p, byte, tuple(t.shape), t.stride(), t.dtype)
        entry = self.slot_index.get(key)
        if entry is None:
            return None
        starts, owners = entry
        i = bisect.bisect_right(starts, byte) - 1
        if i < 0:
            return None
        b = owners[i]
        rel = byte - starts[i]
        bucket = self.buckets[b]
        if rel >= bucket.nbytes(self.itemsize):
            return None
        j = bisect.bisect_right(bucket.offsets, rel // self.itemsize) - 1
        p = bucket.params[j]
        return _ParamRef(p, rel - bucket.offsets[j] * self.itemsize, tuple(t.shape), t.stride(), t.dtype)

    def _unpack(self, saved):
        if isinstance(saved, SavedActivation):
            return saved.tensor
        p = saved.param
        self._begin_backward()
        if self.recorder.unpack(p, torch._C._current_autograd_node()):
            self.node_buckets = set()
            self._advance(EventKind.UNPACK, p)
        return self._param_view(saved)

    def _param_view(self, saved: _ParamRef) -> torch.Tensor:
        """The weight view ``saved`` names, in its bucket's slot: the bucket is fetched first if it is not on
        the device, and kept while the autograd node running reads it (``node_buckets``)."""
        p = saved.param
        b = self.bucket_of[p]
        self.node_buckets.add(b)
        self._wait(b)
        slot = self.slot[b]
        start = slot.offset + self.host.offset[p] * self.itemsize + saved.byte_offset
        typed = slot.storage.view(saved.dtype)
        itemsize = typed.element_size()
        return typed.as_strided(saved.size, saved.stride, start // itemsize)

    # ---------------------------------------------------------------------------------------------------
    # slot index: which bucket lives at a byte offset of a device storage (for the pack hook)

    def _index_slot(self, b: int, slot: _Slot) -> None:
        key = slot.storage.untyped_storage().data_ptr()
        starts, owners = self.slot_index.setdefault(key, ([], []))
        i = bisect.bisect_left(starts, slot.offset)
        starts.insert(i, slot.offset)
        owners.insert(i, b)

    def _unindex_slot(self, b: int, slot: _Slot) -> None:
        key = slot.storage.untyped_storage().data_ptr()
        starts, owners = self.slot_index[key]
        i = bisect.bisect_left(starts, slot.offset)
        assert owners[i] == b
        del starts[i], owners[i]
        if not starts:
            del self.slot_index[key]
