"""Grads reduce-scattered on the device (issue 20, [Note: grads reduced on the device] in
offload/runtime/device_collectives.py), forced on the CPU backend, where the "device" tensors are host ones and
gloo runs the very code path NCCL runs on CUDA: N spawned ranks against one process, as
test_data_parallel.py's, plus what is new: only this rank's shard crosses to the host, the grad slots are padded
to the shards and the device peak stays within the budget.
"""

from __future__ import annotations

import pytest
import torch

import offload
from offload.host.shard import shard_of
from tests.distributed.test_data_parallel import CONCAT_ATOL, _assert_weights, _ok
from tests.distributed.workers import Case, make_model, reference, run_ranks

DEVICE = {"grad_reduce": "device"}


def _shard_bytes(r: dict, world: int, itemsize: int) -> tuple[int, int]:
    """(this rank's shard bytes, the whole buckets' grad bytes) of one step, from its buckets."""
    shards = sum(shard_of(t, 0, world).size * itemsize for _, t in r["buckets"] if t)
    whole = sum(t * itemsize for _, t in r["buckets"])
    return shards, whole


def _assert_device_path(r: dict, case: Case, itemsize: int, budget: int) -> None:
    """Only the shard came to the host (counted by the engine's copies), from slots padded to the shards, and
    the device peak held the budget."""
    shards, whole = _shard_bytes(r, case.world, itemsize)
    assert r["counters"]["d2h_bytes"] == case.steps * shards, (r["counters"], shards)
    assert shards <= whole / case.world + 16 * itemsize * len(r["buckets"])  # 1/N, up to the shard alignment
    assert r["grad_slot_numel"] == [shard_of(t, 0, case.world).size * case.world for _, t in r["buckets"]]
    assert 0 < r["device_peak_bytes"] <= budget


def test_two_ranks_reduced_on_the_device_equal_one_process(tmp_path):
    """fp32, updates overlapped, chaos delays on every lane: bit for bit the ranks' summed grads in plain
    PyTorch (as the host path), near one process on the concatenated batch; a tenth of the default budget."""
    case = Case(world=2, chaos=True, extra={**DEVICE, "budget": "48KiB"})
    results = _ok(run_ranks(case, tmp_path))
    exact = reference(case, emulate_ranks=True)
    concat = reference(case, emulate_ranks=False)
    for r in results:
        _assert_weights(r["weights"], exact["weights"])
        _assert_weights(r["weights"], concat["weights"], CONCAT_ATOL)
        _assert_device_path(r, case, 4, 48 << 10)
