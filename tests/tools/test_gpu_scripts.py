"""The GPU machine's scripts (benchmarks/gpu_lease.sh, gpu_check.sh, gpu_bench.sh, gpu_setup.sh, gpu_followup.sh) run on a GPU
only when a lease is lent, which is rare and short: a script broken here is a lease lost there. So they are
checked on the CPU: their syntax always, and (marked `slow`) one whole dry run of gpu_lease.sh, a GPU test file
that skips here and the tiny smoke case of the benchmark, with the tarballs the device tool would bring back.
Skipped GPU tests verify nothing: the dry run's test parts (and so the lease) must say FAIL."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("gpu_lease.sh", "gpu_check.sh", "gpu_bench.sh", "gpu_setup.sh", "gpu_followup.sh")


@pytest.mark.parametrize("name", SCRIPTS)
def test_gpu_script_parses(name):
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / name)], check=True)


@pytest.mark.slow
def test_gpu_lease_dry_run_brings_back_every_part_and_fails_on_skips(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(os.environ, RESULTS=str(out), WORK=str(work), SKIP_BUILD="1", TEST_DEADLINE="120",
               TEST_PATHS="tests/backend/test_cuda.py", CASES="tiny-gpt@768KiB", DEADLINE="300",
               BENCH_ARGS="--smoke --no-skip --systems offload,torch")
    run = subprocess.run(["bash", "benchmarks/gpu_lease.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["bench.tar.gz", "check.tar.gz", "dp.tar.gz", "summary.txt"]
    summary = (out / "summary.txt").read_text()
    assert "check: exit status 1" in summary and "bench: exit status 0" in summary, summary
    assert "dp: exit status 1" in summary, summary  # test_cuda_ranks.py's 5 CUDA tests skip here
    assert "gpu tests skipped" in summary and "test_cuda_ranks.py: 0 of 5 gpu tests passed" in summary, summary
    assert summary.rstrip().endswith("lease verdict (tests): FAIL (check 1, dp 1)"), summary
    with tarfile.open(out / "check.tar.gz") as t:
        names = set(t.getnames())
        assert {"check/tests.log", "check/junit.xml", "check/env.json", "check/summary.txt"} <= names, names
        env_json = json.load(t.extractfile("check/env.json"))
    with tarfile.open(out / "dp.tar.gz") as t:
        assert {"dp/tests.log", "dp/tests_gpu.log", "dp/summary.txt"} <= set(t.getnames())
    assert env_json["command"].startswith("RESULTS=$OUT bash benchmarks/gpu_lease.sh")
    with tarfile.open(out / "bench.tar.gz") as t:
        result = json.load(t.extractfile("bench/vs_baselines.json"))
    runs = {r["system"]: r for r in result["runs"]}
    assert runs["offload"]["ok"] and runs["torch"]["ok"], runs


@pytest.mark.slow
def test_gpu_followup_dry_run_brings_back_one_tarball_per_variant_with_its_threads(tmp_path):
    """gpu_followup.sh: each variant's run in its own tarball, its environment in the result's machine record; an
    unknown variant is said, not run."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(os.environ, RESULTS=str(out), WORK=str(work), SKIP_BUILD="1", CASES="tiny-gpt@768KiB", HW="pcie5",
               VARIANTS="default,threads1,passive,bogus", EXTRA_ARGS="--smoke --no-skip")
    for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY"):
        env.pop(k, None)
    run = subprocess.run(["bash", "benchmarks/gpu_followup.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["default.tar.gz", "passive.tar.gz", "summary.txt",
                                                     "threads1.tar.gz"]
    summary = (out / "summary.txt").read_text()
    assert "unknown variant bogus" in summary, summary
    seen = {}
    for variant in ("default", "threads1", "passive"):
        assert f"{variant} (" in summary and "tiny-gpt-768KiB-offload: ok" in summary, summary
        with tarfile.open(out / f"{variant}.tar.gz") as t:
            names = set(t.getnames())
            assert {f"{variant}/vs_baselines.log", f"{variant}/profiles/tiny-gpt-768KiB-offload.json.gz"} <= names
            result = json.load(t.extractfile(f"{variant}/vs_baselines.json"))
        assert [r["status"] for r in result["runs"] if r["system"] == "offload"] == ["ok"], result["runs"]
        seen[variant] = (result["machine"]["omp_env"], result["machine"]["torch_threads"])
    assert seen["default"][0] == {} and seen["passive"][0] == {"OMP_WAIT_POLICY": "passive"}
    assert seen["threads1"] == ({"OMP_NUM_THREADS": "1"}, 1)
