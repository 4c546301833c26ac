"""Timelines of a step (offload/tools/timeline.py): ``Engine.export_timeline`` (measured) and the simulated step of a
plan (``offload report --timeline``), as Chrome-trace JSON whose slices match the plan."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

import offload
import offload.tools.timeline
from offload.planning.hw import PRESETS
from offload.planning.schedule import BufferKind, program_of
from offload.planning.simulate import STEP_START, simulate, simulate_reference
from offload.planning.steady import steady_state
from offload.tools.timeline import simulated
from tests.support import models
from tests.support.loops import ADAMW


def _engine(case, budget_frac=0.6, **fields):
    nbytes = sum(p.numel() * 4 for p in case.model.parameters())
    opt = offload.AdamW(case.model.parameters(), **ADAMW)
    engine = offload.wrap(case.model, opt, budget=int(budget_frac * nbytes), bucket_bytes=nbytes // 10,
                          device="cpu", **fields)
    return engine, opt


def _steps(engine, opt, case, steps, accumulate=1):
    for step in range(steps):
        for i in range(accumulate):
            batch = case.make_batch(step * accumulate + i)
            engine.backward(case.loss_fn(models.run(engine, batch), batch))
        opt.step()
        opt.zero_grad()


def _slices(trace: dict, cat: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == cat]


def _check_chrome_format(trace: dict) -> None:
    """What Perfetto / chrome://tracing need: a traceEvents list, X slices with ts/dur (µs) on named threads,
    C counters with numeric args."""
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert set(threads.values()) == {"compute", "H2D (host to device)", "D2H (device to host)", "CPU AdamW"}
    for e in trace["traceEvents"]:
        assert e["ph"] in ("X", "C", "M")
        if e["ph"] == "X":
            assert e["tid"] in threads and e["dur"] >= 0 and isinstance(e["ts"], float)
        if e["ph"] == "C":
            assert all(isinstance(v, int) for v in e["args"].values())


def test_export_timeline_of_the_last_step(tmp_path):
    """One slice per bucket copy / gradient copy / update of the last step, module calls on the compute track,
    a memory counter that stays under the budget; the JSON loads and has what a viewer needs."""
    case = models.gpt()
    engine, opt = _engine(case)
    try:
        _steps(engine, opt, case, 3)
        path = tmp_path / "step.json"
        tl = engine.export_timeline(path)
        plan = engine._runtime.executor.train_plan
        stats = engine.memory_stats()
    finally:
        engine.close()
    trace = json.loads(path.read_text())
    _check_chrome_format(trace)
    assert trace["otherData"]["source"] == "measured"
    resident = set(plan.resident)
    # The plan's fetches of this step, plus the refresh of each resident bucket in step() (after its update).
    fetched = Counter(x.bucket for x in plan.buffers if x.kind is BufferKind.PARAM and x.bucket not in resident)
    fetched.update(resident)
    assert Counter(e["args"]["bucket"] for e in _slices(trace, "h2d")) == fetched
    trainable = {b for b, bucket in enumerate(plan.buckets) if bucket.numel}
    assert sorted(e["args"]["bucket"] for e in _slices(trace, "d2h")) == sorted(trainable)
    assert sorted(e["args"]["bucket"] for e in _slices(trace, "cpu_adam")) == sorted(trainable)
    names = {e["name"] for e in _slices(trace, "compute")}
    assert {"(model)", "blocks.0", "blocks.3.mlp"} <= names
    counter = [e["args"]["device bytes"] for e in trace["traceEvents"] if e["ph"] == "C"]
    assert counter and max(counter) <= stats["budget_bytes"]
    assert tl.count("h2d") == sum(fetched.values())


def test_export_timeline_needs_a_step_and_survives_evaluation(tmp_path):
    """Before any step there is nothing to show; an evaluation forward after the step does not replace it."""
    case = models.mlp()
    engine, opt = _engine(case)
    try:
        with pytest.raises(offload.OffloadError, match="no training step"):
            engine.export_timeline(tmp_path / "x.json")
        _steps(engine, opt, case, 2)
        before = engine.export_timeline(tmp_path / "a.json")
        with torch.no_grad():
            models.run(engine, case.make_batch(99))
        after = engine.export_timeline(tmp_path / "b.json")
    finally:
        engine.close()
    assert before == after and before.count("h2d") > 0


def test_simulated_timeline_matches_the_plan(tmp_path):
    """The simulated step: one H2D slice per copy of the plan's program, one D2H and one AdamW slice per
    bucket with grads, compute slices per module call, and the same step time as the simulator."""
    case = models.gpt()
    engine, opt = _engine(case, budget_frac=0.5)
    try:
        _steps(engine, opt, case, 2)
        plan = engine._runtime.executor.train_plan
        names = [n for n, _ in engine.module.named_modules()]
    finally:
        engine.close()
    hw = PRESETS["pcie4"]
    tl = simulated(plan, hw, names)
    tl.save(tmp_path / "sim.json")
    trace = json.loads((tmp_path / "sim.json").read_text())
    _check_chrome_format(trace)
    program = program_of(plan)
    step = simulate(program, hw).step_s
    assert plan.refresh_pipelined and STEP_START in program.h2d_event  # resident buckets, refreshed in step()
    # the step's own copies in program order, then the refreshes its step() issues, in that order ([Note: the
    # refresh pipelined, modelled]); those still in flight when the step ends land in the next one
    _, carry = steady_state(program, hw)
    h2d = sorted(_slices(trace, "h2d"), key=lambda e: e["ts"])
    assert [e["args"]["bucket"] for e in h2d] == [b for b, e in zip(program.h2d_bucket, program.h2d_event)
                                                  if e != STEP_START] + [program.h2d_bucket[k] for k in carry.order]
    late = [e["ts"] + e["dur"] - step * 1e6 for e in h2d[-len(carry.order):]]
    assert late == pytest.approx([d * 1e6 for d in carry.done], abs=2e-3) and max(late) > 0  # (JSON: ns)
    assert sorted(e["args"]["bucket"] for e in _slices(trace, "d2h")) == sorted(program.d2h_bucket)
    assert sorted(e["args"]["bucket"] for e in _slices(trace, "cpu_adam")) == sorted(program.d2h_bucket)
    calls = sum(1 for e in plan.trace.events if int(e.kind) == 0)
    assert sum(1 for e in _slices(trace, "compute") if "module" in e["args"]) == calls
    assert trace["otherData"]["predicted_step_s"] == pytest.approx(step, rel=1e-12)
    assert max(e["ts"] + e["dur"] for e in trace["traceEvents"] if e["ph"] == "X" and e not in h2d) == \
        pytest.approx(step * 1e6)
    counter = [e["args"]["device bytes"] for e in trace["traceEvents"] if e["ph"] == "C"]
    assert max(counter) <= plan.peak_bytes <= plan.budget_bytes


def test_simulate_reference_record_changes_nothing():
    case = models.mlp()
    engine, opt = _engine(case, budget_frac=0.5)
    try:
        _steps(engine, opt, case, 2)
        plan = engine._runtime.executor.train_plan
    finally:
        engine.close()
    program, hw = program_of(plan), PRESETS["pcie4"]
    record: list = []
    assert simulate_reference(program, hw, record) == simulate_reference(program, hw)
    assert Counter(lane for lane, *_ in record)["h2d"] == len(program.h2d_bucket)


def test_plot_memory(tmp_path):
    pytest.importorskip("matplotlib")
    case = models.mlp()
    engine, opt = _engine(case)
    try:
        _steps(engine, opt, case, 2)
        tl = engine.export_timeline(tmp_path / "step.json")
    finally:
        engine.close()
    tl.plot_memory(tmp_path / "mem.png")
    assert (tmp_path / "mem.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


FACTORY = """
import torch
from offload.tools.presets import Shape

