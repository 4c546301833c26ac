"""MEASURED data-parallel throughput on the CPU backend with gloo (issue 20): 1, 2 and 4 ranks on this machine.

Weak scaling: every rank trains the same MLP on its own batch of ``--batch`` samples, so ``samples/s =
N x batch / step``. Each rank is a process (spawned), all on this one machine: the ranks share its cores
(and its memory bandwidth) with each other and with whatever else runs here, so on a machine with fewer cores
than ranks x threads this measures contention as much as the engine; the load average is recorded before and
after. The step time of a step is the slowest rank's (an all-reduce of each rank's time, outside the timed
region). Per-rank host arena bytes come from ``engine.memory_stats()``.

Not done here: the simulation of these same runs beside the measurement (it needs a HardwareModel probed on
this CPU and a link model of gloo over loopback; ``benchmarks/scaling.py`` simulates GPU clusters on presets).

    python benchmarks/scaling_cpu.py --json benchmarks/results/scaling_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
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


def _rank(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    import offload
    torch.set_num_threads(max(1, args.threads))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    model = _model(args.width, args.depth)
    opt = offload.AdamW(model.parameters(), lr=1e-4)
    engine = offload.wrap(model, opt, budget=args.budget, dtype=torch.bfloat16, device="cpu",
                          bucket_bytes=args.bucket)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
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
        Path(out).write_text(json.dumps({"step_s": times, "host_bytes_per_rank": stats["host_pinned_bytes"],
                                         "params": sum(p.numel() for p in model.parameters())}))
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
    return {"ranks": world, "median_step_s": step, "samples_per_s": world * args.batch / step, **result}


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
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    before = machine()
    rows = [run(int(n), args) for n in args.ranks.split(",")]
    base = rows[0]["samples_per_s"] / rows[0]["ranks"]
    for r in rows:
        r["scaling_efficiency"] = r["samples_per_s"] / (r["ranks"] * base)
        print(f"{r['ranks']} rank(s): step {r['median_step_s'] * 1e3:8.1f} ms  {r['samples_per_s']:9.1f} samples/s  "
              f"efficiency {r['scaling_efficiency']:.2f}  host arena/rank {r['host_bytes_per_rank'] / 2**20:.1f} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps({"kind": "measured", "config": vars(args), "machine_before": before,
                                               "machine_after": machine(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
