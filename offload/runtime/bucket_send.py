"""A fast step's resident bucket, gathered and sent by one routine resolved once per plan.

[Note: one routine per fast bucket] (issue 17, the hot path) On a fast step ([Note: the fast path] in fast_path.py)
a bucket's last grad in the plan's order gathers the whole bucket ([Note: one hook's work per bucket]). Through the
general chain (``GradPipeline.gather_bucket`` -> ``_grad_slot`` -> ``finish`` -> ``_copy_piece`` ->
``_submit_update``) in-step timers put ~90 us a bucket of bookkeeping beside the copies and the AdamW kernel on our
CPU (overhead-profile.md, section 12): each step re-derives what the plan fixed (the slot's plan buffer and the
buffers it waits for, whether the bucket's grads fill it whole, that they are all of its grads, that it crosses in
one piece, the parameter set its update covers), and sets up records that the same routine takes down again (the
slot among those being gathered, its parameter views, the received set grown grad by grad, the completion test).

``FastSend.route`` answers, per bucket and once per plan, what the plan fixed; per call it checks only what can
change between steps (nothing of the bucket gathered or sent yet this backward, no update of it held or owned by the
device, the step still on the plan; views are looked up in the executor's per-arena caches, never held here).
``send`` then does what the general chain does for such a bucket, in the same order, with the same backend calls,
waits and events: the waits for the buffers the slot reuses and the compute boundary; the slot cleared unless the
grads fill it whole; one multi-tensor copy of the grads into it; the device-to-host copy into the grad ring after
the compute, the bucket's last update and the ring's earlier readers; its AdamW on the CPU lane after that copy and
the bucket's last host-to-device copy; the ring's bytes lent to that update, the buffer free after the copy. Every
record the rest of the pipeline reads afterwards is left as the general chain leaves it (``received``, ``finished``,
``pending``, ``copies``, ``slots.done``, ``slots.adam_event``, ``lane_order``, the lane log, ``d2h_bytes``), so a
departure, the end of backward, ``step()`` and a fault see no difference. Anything else (data parallel,
accumulation, held or device updates, a bucket crossing in pieces, a slot off the plan) takes the general chain.

Measured (benchmarks/results/cpu-2026-11-26/overhead-profile.md, section 14; the 200-module MLP, AMD EPYC VM):
~0.2 ms of CPU a step less over 10 buckets, i.e. ~20 us a bucket of the chain's bookkeeping; what is left of a
bucket's Python is mostly the lane items, the grad ring and the update's own (``HostState.update``).

[Note: sent as one batch] (issue 17, the hot path) Where a fast step's buckets are sent after backward ([Note: sent
after backward] in fast_path.py: the CPU lane runs inline) on the CPU backend, whose device memory is host memory,
``send_all`` sends the complete buckets as one CPU-lane item instead of two items each (the copy to the host, the
update): per bucket, in the order their last grads came, its grads are copied from ``p.grad`` with one multi-tensor
copy into one piece of the grad ring (the padding between parameters cleared first, as the slot was), and its
AdamW reads them there; the next bucket's grads go into the same piece after that update. Then every bucket's step
count goes up in one op (``HostState.count_runs``; run by run where the counts differ). What it leaves out, and why
no value changes: the hop through the device grad slot (on this backend a copy between two host buffers of the
same bytes; the plan's slot is not written, so its last reader is still the one recorded), one lane item and two
events a bucket, and the Python around them. Its waits are the union of the buckets' (each bucket's last update,
its last host-to-device copy, which reads the masters the update rewrites, and the ring bytes' earlier readers),
all taken before the first bucket, by the item itself (a failed wait fails every bucket's event). Kept per bucket:
the records ``send`` leaves (``received``, ``finished``, ``pending``, ``adam_event``, ``lane_order``,
``d2h_bytes``, the lane log's two entries), and an event of its own for its update, set as soon as it ran: where the
batch is queued on the lane's thread (chaos, a busy lane), ``step()``'s pipelined refresh still copies each bucket
as its update ends ([Note: the refresh pipelined] in executor.py). The copy's log entry carries the times of the
bucket's copy (:class:`Mark`); the batch's own event is the ring bytes' reader and the copies' end. A bucket
whose update raises stops no other; the batch raises the first failure once every bucket was tried. Not batched:
fewer than two buckets, a bucket the routine declines, the lanes on threads (``OFFLOAD_CPU_COPIES=lanes``) and
CUDA, where each bucket still goes at its last grad, overlapped with backward. Measured in overhead-profile.md,
section 16.

With the default fused kernel (fp32 or bf16) the batch leaves out the copy too ([Note: updated from p.grad] in
host/segments.py, session 23): every bucket's runs are updated in ONE kernel call over segments (one per parameter,
its grad read in ``p.grad``; one per gap of padding, its grads zeros; ``host_layout`` keeps each bucket's regions
side by side, so a segment names its own addresses), so the ring is neither written nor lent and the batch waits
for no reader of it. Nothing but a batch's own updates reads its ring bytes (the grad norms read the accumulation's
fp32 sums, which a batched step never has; the timeline reads the lane log; a departure, save/load and data parallel
never read the ring bytes of an overlapped update), so no record changes. The per-bucket events, records and
lane-log entries stay (a bucket's "d2h" entry: no time, its bytes counted as before). Where the batch runs on the
issuing thread (the inline lane, unless its thread is busy), nothing can wait for a bucket's event before the batch
returns (``step()`` comes after it), so one call serves every bucket and their events are set after it; on the
lane's thread (queued: chaos, a busy lane) it calls the kernel once per bucket and sets each event as that call
ends, so ``step()``'s pipelined refresh still copies each bucket as its update ends. Measured in
overhead-profile.md, section 17.
"""

