"""The device tier of the optimizer (issue 18): buckets whose plan places their optimizer on the device
(``Placement.DEVICE_OPTIMIZER``) keep their fp32 master, Adam m and v in the arena's STATE buffer and are
updated there, from their grad slot, as soon as their grads are complete: no grad copy to the host, no
CPU AdamW, no weight copy back.

[Note: two tiers of optimizer state] The host arena is laid out and allocated by the traced warm-up,
before any plan exists, with every bucket's region (fp32 master, m, v, grads, 16-bit copy). A training plan
that places bucket ``b`` on the device makes the device the owner of its state, and ``b`` *device-homed*:
the host arena is laid out again without its state when the plan is activated ([Note: device-homed
buckets] in ``host/state.py``; a host copy of it exists only while the host needs one: ``dirty`` buckets
have none that is current). While the plan's arena lives:

* ``activate`` (the executor brings the plan's arena in): the bucket's weights come in like any resident
  bucket's (the executor's copy of its 16-bit copy, or of its master in fp32), and its state (the master
  where the weights are 16-bit, m, v) is copied from the host arena into its STATE buffer;
* while the arena lives, ``update`` runs AdamW on the device for each bucket whose grads are complete (torch's
  ``_fused_adamw_`` where this torch has it, else its single-tensor ops; with ``offload.AdamW(fused=False)``
  torch's single-tensor ops, bit for bit ``torch.optim.AdamW(foreach=False)``), then writes the 16-bit
  weights from the new master in place (with fp32 compute the resident weights *are* the master). The host
  copy of that state is stale from then on (``dirty``), and a device-homed bucket's is freed;
* ``sync_to_host`` copies the state back (master, m, v and the device weights, device to host, in the
  host region's dtype; a device-homed bucket into a host copy made for it): before anything reads the host (``Runtime.wait_for_updates``: ``state_dict``,
  ``save``, ``module.state_dict()``, ``optimizer.state_dict()``/``load_state_dict``; ``close``) and
  before the arena goes (``deactivate``: a re-plan, a departure from the plan, a switch to a forward-only
  plan). A departure in the middle of a backward therefore hands the buckets updated so far to the host,
  and the rest of the step updates on the CPU;
* after the host was written from outside (``load_state_dict``, ``optimizer.load_state_dict``),
  ``reload`` copies it in again.

The step counts are host metadata both tiers share (``HostState.steps``, the tensors
``optimizer.state[p]["step"]`` shows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, NamedTuple

import torch

from ..backend.base import Event
from ..errors import InvariantError
from ..host.cpu_adam import kernel_info
from ..optim import adamw_
from ..planning.buckets import locate
from ..planning.placement import placement_bytes
from ..planning.trace import EventKind

if TYPE_CHECKING:
    from ..host.state import HostState
    from ..planning.plan import Plan
    from .context import RuntimeContext
    from .executor import PlanExecutor
    from .slots import SlotTable


FUSED_AVAILABLE = hasattr(torch, "_fused_adamw_")  # else torch's single-tensor ops (the bitwise path)
# the one-pass kernel matches the host kernel's instruction set: fused multiply-adds unless it runs "baseline"
HOST_FMA = kernel_info().get("isa") != "baseline"
MAX_PIECE_BYTES = 64 << 20  # the most a summed-grad piece takes on the device ([Note: deferred device updates])
HParams = list[tuple[float, float, float, float, float]]  # AdamW.hparams(): per param group
RELAYOUT_SHARE = 16  # the host arena is laid out again where over 1/16 of it would move (_relayout_pays)


class DeviceState(NamedTuple):
    """One device-optimizer bucket's views into the arena."""

    weights: torch.Tensor  # the resident weights, compute dtype, the whole bucket
    master: torch.Tensor  # fp32, the trainable prefix (``weights`` itself with fp32 compute)
    exp_avg: torch.Tensor  # fp32, the trainable prefix
    exp_avg_sq: torch.Tensor


class Postponed(NamedTuple):
    """A first update held until the plan that keeps the bucket's optimizer on the device is active
    ([Note: the first step's host memory] in ``runtime/warmup.py``)."""

    bucket: int
    params: frozenset[int]
    ready: Event  # after it, ``grads`` (or the fp32 sum) is final
    hparams: HParams
    factors: tuple[float, ...]  # loss-scale inverse, clipping coefficient (deferred updates; none overlapped)
    grads: torch.Tensor | None  # overlapped: the step's grads held on the host, device dtype; None: the fp32 sum


