"""[Note: one host copy per host] (offload/host/node_copy.py): ranks on several hosts (faked: ``host_key``,
``extra={"hosts": H}``, consecutive ranks per host) keep one shared device-dtype copy of the weights per host,
and each rank's column all-gather brings the other hosts' shards into its host's copy. Against one process:
four ranks in fp32 are within 1e-6 of plain torch fed the rank-ordered sum (gloo sums four addends in its
own order, as test_data_parallel.py's four-rank tests state) and within CONCAT_ATOL of the concatenated batch;
every rank holds the same model bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.host.node_copy import Hosts, hosts_of, node_copy_layout
from offload.host.shard import shard_of
from offload.planning.buckets import HOST_ALIGN
from tests.distributed.test_data_parallel import (CONCAT_ATOL, _assert_copy_checks, _assert_host_bytes,
                                                  _assert_weights, _ok)
from tests.distributed.workers import Case, reference, run_ranks

TWO_HOSTS = {"hosts": 2}


def _one_copy_per_host(r: dict) -> int:
    """The bytes of one host's shared copy of these buckets (fp32), as node_copy_layout lays them out."""
    return sum(-(-numel * 4 // HOST_ALIGN) * HOST_ALIGN for numel, _ in r["buckets"])


def _assert_trained(results: list[dict], case: Case) -> None:
    exact = reference(case, emulate_ranks=True)
    concat = reference(case, emulate_ranks=False)
    for r in results:
        _assert_weights(r["weights"], results[0]["weights"])  # every rank the same model, bit for bit
        _assert_weights(r["weights"], exact["weights"], 1e-6)
        _assert_weights(r["weights"], concat["weights"], CONCAT_ATOL)
        _assert_weights(r["after_close"], r["weights"])
        # one copy per host, outside the rank's arena, which holds what a rank on one host holds
        assert r["host_shared_bytes"] == _one_copy_per_host(r) > 0, r["host_shared_bytes"]
        if case.extra.get("grad_reduce") != "device":  # (there no whole grad lands on the host)
            _assert_host_bytes(r, case.world, accumulate=case.micro > 1)
        _assert_copy_checks(r, case.steps)


def test_hosts_of_places_ranks_as_torchrun_does():
    """Pure: consecutive ranks, as many per host; anything else is said in words (then each rank keeps its own
    copy)."""
    two = hosts_of([7, 7, 9, 9], 3)
    assert two == Hosts(count=2, per_host=2, rank=3)
    assert (two.local, two.leader, two.column) == (1, 2, (1, 3))
    assert hosts_of([7, 7, 7, 7], 2).column == (2,)  # one host: the rank's own shard only
    assert hosts_of([1, 1, 2, 2, 3, 3], 0).column == (0, 2, 4)
    assert "not consecutive" in hosts_of([7, 9, 7, 9], 0)
    assert "different numbers of ranks (3, 1)" in hosts_of([7, 7, 7, 9], 0)
    assert "different numbers of ranks (1, 2, 1)" in hosts_of([1, 2, 2, 3], 0)
    assert "different numbers of ranks (3, 2)" in hosts_of([1, 1, 1, 2, 2], 0)
    assert node_copy_layout((), 4) == ((), 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=12), st.data())
def test_hosts_of_on_any_placement(keys, data):
    """Pure, on any host keys: a layout exactly where the keys come in equal runs of distinct hosts; then every
    rank's host is its run, and the columns of a host's ranks hold every rank once."""
    rank = data.draw(st.integers(0, len(keys) - 1))
    got = hosts_of(keys, rank)
    runs = [k for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k]
    equal = len(set(runs)) == len(runs) and len({keys.count(k) for k in runs}) == 1
    assert isinstance(got, Hosts) == equal, (keys, got)
    if isinstance(got, Hosts):
        assert got.count * got.per_host == len(keys) and keys[got.leader] == keys[rank]
        assert all(keys[r] == keys[got.leader] for r in range(got.leader, got.leader + got.per_host))
        host = [hosts_of(keys, r) for r in range(got.leader, got.leader + got.per_host)]
        assert sorted(r for h in host if isinstance(h, Hosts) for r in h.column) == list(range(len(keys)))
        assert rank in got.column and len({keys[r] for r in got.column}) == got.count


def test_four_ranks_on_two_hosts_share_one_copy_per_host(tmp_path):
    """fp32, overlapped updates, chaos delays on every lane (the column all-gathers included): each host's
    two ranks map one copy, every rank's update writes its shard there and its column's all-gather the
    other host's shard; the model is one process's (tolerances in the module docstring)."""
    case = Case(world=4, chaos=True, extra=TWO_HOSTS)
    results = _ok(run_ranks(case, tmp_path))
    assert all(r["chaos_draws"] > 0 for r in results)
    _assert_trained(results, case)


@pytest.mark.slow
def test_four_ranks_on_two_hosts_accumulate_and_clip_with_one_copy_per_host(tmp_path):
    """Deferred updates (two micro-batches, the global norm's clip): the updates in step() write the shards
    and gather the columns, checked whole once per step."""
    case = Case(world=4, overlap=False, micro=2, clip=0.05, extra=TWO_HOSTS)
    results = _ok(run_ranks(case, tmp_path))
    _assert_trained(results, case)


@pytest.mark.slow
def test_a_rank_raising_in_backward_is_named_across_hosts(tmp_path):
    """Rank 3 (the second host) raises in its second backward: every other rank, on either host, fails with a
    DistributedError naming it, at once (the group's timeout is 60 s, the test's 50 s), never a hang. The copy
    must be shared per host (``share_host_copy=True``: an error otherwise)."""
    case = Case(world=4, fail_rank=3, timeout_s=60.0, extra={**TWO_HOSTS, "share_host_copy": True})
    results = run_ranks(case, tmp_path, timeout_s=50.0)
    assert not any(r.get("hung") for r in results), results
    assert results[3]["error"] == "RuntimeError: injected fault in backward", results[3]
    for r in results[:3]:
        assert r["error"].startswith(f"DistributedError: rank {r['rank']} of 4: the backward raised on rank 3 "), r


@pytest.mark.slow
def test_checkpoint_saved_on_two_hosts_resumes_on_one(tmp_path):
    """Four ranks on two hosts save; two ranks on one host load the file (each its shard of it: gathered back,
    the file's state bit for bit) and train on as plain torch resumed from it (two addends: bit for bit)."""
    path = str(tmp_path / "ck.pt")
    case = Case(world=4, steps=2, save=path, extra=TWO_HOSTS)
    results = _ok(run_ranks(case, tmp_path / "save"))
    assert all(r["host_shared_bytes"] == _one_copy_per_host(r) for r in results)
    ck = torch.load(path, weights_only=True)
    _assert_weights(ck["model"], results[0]["weights"])
    _assert_weights(ck["model"], reference(case, emulate_ranks=True)["weights"], 1e-6)
    on_two = Case(world=2, load=path, start_step=2, steps=1)
    loaded = _ok(run_ranks(on_two, tmp_path / "load"))
    want = reference(on_two, emulate_ranks=True, start=ck)
    for r in loaded:
        _assert_weights(r["loaded"]["model"], ck["model"])
        for i, state in ck["optimizer"]["state"].items():
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(r["loaded"]["optimizer"]["state"][i][k], state[k]), (i, k)
        _assert_weights(r["weights"], want["weights"])


@pytest.mark.slow
def test_hosts_whose_ranks_cannot_map_a_copy_keep_their_own_and_say_why(tmp_path):
    """Each host's lowest rank finds no room for its copy (faked): every rank warns once, saying why, keeps its
    own copy (in its arena) and trains as one process; with ``share_host_copy=True`` every rank raises."""
    case = Case(world=4, steps=2, extra={**TWO_HOSTS, "no_shm_room": True, "record_warnings": True})
    results = _ok(run_ranks(case, tmp_path / "auto"))
    exact = reference(case, emulate_ranks=True)
    for r in results:
        assert r["host_shared_bytes"] == 0
        _assert_host_bytes(r, case.world, accumulate=False, shared=False)
        _assert_weights(r["weights"], exact["weights"], 1e-6)
        said = [w for w in r["warnings"] if "keeps its own host copy" in w]
        leader = r["rank"] - r["rank"] % 2
        want = "no room (a test)" if r["rank"] == leader else f"rank {leader} could not make its host's copy"
        assert len(said) == 1 and want in said[0], said
    case = Case(world=4, steps=1, extra={**TWO_HOSTS, "no_shm_room": True, "share_host_copy": True})
    for r in run_ranks(case, tmp_path / "must"):
        assert "share_host_copy=True" in r.get("error", ""), r


def _column_bytes(r: dict, world: int, hosts: int) -> int:
    """Per step, the bytes of the other hosts' shards of this rank's column (its local rank on each host)."""
    per_host, rank = world // hosts, r["rank"]
    column = [rank % per_host + k * per_host for k in range(hosts)]
    return sum(shard_of(t, c, world).numel * 4 for _, t in r["buckets"] for c in column if c != rank)


@pytest.mark.parametrize("simulated_gpu", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_four_ranks_on_two_hosts_reduced_on_the_device_share_one_copy_per_host(tmp_path, simulated_gpu):
    """``grad_reduce="device"``: the updated shards are all-gathered on the device over every rank ([Note:
    weights gathered on the device]), and each rank copies back only its column's other shards into its
    host's copy (its own is there from its update): 1/G of the copy back of a copy per rank. On the CPU
    backend, and on the simulated GPU (the CUDA backend's streams and events, every access checked: no race)."""
    case = Case(world=4, chaos=not simulated_gpu, extra={**TWO_HOSTS, "grad_reduce": "device",
                                                         "simulated_gpu": simulated_gpu})
    results = _ok(run_ranks(case, tmp_path))
    _assert_trained(results, case)
    for r in results:
        own = sum(shard_of(t, r["rank"], case.world).numel * 4 for _, t in r["buckets"])
        assert r["counters"]["gather_h2d_bytes"] == case.steps * own, r["counters"]
        assert r["counters"]["gather_d2h_bytes"] == case.steps * _column_bytes(r, 4, 2), r["counters"]
        assert r.get("races", []) == [], r["races"][:3]


@pytest.mark.slow
def test_a_load_between_steps_on_two_hosts_is_seen_whole_by_every_rank(tmp_path):
    """Weights written outside a step (``load_state_dict`` after the first step, rank 1's writes slowed): each
    rank writes its column's shards of its host's copy from the whole value, and the check after it waits for
    every rank; then the same no-grad forward on every rank of both hosts gives the same output, from the
    loaded weights (tests/MUTATIONS.md N10: a rank that wrote only its own shard leaves the other host's
    stale)."""
    case = Case(world=4, steps=2, extra={**TWO_HOSTS, "share_host_copy": True, "load_between_steps": True})
    results = _ok(run_ranks(case, tmp_path))
    assert all(r["host_shared_bytes"] == _one_copy_per_host(r) for r in results)
    for r in results[1:]:
        got, want = r["after_load"], results[0]["after_load"]
        assert torch.equal(got, want), (r["rank"], (got - want).abs().max())
