"""Simulated step time of the greedy scheduler against other engines' placement rules and the physical
bound, on traces of real model shapes (built on the meta device: no weights, no GPU).

For each model, hardware preset and budget, every policy of ``offload.tools.baselines`` runs on the same
simulator with the same trace, buckets and compute times. Compute times are *estimated* from each
operator's FLOPs and bytes on the preset's assumed device roofline (see ``offload/planning/hw.py``); the hardware
presets are nominal figures, not measurements. What is measured in this run: how long tracing and
planning took on this machine.

Budget rule: the budget is the step's non-parameter device memory (saved activations, the largest grad,
module buffers) plus 10 %, 25 % or 50 % of the parameters' bf16 bytes, i.e. the share of the parameters
that could stay on the device.

    python benchmarks/schedule_sim.py --json benchmarks/results/schedule_sim.json
    python benchmarks/schedule_sim.py --models none --chain 1000,3000,10000   # planner speed only

``--chain N,...``: the planner's own speed on a plain stack of N one-parameter layers (N buckets, 4N trace
events), the issue's "< 1 s for 10,000 buckets" case: wall and CPU seconds of ``build_plan``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

from offload.config import format_bytes, parse_bytes
from offload.planning.buckets import ParamSpec, make_buckets
from offload.planning.hw import PRESETS
from offload.planning.schedule import build_plan, least_traffic
from offload.planning.simulate import physical_bound
from offload.planning.trace import EventKind, Recorder
from offload.tools.baselines import POLICIES, Case
from offload.tools.metatrace import trace_meta
from offload.tools.presets import MODELS, preset_inputs

CASES = (("gpt2-xl", 1, 1024), ("gpt3-6.7b", 1, 2048), ("bert-large", 8, 512))
FRACTIONS = (0.10, 0.25, 0.50)
ITEMSIZE = 2  # bf16 on the device


def machine() -> dict:
    return {"platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
            "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}


def chain(n: int, numel: int = 256):
    """A plain stack of ``n`` layers, one parameter (one bucket) each: forward 0..n-1, backward n-1..0."""
    rec = Recorder()
    rec.pre(n)
    for i in range(n):
        rec.pre(i)
        rec.touch(i)
        rec.post(i)
    rec.post(n)
    for i in reversed(range(n)):
        rec.unpack(i, object())
        rec.grad(i, numel * 4)
    trace = rec.finish()
    return trace, make_buckets([ParamSpec(numel, 0)] * n, list(range(n)), numel * 4, 4)


def time_chain(n: int) -> dict:
    """Wall and CPU seconds of build_plan on an n-bucket chain (budget: a quarter of the buckets)."""
    trace, buckets = chain(n)
    compute = [1e-5 if ev.kind in (EventKind.PRE, EventKind.UNPACK) else 0.0 for ev in trace.events]
    load = os.getloadavg()[0]
    w0, c0 = time.perf_counter(), time.process_time()
    plan = build_plan(trace, buckets, itemsize=4, budget_bytes=n * 1024 // 4, fixed_bytes=0, hw=PRESETS["pcie4"],
                      compute_s=compute)
    return {"buckets": n, "events": len(trace.events), "buffers": len(plan.buffers), "wall_s": time.perf_counter() - w0,
            "cpu_s": time.process_time() - c0, "load_avg_1m_before": load, "load_avg_1m_after": os.getloadavg()[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--models", default=",".join(c[0] for c in CASES))
    ap.add_argument("--hw", default="pcie4,pcie5")
    ap.add_argument("--bucket-bytes", default="32MiB")
    ap.add_argument("--chain", default="", help="comma-separated bucket counts: time build_plan on a layer chain")
    args = ap.parse_args()
    console = Console(width=None if sys.stdout.isatty() else 170)
    bucket_bytes = parse_bytes(args.bucket_bytes)
    out = {"machine": machine(), "bucket_bytes": bucket_bytes, "itemsize": ITEMSIZE,
           "budget_rule": "activations + largest grad + buffers + fraction x bf16 parameter bytes",
           "compute_times": "estimated: per-operator roofline on the preset's assumed device throughput",
           "cases": [], "timings_s": {}}
    wanted = args.models.split(",")
    table = Table(title="simulated step (s); x = over the budget")
    for col in ("model", "hw", "budget", "bound", "limit", *POLICIES, "greedy/bound"):
        table.add_column(col, justify="right" if col not in ("model", "hw", "limit") else "left")
    for name, batch, seq in (c for c in CASES if c[0] in wanted):
        shape = MODELS[name]
        t0 = time.perf_counter()
        with console.status(f"tracing {name} on the meta device"):
            mt = trace_meta(shape.build(dtype=torch.bfloat16), preset_inputs(shape, batch, seq), PRESETS["pcie4"])
        out["timings_s"][f"trace {name}"] = time.perf_counter() - t0
        buckets = make_buckets(list(mt.specs), list(mt.order), bucket_bytes, ITEMSIZE)
        param_bytes = sum(b.nbytes(ITEMSIZE) for b in buckets)
        extra = mt.trace.activation_peak_bytes + mt.trace.max_grad_bytes + mt.buffer_bytes
        for hw_name in args.hw.split(","):
            hw = PRESETS[hw_name]
            compute = mt.compute_s(hw)
            for frac in FRACTIONS:
                budget = extra + int(frac * param_bytes)
                case = Case(mt.trace, buckets, ITEMSIZE, hw, compute, budget, mt.buffer_bytes)
                least = least_traffic(mt.trace, buckets, ITEMSIZE, budget - extra)
                bound = physical_bound(sum(compute), least["h2d"], least["d2h"], least["adam_numel"], hw)
                row = {}
                for pname, policy in POLICIES.items():
                    t1 = time.perf_counter()
                    with console.status(f"{name} {hw_name} {frac:.0%}: {pname}"):
                        r = policy(case)
                    if pname == "greedy":
                        out["timings_s"][f"greedy {name} {hw_name} {frac:.0%}"] = time.perf_counter() - t1
                    row[pname] = r
                    out["cases"].append({
                        "model": name, "batch": batch, "seq": seq, "params": mt.numel, "budget_bytes": budget,
                        "budget_fraction": frac, "hw": hw_name, "policy": pname, "step_s": r.step_s,
                        "bound_s": bound.seconds, "bound_limit": bound.limit, "peak_bytes": r.peak_bytes,
                        "fits": r.fits, "stall_s": r.sim.stall_s if r.sim else None,
                        "h2d_bytes": r.sim.h2d_bytes if r.sim else None})
                g = row["greedy"].step_s
                cells = [f"{r.step_s:.3f}{'' if r.fits else ' x'}" if r.step_s is not None else "-"
                         for r in row.values()]
                table.add_row(name, hw_name, format_bytes(budget), f"{bound.seconds:.3f}", bound.limit, *cells,
                              f"{g / bound.seconds:.2f}" if g else "-")
    if out["cases"]:
        console.print(table)
    if args.chain:
        out["chain"] = []
        speed = Table(title="build_plan speed on a chain of one-bucket layers")
        for col in ("buckets", "events", "buffers", "wall s", "cpu s", "load before/after"):
            speed.add_column(col, justify="right")
        for n in (int(x) for x in args.chain.split(",")):
            with console.status(f"planning a {n}-bucket chain"):
                r = time_chain(n)
            out["chain"].append(r)
            speed.add_row(str(n), str(r["events"]), str(r["buffers"]), f"{r['wall_s']:.2f}", f"{r['cpu_s']:.2f}",
                          f"{r['load_avg_1m_before']:.1f}/{r['load_avg_1m_after']:.1f}")
        console.print(speed)
    console.print(f"machine: {out['machine']}")
    console.print({k: round(v, 2) for k, v in out["timings_s"].items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