from __future__ import annotations

import operator
import threading
import time
import weakref
from functools import partial
from typing import TYPE_CHECKING, Sequence, cast

import torch

from ..backend.base import HostEvent
from ..errors import InvariantError
from ..host.segments import BatchUpdate
from .grad_records import PendingGrads

if TYPE_CHECKING:
    from ..backend.base import Event
    from ..host.grad_ring import GradRing, Lent
    from ..planning.plan import Plan
    from .fast_path import Closing
    from .grads import GradPipeline


_is_none = partial(operator.is_, None)


def copy_into_slot(params, ps, views, grads: list[torch.Tensor], memory, nbytes: int, leave: bool = False) -> None:
    """The grads of ``ps`` (held in ``p.grad``, in the plan's order) into their slot ``views`` with one
    multi-tensor copy, their ``nbytes`` held at once for an instant (``memory.passing``), then out of ``p.grad``
    (``leave``: left there for the exposure to replace, [Note: grads left for the exposure]). Shared by the
    general chain (``GradPipeline.gather_bucket``) and :meth:`FastSend.send`."""
    memory.passing(nbytes)
    dst = [views[q] for q in ps]
    if torch.is_grad_enabled():  # backward(create_graph=True)
        with torch.no_grad():
            torch._foreach_copy_(dst, grads)
    else:
        torch._foreach_copy_(dst, grads)
    if not leave:
        for q in ps:
            params[q].grad = None


class Route:
    """What the plan fixed about sending bucket ``b`` on a fast step (see [Note: one routine per fast bucket])."""

    __slots__ = ("b", "ps", "got", "k", "offset", "after", "numel", "whole", "nbytes", "what")

    def __init__(self, b: int, ps: tuple[int, ...], k: int, offset: int, after: tuple[int, ...], numel: int,
                 whole: bool, nbytes: int) -> None:
        self.b, self.ps, self.got, self.k, self.offset = b, ps, frozenset(ps), k, offset
        self.after = after  # plan buffers whose readers the slot waits for
        self.numel = numel  # the slot's elements: the bucket's trainable prefix, all of it crossing in one piece
        self.whole = whole  # the grads write every element of the slot: no clearing first
        self.nbytes = nbytes  # the grads' bytes
        self.what = f"AdamW of bucket {b}"


class Mark:
    """When one bucket's grads were copied in a batch (``time.perf_counter()``), for the lane log's timeline: the
    batch's event is the one to wait for ([Note: sent as one batch])."""

    __slots__ = ("started", "finished")

    def __init__(self) -> None:
        self.started: float | None = None
        self.finished: float | None = None


