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
"""

from __future__ import annotations

import operator
from functools import partial
from typing import TYPE_CHECKING, cast

import torch

from ..errors import InvariantError
from .grad_records import PendingGrads

if TYPE_CHECKING:
    from ..planning.plan import Plan
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


class FastSend:
    """Routes resolved per plan, and the routine that sends a fast step's bucket along one."""

    def __init__(self, grads: GradPipeline) -> None:
        self.grads = grads
        self._plan: Plan | None = None
        self._routes: dict[int, Route | None] = {}
        self.sent = 0  # buckets sent by :meth:`send` (tests read it)

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
