"""``offload probe`` under torch.distributed (issue 20): the collectives timed over spawned gloo ranks, the
ring model's fit (against hand-made data, and against the timings it was fitted to), and ``offload report
--gpus --hw probe.json`` using the measured links ([Note: probing the collectives])."""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import time
import traceback
from pathlib import Path

import pytest
import torch

from offload.planning.collectives import Link, gloo_all_gather_seconds, gloo_cluster_of, gloo_reduce_scatter_seconds, \
    ring_seconds
from offload.planning.hw import PRESETS
from offload.tools import cli
from offload.tools.probe_collectives import KINDS, fit_ring, link_origins, measured_links, ring_terms

SIZES = (64 << 10, 256 << 10, 1 << 20)
# the fit's test: sizes far enough apart that the bytes, not the machine's load, set the times (64 KiB .. 1 MiB
# failed to fit the reduce-scatter's bandwidth at load 5 on 2 cores)
FIT_SIZES = (64 << 10, 1 << 20, 16 << 20)


# -- the fit ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [2, 3, 8])
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_fit_recovers_the_latency_and_bandwidth_of_exact_ring_times(ranks, backend):
    a, bw = 37e-6, 1.7e9
    points = [(*ring_terms(kind, backend, n, ranks), 0.0) for kind in KINDS for n in (4096, 1 << 20, 64 << 20)]
    points = [(s, w, s * a + w / bw) for s, w, _ in points]
    fit = fit_ring(points)
    assert fit.latency_s == pytest.approx(a, rel=1e-9) and fit.bytes_per_s == pytest.approx(bw, rel=1e-9)
    assert fit.max_rel_error < 1e-9
    one = fit_ring(points[:3])  # one kind alone
    assert (one.latency_s, one.bytes_per_s) == (pytest.approx(a, rel=1e-9), pytest.approx(bw, rel=1e-9))


def test_ring_terms_are_the_cost_models():
    """The fitted equations are the planner's: gloo's reduce-scatter is an all-reduce ([Note: gloo's
    collectives]); NCCL's reduce-scatter and all-gather are one ring ([Note: the alpha-beta ring model])."""
    link = Link("x", 2e9, 30e-6)
    for p in (2, 4):
        cluster = gloo_cluster_of(p, 1, link)
        n = 3 << 20  # a multiple of p
        fit = fit_ring([(*ring_terms("all_gather", "gloo", m, p), ring_seconds(m, p, link)) for m in (n, 4 * n)])

        def model(kind, backend):
            return fit.seconds(*ring_terms(kind, backend, n, p))
        assert model("all_gather", "gloo") == pytest.approx(gloo_all_gather_seconds(n, cluster))
        assert model("reduce_scatter", "gloo") == pytest.approx(gloo_reduce_scatter_seconds(n, cluster))
        assert model("all_reduce", "gloo") == pytest.approx(2 * gloo_all_gather_seconds(n, cluster))
        assert model("reduce_scatter", "nccl") == model("all_gather", "nccl") == pytest.approx(ring_seconds(n, p, link))


def test_fit_keeps_the_latency_non_negative_and_refuses_flat_times():
    # pure bandwidth, with the small size a little fast: the unconstrained latency would be negative
    points = [(1, 1e6, 0.9e-3), (1, 1e8, 0.1), (1, 1e9, 1.0)]
    fit = fit_ring(points)
    assert fit.latency_s == 0 and 0.9e9 < fit.bytes_per_s < 1.1e9
    assert fit.max_rel_error == pytest.approx(max(abs(w / fit.bytes_per_s - t) / t for _, w, t in points))
    with pytest.raises(ValueError, match="do not grow"):
        fit_ring([(1, 1e6, 1e-3), (1, 1e8, 1e-3)])
    with pytest.raises(ValueError, match="two or more"):
        fit_ring([(1, 1e6, 1e-3)])


# -- spawned ranks ------------------------------------------------------------------------------------------


