"""benchmarks/trace_timeline.py: the per-lane summary of one step's torch.profiler trace, checked on a synthetic
CUDA-shaped trace whose every figure is worked out by hand below, and on a real CPU-backend profile."""

from __future__ import annotations

import gzip
import json

import pytest
import trace_timeline as tt  # benchmarks/ is on sys.path (pyproject's pytest `pythonpath`)

import offload
from tests.support import models
from tests.support.loops import ADAMW

MAIN, AUTOGRAD, LANE = 10, 11, 12  # host thread ids (process 10)
COMPUTE, H2D, D2H = 7, 14, 18  # stream ids (GPU "process" 0)


def _x(tid, cat, name, ts, end, pid=None, **args):
    pid = (0 if tid in (COMPUTE, H2D, D2H) else MAIN) if pid is None else pid
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": end - ts, "args": args}


def _copy(stream, kind, ts, end, nbytes):
    name = {"h2d": "Memcpy HtoD (Pinned -> Device)", "d2h": "Memcpy DtoH (Device -> Pinned)"}[kind]
    # the profiler repeats each annotated copy as a gpu_user_annotation of the same span (no bytes): ignored
    return [_x(stream, "gpu_memcpy", name, ts, end, bytes=nbytes),
            _x(stream, "gpu_user_annotation", f"offload::{kind}", ts, end)]


