"""Grads reduce-scattered on the device (issue 20, the grads half of the design path): the group and the
padding they need. ``DataParallel.reduce_on_device`` (runtime/distributed.py) issues them.

[Note: grads reduced on the device]
With ``grad_reduce="device"`` (the default on CUDA with overlapped updates: :func:`resolve_grad_reduce`), a
bucket whose grads are final in its device grad slot is not copied to the host whole. Per bucket, from the
main thread (the backward hook that completes it), in the order the grads complete:

    check (a small all-gather of (bucket, checks so far), the device group's host side)
      ─► reduce-scatter of the slot, in place, on the backend's collective stream after the grads' event
         (NCCL on CUDA; gloo on the CPU backend and the simulated GPU, whose "device" tensors are host ones)
      ─► device-to-host copy of this rank's shard only (1/N of the slot) into the host's ``grad_shard``,
         after the reduce-scatter
      ─► on the CPU lane, as on the host path: AdamW of the shard; then the updated shards all-gathered on
         the device too ([Note: weights gathered on the device])

*In place.* The slot is the input; the rank's output is its own chunk of it (``slot[r*c: (r+1)*c]``, NCCL's
in-place form), so no buffer outside the plan's arena is made. The slot therefore holds ``c * world``
elements, the host's padded shard layout ([Note: host shards] in host/shard.py): each bucket's
``grad_padding`` (:func:`pad_buckets`) rounds its grad slot up before planning, so the planner lays the
padded slot out and counts it in the budget; the slot is zeroed when taken, padding included. The plan's
grad-slot waits cover both device operations: the copy of the shard waits for the reduce-scatter, and the
slot's reuse waits for the copy (``slots.done``).

*Two groups.* Collectives pair by issue order per group. The device collectives and their checks are issued
by the main thread, the weights' all-gathers by the CPU-lane thread; on one group the two threads'
orders would interleave differently on each rank. So ``wrap`` makes a second group over the same ranks
(:class:`DeviceGroup`, ``dist.new_group`` with ``use_local_synchronization``: only these ranks call it):
``gloo`` on the CPU backend, ``cpu:gloo,cuda:nccl`` on CUDA (``gloo`` in the one-GPU tests only:
``DeviceGroup.CUDA_BACKEND``; its NCCL side reduce-scatters the slots, its gloo
side runs the checks, which must finish before the sum is issued: an NCCL result would need a host sync), with
the user's group's timeout, so a rank that hangs fails the others as soon on either group. The
main thread is its only user: the per-bucket checks, and every check that pairs with them ([Note: a fault
named], [Note: re-plans agreed], [Note: a read on one rank] all use it then), so a rank that completed another
bucket, raised in backward or reads alone still meets the others' next check and is named. The CPU lane's
all-gathers of the weights have a third group (``DeviceGroup.weights``, made the same way); the user's group
keeps the collective reads of the host state (lane drained). The main thread's refresh of the resident buckets
after ``step()`` all-gathers on ``DeviceGroup.node`` ([Note: resident weights gathered in their slots]): the
device group itself where every rank is on one host, else a fourth group of this host's ranks.

*Which modes.* Only overlapped updates (``overlap_optimizer=True``). Deferred updates (accumulation, clipping,
float16, ``no_sync``, the averaged ``p.grad``) keep the host path: they sum whole buckets on the host over
backward passes. ``grad_reduce="device"`` with deferred updates is refused (``OffloadConfig``).

The weights come back through the device too: [Note: weights gathered on the device]. The resident buckets'
new weights go up to the device after ``step()`` through the device too: [Note: resident weights gathered
in their slots].

[Note: weights gathered on the device]
With grads reduced on the device and no host copy shared by the node's ranks (``share_host_copy=False``, or
the ranks cannot share; a shared copy on one host needs no gather: [Note: one host copy per node] in
host/node_copy.py), or one shared copy per host over several hosts ([Note: one host copy per host]; then
the copy back below brings only the rank's column's other shards, ``(M - 1) / N`` of the bucket, into its
host's copy: together the host's ``G`` ranks write each element once), the updated weights are all-gathered
on the device too: not on the host through gloo (which, on the CPU lane,
bounded the simulated step: ``planning/data_parallel_runtime.py``). Per
bucket, on the CPU lane, in the order its updates run (the same on every rank):

    AdamW of the shard ─► host-to-device copy of the shard's updated device-dtype elements into this rank's
    chunk of a gather buffer ─► all-gather in place in that buffer (the weights' collective stream) ─►
    device-to-host copy of the gathered trainable prefix into this rank's whole host copy

The bucket's next host-to-device copy waits for the last one (``slots.adam_event`` is a :class:`Deferred`
event: on CUDA the copy's stream waits for it on the device; the host waits only until the lane issued it).
Everything that reads the host copy keeps reading a whole, current copy: fetches on or off the plan, reads of
idle parameters, checkpoints, an evaluation on one rank. So every rank still plans its own device side, and
nothing pairs collectives with fetches.

*Buffers.* ``WEIGHT_GATHER_BUFFERS`` (2) device buffers of the largest padded trainable prefix
(``planning.data_parallel_runtime.weight_gather_bytes``), taken in turn: a buffer's next copy in waits for its
previous copy out, so one bucket's copy back overlaps the next one's gather. They are allocated at the end
of the first forward, counted in the device memory (part ``gather``) and planned as fixed bytes inside the
budget.

*Threads and groups.* The CPU lane's thread issues these collectives, the main thread the grads' reduce-scatters.
Two threads on one NCCL communicator, or on one stream, would interleave differently on each rank, and a
collective would wait on a partner queued behind another. So the weights have a group of their own
(:class:`DeviceGroup` ``weights``, made like the device group) and a stream of their own (``Backend.collective``
with ``weights=True``). Two NCCL communicators active at once on one GPU is what NCCL's documentation warns
"might work" provided both fit on the GPU; PyTorch's own FSDP and DDP-with-several-groups rely on the same.
``grad_reduce="host"`` keeps every collective on the host where that is in doubt.

*Order of host writes.* The update of a bucket waits for the previous copy back of that bucket (its
``Deferred``); the copy back rewrites this rank's own shard with the same values the update wrote. Readers
of the whole host copy (``Runtime.wait_for_updates``: ``state_dict``, ``save``) wait for every copy back
(:meth:`WeightGather.settle`).

*Cost.* Per rank and step: the shard host-to-device (``1/N`` of the bucket), the all-gather on the
device's links, the gathered prefix device-to-host (the single-GPU's grad copy's size, the other direction
of the link than the fetches; a host's shared copy: ``(M - 1) / N`` of it). The host keeps a whole copy per
rank (2 B/param in 16 bits), as before, or one per host where shared.

[Note: resident weights gathered in their slots]
After ``step()`` every resident bucket that was updated gets its new weights (``Executor.refresh``). Copied
whole from the host, that is the whole model over every GPU's PCIe link each step, where ZeRO-Offload copies
``1/N`` and all-gathers on the device (``benchmarks/scaling.py`` found the runtime slower than ZeRO-Offload's
rule at 11 of 80 configurations for that reason: the whole-bucket copies sit between the last AdamW and the
next forward). With grads reduced on the device, each such bucket comes up from the node's ranks instead:

    host copy (whole: see below) ─► this rank's chunk
    ``[i c, (i + 1) c)`` to the device, into the bucket's own slot, plus the tail ``[G c, n)``
    ─► all-gather of ``[0, G c)`` in place in the slot over the node's ``G`` ranks (``i``: this rank's
       index among them; ``c``: ``n // G`` elements rounded down to :data:`REFRESH_ALIGN`)

Compute waits for the all-gather (it is the bucket's ``h2d_event``), which waits for both copies. Each rank
reads only its own *whole* host copy (the node's shared one, whole since the check at the end of backward
or of step()'s updates; or its own, whole once its gather's copy back landed), so the chunks need not be the
AdamW's shards, frozen tails and padding need nothing special, and every other reader of the host copy is
unchanged. Over the node's ranks only: across nodes every host already holds the whole bucket (its shared
copy or per-rank copies, gathered during backward), so the inter-node links carry nothing more; on one
node the node is the group.

*Agreement.* Collectives pair by order, so every rank must gather the same buckets in the same order. The
buckets are those updated (the same on every rank) that this rank holds on the device, and each rank plans
its own device side: ``DataParallel.agree_refresh`` all-gathers a checksum of the list (one check of the
usual format, on the main thread's group, where every check pairs) and the gather runs only where every rank
sent the same (a CRC-32 and the length: two different lists pass once in about 4e9); otherwise every bucket
is copied whole (as before; correct, slower). A refresh outside
``step()`` (after a backward that raised) copies whole; so does a rank alone on its host (nothing to gather
from). ``grad_reduce="host"`` has no device group: whole.

*Cost.* Per rank and step, ``1/G`` of each refreshed bucket over PCIe (plus a tail under
``REFRESH_ALIGN x G`` elements), one all-gather over the node's links (NVLink) on the main thread's collective
stream, and one small check; modelled in ``planning/data_parallel_runtime.py`` ([Note: the runtime's device
reduce-scatter]).
"""

