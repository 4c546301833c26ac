"""Set-up and fault naming for data parallel (issue 20), apart from ``distributed.py``'s collectives: the
node's one shared host copy made and mapped by every rank ([Note: one host copy per node] in
host/node_copy.py) and when it is checked whole ([Note: the shared copy checked once per backward];
``DataParallel.check_copies``), and the group store's roll call that names a rank that died or hangs ([Note:
a fault named] in distributed.py).

[Note: the shared copy checked once per backward]
A bucket's shared copy is whole once every rank has written its shard of it, and only a collective can say
so. That check was one small all-gather per bucket on the CPU lane, after the bucket's AdamW: ~145 a step
for gpt2-xl in 32 MiB buckets, each a gloo ring's latency (31 ms a step at 8 ranks on the nominal preset) on
the lane that bounds the step (up to 5 % of it in the model, benchmarks/scaling.py). Nothing
reads a bucket's copy between its update and the end of the backward that updated it (overlapped updates)
or the end of ``step()``'s updates (deferred ones), but in one case (below), so one check of every bucket
written since the last one is enough there:

* **When.** At the end of a backward (``Runtime._end_backward``, after its last update was submitted) and in
  ``step()`` after its updates, before the re-plan's agreement. Every rank reaches both with the same
  buckets written in the same order (the grads' order, checked before each reduce-scatter), so the checks
  pair one to one; the tag carries the number of buckets and a CRC-32 of their list (and the checks so far,
  as every check's), and ranks that differ raise.
* **How it orders the reads.** The check runs on the main thread once this rank's CPU lane drained (its own
  writes are done), on the checks' group ([Note: collectives on one thread]: where a faulty rank's tag is
  sent, so a rank that raised mid-backward is named there, never waited for), and returns once every rank's
  has: every later read of the copy (a host-to-device copy, a read of ``p``) is issued after it. Blocking the
  main thread at the end of backward costs a usual step nothing (``step()`` would drain the lane there); what
  a user runs between ``backward()`` and ``step()`` no longer overlaps the last updates.
* **The one case.** A read of ``p`` inside the backward that updated its bucket (``Runtime.wait_for_updates``):
  the check of what is written so far runs at once, before the read (counted in ``copy_checks_early``). A bucket
  fetched again inside that backward is not such a case any more: on its plan a streamed bucket read after
  its last grad has its update held to the end of backward ([Note: streamed weights read after their update]
  in device_optim.py), a step off its plan holds all of its updates from the departure on, and a bucket updated
  before a departure noticed only in backward is refused when copied in again ([Note: a departed step's
  updates wait]): no rank has written a shard of what a backward fetches (tests/distributed/
  test_node_copy_written.py: every rank reads torch's weight from before the update, ``copy_checks_early``
  0; N6 in tests/MUTATIONS.md: the early check in ``copy_in`` stays, reached by a fault's refresh only, where
  it does nothing). Every rank reaches a read of ``p`` there only where every rank reads there
  (the same plan); ranks whose plans differ there (other budgets) send different tags and raise, loudly,
  never with a wrong number: a limit, stated.
* **Writes.** A rank writes its shard of ``b`` only after the reduce-scatter (or all-reduce) of ``b``'s
  grads, which every rank joins after its backward read ``b``, so a write never overlaps another rank's read
  ([Note: one host copy per node]); batching the checks changes nothing there.
"""

from __future__ import annotations

import os
import time
import uuid
import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..errors import HostMemoryError, OffloadError, OffloadWarning
from ..host.node_copy import SHM_DIR, NodeCopy, no_room_for, node_copy_layout
from .device_collectives import _all_gather, host_key

if TYPE_CHECKING:
    from ..planning.buckets import Bucket

_PATH_BYTES = 128  # the node copy's file name, broadcast by rank 0 ([Note: one host copy per node])


