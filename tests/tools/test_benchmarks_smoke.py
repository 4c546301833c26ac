"""The baseline benchmark harness (benchmarks/vs_baselines.py, max_model.py, plot.py) in its smoke mode:
tiny models on the CPU, every system's run in its own process, so the harness cannot rot while no GPU is
around. These check that the harness measures and records, not what it measures."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import bench_runner  # benchmarks/ is on sys.path (pyproject's pytest `pythonpath`)
import bench_systems
import max_model
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
import plot
import vs_baselines

KEYS = {"system", "model", "budget_bytes", "ok", "step_s", "tokens_per_s", "tflops", "peak_gpu_bytes",
        "peak_host_bytes", "error"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    d = tmp_path_factory.mktemp("vs")
    path = d / "vs.json"
    # --no-skip: plain torch's 16 B/param do not fit this budget, but nothing enforces one on the CPU, and
    # the test wants a baseline that really runs through its child process.
    rc = vs_baselines.main(["--smoke", "--cases", "tiny-gpt@768KiB", "--no-skip", "--json", str(path),
                            "--profile", str(d / "prof"), "--logs", str(d / "logs")])
    assert rc == 0
    return json.loads(path.read_text()), d


def test_smoke_records_every_system(smoke):
    data, _ = smoke
    assert data["benchmark"] == "vs_baselines" and data["smoke"]
    assert data["machine"]["versions"]["torch"] and data["machine"]["command"]
    runs = {r["system"]: r for r in data["runs"]}
    assert set(runs) == set(bench_systems.SYSTEMS)
    for r in data["runs"]:
        assert KEYS <= set(r), r["system"]
        assert r["budget_bytes"] == 768 * 2**10 and r["model"] == "tiny-gpt"
        assert r["ok"] == (r["status"] == "ok")
        assert r["ok"] or r["error"], f"{r['system']} failed without saying why"
    assert runs["gemini"]["status"] == "not_installed" and "colossalai" in runs["gemini"]["error"]
    for ds in ("zero_offload", "zero3_offload", "twinflow"):
        assert runs[ds]["status"] in ("not_runnable", "not_installed")
    ratios = [r["twinflow_ratio"] for r in data["runs"] if r["system"] == "twinflow"]
    assert ratios == [float(x) for x in vs_baselines.TWINFLOW_RATIOS.split(",")]  # none ran: all tried
    if importlib.util.find_spec("torchao") is None:
        assert runs["torchao"]["status"] == "not_installed"
    else:  # it really ran, and its own error is recorded
        assert runs["torchao"]["status"] == "error" and "CUDA" in runs["torchao"]["error"]


def test_smoke_figures_are_consistent(smoke):
    data, d = smoke
    runs = {r["system"]: r for r in data["runs"]}
    params = sum(p.numel() for p in vs_baselines.SMOKE_MODELS["tiny-gpt"][0].build("meta").parameters())
    for name in ("offload", "torch"):
        r = runs[name]
        assert r["ok"], r.get("log_tail")
        assert r["params"] == params
        assert len(r["step_times_s"]) == 2 and r["step_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["seq"] / r["step_s"])
        assert r["tflops"] == pytest.approx(6 * params * r["tokens_per_s"] / 1e12)
        assert r["peak_host_bytes"] > 50 * 2**20  # a Python process with torch in it
        assert not r["budget_enforced"]  # nothing enforces a budget on the CPU
        assert (d / "logs" / f"tiny-gpt-768KiB-{name}.log").exists()
    ours = runs["offload"]
    assert 0 < ours["peak_gpu_bytes"] <= ours["budget_bytes"]  # the CPU backend's accounted device peak
    assert ours["details"]["host_pinned_bytes"] > 0
    assert ours["details"]["least_traffic"]["h2d"] > 0
    assert ours["details"]["predicted_step_s"] > 0 and ours["details"]["predicted_step_s_hw"] > 0
    # the bound: measured compute (the calibration child) and the plan's least traffic, from the file alone
    (cal,) = data["calibration"]
    assert cal["system"] == "compute" and cal["ok"] and cal["step_s"] > 0
    b = ours["bound"]
    assert b["parts"]["compute"] == pytest.approx(cal["step_s"])
    assert b["seconds"] == pytest.approx(max(b["parts"].values())) and b["limit"] in b["parts"]
    assert b["hw"] == "pcie5" and b["hw_measured"] is False
    assert ours["step_over_bound"] == pytest.approx(ours["step_s"] / b["seconds"])
    assert runs["torch"]["peak_gpu_bytes"] is None  # no GPU, no figure (not a zero)


def test_smoke_profile_trace(smoke):
    data, d = smoke
    ours = next(r for r in data["runs"] if r["system"] == "offload")
    trace = json.loads(gzip.decompress(Path(ours["profile"]).read_bytes()))
    names = {e.get("name") for e in trace["traceEvents"]}
    assert any(n and n.startswith("aten::") for n in names)
    assert (d / "prof" / "tiny-gpt-768KiB-offload.txt").read_text().strip()


def test_plot_markdown_from_smoke(smoke, tmp_path):
    data, d = smoke
    assert plot.main([str(d / "vs.json"), "--out", str(tmp_path), "--no-png"]) == 0
    md = (tmp_path / "results.md").read_text()
    assert "smoke run" in md and "| tiny-gpt | 768 KiB |" in md
    ours = next(r for r in data["runs"] if r["system"] == "offload")
    torch_ = next(r for r in data["runs"] if r["system"] == "torch")
    assert f"{ours['tokens_per_s']:.0f}" in md
    assert f"| tiny-gpt | 768 KiB | torch | {ours['tokens_per_s'] / torch_['tokens_per_s']:.2f}x |" in md
    assert "(not_installed)" in md and "**not_installed** colossalai" in md


def _run(system, model, budget, ok, tps, status="ok", **extra):
    return {"system": system, "model": model, "budget_bytes": budget, "ok": ok, "status": status,
            "step_s": 2048 / tps if tps else None, "tokens_per_s": tps, "tflops": None, "peak_gpu_bytes": None,
            "peak_host_bytes": None, "error": None if ok else "CUDA out of memory", **extra}


def test_plot_markdown_goals(tmp_path):
    g = 2**30
    runs = [_run("offload", "gpt2-xl", 8 * g, True, 3000.0, step_over_bound=1.1, bound={"limit": "cpu_adam"}),
            _run("zero_offload", "gpt2-xl", 8 * g, True, 1500.0), _run("zero3_offload", "gpt2-xl", 8 * g, True, 2000.0),
            _run("torchao", "gpt2-xl", 8 * g, False, None, status="oom")]
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"benchmark": "vs_baselines", "machine": {}, "settings": {}, "runs": runs}))
    m = tmp_path / "m.json"
    m.write_text(json.dumps({"benchmark": "max_model", "machine": {}, "host_ram_bound": {
        "host_ram_bytes": 128 * g, "bytes_per_param": 18.0, "params": 7.6e9, "source": "test"}, "max_model": [
        {"system": "offload", "budget_bytes": 8 * g, "params": 5_000_000_000, "n_layer": 60, "capped": False,
         "incomplete": False, "error": None, "probes": []},
        {"system": "torch", "budget_bytes": 8 * g, "params": None, "n_layer": None, "capped": False,
         "incomplete": False, "error": None, "probes": [{"status": "skipped"}]}]}))
    assert plot.main([str(f), str(m), "--out", str(tmp_path / "o"), "--no-png"]) == 0
    md = (tmp_path / "o" / "results.md").read_text()
    assert "| gpt2-xl | 8 GiB | 3000 | 1500 | 2000 | (oom) | 1.10 (cpu_adam-bound) |" in md
    assert "| gpt2-xl | 8 GiB | zero_offload | 2.00x | >= 1.5x | yes |" in md
    assert "| gpt2-xl | 8 GiB | zero3_offload | 1.50x | >= 1.84x | no |" in md
    assert "| gpt2-xl | 8 GiB | torchao | baseline did not run (oom) | >= 1.2x | - |" in md
    assert "| offload | 5.000B (60 layers) |" in md and "| torch | none (skipped) |" in md


def test_plot_png(smoke, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (the bench/dev extra): PNGs untested")
    _, d = smoke
    assert plot.main([str(d / "vs.json"), "--out", str(tmp_path)]) == 0
    png = tmp_path / "throughput_tiny-gpt.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cannot_fit_and_precheck():
    assert bench_runner.cannot_fit("torch", 10**9, 8 * 2**30) is not None  # 16 GB of states > 8 GiB
    assert bench_runner.cannot_fit("torch", 10**8, 8 * 2**30) is None
    assert bench_runner.cannot_fit("offload", 10**12, 2**30) is None  # streams: nothing is certain
    assert bench_runner.cannot_fit("zero3_offload", 10**12, 2**30) is None
    spec = {"system": "zero_offload", "device": "cpu"}
    if importlib.util.find_spec("deepspeed") is not None:
        assert bench_systems.precheck(spec)[0] == "not_runnable"
        assert bench_systems.precheck(spec | {"cpu_deepspeed": True}) is None
    assert bench_systems.precheck({"system": "offload", "device": "cpu"}) is None


def test_twinflow_needs_its_gpu_share_and_a_ratio_with_zero3():
    # 10**9 params at 8 GiB: bf16 params (2 B) plus 12 B of optimizer per GPU-held param; 0.6 of the optimizer
    # on the GPU is 9.2 GB, 0.5 of it on the CPU too much, 0.8 fits the arithmetic
    assert bench_runner.cannot_fit("twinflow", 10**9, 8 * 2**30, 0.4) is not None
    assert bench_runner.cannot_fit("twinflow", 10**9, 8 * 2**30, 0.8) is None
    cfg = bench_systems.deepspeed_config({"batch": 2, "lr": 1e-4}, bench_systems.torch.device("cpu"), 3, 0.7)
    assert cfg["zero_optimization"]["offload_optimizer"]["ratio"] == 0.7
    assert "offload_param" not in cfg["zero_optimization"]  # Twin-Flow keeps the params on the GPU
    assert cfg["zero_optimization"]["sub_group_size"] <= 1e7  # the ratio applies per sub-group
    assert "offload_param" in bench_systems.deepspeed_config({"batch": 2, "lr": 1e-4},
                                                             bench_systems.torch.device("cpu"), 3)["zero_optimization"]
    with pytest.raises(ValueError, match="ZeRO-3 only"):
        bench_systems.deepspeed_config({"batch": 2, "lr": 1e-4}, bench_systems.torch.device("cpu"), 2, 0.7)


def test_the_twinflow_sweep_stops_at_the_first_ratio_that_runs(tmp_path, monkeypatch):
    """The harness's sweep, with the child replaced: ratios under 0.5 run out of memory, 0.5 and up run."""
    def child(spec, timeout_s, log=None):
        if spec["twinflow_ratio"] < 0.5:
            return {"ok": False, "status": "oom", "error": "CUDA out of memory (stand-in)"}
        return {"ok": True, "status": "ok", "params": 1000, "step_times_s": [2.0 - spec["twinflow_ratio"]]}

    monkeypatch.setattr(vs_baselines, "run_child", child)
    monkeypatch.setattr(vs_baselines, "not_startable", lambda *a, **k: None)
    path = tmp_path / "tf.json"
    for extra, ran in (([], [0.5]), (["--twinflow-all"], [0.5, 0.6])):
        argv = ["--smoke", "--cases", "tiny-gpt@768KiB", "--systems", "twinflow", "--twinflow-ratios", "0.6,0.3,0.5",
                "--json", str(path), *extra]
        assert vs_baselines.main(argv) == 0
        runs = json.loads(path.read_text())["runs"]
        assert [(r["twinflow_ratio"], r["status"]) for r in runs] == [
            (0.3, "oom"), (0.5, "ok"), (0.6, "ok" if 0.6 in ran else "not_run")]
        best = [r["twinflow_ratio"] for r in runs if r.get("twinflow_best")]
        assert best == [0.6 if 0.6 in ran else 0.5]  # the fastest that ran (the stand-in is faster at 0.6)
        table = "\n".join(plot.speedups({"runs": runs}) + plot.vs_table({"runs": runs}))
        assert "twinflow" in table


