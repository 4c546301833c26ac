"""Fast steps on device-optimizer plans ([Note: device updates on a fast step] in offload/runtime/fast_path.py),
measured on the CPU backend: a step of a plan whose buckets all keep their weights resident, some or all with
their optimizer on the device, with the rule before that change (only all-``RESIDENT`` plans run fast: every step
takes the full path) and after it (fast steps).

Both engines train the same model (same weights, same batch) in one process, in blocks of ``--steps`` steps,
alternating (full, fast, fast, full, ...) ``--repeats`` times, so load from other processes hits both alike; step
times are the medians over blocks (minimum alongside), wall clock and CPU time (``time.process_time``: every
thread of the process). The hardware model given to the planner has a slow CPU AdamW (1e6 params/s), so that it
places optimizers on the device; the budget (a multiple of the fp32 weights) decides how many. The plan's
placement and the timed steps' counters (fast steps, departures, device updates) are recorded with each row.

This is the CPU backend: the "device" update is torch's AdamW on the host, and the full path's per-call hooks
are what the fast path saves. What it saves on a GPU (gpt2-xl's device-optimizer plan, run 8) is NOT measured here.

    python benchmarks/fast_devopt.py --json benchmarks/results/cpu-<date>/fast-devopt.json
    python benchmarks/fast_devopt.py --smoke   # tiny sizes, seconds: the harness, not the figures
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import describe, machine, median, print_table, write_json  # noqa: E402
from overhead import HP, Model, gpt_model, mlp_model, param_bytes, time_block  # noqa: E402
from rich.console import Console  # noqa: E402

import offload  # noqa: E402
from offload.planning.hw import PRESETS  # noqa: E402
from offload.planning.placement import Placement  # noqa: E402
from offload.runtime import fast_path  # noqa: E402

SLOW_CPU = dataclasses.replace(PRESETS["pcie4"], name="pcie4-slow-cpu-adam", adam_params_per_s=1e6)


@contextlib.contextmanager
def old_rule():
    """The rule before device-optimizer plans ran fast: only plans whose every bucket is RESIDENT."""
    kept = fast_path._WHOLE_STEP
    fast_path._WHOLE_STEP = (Placement.RESIDENT,)
    try:
        yield
    finally:
        fast_path._WHOLE_STEP = kept


class Run:
    """One engine with the device optimizer; ``old``: every step under the old rule (the full path)."""

    def __init__(self, model: Model, budget: int, old: bool) -> None:
        self.module = model.build()
        self.opt = offload.AdamW(self.module.parameters(), **HP)
        self.old = old
        weights = param_bytes(model)
        with self._rule():
            self.engine = offload.wrap(self.module, self.opt, budget=budget, bucket_bytes=max(weights // 10, 4096),
                                       dtype=torch.float32, device="cpu", hw=SLOW_CPU, device_optimizer=True)
        self.model = model

    def _rule(self):
        return old_rule() if self.old else contextlib.nullcontext()

    def step(self) -> None:
        with self._rule():
            loss = self.model.loss(self.engine(*self.model.batch))
            self.engine.backward(loss)
            self.opt.step()
            self.opt.zero_grad()

    def counters(self) -> dict:
        stats = self.engine.memory_stats()
        c = stats["counters"]
        return {"fast_steps": c["fast_steps"], "plan_departures": c["plan_departures"], "replans": c["replans"],
                "device_updates": stats["device_optimizer"]["updates"]}

    def placement(self) -> dict:
        plan = self.engine._runtime.executor.train_plan
        out: dict = {}
        for b in range(len(plan.buckets)):
            key = plan.placement_of(b).value
            out[key] = out.get(key, 0) + 1
        return out


def warmed(model: Model, budget: int, old: bool) -> Run:
    run = Run(model, budget, old)
    try:
        for _ in range(3):  # traced warm-up, planned step (verifies), one more
            run.step()
    except BaseException:
        run.engine.close()
        raise
    return run


def measure(model: Model, frac: float, steps: int, repeats: int) -> dict:
    """``frac`` x the fp32 weights, plus what the traced step says the rest needs (its activations) where the
    weights alone are not enough."""
    budget = int(frac * param_bytes(model))
    try:
        warmed(model, budget, old=False).engine.close()
    except offload.errors.BudgetTooSmallError as e:
        budget += e.min_budget_bytes
    runs = {"full": warmed(model, budget, old=True), "fast": warmed(model, budget, old=False)}
    try:
        before = {k: r.counters() for k, r in runs.items()}
        wall: dict = {"full": [], "fast": []}
        cpu: dict = {"full": [], "fast": []}
        for r in range(repeats):
            for name in (("full", "fast") if r % 2 == 0 else ("fast", "full")):
                w, c = time_block(runs[name], steps)
                wall[name].append(w)
                cpu[name].append(c)
        after = {k: r.counters() for k, r in runs.items()}
        row = {"model": model.name, "budget_x_weights": frac, "budget_bytes": budget,
               "placement": runs["fast"].placement(), "placement_full": runs["full"].placement(),
               "steps_per_block": steps, "blocks": repeats, "load_average": list(os.getloadavg())}
        for name in runs:
            row[f"{name}_ms"] = round(median(wall[name]), 3)
            row[f"{name}_min_ms"] = round(min(wall[name]), 3)
            row[f"{name}_cpu_ms"] = round(median(cpu[name]), 3)
            row[f"{name}_counters_timed"] = {k: after[name][k] - before[name][k] for k in after[name]}
        row["fast_over_full"] = round(row["fast_ms"] / row["full_ms"], 4)
        row["fast_over_full_cpu"] = round(row["fast_cpu_ms"] / row["full_cpu_ms"], 4)
        return row
    finally:
        for run in runs.values():
            run.engine.close()


def _placement(row: dict) -> str:
    """The fast engine's placement, and the full one's where it differs (each engine plans from its own traced
    compute times: under load they may place differently, and the comparison is then of two plans)."""
    def text(p: dict) -> str:
        return " ".join(f"{k} {v}" for k, v in p.items())
    same = row["placement"] == row["placement_full"]
    return text(row["placement"]) + ("" if same else f" (full path's plan: {text(row['placement_full'])})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--models", default="mlp,gpt", help="comma-separated: mlp, gpt")
    ap.add_argument("--budgets", default="2.5,4",
                    help="comma-separated multiples of the fp32 weights (plus the minimum budget where they alone do "
                         "not fit the activations)")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--steps", type=int, default=None, help="steps per block (default: mlp 20, gpt 3; smoke 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (as benchmarks/overhead.py)")
    ap.add_argument("--smoke", action="store_true", help="tiny models, few steps: checks the harness only")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = {"mlp": (mlp_model(6, 16, 4) if args.smoke else mlp_model(100, 64, 16), 20),
              "gpt": (gpt_model(2, 32, 2, 16, 2) if args.smoke else gpt_model(6, 256, 8, 128, 8), 3)}
    rows = []
    for name in args.models.split(","):
        model, default_steps = models[name]
        steps = 2 if args.smoke else (args.steps or default_steps)
        for frac in (float(f) for f in args.budgets.split(",")):
            rows.append(measure(model, frac, steps, 2 if args.smoke else args.repeats))
    console = Console()
    info = machine()
    describe(console, info)
    print_table("device-optimizer plans, all resident: full path (old rule) vs fast steps, CPU backend",
                ["model", "budget", "placement", "full ms", "fast ms", "fast/full", "full CPU ms", "fast CPU ms",
                 "fast/full CPU", "fast steps (full, fast)", "load"],
                [[r["model"], f"{r['budget_x_weights']}x", _placement(r),
                  r["full_ms"], r["fast_ms"], r["fast_over_full"], r["full_cpu_ms"], r["fast_cpu_ms"],
                  r["fast_over_full_cpu"],
                  f"{r['full_counters_timed']['fast_steps']}, {r['fast_counters_timed']['fast_steps']}",
                  " ".join(f"{x:.1f}" for x in r["load_average"])] for r in rows], console)
    if args.json:
        write_json(args.json, {"machine": info, "cases": rows, "smoke": args.smoke})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
