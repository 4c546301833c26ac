"""``offload report --gpus N [--nodes M]`` (issue 20): per-rank device and host bytes, per-node host bytes
and the predicted step with the collectives, in the JSON and the table, for the path the runtime runs (flat
keys) beside the design's (``*_design``); bad cluster shapes are usage errors."""

from __future__ import annotations

import json

import pytest

from offload.tools import cli


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
    # the runtime path: each rank runs the single-GPU plan
    assert dp["fits"] and dp["device_peak_bytes_per_rank"] == out["plan"]["planned_peak_bytes"] <= out["budget_bytes"]
    assert dp["fits_design"] and dp["device_peak_bytes_per_rank_design"] <= out["budget_bytes"]
    # the simulated design: optimizer state 1/16 a rank, the 16-bit copy 1/8 a rank (once a node): between 1/16
    # and 1/8 of one GPU's
    host = one["host_bytes"]["total"]
    assert host / 16 < dp["host_bytes_per_rank_design"] < host / 8
    assert dp["host_bytes_per_node_design"] == 8 * dp["host_bytes_per_rank_design"]
    # the runtime today (equal to what gloo ranks allocate: tests/distributed): the whole 16-bit copy and landing
    # grad on every rank, 2 + 2 B/param, and 1/16 of the master, m, v and summed grad
    assert dp["host_bytes_per_node"] == 8 * dp["host_bytes_per_rank"]
    assert 4 * one["trainable_params"] < dp["host_bytes_per_rank"] < 5 * one["trainable_params"]
    assert dp["predicted_step_s"] > 0 and dp["all_gather_busy_s"] > 0 and dp["reduce_scatter_busy_s"] > 0
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
    assert dp["predicted_step_s"] > 0 and dp["all_reduce_busy_s"] > 0 and dp["all_gather_busy_s"] > 0
    assert dp["accumulate_busy_s"] > 0  # float16 grads widened into the fp32 sums
    assert "deferred" in dp["runtime_note"] and dp["predicted_step_s_design"] > 0
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
    assert cli.main(["report", "--model", "gpt2", "--budget", "4GiB", "--gpus", "6", "--nodes", "4"]) == 2
    assert "evenly" in capsys.readouterr().err
    assert cli.main(["report", "--model", "gpt2", "--budget", "4GiB", "--gpus", "2", "--intra", "nvlink9"]) == 2