def _rank(rank: int, world: int, init: str, out: str, what: str) -> None:
    """One spawned rank: join a gloo group (10 s timeout), run ``what``, save the result or the error."""
    import torch.distributed as dist
    result: dict = {"rank": rank}
    try:
        os.environ.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))  # as torchrun sets them: one node
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=10))
        from offload.tools.probe import probe
        from offload.tools.probe_collectives import measure_collectives
        started = time.monotonic()
        if what == "missing" and rank == 1:
            os._exit(3)  # a rank that never takes part
        from offload.tools import probe_collectives
        if what == "dies" and rank == 1:  # dies in its first timed all-reduce of 256 KiB
            timed = probe_collectives._Side.time

            def time_or_die(self, kind, nbytes, repeat):
                if (kind, nbytes) == ("all_reduce", 256 << 10):
                    os._exit(3)
                return timed(self, kind, nbytes, repeat)
            probe_collectives._Side.time = time_or_die
        if what == "capped" and rank == 1:  # this rank has room for buffers of 300 KiB only
            probe_collectives._Side.free_bytes = lambda self: 2 * probe_collectives._PEAK_BUFFERS * (300 << 10)
        sizes = FIT_SIZES if what == "probe" else SIZES
        if what == "probe" and rank == 1:  # the CLI's other ranks: the collectives, then return
            result["entry"] = probe(collective_sizes=sizes)
        else:
            result["entry"] = measure_collectives(sizes=sizes, repeat=5 if what not in ("missing", "dies") else 2)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(e).__name__}: {e}"
        result["error_after_s"] = time.monotonic() - started if "started" in locals() else None
        result["traceback"] = traceback.format_exc()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def _spawn(world: int, tmp: Path, what: str, timeout_s: float = 90.0) -> list[dict]:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, world, str(tmp / "init"), str(tmp), what), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    results = []
    for r, p in enumerate(procs):
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)
        path = tmp / f"rank{r}.pt"
        results.append(torch.load(path, weights_only=False) if path.exists() else {"rank": r, "exitcode": p.exitcode})
    return results


def test_two_gloo_ranks_time_the_collectives_and_fit_the_ring(tmp_path):
    r0, r1 = _spawn(2, tmp_path, "probe")
    assert "error" not in r0 and "error" not in r1, (r0.get("traceback"), r1.get("traceback"))
    e = r0["entry"]
    assert e["measured"] and e["world_size"] == 2 and e["nodes"] == 1 and e["rank"] == 0
    assert set(e["backends"]) == {"gloo"}  # no NCCL on the CPU, and it says why
    assert "nccl" in e["not_measured"] and "gloo" not in e["not_measured"]
    g = e["backends"]["gloo"]
    assert g["sizes"] == list(FIT_SIZES) and g["device"] == "cpu" and g["dropped_sizes"] == []
    # rank 1 ran the probe (it returned right after the collectives) and got the same figures: max over ranks
    assert r1["entry"] == {"rank": 1, "collectives": r1["entry"]["collectives"]}
    assert r1["entry"]["collectives"]["backends"]["gloo"]["seconds"] == g["seconds"]
    for kind in KINDS:
        assert len(g["seconds"][kind]) == len(FIT_SIZES) and all(t > 0 for t in g["seconds"][kind])
    for key in (*KINDS, "link"):
        fit = g["fits"][key]
        assert fit is not None, g["fit_errors"]
        assert fit["latency_s"] >= 0 and fit["bytes_per_s"] > 0 and fit["max_rel_error"] >= 0
        kinds = KINDS if key == "link" else (key,)
        for kind in kinds:  # every prediction within the error the fit reports
            for n, t in zip(FIT_SIZES, g["seconds"][kind]):
                steps, wire = ring_terms(kind, "gloo", n, 2)
                predicted = steps * fit["latency_s"] + wire / fit["bytes_per_s"]
                assert abs(predicted - t) <= fit["max_rel_error"] * t * (1 + 1e-9)
    # the measured link the report uses (one node): the fit, labelled measured
    links = measured_links({"collectives": e})
    assert links.nccl is None and links.gloo is not None and links.world == 2 and links.notes == ()
    assert links.gloo.bytes_per_s == g["fits"]["link"]["bytes_per_s"] and "MEASURED" in links.gloo.source
    # the probe's table renders it
    from rich.console import Console
    console = Console(record=True, width=200)
    cli._render_collectives(e, console)
    text = console.export_text()
    assert "gloo collectives over 2 ranks" in text and "ring fit, all three" in text
    assert "nccl collectives not measured: no CUDA device" in text


def test_a_rank_that_does_not_take_part_fails_the_others_within_the_timeout(tmp_path):
    r0, r1 = _spawn(2, tmp_path, "missing")
    assert r1.get("exitcode") == 3
    assert r0["error"].startswith("DistributedError: offload probe: rank 0's gloo")
    assert "Every rank of the group must run the probe" in r0["error"] and "10 s" in r0["error"]
    assert r0["error_after_s"] < 10 + 5  # the group's timeout bounds it


