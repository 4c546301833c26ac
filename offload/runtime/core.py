"""The runtime: registers the hooks and executes the plan. It decides nothing the plan has not decided;
where there is no plan yet (the first, traced step) or the step departs from it, it fetches on demand.

Residency of a bucket (one state machine per bucket, transitions asserted; offload/runtime/residency.py):

    HOST --fetch--> IN_FLIGHT --wait--> DEVICE --release--> HOST

This file holds the hooks, the step state, plan following, residency and the traced first step. The other
parts of :class:`Runtime`, one concern each (mixins sharing the state this file sets up):

* offload/runtime/param_access.py: forward uses, saved-tensor pack/unpack, the slot index ([Note: saved
  parameters], [Note: knowing where we are]);
* offload/runtime/grads.py: backward, grads to the host, accumulation, clipping, the optimizer step;
* offload/runtime/forward_only.py: plans of no-grad forwards ([Note: forward-only plans]);
* offload/runtime/recompute_hooks.py: the runtime's side of activation checkpointing.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Sequence

import torch
from torch import nn

from ..backend import DONE
from ..config import OffloadConfig
from ..errors import BudgetTooSmallError
from ..host.state import HostState
from ..optim import AdamW
from ..planning.activations import AUTO, ActivationProfile, CheckpointChoice
from ..planning.buckets import Bucket, ParamSpec, make_buckets
from ..planning.schedule import (
    Plan,
    budget_error,
    build_plan,
    forward_min_budget,
    validate_plan,
)
from ..planning.trace import EventKind, Recorder, Trace
from ..tools.timeline import LaneLog
from . import faults, guards
from .accounting import DeviceMemory
from .forward_only import ForwardOnlyMixin
from .grads import GradientsMixin
from .param_access import ParamAccessMixin, _Busy, _UseDetector
from .recompute import Checkpointer, candidates
from .recompute_hooks import RecomputeMixin
from .residency import _ALLOWED, Residency, _Slot
from .scaler import LossScaler


def _weak_hook(method):
    """``method`` (bound), holding its object weakly; does nothing once the object is gone."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        fn = ref()
        if fn is not None:
            fn(*args)
    return hook


