"""The runtime: registers the hooks and executes the plan. It decides nothing the plan has not decided;
where there is no plan yet (the first, traced step) or the step departs from it, it fetches on demand.

Residency of a bucket (one state machine per bucket, transitions asserted):

    HOST --fetch--> IN_FLIGHT --wait--> DEVICE --release--> HOST

[Note: saved parameters] Autograd saves views of weights for backward (``linear`` saves ``weight.t()``).
Those views point into a device slot that may hold another bucket by the time backward runs. The
saved-tensor pack hook therefore turns any tensor living in a bucket slot into a reference (parameter,
byte offset, size, stride, dtype), and the unpack hook rebuilds it from wherever the bucket is then,
fetching it first if needed. The pack hook also sees every other saved tensor: those are the
activations, counted (once per storage) until autograd frees them.

[Note: knowing where we are] Forward progress is module calls (pre/post hooks on every module); a
``TorchFunctionMode`` sees every tensor op of the forward and reports which parameters it touches (so a
parent reading a child's weight, tied weights and functional uses are all handled, and a parameter that
is somehow not on the device is fetched instead of read as garbage). Backward progress is autograd nodes
reading saved parameters (unpack hook) and gradient accumulation (post-accumulate-grad hooks); the end of
backward is a callback queued on the autograd engine.
"""

from __future__ import annotations

import bisect
import enum
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from torch.autograd import Variable
from torch.overrides import TorchFunctionMode

from .accounting import DeviceMemory, SavedActivation
from .activations import (AUTO, ActivationProfile, CheckpointChoice, checkpoint_hint, choose_checkpoints,
                          profile_of, recompute_seconds)
from .backend import DONE, Lane
from .buckets import Bucket, ParamSpec, make_buckets
from .config import OffloadConfig
from .errors import BudgetTooSmallError, OffloadError
from .host import HostState
from .optim import AdamW
from .recompute import Checkpointer, candidates
from .scaler import LossScaler
from .schedule import Plan, budget_error, build_plan, forward_min_budget, min_arena_bytes, validate_plan
from .trace import Event, EventKind, Recorder, Trace


EVAL_PLANS_KEPT = 4  # forward-only plans kept, one per recent no-grad path (see [Note: forward-only plans])


class Residency(enum.Enum):
    HOST = "host"
    """Only the host copy exists; the bucket's parameters are placeholders."""
    IN_FLIGHT = "in flight"
    """A host-to-device copy is issued; its event must be waited on before use."""
    DEVICE = "device"
    """On the device; the bucket's parameters are views of its slot."""


_ALLOWED = {
    (Residency.HOST, Residency.IN_FLIGHT),
    (Residency.IN_FLIGHT, Residency.DEVICE),
    (Residency.DEVICE, Residency.HOST),
    (Residency.IN_FLIGHT, Residency.HOST),
    (Residency.DEVICE, Residency.IN_FLIGHT),  # a resident bucket refreshed after the optimizer step
}


@dataclass
class _Slot:
    storage: torch.Tensor  # uint8 device tensor: the arena, or a bucket-sized on-demand allocation
    offset: int  # byte offset of the bucket in ``storage``
    planned: int | None  # plan buffer id, None when allocated on demand


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


