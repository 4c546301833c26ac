"""Reads of what other ranks own, on one rank's engine (issue 20): with a 16-bit dtype the fp32 masters and Adam
state are spread over the ranks ([Note: host shards] in host/shard.py), so reading them is collective.

[Note: a read on one rank]
With a 16-bit dtype the fp32 masters and Adam state are spread over the ranks, so ``model.state_dict()``,
``engine.state_dict()``, ``engine.save`` and ``close()`` gather them: every rank must call them. The common
``if rank == 0: torch.save(model.state_dict(), ...)`` would wait for the group's timeout (30 min by default)
in a gather the other ranks never join. So the first gather since the last training collective is preceded
by a small all-gather (a join tag, in the checks' format) waited for at most ``CollectiveReads.JOIN_WINDOW_S``: if the other
ranks are already in their next training collective it pairs with their check at once, and both sides raise
(the reader explaining that the call is collective and naming ``engine.save``; the others naming the reader);
if they are not there yet the reader raises when the window has passed, and its posted tag makes the others'
next check fail, naming it. The reader's engine is out of step after that (its tag stays posted): restart
from the last checkpoint. In fp32 every rank holds the whole weights and ``model.state_dict()`` is local.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from ..errors import DistributedError
from .device_collectives import _all_gather
from .node_share import COLLECTIVE_READS, JOIN, TAG_SIZE

if TYPE_CHECKING:
    from .distributed import DataParallel


class CollectiveReads:
    """The gathers a data-parallel engine's reads of the host state need, and the check that every rank joins them."""

    # How long a collective read of the host state (model.state_dict(), engine.save, close() with a 16-bit
    # dtype) waits for the other ranks to join it before it raises: [Note: a read on one rank]
    JOIN_WINDOW_S = 60.0

    def __init__(self, dp: DataParallel) -> None:
        self.dp = dp
        self._joined = -1  # dp.reduces when the ranks last joined a collective read (see _join_reads)

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's ``shard`` (same size on all), concatenated: for reads of values other ranks own."""
        dp = self.dp
        dp.check_usable()
        dp.lane.drain()
        self._join_reads()
        full = shard.new_empty(shard.numel() * dp.world)
        dp.call("all-gather of host state", _all_gather, full, shard, group=dp.group)
        return full

    def _join_reads(self) -> None:
        """[Note: a read on one rank]: before the first gather since the last training collective, every rank
        joins one small all-gather, waited for at most ``JOIN_WINDOW_S``."""
        dp = self.dp
        if self._joined == dp.reduces:
            return
        tag = torch.tensor([JOIN, 0, 0, dp.reduces], dtype=torch.int64)
        tags = tag.new_empty(TAG_SIZE * dp.world)
        try:
            work = _all_gather(tags, tag, group=dp.tag_group, async_op=True)
            work.wait(timeout=datetime.timedelta(seconds=self.JOIN_WINDOW_S))
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError on a timeout
            raise self._read_alone(f"the other ranks did not join within {self.JOIN_WINDOW_S:g} s ({e}); the read "
                                   "this rank began is still posted") from e
        dp.reduces += 1
        self._joined = dp.reduces
        others = tags.view(dp.world, TAG_SIZE)
        if not bool((others == tag).all()):
            trained = [r for r in range(dp.world) if int(others[r, 0]) != JOIN]
            raise self._read_alone(f"rank {', '.join(map(str, trained))} issued a training collective instead "
                                   f"(tags per rank: {others.tolist()})")

    def _read_alone(self, why: str) -> DistributedError:
        dp = self.dp
        dp.failed = f"a read of the sharded state on rank {dp.rank} was not joined by the other ranks"
        return dp.first_error(DistributedError(
            f"rank {dp.rank} of {dp.world}: reading the fp32 weights or Adam state (model.state_dict(), "
            f"engine.state_dict(), engine.save, close()) needs every rank: with a 16-bit dtype the fp32 masters "
            f"and Adam state are spread over the ranks, but {why}. {COLLECTIVE_READS} This engine is now out of "
            "step with the others (their collectives fail, naming this rank): restart every rank from the last "
            "checkpoint"))

    def on_rank0(self, fn: Callable[[], None], what: str) -> None:
        """Run ``fn`` on rank 0 (a checkpoint's write); every rank returns once it is done, or raises if it
        failed there."""
        dp = self.dp
        dp.check_usable()
        error: BaseException | None = None
        if dp.rank == 0:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the others were told
                error = e
        ok = torch.tensor([0 if error is not None else 1], dtype=torch.int32)
        dp.call(f"broadcast of the outcome of {what}", dist.broadcast, ok, group_src=0, group=dp.group)
        if error is not None:
            raise error
        if not int(ok):
            raise DistributedError(f"rank {dp.rank} of {dp.world}: {what} failed on rank 0 (its error says why)")

