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
from tests.distributed.test_data_parallel import CONCAT_ATOL, _assert_report_host_bytes, _assert_weights, _ok
from tests.distributed.workers import Case, make_model, reference, run_ranks

DEVICE = {"grad_reduce": "device"}
# each rank its own host copy, the updated weights all-gathered on the device ([Note: weights gathered on the
# device]): what runs where the ranks are on several hosts (here all are on one, which would share one copy)
GATHER = {**DEVICE, "share_host_copy": False}


def _shard_bytes(r: dict, world: int, itemsize: int) -> tuple[int, int]:
    """(this rank's shard bytes, the whole buckets' grad bytes) of one step, from its buckets."""
    shards = sum(shard_of(t, 0, world).size * itemsize for _, t in r["buckets"] if t)
    whole = sum(t * itemsize for _, t in r["buckets"])
    return shards, whole


def _assert_device_path(r: dict, case: Case, itemsize: int, budget: int) -> None:
    """Only the shard came to the host (counted by the engine's copies), from slots padded to the shards, and
    the device peak held the budget. Without a shared host copy, the weights were gathered on the device."""
    shards, whole = _shard_bytes(r, case.world, itemsize)
    assert r["counters"]["d2h_bytes"] == case.steps * shards, (r["counters"], shards)
    own = sum(shard_of(t, r["rank"], case.world).numel * itemsize for _, t in r["buckets"])
    if case.extra.get("share_host_copy") is False:
        # [Note: weights gathered on the device]: every step, each bucket's own updated elements went to the
        # device and its whole gathered trainable prefix came back (the gather, not gloo on the host)
        assert r["host_shared_bytes"] == 0
        assert r["counters"]["gather_h2d_bytes"] == case.steps * own, (r["counters"], own)
        assert r["counters"]["gather_d2h_bytes"] == case.steps * whole, (r["counters"], whole)
    else:  # [Note: one host copy per node]: written in place by the owners, nothing gathered; checked whole once
        assert r["host_shared_bytes"] > 0  # per backward ([Note: the shared copy checked once per backward])
        assert r["counters"]["gather_h2d_bytes"] == r["counters"]["gather_d2h_bytes"] == 0
        assert (r["counters"]["copy_checks"], r["counters"]["copy_checks_early"]) == (case.steps, 0), r["counters"]
    assert shards <= whole / case.world + 16 * itemsize * len(r["buckets"])  # 1/N, up to the shard alignment
    # [Note: resident weights gathered in their slots]: every step after the first that does not plan again
    # brings each resident bucket's new weights up as this rank's chunk, all-gathered in the slot over the node
    assert len(r["resident"]) == len(r["buckets"])  # these budgets keep every bucket resident
    refreshes = case.steps - 1 - r["counters"]["replans"]
    assert r["counters"]["refresh_gathers"] == refreshes * len(r["buckets"]), r["counters"]
    assert r["grad_slot_numel"] == [shard_of(t, 0, case.world).size * case.world for _, t in r["buckets"]]
    assert 0 < r["device_peak_bytes"] <= budget


def test_two_ranks_reduced_on_the_device_equal_one_process(tmp_path):
    """fp32, updates overlapped, chaos delays on every lane: bit for bit the ranks' summed grads in plain
    PyTorch (as the host path), near one process on the concatenated batch; a tenth of the default budget."""
    case = Case(world=2, chaos=True, extra={**GATHER, "budget": "48KiB"})
    results = _ok(run_ranks(case, tmp_path))
    exact = reference(case, emulate_ranks=True)
    concat = reference(case, emulate_ranks=False)
    for r in results:
        _assert_weights(r["weights"], exact["weights"])
        _assert_weights(r["weights"], concat["weights"], CONCAT_ATOL)
        _assert_device_path(r, case, 4, 48 << 10)
    # no whole grad lands on the host: the arena is the one `offload report --grad-reduce device` predicts
    _assert_report_host_bytes(results, "fp32", "device")


