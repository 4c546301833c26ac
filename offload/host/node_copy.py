"""One device-dtype copy of the weights per node, shared by the node's data-parallel ranks (issue 20).

[Note: one host copy per node]
Every rank needs the whole device-dtype copy of every bucket on the host: it is what a fetch copies to the
device. Kept per rank, a node of ``G`` ranks holds ``G`` copies (2 B/param each in 16 bits): on 8 GPUs that
is 16 B/param, as much as the partitioned optimizer state itself. Where every rank of the group runs on
one node, the ranks share one copy instead: a file in ``/dev/shm`` that every rank maps (``MAP_SHARED``),
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
"""

from __future__ import annotations

import os
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
    ``Backend.pin_host`` registers (as for a :class:`offload.host.arena.HostArena`)."""

    def __init__(self, path: str, nbytes: int, create: bool) -> None:
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
        self.path = path
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
