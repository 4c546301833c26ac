"""Data parallel over torch.distributed (issue 20): one engine per rank, optimizer state partitioned.

When ``torch.distributed`` is initialised, ``offload.wrap`` trains data parallel over the default group
(``process_group=`` picks another, ``False`` opts out). Each rank traces and plans its own device side, and
keeps the host side of [Note: host shards] (``offload/host/shard.py``): its ``1/world`` of every bucket's
fp32 master, Adam m and v. Per bucket, on the CPU lane, in the order the grads complete (the same on every
rank, since every rank runs the same model):

    grads on the host ─► reduce-scatter (the rank's shard of the sum over ranks)
                     ─► AdamW of the shard (grads scaled by 1/world: the average, as DDP's)
                     ─► all-gather of the updated device-dtype shards into the whole copy (none where
                         the host's ranks share one copy: [Note: one host copy per node]; over several
                         hosts, of the rank's column only: [Note: one host copy per host])
                     ─► (the next forward's host-to-device copy waits for it, as for any update)

With ``overlap_optimizer`` this runs while backward goes on; with ``grad_reduce="device"`` the reduce-scatter
runs on the device instead, before the copy, and only the rank's shard comes to the host ([Note: grads reduced
on the device] in runtime/device_collectives.py), and the all-gather of the updated shards runs on the device
too, its result copied back into the host copy ([Note: weights gathered on the device]). With deferred
updates (accumulation, clipping, float16) the end of every backward outside ``engine.no_sync()`` all-reduces
each gathered bucket's grads, so that ``p.grad`` is the average over the ranks and every rank computes the same
norms, clip coefficient and float16 overflow check from it ([Note: averaged p.grad]); the update then takes its
shard of that average locally. A
step whose last backward ran inside ``no_sync`` reduce-scatters the local sums at the first of
``clip_grad_norm_`` and ``step()``, and one all-reduce of per-parameter sums of squares gives the norms over
all ranks ([Note: no_sync], :meth:`DataParallel.reduce_pending`).

[Note: collectives on one thread]
gloo and NCCL match collectives by the order each rank issues them. Every collective of a step is issued by
the one CPU-lane thread, in submission order; those of the main thread (the norms' all-reduce, the gathers
that read values other ranks own, the shared copy's checks) are issued only after the lane drained. With
grads reduced on the device the main thread issues collectives during backward too (the checks and the
slots' reduce-scatters): on a group of their own, ``self.tag_group``, where every check then pairs ([Note:
grads reduced on the device] in device_collectives.py); the lane's all-gathers then run on the device, on a
third group of their own. A collective that fails (a peer raised, hung past the group's timeout, or died)
raises :class:`DistributedError` naming this rank, and the engine refuses to go on: its ranks are no longer
in step, and a later collective could pair with the wrong one on another rank. So does a rank whose backward
raised after a collective was issued.

[Note: averaged p.grad]
DDP users expect ``p.grad`` after backward to be the average over the ranks (``clip_grad_norm_`` on
``model.parameters()``, ``clip_grad_value_``, ``p.grad.norm()``, in-place scaling). With deferred updates the
end of every backward (a point every rank reaches) therefore all-reduces each gathered bucket's landing grad
(after a check that every rank gathered the same buckets) and divides it by ``world`` (exact for a power of
two): every rank then holds the same average, which is what plain_grads.py exposes, and the norms are
recomputed from it, so the engine's clip and float16 overflow check agree on every rank without a further
collective. An accumulating backward adds its local grads to that average, and the next average gives
``avg(a) + avg(b)``: still the average of the sums. When the bucket is updated, the rank's shard of the sum
is taken from its own copy (times ``world``, as the reduce-scatter would give it), after any change the user
made to ``p.grad``. The price: an all-reduce (about twice a reduce-scatter's bytes) per backward instead of
one reduce-scatter per step. With ``overlap_optimizer=True`` the grads are consumed during backward and
``p.grad`` raises on use (plain_grads.py), as in one process.

[Note: no_sync]
``engine.no_sync()`` (and ``model.no_sync()``, which the engine adds to a model that has none) is DDP's:
a backward that ends inside it issues no collective at all. Its grads are added to this rank's own sums on
the host, and ``p.grad`` shows that local sum (plus the average an earlier, synced backward of this step
left there); the next backward outside it all-reduces the whole sum once, so ``p.grad`` is then the average
over the ranks of every micro-batch's grads, as with DDP, and two ranks in fp32 are bit for bit one process
adding each rank's micro-batches first. A ``step()`` whose last backward ran inside ``no_sync`` is still right:
it reduce-scatters the local sums (one collective per bucket, the cheapest way). Norms of ``p.grad`` inside
``no_sync`` (``torch.nn.utils.clip_grad_norm_``, ``p.grad.norm()``) raise: they would be this rank's alone,
and each rank would clip by another factor (plain_grads.py). ``engine.clip_grad_norm_`` is collective and
right anywhere. ``overlap_optimizer=True`` updates (and reduce-scatters) during backward: ``no_sync`` raises.

[Note: re-plans agreed]
Each rank plans its own device side, and a step that departs from its plan (other module calls, larger
activations) re-plans at ``step()``. A departure on one rank (a data-dependent branch, a longer batch) must
make every rank re-plan, or none, so that the ranks' plans change at the same step: ``step()``, which every
rank reaches with its lane drained, all-gathers one tag per rank ((kind, stale, 0, collectives so far), the
checks' format, so a fault or a lone read pairs with it and is named) and every rank re-plans if any is stale.

[Note: a fault named]
A rank whose backward raises waits for the collectives it issued before the fault, then joins the next one
the others will issue (always the all-gather of a check, which precedes every sum) with a fault tag: they
raise a :class:`DistributedError` naming it, at once rather than after the group's timeout. A rank that hangs
or dies cannot tell, and gloo's error says neither who (a timeout names no peer; a death names an address)
nor lets the group be used again (a timeout closes its pairs). So the group's store does (``RollCall``, in
node_share.py): a rank whose collective failed writes that it saw the failure (one small key), then waits up to
``ROLL_CALL_S`` for the others to write theirs (a death fails every peer's collective at once; a hang fails
the others' after the same timeout). The ranks that never answer are named: they died or hang. Nothing is
written while training goes well (a FileStore would grow with every write). Where the store cannot be read
(its server was on the rank that died), the error says so and names no one. While a roll call runs (``naming``
clear), ``check_usable`` on the main thread waits for its error instead of raising a bare ``failed``.

[Note: a read on one rank] (collective_reads.py): ``model.state_dict()`` and the like on one rank alone.
"""