from __future__ import annotations

import datetime
import socket
import warnings
import zlib
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..errors import OffloadError, OffloadWarning

if TYPE_CHECKING:
    from ..backend.base import Backend, Event
    from ..host.shard import ShardedHostState
    from ..planning.buckets import Bucket
    from .accounting import DeviceMemory

# torch 2.13 names the single-tensor collectives *_single (the *_tensor names warn); older torch has only those
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


REFRESH_ALIGN = 16
"""Elements a rank's chunk of a resident bucket's refresh is rounded down to ([Note: resident weights gathered
in their slots])."""


def refresh_chunk(numel: int, parts: int) -> int:
    """Elements of each of ``parts`` ranks' chunk when a bucket of ``numel`` elements is gathered in its slot
    (0: too small to split, copied whole)."""
    return numel // parts // REFRESH_ALIGN * REFRESH_ALIGN if parts > 1 else 0


RefreshCopy = Callable[[int, torch.Tensor, torch.Tensor, Sequence["Event"]], Optional[Tuple["Event", int]]]
"""(bucket, its slot, its whole host copy, waits) -> (the event compute waits for, bytes copied), or None: copy it
whole ([Note: resident weights gathered in their slots]; ``DataParallel.agree_refresh`` makes one)."""


def resolve_grad_reduce(mode: str, device: torch.device, overlap: bool) -> str:
    """``OffloadConfig.grad_reduce`` for a backend's device: "device" or "host" ([Note: grads reduced on the
    device]). "auto": on the device where it is a GPU and updates are overlapped; the CPU backend keeps the host
    path unless forced."""
    if mode == "auto":
        return "device" if device.type == "cuda" and overlap else "host"
    return mode


