"""The traced warm-up: the first forward runs before there are buckets. Each parameter keeps its original
(host, fp32) tensor, is copied to a device tensor of its own while a module call uses it, and is recorded;
when that forward ends, the parameters are packed into buckets in first-use order, the budget is checked,
and the host arena is built (``finish``). Its backward then fetches buckets on demand; the first plan is
built at the end of that backward from what the step recorded (``check_first_plan``), before any update.

[Note: refusing the first step whole] (issue 18) The floor checked when the first forward ends refuses only
budgets too small for sure; above it, the exact minimum exists only once a backward was seen. Two checks make
a budget between the two fail with no update applied and, where it can be known, nothing over the budget:
* in the first step's backward, an on-demand allocation (a bucket, a grad slot) that does not fit the budget
  after eviction beside the largest gradient autograd may make (``SlotTable.make_room``) calls
  ``over_budget``. If it would go over the budget with the gradients of its bucket that autograd has still to
  make (the node that needs a bucket makes them next) and the minimum the forward implies
  (:func:`mirrored_step`, what the warm-up names under the floor) is above the budget, it refuses at once,
  naming that minimum (not while a checkpointed block is recomputed); otherwise it goes ahead (counted in ``over_budget_fetches``) and the next check decides.
* when that backward ends, the plan ``step()`` would execute is built (``PlanExecutor.check_ahead``): under
  the exact minimum it refuses there. Overlapped updates of the first step are held until then
  (``GradPipeline.release_held``); deferred ones run in ``step()``. So no weight and no AdamW state changed.
A refusal drops the step's gradients (``Runtime.abort_backward``, as a failed backward, without a warning):
the engine stays usable, and another step at the same budget is refused the same way.

Not guaranteed: the implied minimum is an estimate (exact for a stack of layers), so a budget at or above the
exact minimum is refused by the first check where its on-demand backward is about to go over (the allocation
with its bucket's gradients to come; at the exact minimum of the tests' models it is not, and trains); the
on-demand step may still go over where the first check lets
it (the implied minimum at or under the budget: the plan fits where fetching on demand does not, or a gradient
of another bucket lands beside it); the first forward of a budget under its floor may go over before the
floor refuses it; ``activation_checkpointing="auto"`` keeps refusing at ``step()`` (it answers a budget too
small by checkpointing more blocks there); a later re-plan (a step that departs) still fails at ``step()``.

[Note: the first step's host memory] (issue 18)
The first step runs before any plan exists (the traced warm-up), yet the host must hold the masters from
its first forward on. Laying out every bucket's master, 16-bit copy, m and v then (as before) made the
peak host RAM of a run that of a host-only run, however much of the optimizer the plan puts on the
device. So, with ``device_optimizer``:
* when the first forward ends, the warm-up estimates the first plan's device-homed buckets from that
  forward and the backward it implies (``_predicted_away``); they start device-homed and *fresh*: a
  parked copy of their master and 16-bit copy (what the first backward fetches and the device state
  starts from), no m and v (zeros until the first update: ``HostState.materialize`` makes them
  only where the host needs them) and no arena region. The arena is the plan's from the start.
* the first step's update of such a bucket waits for the plan (overlapped: its grads are held on the
  host until the plan is known anyway, [Note: refusing the first step whole] above; deferred: its fp32 sum).
  If the first plan keeps the bucket's optimizer on the device, the update runs there, right after
  ``step()`` activates the plan (m and v start as zeros on the device: ``DeviceOptimizer.activate``,
  ``_run_postponed``), and the parked copy is freed. If the host needs the values first (a forward, a
  read of the state, ``close``), or the plan keeps the bucket home, it runs on the host, as before.
* a wrong estimate costs memory, not numbers: where the buckets it got wrong hold little beside the
  arena, a bucket the plan keeps home stays parked (its copy serves the host optimizer) and one the plan
  puts on the device keeps its regions, stale; else the arena is laid out again, holding the old and the
  new one for a moment, as every first step did before (``DeviceOptimizer._relayout_pays``).
Peak host bytes, then: the plan's arena, the masters and 16-bit copies of the device-homed buckets until
their first update, and (overlapped) the first step's held grads, instead of the whole host state plus
the plan's arena. ``HostState.host_bytes`` counts what this state holds, ``memory_stats()["host_peak_bytes"]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from ..errors import BudgetTooSmallError, InvariantError
from ..host.state import HostState
from ..planning.buckets import make_buckets
from ..planning.budget import mirrored_step
from ..planning.schedule import budget_error, build_plan, forward_min_budget
from .device_optim import read_after_update
from .idle_params import bind_placeholder, show
from .phases import Lifecycle, Pass
from .residency import ParamRef

if TYPE_CHECKING:
    from ..backend.base import Event
    from ..planning.trace import Recorder, Trace
    from .context import RuntimeContext
    from .executor import PlanExecutor
    from .grads import GradPipeline
    from .recompute_hooks import RecomputeCoordinator
    from .slots import SlotTable


class TracedWarmup:
    """The first, traced forward: per-parameter device copies, then buckets and the host arena."""

    def __init__(self, ctx: RuntimeContext, slots: SlotTable) -> None:
        self.ctx = ctx
        self.slots = slots
        # Before the first forward has been traced, parameters keep their original (host) tensors.
        self.original: list[torch.Tensor] | None = [p.data for p in ctx.params]
        self.views: dict[int, torch.Tensor] = {}  # param -> its own device copy while tracing
        self.storage: dict[int, int] = {}  # storage ptr -> param, for those copies
        # issue 18 ([Note: refusing the first step whole]): the first forward and its activation peak, until
        # the first plan is built; the minimum they imply, once asked for; what checks and refuses
        self.forward: tuple[Trace, int] | None = None
        self.implied: dict[str, int] | None = None
        self._executor: PlanExecutor | None = None
        self._recompute: RecomputeCoordinator | None = None
        self._grads: GradPipeline | None = None
        self._abort_backward: Callable[[], Any] = lambda: None

    def guard_first_step(self, executor: PlanExecutor, recompute: RecomputeCoordinator, grads: GradPipeline,
                         abort_backward: Callable[[], Any]) -> None:
        """Wire the checks of [Note: refusing the first step whole]: ``abort_backward`` drops a step's grads."""
        self._executor, self._recompute, self._grads = executor, recompute, grads
        self._abort_backward = abort_backward

    def originals(self) -> list[torch.Tensor]:
        if self.original is None:
            raise InvariantError("the original parameter tensors are used after the traced warm-up")
        return self.original

    def fetch(self, p: int, recorder: Recorder, boundary: Event) -> None:
        """Parameter ``p`` is used: copy it to a device tensor of its own (once, until ``release``)."""
        if p in self.views:
            return
        ctx = self.ctx
        param = ctx.params[p]
        nbytes = param.numel() * ctx.itemsize
        recorder.exclude_begin()  # the warm-up's synchronous fetches are not compute (trace.overhead)
        self.slots.make_room(nbytes)
        storage = ctx.backend.empty(nbytes)
        ctx.memory.add("slots", nbytes)
        view = storage.view(ctx.dtype).view(param.shape)
        ctx.stats["h2d_bytes"] += nbytes
        # Rounded to the device dtype here, so the copy moves the slot's bytes and converts nothing on the
        # device (see [Note: stream-ordered memory] in backend/cuda.py).
        src = self.originals()[p].detach().to(ctx.dtype)
        ctx.backend.wait(ctx.backend.h2d(view, src, [boundary]))
        recorder.exclude_end()
        show(param)
        ctx.backend.bind(param, view)
        self.views[p] = view
        self.storage[storage.untyped_storage().data_ptr()] = p

    def release(self, p: int) -> None:
        view = self.views.pop(p)
        del self.storage[view.untyped_storage().data_ptr()]
        # A placeholder, never the host original: see [Note: one accumulator per parameter].
        bind_placeholder(self.ctx, p)
        self.ctx.memory.add("slots", -view.numel() * self.ctx.itemsize)

    def locate(self, key: int, byte: int, t: torch.Tensor) -> ParamRef | None:
        p = self.storage.get(key)
        if p is None:
            return None
        return ParamRef(p, byte, tuple(t.shape), t.stride(), t.dtype)

    def abort(self) -> None:
        """The traced forward raised: no graph holds an accumulator now, so the originals come back."""
        for p in list(self.views):
            self.release(p)
        if self.original is not None:
            for p, param in enumerate(self.ctx.params):
                show(param)
                self.ctx.backend.bind(param, self.original[p])

    def _estimated_minimum(self, forward: Trace, activations: int, buckets) -> dict[str, int]:
        """The parts of the least budget the planner would accept for this forward with the backward it
        implies (:func:`offload.planning.budget.mirrored_step`): the minimum the first plan would name, where
        the real backward reads what the forward did (issue 18: not a sum of worst cases)."""
        ctx = self.ctx
        step = mirrored_step(forward.events, forward.uses, forward.ends, buckets, list(ctx.specs), ctx.itemsize,
                             activations=activations, seconds=forward.compute_seconds)
        parts = ctx.memory.parts
        try:
            build_plan(step, buckets, itemsize=ctx.itemsize, budget_bytes=0, fixed_bytes=ctx.memory.fixed,
                       hw=ctx.hw, headroom_bytes=parts["headroom"])
        except BudgetTooSmallError as e:
            return e.breakdown
        raise InvariantError("a step with parameters planned in a device budget of 0 bytes")

    def _predicted_away(self, forward: Trace, activations: int, buckets, recompute: RecomputeCoordinator
                        ) -> frozenset[int]:
        """The buckets the first training plan will likely keep with their optimizer on the device, from this
        forward and the backward it implies (:func:`mirrored_step`, as the minimum budget is estimated), at the
        engine's budget: their host state starts parked and fresh ([Note: the first step's host memory]).
        None without ``device_optimizer``, with "auto" checkpointing (its first plan comes later), or where
        that plan does not fit."""
        ctx = self.ctx
        if not ctx.config.device_optimizer or recompute.auto:
            return frozenset()
        step = mirrored_step(forward.events, forward.uses, forward.ends, buckets, list(ctx.specs), ctx.itemsize,
                             activations=activations, seconds=forward.compute_seconds)
        try:
            plan = build_plan(step, buckets, itemsize=ctx.itemsize, budget_bytes=ctx.budget,
                              fixed_bytes=ctx.memory.fixed, hw=ctx.hw, headroom_bytes=ctx.memory.parts["headroom"],
                              device_optimizer=True, deferred=not ctx.config.overlap_optimizer,
                              refresh_pipelined=ctx.dp is None)
        except BudgetTooSmallError:
            return frozenset()
        return frozenset(plan.device_optimizer) - read_after_update(plan)

    def finish(self, recorder: Recorder, recompute: RecomputeCoordinator, accumulate: bool) -> None:
        """First forward done: pack buckets in first-use order, check the budget, build the host side."""
        ctx = self.ctx
        memory, budget = ctx.memory, ctx.budget
        touched = list(recorder.touched)
        seen = set(touched)
        order = touched + [p for p in range(len(ctx.params)) if p not in seen]
        buckets = make_buckets(list(ctx.specs), order, ctx.bucket_bytes, ctx.itemsize)
        if ctx.dp is not None:  # issue 20: grad slots padded to their shards where reduced on the device, and
            buckets = ctx.dp.pad_buckets(buckets)  # the node's shared copy, or the weights' gather buffers
            ctx.dp.prepare_copy(ctx.backend, memory, ctx.stats, buckets, ctx.itemsize, ctx.dtype)
        floor = forward_min_budget(recorder.events, recorder.uses, recorder.ends, buckets, list(ctx.specs),
                                   ctx.itemsize, activations=memory.activation_peak, fixed=memory.fixed,
                                   headroom=memory.parts["headroom"])
        forward = recorder.finish()
        if sum(floor.values()) > budget:  # too small for sure; above the floor, the first plan decides
            recompute.measure(recorder, memory.activation_peak)
            need = self._estimated_minimum(forward, memory.activation_peak, buckets)
            capacity = budget - sum(need.values()) + need["activations"]
            raise recompute.activation_hint(budget_error(budget, **need), capacity)
        lowp = ctx.dtype if ctx.dtype != torch.float32 else None
        shapes = [p.shape for p in ctx.params]
        host: HostState  # may raise HostMemoryError
        if ctx.dp is None:
            away = self._predicted_away(forward, memory.activation_peak, buckets, recompute)
            host = HostState(buckets, list(ctx.specs), shapes, lowp, fused=ctx.optimizer.fused, accumulate=accumulate,
                             away=away)
        else:  # issue 20: this rank's shard of the optimizer state (offload/host/shard.py)
            host = ctx.dp.host_state(buckets, list(ctx.specs), shapes, ctx.dtype, ctx.optimizer.fused, accumulate)
        ctx.backend.pin_host(host.arena)  # page-locked once, after first touch (CUDA; no-op on the CPU backend)
        original = self.originals()
        with torch.no_grad():
            for p in range(len(ctx.params)):
                host.write_master(p, original[p])
        if ctx.dp is not None and ctx.dp.node_copy is not None:  # issue 20: [Note: one host copy per node]
            ctx.backend.pin_host(ctx.dp.node_copy)
            ctx.dp.copy_written()  # every rank's part of it is in before any fetch reads it
        self.slots.adopt(host)
        self.original = None
        ctx.phases.become(Lifecycle.RUNNING)
        for p in range(len(ctx.params)):
            bind_placeholder(ctx, p)
        host.adopt_optimizer_state(ctx.optimizer, list(ctx.params))
        # Saved references from this forward point at per-parameter copies; from now on they resolve
        # through buckets (backward fetches on demand: there is no plan until this step is recorded).
        self.storage.clear()
        if not recompute.auto:  # "auto" answers a budget too small by checkpointing (at step())
            self.forward = (forward, memory.activation_peak)

    # -- [Note: refusing the first step whole] (issue 18) ---------------------------------------------------

    def over_budget(self, nbytes: int, bucket: int | None) -> None:
        """Off plan, ``nbytes`` more (for ``bucket``) cannot fit the budget even after eviction, with room kept
        for the largest gradient autograd may make (``SlotTable.make_room``, ``cache_limit``). In the first
        step's backward, refuse now, before allocating, if with the gradients of ``bucket`` still to come it
        would go over the budget and the forward's implied minimum is above the budget."""
        ctx, executor = self.ctx, self._executor
        if (self.forward is None or executor is None or executor.train_plan is not None
                or ctx.phases.current is not Pass.BACKWARD):
            return  # not while a checkpointed block is recomputed (its coordinator's state): the end decides
        if self.implied is None:
            forward, activations = self.forward
            self.implied = self._estimated_minimum(forward, activations, self.slots.buckets)
        need = self.implied
        if ctx.memory.current + nbytes + self._largest_grad_to_come(bucket) <= ctx.budget:
            return  # in backward only a gradient autograd makes lands unplanned: there is room for it
        if sum(need.values()) <= ctx.budget:
            return  # the plan may fit where fetching on demand does not: the end of backward decides
        self._abort_backward()
        error = budget_error(ctx.budget, **need)
        if self._recompute is not None:
            error = self._recompute.activation_hint(error, ctx.budget - sum(need.values()) + need["activations"])
        raise error

    def _largest_grad_to_come(self, bucket: int | None) -> int:
        """Bytes of the largest gradient of ``bucket`` autograd has still to make in this backward: the node
        that needs a bucket's weights (or sends its first gradient) makes its gradients next, beside them."""
        if bucket is None or self._grads is None:
            return 0
        ctx = self.ctx
        arrived = self._grads.received.get(bucket, set())  # gathered; one autograd has just made is counted
        return max((ctx.specs[p].numel * ctx.itemsize for p in self.slots.buckets[bucket].params
                    if ctx.specs[p].group is not None and p not in arrived and ctx.params[p].grad is None),
                   default=0)

    def check_first_plan(self) -> None:
        """The end of a backward: with no training plan yet, build it now (the exact minimum), and refuse
        with the step's grads dropped if the budget is under it."""
        executor, recompute = self._executor, self._recompute
        if executor is None or recompute is None or executor.train_plan is not None:
            return
        try:
            executor.check_ahead(recompute)
        except BudgetTooSmallError:
            self._abort_backward()
            raise
        self.forward = self.implied = None  # the plan fits: the estimate is not needed any more