def small(batch, seq):
    shape = Shape("gpt2", vocab=512, n_ctx=64, d=128, n_layer=4, n_head=4, ffn=512)
    return shape.build(torch.get_default_device()), torch.zeros(batch, seq, dtype=torch.long)
"""


def test_report_timeline_and_plot(tmp_path, monkeypatch, capsys):
    """`offload report ... --timeline step.json --plot mem.png`: the simulated step of the report's plan (the
    JSON on stdout stays clean: messages go to stderr)."""
    pytest.importorskip("matplotlib")
    (tmp_path / "tl_factory.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    from offload.tools.cli import main
    status = main(["report", "--model", "tl_factory:small", "--budget", "3MiB", "--batch", "2", "--seq", "64",
                   "--bucket-bytes", "256KiB", "--host-ram", "1GiB", "--json", "--timeline", "step.json",
                   "--plot", "mem.png"])
    out = capsys.readouterr()
    assert status == 0, out.err
    report = json.loads(out.out)
    trace = json.loads((tmp_path / "step.json").read_text())
    _check_chrome_format(trace)
    assert trace["otherData"]["predicted_step_s"] == pytest.approx(report["predicted_step_s"], rel=1e-12)
    fetches = report["plan"]["fetches_per_step"] + report["plan"]["resident_buckets"]
    assert len(_slices(trace, "h2d")) == fetches  # every fetch, and the refresh of each resident bucket
    assert (tmp_path / "mem.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    tl = offload.tools.timeline.Timeline("simulated", (), ((0.0, 1),), budget_bytes=2)
    with pytest.raises(offload.OffloadError, match="pip install matplotlib"):
        tl.plot_memory(tmp_path / "mem.png")


def test_memory_helpers_for_a_users_loop(capsys):
    """offload.memory_line / memory_table / print_memory: device peak against the budget from memory_stats()."""
    case = models.mlp()
    engine, opt = _engine(case)
    try:
        _steps(engine, opt, case, 2)
        stats = engine.memory_stats()
        line = offload.memory_line(engine)
        offload.print_memory(engine)
    finally:
        engine.close()
    peak, budget = offload.format_bytes(stats["device_peak_bytes"]), offload.format_bytes(stats["budget_bytes"])
    assert line.startswith(f"device peak {peak} of {budget} budget")
    out = capsys.readouterr().out
    for text in ("budget", "device peak", peak, "arena", "pinned host", "buckets", "streamed"):
        assert text in out, text
    assert offload.memory_table(stats).row_count >= 7


def test_export_timeline_with_accumulation_and_deferred_updates(tmp_path):
    """overlap_optimizer=False, 2 micro-batches: the step shown is the last micro-batch's forward and backward (one
    gradient copy per trainable bucket) and the updates step() ran after it (one per bucket, after the copies)."""
    case = models.gpt()
    engine, opt = _engine(case, overlap_optimizer=False)
    try:
        _steps(engine, opt, case, 2, accumulate=2)
        trace = engine.export_timeline(tmp_path / "step.json").chrome_trace()
        plan = engine._runtime.executor.train_plan
    finally:
        engine.close()
    trainable = sorted(b for b, bucket in enumerate(plan.buckets) if bucket.numel)
    d2h, adam = _slices(trace, "d2h"), _slices(trace, "cpu_adam")
    assert sorted(e["args"]["bucket"] for e in d2h) == trainable
    assert sorted(e["args"]["bucket"] for e in adam) == trainable
    copied = {e["args"]["bucket"]: e["ts"] + e["dur"] for e in d2h}
    assert all(e["ts"] >= copied[e["args"]["bucket"]] for e in adam)  # each update after its grads arrived
    backward_end = max(e["ts"] + e["dur"] for e in _slices(trace, "compute"))
    assert min(e["args"]["issued_ms"] * 1e3 for e in adam) >= backward_end - 1.0  # issued by step(), not backward


def test_export_timeline_on_the_simulated_gpu_says_which_lanes_have_no_times(monkeypatch, tmp_path):
    """[Note: lane times on CUDA]: copies on CUDA streams record no host times. The CUDA backend (on the simulated
    GPU) gives a timeline with the compute and CPU AdamW lanes, empty copy lanes, and says so."""
    from offload.backend.cuda import CUDABackend
    from tests.support.fake_cuda import FakeCuda

    monkeypatch.setattr(offload.api, "make_backend",
                        lambda device, chaos=None: CUDABackend(torch.device("cpu"), api=FakeCuda(lazy=True)))
    case = models.gpt()
    engine, opt = _engine(case)
    try:
        _steps(engine, opt, case, 2)
        trace = engine.export_timeline(tmp_path / "step.json").chrome_trace()
    finally:
        engine.close()
    assert trace["otherData"]["lanes_without_times"] == ["d2h", "h2d"]
    assert not _slices(trace, "h2d") and not _slices(trace, "d2h")
    assert _slices(trace, "cpu_adam") and _slices(trace, "compute")