class DeviceOptimizer:
    """The device-optimizer buckets of the plan being executed: their state, their updates, its sync with
    the host (see [Note: two tiers of optimizer state])."""

    def __init__(self, ctx: RuntimeContext, slots: SlotTable, executor: PlanExecutor) -> None:
        self.ctx, self.slots, self.executor = ctx, slots, executor
        self.state: dict[int, DeviceState] = {}  # bucket -> its views, while the arena lives
        self.filled: dict[int, Event] = {}  # bucket -> copy of its state from the host, not yet waited for
        self.dirty: set[int] = set()  # buckets whose host copy is stale or absent (the device holds newer values)
        self.fills: dict[int, tuple[Event, ...]] = {}  # bucket -> the copies that read its parked host copy
        self._kernel: Callable[..., None] | None = None  # the backend's one-pass AdamW, if it has one
        self._kernel_asked = False
        self.counters = {"updates": 0, "state_h2d_bytes": 0, "state_d2h_bytes": 0, "grad_h2d_bytes": 0}
        self.demoted = 0  # device-optimizer buckets of the active plan run with the host optimizer instead
        # first updates of fresh device-homed buckets, run on the device once the first plan is active; any
        # left when something else needs them are handed to ``on_host`` (the CPU lane)
        self.postponed: list[Postponed] = []
        self.on_host: Callable[[Postponed], None] | None = None
        self._ahead_homed: tuple[Plan, frozenset[int]] | None = None

    @property
    def stale(self) -> bool:
        """The device holds state the host copy has not seen (or the host has no copy of)."""
        return bool(self.dirty)

    def owns(self, b: int) -> bool:
        """Bucket ``b``'s optimizer is on the device now (its update belongs here, not to the CPU lane)."""
        return b in self.state

    # -- the arena comes and goes ------------------------------------------------------------------------

    def activate(self, plan: Plan, arena: torch.Tensor) -> None:
        """The executor allocated ``plan``'s arena and issued its resident copies: bring the state of its
        device-optimizer buckets in from the host."""
        if self.state:
            raise InvariantError("device optimizer state activated twice")
        ctx, host = self.ctx, self.slots.hosted()
        lowp = ctx.dtype != torch.float32
        read_after = read_after_update(plan)
        self.demoted = len(read_after)
        homed = frozenset(plan.device_optimizer) - read_after if plan is self.executor.train_plan else host.away
        for b in plan.device_optimizer:
            if b in read_after:
                continue  # run as a resident bucket with the host optimizer: [Note: read after the update]
            host.require_copy(b)  # a device-homed bucket comes in from its parked copy
            bucket = plan.buckets[b]
            n, k_w, k_s = bucket.trainable_numel, plan.resident_buffer[b], plan.state_buffer[b]
            if k_w is None or k_s is None:
                raise InvariantError(f"plan: device-optimizer bucket {b} lacks its weights or state buffer")
            w_off, s_off = plan.buffers[k_w].offset, plan.buffers[k_s].offset
            weights = arena[w_off: w_off + bucket.numel * ctx.itemsize].view(ctx.dtype)
            fp32 = arena[s_off: s_off + plan.buffers[k_s].size].view(torch.float32)
            if lowp:
                state = DeviceState(weights, fp32[:n], fp32[n: 2 * n], fp32[2 * n: 3 * n])
            else:
                state = DeviceState(weights, weights, fp32[:n], fp32[n: 2 * n])
            waits = [self.slots.boundary] + [e for e in (self.slots.adam_event.get(b),) if e is not None]
            copies = [(state.exp_avg, host.exp_avg[b]), (state.exp_avg_sq, host.exp_avg_sq[b])]
            if b in host.fresh:  # never updated: m and v are zeros, made here, not copied
                copies = []
                state.exp_avg.zero_()
                state.exp_avg_sq.zero_()
            if lowp:
                copies.insert(0, (state.master, host.master[b][:n]))
            for dst, src in copies:  # one copy queue, in order: the last one's event covers all three
                self.filled[b] = ctx.backend.h2d(dst, src, waits)
                self.counters["state_h2d_bytes"] += dst.numel() * 4
            self.state[b] = state
            self.fills[b] = tuple(e for e in (self.filled.get(b), self.slots.h2d_event.get(b)) if e is not None)
        if homed != host.away and self._relayout_pays(homed):
            self._rehome(homed)
        if plan is self.executor.train_plan:
            self._run_postponed()

    def _relayout_pays(self, homed: frozenset[int]) -> bool:
        """Whether the host arena is laid out again for ``homed``: only where the state that would move (the
        regions of the buckets leaving the host, the parked copies of those coming home) is more than
        ``1/RELAYOUT_SHARE`` of the arena, since a re-layout holds the old and the new arena at once. Else a
        bucket leaving keeps its (stale) regions, and one coming home its parked copy, which serves the host
        optimizer as well: the small misses of the warm-up's estimate ([Note: the first step's host memory] in
        ``warmup.py``) cost a little memory after the first step instead of a second arena during it."""
        host = self.slots.hosted()
        coming, leaving = host.away - homed, homed - host.away
        if any(b not in host.parked for b in coming):
            return True  # (rehome says what went wrong)
        lowp = self.ctx.dtype.itemsize if self.ctx.dtype != torch.float32 else 0
        moved = sum(host.parked_bytes_of(b) for b in coming) + sum(
            host.master_numel[b] * 4 + host.buckets[b].numel * lowp + host.buckets[b].trainable_numel * 8
            for b in leaving)
        return moved * RELAYOUT_SHARE > host.nbytes

    def _rehome(self, homed: frozenset[int]) -> None:
        """The training plan changed which buckets are device-homed ([Note: device-homed buckets] in
        ``host/state.py``): once the copies in from the old host arena are done, lay it out again. A bucket
        leaving the host has no host copy from now on (``dirty``: the next read parks one)."""
        ctx, host = self.ctx, self.slots.hosted()
        leaving = homed - host.away
        ctx.cpu.drain()  # no CPU AdamW still writes the old arena (the updates of the step that re-planned)
        ctx.backend.synchronize()  # every copy reading the old arena (weights, state) has landed
        old = host.rehome(homed)
        ctx.backend.unpin_host(old)
        ctx.backend.pin_host(host.arena)
        del old  # its last reference: the old region goes back to the system
        self.dirty |= leaving
        for b in leaving:
            self.fills.pop(b, None)  # nothing parked to free
        host.show_state(ctx.optimizer, list(ctx.params), range(len(host.buckets)))  # every view moved

    # -- the first updates ([Note: the first step's host memory] in warmup.py) ------------------------------

    def will_own(self, b: int) -> bool:
        """Bucket ``b`` is fresh (device-homed before any plan, never updated) and the first training plan,
        built and about to be activated by ``step()``, keeps its optimizer on the device: its first update
        can wait for that plan and run there, so the host never holds its m and v."""
        ex = self.executor
        if b not in self.slots.hosted().fresh or ex.train_plan is not None or ex.ahead is None:
            return False
        trace, plan = ex.ahead
        if trace is not ex.trace or not trace.complete:
            return False  # step() will not activate this plan (executor.replan)
        if self._ahead_homed is None or self._ahead_homed[0] is not plan:
            self._ahead_homed = (plan, frozenset(plan.device_optimizer) - read_after_update(plan))
        return b in self._ahead_homed[1]

    def postpone(self, update: Postponed) -> None:
        self.postponed.append(update)

    def before_host_update(self, b: int) -> None:
        """The CPU lane is about to update bucket ``b``: a fresh one gets its m and v (zeros) on the host now,
        and ``optimizer.state`` shows them."""
        host = self.slots.hosted()
        if b in host.fresh:
            host.materialize(b)
            host.show_state(self.ctx.optimizer, list(self.ctx.params), (b,))

    def flush_postponed(self) -> None:
        """Something needs the host's values before the plan is active (a forward, a read of the state,
        ``close``): the postponed updates run on the host after all."""
        todo, self.postponed = self.postponed, []
        for x in todo:
            self._to_host(x)

    def _to_host(self, x: Postponed) -> None:
        """Hand a postponed first update to the CPU lane (``on_host``)."""
        if self.on_host is None:
            raise InvariantError("postponed device updates with no host lane to hand them to")
        self.on_host(x)

    def _run_postponed(self) -> None:
        """The first training plan is active: its device-optimizer buckets take their first update here."""
        todo, self.postponed = self.postponed, []
        for x in todo:
            if x.bucket not in self.state:  # not kept on the device after all: the host updates it
                self._to_host(x)
                continue
            # the update rewrites the weights the activation is still copying in
            self.ctx.backend.wait(self.slots.h2d_event[x.bucket])
            self.update_summed(x.bucket, x.params, x.ready, x.hparams, x.factors, grads=x.grads)

    def deactivate(self) -> None:
        """The arena goes (the backend synchronized): hand the state back to the host first."""
        self.sync_to_host()
        self.state.clear()
        self.filled.clear()
        self.fills.clear()

    def sync_to_host(self) -> None:
        """Bring the host copy of every device-optimizer bucket up to date (no-op when it is)."""
        if not self.dirty:
            return
        ctx, host = self.ctx, self.slots.hosted()
        lowp = ctx.dtype != torch.float32
        start = [ctx.backend.record()]  # after the updates issued so far on the compute stream
        copies = []
        parked = [b for b in sorted(self.dirty) if b in host.away]
        for b in parked:
            host.park(b)  # device-homed: a host copy again, until its next update
        host.show_state(ctx.optimizer, list(ctx.params), parked)
        for b in sorted(self.dirty):
            state = self.state[b]
            n = state.exp_avg.numel()
            pairs = [(host.exp_avg[b], state.exp_avg), (host.exp_avg_sq[b], state.exp_avg_sq)]
            if lowp:
                pairs += [(host.master[b][:n], state.master), (host.source(b), state.weights)]
            else:
                pairs.append((host.master[b], state.weights))
            for dst, src in pairs:
                copies.append(ctx.backend.d2h(dst, src, start))
                self.counters["state_d2h_bytes"] += src.numel() * src.element_size()
        for event in copies:
            event.synchronize()
        self.dirty.clear()

    def reload(self) -> None:
        """The host state was written from outside (a loaded checkpoint): copy it in again."""
        plan, arena = self.executor.plan, self.executor.arena
        if not self.state or plan is None or arena is None:
            return
        self.ctx.backend.synchronize()
        self.state.clear()
        self.filled.clear()
        self.fills.clear()
        self.dirty.clear()
        self.activate(plan, arena)

    # -- the update ------------------------------------------------------------------------------------

    @torch.no_grad()
    def update(self, b: int, grad: torch.Tensor, buffer: int | None, params: frozenset[int],
               hparams: HParams | None) -> Event:
        """Bucket ``b``'s grads are complete in its slot ``grad`` (plan buffer ``buffer``): AdamW on the
        device for ``params``, then the slot is free. Returns the event after which the update is done."""
        ctx = self.ctx
        if hparams is None:
            raise InvariantError("a device update runs outside a backward")
        state = self._ready(b)
        step = self._step_fn()
        chunk = 0 if step == self._onepass else self._widen_chunk(grad)
        for s, e, count, hp in self._segments(b, params, hparams):
            self._chunked(step, state, grad, s, e, count, hp, chunk)
        event = self._updated(b, state, rounded=step == self._onepass)
        self.slots.updated.add(b)  # fetched again in this backward (after a departure): refused (slots.py)
        for p in params:  # [Note: a departed step's updates wait]: a saved view read after this raises, as torch's
            torch.autograd.graph.increment_version(ctx.params[p])  # does for an in-place write of a saved tensor
        if buffer is not None:
            self.slots.done[buffer] = event  # the grad slot may be reused after the update read it
        else:
            ctx.memory.add("slots", -grad.numel() * grad.element_size())
        return event

    @torch.no_grad()
    def update_summed(self, b: int, params: frozenset[int], ready: Event, hparams: HParams,
                      factors: tuple[float, ...], grads: torch.Tensor | None = None) -> Event:
        """``step()`` with ``overlap_optimizer=False``: bucket ``b``'s grads were summed on the host like any
        bucket's (accumulation, norms, clipping, the float16 overflow check); they come back a piece at a
        time (see [Note: deferred device updates]) and AdamW runs on the device, each piece's grads
        multiplied by ``factors`` first (the loss-scale inverse, then the clipping coefficient), as the host
        update does. ``grads``: host grads to use instead of the sum (a first update postponed from an
        overlapped backward, in the device dtype: 16-bit grads are widened on the device, as ``update`` does)."""
        ctx, host = self.ctx, self.slots.hosted()
        ready.synchronize()  # the host sum is final (its copy, or the CPU lane's widening or adding)
        state = self._ready(b)
        step = self._step_fn()
        summed = host.grad_sum(b) if grads is None else grads  # raises a clear InvariantError if there are no sums
        widen = summed.dtype != torch.float32 and step != self._onepass
        # a piece, and its widened copy where the update needs fp32 grads
        per = summed.element_size() + (4 if widen else 0)
        chunk = max(1, self._step_chunk(summed.numel()) * 4 // per)
        piece = ctx.backend.empty(chunk * summed.element_size()).view(summed.dtype)
        ctx.memory.add("slots", chunk * per)
        fused = step is self._fused or step == self._onepass
        scale = 1.0
        for f in factors:
            scale *= f
        try:
            for s, e, count, hp in self._segments(b, params, hparams):
                for lo in range(s, e, chunk):
                    hi = min(e, lo + chunk)
                    g = piece[: hi - lo]
                    # the piece is rewritten only after the compute that read the previous one
                    ctx.backend.wait(ctx.backend.h2d(g, summed[lo:hi], [ctx.backend.record()]))
                    if widen:  # exactly, as both tiers widen 16-bit grads ([Note: widening 16-bit grads])
                        g = g.float()
                    if fused and scale != 1.0:  # as the host kernel: one multiply by the product
                        g.mul_(scale)
                    elif not fused:  # as the host's torch path: one factor after the other
                        for f in factors:
                            if f != 1.0:
                                g.mul_(f)
                    step(state, g, 0, hi - lo, lo, hi, count, hp)
                    self.counters["grad_h2d_bytes"] += (hi - lo) * summed.element_size()
        finally:
            ctx.memory.add("slots", -chunk * per)
        return self._updated(b, state, rounded=step == self._onepass)

    def _ready(self, b: int) -> DeviceState:
        """Bucket ``b``'s state, once its copy from the host has landed."""
        fill = self.filled.pop(b, None)
        if fill is not None:
            self.ctx.backend.wait(fill)
        return self.state[b]

    def _step_fn(self):
        """The device AdamW: with ``offload.AdamW(fused=True)`` (the default) the backend's one-pass kernel
        where it has one (CUDA with the cupy extra: the host kernel's numbers, see ``backend/cupy_adamw.py``),
        else torch's ``_fused_adamw_``; with ``fused=False`` torch's single-tensor ops (torch's numbers)."""
        if not self.ctx.optimizer.fused:
            return self._plain
        if not self._kernel_asked:
            self._kernel, self._kernel_asked = self.ctx.backend.onepass_adamw(), True
        if self._kernel is not None:
            return self._onepass
        return self._fused if FUSED_AVAILABLE else self._plain

    def _onepass(self, state: DeviceState, grad: torch.Tensor, gs: int, ge: int, s: int, e: int, step: int,
                 hp: tuple[float, float, float, float, float]) -> None:
        """The backend's one-pass kernel: reads the grad in its own dtype (no widened temporary) and writes
        the 16-bit weights of ``[s, e)`` with the master, m and v (``_updated`` then copies nothing)."""
        lr, b1, b2, eps, wd = hp
        lowp = None if state.weights is state.master else state.weights[s:e]
        if self._kernel is None:
            raise InvariantError("the one-pass device AdamW ran without a kernel")
        self._kernel(state.master[s:e], grad[gs:ge], state.exp_avg[s:e], state.exp_avg_sq[s:e], step=step, lr=lr,
                     beta1=b1, beta2=b2, eps=eps, weight_decay=wd, lowp_out=lowp, fma=HOST_FMA)

    def _segments(self, b: int, params: frozenset[int], hparams: HParams):
        """(start, end, step count after it, hyperparameters) of each piece of bucket ``b`` one AdamW call
        updates: a run of same-group parameters all stepped the same number of times, else one parameter
        (as ``HostState.update`` splits them); the step counts go up as they are handed out."""
        ctx, host = self.ctx, self.slots.hosted()
        for run in self.slots.buckets[b].runs:
            hp = hparams[run.group]
            steps = {host.steps[p] for p in run.params}
            if params.issuperset(run.params) and len(steps) == 1:
                yield run.start, run.end, steps.pop() + 1, hp
                host.count_steps(run.params)
                continue
            for p in run.params:
                if p in params:
                    off = host.offset[p]
                    yield off, off + ctx.specs[p].numel, host.steps[p] + 1, hp
                    host.count_steps((p,))

    def _updated(self, b: int, state: DeviceState, rounded: bool = False) -> Event:
        """After bucket ``b``'s AdamW: the 16-bit weights from the new master (unless the kernel wrote them:
        ``rounded``); the host copy is stale."""
        if state.weights is not state.master and not rounded:  # to nearest even, as the host's 16-bit copy is
            state.weights[: state.master.numel()].copy_(state.master)
        self.dirty.add(b)
        host = self.slots.hosted()
        if b in host.away and b in host.parked:  # device-homed: its host copy is stale from now on, so it goes
            for e in self.fills.pop(b, ()):
                e.synchronize()  # the copies in that read it (issued at activation: long done)
            host.drop(b)
            host.show_state(self.ctx.optimizer, list(self.ctx.params), (b,))
        self.counters["updates"] += 1
        return self.ctx.backend.record()

    def _step_chunk(self, numel: int) -> int:
        """[Note: deferred device updates] With ``overlap_optimizer=False`` the grads are summed on the host
        (as every bucket's are: accumulation, clipping and the float16 overflow check need no second
        mechanism) and the plan has no device buffer for them at ``step()``. There, no activation and no
        autograd grad is alive, so the room the plan keeps for them (``activation_peak_bytes +
        max_grad_bytes``) is free: the summed grads come back through a temporary of at most that size,
        a piece at a time. That costs 4 bytes per parameter of host-to-device traffic the cost model does
        not count (it plans device updates at the grads' completion); the CPU AdamW is still spared."""
        plan = self.executor.plan
        trace = plan.trace if plan is not None else None
        room = trace.activation_peak_bytes + trace.max_grad_bytes if trace is not None else 0
        return max(1, min(numel, min(room, MAX_PIECE_BYTES) // 4))

    def _widen_chunk(self, grad: torch.Tensor) -> int:
        """Elements of 16-bit grads widened to fp32 at a time (0: fp32 grads, used as they are).

        [Note: widening 16-bit grads] Both tiers widen 16-bit grads (exactly) before an fp32 update. On the
        device that needs a temporary the plan has no buffer for, so it is made a piece at a time, no larger
        than the plan's room for the largest grad autograd materialises (``Trace.max_grad_bytes``): when a
        bucket's grads are complete its last grad has already moved into the grad slot, so that room is
        free. AdamW is elementwise, so the pieces change no number. (The backend's one-pass kernel, where it
        has one, reads the 16-bit grad directly and needs none: ``_onepass``.)"""
        if grad.dtype == torch.float32:
            return 0
        plan = self.executor.plan
        room = plan.trace.max_grad_bytes if plan is not None else 0
        return max(1, room // 4)

    def _chunked(self, step, state: DeviceState, grad: torch.Tensor, s: int, e: int, count: int,
                 hp: tuple[float, float, float, float, float], chunk: int) -> None:
        if not chunk:
            step(state, grad, s, e, s, e, count, hp)
            return
        memory = self.ctx.memory
        for lo in range(s, e, chunk):
            hi = min(e, lo + chunk)
            memory.add("slots", (hi - lo) * 4)
            try:
                step(state, grad[lo:hi].float(), 0, hi - lo, lo, hi, count, hp)
            finally:
                memory.add("slots", -(hi - lo) * 4)

    @staticmethod
    def _plain(state: DeviceState, grad: torch.Tensor, gs: int, ge: int, s: int, e: int, step: int,
               hp: tuple[float, float, float, float, float]) -> None:
        """torch's single-tensor AdamW ops (``offload.AdamW(fused=False)``): bit for bit torch's. Elements
        ``[s, e)`` of the state, ``[gs, ge)`` of ``grad``."""
        lr, b1, b2, eps, wd = hp
        adamw_(state.master[s:e], grad[gs:ge], state.exp_avg[s:e], state.exp_avg_sq[s:e], step, lr=lr, beta1=b1,
               beta2=b2, eps=eps, weight_decay=wd)

    @staticmethod
    def _fused(state: DeviceState, grad: torch.Tensor, gs: int, ge: int, s: int, e: int, step: int,
               hp: tuple[float, float, float, float, float]) -> None:
        """torch's fused AdamW kernel on the device (``offload.AdamW``'s default)."""
        lr, b1, b2, eps, wd = hp
        master, m, v = state.master[s:e], state.exp_avg[s:e], state.exp_avg_sq[s:e]
        steps = [torch.full((), float(step), dtype=torch.float32, device=master.device)]
        torch._fused_adamw_([master], [grad[gs:ge]], [m], [v], [], steps, lr=lr, beta1=b1, beta2=b2,
                            weight_decay=wd, eps=eps, amsgrad=False, maximize=False)

    # -- reporting -------------------------------------------------------------------------------------

    def kernel_name(self) -> str:
        """Which AdamW updates device-optimizer buckets: "one-pass" (the backend's, cupy), "torch-fused" or
        "torch" (single-tensor ops); the first device update decides (before it: "unchosen")."""
        if not self.ctx.optimizer.fused:
            return "torch"
        if not self._kernel_asked:
            return "unchosen"
        return "one-pass" if self._kernel is not None else ("torch-fused" if FUSED_AVAILABLE else "torch")

    def stats(self, plan: Plan | None) -> dict:
        """Bytes per placement of ``plan`` (the training plan) and this tier's counters."""
        out: dict = {"enabled": self.ctx.config.device_optimizer, "buckets": 0, "bytes": None,
                     "demoted_buckets": self.demoted, "kernel": self.kernel_name(), **self.counters}
        if plan is not None and plan.placement:
            out["buckets"] = len(plan.device_optimizer)
            out["bytes"] = placement_bytes(plan.buckets, plan.itemsize, plan.placement)
        host = self.slots.host
        if host is not None and self.ctx.dp is None:  # a rank's sharded host state has its own layout
            out.update(host_bytes(host, plan))
        return out


def host_bytes(host: HostState, plan: Plan | None) -> dict:
    """The host side of each placement ([Note: device-homed buckets] in ``host/state.py``), measured from the
    host arena's regions (unaligned; the arena adds alignment and the shared grad ring, ``host_ring_bytes``):
    ``host_bytes`` and ``host_bytes_per_param`` per placement of ``plan`` ("device-homed" where the plan
    runs a device-optimizer bucket with the host optimizer, [Note: read after the update], its bytes are
    still on the host and counted under "device-optimizer"; "host" before the first plan); the parked host
    copies of device-homed state (pageable, outside the arena: only between a read of the state or the
    arena's going and the bucket's next device update); the fp32 grad sums device-homed buckets keep on the
    host with ``overlap_optimizer=False``."""
    where: list[str] = ["host"] * len(host.buckets)
    if plan is not None and plan.placement and len(plan.placement) == len(host.buckets):
        where = [x.value for x in plan.placement]
    nbytes: dict[str, int] = {}
    params: dict[str, int] = {}
    for b, bucket in enumerate(host.buckets):
        nbytes[where[b]] = nbytes.get(where[b], 0) + host.region_bytes(b)
        params[where[b]] = params.get(where[b], 0) + bucket.numel
    away = host.away
    grad_sums = sum(host.buckets[b].trainable_numel * 4 for b in away) if host.grad else 0
    return {"host_bytes": nbytes,
            "host_bytes_per_param": {k: nbytes[k] / params[k] for k in nbytes if params[k]},
            "host_ring_bytes": host.layout.ring_bytes,
            "host_parked_bytes": host.parked_bytes,
            "device_homed_buckets": len(away),
            "host_grad_sum_bytes_device_homed": grad_sums}



def read_after_update(plan: Plan) -> set[int]:
    """Device-optimizer buckets of ``plan`` whose weights an event after their last grad still reads.

    [Note: read after the update] The device update writes the bucket's weights in place the moment its
    grads are complete. Autograd reads a weight only in the nodes that produce its grad, so normally nothing
    reads it after; but a node may read a weight it sends no grad to (``x @ w.detach()``), and torch's
    AdamW would not have moved it yet. Such a bucket runs as what its buffers also make it, a resident
    bucket with the host optimizer (its grads to the host, the CPU AdamW, its new weights in after
    ``step()``): numbers stay torch's; only the plan's timing for it is off (``stats()["demoted_buckets"]``)."""
    return reads_after_last_grad(plan, plan.device_optimizer)


def streamed_reads_after_update(plan: Plan) -> frozenset[int]:
    """The buckets ``plan`` streams whose weights its step reads after their last grad.

    [Note: streamed weights read after their update] Overlapped, a bucket's CPU AdamW runs as soon as its grads
    are complete and writes its host weights in place. Autograd reads a weight only in the nodes that give it a
    grad, so nothing normally reads it after; but a node may read a weight it sends no grad to
    (``F.linear(h, w.detach())`` before ``w``'s own module), and its backward comes after ``w``'s grads are
    complete. A resident bucket's device slot keeps the old weights until ``step()`` refreshes it, as torch
    does; a streamed one is fetched again from the host, whose weights the update has changed: silently wrong
    grads (found on the CPU backend, ``DetachedReuse`` at 1.2x its weights: losses off in the 7th digit). So the
    update of such a bucket waits for the end of backward (``GradPipeline``'s held updates), as the first
    step's do ([Note: the first step's host memory] in warmup.py: the grads copied out of the ring on the CPU
    lane, the update submitted by ``release_held``). Device-optimizer buckets have their own rule
    (``read_after_update``). A step that leaves its plan reads what the plan did not say: the next Note.

    [Note: a departed step's updates wait] Off its plan a backward may read a weight after its bucket's update in
    ways the trace did not say; torch reads it from before the step. (1) A departure noticed in forward (a bucket
    needed that the plan did not bring, other calls, or a call reading a parameter its planned call did not:
    ``PlanExecutor.check_use``, without which a read of a resident weight showed only at its backward's unpack):
    ``GradPipeline.finish`` holds every update of the step not yet issued to the end of its backward
    (``release_held``, in the order the grads completed, as above), so every read sees the weights before the step;
    the same from a departure inside backward on. Cost, once per change of path (the engine re-plans after it):
    that step's CPU AdamW runs after its backward instead of beside it, its grads copied out of the ring to
    pageable memory first (tests/runtime/test_off_plan_late_read.py; data parallel: no rank writes its shard of
    the node's copy before the read, tests/distributed/test_node_copy_written.py). (2) A departure noticed only
    in backward, after an update was issued (``W (W.detach() h)`` inside ``W``'s own call touches what the plan's
    call does): that update rewrote the host copy and the departure dropped the arena, so copying the bucket in
    again in that backward raises an OffloadError (``SlotTable.updated``, ``fetch_on_demand`` in slots.py).
    (3) A fast step sees no calls ([Note: the fast path]): a device bucket updated in its slot and then read by a
    node no plan foresaw would give the new weights; ``update`` bumps its parameters' version counters, so autograd
    refuses that read, as torch refuses a saved tensor written in place. A host-optimizer slot is not written in
    backward. Deferred updates run in ``step()``: nothing to hold."""
    resident = set(plan.resident)
    return frozenset(reads_after_last_grad(plan, (b for b in range(len(plan.buckets)) if b not in resident)))


def reads_after_last_grad(plan: Plan, buckets: Iterable[int]) -> set[int]:
    """Those of ``buckets`` whose weights an event of ``plan``'s step reads after their last grad ([Note: read
    after the update]; [Note: streamed weights read after their update])."""
    chosen = set(buckets)
    if not chosen:
        return set()
    bucket_of = locate(plan.buckets)[0]
    last_grad: dict[int, int] = {}
    last_use: dict[int, int] = {}
    for i, (event, uses) in enumerate(zip(plan.trace.events, plan.trace.uses)):
        if event.kind is EventKind.GRAD and bucket_of[event.key] in chosen:
            last_grad[bucket_of[event.key]] = i
        for p in uses:
            if bucket_of[p] in chosen:
                last_use[bucket_of[p]] = i
    return {b for b in chosen if last_use.get(b, -1) > last_grad.get(b, len(plan.trace.events))}
