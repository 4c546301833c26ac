"""Set-up and fault naming for data parallel (issue 20), apart from ``distributed.py``'s collectives: the
host's one shared host copy made and mapped by its ranks ([Note: one host copy per node], [Note: one host
copy per host] in host/node_copy.py), the lane's all-gather of the updated shards into a host copy
(:class:`ShardGather`), when the shared copy is checked whole ([Note: the shared copy checked once per backward];
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
  ([Note: one host copy per node]); batching the checks changes nothing there. Over several hosts ([Note: one
  host copy per host]) a rank also writes its column's other shards of ``b`` after its update (the column's
  all-gather on its lane, or the copies back from the device's all-gather, which the check waits for:
  ``DataParallel.settle``): still after that reduce-scatter, and before this rank's check.
* **Over the whole group.** Over several hosts a host's copy is whole once its ``G`` ranks wrote their
  columns, so a check among the host's ranks would do; the check stays one all-gather over every rank (the
  main thread's group) instead: it costs one small collective per backward over the inter-host links, and
  it is where every other check pairs, so a rank that raised after the last sum, or read alone, is still met
  and named there ([Note: a fault named]), never waited for on a group it left.
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
from ..host.node_copy import SHM_DIR, Hosts, NodeCopy, hosts_of, no_room_for, node_copy_layout
from .device_collectives import _all_gather, group_timeout, host_key

if TYPE_CHECKING:
    from ..host.shard import ShardedHostState
    from ..planning.buckets import Bucket

# [Note: a fault named]: the kinds of the tags a rank sends in place of a check's (distributed.py's others)
FAULT, JOIN = -1, -2
TAG_SIZE = 4  # the tags of the checks before a sum: (kind, two values, checks so far)
COLLECTIVE_READS = ("Call model.state_dict() on every rank (sd = model.state_dict(); if rank == 0: torch.save(sd, "
                     "path)), or engine.save(path) on every rank (rank 0 writes the file).")
_PATH_BYTES = 128  # a host copy's file name, all-gathered ([Note: one host copy per node])


def make_node_copy(buckets: Sequence[Bucket], itemsize: int, call: Callable[..., None], group: Any, rank: int,
                   world: int, share: bool | None) -> NodeCopy | None:
    """[Note: one host copy per node], [Note: one host copy per host]: each host's lowest rank makes its file,
    every rank maps its host's; None (after a warning, or an error with ``share_host_copy=True``) where the
    ranks are not placed as torchrun places them or a rank cannot map its host's copy; None quietly where
    each of several hosts runs one rank (nothing to share)."""
    _, nbytes = node_copy_layout(buckets, itemsize)
    if nbytes == 0:
        return None
    keys = torch.empty(world, dtype=torch.int64)
    call("all-gather of the host names", _all_gather, keys, torch.tensor([host_key()], dtype=torch.int64),
         group=group)
    hosts = hosts_of(keys.tolist(), rank)
    if isinstance(hosts, Hosts) and hosts.count > 1 and hosts.per_host == 1:
        if share:
            raise OffloadError(f"rank {rank} of {world}: share_host_copy=True, but every host runs one rank: "
                               "there is nothing to share. Use share_host_copy=None (share where possible) or False")
        return None  # each rank its own copy, nothing to warn about
    why = hosts if isinstance(hosts, str) else ""
    node: NodeCopy | None = None
    path = ""
    if isinstance(hosts, Hosts) and rank == hosts.leader:
        why = no_room_for(nbytes)
        if not why:
            path = os.path.join(SHM_DIR, f"offload-{uuid.uuid4().hex}")
            try:
                node = NodeCopy(path, nbytes, create=True, hosts=hosts)
            except (OSError, RuntimeError, HostMemoryError) as e:
                why, path = f"rank {rank} could not make {path}: {e}", ""
    try:
        path, node, why, mapped = _share_node_copy(path, node, why, nbytes, hosts, call, group, rank, world)
    finally:
        if isinstance(hosts, Hosts) and rank == hosts.leader and path:
            NodeCopy.unlink(path)  # every rank has tried to map it (or failed): the memory lives while mapped
    missing = [r for r in range(world) if not int(mapped[r])]
    if node is not None and not missing:
        return node
    node = None
    why = why or f"rank {', '.join(map(str, missing))} could not map its host's copy (its warning says why)"
    if share:
        raise OffloadError(f"rank {rank} of {world}: share_host_copy=True, but the ranks cannot share one host "
                           f"copy of the weights per host: {why}. Use share_host_copy=None (share where "
                           "possible) or False")
    warnings.warn(f"offload: rank {rank} keeps its own host copy of the weights ({why}); the node holds one "
                  "per rank ([Note: one host copy per node]; share_host_copy=False: no warning)", OffloadWarning,
                  stacklevel=2)
    return None


def _share_node_copy(path: str, node: NodeCopy | None, why: str, nbytes: int, hosts: Hosts | str,
                     call: Callable[..., None], group: Any, rank: int,
                     world: int) -> tuple[str, NodeCopy | None, str, torch.Tensor]:
    """Each host's lowest rank says its file's name ("" if it made none: an all-gather over the group), the
    host's other ranks map it; every rank says whether it did."""
    mine = torch.zeros(_PATH_BYTES, dtype=torch.uint8)
    mine[: len(path)] = torch.tensor(list(path.encode()), dtype=torch.uint8) if path else mine[:0]
    names = torch.empty(world * _PATH_BYTES, dtype=torch.uint8)
    call("all-gather of the host copies' names", _all_gather, names, mine, group=group)
    if isinstance(hosts, Hosts):
        leader = hosts.leader
        sent = names[leader * _PATH_BYTES: (leader + 1) * _PATH_BYTES]
        path = bytes(sent.tolist()).rstrip(b"\0").decode()
        if not why and not path:
            why = f"rank {leader} could not make its host's copy (its warning says why)"
        if path and rank != leader:
            try:
                node = NodeCopy(path, nbytes, create=False, hosts=hosts)
            except (OSError, RuntimeError) as e:
                why = f"rank {rank} could not map {path} ({e}): another /dev/shm (a container of its own?)"
    mapped = torch.empty(world, dtype=torch.int64)
    call("all-gather of the node copy's mappings", _all_gather, mapped,
         torch.tensor([int(node is not None)], dtype=torch.int64), group=group)
    return path, node, why, mapped


