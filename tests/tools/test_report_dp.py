"""``offload report --gpus N [--nodes M]`` (issue 20): per-rank device and host bytes, per-node host bytes
and the predicted step with the collectives, in the JSON and the table, for the path the runtime runs (flat
keys) beside the design's (``*_design``); bad cluster shapes are usage errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from offload.planning.hw import PRESETS
from offload.planning.schedule import build_plan
from offload.tools import cli
from offload.tools.report import make_report
from offload.tools.report_dp import data_parallel
from offload.tools.report_model import Request


def _json(capsys, *extra):
    rc = cli.main(["report", "--model", "gpt2", "--budget", "4GiB", "--host-ram", "64GiB", "--json", *extra])
    return rc, json.loads(capsys.readouterr().out)


def test_report_gpus_json(capsys):
    rc, one = _json(capsys)
    assert rc == 0 and "data_parallel" not in one
    rc, out = _json(capsys, "--gpus", "16", "--nodes", "2", "--inter", "ib400")
    assert rc == 0
    dp = out["data_parallel"]
    assert (dp["gpus"], dp["nodes"], dp["gpus_per_node"], dp["intra"], dp["inter"]) == (16, 2, 8, "nvlink3", "ib400")
    assert (dp["gloo_intra"], dp["gloo_inter"]) == ("gloo-loopback", "gloo-ipoib-400")
    assert dp["simulated"].startswith("cost model") and dp["runs"].startswith("runtime")
    assert set(dp["links"]) == {"nvlink3", "ib400", "gloo-loopback", "gloo-ipoib-400"}
    # the runtime path: each rank runs the single-GPU plan, here with grads and weights on the device, so planned
    # with the weights' gather buffers out of the budget (test_report_gpus_device_peak_counts_... below)
    assert dp["fits"] and dp["device_peak_bytes_per_rank"] <= out["budget_bytes"]
    assert dp["weight_gather_bytes_per_rank"] > 0 and "gather buffers" in dp["device_peak_note"]
    assert dp["fits_design"] and dp["device_peak_bytes_per_rank_design"] <= out["budget_bytes"]
    # the simulated design: optimizer state 1/16 a rank, the 16-bit copy 1/8 a rank (once a node): between 1/16
    # and 1/8 of one GPU's
    host = one["host_bytes"]["total"]
    assert host / 16 < dp["host_bytes_per_rank_design"] < host / 8
    assert dp["host_bytes_per_node_design"] == 8 * dp["host_bytes_per_rank_design"]
    # the runtime today (equal to what gloo ranks allocate: tests/distributed), grads reduced on the device: 1/16
    # of the master, m, v and grad shard (14 B/param) a rank, and one 16-bit copy a node, 2 B/param ([Note: one
    # host copy per host])
    copy = dp["host_shared_bytes_per_node"]
    assert dp["host_copy"] == "shared" and dp["host_bytes_per_node"] == 8 * dp["host_bytes_per_rank"] + copy
    assert 0.8 * one["trainable_params"] < dp["host_bytes_per_rank"] < 1.0 * one["trainable_params"]
    assert 2 * one["trainable_params"] <= copy < 2.1 * one["trainable_params"]
    # what runs on CUDA with overlapped updates: grads reduce-scattered and weights all-gathered on the device,
    # neither on the CPU lane
    assert dp["grad_reduce"] == "device" and dp["device_reduce_busy_s"] > 0 and dp["reduce_scatter_busy_s"] == 0
    assert dp["predicted_step_s"] > 0 and dp["device_gather_busy_s"] > 0 and dp["all_gather_busy_s"] == 0
    assert dp["check_busy_s"] > 0 and dp["runtime_note"] is None
    assert dp["tokens_per_s"] == pytest.approx(16 * out["batch"] * out["seq"] / dp["predicted_step_s"])
    # the CPU lane runs the collectives and the AdamW one after the other: the step is at least their sum
    assert dp["predicted_step_s"] > dp["all_gather_busy_s"] + dp["reduce_scatter_busy_s"] + dp["check_busy_s"]
    assert dp["predicted_step_s_design"] > 0 and dp["all_gather_busy_s_design"] > 0
    assert dp["tokens_per_s_design"] == pytest.approx(16 * out["batch"] * out["seq"] / dp["predicted_step_s_design"])
    assert dp["zero_offload_step_s"] > 0


def test_report_gpus_float16_gives_the_deferred_runtime_path(capsys):
    # float16 defers the updates to step(): the deferred path's figure, one backward per step whose end
    # all-reduces every bucket's grads ([Note: the runtime's deferred data-parallel step])
    rc, out = _json(capsys, "--gpus", "2", "--dtype", "fp16")
    dp = out["data_parallel"]
    assert rc == 0 and dp["fits"] and dp["runtime_path"] == "deferred" and dp["micro_batches"] == 1
    assert dp["predicted_step_s"] > 0 and dp["all_reduce_busy_s"] > 0
    # one node: the shared host copy, step()'s updates write into it and check, nothing is all-gathered
    assert dp["host_copy"] == "shared" and dp["all_gather_busy_s"] == 0 and "shared 16-bit copy" in dp["runtime_note"]
    rc, own = _json(capsys, "--gpus", "2", "--dtype", "fp16", "--share-host-copy", "no")
    own = own["data_parallel"]
    assert rc == 0 and own["host_copy"] == "per rank" and own["all_gather_busy_s"] > 0
    assert "all-gathers the 16-bit copy" in own["runtime_note"]
    assert own["predicted_step_s"] > dp["predicted_step_s"]
    assert dp["accumulate_busy_s"] > 0  # float16 grads widened into the fp32 sums
    assert "deferred" in dp["runtime_note"] and dp["predicted_step_s_design"] > 0
    assert dp["grad_reduce"] == "host" and dp["device_reduce_busy_s"] == 0  # deferred: every collective on the host
    assert dp["tokens_per_s"] == pytest.approx(2 * out["batch"] * out["seq"] / dp["predicted_step_s"])
    # the CPU lane's serial work (the end of backward's all-reduces, step()'s updates and all-gathers) is in it
    assert dp["predicted_step_s"] > dp["all_reduce_busy_s"] + dp["all_gather_busy_s"] + dp["check_busy_s"]
    rc, bf16 = _json(capsys, "--gpus", "2")
    assert bf16["data_parallel"]["runtime_path"] == "overlapped" and bf16["data_parallel"]["all_reduce_busy_s"] == 0
    assert cli.main(["report", "--model", "gpt2", "--budget", "4GiB", "--host-ram", "64GiB", "--gpus", "2",
                     "--dtype", "fp16"]) == 0
    text = capsys.readouterr().out
    step_row = next(line for line in text.splitlines() if "step (with collectives)" in line)
    assert "all-reduce per backward" in text and "not modelled" not in step_row and step_row.count(" s ") >= 2


def test_report_gpus_table_and_usage_errors(capsys):
    assert cli.main(["report", "--model", "gpt2", "--budget", "4GiB", "--host-ram", "64GiB", "--gpus", "4"]) == 0
    text = capsys.readouterr().out
    assert "data parallel on 4 GPUs" in text and "SIMULATED" in text and "pinned host per node" in text
    assert "runtime path (what runs)" in text and "design path" in text and "gloo-loopback" in text
    # one node: the ranks share the host copy, so nothing is gathered on the device and no buffer is named
    assert "one shared by the node's ranks" in text and "gather buffers" not in text
    assert "none / 0.0" in text and "checks busy" in text  # no all-gather of the weights; the checks instead
    assert "each grad slot padded to its shards" in text and "one shared copy" in text
    assert cli.main(["report", "--model", "gpt2", "--budget", "4GiB", "--host-ram", "64GiB", "--gpus", "4",
                     "--share-host-copy", "no"]) == 0
    text = capsys.readouterr().out
    assert "one per rank" in text and "one shared" not in text
    assert "device peak per rank (with the gather buffers)" in text and "of which weights' gather buffers" in text
    assert "each grad slot padded to its shards" in text
    assert cli.main(["report", "--model", "gpt2", "--budget", "4GiB", "--gpus", "6", "--nodes", "4"]) == 2
    assert "evenly" in capsys.readouterr().err
    assert cli.main(["report", "--model", "gpt2", "--budget", "4GiB", "--gpus", "2", "--intra", "nvlink9"]) == 2


def test_report_gpus_with_micro_batches_gives_the_deferred_path_per_step_of_k(capsys):
    # K micro-batches a step: the deferred path (overlap_optimizer=False), tokens of all K, every synced backward
    # all-reduces; no_sync leaves that to the last; the design path and ZeRO-Offload's rule are not modelled
    rc, one = _json(capsys, "--gpus", "2")
    rc4, four = _json(capsys, "--gpus", "2", "--micro-batches", "4")
    rcn, nosync = _json(capsys, "--gpus", "2", "--micro-batches", "4", "--no-sync")
    assert rc == rc4 == rcn == 0
    one, four, nosync = one["data_parallel"], four["data_parallel"], nosync["data_parallel"]
    assert four["runtime_path"] == nosync["runtime_path"] == "deferred" and four["micro_batches"] == 4
    assert (four["no_sync"], nosync["no_sync"]) == (False, True) and "4 forward and backward" in four["runtime_note"]
    assert four["tokens_per_s"] == pytest.approx(2 * 4 * 1024 / four["predicted_step_s"])  # batch 1, seq 1024
    assert four["host_bytes_per_rank"] > one["host_bytes_per_rank"]  # the fp32 grad sums on the host
    assert four["all_reduce_busy_s"] == pytest.approx(4 * nosync["all_reduce_busy_s"])
    assert four["predicted_step_s"] > nosync["predicted_step_s"] > one["predicted_step_s"]
    for dp in (four, nosync):
        assert dp["design_note"] and dp["fits_design"] is None and dp["predicted_step_s_design"] is None
        assert dp["zero_offload_step_s"] is None
    assert one["design_note"] is None and one["fits_design"] and one["micro_batches"] == 1
    assert cli.main(["report", "--model", "gpt2", "--budget", "4GiB", "--host-ram", "64GiB", "--gpus", "2",
                     "--micro-batches", "4", "--no-sync"]) == 0
    text = capsys.readouterr().out
    assert "4 micro-batches a step (no_sync on all but the last)" in text and "not modelled" in text
    # asked where it cannot apply, or nonsense: a usage error, never ignored
    for bad in (["--micro-batches", "2"], ["--gpus", "2", "--no-sync"], ["--gpus", "2", "--micro-batches", "0"]):
        assert cli.main(["report", "--model", "gpt2", "--budget", "4GiB", *bad]) == 2
        assert "--micro-batches" in capsys.readouterr().err


def test_report_gpus_grad_reduce_host_and_its_usage_errors(capsys):
    # --grad-reduce host: the whole buckets' grads land on the host (2 B/param more per rank in bf16) and gloo
    # reduce-scatters them there on the CPU lane; the default reduces them on the device
    rc, device = _json(capsys, "--gpus", "2", "--share-host-copy", "no")  # each rank's own copy, all-gathered
    rc2, host = _json(capsys, "--gpus", "2", "--grad-reduce", "host", "--share-host-copy", "no")
    assert rc == rc2 == 0
    d, h = device["data_parallel"], host["data_parallel"]
    assert (d["grad_reduce"], h["grad_reduce"]) == ("device", "host")
    assert d["device_reduce_busy_s"] > 0 and not h["device_reduce_busy_s"] and h["reduce_scatter_busy_s"] > 0
    assert d["device_gather_busy_s"] > 0 and not h["device_gather_busy_s"] and h["all_gather_busy_s"] > 0
    assert h["weight_gather_bytes_per_rank"] is None and h["device_peak_note"] is None  # the single-GPU plan
    assert h["device_peak_bytes_per_rank"] == host["plan"]["planned_peak_bytes"]
    params = device["trainable_params"]
    assert 2 * params <= h["host_bytes_per_rank"] - d["host_bytes_per_rank"] < 2.1 * params
    # where it cannot apply: one GPU, or deferred updates (float16) on the device
    assert cli.main(["report", "--model", "gpt2", "--budget", "4GiB", "--grad-reduce", "host"]) == 2
    assert "--grad-reduce" in capsys.readouterr().err
    assert cli.main(["report", "--model", "gpt2", "--budget", "4GiB", "--host-ram", "64GiB", "--gpus", "2",
                     "--dtype", "fp16", "--grad-reduce", "device"]) == 2
    assert "overlapped updates" in capsys.readouterr().err


def test_report_gpus_device_peak_counts_the_gather_buffers_and_the_padding():
    """With grads and weights on the device the engine plans each rank with its grad slots padded to the shards
    and the weights' two gather buffers out of the budget: the report's device peak is that plan's, worked out
    here from the padding rule ([Note: host shards]: ``ceil(n / N)`` rounded up to 16 elements, times N).
    The host path's peak is the single-GPU plan's (test_report_gpus_grad_reduce_host_...)."""
    report = make_report(Request(model="gpt2", budget_bytes=4 << 30, batch=1, seq=1024, dtype=torch.bfloat16,
                                 hw=PRESETS["pcie4"], host_ram_bytes=64 << 30, host_ram_source="given",
                                 bucket_bytes="auto"))
    plan = report.plan
    # 5: gpt2 prefixes (multiples of 384) need padding; each rank's own host copy: the weights gathered on the device
    dp = data_parallel(report, 5, 1, "nvlink3", "ib200", share_host_copy="no")
    slots = [-(-(-(-b.trainable_numel // 5)) // 16) * 16 * 5 for b in plan.buckets]
    assert any(n > b.trainable_numel for n, b in zip(slots, plan.buckets))  # some padding to plan with
    gather = 2 * max(slots) * 2  # two buffers of the largest padded prefix, in bf16
    assert dp["weight_gather_bytes_per_rank"] == gather
    padded = [dataclasses.replace(b, grad_padding=n - b.trainable_numel) for n, b in zip(slots, plan.buckets)]
    engine = build_plan(plan.trace, padded, itemsize=2, budget_bytes=4 << 30, fixed_bytes=plan.fixed_bytes + gather,
                        hw=PRESETS["pcie4"], compute_s=report.compute_s)
    assert dp["device_peak_bytes_per_rank"] == engine.peak_bytes <= 4 << 30
    assert engine.peak_bytes >= engine.arena_bytes + gather  # the buffers are in the peak, outside the arena
    assert dp["device_peak_bytes_per_rank"] > plan.peak_bytes  # the single-GPU plan's peak has neither
    # where the buffers and the padding do not fit, the device path says so and gives no figure
    tight = make_report(dataclasses.replace(report.request, budget_bytes=report.min_budget_bytes))
    assert tight.fits
    squeezed = data_parallel(tight, 5, 1, "nvlink3", "ib200", share_host_copy="no")
    assert not squeezed["fits"] and squeezed["predicted_step_s"] is None
    assert "does not fit the budget" in squeezed["runtime_note"]


def test_report_gpus_shares_the_host_copy_on_one_node(capsys):
    """The engine's default on one node ([Note: the runtime's shared host copy]): one host copy for the node, no
    all-gather of the weights (neither on the device nor by gloo), no gather buffers in the plan; across nodes
    one copy per node too, the column's shards gathered on the device (its gather buffers in the plan: [Note:
    one host copy per host]); with --share-host-copy no each rank's own copy as before. The JSON and the table
    say which."""
    rc, shared = _json(capsys, "--gpus", "8")
    rc2, own = _json(capsys, "--gpus", "8", "--share-host-copy", "no")
    rc3, nodes = _json(capsys, "--gpus", "16", "--nodes", "2")
    assert rc == rc2 == rc3 == 0
    s, o, n = shared["data_parallel"], own["data_parallel"], nodes["data_parallel"]
    assert (s["host_copy"], o["host_copy"], n["host_copy"]) == ("shared", "per rank", "shared")
    assert s["grad_reduce"] == o["grad_reduce"] == "device"
    assert s["device_gather_busy_s"] == 0 and s["all_gather_busy_s"] == 0 and o["device_gather_busy_s"] > 0
    assert s["device_reduce_busy_s"] == pytest.approx(o["device_reduce_busy_s"], rel=0.2)
    assert s["check_busy_s"] > o["check_busy_s"]  # the check that the shared copy is whole, once per backward
    # the step is not asserted faster: on the device path the CPU lane (the AdamW) loses nothing (the gather ran
    # on the device and the copy lanes) and the step gains that check; the saving is host and device memory
    assert s["predicted_step_s"] > 0 and o["predicted_step_s"] > 0
    # no gather buffers: planned with the padded grad slots alone, so within the budget at no more device peak
    assert s["weight_gather_bytes_per_rank"] == 0 and o["weight_gather_bytes_per_rank"] > 0
    assert "gather buffers" not in s["device_peak_note"] and "gather buffers" in o["device_peak_note"]
    assert s["device_peak_bytes_per_rank"] <= o["device_peak_bytes_per_rank"] <= shared["budget_bytes"]
    # host bytes: the rank's arena less its copy, the node's one copy beside them; 7 copies fewer on 8 GPUs
    copy = s["host_shared_bytes_per_node"]
    assert copy >= 2 * shared["trainable_params"] and o["host_shared_bytes_per_node"] == 0
    assert s["host_bytes_per_node"] == 8 * s["host_bytes_per_rank"] + copy
    assert o["host_bytes_per_rank"] - s["host_bytes_per_rank"] == copy
    assert o["host_bytes_per_node"] - s["host_bytes_per_node"] == 7 * copy
    # two nodes: one copy per node (each node's 8 ranks hold what one node's do), gathered on the device
    assert n["host_shared_bytes_per_node"] == copy and n["weight_gather_bytes_per_rank"] > 0
    assert n["host_bytes_per_node"] == 8 * n["host_bytes_per_rank"] + copy
    assert n["device_gather_busy_s"] > 0 and "gather buffers" in n["device_peak_note"]
    rc4, own_nodes = _json(capsys, "--gpus", "16", "--nodes", "2", "--share-host-copy", "no")
    assert own_nodes["data_parallel"]["host_bytes_per_node"] - n["host_bytes_per_node"] == 7 * copy
    assert cli.main(["report", "--model", "gpt2", "--budget", "4GiB", "--host-ram", "64GiB", "--gpus", "2",
                     "--nodes", "2", "--share-host-copy", "yes"]) == 2
    assert "nothing to share" in capsys.readouterr().err
