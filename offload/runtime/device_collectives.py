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
      ─► on the CPU lane, as on the host path: AdamW of the shard, gloo all-gather of the updated shards of
         the device-dtype copy into the whole host copy (the host group)

*In place.* The slot is the input; the rank's output is its own chunk of it (``slot[r*c: (r+1)*c]``, NCCL's
in-place form), so no buffer outside the plan's arena is made. The slot therefore holds ``c * world``
elements, the host's padded shard layout ([Note: host shards] in host/shard.py): each bucket's
``grad_padding`` (:func:`pad_buckets`) rounds its grad slot up before planning, so the planner lays the
padded slot out and counts it in the budget; the slot is zeroed when taken, padding included. The plan's
grad-slot waits cover both device operations: the copy of the shard waits for the reduce-scatter, and the
slot's reuse waits for the copy (``slots.done``).

*Two groups.* Collectives pair by issue order per group. The device collectives and their checks are issued
by the main thread, the weights' all-gathers by the CPU-lane thread; on one gloo group the two threads'
orders would interleave differently on each rank. So ``wrap`` makes a second group over the same ranks
(:class:`DeviceGroup`, ``dist.new_group`` with ``use_local_synchronization``: only these ranks call it):
``gloo`` on the CPU backend, ``cpu:gloo,cuda:nccl`` on CUDA (its NCCL side reduce-scatters the slots, its gloo
side runs the checks, which must finish before the sum is issued: an NCCL result would need a host sync), with
the user's group's timeout, so a rank that hangs fails the others as soon on either group. The
main thread is its only user: the per-bucket checks, and every check that pairs with them ([Note: a fault
named], [Note: re-plans agreed], [Note: a read on one rank] all use it then), so a rank that completed another
bucket, raised in backward or reads alone still meets the others' next check and is named. The user's group
keeps the CPU lane's all-gathers and the collective reads of the host state (lane drained).

*Which modes.* Only overlapped updates (``overlap_optimizer=True``). Deferred updates (accumulation, clipping,
float16, ``no_sync``, the averaged ``p.grad``) keep the host path: they sum whole buckets on the host over
backward passes. ``grad_reduce="device"`` with deferred updates is refused (``OffloadConfig``).

*Not yet.* The weights half (each rank's updated shard host-to-device, then an all-gather on the device at
fetch time) is the next increment: it needs one plan agreed by every rank (fetch order is plan order, and
the all-gathers pair by it), where today each rank plans its own device side.
"""

from __future__ import annotations

import datetime
import warnings
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from ..errors import OffloadError, OffloadWarning

if TYPE_CHECKING:
    from ..planning.buckets import Bucket


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
    """The second group over a data-parallel group's ranks, for the main thread's collectives."""

    def __init__(self, group: Any, device: torch.device) -> None:
        backend = "gloo" if device.type == "cpu" else "cpu:gloo,cuda:nccl"
        try:
            self.group = dist.new_group(ranks=dist.get_process_group_ranks(group), backend=backend,
                                        timeout=_timeout_of(group), use_local_synchronization=True)
        except Exception as e:  # noqa: BLE001 - a backend this torch lacks, a store that failed
            raise OffloadError(
                f"grad_reduce=\"device\" needs a second process group over the same ranks (backend {backend!r}) "
                f"for the device collectives, and torch.distributed.new_group failed: {e}. Use "
                "grad_reduce=\"host\" to keep every collective on the host") from e
        self.device = device


def _timeout_of(group: Any) -> datetime.timedelta | None:
    """The group's timeout, for the second group (None: torch's default) so a hang fails as soon on both."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - a private torch API: without it, torch's default timeout
        warnings.warn("offload: the process group's timeout could not be read; the device collectives' group "
                      "uses torch's default timeout", OffloadWarning, stacklevel=2)
        return None