class FastSend:
    """Routes resolved per plan, and the routine that sends a fast step's bucket along one."""

    def __init__(self, grads: GradPipeline) -> None:
        self.grads = grads
        self._plan: Plan | None = None
        self._routes: dict[int, Route | None] = {}
        self.sent = 0  # buckets sent by :meth:`send` or in a batch (tests read it)
        self.batches = 0  # batches sent by :meth:`send_all` ([Note: sent as one batch]; tests read it)
        self.direct = 0  # of them, updated from the grads in ``p.grad`` ([Note: updated from p.grad]; tests read it)
        self.copied = 0  # batches with a table that ``ready`` refused at the call, updated from a copy (tests read it)
        # [Note: updated from p.grad]: per set of buckets, its table (or None), for one plan and host state
        self._direct: dict[tuple[int, ...], BatchUpdate | None] = {}
        self._direct_plan: Plan | None = None
        self._direct_host: object = None
        # per grad ring (held weakly: a new host arena has a new one): (offset, bucket) -> its grads' views there
        self._ring_views: weakref.WeakKeyDictionary[GradRing, dict[tuple[int, int], list[torch.Tensor]]] = (
            weakref.WeakKeyDictionary())

    def route(self, b: int, ps: tuple[int, ...], nbytes: int) -> Route | None:
        """Bucket ``b``'s route if it can be sent by :meth:`send` now, else None (the general chain)."""
        grads = self.grads
        executor = grads.executor
        plan = executor.plan
        if plan is not self._plan:
            self._plan, self._routes = plan, {}
        routes = self._routes
        r = routes[b] if b in routes else routes.setdefault(b, self._resolve(b, ps, nbytes))
        if (r is None or not executor.on_plan or r.ps != ps or b in grads.received or b in grads.gathering
                or b in grads.pending or grads.holds(b) or grads.device.owns(b) or b in grads.slots.hosted().fresh):
            return None
        return r

    def _resolve(self, b: int, ps: tuple[int, ...], nbytes: int) -> Route | None:
        """What the plan fixes about bucket ``b``, or None where something of it needs the general chain."""
        grads = self.grads
        ctx, slots, plan = grads.ctx, grads.slots, grads.executor.plan
        if plan is None or grads.deferred or ctx.dp is not None:
            return None
        k = plan.grad_buffer[b]
        if k is None:
            return None
        host, bucket = slots.hosted(), slots.buckets[b]
        n = bucket.grad_numel
        if host.chunks(b, True) != [(0, n)] or n != bucket.trainable_numel:
            return None  # in pieces ([Note: chunked grad staging]), or padded to shards
        expected = frozenset(p for run in bucket.runs for p in run.params if p in grads.executor.recorder.touched)
        if frozenset(ps) != expected or len(ps) != len(expected):
            return None
        x = plan.buffers[k]
        return Route(b, ps, k, x.offset, tuple(x.after), n, nbytes == n * ctx.itemsize, nbytes)

    def _slot(self, r: Route) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Bucket ``r.b``'s grad slot (a plan buffer) and its parameters' views in it, after the readers of the
        buffers it reuses and the last compute boundary; cleared unless the grads fill it whole (as
        ``GradPipeline._grad_slot``)."""
        grads = self.grads
        slots, executor, backend, b = grads.slots, grads.executor, grads.ctx.backend, r.b
        rec = executor.recorder
        rec.exclude_begin()  # a stall, not compute: simulated (``Program.grad_waits``)
        done = slots.done
        for j in r.after:
            if j in done:
                backend.wait(done[j])
        backend.wait(slots.boundary)
        rec.exclude_end()
        view = executor.arena_view(r.offset, r.numel)
        views = executor.arena_views(("grads", b, r.k), lambda: grads.views_of(b, view))
        if not r.whole:
            view.zero_()
        return view, views

    def send(self, r: Route, leave: bool = False) -> None:
        """Gather bucket ``r.b``'s grads (waiting in ``p.grad``) into its slot and send them: what
        ``GradPipeline.gather_bucket`` and ``finish`` do for it, in the same order (see the Note). ``leave``: the
        grads stay in ``p.grad`` for the exposure to replace ([Note: grads left for the exposure])."""
        grads = self.grads
        ctx, slots, executor = grads.ctx, grads.slots, grads.executor
        backend, b, ps, params = ctx.backend, r.b, r.ps, ctx.params
        maybe = [params[q].grad for q in ps]
        if any(map(_is_none, maybe)):
            raise InvariantError(f"bucket {b}: a grad of its plan's order is missing at its last grad")
        got = cast("list[torch.Tensor]", maybe)
        view, views = self._slot(r)
        copy_into_slot(params, ps, views, got, ctx.memory, r.nbytes, leave)
        del maybe, got
        grads.received[b] = set(ps)
        grads.finished.add(b)
        # to the host: after the compute, the bucket's last update and the ring's earlier readers
        host = slots.hosted()
        last = slots.adam_event.get(b)
        waits = [backend.record()] if last is None else [backend.record(), last]
        ctx.stats["d2h_bytes"] += r.numel * ctx.itemsize
        landing = host.landing(b, True, 0, r.numel)  # bytes of the grad ring ([Note: grad staging ring])
        staged = landing.view
        after = [*waits, *landing.after]
        if backend.copy_waits_on_host(after):  # as GradPipeline._copy_piece ([Note: timing compute])
            (rec := executor.recorder).exclude_begin()
            d2h = backend.d2h(staged, view, after)
            rec.exclude_end()
        else:
            d2h = backend.d2h(staged, view, after)
        log = ctx.lane_log
        log.add("d2h", b, r.numel * ctx.itemsize, d2h)
        grads.copies.append(d2h)
        # its AdamW on the CPU lane ([Note: one H2D wait per bucket's update] in grads.py)
        h2d = slots.h2d_event.get(b)
        hp, covered = grads.hparams, r.got
        adam = ctx.cpu.issue(lambda: host.update(b, covered, hp, (), staged), [d2h] if h2d is None else [d2h, h2d],
                             r.what)  # [Note: inline copies] (backend/cpu.py)
        slots.adam_event[b] = adam
        grads.lane_order[b] = None  # [Note: the refresh pipelined] (executor.py)
        log.add("cpu_adam", b, 0, adam)
        host.staged_read_by(landing.lent, adam)
        slots.done[r.k] = d2h  # the slot is free once the copy read it
        grads.pending[b] = PendingGrads(covered, d2h)
        self.sent += 1

    def send_all(self, closings: Sequence[Closing], leave: bool) -> None:
        """The complete buckets of a fast step sent after backward, in this order ([Note: sent after backward] in
        fast_path.py): as one batch where it can ([Note: sent as one batch]), else each as ``gather_bucket``
        sends it."""
        grads = self.grads
        ctx = grads.ctx
        routes = []
        if len(closings) > 1 and ctx.cpu.inline and ctx.backend.device.type == "cpu":
            for b, ps, nbytes in closings:
                if (r := self.route(b, ps, nbytes)) is None:
                    break
                routes.append(r)
        if len(routes) < 2 or len(routes) != len(closings):
            for b, ps, nbytes in closings:
                grads.gather_bucket(b, ps, nbytes, leave=leave)
            return
        self._send_batch(routes, leave)

    def _send_batch(self, routes: list[Route], leave: bool) -> None:
        """[Note: sent as one batch]: the buckets of ``routes`` (each as :meth:`route` allowed it) in one CPU-lane
        item (:class:`Batch`), each bucket updated from its parameters' own grads in one kernel call for all
        ([Note: updated from p.grad] in host/segments.py) or, where that does not cover them, each bucket's grads
        copied from ``p.grad`` into one piece of the grad ring and updated from there; then their step counts in
        one op; the records :meth:`send` leaves, per bucket."""
        grads = self.grads
        ctx, slots = grads.ctx, grads.slots
        params, host, itemsize = ctx.params, slots.hosted(), ctx.itemsize
        work, waits = [], []
        for r in routes:
            maybe = [params[q].grad for q in r.ps]
            if any(map(_is_none, maybe)):
                raise InvariantError(f"bucket {r.b}: a grad of its plan's order is missing at its last grad")
            work.append((r, cast("list[torch.Tensor]", maybe), Mark(), HostEvent(what=r.what)))
            # the bucket's last update, and the host-to-device copy that still reads the masters it rewrites
            waits += [e for e in (slots.adam_event.get(r.b), slots.h2d_event.get(r.b)) if e is not None]
        batch = Batch(self, work, host, self._batch_update(routes, host))
        lent: Lent | None = None
        after: tuple[Event, ...] = ()
        if batch.direct is None:  # into the ring: [Note: grad staging ring]
            lent, batch.ring_piece, after = host.ring.take(max(r.numel for r in routes))
            batch.ring_views = self._views_in(host.ring, lent.start, batch.ring_piece, work)
        batch.waits = [*waits, *after]
        done = ctx.cpu.issue(batch.run, (), f"grads and AdamW of buckets {[r.b for r in routes]}")
        host.staged_read_by(lent, done)
        grads.copies.append(done)
        log = ctx.lane_log
        for r, _, copied, updated in work:
            b = r.b
            grads.received[b] = set(r.ps)
            grads.finished.add(b)
            ctx.stats["d2h_bytes"] += r.numel * itemsize
            log.add("d2h", b, r.numel * itemsize, copied)
            slots.adam_event[b] = updated  # set as soon as its update ran: the batch's failures reach it too
            grads.lane_order[b] = None  # [Note: the refresh pipelined] (executor.py)
            log.add("cpu_adam", b, 0, updated)
            grads.pending[b] = PendingGrads(r.got, updated)
            if not leave:
                for q in r.ps:
                    params[q].grad = None
        self.sent += len(routes)
        self.batches += 1

    def _batch_update(self, routes: list[Route], host) -> BatchUpdate | None:
        """[Note: updated from p.grad]'s table for these buckets (built once per plan, host state and set of
        buckets), or None where it does not cover them."""
        key = tuple(r.b for r in routes)
        if self._direct_plan is not self._plan or self._direct_host is not host:
            self._direct_plan, self._direct_host, self._direct = self._plan, host, {}
        if key not in self._direct:
            if len(self._direct) >= 16:
                self._direct.clear()
            self._direct[key] = BatchUpdate.build(host, [(r.b, r.got, r.ps) for r in routes])
        return self._direct[key]

    def _views_of(self, piece: torch.Tensor, work) -> list[list[torch.Tensor]]:
        """Per bucket of ``work``, its parameters' views in ``piece`` (a scratch buffer: not cached)."""
        off, params = self.grads.slots.hosted().offset, self.grads.ctx.params
        return [[piece[off[q]: off[q] + params[q].numel()].view(params[q].shape) for q in r.ps] for r, *_ in work]

    def _views_in(self, ring: GradRing, start: int, piece: torch.Tensor, work) -> list[list[torch.Tensor]]:
        """Per bucket of ``work``, its parameters' views in the ``ring``'s ``piece`` that begins at byte ``start``,
        in its plan's grad order (cached: a steady step takes the same pieces)."""
        off, params = self.grads.slots.hosted().offset, self.grads.ctx.params
        cache = self._ring_views.get(ring)
        if cache is None:
            cache = self._ring_views[ring] = {}
        out = []
        for r, *_ in work:
            views = cache.get((start, r.b))
            if views is None:
                if len(cache) >= 256:
                    cache.clear()
                views = cache[(start, r.b)] = [piece[off[q]: off[q] + params[q].numel()].view(params[q].shape)
                                               for q in r.ps]
            out.append(views)
        return out