def make_node_copy(buckets: Sequence[Bucket], itemsize: int, call: Callable[..., None], group: Any, rank: int,
                   world: int, share: bool | None) -> NodeCopy | None:
    """[Note: one host copy per node]: rank 0 makes the file, every rank maps it; None (after a warning, or
    an error with ``share_host_copy=True``) where the ranks are not on one host or a rank cannot map it."""
    _, nbytes = node_copy_layout(buckets, itemsize)
    if nbytes == 0:
        return None
    hosts = torch.empty(world, dtype=torch.int64)
    call("all-gather of the host names", _all_gather, hosts, torch.tensor([host_key()], dtype=torch.int64),
         group=group)
    several_hosts = len(set(hosts.tolist())) > 1
    why = "the group's ranks run on more than one host" if several_hosts else ""
    node: NodeCopy | None = None
    path = ""
    if not why and rank == 0:
        why = no_room_for(nbytes)
        if not why:
            path = os.path.join(SHM_DIR, f"offload-{uuid.uuid4().hex}")
            try:
                node = NodeCopy(path, nbytes, create=True)
            except (OSError, RuntimeError, HostMemoryError) as e:
                why, path = f"rank 0 could not make {path}: {e}", ""
    try:
        path, node, why, mapped = _share_node_copy(path, node, why, nbytes, call, group, rank, world)
    finally:
        if rank == 0 and path:
            NodeCopy.unlink(path)  # every rank has tried to map it (or failed): the memory lives while mapped
    missing = [r for r in range(world) if not int(mapped[r])]
    if path and missing:
        node = None
        why = why or f"rank {', '.join(map(str, missing))} could not map {path} (its warning says why)"
    if node is not None:
        return node
    if share:
        raise OffloadError(f"rank {rank} of {world}: share_host_copy=True, but the node's ranks cannot "
                           f"share one host copy of the weights: {why}. Use share_host_copy=None (share where "
                           "possible) or False")
    if several_hosts:
        return None  # what runs across hosts: each rank its own copy, nothing to warn about
    warnings.warn(f"offload: rank {rank} keeps its own host copy of the weights ({why}); the node holds one "
                  "per rank ([Note: one host copy per node]; share_host_copy=False: no warning)", OffloadWarning,
                  stacklevel=2)
    return None

def _share_node_copy(path: str, node: NodeCopy | None, why: str, nbytes: int, call: Callable[..., None],
                     group: Any, rank: int, world: int) -> tuple[str, NodeCopy | None, str, torch.Tensor]:
    """Rank 0 sends the file's name ("" if it made none), the others map it; every rank says whether it did."""
    sent = torch.zeros(_PATH_BYTES, dtype=torch.uint8)
    sent[: len(path)] = torch.tensor(list(path.encode()), dtype=torch.uint8) if path else sent[:0]
    call("broadcast of the node copy's name", dist.broadcast, sent, group_src=0, group=group)
    path = bytes(sent.tolist()).rstrip(b"\0").decode()
    if not why and not path:
        why = "rank 0 could not make it (its warning says why)"
    if path and rank != 0:
        try:
            node = NodeCopy(path, nbytes, create=False)
        except (OSError, RuntimeError) as e:
            why = f"rank {rank} could not map {path} ({e}): another /dev/shm (a container of its own?)"
    mapped = torch.empty(world, dtype=torch.int64)
    call("all-gather of the node copy's mappings", _all_gather, mapped,
               torch.tensor([int(node is not None)], dtype=torch.int64), group=group)
    return path, node, why, mapped


class RollCall:
    """[Note: a fault named]: which ranks of the group say they saw a collective fail, in the group's store."""

    ROLL_CALL_S = 5.0  # how long a rank whose collective failed waits for the others to say they saw it too

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world

    @classmethod
    def of(cls, group: Any, rank: int, world: int) -> RollCall | None:
        """None where torch gives no store for the group (the errors then name no other rank)."""
        try:
            from torch.distributed.distributed_c10d import _get_process_group_store
            return cls(dist.PrefixStore("offload/failed/", _get_process_group_store(group)), rank, world)
        except Exception:  # noqa: BLE001 - a private torch API: without it, only the naming is lost
            return None

    def silent(self) -> str:
        """After a failed collective: the ranks that do not say they saw it fail too (dead or hung), in words."""
        others = [r for r in range(self.world) if r != self.rank]
        try:
            self.store.set(str(self.rank), "1")
            deadline = time.monotonic() + self.ROLL_CALL_S
            while True:
                answered = [r for r in others if self.store.check([str(r)])]
                if len(answered) == len(others) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        except Exception as e:  # noqa: BLE001 - the store's server was on a rank that died
            return (f"The group's store cannot be read to say which rank stopped ({type(e).__name__}: {e}): most "
                    "likely the rank it ran on (rank 0 with torchrun) died or hangs")
        silent = [r for r in others if r not in answered]
        if not silent:
            return ("Every other rank saw it fail too: another process of the group failed (its own error says "
                    "why)")
        return (f"Rank {', '.join(map(str, silent))} did not say it saw this collective fail within "
                f"{self.ROLL_CALL_S:g} s: it died or hangs (its own log says why)")