@pytest.mark.slow  # ~6 s on 2 cores; the default run keeps test_a_rank_that_does_not_take_part_fails_the_others_within_the_timeout
def test_a_rank_that_dies_midway_fails_the_other_and_says_where(tmp_path):
    r0, r1 = _spawn(2, tmp_path, "dies")
    assert r1.get("exitcode") == 3
    assert r0["error"].startswith("DistributedError: offload probe: rank 0's gloo")
    assert "256.00 KiB" in r0["error"] and r0["error_after_s"] < 10 + 5


@pytest.mark.slow  # ~4-9 s on 2 cores
def test_every_rank_keeps_the_sizes_every_rank_has_the_memory_for(tmp_path):
    r0, r1 = _spawn(2, tmp_path, "capped")
    assert "error" not in r0 and "error" not in r1, (r0.get("traceback"), r1.get("traceback"))
    g0, g1 = (r["entry"]["backends"]["gloo"] for r in (r0, r1))
    assert g0["sizes"] == g1["sizes"] == [64 << 10, 256 << 10]  # rank 0 had room for 1 MiB, rank 1 had not
    assert g0["dropped_sizes"] == [1 << 20]


def test_a_group_of_one_has_nothing_to_measure(tmp_path):
    (r0,) = _spawn(1, tmp_path, "measure")
    assert "error" not in r0, r0.get("traceback")
    e = r0["entry"]
    assert not e["measured"] and e["backends"] == {} and "one rank" in e["note"]
    links = measured_links({"collectives": e})
    assert (links.nccl, links.gloo) == (None, None) and "one rank" in links.notes[0]


def test_without_a_group_the_probe_has_no_collectives_entry(monkeypatch):
    import offload.tools.probe as probe_mod
    monkeypatch.setattr(probe_mod, "cpu_adam_params_per_s", lambda: 1e9)  # the rest is tested in test_cli.py
    monkeypatch.setattr(probe_mod, "host_bytes_per_s", lambda: 1e10)
    assert not torch.distributed.is_initialized()
    assert "collectives" not in probe_mod.probe()
    assert probe_mod.measure_collectives() is None


def test_offload_probe_fails_loudly_when_the_collectives_fail(monkeypatch, capsys):
    import offload.tools.probe
    from offload.errors import DistributedError

    def fail(**kwargs):
        raise DistributedError("offload probe: rank 0's gloo all_gather of 64.00 KiB over 2 ranks failed: reset")
    monkeypatch.setattr(offload.tools.probe, "probe", fail)
    assert cli.main(["probe"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("offload probe: error: offload probe: rank 0's gloo") and "Traceback" not in err


# -- offload report --hw probe.json -------------------------------------------------------------------------


def _side(a: float, bw: float, world: int = 2) -> dict:
    fit = {"latency_s": a, "bytes_per_s": bw, "max_rel_error": 0.05}
    secs = {k: [fit_ring_time(k, n, world, a, bw) for n in SIZES] for k in KINDS}
    return {"device": "cpu", "dtype": "float32", "repeat": 5, "sizes": list(SIZES), "dropped_sizes": [],
            "seconds": secs, "fits": {k: dict(fit) for k in (*KINDS, "link")}, "fit_errors": {}}


def fit_ring_time(kind: str, n: int, world: int, a: float, bw: float) -> float:
    steps, wire = ring_terms(kind, "gloo", n, world)
    return steps * a + wire / bw


def _probe_json(tmp_path: Path, nodes: int | None = 1, nccl: bool = False) -> str:
    backends = {"gloo": _side(200e-6, 0.2e9)}
    if nccl:
        backends["nccl"] = _side(8e-6, 150e9)
    data = {"hardware_model": PRESETS["pcie4"].to_dict(),
            "collectives": {"measured": True, "world_size": 2, "rank": 0, "nodes": nodes,
                            "machine": {"host": "testhost", "platform": "Linux"}, "backends": backends,
                            "not_measured": {}}}
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(data))
    return str(path)


def _report(capsys, *extra):
    rc = cli.main(["report", "--model", "gpt2", "--budget", "4GiB", "--host-ram", "64GiB", "--gpus", "4",
                   "--grad-reduce", "host", *extra])
    out = capsys.readouterr().out
    return rc, (json.loads(out)["data_parallel"] if "--json" in extra else out)


def test_report_uses_the_measured_gloo_link_and_says_so(capsys, tmp_path):
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"hardware_model": PRESETS["pcie4"].to_dict()}))
    rc, before = _report(capsys, "--hw", str(plain), "--json")
    assert rc == 0 and before["gloo_intra"] == "gloo-loopback"
    assert "link_origin" not in before  # a probe JSON without collectives: the report as it was
    rc, dp = _report(capsys, "--hw", _probe_json(tmp_path), "--json")
    assert rc == 0 and dp["gloo_intra"] == "gloo-measured" and dp["intra"] == "nvlink3"
    assert dp["link_origin"] == {"nvlink3": "nominal preset", "gloo-measured": "measured by offload probe"}
    assert "MEASURED by offload probe on testhost" in dp["links"]["gloo-measured"]
    assert any("measured on 2 ranks and is used for 4" in n and "extrapolated" in n for n in dp["link_notes"])
    assert dp["simulated"].startswith("cost model on the links of link_origin")
    # the measured link is the one costed: 0.2 GB/s against the preset's 3 GB/s: the host collectives take longer
    # (the reduce-scatter: on one node the ranks share the host copy by default, so nothing is all-gathered)
    assert dp["reduce_scatter_busy_s"] > 5 * before["reduce_scatter_busy_s"] > 0
    rc, text = _report(capsys, "--hw", _probe_json(tmp_path))
    assert rc == 0 and "links measured by offload probe: gloo-measured; nominal presets: nvlink3" in text
    assert "extrapolated in the ring model" in text


