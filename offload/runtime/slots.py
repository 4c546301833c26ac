"""The slot table: which parameter buckets are on the device, where, and since which copy.

It owns, per bucket, the residency state machine (offload/runtime/residency.py), the slot a bucket on the
device lives in, the events of its latest host-to-device copy and AdamW update, the LRU order of buckets
fetched on demand, and the index from a device address to the bucket living there (for the saved-tensor
pack hook). It also owns the device memory allocated on demand (bucket slots, and grad slots until their
copy has read them), the compute ``boundary`` every new copy into a slot waits for, and the events after
which a plan buffer may be reused (``done``).

[Note: parameters show landed slots] A parameter points into its bucket's slot only once compute has
waited for the copy that fills it (``land``); while a copy is in flight (a prefetch, the first plan's
resident buckets, a resident bucket refreshed with its new weights after ``step()``) it points at its
placeholder. Every use in forward lands the bucket first (the use detector and the plan's waits), so
nothing changes there; what it prevents is a read outside forward (``p.norm()`` for logging, an EMA of
weights, right after ``step()``) racing the copy: it read the slot's previous bytes (another bucket's, or
the weights before the step) as plausible numbers; now it is idle and reads a copy of its current weights
([Note: parameters between forwards] in idle_params.py; issue 19).

[Note: cross-stream lifetimes] The arena is ours, so the caching allocator's ``record_stream`` does not
protect a slot: every reuse of a slot waits on the event of its last reader (``done``, ``boundary``),
a slot is never freed while a copy still writes it (``release``) or reads it (``Freeing``), and a host
buffer read by a copy is not written by the CPU until that copy's event completed (``adam_event``).
"""

from __future__ import annotations

import bisect
import operator
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

import torch

from ..backend.base import DONE, Event
from ..errors import InvariantError, OffloadError
from .grad_records import STALE_GRAPH
from .idle_params import PLAIN_OF, bind_placeholder
from .residency import Freeing, ParamRef, Residency, Slot, check_move

if TYPE_CHECKING:
    from torch import nn

    from ..host.state import HostState
    from ..planning.buckets import Bucket
    from .device_collectives import RefreshCopy
    from .context import RuntimeContext


