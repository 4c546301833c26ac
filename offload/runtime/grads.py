"""The grad pipeline: gradients gathered per bucket in a device grad slot, copied to the host as soon as the
bucket's grads are final, summed over backward passes (accumulation), their norms for clipping, the loss
scale, and the AdamW updates they feed on the CPU lane (overlapped with backward, or deferred to ``step()``).

It owns every record of grads in flight: the slots being filled (:class:`GradSlot`), the device-to-host
copies not yet waited for, and per bucket the grads gathered since the last ``step()`` (:class:`PendingGrads`).
Like the rest of the runtime it executes the plan (``plan.grad_buffer``) and touches streams only through
the backend.

Grads exposed to the user in ``p.grad`` (issue 19, offload/runtime/plain_grads.py, owned here as ``exposure``):
``backward_done`` exposes them, once per backward after every bucket's copy was issued; ``clear`` takes them back
when gathered grads are consumed or dropped (``step()``, ``zero_grad()``, a failed backward). The runtime has them
collected (the user's edits in) when the backward of a forward with grad enabled reaches that forward's outputs
(``Exposure.before_backward_of``), at ``step()`` and before ``engine.clip_grad_norm_``. They change the sums, norms
and clip factor only through ``sums`` (offload/runtime/grad_sums.py).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Iterable

import torch
from torch import nn

from ..errors import InvariantError, OffloadError
from .bucket_send import FastSend, copy_into_slot
from .clipping import clip_gathered, step_factors
from .device_optim import DeviceOptimizer, Postponed, streamed_reads_after_update
from .grad_records import SECOND_BACKWARD, BackwardDiscard, GradSlot, PendingGrads
from .grad_sums import GatheredSums
from .plain_grads import Exposure
from .scaler import LossScaler

if TYPE_CHECKING:
    from ..backend.base import Event
    from .context import RuntimeContext
    from .executor import PlanExecutor
    from .slots import SlotTable


HParams = list[tuple[float, float, float, float, float]]  # AdamW.hparams(): per param group


class GradPipeline:
    """Backward's grads: slots, copies to the host, accumulation, norms, clipping, updates."""

    def __init__(self, ctx: RuntimeContext, slots: SlotTable, executor: PlanExecutor) -> None:
        self.ctx = ctx
        self.slots = slots
        self.executor = executor
        config = ctx.config
        self.deferred = not config.overlap_optimizer  # updates run in step(), after every grad is in
        self.scaler = LossScaler(config.loss_scale) if config.loss_scale is not None else None
        self.gathering: dict[int, GradSlot] = {}  # bucket -> its grad slot, while this backward fills it
        # bucket -> its parameters' views in its gathering slot, when that is a plan buffer (built once per arena)
        self.param_views: dict[int, dict[int, torch.Tensor]] = {}
        self.copies: list[Event] = []  # device-to-host grad copies of the last backward, not yet waited for
        self.pending: dict[int, PendingGrads] = {}  # bucket -> its grads gathered since the last step()
        self.lane_order: dict[int, None] = {}  # buckets whose update went to the CPU lane since, in its order
        self.norms: dict[int, torch.Tensor] = {}  # param -> 2-norm of its gathered grad (deferred mode)
        self.clip_factor = 1.0  # set by clip_grad_norm_, applied by the next step()
        self.next_backward_scale: float | None = None  # set by Engine.backward just before loss.backward()
        self.step_scale: float | None = None  # the loss scale of this step's backward passes
        self.awaiting_step = False  # a backward's grads wait for step()
        self.backward_seen = False  # a backward ran since the last step() (guards.check_step_has_grads)
        self.last_step_skipped = False
        self._warned = False
        self.sums = GatheredSums(self)  # the sums, norms and clip factor as p.grad and data parallel see them
        self.exposure = Exposure(ctx, self)  # issue 19: the gathered grads in p.grad (plain_grads.py)
        self.device = DeviceOptimizer(ctx, slots, executor)  # issue 18: updates on the device (device_optim.py)
        self.fast_send = FastSend(self)  # issue 17: a fast step's bucket sent by one routine (bucket_send.py)
        self.device.on_host = lambda x: self._submit_update(x.bucket, x.params, x.ready, x.hparams, x.factors, x.grads)
        self._late: tuple[object, frozenset[int]] | None = None  # (plan, streamed_reads_after_update): once a plan
        self.reset_step()

    def reset_step(self) -> None:
        self.received: dict[int, set[int]] = {}  # bucket -> params whose grads arrived this backward
        self.finished: set[int] = set()  # buckets whose grads went to the host this backward
        self.hparams: HParams | None = None  # overlapped updates: hyperparameters read as backward begins
        # issue 18: overlapped updates of a step with no training plan yet, submitted once its backward ended
        # and the plan was built (release_held): a budget too small is refused before any update is applied
        self.held: list[tuple[int, frozenset[int], Event, torch.Tensor | None]] | None = None
        self.hold_only: frozenset[int] | None = None  # with ``held``: only these buckets' updates wait (None: all)
        self._expected_cache: dict[int, tuple[dict[int, None], int, frozenset[int]]] = {}  # bucket -> _expected

    # -- backward --------------------------------------------------------------------------------------------

    def begin(self) -> None:
        """A backward reaches the engine: check it may run, take its loss scale and hyperparameters."""
        if self.awaiting_step and not self.deferred:
            raise OffloadError(
                "a second backward ran before optimizer.step(), but this engine applies each bucket's AdamW "
                "while backward runs (overlap_optimizer=True), so the previous backward's update is already "
                "applied. To accumulate gradients over several backward passes, wrap with "
                "overlap_optimizer=False; otherwise call step() after each backward. (A second backward through "
                "the same forward's graph, backward(retain_graph=True) twice, is refused in either mode: run the "
                "forward again before each backward.)")
        scaled = self.next_backward_scale is not None
        scale = self.next_backward_scale if self.next_backward_scale is not None else 1.0
        self.next_backward_scale = None
        if self.step_scale is not None and scale != self.step_scale:
            raise OffloadError(
                f"this backward's loss is scaled by {scale:g} but the grads gathered since the last step() "
                f"by {self.step_scale:g}: with float16, call engine.backward(loss) for every backward pass")
        self.step_scale = scale
        if self.scaler is not None and not scaled and not self._warned:
            self._warned = True
            warnings.warn("offload: with float16, call engine.backward(loss) rather than loss.backward(), so "
                          "that the loss is scaled and small gradients do not underflow to zero", stacklevel=4)
        if self.ctx.dp is not None:  # issue 20: not after a fault left this rank out of step
            self.ctx.dp.check_usable()
        self.backward_seen = True
        self.ctx.stats["backwards"] += 1
        self.hparams = self.ctx.optimizer.hparams()
        # Overlapped updates held to the end of backward: all of the first step's (issue 18: they wait for its
        # plan), after it those of streamed buckets read after it ([Note: streamed weights read after their update])
        plan = self.executor.train_plan
        self.hold_only = None if self.deferred or plan is None else self._read_late(plan)
        self.held = None if self.deferred or self.hold_only == frozenset() else []

    def _read_late(self, plan) -> frozenset[int]:
        """``streamed_reads_after_update(plan)``, once per plan ([Note: streamed weights read after their update])."""
        cached = self._late
        if cached is None or cached[0] is not plan:
            self._late = cached = (plan, streamed_reads_after_update(plan))
        return cached[1]

    def holds(self, b: int) -> bool:
        """Bucket ``b``'s update waits for the end of this backward (``release_held``)."""
        return self.held is not None and (self.hold_only is None or b in self.hold_only)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Engine.backward: the loss multiplied by the loss scale (float16), which the backward records."""
        if self.scaler is None:
            return loss
        self.next_backward_scale = self.scaler.scale
        return loss * self.scaler.scale

    def forget_scale(self) -> None:
        """Engine.backward returned (or raised): the scale it set is not for a later backward."""
        self.next_backward_scale = None

    def gather(self, p: int, param: nn.Parameter, nbytes: int) -> None:
        """Parameter ``p``'s grad is accumulated: move it into its bucket's grad slot; send the bucket to
        the host once all of its grads are in."""
        b = self.slots.bucket_of[p]
        if b in self.finished:  # issue 19: its grads were sent, this backward's would be lost (silently)
            raise OffloadError(SECOND_BACKWARD)
        views = self.param_views.get(b)
        if views is None:
            slot = self._grad_slot(b)
            views = self.param_views.get(b)
        grad = param.grad
        if grad is None:
            raise InvariantError(f"parameter {p}: its post-accumulate-grad hook ran without a grad")
        # A plan buffer's slot has a cached view per parameter (its shape: no slice or reshape per grad);
        # an on-demand slot is sliced per grad. Either way the same elements get the same values.
        if views is not None:
            dst = views[p]
            src = grad
        else:
            off = self.slots.hosted().offset[p]
            dst = slot[off: off + param.numel()]
            src = grad.reshape(-1)
        if torch.is_grad_enabled():  # backward(create_graph=True); otherwise no context to enter per grad
            with torch.no_grad():
                dst.copy_(src)
        else:
            dst.copy_(src)
        param.grad = None
        del grad, src
        self.ctx.memory.add("grads", -nbytes)
        self._arrived(b, p)

    def gather_in_order(self, p: int, param: nn.Parameter) -> None:
        """:meth:`gather` for a fast step's grad in the plan's order ([Note: the fast path] in fast_path.py), less
        the accounting that cancels out; a bucket's first grad (or a slot without cached views) goes to gather."""
        b = self.slots.bucket_of[p]
        views = self.param_views.get(b)  # present only while ``b`` is gathered in a plan buffer: not finished
        grad = param.grad
        if grad is None:
            raise InvariantError(f"parameter {p}: its post-accumulate-grad hook ran without a grad")
        if views is None:
            nbytes = grad.numel() * grad.element_size()
            del grad
            self.ctx.memory.add("grads", nbytes)  # as Runtime._on_grad does for gather
            return self.gather(p, param, nbytes)
        self.ctx.memory.passing(grad.numel() * grad.element_size())
        if torch.is_grad_enabled():  # backward(create_graph=True)
            with torch.no_grad():
                views[p].copy_(grad)
        else:
            views[p].copy_(grad)
        param.grad = None
        del grad
        self._arrived(b, p)

    def gather_bucket(self, b: int, ps: tuple[int, ...], nbytes: int, leave: bool = False) -> None:
        """A fast step's bucket ``b`` whose grads all came in the plan's order and wait in ``p.grad`` ([Note:
        one hook's work per bucket] in fast_path.py): one multi-tensor copy into its slot (``nbytes`` held at
        once, counted in the peak), then sent. A slot without cached views goes grad by grad, as gather.
        ``leave``: ([Note: grads left for the exposure] in plain_grads.py) the routine leaves them in p.grad."""
        if b in self.finished:
            raise OffloadError(SECOND_BACKWARD)
        if (route := self.fast_send.route(b, ps, nbytes)) is not None:  # [Note: one routine per fast bucket]
            return self.fast_send.send(route, leave)
        params = self.ctx.params
        grads = [g for g in (params[q].grad for q in ps) if g is not None]
        if len(grads) != len(ps):
            raise InvariantError(f"bucket {b}: a grad of its plan's order is missing at its last grad")
        views = self.param_views.get(b)
        if views is None:
            # A slot these grads fill whole (no padding, every parameter's grad here) is not cleared first: the
            # copy below writes each of its elements (a memset of the bucket less per bucket; same bytes)
            whole = nbytes == self.slots.buckets[b].grad_numel * self.ctx.itemsize
            slot = self._grad_slot(b, clear=not whole)
            views = self.param_views.get(b)
            if views is None:  # an on-demand slot (not on a fast step's plan, but correct all the same)
                if whole:
                    slot.zero_()
                del grads
                for q in ps:
                    self.gather_in_order(q, params[q])
                return
        copy_into_slot(params, ps, views, grads, self.ctx.memory, nbytes)
        del grads
        got = self.received.setdefault(b, set())
        got.update(ps)
        if got >= self._expected(b):
            self.finish(b)

    def _arrived(self, b: int, p: int) -> None:
        """Parameter ``p``'s grad is in bucket ``b``'s slot: send the bucket once all of its grads are in."""
        got = self.received.get(b)
        if got is None:
            got = self.received[b] = set()
        got.add(p)
        expected = self._expected(b)
        if len(got) >= len(expected) and got >= expected:
            self.finish(b)

    def _expected(self, b: int) -> frozenset[int]:
        """Bucket ``b``'s parameters this step touched: the grads to wait for. Cached per bucket while the
        step's touched set is unchanged (it only grows, and a new step has a new recorder), since every
        gradient asks (rebuilding it cost O(bucket size) per gradient)."""
        touched = self.executor.recorder.touched
        hit = self._expected_cache.get(b)
        if hit is not None and hit[0] is touched and hit[1] == len(touched):
            return hit[2]
        got = frozenset(p for run in self.slots.buckets[b].runs for p in run.params if p in touched)
        self._expected_cache[b] = (touched, len(touched), got)
        return got

    def _grad_slot(self, b: int, clear: bool = True) -> torch.Tensor:
        """The device slot bucket ``b``'s grads are gathered in (typed, trainable prefix only); taken now, it is
        cleared unless ``clear`` is False (the caller writes every element)."""
        have = self.gathering.get(b)
        if have is not None:
            return have.view
        ctx, slots, executor = self.ctx, self.slots, self.executor
        n = slots.buckets[b].grad_numel  # issue 20: padded to its shards where reduced on the device
        plan = executor.plan
        k = plan.grad_buffer[b] if executor.on_plan and plan is not None else None
        if k is not None and plan is not None:
            x = plan.buffers[k]
            (rec := executor.recorder).exclude_begin()  # a stall, not compute: simulated (``Program.grad_waits``)
            for j in x.after:
                if j in slots.done:
                    ctx.backend.wait(slots.done[j])
            ctx.backend.wait(slots.boundary)
            rec.exclude_end()
            view = executor.arena_view(x.offset, n)
            self.param_views[b] = executor.arena_views(("grads", b, k), lambda: self.views_of(b, view))
        else:
            slots.make_room(n * ctx.itemsize, b)
            view = ctx.backend.empty(n * ctx.itemsize).view(ctx.dtype)
            ctx.memory.add("slots", n * ctx.itemsize)
        # Cleared once (one fill on the compute stream, after the waits above): the padding between
        # parameters ([Note: parameter alignment] in buckets.py) and any parameter without a grad this
        # pass (an unused branch) send zeros, not the bytes of the slot's previous occupant. (No no_grad():
        # the slot never requires grad, so nothing is recorded even under create_graph; entering it costs ~8 us.)
        if clear:
            view.zero_()
        self.gathering[b] = GradSlot(view, k)
        return view

    def views_of(self, b: int, view: torch.Tensor) -> dict[int, torch.Tensor]:
        """Bucket ``b``'s parameters in its grad slot ``view`` (a plan buffer), each shaped as the parameter."""
        off, specs, params = self.slots.hosted().offset, self.ctx.specs, self.ctx.params
        return {p: view[off[p]: off[p] + specs[p].numel].view(params[p].shape)
                for run in self.slots.buckets[b].runs for p in run.params}

    def finish(self, b: int) -> None:
        """All of bucket ``b``'s grads are in its slot: copy them to the host, then update on the CPU."""
        if b in self.finished:
            return
        self.finished.add(b)
        if not (self.deferred or self.executor.on_plan or self.held is not None and self.hold_only is None):
            self.held, self.hold_only = [] if self.held is None else self.held, None  # [Note: a departed step's
            # updates wait] (device_optim.py): off its plan, this backward's reads are not known
        ctx, slots = self.ctx, self.slots
        view, k = self.gathering.pop(b)
        self.param_views.pop(b, None)
        got = frozenset(self.received[b])  # the slot was cleared when taken: the others send zeros
        if self.device.owns(b) and not self.deferred:  # issue 18: optimizer on the device: updated from the slot
            self.pending[b] = PendingGrads(got, self.device.update(b, view, k, got, self.hparams))
            return
        host = slots.hosted()
        earlier = self.pending.get(b)
        nbytes = view.numel() * ctx.itemsize
        if self.deferred and earlier is None:  # the norms clipping needs, where the grads are
            with torch.no_grad():
                self.norms.update(self.sums.slot_norms(view, got))
        waits = [ctx.backend.record()] + [e for e in (slots.adam_event.get(b),) if e is not None]
        if ctx.dp is not None and ctx.dp.device is not None:  # issue 20: reduce-scattered on the device
            return self._send_shard(b, view, k, got, waits)
        ctx.stats["d2h_bytes"] += nbytes
        first = earlier is None
        # The issue-18 first step's held grads are copied out whole, whatever pieces they crossed in.
        kept = host.hold(view.numel(), view.dtype) if self.holds(b) else None
        spans = host.chunks(b, first)  # [Note: chunked grad staging] in buckets.py
        for lo, hi in spans:
            ready, d2h = self._copy_piece(b, got, view, waits, earlier, lo, hi, last=hi == spans[-1][1],
                                          kept=kept, piecewise=len(spans) > 1)
        self._slot_free_after(d2h, view, k)
        self.pending[b] = PendingGrads((earlier.params if earlier else frozenset()) | got, ready)
        if kept is not None and self.held is not None:
            self.held.append((b, got, ready, kept))

    def _send_shard(self, b: int, view: torch.Tensor, k: int | None, got: frozenset[int],
                    waits: list[Event]) -> None:
        """[Note: grads reduced on the device] (runtime/device_collectives.py): the slot reduce-scattered in
        place, this rank's shard copied to the host, its update (then the all-gather) on the CPU lane."""
        ctx = self.ctx
        dp = ctx.dp
        if dp is None:
            raise InvariantError(f"bucket {b}: a grad shard without data parallel: a bug in offload")
        d2h, nbytes = dp.reduce_on_device(ctx.backend, self.slots.hosted(), b, view, waits[0], waits[1:])
        ctx.stats["d2h_bytes"] += nbytes
        ctx.lane_log.add("d2h", b, nbytes, d2h)
        self.copies.append(d2h)
        self._slot_free_after(d2h, view, k)  # the copy came after the reduce-scatter
        self.pending[b] = PendingGrads(got, d2h)
        if self.holds(b) and self.held is not None:  # issue 18: the first step's update waits for its plan
            self.held.append((b, got, d2h, None))  # (release_held), as a weight read after the update does
        else:
            self._submit_update(b, got, d2h)

    def _slot_free_after(self, d2h: Event, view: torch.Tensor, k: int | None) -> None:
        """The grad slot ``view`` (plan buffer ``k``, or None: allocated on demand) may be reused once ``d2h``,
        the last copy out of it, is done."""
        if k is not None:
            self.slots.done[k] = d2h
        else:
            self.slots.free_after(d2h, view.numel() * self.ctx.itemsize, view)

    def _copy_piece(self, b: int, got: frozenset[int], view: torch.Tensor, waits: list[Event],
                    earlier: PendingGrads | None, lo: int, hi: int, last: bool, kept: torch.Tensor | None,
                    piecewise: bool) -> tuple[Event, Event]:
        """Grads ``[lo, hi)`` of bucket ``b`` (its slot ``view``) to the host and, on the CPU lane, their reader:
        the update of those elements, their widening or adding into the fp32 sum, or (first step, held) their
        copy into ``kept``. Returns (the event after which the reader's input is ready, the copy's event)."""
        ctx, host, slots = self.ctx, self.slots.hosted(), self.slots
        first = earlier is None
        # The copy never converts: it lands in pinned host memory of the slot's dtype ([Note: host grads]
        # in buckets.py): bytes of the host's grad ring, lent until the CPU lane has read them, or the fp32 sum
        # itself ([Note: grad staging ring]); it waits for the readers of what those bytes held before.
        dst = host.landing(b, first, lo, hi)
        after = [*waits, *dst.after] + ([earlier.ready] if earlier is not None else [])  # the previous sum is done
        src = view if lo == 0 and hi == view.numel() else view[lo:hi]
        if ctx.backend.copy_waits_on_host(after):  # CPU-lane work not done: the ring's readers, the last update
            # On CUDA the host waits for it before it issues the copy: a stall of the lane's making, not the model's
            # compute ([Note: timing compute] in executor.py: counted, an H200 timed step read 4.6x the model's
            # compute; the cost model lacks the ring's depth). The CPU backend hands the copy to its lane: no wait.
            (rec := self.executor.recorder).exclude_begin()
            d2h = ctx.backend.d2h(dst.view, src, after)
            rec.exclude_end()
        else:
            d2h = ctx.backend.d2h(dst.view, src, after)
        if not self.deferred or dst.view is host.grad_sum(b):  # the update reads the landed grads (or the sum)
            ready = d2h
        else:  # widened into the fp32 sum (the step's first grads) or added to it, on the CPU lane
            staged = dst.view
            ready = ctx.cpu.submit(lambda: self.sums.fold(b, got, first, staged, lo, last), [d2h, *(
                [earlier.ready] if earlier is not None else [])], f"gradient accumulation of bucket {b}")
            host.staged_read_by(dst.lent, ready)
        ctx.lane_log.add("d2h", b, (hi - lo) * ctx.itemsize, d2h)
        self.copies.append(d2h)
        if kept is not None:  # issue 18: the first step's updates wait for its plan (release_held); the ring
            # cannot (a later copy over these bytes needs their reader): the grads go to pageable memory, on the lane.
            src, out_view = dst.view, kept[lo:hi]
            ready = ctx.cpu.submit(lambda: out_view.copy_(src), [ready], f"first-step grads of bucket {b} held")
            host.staged_read_by(dst.lent, ready)
        elif not self.deferred:
            self._submit_update(b, got, ready, grads=dst.view, span=(lo, hi) if piecewise else None)
            host.staged_read_by(dst.lent, slots.adam_event[b])
        return ready, d2h

    # [Note: one H2D wait per bucket's update]
    # An update rewrites the host master and 16-bit copy that the bucket's last H2D may still read, so it waits
    # for ``slots.h2d_event[b]``; a bucket crossing in pieces ([Note: chunked grad staging] in buckets.py) waits
    # in its first piece's item only (each wait may cost a GIL hand-off: [Note: the cost of a lane item] in
    # backend/base.py). ``finish`` submits the pieces in order, with no H2D of the bucket in between (the same
    # event), to one lane, which runs each item after the one before ended: every later piece runs after the
    # first piece's wait returned. (Implied twice over: a piece waits for its grads' D2H, which followed the
    # compute that waited for the H2D; mutation G8, tests/MUTATIONS.md.) Shard updates are never piecewise.

    def _submit_update(self, b: int, params: Iterable[int], ready: Event, hparams: HParams | None = None,
                       factors: tuple[float, ...] = (), grads: torch.Tensor | None = None,
                       span: tuple[int, int] | None = None) -> None:
        """AdamW of bucket ``b`` on the CPU lane after ``ready``, from ``grads`` (in the grad ring) or its fp32 sum;
        ``span``: only those elements (one piece of the ring: [Note: chunked grad staging] in buckets.py)."""
        slots = self.slots
        hp = hparams or self.hparams
        ps = frozenset(params)
        host = slots.hosted()
        self.device.before_host_update(b)  # issue 18: a fresh device-homed bucket updated on the host after all
        slots.updated.add(b)  # [Note: a departed step's updates wait] (device_optim.py)
        waits = [ready] + [e for e in (slots.h2d_event.get(b),) if e is not None]
        if span is not None and span[0] > 0:  # [Note: one H2D wait per bucket's update]
            del waits[1:]
        dp = self.ctx.dp
        if dp is not None:  # issue 20: reduce-scatter, AdamW of this rank's shard, all-gather (runtime/distributed.py)
            slots.adam_event[b] = dp.submit_update(host, b, ready, lambda: host.update(b, ps, hp, factors, grads),
                                                   waits)
        else:
            slots.adam_event[b] = self.ctx.cpu.issue(lambda: host.update(b, ps, hp, factors, grads, span), waits,
                                                     f"AdamW of bucket {b}")  # [Note: inline copies] (backend/cpu.py)
            self.lane_order[b] = None  # a bucket's pieces go in a row: its first says where its last is
        self.ctx.lane_log.add("cpu_adam", b, 0, slots.adam_event[b])

    def release_held(self) -> None:
        """The end of backward, its plan checked: submit the updates held back (in the order their grads
        were complete; the hyperparameters read as backward began)."""
        held, self.held, self.hold_only = self.held, None, None
        for b, got, ready, grads in held or ():
            if self.device.will_own(b):  # its first update, on the device once step() activates the plan
                self.device.postpone(Postponed(b, got, ready, self.hparams or [], (), grads))
                continue
            self._submit_update(b, got, ready, grads=grads)

    def flush(self) -> None:
        """The end of backward: buckets some of whose grads never came (an unused branch) go now."""
        for b in list(self.received):
            if b not in self.finished:
                self.finish(b)

    def move_out_of_arena(self) -> None:
        """The step leaves its plan (the arena goes): grads gathered in plan buffers move to on-demand
        slots. Called after the backend synchronized."""
        ctx = self.ctx
        for b, (view, k) in list(self.gathering.items()):
            if k is not None:
                moved = ctx.backend.empty(view.numel() * ctx.itemsize).view(ctx.dtype)
                ctx.memory.add("slots", moved.numel() * ctx.itemsize)
                moved.copy_(view)
                self.gathering[b] = GradSlot(moved, None)
                self.param_views.pop(b, None)

    def backward_done(self) -> None:
        """Every grad of this backward is on its way to the host (grads would be exposed from here)."""
        self.awaiting_step = bool(self.pending)
        if self.received:  # not after torch.autograd.grad(...) (a gradient penalty), which accumulates nothing:
            # the real backward that follows must find p.grad None, as the forward left it
            if self.ctx.dp is not None and self.deferred:  # issue 20: p.grad shows the average over ranks, as
                # DDP's, or inside no_sync() this rank's own sum ([Note: no_sync] in distributed.py)
                self.exposure.local = self.ctx.dp.backward_ended(self)
            self.exposure.expose()  # issue 19: the gathered grads in p.grad (offload/runtime/plain_grads.py)

    def wait_for_copies(self) -> None:
        """A forward starts: grad copies of an earlier backward of this step (accumulation) may still be
        reading their slots, and the plan reuses those bytes: everything this pass issues comes after them.
        (Issue 18: first updates postponed for the device run on the host now: this forward reads them.)"""
        self.device.flush_postponed()
        for event in self.copies:
            self.ctx.backend.wait(event)
        self.copies = []

    # -- the optimizer step ------------------------------------------------------------------------------

    def consume_backward(self) -> bool:
        """Whether a backward ran since the last ``step()`` (and from now on: not)."""
        seen, self.backward_seen = self.backward_seen, False
        return seen

    def run_step(self) -> set[int]:
        """Run (deferred) or join (overlapped) the updates; return the buckets updated."""
        skipped = False
        if self.deferred and self.pending:
            skipped = self._step_deferred()
        try:
            try:
                if not self.deferred and self.ctx.dp is None:  # [Note: the refresh pipelined] (executor.py)
                    self.executor.refresh_as_updated([b for b in self.lane_order if b in self.pending])
            finally:  # a failed update raised there: the lane's other work ends first, as it does here
                self.ctx.cpu.drain()
        except OffloadError as e:
            if self.ctx.dp is not None:  # issue 20: the collective's DistributedError, not the lane's wrappings
                self.ctx.dp.raise_failure(e)
            raise
        self.slots.reclaim(block=True)  # every update waited for its grads' copy: all grad slots are free
        updated = set() if skipped else set(self.pending)
        self.clear()
        self.last_step_skipped = skipped
        self.ctx.stats["steps"] += bool(updated)
        return updated

    def _step_deferred(self) -> bool:
        """Run the gathered updates (loss scale and clipping applied); return True if the step is skipped."""
        hparams = self.ctx.optimizer.hparams()  # read now, as torch.optim does
        if self.ctx.dp is not None:  # issue 20: grads summed over ranks now; norms (overflow check) over all ranks
            self.ctx.dp.reduce_pending(self, norms=self.scaler is not None)
        factors = step_factors(self)
        if factors is None:
            return True  # the float16 overflow check skips this step
        for b in sorted(self.pending):  # first-use order: the next forward's first buckets are done first
            params, ready = self.pending[b]
            if self.device.owns(b):  # issue 18: summed on the host, updated on the device (device_optim.py)
                self.device.update_summed(b, params, ready, hparams, factors)
                continue
            if self.device.will_own(b):  # its first update, once the plan is active ([Note: the first step's
                # host memory] in warmup.py)
                self.device.postpone(Postponed(b, params, ready, hparams, factors, None))
                continue
            self._submit_update(b, params, ready, hparams, factors)
        return False

    def check_can_clip(self) -> None:
        if not self.deferred:
            raise OffloadError(
                "clip_grad_norm_ needs every grad before any update, but this engine applies each bucket's "
                "AdamW while backward runs (overlap_optimizer=True). Wrap with overlap_optimizer=False to clip.")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every grad gathered since the last step, applied by the
        next ``step()`` (``clipping.clip_gathered``). Returns the total norm (of the unscaled grads, with
        float16 loss scaling)."""
        return clip_gathered(self, max_norm, norm_type, error_if_nonfinite)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Grads are consumed by the update, so after step() there is nothing to clear; before it (deferred
        updates), the grads gathered so far are dropped, as ``optimizer.zero_grad()`` would (or zeroed, with
        ``set_to_none=False``: see offload/runtime/plain_grads.py)."""
        if self.exposure.zero_grad(set_to_none):  # issue 19: p.grad None or zeros, as torch's zero_grad leaves it
            return
        if self.deferred and self.pending:
            self.ctx.cpu.drain()
            self.slots.reclaim(block=True)
            self.clear()

    def clear(self) -> None:
        """Gathered grads are consumed (step) or dropped (zero_grad, a failed backward)."""
        self.exposure.drop()  # issue 19: no exposed p.grad outlives the sums it shows
        self.pending = {}
        self.lane_order = {}
        self.norms = {}
        self.clip_factor = 1.0
        self.step_scale = None
        self.awaiting_step = False

    def abort(self) -> BackwardDiscard:
        """A backward failed: finish what is in flight (nothing is freed under a copy), free every grad
        slot, drop the grads gathered since the last step() (see [Note: what a fault discards])."""
        ctx = self.ctx
        problems = []
        if ctx.dp is not None:  # issue 20: this rank left the other ranks' sequence of collectives
            ctx.dp.backward_failed("see the error this backward raised")
        try:
            ctx.cpu.drain()  # AdamW already submitted reads grads and writes masters: let it finish
        except OffloadError as e:
            problems.append(str(e))
        ctx.backend.synchronize()
        if self.slots.host is not None:  # every copy and CPU-lane reader is done: the grad ring forgets them
            self.slots.host.reset_staging()
        for view, k in self.gathering.values():
            if k is None:  # an on-demand slot (planned ones are bytes of the arena)
                ctx.memory.add("slots", -view.numel() * ctx.itemsize)
        self.gathering.clear()
        self.param_views.clear()
        self.slots.reclaim(block=True)
        self.copies = []
        arrived = sum(len(ps) for ps in self.received.values())
        if self.deferred:
            updated, dropped = [], sorted(self.pending)
        else:  # overlap: every bucket in pending had its update submitted (and now run), unless held (issue 18)
            held = {b for b, _, _, _ in self.held or ()}
            updated, dropped = sorted(set(self.pending) - held), sorted(held)
            self.held, self.hold_only = None, None
        for p in ctx.params:
            p.grad = None
        ctx.memory.add("grads", -ctx.memory.parts["grads"])  # counted as autograd made them; none is left now
        self.clear()
        self.next_backward_scale = None
        self.backward_seen = False  # the failed backward does not count for step()
        return BackwardDiscard(arrived, updated, dropped, problems)