def synthetic() -> dict:
    """One step, times in microseconds. Forward on the main thread 0-200; backward on autograd's thread
    200-1220 (four grad copies issued inside offload::d2h, one of them after a 275 us ring wait); the CPU lane's
    four items, two waits each; step() resumes the main thread at 1300 (refresh of one resident bucket);
    the harness's synchronize 1500-1510."""
    ev = [
        _x(MAIN, "cpu_op", "aten::linear", 0, 100),
        _x(MAIN, "user_annotation", "offload::h2d", 100, 150), _x(MAIN, "cuda_runtime", "cudaMemcpyAsync", 110, 120),
        _x(MAIN, "cpu_op", "aten::add", 150, 200),
        _x(MAIN, "user_annotation", "offload::h2d", 1300, 1320),
        _x(MAIN, "cuda_runtime", "cudaMemcpyAsync", 1305, 1310),
        _x(MAIN, "cuda_runtime", "cudaDeviceSynchronize", 1500, 1510),
        _x(AUTOGRAD, "cpu_op", "autograd::engine::evaluate_function: AddmmBackward0", 200, 260),
        _x(AUTOGRAD, "cpu_op", "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 260, 700),
    ]
    for start, end, inner in ((270, 300, (290, 295)), (300, 320, (315, 318)), (320, 600, (590, 595)),
                              (1000, 1010, (1002, 1004))):
        ev += [_x(AUTOGRAD, "user_annotation", "offload::d2h", start, end),
               _x(AUTOGRAD, "cuda_runtime", "cudaMemcpyAsync", *inner)]
    ev.append(_x(AUTOGRAD, "cpu_op", "autograd::engine::evaluate_function: NativeLayerNormBackward0", 700, 1200))
    ev.append(_x(AUTOGRAD, "cuda_runtime", "cudaStreamWaitEvent", 1210, 1220))  # the end-of-backward callback
    for start, end in ((302, 319), (319, 322), (522, 530), (530, 532), (700, 702), (702, 704), (1100, 1104),
                       (1104, 1106)):
        ev.append(_x(LANE, "cuda_runtime", "cudaEventSynchronize", start, end))
    ev += _copy(D2H, "d2h", 300, 380, 4_000_000) + _copy(D2H, "d2h", 380, 420, 2_000_000)
    ev += _copy(D2H, "d2h", 600, 620, 1_000_000) + _copy(D2H, "d2h", 1010, 1014, 200_000)
    ev += _copy(H2D, "h2d", 50, 150, 5_000_000) + _copy(H2D, "h2d", 1305, 1405, 5_000_000)
    ev += [_x(COMPUTE, "kernel", "gemm", 20, 90), _x(COMPUTE, "kernel", "gemm_backward", 210, 250),
           _x(COMPUTE, "gpu_memcpy", "Memcpy DtoD (Device -> Device)", 250, 260, bytes=1000),
           _x(COMPUTE, "gpu_memset", "Memset (Device)", 800, 805),
           _x(COMPUTE, "gpu_user_annotation", "a region", 90, 210)]  # spans idle time: not busy
    ev += [{"ph": "M", "name": "thread_name", "pid": MAIN, "tid": MAIN, "args": {"name": "python3"}},
           {"ph": "X", "cat": "overhead", "name": "Activity Buffer Request", "pid": -1, "tid": 0, "ts": -500,
            "dur": 5},
           {"ph": "f", "cat": "ac2g", "name": "flow", "pid": MAIN, "tid": MAIN, "ts": 5}]
    return {"traceEvents": ev}


def queried() -> dict:
    """The same step as :func:`synthetic` with the CPU lane as traced since c9adf4c ([Note: reading the CPU lane
    from its waits]): each wait a ``cudaEventQuery``, followed by a ``cudaEventSynchronize`` where the event was
    not complete; five items (D2H copies of 4, 2, 2, 1 and 0.2 MB: one bucket of 4 MB, one crossing the ring in
    pieces of 2 MB, 2 + 2 + 1, one of 0.2 MB), the later two pieces waiting for their grad copy only. Each item's
    AdamW takes 20 us + 1e10 params/s; the fourth item's successor is submitted (1010) after its wait (848)."""
    ev = [e for e in synthetic()["traceEvents"]
          if e.get("tid") not in (LANE, D2H) and not (e.get("tid") == AUTOGRAD and e["name"] in
                                                      ("offload::d2h", "cudaMemcpyAsync"))]
    for start, end in ((270, 300), (300, 320), (320, 330), (330, 600), (1000, 1010)):
        ev += [_x(AUTOGRAD, "user_annotation", "offload::d2h", start, end),
               _x(AUTOGRAD, "cuda_runtime", "cudaMemcpyAsync", start + 1, start + 3)]
    q, sync = "cudaEventQuery", "cudaEventSynchronize"
    for name, start, end in ((q, 302, 303), (sync, 305, 382), (q, 383, 384),  # 2e6 params, ready at 384
                             (q, 604, 605), (q, 605, 606),  # 1e6: its AdamW 220 us after 384; ready 606
                             (q, 726, 727),  # a later piece (1e6): one wait
                             (q, 847, 848),  # a later piece (5e5); its successor is submitted at 1010
                             (q, 1011, 1012), (sync, 1012, 1016), (q, 1017, 1018)):  # 1e5; the main thread at 1300
        ev.append(_x(LANE, "cuda_runtime", name, start, end))
    for start, end, nbytes in ((300, 380, 4_000_000), (380, 420, 2_000_000), (420, 460, 2_000_000),
                               (600, 620, 1_000_000), (1010, 1014, 200_000)):
        ev += _copy(D2H, "d2h", start, end, nbytes)
    return {"traceEvents": ev}


def test_cpu_adam_lane_of_queries_and_later_pieces():
    s = tt.summarise(queried())
    assert [ln["tid"] for ln in s["lanes"] if ln["role"] == "cpu_adam"] == [LANE]
    a = s["cpu_adam"]
    assert a["found"] and (a["items"], a["waits"], a["queries"], a["synchronizes"]) == (5, 8, 8, 2)
    assert (a["ring_piece_bytes"], a["later_pieces"]) == (2_000_000, 2) and "waits_per_item" not in a
    # a query and the synchronize after it are one wait: 302-382 and 1011-1016
    assert a["wait_s"] == pytest.approx(91e-6) and a["synchronize_s"] == pytest.approx(81e-6)
    assert a["wait_by_position_s"] == pytest.approx([88e-6, 3e-6]) and a["first_s"] == pytest.approx(302e-6)
    assert a["params"] == 4_600_000
    assert (a["queued_items"], a["queued_params"], a["queued_s"]) == (3, 4_000_000, pytest.approx(460e-6))
    rate = 4e6 / 460e-6
    assert a["params_per_s_queued"] == pytest.approx(rate)
    assert a["params_per_s_queued_median_large"] == pytest.approx(2e6 / 220e-6)  # the one item of >= 1 Mi params
    assert (a["fit_per_item_s"], a["fit_params_per_s"]) == pytest.approx((20e-6, 1e10))
    # not queued: the fourth item (gap 848-1011) and the last (gap 1018 to the main thread's 1300)
    assert a["unqueued_items"] == 2 and a["unqueued_gap_s"] == pytest.approx((163 + 282) * 1e-6)
    assert a["idle_est_s"] == pytest.approx(163e-6 - 5e5 / rate + 282e-6 - 1e5 / rate)
    assert a["last_adam_end_at_most_s"] == pytest.approx(1300e-6) and a["window_s"] == pytest.approx(998e-6)
    assert a["busy_est_s"] == pytest.approx(998e-6 - 91e-6 - a["idle_est_s"])


def test_a_lane_of_queries_whose_count_does_not_check_is_not_read():
    trace = queried()  # the second item's H2D wait dropped: 7 waits, where 5 items less 2 later pieces need 8
    trace["traceEvents"] = [e for e in trace["traceEvents"] if not (e.get("tid") == LANE and e["ts"] == 605)]
    a = tt.summarise(trace)["cpu_adam"]
    assert a["found"] and a["waits"] == 7 and a["later_pieces"] == 2
    assert "not two waits per item less one per later piece" in a["note"] and "params_per_s_queued" not in a


@pytest.mark.intra_op_threads  # [Note: the suite's intra-op threads] in tests/conftest.py
def test_a_thread_of_queries_is_the_lane_only_with_nothing_but_its_waits():
    for extra in (_x(LANE, "cuda_runtime", "cudaEventSynchronize", 250, 260),  # a synchronize after no query
                  _x(LANE, "cuda_runtime", "cudaStreamSynchronize", 1100, 1101)):  # not a wait of the lane
        trace = queried()
        trace["traceEvents"].append(extra)
        s = tt.summarise(trace)
        assert [ln["role"] for ln in s["lanes"] if ln["tid"] == LANE] == ["other"]
        assert not s["cpu_adam"]["found"]


def test_cli_prints_a_lane_of_queries(capsys):
    from rich.console import Console

    tt.render("step", tt.summarise(queried()), Console(width=400))
    printed = capsys.readouterr().out
    assert "5 items, 8 waits" in printed and "8 cudaEventQuery, 2 cudaEventSynchronize after one" in printed
    assert "2 later pieces of a bucket in ring pieces of 2000000 B" in printed and "fit over them: 20 us" in printed


def test_lanes_phases_and_busy_times():
    s = tt.summarise(synthetic())
    lanes = {ln["role"]: ln for ln in s["lanes"]}
    assert set(lanes) == {"main", "autograd", "cpu_adam", "compute", "h2d", "d2h"}
    assert lanes["cpu_adam"]["tid"] == LANE and lanes["h2d"]["tid"] == H2D and lanes["d2h"]["tid"] == D2H
    assert s["step_s"] == pytest.approx(1510e-6)  # the overhead event at -500 is not part of the step
    assert list(s["phases"]) == ["forward", "backward", "after"]
    assert [x for p in s["phases"].values() for x in (p["start_s"], p["end_s"])] == pytest.approx(
        [0, 200e-6, 200e-6, 1220e-6, 1220e-6, 1510e-6])
    main = lanes["main"]
    assert main["busy_s"] == pytest.approx(230e-6)
    assert main["busy_by_phase_s"] == pytest.approx({"forward": 200e-6, "backward": 0, "after": 30e-6})
    assert main["largest_gaps"][0]["seconds"] == pytest.approx(1100e-6)  # blocked in backward and step()'s drain
    assert lanes["compute"]["busy_s"] == pytest.approx(125e-6)
    k = s["gpu_kernels"]
    assert (k["kernels"], k["kernel_busy_s"], k["busy_s"]) == (2, pytest.approx(110e-6), pytest.approx(125e-6))
    assert k["busy_by_phase_s"] == pytest.approx({"forward": 70e-6, "backward": 55e-6, "after": 0})


def test_copies_bytes_and_bandwidth():
    s = tt.summarise(synthetic())
    d2h, h2d = s["copies"]["d2h"], s["copies"]["h2d"]
    assert (d2h["copies"], d2h["bytes"]) == (4, 7_200_000)  # not the device-to-device copy, not the annotations
    assert d2h["busy_s"] == pytest.approx(144e-6) and d2h["achieved_GBps"] == pytest.approx(50.0)
    assert (h2d["copies"], h2d["bytes"], h2d["achieved_GBps"]) == (2, 10_000_000, pytest.approx(50.0))
    assert h2d["by_phase"]["forward"]["bytes"] == h2d["by_phase"]["after"]["bytes"] == 5_000_000
    assert h2d["by_phase"]["backward"]["bytes"] == 0


def test_host_waits_are_the_uncovered_part_of_the_backend_spans():
    w = tt.summarise(synthetic())["host_waits"]
    ring = w["autograd:offload::d2h"]
    assert ring["spans"] == 4 and ring["uncovered_s"] == pytest.approx((25 + 17 + 275 + 8) * 1e-6)
    assert (ring["over_100us"], ring["max_s"]) == (1, pytest.approx(275e-6))
    h2d = w["main:offload::h2d"]
    assert h2d["uncovered_by_phase_s"] == pytest.approx({"forward": 40e-6, "backward": 0, "after": 15e-6})


def test_cpu_adam_lane_read_from_its_waits():
    a = tt.summarise(synthetic())["cpu_adam"]
    assert a["found"] and (a["items"], a["waits"], a["waits_per_item"]) == (4, 8, 2)
    assert a["wait_s"] == pytest.approx(40e-6) and a["wait_by_position_s"] == pytest.approx([31e-6, 9e-6])
    assert a["params"] == 3_600_000
    # item 0 (2e6 params): the next one was submitted (320) before its waits ended (322): 200 us of AdamW
    assert (a["queued_items"], a["queued_params"]) == (1, 2_000_000)
    assert a["params_per_s_queued"] == pytest.approx(1e10)
    assert a["params_per_s_queued_median_large"] == pytest.approx(1e10)
    # the others waited for their successor: gaps 168, 396 and (to the main thread's resume) 194 us, less
    # 100, 50 and 10 us of AdamW at the queued rate
    assert a["unqueued_items"] == 3 and a["unqueued_gap_s"] == pytest.approx((168 + 396 + 194) * 1e-6)
    assert a["idle_est_s"] == pytest.approx((68 + 346 + 184) * 1e-6)
    assert a["last_adam_end_at_most_s"] == pytest.approx(1300e-6) and a["window_s"] == pytest.approx(998e-6)
    assert a["achieved_params_per_s_window"] == pytest.approx(3_600_000 / 998e-6)
    assert a["busy_est_s"] == pytest.approx(360e-6)


def test_end_of_step():
    e = tt.summarise(synthetic())["end_of_step"]
    assert e["backward_end_s"] == pytest.approx(1220e-6) and e["main_resumes_s"] == pytest.approx(1300e-6)
    i = e["refresh_issue_s"]
    assert (i["first_s"], i["last_s"], i["spans"]) == pytest.approx((1300e-6, 1320e-6, 1))
    r = e["refresh_copies"]
    assert (r["copies"], r["bytes"]) == (1, 5_000_000)
    assert (r["first_s"], r["last_end_s"], r["achieved_GBps"]) == pytest.approx((1305e-6, 1405e-6, 50.0))
    assert e["main_last_event"]["name"] == "cudaDeviceSynchronize"
    assert [x["lane"].split()[0] for x in e["lanes_by_last_end"][:2]] == ["main", "h2d"]


def test_an_unreadable_lane_says_so():
    trace = synthetic()
    trace["traceEvents"] = [e for e in trace["traceEvents"] if not (e.get("tid") == LANE and e["ts"] == 1104)]
    a = tt.summarise(trace)["cpu_adam"]
    assert "not one item per copy" in a["note"] and "params_per_s_queued" not in a


def test_cli_reads_gzip_and_writes_json(tmp_path, capsys):
    path = tmp_path / "step.json.gz"
    path.write_bytes(gzip.compress(json.dumps(synthetic()).encode()))
    assert tt.main([str(path), "--json", str(tmp_path / "out.json")]) == 0
    out = json.loads((tmp_path / "out.json").read_text())[str(path)]
    assert out["copies"]["d2h"]["bytes"] == 7_200_000
    printed = capsys.readouterr().out
    assert "CPU AdamW lane" in printed and "10.00e9 params/s" in printed


def test_a_cpu_backend_profile(tmp_path):
    """A real torch.profiler trace of one engine step on the CPU backend: forward and backward on the main
    thread, no GPU lanes, and the CPU lane not in the trace (the profiler records no op on its thread)."""
    from torch.profiler import ProfilerActivity, profile

    case = models.mlp()
    nbytes = sum(p.numel() * 4 for p in case.model.parameters())
    opt = offload.AdamW(case.model.parameters(), **ADAMW)
    engine = offload.wrap(case.model, opt, budget=int(0.6 * nbytes), bucket_bytes=nbytes // 10, device="cpu")

    def step(i):
        batch = case.make_batch(i)
        engine.backward(case.loss_fn(models.run(engine, batch), batch))
        opt.step()
        opt.zero_grad()

    try:
        for i in range(2):
            step(i)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(2)
    finally:
        engine.close()
    prof.export_chrome_trace(str(tmp_path / "step.json"))
    s = tt.summarise(tt.load(tmp_path / "step.json"))
    roles = [ln["role"] for ln in s["lanes"]]
    assert roles.count("main") == 1 and not {"h2d", "d2h", "compute", "cpu_adam"} & set(roles)
    f, b = s["phases"]["forward"], s["phases"]["backward"]
    assert f["seconds"] > 0 and b["seconds"] > 0 and f["end_s"] == b["start_s"]
    assert s["copies"]["h2d"]["copies"] == 0 and s["gpu_kernels"]["kernels"] == 0
    assert not s["cpu_adam"]["found"]
    json.dumps(s)  # JSON-ready


def test_fit_line():
    a, b = tt.fit_line([(0, 1.0), (10, 21.0), (20, 41.0)])
    assert (a, b) == pytest.approx((1.0, 2.0))
    assert tt.fit_line([(5, 1.0), (5, 2.0)]) is None  # one size: no rate to separate from the per-item cost
    a = tt.summarise(synthetic())["cpu_adam"]
    assert "fit_per_item_s" not in a and a["small_items"] == 0  # one queued item, of 2e6 parameters
