"""benchmarks/scaling_cpu.py in a tiny configuration (1 and 2 gloo ranks): the harness runs, labels its numbers
measured, simulates the same runs beside them, and its figures agree with each other (samples/s from the step
time, the error from both steps, a rank's host arena smaller with two ranks). It checks the harness, not the
machine's speed."""

from __future__ import annotations

import json

import pytest
import scaling_cpu  # benchmarks/ is on sys.path (pyproject's pytest `pythonpath`)


@pytest.mark.slow
def test_scaling_cpu_smoke(tmp_path):
    path = tmp_path / "scaling_cpu.json"
    rc = scaling_cpu.main(["--ranks", "1,2", "--width", "64", "--depth", "2", "--batch", "4", "--steps", "2",
                           "--warmup", "1", "--budget", "1MiB", "--bucket", "8KiB", "--json", str(path)])
    assert rc == 0
    result = json.loads(path.read_text())
    assert result["kind"] == "measured" and result["machine_before"]["logical_cpus"]
    one, two = result["rows"]
    for r in (one, two):
        assert r["samples_per_s"] == pytest.approx(r["ranks"] * 4 / r["median_step_s"])
        assert len(r["step_s"]) == 2
        # the simulation of the same run beside it (rank 0's plan), its error computed from the two
        assert r["predicted_step_s"] > 0 and r["buckets"] >= 1
        assert r["relative_error"] == pytest.approx((r["predicted_step_s"] - r["median_step_s"]) / r["median_step_s"])
    assert one["predicted_all_gather_s"] == 0  # one rank: no collective
    # two ranks on one host share one host copy by default: simulated so, one check of it and no all-gather
    assert (one["host_copy"], two["host_copy"]) == ("per rank", "shared") and two["host_shared_bytes"] > 0
    assert two["simulated_host_copy"] == "shared" and two["predicted_all_gather_s"] == 0
    assert two["predicted_check_s"] > 0
    # the runtime's path is the one simulated (the design's beside it); one rank: the two are the same step
    assert result["simulated_path"].startswith("runtime") and one["path"] == two["path"] == "runtime"
    assert one["predicted_step_s"] == one["predicted_step_s_design"]
    assert two["predicted_cpu_lane_s"] >= two["predicted_all_gather_s"] + two["predicted_reduce_scatter_s"]
    assert set(two["measured_8MiB_s"]) == set(two["modelled_8MiB_s"]) == {"all_reduce", "reduce_scatter", "all_gather"}
    assert all(v > 0 for v in (*two["measured_8MiB_s"].values(), *two["modelled_8MiB_s"].values()))
    assert two["gloo_bytes_per_s"] > 0 and one["gloo_bytes_per_s"] is None
    assert two["host_bytes_per_rank"] < one["host_bytes_per_rank"]


@pytest.mark.slow
def test_scaling_cpu_smoke_with_a_copy_per_rank(tmp_path):
    """--share-host-copy no: each rank its own copy, gloo's all-gather per bucket, simulated so."""
    path = tmp_path / "scaling_cpu.json"
    rc = scaling_cpu.main(["--ranks", "2", "--width", "64", "--depth", "2", "--batch", "4", "--steps", "2",
                           "--warmup", "1", "--budget", "1MiB", "--bucket", "8KiB", "--share-host-copy", "no",
                           "--json", str(path)])
    assert rc == 0
    (two,) = json.loads(path.read_text())["rows"]
    assert two["host_copy"] == two["simulated_host_copy"] == "per rank" and two["host_shared_bytes"] == 0
    assert two["predicted_all_gather_s"] > 0