class SlotTable:
    """Residency, slots and events of every bucket; fetch, wait, release and evict."""

    def __init__(self, ctx: RuntimeContext) -> None:
        self.ctx = ctx
        self.host: HostState | None = None  # set when the traced warm-up has made the buckets
        self.buckets: tuple[Bucket, ...] = ()
        self.bucket_of: Sequence[int] = ()  # param -> its bucket
        self.state: list[Residency] = []  # per bucket
        self.slot: dict[int, Slot] = {}  # bucket -> where it is on the device (not HOST)
        self.index: dict[int, tuple[list[int], list[int]]] = {}  # storage ptr -> (offsets, buckets)
        self.h2d_event: dict[int, Event] = {}  # bucket -> its latest host-to-device copy
        self.adam_event: dict[int, Event] = {}  # bucket -> its latest AdamW (host master is written)
        self.updated: set[int] = set()  # buckets whose update was issued since this step's forward began
        self.stepped = False  # step() began since this step's forward did: a backward now runs through an older graph
        self.versions: list[int] = []  # per bucket: how often step() changed its weights ([Note: stale graphs])
        self.lru: OrderedDict[int, None] = OrderedDict()  # buckets fetched on demand, oldest first
        self.h2d_by_bucket: list[int] = []  # host-to-device bytes per bucket since wrap
        self.freeing: list[Freeing] = []  # on-demand grad slots until their D2H copy has read them
        self.done: dict[int, Event] = {}  # plan buffer -> event after which its memory may be reused (this step)
        self.boundary: Event = DONE  # compute event at the end of the previous forward/backward
        self.reserve = 0  # bytes a recompute in progress is still expected to save (offload/runtime/recompute_hooks.py)
        itemsize = ctx.itemsize
        # the largest gradient autograd may materialise: room kept free off plan (cache_limit)
        self.grad_headroom = max((s.numel * itemsize for s in ctx.specs if s.group is not None), default=0)
        self._pinned: list[Callable[[], Iterable[int]]] = []  # who says which buckets may not be evicted now
        # bucket -> (the slot it holds, its parameters' views into it, those parameters, the views' addresses):
        # built once per slot (issue 17, hot path)
        self._param_views: dict[int, tuple[Slot, list[torch.Tensor], list[nn.Parameter], list[int]]] = {}
        self._dst: dict[int, tuple[Slot, torch.Tensor]] = {}  # bucket -> (its slot, the slot's bytes as its dtype)
        self._kept: set[int] = set()  # refreshed buckets whose parameters stayed bound while in flight (copy_in)
        # issue 18: told (bytes, bucket) when an on-demand allocation cannot fit the budget; may raise (warmup.py)
        self.over_budget: Callable[[int, int | None], None] | None = None

    def adopt(self, host: HostState) -> None:
        """The traced warm-up built the buckets and their host arena: every bucket starts on the host."""
        self.host, self.buckets, self.bucket_of = host, host.buckets, host.bucket_of
        self.state = [Residency.HOST] * len(host.buckets)
        self.h2d_by_bucket = [0] * len(host.buckets)
        self.versions = [0] * len(host.buckets)

    def hosted(self) -> HostState:
        """The host side (buckets exist only once the traced warm-up has made them)."""
        if self.host is None:
            raise InvariantError("the host arena is used before the traced warm-up made it")
        return self.host

    def pin_with(self, pinned: Callable[[], Iterable[int]]) -> None:
        """``pinned()`` names buckets that views in use point into: eviction skips them."""
        self._pinned.append(pinned)

    def mark_boundary(self) -> None:
        """Copies issued from now on into a slot wait for the compute issued so far."""
        self.boundary = self.ctx.backend.record()

    def reset_step(self) -> None:
        self.done = {}
        self.updated = set()
        self.stepped = False

    def close(self) -> None:
        """The engine closed: nothing is on the device any more, and the host arena goes."""
        self.slot.clear()
        self._param_views.clear()
        self._dst.clear()
        self._kept.clear()
        self.host = None

    def items(self) -> Iterator[tuple[int, Slot]]:
        return iter(list(self.slot.items()))

    def check_shared_copies(self, early: bool = False) -> None:
        """Issue 20: every rank wrote its shard of the node's shared copy of the buckets updated since the last
        check, checked once this rank's CPU lane drained; nothing reads them before ([Note: the shared copy
        checked once per backward] in runtime/node_share.py). ``early``: a read inside a backward forced it."""
        dp = self.ctx.dp
        if dp is not None and dp.check_copies():
            self.ctx.stats["copy_checks"] += 1
            self.ctx.stats["copy_checks_early"] += int(early)

    # -- transitions --------------------------------------------------------------------------------------

    def set_state(self, b: int, new: Residency) -> None:
        check_move(b, self.state[b], new)
        self.state[b] = new

    def copy_in(self, b: int, slot: Slot, waits: Iterable[Event], keep_bound: bool = False,
                copy: RefreshCopy | None = None) -> None:
        """Issue the host-to-device copy of bucket ``b`` into ``slot``. ``keep_bound``: a refresh that compute
        waits for before anything else runs (the fast path's ``settle``): its parameters stay bound to the slot
        (no placeholder in between, which nothing could read), and ``land`` finds them bound. ``copy``: how
        (issue 20: [Note: resident weights gathered in their slots] in device_collectives.py), if not whole."""
        ctx = self.ctx
        n = self.buckets[b].numel
        hit = self._dst.get(b)
        if hit is not None and hit[0] is slot:  # refreshed in the slot it holds (after every step()): one view
            dst = hit[1]
        else:
            dst = slot.storage[slot.offset: slot.offset + n * ctx.itemsize].view(ctx.dtype)
            self._dst[b] = (slot, dst)
        dp = ctx.dp
        if dp is not None and b in dp.unchecked:  # issue 20: a read in the backward (since a fetch there raises,
            # fetch_on_demand, only a fault's refresh, out of step: a no-op; tests/MUTATIONS.md, N6)
            self.check_shared_copies(early=True)  # that updated it: [Note: the shared copy checked once per backward]
        waits = [w for w in (*waits, self.adam_event.get(b)) if w is not None]
        fresh = b not in self.slot
        self.set_state(b, Residency.IN_FLIGHT)
        self.slot[b] = slot
        src = self.hosted().source(b)
        gathered = copy(b, dst, src, waits) if copy is not None else None
        if gathered is None:
            gathered = ctx.backend.h2d(dst, src, waits), n * ctx.itemsize
        else:
            ctx.stats["refresh_gathers"] += 1
        self.h2d_event[b], nbytes = gathered
        ctx.stats["h2d_bytes"] += nbytes
        self.h2d_by_bucket[b] += nbytes
        ctx.lane_log.add("h2d", b, nbytes, self.h2d_event[b])
        if fresh:
            self._index(b, slot)
        elif keep_bound:
            self._kept.add(b)
        else:  # refreshed in place (new weights after step()): see [Note: parameters show landed slots]
            self.unbind(b)

    def land(self, b: int) -> None:
        """Compute waits until bucket ``b``'s copy (issued) has landed; its parameters show the slot from now."""
        self.ctx.backend.wait(self.h2d_event[b])
        self.set_state(b, Residency.DEVICE)
        if b not in self._kept or not self._still_bound(b):
            self.bind(b, self.slot[b])
        self._kept.discard(b)
        self.touch(b)

    def _still_bound(self, b: int) -> bool:
        """Bucket ``b``'s parameters point at their views of its slot (a refresh that kept them bound)."""
        hit = self._param_views.get(b)
        if hit is None or hit[0] is not self.slot[b]:
            return False
        return all(map(operator.eq, map(torch.Tensor.data_ptr, hit[2]), hit[3]))  # at C speed: once per refresh

    def touch(self, b: int) -> None:
        if b in self.lru:
            self.lru.move_to_end(b)

    def fetch_on_demand(self, b: int) -> None:
        ctx = self.ctx
        if b in self.updated and ctx.phases.in_backward:  # [Note: a departed step's updates wait] (device_optim.py)
            if self.stepped:  # updated by step(), after the forward whose graph this backward runs through
                raise OffloadError(STALE_GRAPH)  # (a recompute's read: check_saved sees the others first)
            raise_read_after_update(b)
        nbytes = self.buckets[b].nbytes(ctx.itemsize)
        self.make_room(nbytes, b)
        storage = ctx.backend.empty(nbytes)
        ctx.memory.add("slots", nbytes)
        self.copy_in(b, Slot(storage, 0, None), [self.boundary])
        self.lru[b] = None
        ctx.stats["on_demand_fetches"] += 1

    def release(self, b: int) -> None:
        """Bucket ``b``'s parameters are no longer needed on the device."""
        ctx = self.ctx
        slot = self.slot.pop(b)
        self._param_views.pop(b, None)
        self._dst.pop(b, None)
        self._kept.discard(b)
        if self.state[b] is Residency.IN_FLIGHT:
            ctx.backend.wait(self.h2d_event[b])  # never free memory a copy is still writing
            self.set_state(b, Residency.DEVICE)
        self.set_state(b, Residency.HOST)
        self.unbind(b)
        self._unindex(b, slot)
        self.lru.pop(b, None)
        if slot.planned is not None:
            self.done[slot.planned] = ctx.backend.record()
        else:
            ctx.memory.add("slots", -self.buckets[b].nbytes(ctx.itemsize))

    # -- parameters -----------------------------------------------------------------------------------------

    def bind(self, b: int, slot: Slot) -> None:
        """Point bucket ``b``'s parameters at their bytes of ``slot``. The views are built once per slot the
        bucket holds (refreshed weights land in the same slot after every ``step()``) and dropped at release."""
        ctx = self.ctx
        bucket = self.buckets[b]
        hit = self._param_views.get(b)
        if hit is None or hit[0] is not slot:
            typed = slot.storage.view(ctx.dtype)
            base = slot.offset // ctx.itemsize
            specs, shapes = ctx.specs, self.hosted().shapes  # not the parameters' own: they may be idle
            views = [typed[base + off: base + off + specs[p].numel].view(shapes[p])
                     for p, off in zip(bucket.params, bucket.offsets)]
            owners = [ctx.params[p] for p in bucket.params]
            hit = self._param_views[b] = (slot, views, owners, [v.data_ptr() for v in views])
        bind, params = ctx.backend.bind, ctx.params
        for p, view in zip(bucket.params, hit[1]):
            param = params[p]
            plain = PLAIN_OF.get(type(param))  # idle_params.show, inline: this runs for every bucket fetched
            if plain is not None:
                param.__class__ = plain
            bind(param, view)

    def unbind(self, b: int) -> None:
        ctx = self.ctx
        for p in self.buckets[b].params:
            bind_placeholder(ctx, p)

    def shown(self, b: int) -> Slot | None:
        """The slot bucket ``b``'s parameters point into now: None (their placeholders) unless it landed."""
        return self.slot.get(b) if self.state[b] is Residency.DEVICE else None

    def address(self, p: int) -> int:
        """Where parameter ``p``'s data points right now: its slot, or its placeholder."""
        ctx = self.ctx
        slot = self.shown(self.bucket_of[p])
        if slot is None:
            return ctx.placeholders[p].data_ptr()
        return slot.storage.data_ptr() + slot.offset + self.hosted().offset[p] * ctx.itemsize

    def rebind(self, p: int) -> None:
        """Point parameter ``p`` back at what the slot table gave it (its bucket's slot or placeholder)."""
        b = self.bucket_of[p]
        slot = self.shown(b)
        if slot is None:
            bind_placeholder(self.ctx, p)
        else:
            self.bind(b, slot)

    def view(self, saved: ParamRef) -> torch.Tensor:
        """The weight view ``saved`` names, in its bucket's slot (the bucket must be on the device)."""
        p = saved.param
        slot = self.slot[self.bucket_of[p]]
        start = slot.offset + self.hosted().offset[p] * self.ctx.itemsize + saved.byte_offset
        typed = slot.storage.view(saved.dtype)
        itemsize = typed.element_size()
        return typed.as_strided(saved.size, saved.stride, start // itemsize)

    # -- device memory ---------------------------------------------------------------------------------------

    def free_after(self, event: Event, nbytes: int, slot: torch.Tensor) -> None:
        """(tensor, event): the on-demand grad slot is kept until the copy reading it has finished."""
        self.freeing.append(Freeing(event, nbytes, slot))

    def reclaim(self, block: bool = False) -> None:
        """Free grad slots whose device-to-host copy has finished (all of them when ``block``)."""
        keep = []
        for ev, nbytes, slot in self.freeing:
            if block or ev.query():
                ev.synchronize()
                self.ctx.memory.add("slots", -nbytes)
            else:
                keep.append(Freeing(ev, nbytes, slot))
        self.freeing = keep

    def make_room(self, nbytes: int, bucket: int | None = None) -> None:
        """Evict on-demand buckets, least recently used first, until ``nbytes`` more (for ``bucket``'s weights
        or grads, if given) fit the budget."""
        if not self.evict_to_fit(nbytes):
            if self.over_budget is not None:  # the room kept for autograd's next allocation is taken
                self.over_budget(nbytes, bucket)  # issue 18: the first step may be refused here, before going over
            self.ctx.stats["over_budget_fetches"] += 1

    def evict_to_fit(self, nbytes: int) -> bool:
        """Free finished grad slots, then evict unused on-demand buckets, least recently used first, until
        ``nbytes`` more fit the budget; False if they still do not."""
        memory = self.ctx.memory
        limit = self.cache_limit()
        self.reclaim(block=memory.current + nbytes > limit)
        protected: set[int] = set()
        for pinned in self._pinned:
            protected.update(pinned())
        for b in list(self.lru):
            if memory.current + nbytes <= limit:
                return True
            if b not in protected and self.state[b] is not Residency.HOST:
                self.release(b)
        return memory.current + nbytes <= limit

    def cache_limit(self) -> int:
        """Device bytes that buckets fetched on demand may fill, with what else is live.

        Off plan, nothing is laid out ahead: a saved activation or a parameter's gradient is allocated by
        autograd before the engine hears of it, so evicting then does not lower the peak already reached.
        The room for the next one is kept free instead: the largest gradient autograd may materialise
        (backward) or the largest storage saved for backward so far, checkpointed blocks' included (forward;
        in backward only a recompute saves, and ``reserve`` holds what it is still to save). The two never land
        in the same phase, so the larger of them is enough. An activation larger than any seen before (a
        longer sequence) can still overshoot, by at most its own size: eviction follows it
        (``activations_grew``)."""
        headroom = max(self.grad_headroom, self.ctx.memory.largest_saved)
        return self.ctx.budget - headroom - self.reserve

    def activations_grew(self) -> None:
        """Off plan, buckets fetched on demand stay cached until room is needed; room is needed when saved
        activations grow as much as when another bucket is fetched, so evict the same way (no-op on plan,
        where activations are planned, and while tracing, where nothing is cached)."""
        if self.lru and self.ctx.memory.current > self.cache_limit():
            self.evict_to_fit(0)

    # -- slot index: which bucket lives at a byte offset of a device storage (for the pack hook) ------------

    def locate(self, entry: tuple[list[int], list[int]], byte: int, t: torch.Tensor) -> ParamRef | None:
        """The parameter view ``t`` is, if it lives at ``byte`` of a slot's storage (``entry``: that
        storage's ``index``)."""
        starts, owners = entry
        i = bisect.bisect_right(starts, byte) - 1
        if i < 0:
            return None
        b = owners[i]
        rel = byte - starts[i]
        bucket = self.buckets[b]
        itemsize = self.ctx.itemsize
        if rel >= bucket.nbytes(itemsize):
            return None
        j = bisect.bisect_right(bucket.offsets, rel // itemsize) - 1
        p = bucket.params[j]
        return ParamRef(p, rel - bucket.offsets[j] * itemsize, tuple(t.shape), t.stride(), t.dtype, self.versions[b])

    # [Note: stale graphs]
    # torch refuses a backward whose graph saved a weight that changed since (each tensor has a version counter,
    # which optimizer.step() bumps): loss.backward(retain_graph=True), step(), loss.backward() raises "one of the
    # variables needed for gradient computation has been modified by an inplace operation". Our saved weights
    # are ParamRefs to slots that the engine refills, so no counter sees the update: a backward through a graph
    # from before step() read the new weights and its grads went into the next step, silently (found with an
    # eval forward between step() and the second backward; without it the engine raised, by chance, from
    # whichever of two unrelated checks came first). So each bucket counts the changes to its weights (step(),
    # updates kept from a backward that failed, a state dict loaded), a ParamRef carries its bucket's count when
    # saved, and Runtime.unpack_saved refuses one whose count is behind, as torch does.

    def note_updates(self, updated: Iterable[int]) -> None:
        """The weights of buckets ``updated`` changed: weight views saved before now are stale."""
        versions = self.versions
        for b in updated:
            versions[b] += 1

    def check_saved(self, ref: ParamRef) -> None:
        """Refuse a saved weight view whose bucket was updated since it was saved ([Note: stale graphs])."""
        versions = self.versions
        if versions and ref.version != versions[self.bucket_of[ref.param]]:
            raise OffloadError(STALE_GRAPH)

    def _index(self, b: int, slot: Slot) -> None:
        key = slot.storage.untyped_storage().data_ptr()
        starts, owners = self.index.setdefault(key, ([], []))
        i = bisect.bisect_left(starts, slot.offset)
        starts.insert(i, slot.offset)
        owners.insert(i, b)

    def _unindex(self, b: int, slot: Slot) -> None:
        key = slot.storage.untyped_storage().data_ptr()
        starts, owners = self.index[key]
        i = bisect.bisect_left(starts, slot.offset)
        if owners[i] != b:
            raise InvariantError(f"slot index: bucket {b} is not at offset {slot.offset} of its storage")
        del starts[i], owners[i]
        if not starts:
            del self.index[key]


def raise_read_after_update(b: int) -> None:
    """Bucket ``b`` is fetched again inside the backward that already updated it ([Note: a departed step's updates
    wait] in device_optim.py): its copy would read the updated weights, where torch's backward reads them from
    before the step. Refused, loudly."""
    raise OffloadError(
        f"bucket {b}'s weights are read inside the backward that already applied its AdamW update (overlapped "
        "updates run as each bucket's grads complete): this step left its plan only in backward, after that "
        "update, so the read was not foreseen (a weight read without a grad, e.g. F.linear(h, w.detach()), in a "
        "module call that reads w anyway, taken in this step only). It would read the updated weights where "
        "torch's backward reads them from before the step. Wrap with overlap_optimizer=False (updates in step()), "
        "or take that read in every step (the plan then holds the update back for it)")
