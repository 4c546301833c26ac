"""One device-dtype copy of the weights per node, shared by the node's data-parallel ranks (issue 20).

[Note: one host copy per node]
Every rank needs the whole device-dtype copy of every bucket on the host: it is what a fetch copies to the
device. Kept per rank, a node of ``G`` ranks holds ``G`` copies (2 B/param each in 16 bits): on 8 GPUs that
is 16 B/param, as much as the partitioned optimizer state itself. Where every rank of the group runs on
one node, the ranks share one copy instead (over several nodes, one per node: [Note: one host copy per
host], below): a file in ``/dev/shm`` that every rank maps (``MAP_SHARED``),
laid out as the per-rank copy was, bucket after bucket (:func:`node_copy_layout`).

Each element has one writer: the owner of its shard for the trainable prefix ([Note: host shards] in
shard.py; the update writes its shard's new device-dtype values straight into the shared copy), rank 0 for
the rest (frozen parameters, written once). So the all-gather of the updated shards is not needed at all:
a bucket's copy is whole once every rank has updated its shard, which one small all-gather of a tag says,
once per backward for every bucket it updated ([Note: the shared copy checked once per backward] in
runtime/node_share.py; ``DataParallel.check_copies``). Writes outside a step (the first masters,
``load_state_dict``, a write to ``p.data``) are followed by one such check on the main thread before anything
reads the copy.

Reads by another rank cannot overlap a write: a rank updates bucket ``b`` only after the reduce-scatter of
``b``'s grads of the next step, which every rank joins after its backward used ``b`` (so after its copies of
``b`` to the device), and reads outside a step (``state_dict``, a fetch of an evaluation) come before that.

Making it (``DataParallel.host_state``): rank 0 creates the file at its exact size with ``posix_fallocate``
(so a ``/dev/shm`` too small, as Docker's 64 MiB default, fails there with an error, not later with SIGBUS),
the ranks map it and say whether they could (ranks on one host name may still see different ``/dev/shm``,
e.g. in separate containers), and rank 0 unlinks the name (also when that exchange failed): the memory lives
while a rank maps it, and nothing is left in ``/dev/shm`` if a rank dies. If any rank could not map it, every
rank keeps its own copy and the engine warns. The mapping is page-locked as the arena is (``Backend.pin_host``).

[Note: one host copy per host]
Over several hosts each host keeps one copy too, made and mapped by its own ranks as above (its lowest rank
makes the file and unlinks it; the names are all-gathered, each rank maps its host's). That needs the
layout torchrun gives (:func:`hosts_of`): every host holds the same number ``G`` of ranks, and consecutive
ranks (rank ``r`` is local rank ``l = r mod G`` of host ``h = r // G``); otherwise every rank keeps its own
copy, as on a host whose ranks cannot map theirs. The optimizer state stays partitioned over all ``N``
ranks ([Note: host shards]), so after rank ``r`` updated its shard of a bucket, its host's copy still lacks
the shards of the other hosts' ranks. The ranks of one local rank ``l`` on every host form a *column*
(``l, l + G, l + 2G, ...``, one per host): after its update a rank all-gathers its column's ``M`` shards
(``M`` hosts; a group of their own) and writes the ``M - 1`` it did not update into its host's copy
(:meth:`offload.host.shard.ShardedHostState.take_copy_shards`). Each element of a host's copy still has one
writer on that host: local rank ``l`` writes the shards ``l + kG`` (its own by the update, the others by
its column's gather; written outside a step from the whole value, ``ShardedHostState.writes``), local rank 0
the elements past the trainable prefix. The check that the copies are whole
([Note: the shared copy checked once per backward]) follows the column gathers on every rank (each rank's
lane drained first, the gathers included). Per rank and bucket the inter-host links carry ``M - 1`` shards
in (``(M - 1) / N`` of the bucket) where a copy per rank gathers ``N - 1``; each host holds one copy (2 B
per parameter in 16 bits), not ``G``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import psutil
import torch

from ..config import format_bytes
from ..errors import HostMemoryError
from ..planning.buckets import HOST_ALIGN, Bucket
from .state import HOST_RAM_HEADROOM

SHM_DIR = "/dev/shm"


def node_copy_layout(buckets: Sequence[Bucket], itemsize: int) -> tuple[tuple[int, ...], int]:
    """Pure: the byte offset of each bucket's copy in the shared file (``HOST_ALIGN``-aligned), and its size."""
    offsets, off = [], 0
    for b in buckets:
        offsets.append(off)
        off = -(-(off + b.numel * itemsize) // HOST_ALIGN) * HOST_ALIGN
    return tuple(offsets), off


@dataclass(frozen=True)
class Hosts:
    """Where the group's ranks run ([Note: one host copy per host]): ``count`` hosts of ``per_host``
    consecutive ranks each; ``rank``: this rank (of the group)."""

    count: int
    per_host: int
    rank: int

    @property
    def local(self) -> int:
        """This rank's index among its host's ranks."""
        return self.rank % self.per_host

    @property
    def leader(self) -> int:
        """Its host's lowest rank: it makes the host's copy and writes what no shard holds."""
        return self.rank - self.local

    @property
    def column(self) -> tuple[int, ...]:
        """The ranks of this rank's local rank on every host, in host order (this rank among them)."""
        return tuple(self.local + k * self.per_host for k in range(self.count))


def hosts_of(keys: Sequence[int], rank: int) -> Hosts | str:
    """Pure: the hosts of a group from each rank's host key (``keys[r]``: rank ``r``'s), or why its ranks
    cannot keep one copy per host (:class:`Hosts` needs consecutive ranks, as many on every host)."""
    order = [k for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k]
    if len(order) != len(set(order)):
        return "the ranks of a host are not consecutive (torchrun's placement is)"
    per_host = len(keys) // len(order)
    if per_host * len(order) != len(keys) or any(keys[i] != order[i // per_host] for i in range(len(keys))):
        counts = [keys.count(k) for k in order]
        return f"the hosts hold different numbers of ranks ({', '.join(map(str, counts))})"
    return Hosts(len(order), per_host, rank)


def shm_free_bytes(directory: str = SHM_DIR) -> int:
    """Bytes free in ``directory`` (0 where it does not exist)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def no_room_for(nbytes: int, directory: str = SHM_DIR) -> str:
    """Why a shared copy of ``nbytes`` cannot be made here ("" if it can): ``directory``'s free space, the host's
    available RAM (with the arena's headroom)."""
    free, ram = shm_free_bytes(directory), psutil.virtual_memory().available
    if free < nbytes:
        return f"{directory} has {format_bytes(free)} free and the copy needs {format_bytes(nbytes)}"
    if nbytes * HOST_RAM_HEADROOM > ram:
        return f"the host has {format_bytes(ram)} of RAM available and the copy needs {format_bytes(nbytes)}"
    return ""


class NodeCopy:
    """The shared file, mapped: ``view`` gives a bucket's copy. ``data_ptr`` and ``size_bytes`` are what
    ``Backend.pin_host`` registers (as for a :class:`offload.host.arena.HostArena`). ``hosts``: where the
    ranks that share it run (one host: ``Hosts(1, world, rank)``), which says what this rank writes in it."""

    def __init__(self, path: str, nbytes: int, create: bool, hosts: Hosts) -> None:
        if create:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                os.close(fd)
                os.unlink(path)
                raise HostMemoryError(f"the node's shared copy of the weights needs {nbytes} bytes in "
                                      f"{os.path.dirname(path)}: {e}") from e
            os.close(fd)
        self.path, self.hosts = path, hosts
        self.tensor = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        self.data_ptr = self.tensor.data_ptr()
        self.size_bytes = nbytes

    def view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.tensor[offset: offset + numel * itemsize].view(dtype)

    @staticmethod
    def unlink(path: str) -> None:
        """Remove the name (the memory stays while mapped); nothing to do if it is gone."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