def pad_buckets(buckets: Sequence[Bucket], world: int) -> tuple[Bucket, ...]:
    """Each bucket with its grad slot rounded up to its shards' padded length (``c * world``)."""
    from ..host.shard import shard_of

    return tuple(replace(b, grad_padding=shard_of(b.trainable_numel, 0, world).size * world - b.trainable_numel)
                 for b in buckets)


class DeviceGroup:
    """The groups over a data-parallel group's ranks for the device collectives: ``group`` for the main
    thread's (the grads' reduce-scatters and every check), ``weights`` for the CPU lane's (the weights'
    all-gathers: [Note: weights gathered on the device]), ``node`` over this host's ranks for the main thread's
    refresh of the resident buckets ([Note: resident weights gathered in their slots]; ``group`` itself where
    every rank is on this host)."""

    CUDA_BACKEND = "cpu:gloo,cuda:nccl"
    """The groups' backend on CUDA. Tests only may set ``"gloo"`` (in a spawned rank's process): gloo moves CUDA
    tensors through pinned host buffers, on its own streams ordered after the issuing stream and before it again
    (its reduce-scatter is an all-reduce of a copy), so several ranks can share ONE GPU, which NCCL refuses
    (tests/distributed/test_cuda_ranks.py: [Note: data parallel on one GPU] there)."""

    def __init__(self, group: Any, device: torch.device) -> None:
        backend = "gloo" if device.type == "cpu" else self.CUDA_BACKEND
        ranks, timeout = dist.get_process_group_ranks(group), group_timeout(group)
        try:  # every rank makes both, in this order (then its host's group, where the ranks span hosts)
            self.group = dist.new_group(ranks=ranks, backend=backend, timeout=timeout, use_local_synchronization=True)
            self.weights = dist.new_group(ranks=ranks, backend=backend, timeout=timeout,
                                          use_local_synchronization=True)
            # [Note: resident weights gathered in their slots]: the ranks on this host (the whole group on one)
            hosts = torch.empty(len(ranks), dtype=torch.int64)
            _all_gather(hosts, torch.tensor([host_key()], dtype=torch.int64), group=group)
            me, keys = dist.get_rank(), hosts.tolist()
            node = [r for r, h in zip(ranks, keys) if h == keys[ranks.index(me)]]
            self.node = self.group if len(node) == len(ranks) else dist.new_group(
                ranks=node, backend=backend, timeout=timeout, use_local_synchronization=True)
        except Exception as e:  # noqa: BLE001 - a backend this torch lacks, a store that failed
            raise OffloadError(
                f"grad_reduce=\"device\" needs two or three more process groups over the same ranks (backend "
                f"{backend!r}) for the device collectives, and torch.distributed failed: {e}. Use "
                "grad_reduce=\"host\" to keep every collective on the host") from e
        self.device = device
        self.node_rank, self.node_size = node.index(me), len(node)

    def refresh(self, backend: Backend, dst: torch.Tensor, src: torch.Tensor, waits: Sequence[Event],
                call: Callable[..., None], what: str) -> tuple[Event, int] | None:
        """[Note: resident weights gathered in their slots]: bring the whole host copy ``src`` into the slot
        ``dst`` as this rank's chunk and the tail after ``waits``, then the all-gather over the node's ranks;
        return (the all-gather's event, the bytes copied), or None where the bucket is too small to split."""
        size, i = self.node_size, self.node_rank
        c = refresh_chunk(dst.numel(), size)
        if not c:
            return None
        end, mine = c * size, dst[i * c: (i + 1) * c]
        copies = [backend.h2d(mine, src[i * c: (i + 1) * c], waits)]
        if end < dst.numel():
            copies.append(backend.h2d(dst[end:], src[end:], waits))
        gathered = backend.collective(lambda: call(what, _all_gather, dst[:end], mine, group=self.node), copies)
        return gathered, (c + dst.numel() - end) * dst.element_size()


