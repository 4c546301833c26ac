"""ShardedHostState ([Note: host shards], offload/host/shard.py) without processes: the shards partition
every bucket, and N ranks' shard updates, put together, are the unsharded HostState's update bit for bit
(AdamW is elementwise; each rank reads the sum of the ranks' grads, scaled by 1/N: fed N x the grad here,
exact for N a power of two). The collectives themselves are tested with gloo ranks in tests/distributed."""

import pytest
import torch

from offload.host.shard import SHARD_ALIGN, ShardedHostState, shard_of
from offload.host.state import HostState
from offload.planning.buckets import make_buckets
from tests.host.test_host import HPARAMS, LOWP, PATHS, SPECS

pytestmark = pytest.mark.intra_op_threads  # [Note: the suite's intra-op threads] in tests/conftest.py


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 100, 1000, 4099])
def test_shards_partition_the_trainable_prefix(n, world):
    shards = [shard_of(n, r, world) for r in range(world)]
    assert all(s.size == shards[0].size and s.size % SHARD_ALIGN == 0 for s in shards)
    assert shards[0].size * world >= n
    covered = [i for s in shards for i in range(s.start, s.end)]
    assert covered == list(range(n))  # in order, disjoint, complete


def _no_gather(shard: torch.Tensor) -> torch.Tensor:
    raise AssertionError("the update must not gather")


@pytest.mark.parametrize("fused", PATHS)
@pytest.mark.parametrize("lowp", LOWP)
@pytest.mark.parametrize("world", [2, 4])
def test_shard_updates_put_together_are_the_unsharded_update(world, lowp, fused):
    buckets = make_buckets(SPECS, range(len(SPECS)), bucket_bytes=4 * 4000, itemsize=4)
    shapes = [torch.Size([s.numel]) for s in SPECS]
    whole = HostState(buckets, SPECS, shapes, lowp, fused=fused)
    dtype = lowp or torch.float32
    ranks = [ShardedHostState(buckets, SPECS, shapes, dtype, r, world, _no_gather, fused=fused) for r in range(world)]
    gen = torch.Generator().manual_seed(0)
    for p, spec in enumerate(SPECS):
        value = torch.randn(spec.numel, generator=gen)
        whole.write_master(p, value)
        for host in ranks:
            host.write_master(p, value)
        if spec.group is None:
            continue
        for which, scale in (("exp_avg", 1e-2), ("exp_avg_sq", 1e-4)):
            state = torch.rand(spec.numel, generator=gen) * scale
            whole.param_state(p, which).copy_(state)
            for host in ranks:
                host.write_state(p, which, state)
    for b, bucket in enumerate(buckets):
        if not bucket.trainable_numel:
            continue
        grad = (torch.randn(bucket.trainable_numel, generator=gen) * 256).to(dtype)  # as the copy lands it
        params = frozenset(p for run in bucket.runs for p in run.params)
        whole.update(b, params, HPARAMS, (0.5,), grads=grad.clone())  # the torch path scales it in place
        for host in ranks:
            s = host.shards[b]
            host.grad_shard[b][: s.numel].copy_(grad[s.start: s.end] * world)  # the sum over ranks
            host.update(b, params, HPARAMS, (0.5,))
        full = torch.cat([host.shard_of_copy(b) for host in ranks])
        for host in ranks:
            host.take_gathered_copy(b, full)
            s = host.shards[b]
            assert torch.equal(host.lowp[b], whole.source(b)), (b, host.rank)  # the whole copy, frozen tail too
            assert torch.equal(host.master[b][: s.numel], whole.master[b][s.start: s.end])
            assert torch.equal(host.exp_avg[b][: s.numel], whole.exp_avg[b][s.start: s.end])
            assert torch.equal(host.exp_avg_sq[b][: s.numel], whole.exp_avg_sq[b][s.start: s.end])
    assert all(host.steps == whole.steps for host in ranks)  # every rank counts every parameter's steps