def test_child_crash_and_timeout_are_recorded():
    crashed = bench_runner.run_child({"system": "offload"}, timeout_s=300)  # a spec the child cannot read
    assert crashed["status"] == "crashed" and not crashed["ok"] and "exit status 1" in crashed["error"]
    assert "KeyError" in crashed["log_tail"] and crashed["peak_host_bytes"] > 0
    late = bench_runner.run_child({"system": "offload"}, timeout_s=0.2)
    assert late["status"] == "timeout" and "timed out" in late["error"]


class _Args:
    width = max_model.SMOKE_WIDTH


def _search(fits_upto, error_at=None, cap=64):
    seen = []

    def probe(system, budget, n):
        seen.append(n)
        if n == error_at:
            return {"ok": False, "status": "error", "error": "boom"}
        return {"ok": n <= fits_upto, "status": "ok" if n <= fits_upto else "oom"}

    return max_model.Search(_Args, "torch", 1, probe).run(lambda: cap), seen


def test_max_model_search():
    r, seen = _search(5)
    assert (r["n_layer"], r["capped"], r["incomplete"]) == (5, False, False) and seen == [1, 2, 4, 8, 6, 5]
    assert r["params"] == max_model.params_at(_Args, 5) and [p["status"] for p in r["probes"]][-1] == "ok"
    r, _ = _search(100, cap=6)
    assert (r["n_layer"], r["capped"]) == (6, True)
    r, _ = _search(0)
    assert r["n_layer"] is None and r["params"] is None and not r["incomplete"]
    r, seen = _search(5, error_at=4)
    assert r["n_layer"] == 2 and r["incomplete"] and "boom" in r["error"] and seen == [1, 2, 4]