class ShardGather:
    """The all-gather, on the CPU lane after this rank's update of a bucket, that brings other ranks' updated
    shards into this rank's host copy: every rank's into its own copy, over the group (:meth:`every`), or
    its column's into its host's shared copy, over a group of the column (:meth:`column`, [Note: one host
    copy per host] in host/node_copy.py)."""

    def __init__(self, group: Any, ranks: Sequence[int], call: Callable[..., None], what: str) -> None:
        self.group, self.ranks, self.what = group, tuple(ranks), what  # ranks: the group's, in gather order
        self.call = call  # DataParallel.call: a failed collective named

    @classmethod
    def every(cls, group: Any, world: int, call: Callable[..., None]) -> ShardGather:
        return cls(group, range(world), call, "weights")

    @classmethod
    def column(cls, group: Any, hosts: Hosts, call: Callable[..., None]) -> ShardGather:
        """Every rank of ``group`` makes its column's group (only the column's ranks join each one:
        ``use_local_synchronization``)."""
        ranks = dist.get_process_group_ranks(group)
        try:
            column = dist.new_group(ranks=[ranks[r] for r in hosts.column], backend="gloo",
                                    timeout=group_timeout(group), use_local_synchronization=True)
        except Exception as e:  # noqa: BLE001 - a store that failed
            raise OffloadError(f"one host copy of the weights per host needs a process group over each local "
                               f"rank's ranks, and torch.distributed failed: {e}. Use share_host_copy=False") from e
        return cls(column, hosts.column, call, "column of weights over the hosts")

    def gather(self, host: ShardedHostState, b: int) -> None:
        mine = host.shard_of_copy(b)
        full = mine.new_empty(mine.numel() * len(self.ranks))
        self.call(f"all-gather of bucket {b}'s {self.what}", _all_gather, full, mine, group=self.group)
        host.take_copy_shards(b, full, self.ranks)


def fault_in(tags: torch.Tensor, rank: int, world: int) -> tuple[str, str] | None:
    """[Note: a fault named]: in a check's all-gathered ``tags`` (one row per rank), the ranks that read alone
    ([Note: a read on one rank]) or whose backward raised, sent in place of their check: (why this rank is out
    of step, the text of its error), or None."""
    alone = [r for r in range(world) if int(tags[r, 0]) == JOIN]
    if alone:
        names = ", ".join(str(r) for r in alone)
        return f"rank {names} read the sharded state alone", (
            f"rank {rank} of {world}: rank {names} called a collective read of the weights alone "
            f"(model.state_dict(), engine.state_dict(), engine.save or close(), with a 16-bit dtype) while this "
            f"rank trained on, so the ranks' collectives no longer pair. {COLLECTIVE_READS} Restart every "
            "rank from the last checkpoint")
    faulty = [r for r in range(world) if int(tags[r, 0]) == FAULT]
    if faulty:
        names = ", ".join(str(r) for r in faulty)
        return f"the backward raised on rank {names}", (
            f"rank {rank} of {world}: the backward raised on rank {names} (its own error says why), "
            "which then left the collectives: this engine cannot go on in step with it. Restart every rank "
            "from the last checkpoint")
    return None


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
