"""The traced warm-up: the first forward runs before there are buckets. Each parameter keeps its original
(host, fp32) tensor, is copied to a device tensor of its own while a module call uses it, and is recorded;
when that forward ends, the parameters are packed into buckets in first-use order, the budget is checked,
and the host arena is built (``finish``). Its backward then fetches buckets on demand; the first plan is
built at the first ``step()`` from what the step recorded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import BudgetTooSmallError, InvariantError
from ..host.state import HostState
from ..planning.buckets import make_buckets
from ..planning.budget import mirrored_step
from ..planning.schedule import budget_error, build_plan, forward_min_budget
from .phases import Lifecycle
from .residency import ParamRef

if TYPE_CHECKING:
    from ..backend.base import Event
    from ..planning.trace import Recorder
    from .context import RuntimeContext
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
        ctx.backend.bind(param, view)
        self.views[p] = view
        self.storage[storage.untyped_storage().data_ptr()] = p

    def release(self, p: int) -> None:
        view = self.views.pop(p)
        del self.storage[view.untyped_storage().data_ptr()]
        # A placeholder, never the host original: see [Note: one accumulator per parameter].
        self.ctx.backend.bind(self.ctx.params[p], self.ctx.placeholders[p])
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
                self.ctx.backend.bind(param, self.original[p])

    def _estimated_minimum(self, recorder: Recorder, buckets) -> dict[str, int]:
        """The parts of the least budget the planner would accept for this forward with the backward it
        implies (:func:`offload.planning.budget.mirrored_step`): the minimum the first plan would name, where
        the real backward reads what the forward did (issue 18: not a sum of worst cases)."""
        ctx = self.ctx
        forward = recorder.finish()
        step = mirrored_step(forward.events, forward.uses, forward.ends, buckets, list(ctx.specs), ctx.itemsize,
                             activations=ctx.memory.activation_peak, seconds=forward.compute_seconds)
        parts = ctx.memory.parts
        try:
            build_plan(step, buckets, itemsize=ctx.itemsize, budget_bytes=0, fixed_bytes=parts["buffers"],
                       hw=ctx.hw, headroom_bytes=parts["headroom"])
        except BudgetTooSmallError as e:
            return e.breakdown
        raise InvariantError("a step with parameters planned in a device budget of 0 bytes")

    def finish(self, recorder: Recorder, recompute: RecomputeCoordinator, accumulate: bool) -> None:
        """First forward done: pack buckets in first-use order, check the budget, build the host side."""
        ctx = self.ctx
        memory, budget = ctx.memory, ctx.budget
        touched = list(recorder.touched)
        seen = set(touched)
        order = touched + [p for p in range(len(ctx.params)) if p not in seen]
        buckets = make_buckets(list(ctx.specs), order, ctx.bucket_bytes, ctx.itemsize)
        floor = forward_min_budget(recorder.events, recorder.uses, recorder.ends, buckets, list(ctx.specs),
                                   ctx.itemsize, activations=memory.activation_peak, fixed=memory.parts["buffers"],
                                   headroom=memory.parts["headroom"])
        if sum(floor.values()) > budget:  # too small for sure; above the floor, the first plan decides
            recompute.measure(recorder, memory.activation_peak)
            need = self._estimated_minimum(recorder, buckets)
            capacity = budget - sum(need.values()) + need["activations"]
            raise recompute.activation_hint(budget_error(budget, **need), capacity)
        lowp = ctx.dtype if ctx.dtype != torch.float32 else None
        shapes = [p.shape for p in ctx.params]
        host: HostState  # may raise HostMemoryError
        if ctx.dp is None:
            host = HostState(buckets, list(ctx.specs), shapes, lowp, fused=ctx.optimizer.fused, accumulate=accumulate)
        else:  # issue 20: this rank's shard of the optimizer state (offload/host/shard.py)
            host = ctx.dp.host_state(buckets, list(ctx.specs), shapes, ctx.dtype, ctx.optimizer.fused, accumulate)
        ctx.backend.pin_host(host.arena)  # page-locked once, after first touch (CUDA; no-op on the CPU backend)
        original = self.originals()
        with torch.no_grad():
            for p in range(len(ctx.params)):
                host.write_master(p, original[p])
        self.slots.adopt(host)
        self.original = None
        ctx.phases.become(Lifecycle.RUNNING)
        for p, param in enumerate(ctx.params):
            ctx.backend.bind(param, ctx.placeholders[p])
        host.adopt_optimizer_state(ctx.optimizer, list(ctx.params))
        # Saved references from this forward point at per-parameter copies; from now on they resolve
        # through buckets (backward fetches on demand: there is no plan until this step is recorded).
        self.storage.clear()