from __future__ import annotations

import contextlib
import threading
import zlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from ..errors import DistributedError, InvariantError, OffloadError
from ..host.node_copy import NodeCopy
from ..host.shard import ShardedHostState
from ..host.state import HostState
from ..backend.base import Deferred
from .device_collectives import DeviceGroup, RefreshCopy, WeightGather, _all_gather, _reduce_scatter, pad_buckets
from .collective_reads import CollectiveReads
from .node_share import FAULT, TAG_SIZE, RollCall, ShardGather, fault_in, make_node_copy


# The kinds of the checks' tags (node_share.TAG_SIZE: [Note: a fault named])
_ONE_BUCKET, _BUCKET_SET, _REPLAN, _COPY_READY, _COPY_WRITTEN, _REFRESH = 0, 1, 2, 3, 4, 5

if TYPE_CHECKING:
    from ..backend.base import Backend, Event, Lane
    from ..planning.buckets import Bucket, ParamSpec
    from .accounting import DeviceMemory
    from .grads import GradPipeline


class DataParallel:
    """The collectives of one rank's engine, on its CPU lane (see the module docstring)."""

    def __init__(self, group: Any, lane: Lane, device: torch.device | None = None, share: bool | None = None) -> None:
        self.group = group
        # [Note: grads reduced on the device]: the main thread's group (its collectives and every check), or None
        self.device = DeviceGroup(group, device) if device is not None else None
        self.tag_group = self.device.group if self.device is not None else group  # where the checks pair
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.lane = lane
        self._reduced: dict[int, tuple[Event, Event]] = {}  # bucket -> (the grads' ready event, its reduce)
        self.failed: str | None = None  # why this rank can no longer train in step with the others
        self.error: DistributedError | None = None  # the first collective failure (raised cleanly by step())
        self.naming = threading.Event()  # clear while a failed collective's roll call runs ([Note: a fault named])
        self.naming.set()
        self.closed_with_local = False  # close() gave the module the 16-bit copy (the masters could not be gathered)
        self.reduces = 0  # reduce-scatters issued since wrap (the same on every rank in step)
        # bucket -> its grads' ready event when :meth:`average_gathered` averaged its landing grad over the
        # ranks (then its shard of the sum is taken locally, no reduce-scatter: [Note: averaged p.grad])
        self._averaged: dict[int, Event] = {}
        self.roll_call = RollCall.of(group, self.rank, self.world)  # [Note: a fault named]: hangs and deaths
        self.syncing = True  # False inside engine.no_sync(): a backward's end issues no collective ([Note: no_sync])
        # [Note: weights gathered on the device]: the gather buffers (made at the end of the first forward), and
        # each bucket's latest gather (the host copy is whole after it)
        self.weights: WeightGather | None = None
        self._gathered: dict[int, Deferred] = {}
        # [Note: one host copy per node]: OffloadConfig.share_host_copy; the shared copy; the buckets written since
        # the last check that it is whole (an ordered set: [Note: the shared copy checked once per backward])
        self.share = share
        self.node_copy: NodeCopy | None = None
        self.shards: ShardGather | None = None  # the host path's gather of the updated shards, if any
        self.unchecked: dict[int, None] = {}
        self.reads = CollectiveReads(self)  # [Note: a read on one rank]: gathers of what other ranks own

    @classmethod
    def resolve(cls, process_group: Any, lane: Lane, device: torch.device | None = None,
                share: bool | None = None) -> DataParallel | None:
        """``process_group``: None (the default group if torch.distributed is initialised), False (never),
        or a group. None when there is nothing to be parallel over (no group, or a group of one rank).
        ``device``: reduce-scatter grads on that device ([Note: grads reduced on the device]); None: on the host.
        ``share``: ``OffloadConfig.share_host_copy`` ([Note: one host copy per node])."""
        if process_group is False:
            return None
        if not (dist.is_available() and dist.is_initialized()):
            if process_group is None:
                return None
            raise OffloadError("process_group= was given but torch.distributed is not initialised: call "
                               "torch.distributed.init_process_group first, or leave process_group unset")
        group = dist.group.WORLD if process_group is None else process_group
        if dist.get_world_size(group) == 1:
            return None
        if str(dist.get_backend(group)) == "nccl":
            raise OffloadError(
                "data parallel runs its collectives on the host (grads and weights in the host arena), which NCCL "
                "cannot move; this group is NCCL only. Initialise with backend=\"cpu:gloo,cuda:nccl\", or pass "
                "process_group=torch.distributed.new_group(backend=\"gloo\") (or process_group=False to opt out)")
        return cls(group, lane, device, share)

    def host_state(self, buckets: Sequence[Bucket], specs: Sequence[ParamSpec], shapes: Sequence[torch.Size],
                   dtype: torch.dtype, fused: bool, accumulate: bool) -> ShardedHostState:
        return ShardedHostState(buckets, specs, shapes, dtype, self.rank, self.world, self.reads.gather,
                                fused=fused, accumulate=accumulate, landing=self.device is None,
                                node_copy=self.node_copy)

    def prepare_copy(self, backend: Backend, memory: DeviceMemory, stats: dict[str, int],
                     buckets: Sequence[Bucket], itemsize: int, dtype: torch.dtype) -> None:
        """The end of the first forward, before the host state is made: how the updated weights reach every
        rank's host copy. One copy shared by the node ([Note: one host copy per node]: nothing to gather on one
        host, the rank's column over several: [Note: one host copy per host]), else each rank's own, all-gathered
        on the device where grads are reduced there ([Note: weights gathered on the device]: the gather buffers,
        counted in ``memory``) or by gloo on the CPU lane."""
        if self.node_copy is None and self.weights is None and self.shards is None and self.share is not False:
            self.node_copy = make_node_copy(buckets, itemsize, self.call, self.tag_group, self.rank, self.world,
                                            self.share)
        # [Note: one host copy per host]: over several hosts the column's shards are gathered (on the device
        # where grads are reduced there) into the host's copy
        hosts = self.node_copy.hosts if self.node_copy is not None else None
        column = hosts.column if hosts is not None and hosts.count > 1 else None
        if self.device is None and self.shards is None and (hosts is None or column is not None):
            self.shards = (ShardGather.every(self.group, self.world, self.call) if hosts is None
                           else ShardGather.column(self.group, hosts, self.call))
        if (hosts is None or column is not None) and self.device is not None and self.weights is None:
            self.weights = WeightGather(backend, memory, stats, buckets, itemsize, dtype, self.rank, self.world,
                                        self.device.weights, self.call, column)

    def copy_written(self) -> None:
        """The main thread wrote this rank's part of the node's copy (the first masters, ``load_state_dict``, a
        write to ``p.data``): every rank's must be in before any reads it. A check every rank joins."""
        if self.node_copy is not None:
            self.check_usable()
            self._written_whole(_COPY_WRITTEN, ())

    def check_copies(self) -> int:
        """[Note: the shared copy checked once per backward] (node_share.py): the buckets written since the last
        check, checked whole once this rank's lane drained; how many (0 also once out of step). Collective."""
        buckets, self.unchecked = tuple(self.unchecked), {}
        if not buckets or self.failed is not None or self.error is not None:
            return 0
        self._written_whole(_COPY_READY, buckets)
        return len(buckets)

    def _written_whole(self, kind: int, buckets: tuple[int, ...]) -> None:
        try:
            self.lane.drain()  # this rank's writes are done
        except OffloadError as e:
            self.raise_failure(e)
            raise
        self.settle()  # and its copies back from the device ([Note: one host copy per host])
        tag = torch.tensor([kind, len(buckets), zlib.crc32(",".join(map(str, buckets)).encode()), self.reduces],
                           dtype=torch.int64)
        self._require_same(tag, "check that every rank wrote its part of the node's copy of the weights", "ranks wrote "
                           "the weights apart", "the ranks reached the check that the node's copy of the weights is "
                           "whole at different points ((kind, buckets, their checksum, checks so far)", "update the "
                           "same parameters in the same order and write parameters on every rank alike")

    def settle(self) -> None:
        """The CPU lane drained: block until the host copy is whole (the weights' copies back are done)."""
        if self.weights is not None:
            self.weights.settle()

    def release(self) -> None:
        """``close()``: the gather buffers go, this rank's mapping of the node's copy, and every reference to a
        process group or its store, so that ``destroy_process_group()`` frees the group (gloo's threads) at once,
        as after DDP, while the user still holds the engine (else the group lives until the interpreter exits,
        where a gloo thread freeing a tensor can abort the process)."""
        if self.weights is not None:
            self.weights.close()
        self.node_copy = None
        self.group = self.tag_group = self.device = self.shards = self.roll_call = None

    def pad_buckets(self, buckets: Sequence[Bucket]) -> tuple[Bucket, ...]:
        """The buckets to plan: with grads reduced on the device, each grad slot padded to its shards."""
        return tuple(buckets) if self.device is None else pad_buckets(buckets, self.world)

    # -- per bucket, on the main thread: [Note: grads reduced on the device] ------------------------------

    def reduce_on_device(self, backend: Backend, host: HostState, b: int, slot: torch.Tensor, ready: Event,
                         waits: Sequence[Event]) -> tuple[Event, int]:
        """Check, then reduce-scatter bucket ``b``'s grad ``slot`` in place on the device after ``ready``, then
        copy this rank's shard to the host's ``grad_shard`` after it and ``waits``. Returns (the copy's event,
        its bytes): once it is done the slot is free and the shard's update may run."""
        self.check_usable()
        host = _sharded(host, self.rank)
        size, device = host.shards[b].size, self.device
        dst = host.grad_shard[b]
        if device is None or slot.numel() != size * self.world or dst.dtype != slot.dtype:
            raise InvariantError(f"bucket {b}: a grad slot of {slot.numel()} {slot.dtype} elements cannot be "
                                 f"reduce-scattered into {self.world} shards of {size} {dst.dtype} elements: a bug "
                                 "in offload, please report it")
        mine = slot[self.rank * size: (self.rank + 1) * size]  # NCCL's in-place form: no buffer outside the arena
        self._check_same_bucket(b)  # on the device group's host side, before the sum is issued
        reduced = backend.collective(lambda: self.call(f"reduce-scatter of bucket {b}'s grads on the device",
                                                        _reduce_scatter, mine, slot, group=device.group), [ready])
        return backend.d2h(dst, mine, [reduced, *waits]), size * slot.element_size()

    # -- per bucket, on the CPU lane ---------------------------------------------------------------------

    def submit_update(self, host: HostState, b: int, ready: Event, update: Callable[[], None],
                      waits: Sequence[Event]) -> Event:
        """Reduce-scatter bucket ``b``'s grads (unless :meth:`reduce_pending` did), run ``update`` on the
        shard, all-gather the new copy; return the event after which the copy is whole."""
        self.check_usable()
        host = _sharded(host, self.rank)
        reduced = self._reduced.pop(b, None)
        if self.device is not None:  # reduce-scattered on the device, its shard copied: ``ready`` is that copy
            reduce = ready
        elif reduced is not None and reduced[0] is ready:
            reduce = reduced[1]
        else:
            reduce = self._submit_reduce(host, b, ready)
        self._averaged.pop(b, None)
        # [Note: weights gathered on the device]: the update rewrites the host copy the last gather wrote back
        last = self._gathered.get(b)
        updated = self.lane.submit(update, [reduce, *waits, *([last] if last is not None else [])],
                                   f"AdamW of bucket {b}'s shard")
        weights, shards = self.weights, self.shards
        # [Note: one host copy per node]: the shard written in place (over several hosts the column's gathered
        # too: [Note: one host copy per host]), the bucket checked whole later
        if host.node_copy is not None:
            self.unchecked[b] = None  # checked once per backward ([Note: the shared copy checked once per backward])
        if shards is not None:  # after the other hosts' shards came in
            return self.lane.submit(lambda: shards.gather(host, b), [updated], f"all-gather of bucket {b}")
        if weights is None:
            return updated
        out: list[Event] = []
        issued = self.lane.submit(lambda: out.append(weights.gather(host, b)), [updated],
                                  f"all-gather of bucket {b} on the device")
        gathered = self._gathered[b] = Deferred(issued, out)
        return gathered

    def _submit_reduce(self, host: ShardedHostState, b: int, ready: Event) -> Event:
        if self._averaged.get(b) is ready:  # [Note: averaged p.grad]: the average is already on every rank
            return self.lane.submit(lambda: self._take_shard(host, b), [ready], f"shard of bucket {b}'s averaged grads")
        return self.lane.submit(lambda: self._reduce(host, b), [ready], f"reduce-scatter of bucket {b}'s grads")

    def _take_shard(self, host: ShardedHostState, b: int) -> None:
        """The reduce-scatter's result from the averaged landing grad, without a collective: the shard of the
        sum over ranks (``update`` scales by ``1 / world``; times ``world`` is exact for a power of two)."""
        s = host.shards[b]
        host.grad_shard[b].copy_(host.landed(b, padded=True)[self.rank * s.size: (self.rank + 1) * s.size])
        host.grad_shard[b].mul_(self.world)

    def _reduce(self, host: ShardedHostState, b: int) -> None:
        self._check_same_bucket(b)
        self.call(f"reduce-scatter of bucket {b}'s grads", _reduce_scatter, host.grad_shard[b],
                   host.landed(b, padded=True), group=self.group)

    def _check_same_bucket(self, b: int) -> None:
        """[Note: collectives on one thread]: collectives pair by order, so a rank whose grads completed
        another bucket (a data-dependent branch taken on one rank only) would sum another bucket's bytes,
        silently where the sizes agree. One small all-gather of (bucket, count so far) first makes it loud."""
        tag = torch.tensor([_ONE_BUCKET, b, 0, self.reduces], dtype=torch.int64)
        self._require_same(tag, f"check of bucket {b}'s reduce-scatter", "ranks reduced different buckets",
                           "the ranks are about to sum different buckets' grads ((bucket, reduce-scatters so far)",
                           "so that the same parameters get grads in the same order")

    def _check(self, tag: torch.Tensor, what: str) -> torch.Tensor:
        """All-gather every rank's ``tag`` (the checks before a sum: [Note: a fault named]); raise naming the
        ranks that sent a fault instead."""
        tags = tag.new_empty(TAG_SIZE * self.world)
        self.call(what, _all_gather, tags, tag, group=self.tag_group)
        self.reduces += 1
        others = tags.view(self.world, TAG_SIZE)
        named = fault_in(others, self.rank, self.world)
        if named is not None:
            self.failed = named[0]
            raise self.first_error(DistributedError(named[1]))
        return others

    # -- on the main thread, the lane drained ([Note: collectives on one thread]) -------------------------

    @contextlib.contextmanager
    def no_sync(self, deferred: bool) -> Iterator[None]:
        """[Note: no_sync]: backward passes that end inside issue no collective; grads add up locally."""
        if not deferred:
            raise OffloadError(
                "engine.no_sync() (model.no_sync()) accumulates gradients over backward passes without "
                "communication, but this engine applies each bucket's AdamW (and its reduce-scatter) while "
                "backward runs (overlap_optimizer=True). Wrap with overlap_optimizer=False to accumulate")
        self.check_usable()
        outer, self.syncing = self.syncing, False
        try:
            yield
        finally:
            self.syncing = outer

    def backward_ended(self, grads: GradPipeline) -> bool:
        """The end of a backward with deferred updates: average the gathered grads over the ranks, unless
        inside ``no_sync``. Returns True when ``p.grad`` shows this rank's own sum ([Note: no_sync])."""
        if not self.syncing:
            self.check_usable()
            return True
        self.average_gathered(grads)
        return False

    def agree_replan(self, stale: bool) -> bool:
        """[Note: re-plans agreed]: whether any rank's step departed from its plan (then every rank re-plans).
        Collective: every rank calls it in ``step()``, its lane drained."""
        self.check_usable()
        tag = torch.tensor([_REPLAN, int(stale), 0, self.reduces], dtype=torch.int64)
        return bool(self._agree(tag, "agreement on re-planning")[:, 1].any())

    def _agree(self, tag: torch.Tensor, what: str) -> torch.Tensor:
        """:meth:`_check` of a ``step()`` tag; raise unless every rank sent its kind at the same count."""
        others = self._check(tag, what)
        if not bool((others[:, 0] == tag[0]).all()) or not bool((others[:, 3] == tag[3]).all()):
            self.failed = f"ranks out of step at step() ({others.tolist()})"
            raise DistributedError(f"rank {self.rank} of {self.world}: at step() the ranks are at different "
                                   f"collectives (kind and collectives so far per rank: {others.tolist()}): every "
                                   "rank must run the same backward passes and steps")
        return others

    def agree_refresh(self, buckets: Sequence[int], backend: Backend) -> RefreshCopy | None:
        """[Note: resident weights gathered in their slots] (device_collectives.py): where every rank brings the
        same ``buckets``, in this order, to the device after ``step()``, how: each gathered in its slot over the
        node's ranks; None (copy them whole) where the ranks differ or grads are reduced on the host. Collective
        on the device path: every rank calls it in ``step()`` after :meth:`agree_replan`, unless they re-plan."""
        device = self.device
        if device is None:
            return None
        self.check_usable()
        tag = torch.tensor([_REFRESH, zlib.crc32(",".join(map(str, buckets)).encode()), len(buckets),
                            self.reduces], dtype=torch.int64)
        if not bool((self._agree(tag, "agreement on the buckets gathered after step()")[:, 1:3] == tag[1:3]).all()):
            return None
        return lambda b, dst, src, waits: device.refresh(backend, dst, src, waits, self.call,
                                                         f"all-gather of bucket {b}'s new weights in its slot")

    def average_gathered(self, grads: GradPipeline) -> None:
        """[Note: averaged p.grad]: the end of a backward with deferred updates, before the grads are exposed
        in ``p.grad``: every rank's landing grad of every gathered bucket becomes the average over the ranks
        (one all-reduce per bucket), and the norms are those of the average. Collective: every rank ends a
        backward here."""
        self.check_usable()
        self.lane.drain()  # the accumulation into the sums runs on the lane
        grads.sums.wait_gathered()
        host = _sharded(grads.slots.hosted(), self.rank)
        buckets = sorted(grads.pending)
        self._check_same_buckets(buckets)
        for b in buckets:
            landed = host.landed(b, padded=True)
            self.call(f"all-reduce of bucket {b}'s grads", dist.all_reduce, landed, group=self.group)
            landed.div_(self.world)  # exact for a power of two
            self._averaged[b] = grads.pending[b].ready
        grads.sums.refresh_norms(grads.sums.pending_params())

    def _check_same_buckets(self, buckets: list[int]) -> None:
        """As :meth:`_check_same_bucket`, for the set of buckets :meth:`average_gathered` is about to sum:
        one all-gather of (count, a checksum of the set, collectives so far)."""
        checksum = sum((b + 1) * (2 * b + 3) for b in buckets)
        tag = torch.tensor([_BUCKET_SET, len(buckets), checksum, self.reduces], dtype=torch.int64)
        self._require_same(tag, "check of the buckets to average", "ranks gathered grads of different buckets",
                           "the ranks' backward passes reached different parameters ((buckets, checksum, "
                           "collectives so far)", "so that the same parameters get grads")

    def _require_same(self, tag: torch.Tensor, what: str, failed: str, differ: str, why: str) -> None:
        """All-gather ``tag`` (:meth:`_check`); where the ranks' tags differ, this rank is out of step: raise."""
        others = self._check(tag, what)
        if not bool((others == tag).all()):
            self.failed = f"{failed} ({others.tolist()})"
            raise DistributedError(f"rank {self.rank} of {self.world}: {differ} per rank: {others.tolist()}): "
                                   f"every rank must run the same model calls, {why}")

    def reduce_pending(self, grads: GradPipeline, norms: bool, norm_type: float = 2.0) -> None:
        """Deferred updates: reduce-scatter every bucket gathered since the last step (once), and with
        ``norms`` replace ``grads.norms`` by the norms of the averaged grads over every rank (already there
        where :meth:`average_gathered` averaged every bucket)."""
        self.check_usable()
        if norm_type != 2.0:
            raise OffloadError(f"clip_grad_norm_ with norm_type={norm_type:g} is not supported data parallel (the "
                               "2-norm is, computed over every rank); use norm_type=2.0")
        host = _sharded(grads.slots.hosted(), self.rank)
        averaged = all(self._averaged.get(b) is grads.pending[b].ready for b in grads.pending)
        for b in sorted(grads.pending):
            ready = grads.pending[b].ready
            have = self._reduced.get(b)
            if self._averaged.get(b) is ready:
                continue  # its shard is taken when it is updated (after any change the user makes to p.grad)
            if have is None or have[0] is not ready:
                self._reduced[b] = (ready, self._submit_reduce(host, b, ready))
        self.lane.drain()
        if not norms or averaged:  # averaged: grads.norms are the average's, the same on every rank
            return
        for b in sorted(grads.pending):
            if self._averaged.get(b) is grads.pending[b].ready:  # mixed: its shard for the norms' all-reduce
                self._take_shard(host, b)
        params = grads.sums.pending_params()
        sq = host.shard_sq_norms(params)
        self.call("all-reduce of the grad norms", dist.all_reduce, sq, group=self.group)
        total = (sq.sqrt() / self.world).float()  # the norms of the averaged grads (world: exact if a power of 2)
        grads.norms.update({p: total[i] for i, p in enumerate(params)})

    # -- faults --------------------------------------------------------------------------------------------

    def call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError, DistBackendError, ...
            self.naming.clear()  # check_usable() waits for the error naming the rank, not the bare `failed`
            try:
                self.failed = f"the {what} failed on rank {self.rank}"
                who = ("Another rank of the process group raised, hung past the group's timeout or exited (its "
                       "own error says why)" if self.roll_call is None else self.roll_call.silent())
                raise self.first_error(DistributedError(
                    f"rank {self.rank} of {self.world}: the {what} failed: {e}. {who}; this engine cannot go on "
                    "in step with the others")) from e
            finally:
                self.naming.set()

    def first_error(self, error: DistributedError) -> DistributedError:
        if self.error is None:
            self.error = error
        return error

    def raise_failure(self, error: BaseException) -> None:
        """``error`` came out of the lane (wrapped once per item that waited on the failed one): raise the
        :class:`DistributedError` it began with instead, if a collective failed."""
        if self.error is not None:
            raise DistributedError(str(self.error)) from error

    def local_weight(self, host: HostState, p: int) -> torch.Tensor:
        """Parameter ``p``'s value from what this rank holds alone (``close()`` after a fault, when the other
        ranks' shards can no longer be gathered): the whole device-dtype copy, in fp32 (in fp32 it is the
        master itself)."""
        sharded = _sharded(host, self.rank)
        self.closed_with_local = self.closed_with_local or sharded.device_dtype != torch.float32
        return sharded.param_source(p).float()

    def after_close(self) -> None:
        """``close()`` released everything; say so if the module got this rank's 16-bit copy, not the masters."""
        if self.closed_with_local:
            raise DistributedError(
                f"rank {self.rank} of {self.world}: the engine is closed (threads and memory released), but after "
                f"the data-parallel failure ({self.failed}) the fp32 masters, spread over the ranks, could not be "
                "gathered: the module holds this rank's last 16-bit copy of the weights, in fp32. Restart every "
                "rank from the last checkpoint (engine.save) to get exact weights")

    def backward_failed(self, error: str) -> None:
        """This rank's backward raised: it has left the collective sequence the other ranks follow. Unless a
        collective failed already, it tells them ([Note: a fault named])."""
        in_step, self.failed = self.failed is None, f"a backward raised on rank {self.rank} ({error})"
        if not in_step:
            return
        try:
            self.lane.drain()  # the collectives this rank issued before the fault: the others are in them too
            tag = torch.tensor([FAULT, self.rank, 0, self.reduces], dtype=torch.int64)
            _all_gather(tag.new_empty(TAG_SIZE * self.world), tag, group=self.tag_group)
        except Exception:  # noqa: BLE001 - a peer gone or timed out: it errs on its own; this rank's error stands
            pass

    def check_usable(self) -> None:
        self.naming.wait(60.0)  # a collective failing on the lane now: wait for its roll call ([Note: a fault named])
        if self.error is not None:  # a collective failed: its error says who and why
            raise DistributedError(str(self.error))
        if self.failed is not None:
            raise DistributedError(
                f"rank {self.rank} of {self.world}: {self.failed}, so this data-parallel engine is out of step "
                "with the other ranks and cannot train on. Restart every rank from the last checkpoint")


def _sharded(host: HostState, rank: int) -> ShardedHostState:
    if not isinstance(host, ShardedHostState):
        raise InvariantError(f"rank {rank}: a data-parallel engine without sharded host state: a bug in offload, "
                             "please report it")
    return host