def test_report_takes_the_measured_nccl_link_unless_intra_is_given(capsys, tmp_path):
    rc, dp = _report(capsys, "--hw", _probe_json(tmp_path, nccl=True), "--json", "--grad-reduce", "device")
    assert rc == 0 and dp["intra"] == "nccl-measured" and dp["gloo_intra"] == "gloo-measured"
    assert set(dp["link_origin"].values()) == {"measured by offload probe"}
    rc, dp = _report(capsys, "--hw", _probe_json(tmp_path, nccl=True), "--json", "--intra", "nvlink4")
    assert rc == 0 and dp["intra"] == "nvlink4" and dp["link_origin"]["nvlink4"] == "nominal preset"
    assert any("--intra was given" in n for n in dp["link_notes"])


def test_report_does_not_use_a_fit_of_unknown_or_several_nodes(capsys, tmp_path):
    for nodes in (None, 2):
        rc, dp = _report(capsys, "--hw", _probe_json(tmp_path, nodes=nodes), "--json")
        assert rc == 0 and dp["gloo_intra"] == "gloo-loopback"
        assert set(dp["link_origin"].values()) == {"nominal preset"}
        assert any("not used" in n for n in dp["link_notes"])


def test_link_origins_without_measurements():
    assert link_origins({"nvlink3": "x"}, None, 8, False) == {"link_origin": {"nvlink3": "nominal preset"},
                                                              "link_notes": []}


def test_report_refuses_a_malformed_collectives_entry(capsys, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"hardware_model": PRESETS["pcie4"].to_dict(),
                                "collectives": {"measured": True, "backends": {}}}))
    rc = cli.main(["report", "--model", "gpt2", "--budget", "4GiB", "--gpus", "2", "--hw", str(path)])
    assert rc == 2 and "collectives entry is malformed" in capsys.readouterr().err


@pytest.mark.slow  # ~40 s: the default sizes up to 256 MiB, and rank 0's whole probe
def test_offload_probe_under_torchrun_writes_the_collectives(tmp_path):
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "probe.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        str(port), "-m", "offload", "probe", "--json", str(out), "--timeout", "60"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("offload probe") == 1 and r.stdout.count("wrote") == 1  # rank 0 alone prints
    assert "gloo collectives over 2 ranks (nodes: 1)" in r.stdout
    data = json.loads(out.read_text())
    coll = data["collectives"]
    assert coll["measured"] and coll["world_size"] == 2 and coll["nodes"] == 1 and set(coll["backends"]) == {"gloo"}
    assert measured_links(data).gloo is not None


@pytest.mark.parametrize("config, cuda, sides", [
    ("cpu:gloo,cuda:gloo", False, {"gloo"}),
    ("cpu:gloo,cuda:nccl", False, {"gloo"}),  # no CUDA device here: nothing for NCCL to move
    ("cpu:gloo,cuda:nccl", True, {"nccl", "gloo"}),
    ("cuda:nccl", True, {"nccl"}),  # an NCCL-only group: no host side to time
])
def test_the_sides_timed_are_the_groups_backends(monkeypatch, config, cuda, sides):
    """Which sides are timed, from the group's backend config (the CUDA half is faked: no GPU here, so the
    NCCL timings themselves have not run)."""
    import torch.distributed as dist

    from offload.tools import probe_collectives
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    got = probe_collectives.group_sides()
    assert set(got) == sides
    assert all(got[k].type == ("cuda" if k == "nccl" else "cpu") for k in got)