class Batch:
    """One batch's CPU-lane item ([Note: sent as one batch]): per bucket of ``work`` (its route, its grads in
    ``p.grad``, the :class:`Mark` of its copy, the event of its update), the waits taken first, then the updates
    from the grads themselves (``direct``: [Note: updated from p.grad]) or from a copy (``ring_piece`` and
    ``ring_views``: the grad ring's; a scratch buffer where ``direct`` refuses the call). Made on the issuing
    thread (:meth:`FastSend._send_batch`); :meth:`run` may run on the lane's."""

    __slots__ = ("send", "work", "host", "direct", "hparams", "update", "issuer", "waits", "ring_piece", "ring_views")

    def __init__(self, send: FastSend, work: list, host, direct: BatchUpdate | None) -> None:
        self.send, self.work, self.host, self.direct = send, work, host, direct
        self.hparams, self.update = send.grads.hparams, host.update
        self.issuer = threading.get_ident()
        self.waits: list[Event] = []
        self.ring_piece: torch.Tensor | None = None
        self.ring_views: list[list[torch.Tensor]] = []

    def run(self) -> None:
        """The lane item: the waits, then every bucket's update; the first failure raised once every bucket was
        tried, and no bucket's event left unset."""
        work, host, direct = self.work, self.host, self.direct
        failed: BaseException | None = None
        try:
            for w in self.waits:  # here, not the lane's: a failed wait fails every bucket's event too
                w.synchronize()
            if direct is not None:
                flat = [g for _, got, _, _ in work for g in got]
                if (count := direct.ready(host, flat)) >= 0:
                    failed = self.from_grads(direct, flat, count)
                else:  # (rare: see the Note) from a copy, as into the ring
                    self.send.copied += 1
                    scratch = torch.zeros(max(r.numel for r, *_ in work), dtype=host.device_dtype)
                    failed = self.copied_then_updated(scratch, self.send._views_of(scratch, work))
            else:
                failed = self.copied_then_updated(cast(torch.Tensor, self.ring_piece), self.ring_views)
        except BaseException as e:
            failed = e
            raise
        finally:
            for *_, updated in work:  # whatever happened, no bucket's event is left unset
                if not updated.query():
                    updated.set(failed or InvariantError("a batch ended before this bucket's update"))
        if failed is not None:
            raise failed

    def copied_then_updated(self, piece: torch.Tensor, views: list[list[torch.Tensor]]) -> BaseException | None:
        """Each bucket's grads copied into ``piece`` and updated from there, as if each were its own lane item:
        one failing stops no other; the first failure is returned."""
        hp, update, clock = self.hparams, self.update, time.perf_counter
        failed: BaseException | None = None
        counted: list[tuple[int, ...]] = []
        for (r, got, copied, updated), dst in zip(self.work, views):
            try:
                copied.started = clock()
                if not r.whole:
                    piece[:r.numel].zero_()  # the padding between parameters sends zeros
                torch._foreach_copy_(dst, got)
                copied.finished = updated.started = clock()
                update(r.b, r.got, hp, (), piece, counts=counted)
                updated.finished = clock()
                updated.set()  # its refresh copy may go now ([Note: the refresh pipelined])
            except Exception as e:  # noqa: BLE001 - raised once every other bucket is done
                updated.set(e)
                failed = failed or e
        self.host.count_runs(counted)
        return failed

    def from_grads(self, batch: BatchUpdate, flat: list[torch.Tensor], count: int) -> BaseException | None:
        """[Note: updated from p.grad]: one kernel call for every bucket where this runs on the issuing thread
        (nothing there can wait for a bucket's event before the batch returns), else a call per bucket, its
        event set as it ends (``step()``'s refresh, on another thread, copies each bucket as its update ends).
        A call that fails fails its buckets only; the rest are updated and counted."""
        work, clock = self.work, time.perf_counter
        failed: BaseException | None = None
        prepared = batch.prepare(flat, self.hparams, count)
        calls: list[tuple[int, int | None, range]]  # (first row, rows or all, the buckets' positions in work)
        if threading.get_ident() == self.issuer:
            calls = [(0, None, range(len(work)))]
        else:
            calls = [(first, rows, range(i, i + 1)) for i, (first, rows) in enumerate(batch.spans)]
        updated_ok: list[int] = []
        for first, rows, at in calls:
            began = clock()
            for i in at:
                _, _, copied, updated = work[i]
                copied.started = copied.finished = updated.started = began  # nothing copied
            try:
                batch.run(prepared, first, rows)
            except Exception as e:  # noqa: BLE001 - raised once every other bucket is done
                for i in at:
                    work[i][3].set(e)
                failed = failed or e
                continue
            ended = clock()
            for i in at:
                work[i][3].finished = ended
                work[i][3].set()  # its refresh copy may go now ([Note: the refresh pipelined])
            updated_ok += at
        if failed is None:
            batch.count(count)
        else:  # only the buckets updated, as ``update(counts=)`` adds only theirs
            self.host.count_runs([run for i in updated_ok for run in batch.bucket_runs[i]])
        self.send.direct += 1
        return failed