class Runtime(ParamAccessMixin, ForwardOnlyMixin, RecomputeMixin, GradientsMixin):
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
        self.memory = DeviceMemory(headroom=backend.headroom_bytes())  # [Note: headroom] in backend/cuda.py
        self.memory.on_activations = self._activations_grew
        self.placeholders = [backend.placeholder(p.shape, self.dtype) for p in self.params]
        self.grad_headroom = max((s.numel * self.itemsize for s in self.specs if s.group is not None), default=0)
        # AdamW of each bucket, in arrival order
        self.cpu = backend.host_lane("cpu-adam")

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
        self.lane_log = LaneLog()  # copies and updates of the latest steps, for Engine.export_timeline
        self.last_step_skipped = False
        self.backward_seen = False  # a backward ran since the last step() (guards.check_step_has_grads)
        self.guard = guards.ParamGuard(self)
        self.engine_call = False  # a forward called through Engine.__call__, which handles its faults
        self._warned = False
        self._module_index = {}
        self._handles = []
        self._contexts: list = []
        # Activation checkpointing (offload/runtime/recompute.py, [Note: recompute and the parameter buckets]).
        spec = config.activation_checkpointing
        self.auto_checkpoint = spec == AUTO
        blocks = candidates(spec, module)
        if self.auto_checkpoint and not blocks:
            raise ValueError('activation_checkpointing="auto" found no repeated blocks (children of an '
                             "nn.ModuleList or nn.Sequential with submodules) to checkpoint in this model; "
                             "name the modules instead: activation_checkpointing=[\"layers.0\", ...]")
        self.ckpt = Checkpointer(module, self, blocks)
        self.checkpoint_choice: CheckpointChoice | None = None  # what "auto" decided after the warm-up
        # "auto" runs with no block checkpointed where the warm-up says that may fit: the warm-up's (trace,
        # profile), to choose blocks from if that step's plan does not fit (offload/runtime/recompute_hooks.py)
        self.warmup: tuple[Trace, ActivationProfile] | None = None
        self.profile: ActivationProfile | None = None  # activation bytes per block, of the last step
        self._reset_step()
        self._register_hooks()
        faults.watch_root(self)
        if spec is not None:
            self.ckpt.set_active(blocks)  # "auto": the warm-up step checkpoints every block, then chooses

    # ---------------------------------------------------------------------------------------------------
    # hooks

    def _register_hooks(self) -> None:
        for i, m in enumerate(self.module.modules()):
            self._module_index[id(m)] = i
            self._handles.append(m.register_forward_pre_hook(self._pre_hook(i)))
            self._handles.append(m.register_forward_hook(self._post_hook(i)))
        # Tensor hooks are held by the tensor's C++ side, where Python's gc cannot see them: a hook holding the
        # runtime strongly would make runtime -> params -> hook -> runtime an uncollectable cycle, so an engine
        # dropped without close() would never be freed (host arena, threads and all).
        on_grad = _weak_hook(self._on_grad)
        for p, spec in zip(self.params, self.specs):
            if spec.group is not None:
                self._handles.append(p.register_post_accumulate_grad_hook(on_grad))

    def _pre_hook(self, index: int):
        def hook(module, args):
            guards.refuse_compile()
            if self.ckpt.recomputing is not None:
                return  # backward recomputes a checkpointed call: its RECOMPUTE event stands for it
            with _Busy(self):
                if index == 0 and self.recorder.stack:
                    faults.abort_forward(self, None)  # the previous call of the root module raised
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
        self.standin_regions: set[int] = set()  # regions recomputed off plan: weight views saved as stand-ins
        self.recompute_holds: dict[int, list[int]] = {}  # region -> storages of its recomputed tensors

    def _begin_forward(self, root: int) -> None:
        self.backend.begin_forward()  # CUDA: binds to (or checks) the current stream
        faults.check_backward_finished(self, None)  # cleans up after a plain loss.backward() that raised
        self.guard.check()  # replaced, added or reassigned parameters: a clear error, not garbage
        grad_enabled = torch.is_grad_enabled()
        if self.in_backward or self.pos:
            # The previous forward was not followed by a (completed) backward: start over cleanly.
            self._release_all()
        # A no-grad forward follows a forward-only plan (offload/runtime/forward_only.py, [Note: forward-only plans]).
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
            if self.original is not None:  # the traced forward raised: no graph holds an accumulator now
                for p, param in enumerate(self.params):
                    self.backend.bind(param, self.original[p])
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
            self.backend.bind(param, typed[base + off: base + off + param.numel()].view(param.shape))

    def _unbind_params(self, b: int) -> None:
        for p in self.buckets[b].params:
            self.backend.bind(self.params[p], self.placeholders[p])

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
        self.lane_log.add("h2d", b, n * self.itemsize, self.h2d_event[b])
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
        if not self._evict_to_fit(nbytes):
            self.stats["over_budget_fetches"] += 1

    def _evict_to_fit(self, nbytes: int) -> bool:
        """Free finished grad slots, then evict unused on-demand buckets, least recently used first, until
        ``nbytes`` more fit the budget; False if they still do not."""
        limit = self._cache_limit()
        self._reclaim(block=self.memory.current + nbytes > limit)
        protected = set(self.active) | self.node_buckets
        for buckets in self.held.values():  # recomputed weight views point into them (see recompute.py)
            protected |= buckets
        for b in list(self.lru):
            if self.memory.current + nbytes <= limit:
                return True
            if b not in protected and self.state[b] is not Residency.HOST:
                self._release(b)
        return self.memory.current + nbytes <= limit

    def _cache_limit(self) -> int:
        """Device bytes that buckets fetched on demand may fill, with what else is live.

        Off plan, nothing is laid out ahead: a saved activation or a parameter's gradient is allocated by
        autograd before the engine hears of it, so evicting then does not lower the peak already reached.
        The room for the next one is kept free instead: the largest gradient autograd may materialise
        (backward) or the largest storage saved for backward so far, checkpointed blocks' included (forward;
        in backward only a recompute saves, and ``reserve`` holds what it is still to save). The two never land
        in the same phase, so the larger of them is enough. An activation larger than any seen before (a
        longer sequence) can still overshoot, by at most its own size: eviction follows it
        (``_activations_grew``)."""
        headroom = max(self.grad_headroom, self.memory.largest_saved)
        return self.config.budget - headroom - self.reserve

    def _activations_grew(self) -> None:
        """Off plan, buckets fetched on demand stay cached until room is needed; room is needed when saved
        activations grow as much as when another bucket is fetched, so evict the same way (no-op on plan,
        where activations are planned, and while tracing, where nothing is cached)."""
        if self.lru and self.memory.current > self._cache_limit():
            self._evict_to_fit(0)

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

    # ---------------------------------------------------------------------------------------------------
    # after the optimizer step: new weights on the device, or a new plan

    def step(self) -> None:
        with self.backend.compute():  # called outside the user's `with torch.cuda.stream(s)`, perhaps
            GradientsMixin.step(self)

    def _end_backward(self) -> None:
        # Queued on the autograd engine, which runs it on the stream current where backward was called:
        # the runtime's kernels in it (flushing grads) go on the engine's compute stream all the same.
        with self.backend.compute():
            GradientsMixin._end_backward(self)

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
                              fixed_bytes=self.memory.parts["buffers"], hw=self.config.hw,
                              headroom_bytes=self.memory.parts["headroom"])
        except BudgetTooSmallError as e:
            if self.auto_checkpoint and self._choose_checkpoints(trace):
                return self._drop_plan()  # the activations grew (a longer sequence): checkpoint more blocks
            parts = e.breakdown
            raise self._activation_hint(e, self.config.budget - sum(parts.values()) + parts["activations"]) from None
        validate_plan(plan)
        self.warmup = None  # decided: from now on "auto" only ever checkpoints more
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
                                  activations=self.memory.activation_peak, fixed=self.memory.parts["buffers"],
                                  headroom=self.memory.parts["headroom"])
        if sum(need.values()) > self.config.budget:
            self.profile = self._profile(self.memory.activation_peak)
            capacity = self.config.budget - sum(need.values()) + need["activations"]
            raise self._activation_hint(budget_error(self.config.budget, **need), capacity)
        lowp = self.dtype if self.dtype != torch.float32 else None
        host = HostState(buckets, self.specs, [p.shape for p in self.params], lowp,  # may raise HostMemoryError
                         fused=self.optimizer.fused, accumulate=self.deferred)
        self.backend.pin_host(host.arena)  # page-locked once, after first touch (CUDA; no-op on the CPU backend)
        with torch.no_grad():
            for p in range(len(self.params)):
                host.write_master(p, self.original[p])
        self.host, self.buckets, self.bucket_of = host, host.buckets, host.bucket_of
        self.state = [Residency.HOST] * len(buckets)
        self.h2d_by_bucket = [0] * len(buckets)
        self.original = None
        for p, param in enumerate(self.params):
            self.backend.bind(param, self.placeholders[p])
        self._adopt_optimizer_state()
        # Saved references from this forward point at per-parameter copies; from now on they resolve
        # through buckets (backward fetches on demand: there is no plan until this step is recorded).
        self.trace_storage.clear()

    def _adopt_optimizer_state(self) -> None:
        if self.host is not None:
            self.host.adopt_optimizer_state(self.optimizer, self.params)

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
                # A copy in flight (a resident bucket's refresh after step()) may still read the host copy
                # written here: host buffers are touched only after the copies reading them finished.
                self.backend.synchronize()
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
                    self.backend.bind(param, self.read_weight(p))  # fp32, as every parameter was when wrapped
            elif self.original is not None:
                for p, param in enumerate(self.params):
                    self.backend.bind(param, self.original[p])
            self.cpu.close()
            self.backend.close()
            self.slot.clear()
            self.arena = None
            self.host = None
