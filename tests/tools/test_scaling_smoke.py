"""benchmarks/scaling.py in a small configuration (GPT-2 small on the meta device, 1, 2 and 4 GPUs): the
harness runs, labels its numbers SIMULATED, names its presets and writes figures that agree with each
other, on both data paths: the runtime's (what runs, first, with the runtime's host bytes) and the design's.
It checks the harness, not the model's conclusions (tests/planning/test_collectives.py and
test_data_parallel_runtime.py do)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import scaling  # benchmarks/ is on sys.path (pyproject's pytest `pythonpath`)
from rich.console import Console

from common import trace_preset
from offload.planning.hw import PRESETS
from offload.planning.schedule import build_plan
from offload.tools.report_dp import runtime_host_bytes_per_rank


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    path = tmp_path_factory.mktemp("scaling") / "scaling.json"
    rc = scaling.main(["--models", "gpt2:1:1024", "--hw", "pcie4", "--configs", "1,2,4/2", "--inter", "eth100,ib400",
                       "--json", str(path)])
    assert rc == 0
    return json.loads(path.read_text())


def test_labelled_simulated_with_presets_and_machine(result):
    assert result["benchmark"] == "scaling" and result["label"].startswith("SIMULATED")
    assert "not measured" in result["hw"]["pcie4"]
    assert set(result["links"]) == {"nvlink3", "eth100", "ib400", "gloo-loopback", "gloo-tcp-eth100", "gloo-ipoib-400"}
    assert result["runs"] == "runtime" and list(result["paths"]) == ["runtime", "design"]
    assert "NOT what runs" in result["paths"]["design"]
    assert all(len(src) > 40 for src in result["links"].values())
    assert result["machine"]["cpus"] and result["timings_s"]["trace gpt2 1x1024"] > 0


def test_rows_agree_with_each_other(result):
    rows = result["rows"]
    # 2 budgets x (1, 2 on one node, 4 over 2 nodes on each of 2 networks) x (runtime path, 2 policies on the design)
    assert len(rows) == 2 * 4 * 3 and rows[0]["path"] == "runtime"
    zo_budget = [r for r in rows if r["budget"] == "zero-offload"]
    assert all(r["fits"] for r in zo_budget)  # that budget is the one ZeRO-Offload's rule fits in
    for r in zo_budget:
        assert r["tokens_per_s"] == pytest.approx(r["gpus"] * r["batch"] * r["seq"] / r["step_s"])
        assert r["peak_bytes"] <= r["budget_bytes"]
    for policy in ("greedy", "zero-offload"):
        mine = {(r["gpus"], r["inter"]): r for r in zo_budget if r["policy"] == policy and r["path"] == "design"}
        assert mine[(1, None)]["efficiency"] == 1.0
        one = mine[(1, None)]["tokens_per_s"]
        for r in mine.values():  # efficiency = tokens/s at N / (N x tokens/s at 1)
            assert r["efficiency"] == pytest.approx(r["tokens_per_s"] / (r["gpus"] * one))
        # a faster network between the nodes is never slower
        assert mine[(4, "ib400")]["step_s"] <= mine[(4, "eth100")]["step_s"]
        # host bytes: per node ~1/M of the single-GPU's optimizer state, the 16-bit copy once a node
        assert mine[(2, None)]["host_bytes_per_rank"] == pytest.approx(mine[(1, None)]["host_bytes_per_rank"] / 2,
                                                                       rel=0.01)
        assert mine[(4, "ib400")]["host_bytes_per_node"] < mine[(1, None)]["host_bytes_per_node"]
        assert mine[(2, None)]["all_gather_busy_s"] > 0 and mine[(1, None)]["all_gather_busy_s"] == 0
    goals = {(g["goal"], g["path"]) for g in result["goals"]}  # no 8-GPU config here: that goal is not evaluated
    assert goals == {("never_below_zero_offload", "runtime"), ("never_below_zero_offload", "design")}


def test_the_runtime_path_beside_the_design(result):
    rows = result["rows"]
    runtime = [r for r in rows if r["path"] == "runtime"]
    design = [r for r in rows if r["path"] == "design" and r["policy"] == "greedy"]
    assert len(runtime) == len(design) == 2 * 4
    mt, buckets, *_ = trace_preset(Console(quiet=True), "gpt2", 1, 1024, scaling.BUCKET_BYTES, scaling.ITEMSIZE)
    for r, d in zip(runtime, design):
        assert (r["gpus"], r["budget"], r["inter_nics"]) == (d["gpus"], d["budget"], d["inter_nics"])
        assert r["intra"] == "gloo-loopback" and (r["inter"] is None) == (r["nodes"] == 1)
        # the runtime's own arena (one definition: report_dp): wherever a node runs several ranks the node's one
        # shared copy beside it ([Note: the runtime's shared host copy], [Note: one host copy per host])
        shared = r["gpus_per_node"] > 1
        assert r["host_copy"] == ("shared" if shared else "per rank")
        assert r["host_bytes_per_rank"] == runtime_host_bytes_per_rank(buckets, scaling.ITEMSIZE, r["gpus"], False,
                                                                       landing=False, own_copy=not shared)
        assert r["host_bytes_per_node"] == r["gpus_per_node"] * r["host_bytes_per_rank"] + r[
            "host_shared_bytes_per_node"]
        assert (r["host_shared_bytes_per_node"] > 0) == shared
        copy = r["host_bytes_per_node_per_rank_copy"] - r["host_bytes_per_node"]
        assert copy == ((r["gpus_per_node"] - 1) * r["host_shared_bytes_per_node"] if shared else 0)
        assert r["node_host_copy_bytes"] is None or r["node_host_copy_bytes"] >= r["gpus_per_node"] * r[
            "h2d_bytes_per_rank"] > 0
        assert r["fits"] == d["fits"]
        if not r["fits"]:
            continue
        if r["gpus"] == 1:  # one rank: no collective on either path, the same single-GPU step
            assert r["step_s"] == d["step_s"] and r["efficiency"] == d["efficiency"] == 1.0
            assert r["all_gather_busy_s"] == 0
        else:  # the engine's plan: grad slots padded to N shards of 16-element multiples, and over several nodes
            # two buffers of the largest padded prefix (bf16) out of the budget (worked out here by hand); on one
            # node (the shared copy) no gather buffer
            n = r["gpus"]
            slots = [-(-(-(-b.trainable_numel // n)) // 16) * 16 * n for b in buckets]
            padded = [dataclasses.replace(b, grad_padding=m - b.trainable_numel) for m, b in zip(slots, buckets)]
            gather = 0 if shared and r["nodes"] == 1 else 2 * max(slots) * scaling.ITEMSIZE
            hw = PRESETS[r["hw"]]
            engine = build_plan(mt.trace, padded, itemsize=scaling.ITEMSIZE, budget_bytes=r["budget_bytes"],
                                fixed_bytes=mt.buffer_bytes + gather, hw=hw, compute_s=mt.compute_s(hw))
            assert r["peak_bytes"] == engine.peak_bytes <= r["budget_bytes"]
        if r["gpus"] > 1:
            assert r["host_bytes_per_rank"] > d["host_bytes_per_rank"] or shared
            # grads reduce-scattered on the device; the weights all-gathered there but on one node with a shared
            # copy, which has one check of it per backward instead; gloo's collectives never
            assert (r["device_gather_busy_s"] > 0) == (not shared or r["nodes"] > 1) and r["device_reduce_busy_s"] > 0
            assert r["check_busy_s"] > 0
            assert r["all_gather_busy_s"] == r["reduce_scatter_busy_s"] == 0
            assert r["tokens_per_s"] == pytest.approx(r["gpus"] * r["batch"] * r["seq"] / r["step_s"])
