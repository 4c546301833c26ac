"""benchmarks/scaling.py on a small model (issue 20): both data paths side by side in the JSON, the runtime's
(what runs) first and named as such, each with its own host bytes (the runtime's arena for the runtime path)
and its own efficiency at 8 GPUs on one node; labelled SIMULATED."""

from __future__ import annotations

import json

import scaling  # benchmarks/ is on sys.path (pyproject's pytest `pythonpath`)

from offload.tools.report_dp import runtime_host_bytes_per_rank


def test_scaling_writes_both_paths(tmp_path, capsys):
    path = tmp_path / "scaling.json"
    assert scaling.main(["--models", "gpt2:1:256", "--hw", "pcie4", "--configs", "1,2,8,16/2", "--inter", "eth100",
                         "--json", str(path)]) == 0
    text = capsys.readouterr().out
    assert "The code runs the runtime path" in text and "NOT what runs" in text
    out = json.loads(path.read_text())
    assert out["label"].startswith("SIMULATED") and out["runs"] == "runtime" and list(out["paths"]) == ["runtime", "design"]
    rows = out["rows"]
    runtime = [r for r in rows if r["path"] == "runtime"]
    design = [r for r in rows if r["path"] == "design" and r["policy"] == "greedy"]
    assert rows[0]["path"] == "runtime" and len(runtime) == len(design) == 2 * 4  # 2 budgets x 4 clusters
    for r in runtime:
        assert r["intra"] == "gloo-loopback" and (r["inter"] == "gloo-tcp-eth100") == (r["nodes"] > 1)
        assert r["host_bytes_per_rank"] == runtime_host_bytes_per_rank_of(r)
        assert r["host_bytes_per_node"] == r["gpus_per_node"] * r["host_bytes_per_rank"]
    for r, d in zip(runtime, design):
        assert (r["gpus"], r["budget"]) == (d["gpus"], d["budget"])
        assert r["fits"] == d["fits"] and (r["fits"] or r["budget"] != "zero-offload")  # ZO-min fits both
        if not r["fits"]:
            continue
        if r["gpus"] == 1:  # one rank: no collective on either path, the same single-GPU step
            assert r["step_s"] == d["step_s"] and r["efficiency"] == d["efficiency"] == 1.0
        else:
            assert r["host_bytes_per_rank"] > d["host_bytes_per_rank"]  # the whole copy on every rank
    goals = [g for g in out["goals"] if g["goal"] == "efficiency_8_gpus_one_node"]
    assert sorted(g["path"] for g in goals if g["budget"] == "zero-offload") == ["design", "runtime"]


def runtime_host_bytes_per_rank_of(row: dict) -> int:
    _, buckets, *_ = scaling_trace()
    return runtime_host_bytes_per_rank(buckets, scaling.ITEMSIZE, row["gpus"], False)


_TRACE: list = []


def scaling_trace():
    if not _TRACE:
        from rich.console import Console

        from common import trace_preset
        _TRACE.append(trace_preset(Console(quiet=True), "gpt2", 1, 256, scaling.BUCKET_BYTES, scaling.ITEMSIZE))
    return _TRACE[0]
