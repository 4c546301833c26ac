"""The plan executor: follows the plan being executed event by event, runs the prefetches and releases the
plan hangs on each event, notices when a step departs from it, and owns the arena the plan is laid out in.

[Note: the plan is a cache of the trace] A plan is valid only while execution follows the traced order.
Every hook reports its event (``advance``); the next planned event is checked cheaply against it. On a
mismatch the step leaves the plan (``leave``): it finishes on demand, within the budget, and a new plan is
built at ``step()`` from what this step recorded. It never hangs.

[Note: timing compute] The plan's cost model takes each event's compute time from the step it was planned
from. The first plan comes from the first, traced step, timed by the host's clock between hooks. On the CPU
backend compute runs on the host, so that is compute (plus the warm-up's own work, excluded where it waits
or fetches). On CUDA it is not: kernels run behind the host, and the first step pays for lazy
initialisation (the CUDA context's libraries, each kernel's first load). Measured on an H200, gpt2-xl: 2.62 s
traced where forward + backward took 0.056 s, so the plan predicted 2.95 s for a 0.645 s step
(benchmarks/results/2026-11-27-h200). A planner that believes compute is 40x longer than it is hides every
copy and every CPU update behind it, and never trades budget for speed.

So, with ``calibrate_compute`` (on for CUDA by default), the first full step that follows a new training plan
to its end is timed with the backend's clock of compute (:meth:`Backend.timer`: on CUDA a timing event on
the compute stream at every hook, and around every wait so that a stall is not counted as compute: a grad
copy's host wait for the CPU lane to free its ring bytes too, since an H200 run counted it). If the
compute it measured is more than ``RETIME_BEYOND`` off the plan's, the plan is stale and ``step()`` plans
again from this step's record; either way the plan is checked and no later step is timed (a plan built from
a timed record is checked already). A step that departs plans again from its own host-timed record, and the
next plan is checked the same way. What it costs: one more full step's record with a mark per hook (an event
record each, a few microseconds) and one wait for the compute stream at that step's end; a re-plan (the
arena laid out again) where the times were off. ``memory_stats()["compute_timing"]`` shows the last check.

Not covered: forward-only (evaluation) plans keep their host-timed record; ``activation_checkpointing="auto"``
chooses its blocks once, by plans built from the first step's times, and the re-plan keeps that choice; a fast
step ([Note: the fast path]) is never timed (it is never the first step of a plan); the timed step runs the
full path's hooks, so a GPU that outruns them idles between kernels and the measured compute is what the full
path feeds it. On an H200 (benchmarks/results/2026-11-27-h200, run 4) a timed step of 8 x Linear(2048) read 13.1
ms against 4.5 ms of the same forward + backward outside the engine, the ring waits left out: that gap is not
explained yet (host-bound hooks, or the CPU AdamW's threads beside the launching ones).

[Note: the refresh pipelined] (issue 18) With overlapped updates, ``step()`` used to drain the CPU lane
(``GradPipeline.run_step``) and only then copy the resident buckets' new 16-bit weights in (``refresh``): PCIe
idle while the lane finished, the lane while PCIe refreshed, and the next forward waits for those copies (H200,
benchmarks/results/2026-11-27-h200 runs 7-8, gpt2-xl at 8 GiB all resident: 3.1 GB, ~57-64 ms after the lane's
last update, in a 0.53-0.55 s step bound at 0.30 s by the CPU AdamW). So now, before it drains the lane,
``step()`` (``refresh_as_updated``) issues the refresh of each bucket the lane updated this step, each copy
after its own bucket's update only (``SlotTable.copy_in``'s ``adam_event``): first those whose update has
already ended (that event's ``query()``: asked, never waited for), in the order the next forward first uses
them (the training plan's first ``need``); then the others in the lane's order (``GradPipeline.lane_order``:
that of their updates, general chain and fast send alike): the lane's order alone put the first layers last
(test_steady.py: 6.4 s against 7.2 s). But where the bucket used first is the lane's next update (the first not
ended), its copy goes first: queued behind the ended ones it was late (session 23: an 8-layer chain on pcie4
waited 82 us at its first layer, its plan went to streaming). ``planning.steady.issue_order``. On CUDA no stream
can wait for a host thread: ``step()`` blocks until bucket b's update ends, then enqueues b's copy, so each copy
runs beside the lane's later updates; on the CPU backend the copy lane waits. Then the lane drains and
``after_step`` refreshes what is left (buckets whose update did not run on this lane), and the fast path's
``settle`` runs once, after both. As before: a failed update raises where it did (its event is done, so its
copy may come earlier: on CUDA from the copy's wait in ``step()``, once the lane has drained, ``run_step``'s
``finally``; from the drain if it was the lane's last item; else from the next forward's wait for its copy);
``after_step`` re-plans without a copy issued into the old plan's slots (``replans_at_step`` is asked first,
and nothing between changes its answer without data parallel); device-optimizer buckets are not refreshed;
deferred updates (and so the float16 overflow skip) and data parallel (``agree_refresh``) refresh after the
drain; a forward between backward and ``step()`` reads the weights before the update. The saving is
predicted, not measured (no GPU since): on that H200 case up to ~57-64 ms a step; it costs a host wake-up and
GIL take per bucket while the lane runs ([Note: the cost of a lane item] in backend/base.py). The simulator
models this order with ``refresh_pipelined`` ([Note: the refresh pipelined, modelled] in planning/simulate.py).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from ..errors import BudgetTooSmallError, InvariantError, OffloadWarning
from ..planning.schedule import Plan
from ..planning.steady import issue_order
from ..planning.trace import EventKind, Recorder, Trace
from .departures import Departures, Where
from .plan_builder import PlanBuilder
from .residency import Residency, Slot
from .unforeseen_reads import UnforeseenReads

RETIME_BEYOND = 0.25  # [Note: timing compute]: plan again where the measured compute is off by more than this

if TYPE_CHECKING:
    from ..backend.base import Timer
    from .context import RuntimeContext
    from .device_collectives import RefreshCopy
    from .device_optim import DeviceOptimizer
    from .forward_only import EvalPlans
    from .recompute_hooks import RecomputeCoordinator
    from .slots import SlotTable


class PlanExecutor:
    """Plan position, prefetch and release actions, leaving and re-entering a plan, the arena."""

    def __init__(self, ctx: RuntimeContext, slots: SlotTable, evals: EvalPlans) -> None:
        self.ctx = ctx
        self.slots = slots
        self.evals = evals
        self.plan: Plan | None = None  # the plan being executed: train_plan or a forward-only plan
        self.train_plan: Plan | None = None  # forward + backward, from a recorded training step
        self.arena: torch.Tensor | None = None  # the plan's device memory, while it is executed
        self.recorder = Recorder()  # what this step did (compared with the plan, and the next plan's input)
        self.trace: Trace | None = None  # the latest forward + backward recorded
        self.pos = 0  # next plan event
        self.on_plan = False  # this step follows ``plan`` so far
        self.stale = False  # this step departed (or outgrew the plan): plan again at step()
        # the plan no longer fits beside the transients learnt ([Note: transients] in accounting.py): plan again
        # at step()
        self.refit = False
        self.grad_enabled = True  # grad mode of this step's forward
        self._leaving: list[Callable[[], None]] = []  # what must move out of the arena before it goes
        self.device_state: DeviceOptimizer | None = None  # issue 18: optimizer state kept in the arena
        self.departures = Departures()  # [Note: steps that keep departing] (departures.py)
        self._copied_in: list[Callable[[], None]] = []  # told when copies into slots were issued between passes
        self._lands_at_once: list[Callable[[], bool]] = []  # see after_copying_in
        # Views into the arena built once per arena (the grad pipeline's per-parameter grad views): dropped with
        # it, so no cached view keeps a freed arena's memory alive (issue 17, the hot path)
        self._arena_views: dict[object, dict[int, torch.Tensor]] = {}
        self._arena_slices: dict[tuple[int, int], torch.Tensor] = {}  # arena_view's, by (offset, numel)
        self.ahead: tuple[Trace, Plan] | None = None  # issue 18: the first plan, built as its backward ended
        self._issued_early: set[int] = set()  # refreshes step() issued as their updates ended (refresh_as_updated)
        self._first_use: tuple[Plan | None, dict[int, int]] = (None, {})  # per bucket: its first need, per plan
        # [Note: timing compute]: the training plan whose compute times were checked (or came from a timed
        # record), the backend's timer once made, and what the last check found
        self.checked: Plan | None = None
        self._timer: Timer | None = None
        self.timing: dict[str, object] | None = None
        self._untimed = False  # the timer failed once: no step is timed again
        self._planned_uses: tuple[Plan, list[frozenset[int]]] | None = None  # check_use's, once per plan
        self.unforeseen = UnforeseenReads(slots)
        self.builder = PlanBuilder(ctx, slots)  # the planner at the budget, beside the transients learnt

    def before_leaving(self, fn: Callable[[], None]) -> None:
        self._leaving.append(fn)

    def after_copying_in(self, fn: Callable[[], None], lands_at_once: Callable[[], bool] | None = None) -> None:
        """``fn`` runs after ``activate`` and ``refresh`` issued their copies (the fast path waits for them);
        ``lands_at_once()``: whether it lands every copy in flight before returning (then a refreshed bucket's
        parameters stay bound to its slot: [Note: parameters show landed slots] in slots.py)."""
        self._copied_in.append(fn)
        if lands_at_once is not None:
            self._lands_at_once.append(lands_at_once)

    def reset_step(self) -> None:
        self.pos = 0
        self.on_plan = self.plan is not None and self.arena is not None
        self.recorder = Recorder(self._step_timer())
        self.slots.reset_step()

    def _step_timer(self) -> Timer | None:
        """The backend's timer where this step checks its plan's compute times ([Note: timing compute])."""
        plan = self.plan
        if (not self.ctx.config.calibrate_compute or self._untimed or not self.on_plan or not self.grad_enabled
                or plan is None or plan is not self.train_plan or plan is self.checked):
            return None
        if self._timer is None:
            self._timer = self.ctx.backend.timer()
        return self._timer

    def choose(self, root: int, grad_enabled: bool) -> None:
        """A forward of module ``root`` starts: a training forward follows the training plan, a no-grad one
        a forward-only plan ([Note: forward-only plans]). Switching plans frees one arena before the other
        is allocated."""
        self.grad_enabled = grad_enabled
        want = self.train_plan if grad_enabled else self.evals.plan_for(root)
        if want is not self.plan and self.slots.host is not None:
            self.deactivate()
            self.plan = want
        if self.plan is not None and self.arena is None:
            self.activate(self.plan)  # after a departure from it, or a switch of plans

    # -- following ------------------------------------------------------------------------------------------

    def advance(self, kind: EventKind, key: int) -> None:
        if not self.on_plan:
            return
        plan = self.plan
        if plan is None:
            raise InvariantError("on plan without a plan")
        events = plan.trace.events
        pos = self.pos
        if pos >= len(events):
            self.leave(Where(None, (kind, key)))
            return
        event = events[pos]
        at: int | None = pos
        if event.kind != kind or event.key != key:
            at = self.unforeseen.at(plan, pos, kind, key)  # [Note: reads the plan did not foresee]
            if at is None:
                self.leave(Where((event.kind, event.key), (kind, key)))
            if at is None or at < 0:
                return
        while True:  # up to ``at``: the actions of planned reads that did not come, then of the event that came
            self.pos = pos + 1
            actions = plan.actions[pos]
            if actions.release:
                for k in actions.release:
                    self._release_buffer(plan, k)
            if actions.prefetch:
                for k in actions.prefetch:
                    self._prefetch(plan, k)
            if actions.need:
                for b in actions.need:
                    self.need(b)
            if pos == at or not self.on_plan:
                return
            pos += 1

    def check_use(self, p: int) -> None:
        """A training forward's call reads parameter ``p``: if its planned call did not, the step departs now, in
        forward, so that its backward's reads count as unknown ([Note: a departed step's updates wait] in
        device_optim.py). Otherwise a read of a resident weight (``F.linear(h, w.detach())``) went unnoticed until
        its backward read it, maybe after the update of its bucket, which the departure then fetched again."""
        plan, stack = self.plan, self.recorder.stack
        if plan is None or not stack or not self.grad_enabled or self.pos > plan.trace.num_forward:
            return
        uses = self._planned_uses
        if uses is None or uses[0] is not plan:
            uses = self._planned_uses = (plan, [frozenset(u) for u in plan.trace.uses])
        i = stack[-1]
        if i >= len(uses[1]) or p not in uses[1][i]:
            self.leave(Where(reason="in forward, where a module call read a parameter its planned call did not"))

    def need(self, b: int) -> None:
        """Make compute wait until bucket ``b`` is on the device; fetch it now if it is not coming."""
        slots = self.slots
        state = slots.state[b]
        if state is Residency.DEVICE:
            slots.touch(b)
            return
        rec = self.recorder
        rec.exclude_begin()  # waiting is not compute: the cost model simulates it (trace.overhead)
        if state is Residency.HOST:
            if self.on_plan:
                self.leave(Where(reason="where a bucket its plan had not brought was needed"))
            slots.fetch_on_demand(b)
        slots.land(b)
        rec.exclude_end()

    def leave(self, where: Where = Where(reason="where its plan did not foresee")) -> None:
        """The step departs from the plan: finish it on demand, within the budget, and plan again at
        ``step()``. The arena goes (its layout only fits the plan); grads gathered in it move out first."""
        self.departures.left(where)  # [Note: steps that keep departing] (departures.py)
        self.on_plan = False
        self.ctx.stats["plan_departures"] += 1
        if self.grad_enabled:
            self.stale = True
        with torch.no_grad():
            self.ctx.backend.synchronize()
            for move_out in self._leaving:
                move_out()
            self.deactivate()

    def leave_keeping_weights(self) -> None:
        """A fast step departs from its all-resident plan ([Note: the fast path] in fast_path.py): grads
        gathered in plan buffers move out and the rest are gathered on demand, since the plan's buffer
        lifetimes no longer hold; the resident weights stay where saved views point. No re-plan: a fast
        step's record is too thin to plan from, the next (full) step is planned from if it departs too."""
        self.departures.left(Where(reason="in a fast step's backward, whose grads came in another order"))
        self.on_plan = False
        self.ctx.stats["plan_departures"] += 1
        with torch.no_grad():
            self.ctx.backend.synchronize()
            for move_out in self._leaving:
                move_out()

    def leave_unless_followed(self) -> None:
        """The end of backward: a step that did not reach the end of its plan departed from it."""
        plan = self.plan
        if self.on_plan and plan is not None and self.pos != len(plan.trace.events):
            self.leave(Where(reason="at the end of backward, before its plan's end"))

    def inner_pass_ends(self) -> bool:
        """A backward pass ends on the plan and the plan goes on with another backward pass of the same step
        ([Note: a backward pass inside a step] in step_passes.py): the next planned event is an unpack or a grad."""
        plan = self.plan
        if not self.on_plan or plan is None:
            return False
        events, pos = plan.trace.events, self.pos
        return plan.trace.num_forward < pos < len(events) and events[pos].kind in (EventKind.UNPACK, EventKind.GRAD)

    def record_step(self, activation_peak: int) -> None:
        """The end of backward: this step's record becomes the trace the next plan is built from."""
        rec = self.recorder
        rec.activation_peak = activation_peak
        if self.plan is not None and activation_peak > self.plan.activation_bytes:
            self.stale = True  # same calls, larger activations (a longer sequence): plan again at step()
        if rec.timer is None:
            self.trace = self.unforeseen.plan_from(rec.finish())  # [Note: reads the plan did not foresee]
            return
        try:
            trace = rec.finish()
        except RuntimeError as e:  # a diagnostic must not end the training: say so, and go on with host times
            self._untimed = True
            rec.timer = None
            self.trace = self.unforeseen.plan_from(rec.finish())
            warnings.warn(f"offload: timing this step's compute on the device failed ({e}); the plan keeps the "
                          "compute times it was built with and no later step is timed ([Note: timing compute]; "
                          "calibrate_compute=False turns the timing off)", OffloadWarning, stacklevel=2)
            return
        self.trace = self.unforeseen.plan_from(trace)
        self._check_compute(trace)

    def _check_compute(self, trace: Trace) -> None:
        """A timed step's record is in ([Note: timing compute]): if it followed the training plan to its end,
        compare the compute it measured with the plan's; more than ``RETIME_BEYOND`` off, plan again."""
        plan = self.train_plan
        self.ctx.stats["timed_steps"] += 1
        if plan is None or self.plan is not plan or not self.on_plan:
            return  # it departed: stale already, and planned again from this record (a timed one)
        planned, measured = sum(plan.trace.compute_seconds), sum(trace.compute_seconds)
        off = abs(measured / planned - 1) if planned > 0 else float("inf")
        self.checked = plan
        replan = off > RETIME_BEYOND
        if replan:
            self.stale = True
            self.ctx.stats["compute_replans"] += 1
        self.timing = {"planned_compute_s": planned, "measured_compute_s": measured,
                       "planned_from": plan.trace.clock, "replanned": replan}

    def rewind(self) -> None:
        """The pass is over: the next one starts at the plan's first event."""
        self.pos = 0

    def followed(self) -> bool:
        """This step followed its plan to the end."""
        return self.on_plan and self.plan is not None and self.pos == len(self.plan.trace.events)

    # -- the arena ------------------------------------------------------------------------------------------

    def activate(self, plan: Plan) -> None:
        """Make ``plan`` the one executed: allocate its arena and bring in its resident buckets."""
        ctx, slots = self.ctx, self.slots
        for b in [b for b, slot in slots.slot.items() if slot.planned is None]:
            slots.release(b)  # fetched on demand off plan (a submodule called outside the root): its own slot goes
        self.plan = plan
        self.arena = arena = ctx.backend.empty(plan.arena_bytes)
        self._arena_views, self._arena_slices = {}, {}
        ctx.memory.add("arena", plan.arena_bytes)
        slots.mark_boundary()
        for b in plan.resident:
            k = plan.resident_buffer[b]
            if k is None:
                raise InvariantError(f"plan: resident bucket {b} has no buffer")
            slots.copy_in(b, Slot(arena, plan.buffers[k].offset, k), [slots.boundary])
        if self.device_state is not None:
            self.device_state.activate(plan, arena)  # issue 18: device-optimizer state in from the host
        for fn in self._copied_in:
            fn()

    def deactivate(self) -> None:
        """Release every bucket and free the arena (the plan is kept)."""
        slots = self.slots
        self.ctx.backend.synchronize()
        if self.device_state is not None:
            self.device_state.deactivate()  # issue 18: device-optimizer state back to the host first
        for b in list(slots.slot):
            slots.release(b)
        slots.mark_boundary()
        if self.arena is not None:
            self.ctx.memory.add("arena", -self.arena.numel())
            self.arena = None
            self._arena_views, self._arena_slices = {}, {}

    def arena_view(self, offset: int, numel: int) -> torch.Tensor:
        """``numel`` elements of the compute dtype at byte ``offset`` of the arena."""
        if self.arena is None:
            raise InvariantError("a plan buffer is used while no plan is active")
        view = self._arena_slices.get((offset, numel))  # once per arena: a slice and a view cost ~15 us a call
        if view is None:
            view = self.arena[offset: offset + numel * self.ctx.itemsize].view(self.ctx.dtype)
            self._arena_slices[(offset, numel)] = view
        return view

    def arena_views(self, key: object, build: Callable[[], dict[int, torch.Tensor]]) -> dict[int, torch.Tensor]:
        """``build()`` (views into the current arena), built once per arena under ``key``: every deactivation
        drops them with the arena."""
        if self.arena is None:
            raise InvariantError("a plan buffer is used while no plan is active")
        views = self._arena_views.get(key)
        if views is None:
            views = self._arena_views[key] = build()
        return views

    def _prefetch(self, plan: Plan, k: int) -> None:
        x = plan.buffers[k]
        b = x.bucket
        slots = self.slots
        if slots.state[b] is not Residency.HOST:
            return  # already here (fetched on demand earlier in this step)
        if self.arena is None:
            raise InvariantError("a planned prefetch runs while no plan is active")
        done = slots.done
        waits = [done[j] for j in x.after if j in done] + [slots.boundary]
        slots.copy_in(b, Slot(self.arena, x.offset, k), waits)
        self.ctx.stats["planned_fetches"] += 1

    def _release_buffer(self, plan: Plan, k: int) -> None:
        b = plan.buffers[k].bucket
        slot = self.slots.slot.get(b)
        if slot is not None and slot.planned == k:
            self.slots.release(b)

    def release_all(self) -> None:
        """Let go of every bucket that is not resident by plan."""
        slots = self.slots
        for b, slot in slots.items():
            if not self.is_resident(b, slot):
                slots.release(b)
        slots.mark_boundary()

    def is_resident(self, b: int, slot: Slot) -> bool:
        return self.plan is not None and slot.planned is not None and slot.planned == self.plan.resident_buffer[b]

    def streamed(self) -> int:
        """Buckets on the device that the plan does not keep there."""
        return sum(1 for b, slot in self.slots.slot.items() if not self.is_resident(b, slot))

    def refresh(self, buckets: Iterable[int], in_step: bool = False) -> None:
        """Updated buckets that stay on the device get their new weights (the next forward waits). ``in_step``:
        every rank refreshes here (``step()``), so with data parallel they may agree to gather them ([Note:
        resident weights gathered in their slots] in device_collectives.py); the copies ``refresh_as_updated``
        issued in this ``step()`` are not issued again."""
        dp, issued = self.ctx.dp, set()
        if in_step:
            issued, self._issued_early = self._issued_early, set()
        keep = self._keeps_bound()
        order = [b for b in self._refreshable(sorted(set(buckets))) if b not in issued]
        copy = dp.agree_refresh(order, self.ctx.backend) if in_step and dp is not None else None
        for b in order:
            self._refresh_one(b, keep, copy)
        for fn in self._copied_in:
            fn()

    def refresh_as_updated(self, order: Iterable[int]) -> None:
        """``step()`` with overlapped updates and no data parallel, before it waits for the CPU lane ([Note: the
        refresh pipelined]): issue the refresh ``after_step`` would for each bucket of ``order`` (updated this
        step, in the lane's order), each after its own bucket's update, in the Note's order."""
        self._issued_early = set()
        if self.replans_at_step():
            return  # the arena goes: nothing may be copied into its slots
        keep, adam, first = self._keeps_bound(), self.slots.adam_event, self._first_uses()
        todo = issue_order(self._refreshable(order), lambda b: (ev := adam.get(b)) is None or ev.query(),
                           lambda b: (first.get(b, 1 << 62), b))
        try:
            for b in todo:
                self._refresh_one(b, keep, None)
                self._issued_early.add(b)
        except BaseException:  # a failed update (its copy's wait raised): what was issued lands as refresh's would
            for fn in self._copied_in:
                fn()
            raise

    def _first_uses(self) -> dict[int, int]:
        """Per bucket the training plan needs: the first event that needs it (the next forward's order)."""
        plan = self.train_plan
        if self._first_use[0] is not plan:  # the earliest event last, so it wins
            uses = reversed(list(enumerate(plan.actions if plan is not None else ())))
            self._first_use = (plan, {b: i for i, actions in uses for b in actions.need})
        return self._first_use[1]

    def _refreshable(self, buckets: Iterable[int]) -> list[int]:
        """Those of ``buckets`` that ``refresh`` copies in: on the device, and not updated there."""
        slots, device = self.slots, self.device_state
        # issue 18: a bucket whose update ran on the device is updated in place there; its host copy is stale
        return [b for b in buckets if b in slots.slot and (device is None or not device.owns(b))]

    def _keeps_bound(self) -> bool:
        """Whether a refreshed bucket's parameters stay bound to its slot (``SlotTable.copy_in``'s ``keep_bound``)."""
        return any(f() for f in self._lands_at_once)

    def _refresh_one(self, b: int, keep: bool, copy: RefreshCopy | None) -> None:
        slots = self.slots
        if slots.state[b] is Residency.IN_FLIGHT:
            self.need(b)
        slots.copy_in(b, slots.slot[b], [slots.boundary], keep_bound=keep, copy=copy)  # after b's update too

    def close(self) -> None:
        self.arena = None
        self._arena_views, self._arena_slices = {}, {}

    # -- plans ------------------------------------------------------------------------------------------------

    def end_no_grad_forward(self) -> None:
        """No backward follows a no-grad forward (evaluation): let go of everything streamed, and make this
        forward's path the one the next no-grad forward plans by."""
        followed = self.followed()  # self.plan: a forward-only plan
        self.release_all()
        self.pos = 0
        if self.slots.host is not None:
            trace = self.plan.trace if followed and self.plan is not None else self.recorder.finish()
            self.evals.record(trace, self.slots.buckets)

    def check_transients(self) -> None:
        """A backward ended: learn what the allocator says the accounting missed ([Note: transients] in
        accounting.py); if the training plan no longer fits beside it, or keeps more than it needs now that
        the traced step's stand-in is measured, plan again at ``step()``."""
        ctx = self.ctx
        gap = ctx.memory.window_ends(ctx.backend.allocated_bytes())
        if not gap:
            return
        self.evals.plans.clear()  # forward-only plans were laid out with the reserve as it was
        plan = self.train_plan
        # plan again where the plan no longer fits beside the reserve, or where the traced step's stand-in was
        # replaced by less (the plan would keep room it does not need for as long as it lasts)
        if plan is not None and (gap < 0 or plan.peak_bytes - plan.headroom_bytes + ctx.memory.parts["headroom"]
                                 > ctx.budget):
            self.refit = True

    def agree(self, replan: bool) -> None:
        """Data parallel: whether any rank re-plans ([Note: re-plans agreed] in distributed.py)."""
        self.stale = replan
        self.refit = False

    def after_step(self, updated: set[int], recompute: RecomputeCoordinator) -> None:
        """``step()`` updated ``updated``: plan again if there is no plan, this one is stale, or it no longer
        fits beside the transients learnt since ([Note: transients] in accounting.py); else bring the new
        weights of the resident buckets in."""
        trace, replan = self.trace, self.replans_at_step()
        refit, self.refit = self.refit and self.train_plan is not None, False
        if replan and trace is not None:
            self._issued_early = set()  # none: refresh_as_updated saw the same
            if refit and not self.stale:
                self.ctx.stats["transient_replans"] += 1  # the re-plan's only cause ([Note: transients])
            self.replan(trace, recompute)  # brings every resident bucket in afresh
        else:
            self.refresh(updated, in_step=True)
        self.stale = False

    def replans_at_step(self) -> bool:
        """Whether ``after_step`` plans again (no plan yet, or this one is stale or no longer fits beside the
        transients learnt) rather than refresh the resident buckets."""
        trace = self.trace
        return (self.train_plan is None or self.stale or self.refit) and trace is not None and trace.complete

    def replan(self, trace: Trace, recompute: RecomputeCoordinator) -> None:
        """Plan training steps from ``trace`` (or, with "auto" checkpointing, choose other blocks first)."""
        ctx = self.ctx
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] is trace:
            plan = ahead[1]  # built and validated at the end of this step's backward (check_ahead)
        else:
            if recompute.auto and recompute.choice is None and recompute.choose(trace):
                return self.drop()  # other blocks are checkpointed from now on: the next step is planned
            try:
                plan = self.builder.build(trace)
            except BudgetTooSmallError as e:
                if recompute.auto and recompute.choose(trace):
                    return self.drop()  # the activations grew (a longer sequence): checkpoint more blocks
                raise self.builder.hinted(e, recompute) from None
        recompute.decided()
        self.on_plan = False
        self.deactivate()
        if self.train_plan is not None:
            ctx.stats["replans"] += 1
        self.train_plan = plan
        if trace.clock == "backend":
            self.checked = plan  # planned from a timed record ([Note: timing compute])
        self.activate(plan)

    def check_ahead(self, recompute: RecomputeCoordinator) -> None:
        """The end of a backward whose step has no training plan yet (the first): build the plan ``step()``
        will execute now, while no update of this step has been applied (overlapped ones are held until
        this returns: ``GradPipeline.release_held``), so that a budget under the exact minimum is refused
        with nothing to undo (issue 18). Raises :class:`BudgetTooSmallError`; "auto" checkpointing, which
        answers a budget too small by checkpointing more, is left to ``step()``."""
        trace = self.trace
        if self.train_plan is not None or recompute.auto or trace is None or not trace.complete:
            return
        try:
            self.ahead = (trace, self.builder.build(trace))
        except BudgetTooSmallError as e:
            raise self.builder.hinted(e, recompute) from None

    def plan_for(self, trace: Trace) -> Plan:
        """The training plan ``trace`` gets at the engine's budget ("auto" checkpointing weighs candidates
        with it); raises :class:`BudgetTooSmallError`."""
        return self.builder.build(trace)

    def drop(self) -> None:
        """Run the next step on demand (its calls will differ from the plan's) and plan it at its step()."""
        self.on_plan = False
        self.deactivate()  # every bucket back to the host: nothing resident keeps pre-update weights
        self.plan = self.train_plan = None
