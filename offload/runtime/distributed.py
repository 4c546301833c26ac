"""Data parallel over torch.distributed (issue 20): one engine per rank, optimizer state partitioned.

When ``torch.distributed`` is initialised, ``offload.wrap`` trains data parallel over the default group
(``process_group=`` picks another, ``False`` opts out). Each rank traces and plans its own device side, and
keeps the host side of [Note: host shards] (``offload/host/shard.py``): its ``1/world`` of every bucket's
fp32 master, Adam m and v. Per bucket, on the CPU lane, in the order the grads complete (the same on every
rank, since every rank runs the same model):

    grads on the host ─► reduce-scatter (the rank's shard of the sum over ranks)
                     ─► AdamW of the shard (grads scaled by 1/world: the average, as DDP's)
                     ─► all-gather of the updated device-dtype shards into the whole copy
                     ─► (the next forward's host-to-device copy waits for it, as for any update)

With ``overlap_optimizer`` this runs while backward goes on. With deferred updates (accumulation,
clipping, float16) nothing is sent while micro-batches accumulate: the first of ``clip_grad_norm_`` and
``step()`` reduce-scatters every gathered bucket, then one all-reduce of per-parameter sums of squares gives
the norms over all ranks, from which the clip coefficient and the float16 overflow check follow, so every
rank agrees on both.

[Note: collectives on one thread]
gloo and NCCL match collectives by the order each rank issues them. Every collective of a step is issued by
the one CPU-lane thread, in submission order; those of the main thread (the norms' all-reduce, the gathers
that read values other ranks own) are issued only after the lane drained. A collective that fails (a peer
raised, hung past the group's timeout, or died) raises :class:`DistributedError` naming this rank, and the
engine refuses to go on: its ranks are no longer in step, and a later collective could pair with the wrong
one on another rank. So does a rank whose backward raised after a collective was issued.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..errors import DistributedError, InvariantError, OffloadError
from ..host.shard import ShardedHostState
from ..host.state import HostState

# torch 2.13 names the single-tensor collectives *_single (the *_tensor names warn); older torch has only those
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

if TYPE_CHECKING:
    from ..backend.base import Event, Lane
    from ..planning.buckets import Bucket, ParamSpec
    from .grads import GradPipeline


class DataParallel:
    """The collectives of one rank's engine, on its CPU lane (see the module docstring)."""

    def __init__(self, group: Any, lane: Lane) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.lane = lane
        self._reduced: dict[int, tuple[Event, Event]] = {}  # bucket -> (the grads' ready event, its reduce)
        self.failed: str | None = None  # why this rank can no longer train in step with the others
        self._reduces = 0  # reduce-scatters issued since wrap (the same on every rank in step)

    @classmethod
    def resolve(cls, process_group: Any, lane: Lane) -> DataParallel | None:
        """``process_group``: None (the default group if torch.distributed is initialised), False (never),
        or a group. None when there is nothing to be parallel over (no group, or a group of one rank)."""
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
        return cls(group, lane)

    def host_state(self, buckets: Sequence[Bucket], specs: Sequence[ParamSpec], shapes: Sequence[torch.Size],
                   dtype: torch.dtype, fused: bool, accumulate: bool) -> ShardedHostState:
        return ShardedHostState(buckets, specs, shapes, dtype, self.rank, self.world, self.gather,
                                fused=fused, accumulate=accumulate)

    # -- per bucket, on the CPU lane ---------------------------------------------------------------------

    def submit_update(self, host: HostState, b: int, ready: Event, update: Callable[[], None],
                      waits: Sequence[Event]) -> Event:
        """Reduce-scatter bucket ``b``'s grads (unless :meth:`reduce_pending` did), run ``update`` on the
        shard, all-gather the new copy; return the event after which the copy is whole."""
        self.check_usable()
        host = _sharded(host, self.rank)
        reduced = self._reduced.pop(b, None)
        if reduced is not None and reduced[0] is ready:
            reduce = reduced[1]
        else:
            reduce = self._submit_reduce(host, b, ready)
        updated = self.lane.submit(update, [reduce, *waits], f"AdamW of bucket {b}'s shard")
        return self.lane.submit(lambda: self._gather_copy(host, b), [updated], f"all-gather of bucket {b}")

    def _submit_reduce(self, host: ShardedHostState, b: int, ready: Event) -> Event:
        return self.lane.submit(lambda: self._reduce(host, b), [ready], f"reduce-scatter of bucket {b}'s grads")

    def _reduce(self, host: ShardedHostState, b: int) -> None:
        self._check_same_bucket(b)
        self._call(f"reduce-scatter of bucket {b}'s grads", _reduce_scatter, host.grad_shard[b],
                   host.grad_padded[b], group=self.group)

    def _check_same_bucket(self, b: int) -> None:
        """[Note: collectives on one thread]: collectives pair by order, so a rank whose grads completed
        another bucket (a data-dependent branch taken on one rank only) would sum another bucket's bytes,
        silently where the sizes agree. One small all-gather of (bucket, count so far) first makes it loud."""
        tag = torch.tensor([b, self._reduces], dtype=torch.int64)
        tags = tag.new_empty(2 * self.world)
        self._call(f"check of bucket {b}'s reduce-scatter", _all_gather, tags, tag, group=self.group)
        self._reduces += 1
        others = tags.view(self.world, 2)
        if not bool((others == tag).all()):
            self.failed = f"ranks reduced different buckets ({others.tolist()})"
            raise DistributedError(
                f"rank {self.rank} of {self.world}: the ranks are about to sum different buckets' grads "
                f"((bucket, reduce-scatters so far) per rank: {others.tolist()}): every rank must run the same "
                "model calls, so that the same parameters get grads in the same order")

    def _gather_copy(self, host: ShardedHostState, b: int) -> None:
        mine = host.shard_of_copy(b)
        full = mine.new_empty(mine.numel() * self.world)
        self._call(f"all-gather of bucket {b}'s weights", _all_gather, full, mine, group=self.group)
        host.take_gathered_copy(b, full)

    # -- on the main thread, the lane drained ([Note: collectives on one thread]) -------------------------

    def reduce_pending(self, grads: GradPipeline, norms: bool, norm_type: float = 2.0) -> None:
        """Deferred updates: reduce-scatter every bucket gathered since the last step (once), and with
        ``norms`` replace ``grads.norms`` by the norms of the averaged grads over every rank."""
        self.check_usable()
        if norm_type != 2.0:
            raise OffloadError(f"clip_grad_norm_ with norm_type={norm_type:g} is not supported data parallel (the "
                               "2-norm is, computed over every rank); use norm_type=2.0")
        host = _sharded(grads.slots.hosted(), self.rank)
        for b in sorted(grads.pending):
            ready = grads.pending[b].ready
            have = self._reduced.get(b)
            if have is None or have[0] is not ready:
                self._reduced[b] = (ready, self._submit_reduce(host, b, ready))
        self.lane.drain()
        if not norms:
            return
        params = grads.pending_params()
        sq = host.shard_sq_norms(params)
        self._call("all-reduce of the grad norms", dist.all_reduce, sq, group=self.group)
        total = (sq.sqrt() / self.world).float()  # the norms of the averaged grads (world: exact if a power of 2)
        grads.norms.update({p: total[i] for i, p in enumerate(params)})

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's ``shard`` (same size on all), concatenated: for reads of values other ranks own."""
        self.check_usable()
        self.lane.drain()
        full = shard.new_empty(shard.numel() * self.world)
        self._call("all-gather of host state", _all_gather, full, shard, group=self.group)
        return full

    def on_rank0(self, fn: Callable[[], None], what: str) -> None:
        """Run ``fn`` on rank 0 (a checkpoint's write); every rank returns once it is done, or raises if it
        failed there."""
        self.check_usable()
        error: BaseException | None = None
        if self.rank == 0:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the others were told
                error = e
        ok = torch.tensor([0 if error is not None else 1], dtype=torch.int32)
        self._call(f"broadcast of the outcome of {what}", dist.broadcast, ok, group_src=0, group=self.group)
        if error is not None:
            raise error
        if not int(ok):
            raise DistributedError(f"rank {self.rank} of {self.world}: {what} failed on rank 0 (its error says why)")

    # -- faults --------------------------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError, DistBackendError, ...
            self.failed = f"the {what} failed on rank {self.rank}"
            raise DistributedError(
                f"rank {self.rank} of {self.world}: the {what} failed: {e}. Another rank of the process group "
                "raised, hung past the group's timeout or exited (its own error says why); this engine cannot "
                "go on in step with the others") from e

    def backward_failed(self, error: str) -> None:
        """This rank's backward raised: it has left the collective sequence the other ranks follow."""
        self.failed = f"a backward raised on rank {self.rank} ({error})"

    def check_usable(self) -> None:
        if self.failed is not None:
            raise DistributedError(
                f"rank {self.rank} of {self.world}: {self.failed}, so this data-parallel engine is out of step "
                "with the other ranks and cannot train on. Restart every rank from the last checkpoint")


def _sharded(host: HostState, rank: int) -> ShardedHostState:
    if not isinstance(host, ShardedHostState):
        raise InvariantError(f"rank {rank}: a data-parallel engine without sharded host state: a bug in offload, "
                             "please report it")
    return host
