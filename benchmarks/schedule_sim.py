"""Simulated step time of the greedy scheduler against other engines' placement rules and the physical
bound, on traces of real model shapes (built on the meta device: no weights, no GPU).

For each model, hardware preset and budget, every policy of ``offload.baselines`` runs on the same
simulator with the same trace, buckets and compute times. Compute times are *estimated* from each
operator's FLOPs and bytes on the preset's assumed device roofline (see ``offload/hw.py``); the hardware
presets are nominal figures, not measurements. What is measured in this run: how long tracing and
planning took on this machine.

Budget rule: the budget is the step's non-parameter device memory (saved activations, the largest grad,
module buffers) plus 10 %, 25 % or 50 % of the parameters' bf16 bytes, i.e. the share of the parameters
that could stay on the device.

    python benchmarks/schedule_sim.py --json benchmarks/results/schedule_sim.json
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

from offload.baselines import POLICIES, Case
from offload.buckets import make_buckets
from offload.config import format_bytes, parse_bytes
from offload.hw import PRESETS
from offload.metatrace import trace_meta
from offload.presets import MODELS, preset_inputs
from offload.schedule import least_traffic
from offload.simulate import physical_bound

CASES = (("gpt2-xl", 1, 1024), ("gpt3-6.7b", 1, 2048), ("bert-large", 8, 512))
FRACTIONS = (0.10, 0.25, 0.50)
ITEMSIZE = 2  # bf16 on the device


def machine() -> dict:
    return {"platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
            "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--models", default=",".join(c[0] for c in CASES))
    ap.add_argument("--hw", default="pcie4,pcie5")
    ap.add_argument("--bucket-bytes", default="32MiB")
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
    console.print(table)
    console.print(f"machine: {out['machine']}")
    console.print({k: round(v, 2) for k, v in out["timings_s"].items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