class Runtime:
    """Hooks plus plan execution for one wrapped module. Owned by :class:`offload.Engine`."""

    def __init__(self, module: nn.Module, optimizer: AdamW, config: OffloadConfig, backend,
                 params: Sequence[nn.Parameter], groups: Sequence[int | None]):
        self.module = module
        self.optimizer = optimizer
        self.config = config
        self.backend = backend
        self.params = list(params)
        self.param_index = {id(p): i for i, p in enumerate(self.params)}
        self.specs = [ParamSpec(p.numel(), g) for p, g in zip(self.params, groups)]
        self.dtype = config.dtype
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.busy = False
        self.memory = DeviceMemory()
        self.placeholders = [backend.placeholder(p.shape, self.dtype) for p in self.params]
        self.grad_headroom = max((s.numel * self.itemsize for s in self.specs if s.group is not None), default=0)
        self.cpu = Lane("offload-cpu-adam")  # AdamW of each bucket, in arrival order

        # Before the first forward has been traced, parameters keep their original (host) tensors.
        self.original: list[torch.Tensor] | None = [p.data for p in self.params]
        self.trace_views: dict[int, torch.Tensor] = {}  # param -> its own device copy while tracing
        self.trace_storage: dict[int, int] = {}  # storage ptr -> param, for those copies

        self.buckets: tuple[Bucket, ...] = ()
        self.bucket_of: list[int] = []
        self.plan: Plan | None = None  # the plan being executed: train_plan or eval_plan
        self.train_plan: Plan | None = None  # forward + backward, from a recorded training step
        self.eval_plan: Plan | None = None  # forward only, for forwards under torch.no_grad()
        self.eval_plans: OrderedDict[tuple, Plan] = OrderedDict()  # recent forward-only plans by path
        self.eval_next: dict[tuple, tuple] = {}  # path -> the path the no-grad forward after it took
        self.eval_last: tuple | None = None  # path of the latest no-grad forward
        self.arena: torch.Tensor | None = None

        self.state: list[Residency] = []  # per bucket
        self.slot: dict[int, _Slot] = {}  # bucket -> where it is on the device (not HOST)
        self.slot_index: dict[int, tuple[list[int], list[int]]] = {}  # storage ptr -> (offsets, buckets)
        self.h2d_event: dict[int, object] = {}  # bucket -> its latest host-to-device copy
        self.adam_event: dict[int, object] = {}  # bucket -> its latest AdamW (host master is written)
        self.lru: OrderedDict[int, None] = OrderedDict()  # buckets fetched on demand, oldest first
        self.grad_slots: dict[int, tuple[torch.Tensor, int | None]] = {}  # bucket -> (slot, plan buffer)
        self.freeing: list[tuple[object, int, torch.Tensor]] = []  # (D2H event, bytes, slot) until copied
        # bucket -> (params whose grads were gathered since the last step(), event after which the host grad
        # buffer holds them): what the next update covers, and what accumulation adds to
        self.pending: dict[int, tuple[frozenset, object]] = {}
        self.awaiting_step = False
        self.deferred = not config.overlap_optimizer  # updates run in step(), after every grad is in
        self.grad_copies: list = []  # device-to-host grad copies of the last backward, not yet waited for
        self.norms: dict[int, torch.Tensor] = {}  # param -> 2-norm of its gathered grad (deferred mode)
        self.clip_factor = 1.0  # set by clip_grad_norm_, applied by the next step()
        self.scaler = LossScaler(config.loss_scale) if config.loss_scale is not None else None
        self.next_backward_scale: float | None = None  # set by Engine.backward just before loss.backward()
        self.step_scale: float | None = None  # the loss scale of this step's backward passes
        self.stale = False
        self.trace: Trace | None = None
        self.boundary = DONE  # compute event at the end of the previous forward/backward
        self.grad_enabled = True
        self.host: HostState | None = None
        self.stats = {"replans": 0, "plan_departures": 0, "on_demand_fetches": 0, "planned_fetches": 0,
                      "over_budget_fetches": 0, "steps": 0, "skipped_steps": 0, "backwards": 0,
                      "eval_plans_built": 0, "h2d_bytes": 0, "d2h_bytes": 0}
        self.h2d_by_bucket: list[int] = []  # host-to-device bytes per bucket since wrap
        self.last_step_skipped = False
        self._warned = False
        self._module_index = {}
        self._handles = []
        self._contexts: list = []
        # Activation checkpointing (offload/recompute.py, [Note: recompute and the parameter buckets]).
        spec = config.activation_checkpointing
        self.auto_checkpoint = spec == AUTO
        blocks = candidates(spec, module)
        if self.auto_checkpoint and not blocks:
            raise ValueError('activation_checkpointing="auto" found no repeated blocks (children of an '
                             "nn.ModuleList or nn.Sequential with submodules) to checkpoint in this model; "
                             "name the modules instead: activation_checkpointing=[\"layers.0\", ...]")
        self.ckpt = Checkpointer(module, self, blocks)
        self.checkpoint_choice: CheckpointChoice | None = None  # what "auto" decided after the warm-up
        self.profile: ActivationProfile | None = None  # activation bytes per block, of the last step
        self._reset_step()
        self._register_hooks()
        if spec is not None:
            self.ckpt.set_active(blocks)  # "auto": the warm-up step checkpoints every block, then chooses

    # ---------------------------------------------------------------------------------------------------
    # hooks

    def _register_hooks(self) -> None:
        for i, m in enumerate(self.module.modules()):
            self._module_index[id(m)] = i
            self._handles.append(m.register_forward_pre_hook(self._pre_hook(i)))
            self._handles.append(m.register_forward_hook(self._post_hook(i)))
        for p, spec in zip(self.params, self.specs):
            if spec.group is not None:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _pre_hook(self, index: int):
        def hook(module, args):
            if self.ckpt.recomputing is not None:
                return  # backward recomputes a checkpointed call: its RECOMPUTE event stands for it
            with _Busy(self):
                if index == 0 and self.recorder.stack:
                    self.abort_forward()  # the previous call of the root module raised
                if not self.recorder.stack:
                    self._begin_forward(index)
                self.recorder.pre(index)
                self.users.append({})
                self._advance(EventKind.PRE, index)
        return hook

    def _post_hook(self, index: int):
        def hook(module, args, output):
            if self.ckpt.recomputing is not None:
                return
            with _Busy(self):
                self._advance(EventKind.POST, index)
                for b in self.users.pop() if self.users else ():
                    self._unuse(b)
                self.recorder.post(index)
                if not self.recorder.stack:
                    self._end_forward()
        return hook

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.ckpt.close()

    # ---------------------------------------------------------------------------------------------------
    # step state

    def _reset_step(self) -> None:
        self.recorder = Recorder()
        self.users: list[dict] = []  # per active module call: what it touched (param or bucket ids)
        self.active: dict[int, int] = {}  # param (tracing) or bucket -> number of active calls using it
        self.pos = 0  # next plan event
        self.on_plan = self.plan is not None and self.arena is not None
        self.in_backward = False
        self.node_buckets: set[int] = set()  # buckets the current backward node reads
        self.received: dict[int, set[int]] = {}  # bucket -> params whose grads arrived this backward
        self.finished: set[int] = set()  # buckets whose grads went to the host this backward
        self.done: dict[int, object] = {}  # plan buffer -> event after which its memory may be reused
        self.hparams = None
        self.memory.activation_peak = self.memory.parts["activations"]
        self.ckpt.reset()
        self.forward_end_activations = 0  # saved bytes held when this step's forward ended
        self.recompute_event: dict[int, int] = {}  # checkpointed call (region) -> its RECOMPUTE event
        self.recompute_region: int | None = None  # the region being recomputed now
        self.reserve = 0  # bytes the recompute in progress is still expected to save
        self.held: dict[int, set[int]] = {}  # region -> buckets its recomputed weight views point into
        self.recompute_holds: dict[int, list[int]] = {}  # region -> storages of its recomputed tensors

    def _begin_forward(self, root: int) -> None:
        grad_enabled = torch.is_grad_enabled()
        if self.in_backward or self.pos:
            # The previous forward was not followed by a (completed) backward: start over cleanly.
            self._release_all()
        # [Note: forward-only plans] A forward under torch.no_grad() (evaluation, generate()) has no
        # backward to keep buckets for or prefetch for: it runs its own plan, built from a recorded
        # no-grad forward. Recent no-grad paths keep their plans. A forward takes the path that followed
        # the previous one last time, if it starts at the module called, else the latest that does
        # (generate() on T5 calls the encoder, then the model computing cross-attention keys, then the
        # model reading them from its cache: three paths, always in that order). Switching plans frees
        # one arena before the other is allocated.
        want = self.train_plan if grad_enabled else self._eval_plan_for(root)
        if want is not self.plan and self.host is not None:
            self._deactivate()
            self.plan = want
        if self.plan is not None and self.arena is None:
            self._activate(self.plan)  # after a departure from it, or a switch of plans
        self._reset_step()
        # Grad copies of an earlier backward of this step (accumulation) may still be reading their slots,
        # and the plan reuses those bytes: everything this pass issues comes after them.
        for event in self.grad_copies:
            self.backend.wait(event)
        self.grad_copies = []
        self.boundary = self.backend.record()
        self.grad_enabled = grad_enabled
        contexts = []
        if self.dtype != torch.float32:
            # Ops autocast keeps in fp32 (softmax, norms, losses) upcast the 16-bit weights and activations;
            # matmuls read the 16-bit weights as they are. No cast cache: it would hold weight views.
            contexts.append(torch.autocast(self.backend.device.type, dtype=self.dtype, cache_enabled=False))
        contexts.append(_UseDetector(self))
        contexts.append(torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))
        for ctx in contexts:
            ctx.__enter__()
        self._contexts = contexts[::-1]

    def _exit_contexts(self) -> None:
        for ctx in self._contexts:  # exit in reverse order of entry
            ctx.__exit__(None, None, None)
        self._contexts = []

    def abort_forward(self) -> None:
        """The forward raised: undo its effects so the engine stays usable."""
        with _Busy(self):
            self._exit_contexts()
            for p in list(self.trace_views):
                self._trace_release(p)
            self.active.clear()
            self._release_all()
            self._reset_step()

    def _end_forward(self) -> None:
        self._exit_contexts()
        self.forward_end_activations = self.memory.parts["activations"]
        if self.original is not None:
            self._finish_trace_forward()
        if not self.grad_enabled:
            # No backward follows a no-grad forward (evaluation): let go of everything streamed.
            followed = self.on_plan and self.pos == len(self.plan.trace.events)  # self.plan: an eval plan
            self._release_all()
            self.pos = 0
            if self.host is not None:
                self._plan_forward_only(self.plan.trace if followed else self.recorder.finish())

    def _eval_plan_for(self, root: int) -> Plan | None:
        start = Event(EventKind.PRE, root)
        plan = self.eval_plans.get(self.eval_next.get(self.eval_last))
        if plan is not None and plan.trace.events[0] == start:
            return plan
        for plan in reversed(self.eval_plans.values()):
            if plan.trace.events[0] == start:
                return plan
        return None  # no path seen starts here: fetch on demand and record one

    def _plan_forward_only(self, trace: Trace) -> None:
        """Make the plan of this no-grad forward's path the one the next no-grad forward follows (see
        [Note: forward-only plans]). Paths seen recently (generate(): the first call and the later ones)
        keep their plans, so alternating between them does not plan again."""
        key = (trace.events, trace.uses)
        if self.eval_last is not None:
            self.eval_next[self.eval_last] = key
        self.eval_last = key
        plan = self.eval_plans.get(key)
        if plan is None:
            try:
                plan = build_plan(trace, self.buckets, itemsize=self.itemsize, budget_bytes=self.config.budget,
                                  fixed_bytes=self.memory.parts["buffers"])
            except BudgetTooSmallError:
                return  # no plan fits: the next no-grad forward fetches on demand, as this one did
            validate_plan(plan)
            self.stats["eval_plans_built"] += 1
            self.eval_plans[key] = plan
            while len(self.eval_plans) > EVAL_PLANS_KEPT:
                gone, _ = self.eval_plans.popitem(last=False)
                self.eval_next = {a: b for a, b in self.eval_next.items() if gone not in (a, b)}
        self.eval_plans.move_to_end(key)
        self.eval_plan = plan

    # ---------------------------------------------------------------------------------------------------
    # plan following

    def _advance(self, kind: EventKind, key: int) -> None:
        if not self.on_plan:
            return
        plan = self.plan
        events = plan.trace.events
        if self.pos >= len(events) or events[self.pos].kind != kind or events[self.pos].key != key:
            self._leave_plan()
            return
        actions = plan.actions[self.pos]
        self.pos += 1
        for k in actions.release:
            self._release_buffer(k)
        for k in actions.prefetch:
            self._prefetch(k)
        for b in actions.need:
            self._wait(b)

    def _leave_plan(self) -> None:
        """The step departs from the plan: finish it on demand, within the budget, and plan again at
        ``step()``. The arena goes (its layout only fits the plan); grads gathered in it move out first."""
        self.on_plan = False
        self.stats["plan_departures"] += 1
        if self.grad_enabled:
            self.stale = True
        with torch.no_grad():
            self.backend.synchronize()
            for b, (view, k) in list(self.grad_slots.items()):
                if k is not None:
                    moved = self.backend.empty(view.numel() * self.itemsize).view(self.dtype)
                    self.memory.add("slots", moved.numel() * self.itemsize)
                    moved.copy_(view)
                    self.grad_slots[b] = (moved, None)
            self._deactivate()

    def _activate(self, plan: Plan) -> None:
        """Make ``plan`` the one executed: allocate its arena and bring in its resident buckets."""
        self.plan = plan
        self.arena = self.backend.empty(plan.arena_bytes)
        self.memory.add("arena", plan.arena_bytes)
        self.boundary = self.backend.record()
        for b in plan.resident:
            k = plan.resident_buffer[b]
            self._copy_in(b, _Slot(self.arena, plan.buffers[k].offset, k), [self.boundary])

    def _deactivate(self) -> None:
        """Release every bucket and free the arena (the plan is kept)."""
        self.backend.synchronize()
        for b in list(self.slot):
            self._release(b)
        self.boundary = self.backend.record()
        if self.arena is not None:
            self.memory.add("arena", -self.arena.numel())
            self.arena = None

    # ---------------------------------------------------------------------------------------------------
    # residency

    def _set_state(self, b: int, new: Residency) -> None:
        old = self.state[b]
        assert (old, new) in _ALLOWED, f"bucket {b}: illegal residency change {old.value} -> {new.value}"
        self.state[b] = new

    def _bind_params(self, b: int, slot: _Slot) -> None:
        typed = slot.storage.view(self.dtype)
        base = slot.offset // self.itemsize
        bucket = self.buckets[b]
        for p, off in zip(bucket.params, bucket.offsets):
            param = self.params[p]
            param.data = typed[base + off: base + off + param.numel()].view(param.shape)

    def _unbind_params(self, b: int) -> None:
        for p in self.buckets[b].params:
            self.params[p].data = self.placeholders[p]

    def _copy_in(self, b: int, slot: _Slot, waits) -> None:
        """Issue the host-to-device copy of bucket ``b`` into ``slot``."""
        n = self.buckets[b].numel
        dst = slot.storage[slot.offset: slot.offset + n * self.itemsize].view(self.dtype)
        waits = [w for w in (*waits, self.adam_event.get(b)) if w is not None]
        fresh = b not in self.slot
        self.stats["h2d_bytes"] += n * self.itemsize
        self.h2d_by_bucket[b] += n * self.itemsize
        self._set_state(b, Residency.IN_FLIGHT)
        self.slot[b] = slot
        self.h2d_event[b] = self.backend.h2d(dst, self.host.source(b), waits)
        if fresh:
            self._bind_params(b, slot)
            self._index_slot(b, slot)

    def _wait(self, b: int) -> None:
        """Make compute wait until bucket ``b`` is on the device; fetch it now if it is not coming."""
        state = self.state[b]
        if state is Residency.DEVICE:
            self._touch_lru(b)
            return
        self.recorder.exclude_begin()  # waiting is not compute: the cost model simulates it (trace.overhead)
        if state is Residency.HOST:
            if self.on_plan:
                self._leave_plan()
            self._fetch_on_demand(b)
        self.backend.wait(self.h2d_event[b])
        self.recorder.exclude_end()
        self._set_state(b, Residency.DEVICE)
        self._touch_lru(b)

    def _prefetch(self, k: int) -> None:
        x = self.plan.buffers[k]
        b = x.bucket
        if self.state[b] is not Residency.HOST:
            return  # already here (fetched on demand earlier in this step)
        waits = [self.done[j] for j in x.after if j in self.done] + [self.boundary]
        self._copy_in(b, _Slot(self.arena, x.offset, k), waits)
        self.stats["planned_fetches"] += 1

    def _fetch_on_demand(self, b: int) -> None:
        nbytes = self.buckets[b].nbytes(self.itemsize)
        self._make_room(nbytes)
        storage = self.backend.empty(nbytes)
        self.memory.add("slots", nbytes)
        self._copy_in(b, _Slot(storage, 0, None), [self.boundary])
        self.lru[b] = None
        self.stats["on_demand_fetches"] += 1

    def _reclaim(self, block: bool = False) -> None:
        """Free grad slots whose device-to-host copy has finished (all of them when ``block``)."""
        keep = []
        for ev, nbytes, slot in self.freeing:
            if block or ev.query():
                ev.synchronize()
                self.memory.add("slots", -nbytes)
            else:
                keep.append((ev, nbytes, slot))
        self.freeing = keep

    def _make_room(self, nbytes: int) -> None:
        """Evict on-demand buckets, least recently used first, until ``nbytes`` more fit the budget."""
        # Leave room for the largest gradient autograd may materialise while this bucket is here.
        limit = self.config.budget - self.grad_headroom - self.reserve
        self._reclaim(block=self.memory.current + nbytes > limit)
        protected = set(self.active) | self.node_buckets
        for buckets in self.held.values():  # recomputed weight views point into them (see recompute.py)
            protected |= buckets
        for b in list(self.lru):
            if self.memory.current + nbytes <= limit:
                return
            if b not in protected and self.state[b] is not Residency.HOST:
                self._release(b)
        if self.memory.current + nbytes > limit:
            self.stats["over_budget_fetches"] += 1

    def _touch_lru(self, b: int) -> None:
        if b in self.lru:
            self.lru.move_to_end(b)

    def _release(self, b: int) -> None:
        """Bucket ``b``'s parameters are no longer needed on the device."""
        slot = self.slot.pop(b)
        if self.state[b] is Residency.IN_FLIGHT:
            self.backend.wait(self.h2d_event[b])  # never free memory a copy is still writing
            self._set_state(b, Residency.DEVICE)
        self._set_state(b, Residency.HOST)
        self._unbind_params(b)
        self._unindex_slot(b, slot)
        self.lru.pop(b, None)
        if slot.planned is not None:
            self.done[slot.planned] = self.backend.record()
        else:
            self.memory.add("slots", -self.buckets[b].nbytes(self.itemsize))

    def _release_buffer(self, k: int) -> None:
        b = self.plan.buffers[k].bucket
        slot = self.slot.get(b)
        if slot is not None and slot.planned == k:
            self._release(b)

    def _release_all(self) -> None:
        """Let go of every bucket that is not resident by plan."""
        for b, slot in list(self.slot.items()):
            if not self._is_resident(b, slot):
                self._release(b)
        self.boundary = self.backend.record()

    def _is_resident(self, b: int, slot: _Slot) -> bool:
        return self.plan is not None and slot.planned is not None and slot.planned == self.plan.resident_buffer[b]

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
        self.backend.wait(self.backend.h2d(view, self.original[p], [self.boundary]))
        self.recorder.exclude_end()
        param.data = view
        self.trace_views[p] = view
        self.trace_storage[storage.untyped_storage().data_ptr()] = p

    def _trace_release(self, p: int) -> None:
        view = self.trace_views.pop(p)
        del self.trace_storage[view.untyped_storage().data_ptr()]
        # Never back to the fp32 original while tracing a 16-bit run: a parameter whose dtype changes gets a
        # new gradient accumulator, and a tied weight released between two uses would then have two.
        self.params[p].data = self.original[p] if self.dtype == torch.float32 else self.placeholders[p]
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
        b = self.bucket_of[p]
        self._begin_backward()
        if self.recorder.unpack(p, torch._C._current_autograd_node()):
            self.node_buckets = set()
            self._advance(EventKind.UNPACK, p)
        self.node_buckets.add(b)
        self._wait(b)
        slot = self.slot[b]
        start = slot.offset + self.host.offset[p] * self.itemsize + saved.byte_offset
        typed = slot.storage.view(saved.dtype)
        itemsize = typed.element_size()
        return typed.as_strided(saved.size, saved.stride, start // itemsize)

    # ---------------------------------------------------------------------------------------------------
    # backward: grads

    def _begin_backward(self) -> None:
        if self.in_backward:
            return
        if self.awaiting_step and not self.deferred:
            raise OffloadError(
                "a second backward ran before optimizer.step(), but this engine applies each bucket's AdamW "
                "while backward runs (overlap_optimizer=True), so the previous backward's update is already "
                "applied. To accumulate gradients over several backward passes, wrap with "
                "overlap_optimizer=False; otherwise call step() after each backward.")
        scaled = self.next_backward_scale is not None
        scale = self.next_backward_scale if scaled else 1.0
        self.next_backward_scale = None
        if self.step_scale is not None and scale != self.step_scale:
            raise OffloadError(
                f"this backward's loss is scaled by {scale:g} but the grads gathered since the last step() "
                f"by {self.step_scale:g}: with float16, call engine.backward(loss) for every backward pass")
        self.step_scale = scale
        if self.scaler is not None and not scaled and not self._warned:
            self._warned = True
            warnings.warn("offload: with float16, call engine.backward(loss) rather than loss.backward(), so "
                          "that the loss is scaled and small gradients do not underflow to zero", stacklevel=3)
        self.in_backward = True
        self.stats["backwards"] += 1
        self.hparams = self.optimizer.hparams()  # overlapped updates: hyperparameters read as backward begins
        if self.on_plan and self.pos != self.plan.trace.num_forward:
            self._leave_plan()
        Variable._execution_engine.queue_callback(self._end_backward)

    def _on_grad(self, param: nn.Parameter) -> None:
        p = self.param_index[id(param)]
        grad = param.grad
        nbytes = grad.numel() * grad.element_size()
        self.memory.add("grads", nbytes)  # autograd has materialised it; it dies below
        self._begin_backward()
        self.node_buckets = set()
        self.recorder.grad(p, nbytes)
        self._advance(EventKind.GRAD, p)
        b = self.bucket_of[p]
        slot = self._grad_slot(b)
        off = self.host.offset[p]
        with torch.no_grad():
            slot[off: off + param.numel()].copy_(grad.reshape(-1))
        param.grad = None
        del grad
        self.memory.add("grads", -nbytes)
        got = self.received.setdefault(b, set())
        got.add(p)
        if got >= self._expected(b):
            self._finish_grads(b)

    def _expected(self, b: int) -> set[int]:
        touched = self.recorder.touched
        return {p for run in self.buckets[b].runs for p in run.params if p in touched}

    def _grad_slot(self, b: int) -> torch.Tensor:
        """The device slot bucket ``b``'s grads are gathered in (typed, trainable prefix only)."""
        have = self.grad_slots.get(b)
        if have is not None:
            return have[0]
        n = self.buckets[b].trainable_numel
        k = self.plan.grad_buffer[b] if self.on_plan else None
        if k is not None:
            x = self.plan.buffers[k]
            for j in x.after:
                if j in self.done:
                    self.backend.wait(self.done[j])
            self.backend.wait(self.boundary)
            view = self.arena[x.offset: x.offset + n * self.itemsize].view(self.dtype)
        else:
            self._make_room(n * self.itemsize)
            view = self.backend.empty(n * self.itemsize).view(self.dtype)
            self.memory.add("slots", n * self.itemsize)
        self.grad_slots[b] = (view, k)
        return view

    def _finish_grads(self, b: int) -> None:
        """All of bucket ``b``'s grads are in its slot: copy them to the host, then update on the CPU."""
        if b in self.finished:
            return
        self.finished.add(b)
        view, k = self.grad_slots.pop(b)
        got = frozenset(self.received[b])
        bucket = self.buckets[b]
        host = self.host
        with torch.no_grad():
            for run in bucket.runs:  # a parameter without a grad this pass contributes zeros, not garbage
                for p in run.params:
                    if p not in got:
                        view[host.offset[p]: host.offset[p] + self.specs[p].numel].zero_()
            earlier = self.pending.get(b)
            if self.deferred and earlier is None:  # the norms clipping needs, where the grads are
                self.norms.update(self._slot_norms(view, got))
        waits = [self.backend.record()] + [e for e in (self.adam_event.get(b),) if e is not None]
        self.stats["d2h_bytes"] += view.numel() * self.itemsize
        if earlier is None:
            d2h = self.backend.d2h(host.grad[b], view, waits)
            ready = d2h
        else:  # accumulate: copy out beside the sum, add on the CPU lane (which also owns the sum's norms)
            staging = torch.empty(view.numel(), dtype=self.dtype)
            d2h = self.backend.d2h(staging, view, waits)
            ready = self.cpu.submit(lambda: self._accumulate(b, staging, got), [d2h, earlier[1]],
                                    f"gradient accumulation of bucket {b}")
        self.grad_copies.append(d2h)
        if k is not None:
            self.done[k] = d2h
        else:  # (tensor, event): the slot is kept until the copy has read it
            self.freeing.append((d2h, view.numel() * self.itemsize, view))
        self.pending[b] = ((earlier[0] if earlier else frozenset()) | got, ready)
        if not self.deferred:
            self._submit_update(b, got, ready)

    def _slot_norms(self, view: torch.Tensor, params) -> dict[int, torch.Tensor]:
        dtype = None if self.dtype == torch.float32 else torch.float32
        off = self.host.offset
        return {p: torch.linalg.vector_norm(view[off[p]: off[p] + self.specs[p].numel], dtype=dtype)
                for p in params}

    def _accumulate(self, b: int, staging: torch.Tensor, got) -> None:
        """CPU lane: add one more backward's grads of bucket ``b`` into the fp32 sum, renew their norms."""
        self.host.grad[b].add_(staging)
        self.norms.update(self.host.grad_norms(b, got))

    def _submit_update(self, b: int, params, ready, hparams=None, factors: tuple[float, ...] = ()) -> None:
        hparams = hparams or self.hparams
        params = frozenset(params)
        waits = [ready] + [e for e in (self.h2d_event.get(b),) if e is not None]
        self.adam_event[b] = self.cpu.submit(lambda: self.host.update(b, params, hparams, factors), waits,
                                             f"AdamW of bucket {b}")

    def _end_backward(self) -> None:
        """Queued on the autograd engine: runs once the whole backward has finished."""
        with torch.no_grad():
            for b in list(self.received):
                if b not in self.finished:
                    self._finish_grads(b)  # some grad of it never came (an unused branch): flush
            if self.on_plan and self.pos != len(self.plan.trace.events):
                self._leave_plan()
            for region in set(self.recompute_event) | set(self.recompute_holds) | set(self.held):
                self.region_done(region)  # a call whose inputs need no grad: its backward is over now
            self.recorder.activation_peak = self.memory.activation_peak
            if self.plan is not None and self.memory.activation_peak > self.plan.activation_bytes:
                self.stale = True  # same calls, larger activations (a longer sequence): plan again at step()
            self.trace = self.recorder.finish()
            self.profile = self._profile(self.memory.activation_peak)
            self._release_all()
            self._reclaim()
        self.awaiting_step = bool(self.pending)
        self.in_backward = False
        self.pos = 0

    # ---------------------------------------------------------------------------------------------------
    # optimizer step

    def wait_for_updates(self) -> None:
        self.cpu.drain()

    def step(self) -> None:
        if self.in_backward:
            raise OffloadError("optimizer.step() was called during backward")
        skipped = False
        if self.deferred and self.pending:
            skipped = self._step_deferred()
        self.cpu.drain()
        self._reclaim(block=True)  # every update waited for its grads' copy: all grad slots are free
        updated = set() if skipped else set(self.pending)
        self._clear_grads()
        self.last_step_skipped = skipped
        if updated:
            self.stats["steps"] += 1
        with torch.no_grad():
            if (self.train_plan is None or self.stale) and self.trace is not None and self.trace.complete:
                self._replan(self.trace)  # brings every resident bucket in afresh
            else:
                self._refresh_resident(updated)
        self.stale = False

    def _step_deferred(self) -> bool:
        """Run the gathered updates (loss scale and clipping applied); return True if the step is skipped."""
        hparams = self.optimizer.hparams()  # read now, as torch.optim does
        factors = []
        if self.scaler is not None:
            self.cpu.drain()  # the norms of accumulated grads are computed on the CPU lane
            norms = [self.norms[p] for ps, _ in self.pending.values() for p in ps]
            found_inf = bool(norms) and not bool(torch.isfinite(torch.stack([n.float().cpu() for n in norms])).all())
            inv_scale = 1.0 / self.step_scale if self.step_scale else 1.0
            self.scaler.update(found_inf)
            if found_inf:
                self.stats["skipped_steps"] += 1
                return True
            factors.append(inv_scale)
        factors.append(self.clip_factor)
        for b in sorted(self.pending):  # first-use order: the next forward's first buckets are done first
            params, ready = self.pending[b]
            self._submit_update(b, params, ready, hparams, tuple(factors))
        return False

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        """``torch.nn.utils.clip_grad_norm_`` over every grad gathered since the last step, applied by the
        next ``step()``. Returns the total norm (of the unscaled grads, with float16 loss scaling)."""
        if not self.deferred:
            raise OffloadError(
                "clip_grad_norm_ needs every grad before any update, but this engine applies each bucket's "
                "AdamW while backward runs (overlap_optimizer=True). Wrap with overlap_optimizer=False to clip.")
        if self.in_backward:
            raise OffloadError("clip_grad_norm_ was called during backward")
        max_norm, norm_type = float(max_norm), float(norm_type)
        params = sorted(p for ps, _ in self.pending.values() for p in ps)
        if not params:
            return torch.tensor(0.0)
        self.cpu.drain()  # grads (and the norms of accumulated ones) are final
        if norm_type == 2.0:
            norms = [self.norms[p].float().cpu() for p in params]
        else:
            by_bucket: dict[int, list[int]] = {}
            for p in params:
                by_bucket.setdefault(self.bucket_of[p], []).append(p)
            found = {}
            for b, ps in by_bucket.items():
                found.update(self.host.grad_norms(b, ps, norm_type))
            norms = [found[p] for p in params]
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        if self.step_scale is not None and self.step_scale != 1.0:
            total = total / self.step_scale  # exact: loss scales are powers of two
        if self.clip_factor != 1.0:
            total = total * self.clip_factor
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite, so it "
                               "cannot be clipped. Pass error_if_nonfinite=False to go on anyway")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self.clip_factor *= float(coef)
        return total

    def zero_grad(self) -> None:
        """Grads are consumed by the update, so after step() there is nothing to clear; before it (deferred
        updates), the grads gathered so far are dropped, as ``optimizer.zero_grad()`` would."""
        if self.in_backward:
            raise OffloadError("zero_grad() was called during backward")
        if self.deferred and self.pending:
            self.cpu.drain()
            self._reclaim(block=True)
            self._clear_grads()

    def _clear_grads(self) -> None:
        self.pending = {}
        self.norms = {}
        self.clip_factor = 1.0
        self.step_scale = None
        self.awaiting_step = False

    def _refresh_resident(self, buckets) -> None:
        """Updated buckets that stay on the device get their new weights (the next forward waits)."""
        for b in sorted(buckets & set(self.slot)):
            if self.state[b] is Residency.IN_FLIGHT:
                self._wait(b)
            self._copy_in(b, self.slot[b], [self.boundary])

    def _replan(self, trace: Trace) -> None:
        if self.auto_checkpoint and self.checkpoint_choice is None and self._choose_checkpoints(trace):
            return self._drop_plan()  # other blocks are checkpointed from now on: the next step is planned
        try:
            plan = build_plan(trace, self.buckets, itemsize=self.itemsize, budget_bytes=self.config.budget,
                              fixed_bytes=self.memory.parts["buffers"], hw=self.config.hw)
        except BudgetTooSmallError as e:
            if self.auto_checkpoint and self._choose_checkpoints(trace):
                return self._drop_plan()  # the activations grew (a longer sequence): checkpoint more blocks
            parts = e.breakdown
            raise self._activation_hint(e, self.config.budget - sum(parts.values()) + parts["activations"]) from None
        validate_plan(plan)
        self.on_plan = False
        self._deactivate()
        if self.train_plan is not None:
            self.stats["replans"] += 1
        self.train_plan = plan
        self._activate(plan)

    # ---------------------------------------------------------------------------------------------------
    # the end of the traced forward: buckets and the host arena

    def _finish_trace_forward(self) -> None:
        """First forward done: pack buckets in first-use order, check the budget, build the host side."""
        touched = list(self.recorder.touched)
        seen = set(touched)
        order = touched + [p for p in range(len(self.params)) if p not in seen]
        buckets = make_buckets(self.specs, order, self.config.bucket_bytes, self.itemsize)
        rec = self.recorder
        need = forward_min_budget(rec.events, rec.uses, rec.ends, buckets, self.specs, self.itemsize,
                                  activations=self.memory.activation_peak, fixed=self.memory.parts["buffers"])
        if sum(need.values()) > self.config.budget:
            self.profile = self._profile(self.memory.activation_peak)
            capacity = self.config.budget - sum(need.values()) + need["activations"]
            raise self._activation_hint(budget_error(self.config.budget, **need), capacity)
        lowp = self.dtype if self.dtype != torch.float32 else None
        host = HostState(buckets, self.specs, [p.shape for p in self.params], lowp,  # may raise HostMemoryError
                         fused=self.optimizer.fused)
        self.backend.pin_host(host.arena)  # page-locked once, after first touch (CUDA; no-op on the CPU backend)
        with torch.no_grad():
            for p in range(len(self.params)):
                host.write_master(p, self.original[p])
        self.host, self.buckets, self.bucket_of = host, host.buckets, host.bucket_of
        self.state = [Residency.HOST] * len(buckets)
        self.h2d_by_bucket = [0] * len(buckets)
        self.original = None
        for p, param in enumerate(self.params):
            param.data = self.placeholders[p]
        self._adopt_optimizer_state()
        # Saved references from this forward point at per-parameter copies; from now on they resolve
        # through buckets (backward fetches on demand: there is no plan until this step is recorded).
        self.trace_storage.clear()

    def _adopt_optimizer_state(self) -> None:
        if self.host is not None:
            self.host.adopt_optimizer_state(self.optimizer, self.params)

    # ---------------------------------------------------------------------------------------------------
    # activation checkpointing (offload/recompute.py calls these; see its [Note: recompute and ...])

    def recompute_begin(self, region: int, module: int) -> list:
        """Backward is about to recompute checkpointed call ``region`` of ``module``: record it as one
        RECOMPUTE event, follow the plan, and return the contexts to run the recompute under."""
        with _Busy(self):
            self._begin_backward()
            self.node_buckets = set()
            self.recompute_event[region] = self.recorder.recompute_begin(module)
            self._advance(EventKind.RECOMPUTE, module)
            # On demand, fetches keep room for what the recompute will save (as measured in forward).
            self.reserve = self.ckpt.region_bytes.get(region, 0)
            if not self.on_plan:
                self._make_room(0)
            self.recompute_region = region
        return [_UseDetector(self)]  # the weights it reads are fetched (and held) like forward's

    def recompute_saved(self, region: int, t: torch.Tensor) -> None:
        """A tensor the recompute saves for the call's backward: device memory until the call is done."""
        with _Busy(self):
            if t.device != self.backend.device or t.layout != torch.strided:
                return
            ref = self._locate(t)
            if ref is not None:  # a weight view into a slot: that bucket stays put
                self.held.setdefault(region, set()).add(self.bucket_of[ref.param])
                return
            storage = t.untyped_storage()
            if self.memory.hold(storage.data_ptr(), storage.nbytes()):
                self.reserve = max(0, self.reserve - storage.nbytes())
            self.recompute_holds.setdefault(region, []).append(storage.data_ptr())

    def recompute_end(self, region: int) -> None:
        self.recorder.recompute_end()
        self.recompute_region = None
        self.reserve = 0

    def region_saved(self, block: int, region: int, t: torch.Tensor) -> None:
        """Forward of a checkpointed call: ``t`` is what it would have saved (measured, not kept)."""
        with _Busy(self):
            if t.device == self.backend.device and t.layout == torch.strided and self._locate(t) is None:
                self.ckpt.count(block, region, t)

    def region_done(self, region: int) -> None:
        """The backward of checkpointed call ``region`` is over: its buckets and recomputed tensors go."""
        with _Busy(self):
            i = self.recompute_event.pop(region, None)
            if i is not None:
                self.recorder.region_done(i)
            self.held.pop(region, None)
            for key in self.recompute_holds.pop(region, ()):
                self.memory.drop(key)

    def _profile(self, peak: int) -> ActivationProfile:
        rec = self.recorder
        return profile_of(self.ckpt.blocks, self.ckpt.saved, self.ckpt.inputs,
                          rec.calls(self.ckpt.blocks), self.ckpt.active,
                          self.forward_end_activations or self.memory.parts["activations"], peak)

    def _drop_plan(self) -> None:
        """Run the next step on demand (its calls will differ from the plan's) and plan it at its step()."""
        self.on_plan = False
        self._deactivate()  # every bucket back to the host: nothing resident keeps pre-update weights
        self.plan = self.train_plan = None

    def _choose_checkpoints(self, trace: Trace) -> bool:
        """After the warm-up step (every block checkpointed): checkpoint the fewest blocks that fit the
        budget from now on. True when that changes what is checkpointed."""
        capacity = (self.config.budget - self.memory.parts["buffers"] - trace.max_grad_bytes
                    - min_arena_bytes(trace, self.buckets, self.itemsize))
        base = self.ckpt.active if self.checkpoint_choice is not None else ()  # later: only ever more
        choice = choose_checkpoints(self.profile, capacity, base)
        if not choice.fits:
            need = dict(arena=min_arena_bytes(trace, self.buckets, self.itemsize), activations=choice.activation_bytes,
                        fixed=self.memory.parts["buffers"], grad=trace.max_grad_bytes)
            raise self._activation_hint(budget_error(self.config.budget, **need), capacity)
        self.checkpoint_choice = choice
        if frozenset(choice.modules) == self.ckpt.active:
            return False
        self.ckpt.set_active(choice.modules)
        return True

    def _activation_hint(self, err: BudgetTooSmallError, capacity: int) -> BudgetTooSmallError:
        """``err`` with what activation checkpointing would (or could not) do about it, when activations
        are part of the problem."""
        if not err.breakdown.get("activations"):
            return err
        hint = checkpoint_hint(self.profile, capacity, self.checkpoint_mode)
        if not hint:
            return err
        return BudgetTooSmallError(f"{err} Activations: {hint}.", min_budget_bytes=err.min_budget_bytes,
                                   budget_bytes=err.budget_bytes, breakdown=err.breakdown)

    @property
    def checkpoint_mode(self) -> str:
        spec = self.config.activation_checkpointing
        return "off" if spec is None else ("auto" if spec == AUTO else "modules")

    def checkpoint_stats(self) -> dict:
        """What is checkpointed and what the activations measured, for ``memory_stats()``."""
        names = self.ckpt.blocks
        choice = self.checkpoint_choice
        return {
            "mode": self.checkpoint_mode,
            "checkpointed": [names[m] for m in sorted(self.ckpt.active)],
            "blocks": len(names),
            "estimated_activation_bytes": choice.activation_bytes if choice is not None else None,
            # forward seconds of the checkpointed blocks, as measured: what recomputing adds to backward
            # (the trace's RECOMPUTE events carry the measured time into the scheduler's cost model)
            "recompute_s": (recompute_seconds(self.profile, self.ckpt.active & {b.module for b in self.profile.blocks})
                            if self.profile is not None else None),
            "saved_bytes_per_block": ({b.name: b.saved for b in self.profile.blocks}
                                      if self.profile is not None else {}),
        }

    # ---------------------------------------------------------------------------------------------------
    # weights in and out

    def read_weight(self, p: int) -> torch.Tensor:
        """Current fp32 value of parameter ``p`` (a copy)."""
        if self.original is not None:
            return self.original[p].detach().to(torch.float32, copy=True)
        return self.host.read_param(p).view(self.params[p].shape)

    def write_weight(self, p: int, value: torch.Tensor) -> None:
        with torch.no_grad():
            if self.original is not None:
                self.original[p].copy_(value)
            else:
                self.host.write_master(p, value)

    def after_weights_written(self) -> None:
        """Masters changed behind the plan's back: refresh whatever is on the device."""
        if self.host is None:
            return
        with torch.no_grad():
            self._deactivate()
            if self.plan is not None:
                self._activate(self.plan)

    def close(self) -> None:
        """Give every parameter its trained fp32 value back as an ordinary tensor, and stop the threads."""
        self.remove_hooks()
        try:
            self.cpu.drain()
            self.backend.synchronize()
        finally:
            if self.host is not None:
                for p, param in enumerate(self.params):
                    param.data = self.read_weight(p)  # fp32, as every parameter was when wrapped
            elif self.original is not None:
                for p, param in enumerate(self.params):
                    param.data = self.original[p]
            self.cpu.close()
            self.backend.close()
            self.slot.clear()
            self.arena = None
            self.host = None