def test_max_model_smoke(tmp_path):
    path = tmp_path / "max.json"
    assert max_model.main(["--smoke", "--max-layers", "1", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    ours, torch_ = data["max_model"]
    assert ours["system"] == "offload" and ours["n_layer"] == 1 and ours["capped"], ours
    assert ours["params"] == max_model.params_at(_Args, 1)
    assert torch_["system"] == "torch" and torch_["probes"][0]["status"] == "skipped"
    b = data["host_ram_bound"]
    assert 14 <= b["bytes_per_param"] < 16.5  # fp32 master, m, v + the bf16 copy, plus the grad ring and alignment
    assert b["params"] == int(b["host_ram_bytes"] / b["bytes_per_param"])


def test_overhead_smoke(tmp_path):
    """benchmarks/overhead.py in its smoke mode: every model and mode measured and recorded (not the figures)."""
    import overhead

    path = tmp_path / "overhead.json"
    assert overhead.main(["--smoke", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["benchmark"] == "overhead" and data["smoke"]
    assert len(data["machine"]["load_average"]) == 3 and len(data["load_average_after"]) == 3
    assert data["settings"]["threads"] == 1
    cases = {(c["name"], c["mode"]): c for c in data["cases"]}
    assert set(cases) == {(m, mode) for m in ("mlp", "gpt") for mode in ("resident", "streamed")}
    for (name, mode), c in cases.items():
        assert c["module_calls_per_step"] == {"mlp": 7, "gpt": 18}[name]  # 3 x (Linear, ReLU) + root; GPT's modules
        assert len(c["engine_block_ms"]) == len(c["torch_block_ms"]) == 2
        assert c["engine_ms"] > 0 and c["torch_ms"] > 0
        assert c["ratio"] == pytest.approx(c["engine_ms"] / c["torch_ms"], rel=1e-3)
        assert c["ratio_cpu"] == pytest.approx(c["engine_cpu_ms"] / c["torch_cpu_ms"], rel=1e-3)
        assert c["us_per_module_call"] == pytest.approx(
            (c["engine_ms"] - c["torch_ms"]) * 1e3 / c["module_calls_per_step"], abs=0.02)
        assert c["torch_adamw"] == "fused" or c["torch_adamw"].startswith("foreach (fused AdamW is not available")
        assert c["on_plan"], c["counters_timed"]  # timed steps followed the plan
        assert len(c["load_average"]) == 3
    streamed = cases[("gpt", "streamed")]
    assert streamed["streamed"] and streamed["counters_timed"]["planned_fetches"] > 0
    assert not cases[("gpt", "resident")]["streamed"]
    # all resident: every timed step ran the fast path (offload/runtime/fast_path.py); a plan that streams: none
    for c in cases.values():
        fast = c["counters_timed"]["fast_steps"]
        assert fast == (0 if c["streamed"] else len(c["engine_block_ms"]) * c["steps_per_block"]), c
    assert cases[("gpt", "streamed")]["budget_bytes"] < cases[("gpt", "resident")]["budget_bytes"]