class WeightGather:
    """[Note: weights gathered on the device]: the gather buffers and the per-bucket chain that brings a
    bucket's updated shards from every rank into this rank's host copy."""

    def __init__(self, backend: Backend, memory: DeviceMemory, stats: dict[str, int], buckets: Sequence[Bucket],
                 itemsize: int, dtype: torch.dtype, rank: int, world: int, group: Any,
                 call: Callable[..., None], column: Sequence[int] | None = None) -> None:
        """``column``: the ranks whose shards this rank copies back into its host's shared copy ([Note: one
        host copy per host] in host/node_copy.py; its own is there already); None: the whole prefix, into
        this rank's own copy."""
        from ..planning.data_parallel_runtime import WEIGHT_GATHER_BUFFERS, weight_gather_bytes

        self.backend, self.memory, self.dtype, self.rank, self.world, self.group = (backend, memory, dtype, rank,
                                                                                     world, group)
        self._call = call  # DataParallel.call: a failed collective named
        self.stats = stats  # gather_h2d_bytes, gather_d2h_bytes: this lane's own counters
        self.nbytes = weight_gather_bytes(buckets, itemsize)
        each = self.nbytes // WEIGHT_GATHER_BUFFERS
        self.buffers = [backend.empty(each) for _ in range(WEIGHT_GATHER_BUFFERS)] if each else []
        memory.add("gather", self.nbytes)
        self.free: list[Event | None] = [None] * len(self.buffers)  # each buffer's last copy out
        self.turn = 0
        self.column = None if column is None else tuple(r for r in column if r != rank)

    def gather(self, host: ShardedHostState, b: int) -> Event:
        """On the CPU lane, the shard's update done: issue the copy in, the all-gather and the copy out of
        bucket ``b``; return the copy out's event."""
        s, copy = host.shards[b], host.source(b)  # the whole host copy
        k, self.turn = self.turn, (self.turn + 1) % len(self.buffers)
        buf = self.buffers[k][: s.size * self.world * self.dtype.itemsize].view(self.dtype)
        mine = buf[self.rank * s.size: (self.rank + 1) * s.size]
        free = [e for e in (self.free[k],) if e is not None]
        copied = self.backend.h2d(mine[: s.numel], copy[s.start: s.end], free)
        gathered = self.backend.collective(
            lambda: self._call(f"all-gather of bucket {b}'s weights on the device", _all_gather, buf, mine,
                               group=self.group), [copied], weights=True)
        out = self.free[k] = self._copy_back(b, host, copy, buf, gathered)
        self.stats["gather_h2d_bytes"] += s.numel * self.dtype.itemsize
        return out

    def _copy_back(self, b: int, host: ShardedHostState, copy: torch.Tensor, buf: torch.Tensor,
                   gathered: Event) -> Event:
        """The gathered prefix (or the column's other shards) into the host copy; the last copy's event (one
        stream: the earlier ones are done by then)."""
        from ..host.shard import shard_of

        n = host.buckets[b].trainable_numel
        if self.column is None:
            self.stats["gather_d2h_bytes"] += n * self.dtype.itemsize
            return self.backend.d2h(copy[:n], buf[:n], [gathered])
        out = gathered
        for r in self.column:
            s = shard_of(n, r, self.world)
            if s.numel:
                out = self.backend.d2h(copy[s.start: s.end], buf[s.start: s.end], [gathered])
                self.stats["gather_d2h_bytes"] += s.numel * self.dtype.itemsize
        return out

    def settle(self) -> None:
        """Block until every copy out issued so far is done (the host copy is whole): after the CPU lane drained."""
        for event in self.free:
            if event is not None:
                event.synchronize()

    def close(self) -> None:
        if self.buffers:
            self.buffers, self.free = [], []
            self.memory.add("gather", -self.nbytes)


def host_key() -> int:
    """This process's host, as a number the ranks on one host share (their node's group)."""
    return zlib.crc32(socket.gethostname().encode())


def group_timeout(group: Any) -> datetime.timedelta | None:
    """The group's timeout, for the second group (None: torch's default) so a hang fails as soon on both."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - a private torch API: without it, torch's default timeout
        warnings.warn("offload: the process group's timeout could not be read; the device collectives' group "
                      "uses torch's default timeout", OffloadWarning, stacklevel=2)
        return None