def test_ranks_that_keep_other_buckets_resident_copy_them_whole(tmp_path):
    """[Note: resident weights gathered in their slots]: rank 1's budget keeps no bucket resident, rank 0's
    keeps all: the ranks do not agree on the buckets to gather after step(), so each copies its own whole (no
    all-gather that nothing pairs with on the other rank), and both train bit for bit as the reference."""
    case = Case(world=2, extra={**DEVICE, "budget": "48KiB", "rank_budget": {1: "16KiB"}})
    results = _ok(run_ranks(case, tmp_path))
    exact = reference(case, emulate_ranks=True)
    assert results[0]["resident"] == [0, 1, 2] and results[1]["resident"] == []
    for r in results:
        _assert_weights(r["weights"], exact["weights"])
        assert r["counters"]["refresh_gathers"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("share", [None, False])
def test_four_ranks_on_two_hosts_gather_resident_buckets_within_each_host(tmp_path, share):
    """Four ranks on two hosts (faked: ``host_key``), chaos on: one shared copy per host ([Note: one host
    copy per host]) or each rank its own (``share_host_copy=False``), the updated shards gathered on the device
    during backward ([Note: weights gathered on the device]), and after step() each resident bucket comes up
    as this rank's half, all-gathered over its host's two ranks only (a group of its own); within 1e-6 of the
    rank-ordered sum (gloo sums four addends in its own order)."""
    case = Case(world=4, chaos=True, extra={**DEVICE, "hosts": 2, "share_host_copy": share})
    results = _ok(run_ranks(case, tmp_path))
    exact = reference(case, emulate_ranks=True)
    for r in results:
        _assert_weights(r["weights"], exact["weights"], 1e-6)
        _assert_weights(r["weights"], results[0]["weights"])
        assert (r["host_shared_bytes"] > 0) == (share is None) and r["counters"]["gather_h2d_bytes"] > 0
        assert r["counters"]["refresh_gathers"] == (case.steps - 1) * len(r["buckets"]), r["counters"]


@pytest.mark.slow
def test_bfloat16_reduced_on_the_device_is_the_host_path_bit_for_bit(tmp_path):
    """bf16 with the fused AdamW: the device reduce-scatter sums the same bf16 grads as gloo does on the host
    (two addends: one rounding either way), so the two paths train the very same model, bit for bit."""
    runs = {}
    for mode in ("host", "device"):
        case = Case(world=2, dtype=torch.bfloat16, fused=True, extra={"grad_reduce": mode})
        runs[mode] = _ok(run_ranks(case, tmp_path / mode))
    for host, device in zip(runs["host"], runs["device"]):
        _assert_weights(device["weights"], host["weights"])
        _assert_weights(device["weights"], runs["device"][0]["weights"])
        _assert_device_path(device, case, 2, 64 << 20)
        assert host["counters"]["d2h_bytes"] == case.steps * _shard_bytes(host, 2, 2)[1]  # the whole buckets


def test_ranks_whose_grads_complete_other_buckets_fail_naming_the_mismatch(tmp_path):
    """Rank 1's second backward stops above the lower layers: at its end its main thread checks the node's
    shared copy ([Note: the shared copy checked once per backward]) while rank 0 checks its next bucket on the
    device group. Both raise at once (not after the 30 s timeout: the test's is 25 s), naming the tags per
    rank: never a sum of different buckets, never a hang."""
    case = Case(world=2, branch_rank=1, extra=DEVICE)
    results = run_ranks(case, tmp_path, timeout_s=25.0)
    assert not any(r.get("hung") for r in results), results
    assert "DistributedError: rank 0 of 2: the ranks are about to sum different buckets' grads" in results[0]["error"]
    assert ("DistributedError: rank 1 of 2: the ranks reached the check that the node's copy of the weights is whole "
            "at different points") in results[1]["error"], results[1]


def test_a_rank_raising_in_backward_is_named_on_the_device_group(tmp_path):
    """[Note: a fault named] with the checks on the device group: rank 1 raises in its second backward and
    joins rank 0's next check there with a fault tag; rank 0 raises naming it, at once (the group timeout is
    60 s, the test's 25 s)."""
    case = Case(world=2, fail_rank=1, timeout_s=60.0, extra=DEVICE)
    results = run_ranks(case, tmp_path, timeout_s=25.0)
    assert not any(r.get("hung") for r in results), results
    assert results[1]["error"] == "RuntimeError: injected fault in backward", results[1]
    assert results[0]["error"].startswith("DistributedError: rank 0 of 2: the backward raised on rank 1 "), results[0]


def test_grad_reduce_option():
    """Unknown values and the device path with deferred updates are refused; "auto" is the device only on CUDA
    with overlapped updates (the CPU backend keeps the host path, so existing CPU tests keep their meaning)."""
    from offload.runtime.device_collectives import resolve_grad_reduce

    with pytest.raises(ValueError, match='grad_reduce must be "auto", "device" or "host"'):
        offload.OffloadConfig(budget="1MiB", grad_reduce="nccl")
    with pytest.raises(ValueError, match='grad_reduce="device" needs overlap_optimizer=True'):
        offload.OffloadConfig(budget="1MiB", grad_reduce="device", overlap_optimizer=False)
    with pytest.raises(ValueError, match='grad_reduce="device" needs overlap_optimizer=True'):
        offload.OffloadConfig(budget="1MiB", grad_reduce="device", dtype=torch.float16)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert resolve_grad_reduce("auto", cuda, overlap=True) == "device"
    assert resolve_grad_reduce("auto", cuda, overlap=False) == "host"
    assert resolve_grad_reduce("auto", cpu, overlap=True) == "host"
    assert resolve_grad_reduce("device", cpu, overlap=True) == "device"
    assert resolve_grad_reduce("host", cuda, overlap=True) == "host"
    model = make_model()  # no group: the option does nothing, and says nothing
    offload.wrap(model, offload.AdamW(model.parameters()), budget="64MiB", device="cpu", grad_reduce="device").close()


@pytest.mark.parametrize("copy", ["gathered", "shared"])
def test_two_ranks_reduced_on_the_simulated_gpu(tmp_path, copy):
    """The CUDA backend's code path (the reduce-scatter on its collective stream, the shard's copy on the D2H
    stream after it; then the weights gathered on the weights' stream from the CPU lane's thread, or written
    into the node's shared copy) on the simulated GPU, whose side streams run late and whose device memory
    checks every access for a missing event: no race, bit for bit as on the CPU backend, over four steps (the
    traced one, planned ones, fast ones)."""
    case = Case(world=2, steps=4, extra={**(GATHER if copy == "gathered" else DEVICE), "simulated_gpu": True})
    results = _ok(run_ranks(case, tmp_path))
    exact = reference(case, emulate_ranks=True)
    for r in results:
        assert r["races"] == [], r["races"][:3]
        assert r["sim_log"].count("new_stream") >= 3, r["sim_log"][:20]  # H2D, D2H and the collectives'
        _assert_weights(r["weights"], exact["weights"])
        _assert_device_path(r, case, 4, 64 << 20)


@pytest.mark.slow
def test_a_rank_hanging_in_backward_fails_the_other_after_the_groups_timeout(tmp_path):
    """The device group takes the user's group's timeout (8 s here, not torch's 30 min): rank 1 hangs midway
    through its second backward, and rank 0's next check on the device group fails after it (plus the 5 s roll
    call), naming rank 1, well before rank 1's 30 s hang ends (after which its exit would fail any wait)."""
    case = Case(world=2, hang_rank=1, timeout_s=8.0, extra=DEVICE)
    results = run_ranks(case, tmp_path, timeout_s=60.0)
    assert "DistributedError" in results[0]["error"] and "rank 0 of 2" in results[0]["error"], results[0]
    assert "Rank 1 did not say it saw this collective fail" in results[0]["error"], results[0]
    assert results[0]["error_after_s"] < 25.0, results[0]["error_after_s"]
    assert results[1].get("exitcode") == 3


@pytest.mark.slow
def test_a_departure_on_one_rank_makes_every_rank_replan(tmp_path):
    """[Note: re-plans agreed] with the checks on the device group: rank 1 alone departs from its plan, both
    re-plan at the same steps (the grad slots, padded, laid out again) and end with the same model."""
    case = Case(world=2, steps=4, extra={**DEVICE, "replan_rank": 1})
    results = _ok(run_ranks(case, tmp_path))
    r0, r1 = (r["counters"] for r in results)
    assert r1["plan_departures"] >= 1 and r0["plan_departures"] == 0, (r0, r1)
    assert r0["replans"] == r1["replans"] >= 1, (r0, r1)
    _assert_weights(results[0]["weights"], results[1]["weights"])
    for r in results:
        _assert_device_path(r, case, 4, 64 << 20)


@pytest.mark.slow
def test_collective_reads_pair_on_the_device_group(tmp_path):
    """[Note: a read on one rank] with the checks on the device group: a rank-0-only ``model.state_dict()`` in
    bf16 meets rank 1's next check there, and both raise naming the way; on every rank it gives the whole fp32
    model, and ``engine.save`` writes it."""
    alone = Case(world=2, dtype=torch.bfloat16, fused=True, timeout_s=60.0,
                 extra={**DEVICE, "rank0_state_dict": True, "join_window_s": 3.0})
    r0, r1 = run_ranks(alone, tmp_path / "alone", timeout_s=50.0)
    assert r0["error"].startswith("DistributedError: rank 0 of 2: reading the fp32 weights"), r0
    assert r1["error"].startswith("DistributedError: rank 1 of 2: rank 0 called a collective read"), r1
    every = Case(world=2, dtype=torch.bfloat16, fused=True, steps=2, save=str(tmp_path / "ck.pt"),
                 extra={**DEVICE, "every_rank_state_dict": True})
    results = _ok(run_ranks(every, tmp_path / "every"))
    saved = torch.load(every.save, weights_only=True)["model"]
    for r in results:
        _assert_weights(r["model_state_dict"], results[0]["weights"])
        _assert_weights(saved, r["weights"])
        assert all(v.dtype == torch.float32 for v in r["model_state_dict"].values())
