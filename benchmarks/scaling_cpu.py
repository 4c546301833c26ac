"""MEASURED data-parallel throughput on the CPU backend with gloo (issue 20): 1, 2 and 4 ranks on this machine.

Weak scaling: every rank trains the same MLP on its own batch of ``--batch`` samples, so ``samples/s =
N x batch / step`` (times ``--micro-batches``). Each rank is a process (spawned), all on this one machine: the
ranks share its cores (and its memory bandwidth) with each other and with whatever else runs here, so on a
machine with fewer cores than ranks x threads this measures contention as much as the engine; the load average
is recorded before and after. The step time of a step is the slowest rank's (an all-reduce of each rank's
time, outside the timed region). Per-rank host arena bytes come from ``engine.memory_stats()``.

Beside each measurement, the simulation of the same run on the path the runtime runs
(``offload.planning.data_parallel_runtime``, [Note: the runtime's data-parallel step]: rank 0's plan, whole
buckets copied, gloo's reduce-scatter (an all-reduce), the shard's AdamW and gloo's all-gather one after the
other on the CPU lane), and its relative error; the design path's simulation (``data_parallel.py``: not what
runs) is recorded beside it for comparison. Their inputs, all measured in this run: the compute seconds per
event of rank 0's own last traced step (``Trace.compute_seconds``: the runtime's waits and fetches
excluded), the CPU AdamW rate (``offload probe``'s measurement of the engine's update with this run's threads
per rank, times ``min(ranks, cpus)``: the node's rate, which the simulator shares among the ranks as among a
node's G ranks), the copy rate of the CPU backend's lanes and host copies (a host memcpy), and gloo over
loopback between these ranks: the all-reduce timed at two sizes in the spawned group gives the bandwidth
and latency of the ring of [Note: gloo's collectives] (the all-reduce, since a reduce-scatter is one). The
three collectives a bucket runs are timed at 8 MiB beside the model's figures for them (with the host copies
the runtime's lane makes), as a check of that part of the model.

    python benchmarks/scaling_cpu.py --json benchmarks/results/scaling_cpu.json

``--micro-batches K`` (K > 1) measures the deferred path instead (``overlap_optimizer=False``: K forward and
backward passes per step, accumulated on the host; ``--no-sync``: the first K - 1 inside ``engine.no_sync()``,
DDP's idiom), beside ``simulate_runtime_deferred`` ([Note: the runtime's deferred data-parallel step]) of the
same K and no_sync; the design path models no accumulation and is then not recorded.

The ranks all run on this one host, so the engine shares one host copy of the weights between them by default
(``share_host_copy=None``: [Note: one host copy per node]): each rank's AdamW writes its shard into it and one
small check per backward replaces the all-gathers of the weights ([Note: the shared copy checked once per
backward]; one per bucket until 2026-11-27). ``--share-host-copy no`` runs each rank with its
own copy (``share_host_copy=False``: gloo's all-gather per bucket), ``yes`` requires the shared one. Whether
the run shared (``engine.memory_stats()["host_shared_bytes"]``) is recorded per row (``host_copy``) and the
simulation models what ran ([Note: the runtime's shared host copy]: ``shared=``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def _gloo_times(world: int, sizes: tuple[int, ...] = (1 << 12, 1 << 23), repeat: int = 5) -> dict:
    """Median seconds of gloo's all-reduce, reduce-scatter and all-gather of buffers of ``sizes`` bytes (fp32;
    the buffer is the whole one: a reduce-scatter's input, an all-gather's output) over this group."""
    import torch.distributed as dist
    # torch 2.13 names them *_single (the *_tensor names warn), as offload/runtime/distributed.py does
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    out: dict = {}
    for nbytes in sizes:
        full = torch.zeros(nbytes // 4)
        mine = full.new_empty(full.numel() // world)
        for name, call in (("all_reduce", lambda: dist.all_reduce(full)), ("reduce_scatter", lambda: reduce_scatter(
                mine, full)), ("all_gather", lambda: all_gather(full, mine))):
            times = []
            for _ in range(repeat):
                dist.barrier()
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            out[f"{name} {nbytes}"] = statistics.median(times)
    return out


def _gloo_link(world: int, times: dict, sizes: tuple[int, int] = (1 << 12, 1 << 23)) -> tuple[float, float]:
    """(bytes/s per hop, seconds per ring step) of gloo over this group, fitted to the all-reduce's times at a
    small and a large size: ``AR(S) = 2 (p - 1) (a + S / (p B))`` ([Note: gloo's collectives]) solved for a, B.
    The all-reduce, since a reduce-scatter is one (the larger of the two collectives a bucket runs)."""
    if world == 1:
        return 1e12, 0.0
    took = [times[f"all_reduce {n}"] for n in sizes]
    steps = 2 * (world - 1)
    big, small = sizes[1] * steps / world, sizes[0] * steps / world
    bandwidth = (big - small) / max(took[1] - took[0], 1e-9)
    latency = max(0.0, (took[0] - small / bandwidth) / steps)
    return bandwidth, latency


def simulate(plan, compute_s, world: int, args: argparse.Namespace, link: tuple[float, float],
             shared: bool = False) -> dict:
    """The simulated step of one rank of ``world`` running ``plan``, on the runtime's path and, beside it,
    the design's (see the module docstring). ``shared``: the run's ranks shared one host copy."""
    from offload.planning.collectives import Cluster, Link, gloo_all_reduce_seconds
    from offload.planning.data_parallel import simulate_rank_plan
    from offload.planning.data_parallel_deferred import simulate_runtime_deferred_plan
    from offload.planning.data_parallel_runtime import (
        all_gather_lane_seconds,
        reduce_scatter_lane_seconds,
        simulate_runtime_plan,
    )
    from offload.planning.hw import HardwareModel, latency_curve
    curve = latency_curve(args.copy_bytes_per_s, 0.0)
    node_adam = args.adam_params_per_s * min(world, os.cpu_count() or 1)  # the lanes give each rank 1/world of it
    hw = HardwareModel("cpu backend (measured here)", curve, curve, duplex_factor=1.0,
                       adam_params_per_s=node_adam, host_bytes_per_s=2 * args.copy_bytes_per_s,
                       device_flops_per_s=1e11, device_bytes_per_s=args.copy_bytes_per_s, measured=True)
    gloo = Link("gloo-loopback", link[0], link[1], source="measured in this run (all-reduce, two sizes)")
    cluster = Cluster(gpus_per_node=world, intra=gloo)
    if args.micro_batches > 1:  # the deferred path; the design path models no accumulation
        sim = simulate_runtime_deferred_plan(plan, hw, cluster, compute_s, args.micro_batches, args.no_sync,
                                             shared=shared)
        design_s = None
    else:
        sim = simulate_runtime_plan(plan, hw, cluster, compute_s, shared=shared)
        design_s = simulate_rank_plan(plan, hw, cluster, compute_s).step_s
    return {"path": "runtime", "predicted_step_s": sim.step_s, "predicted_compute_s": sim.sim.compute_s,
            "deferred": sim.deferred, "micro_batches": sim.micro_batches, "no_sync": sim.no_sync,
            "predicted_all_reduce_s": sim.all_reduce_busy_s, "predicted_accumulate_s": sim.accumulate_busy_s,
            "predicted_all_gather_s": sim.all_gather_busy_s, "predicted_reduce_scatter_s": sim.reduce_scatter_busy_s,
            "predicted_cpu_lane_s": sim.cpu_lane_busy_s, "predicted_check_s": sim.check_busy_s,
            "simulated_host_copy": sim.host_copy, "predicted_step_s_design": design_s,
            "modelled_8MiB_s": {"all_reduce": gloo_all_reduce_seconds(1 << 23, cluster),
                                "reduce_scatter": reduce_scatter_lane_seconds(1 << 23, hw, cluster),
                                "all_gather": all_gather_lane_seconds(1 << 23, hw, cluster)},
            "gloo_bytes_per_s": link[0] if world > 1 else None, "gloo_latency_s": link[1] if world > 1 else None}


def _rank(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    import offload
    torch.set_num_threads(max(1, args.threads))
    # before the group: imported after it, torch keeps the group alive past destroy_process_group() and a gloo
    # thread can abort the exiting process (tests/distributed/workers.py says how)
    importlib.import_module("torch._dynamo")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    gloo_times = _gloo_times(world) if world > 1 else {}
    link = _gloo_link(world, gloo_times)
    model = _model(args.width, args.depth)
    opt = offload.AdamW(model.parameters(), lr=1e-4)
    k = args.micro_batches
    share = {"auto": None, "yes": True, "no": False}[args.share_host_copy]
    engine = offload.wrap(model, opt, budget=args.budget, dtype=torch.bfloat16, device="cpu",
                          bucket_bytes=args.bucket, share_host_copy=share,
                          **({"overlap_optimizer": False} if k > 1 else {}))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        for j in range(k):  # --micro-batches: accumulated, the first k - 1 inside no_sync with --no-sync
            with engine.no_sync() if args.no_sync and j < k - 1 else contextlib.nullcontext():
                loss = engine(x).float().pow(2).mean()
                engine.backward(loss)
        engine.step()
        engine.wait_for_updates()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's step
        if step >= args.warmup:
            times.append(float(dt))
    stats = engine.memory_stats()
    if rank == 0:
        rt = engine._runtime  # the plan it executed and its last trace: the public API has only their summary
        plan, trace = rt.executor.plan, rt.executor.trace
        predicted = {}
        shared = stats.get("host_shared_bytes", 0) > 0  # what ran: the node's one copy, or each rank's own
        if plan is not None and trace is not None:
            predicted = simulate(plan, trace.compute_seconds, world, args, link, shared)
        Path(out).write_text(json.dumps({"step_s": times, "host_bytes_per_rank": stats["host_pinned_bytes"],
                                         "host_copy": "shared" if shared else "per rank",
                                         "host_shared_bytes": stats.get("host_shared_bytes", 0),
                                         "params": sum(p.numel() for p in model.parameters()),
                                         "resident": len(plan.resident) if plan else None,
                                         "buckets": len(plan.buckets) if plan else None,
                                         "measured_8MiB_s": {k.split()[0]: v for k, v in gloo_times.items()
                                                             if k.endswith(str(1 << 23))},
                                         "gloo_times_s": gloo_times, **predicted}))
    engine.close()
    dist.destroy_process_group()


def run(world: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, world, os.path.join(tmp, "init"), args, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
            if p.is_alive():
                p.kill()
                raise SystemExit(f"{world} ranks: a rank hung")
        if any(p.exitcode for p in procs):
            raise SystemExit(f"{world} ranks: a rank failed ({[p.exitcode for p in procs]})")
        result = json.loads(Path(out).read_text())
    step = statistics.median(result["step_s"])
    row = {"ranks": world, "median_step_s": step, "samples_per_s": world * args.batch * args.micro_batches / step,
           **result}
    if "predicted_step_s" in row:
        row["relative_error"] = (row["predicted_step_s"] - step) / step
        design = row["predicted_step_s_design"]
        row["relative_error_design"] = (design - step) / step if design is not None else None
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64, help="samples per rank")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--budget", default="16MiB", help="device budget per rank (below the weights: streamed)")
    ap.add_argument("--bucket", default="2MiB")
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="forward/backward passes per step; > 1: deferred updates (overlap_optimizer=False)")
    ap.add_argument("--no-sync", action="store_true", help="the first micro-batches - 1 inside engine.no_sync()")
    ap.add_argument("--share-host-copy", choices=("auto", "yes", "no"), default="auto",
                    help="OffloadConfig.share_host_copy: auto (None, the default: shared on one host), yes, no")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from offload.tools.probe import cpu_adam_params_per_s, host_bytes_per_s
    torch.set_num_threads(max(1, args.threads))  # as each rank runs
    args.adam_params_per_s = cpu_adam_params_per_s()
    args.copy_bytes_per_s = host_bytes_per_s(1 << 26) / 2  # it counts the read and the write
    before = machine()
    rows = [run(int(n), args) for n in args.ranks.split(",")]
    base = rows[0]["samples_per_s"] / rows[0]["ranks"]
    for r in rows:
        r["scaling_efficiency"] = r["samples_per_s"] / (r["ranks"] * base)
        sim = (f"  simulated, runtime path {r['predicted_step_s'] * 1e3:8.1f} ms (error {r['relative_error']:+.0%}); "
               + (f"design path {r['predicted_step_s_design'] * 1e3:8.1f} ms ({r['relative_error_design']:+.0%})"
                  if r["predicted_step_s_design"] is not None else "design path: no accumulation modelled")
               if "predicted_step_s" in r else "  simulated: no plan")
        if r["ranks"] > 1 and "modelled_8MiB_s" in r:
            sim += "; 8 MiB measured / modelled: " + ", ".join(
                f"{k} {r['measured_8MiB_s'][k] * 1e3:.1f} / {v * 1e3:.1f} ms" for k, v in r["modelled_8MiB_s"].items())
        print(f"{r['ranks']} rank(s): step {r['median_step_s'] * 1e3:8.1f} ms  {r['samples_per_s']:9.1f} samples/s  "
              f"efficiency {r['scaling_efficiency']:.2f}  host arena/rank {r['host_bytes_per_rank'] / 2**20:.1f} MiB"
              f" + shared {r['host_shared_bytes'] / 2**20:.1f} MiB/node (host copy: {r['host_copy']})" + sim)
    if args.json:
        Path(args.json).write_text(json.dumps({"kind": "measured", "simulated_beside": True,
                                               "simulated_path": "runtime (offload/planning/data_parallel_runtime.py)"
                                                                 "; the design path's prediction beside it",
                                               "host_copy": "per row: shared (the node's one copy, simulated with "
                                                            "shared=True) or per rank, as the engine ran",
                                               "config": vars(args),
                                               "machine_before": before,
                                               "machine_after": machine(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
