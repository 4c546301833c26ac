"""Arena planner against its lower bound (max live bytes), on plans from real model traces and on random
interval sets, and how long planning takes.

Model plans: GPT-2 1.5B (gpt2-xl), BERT-large and GPT-3 6.7B (``offload.tools.presets``) are built on the meta device,
one training step is traced the way the engine traces it (``offload.tools.metatrace``), parameters are bucketed
(32 MiB of bf16, the default) and the device
buffers of each schedule strategy (everything streamed), and of ``build_plan`` at half the streamed
weights' size as budget (some buckets resident), are laid out. Random: 1,000 interval sets of three kinds,
plus one of 10,000 buffers for the time goal. The C++ layout is checked against the Python reference
(offload/planning/_reference.py) wherever the reference is fast enough.

    python benchmarks/arena_planner.py --json benchmarks/results/cpu-<date>/arena_planner.json

Goals (issue 6): arena <= 1.05x the lower bound on model plans; < 1 s for 10,000 buffers.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import describe, machine, median, print_table, write_json  # noqa: E402
from rich.console import Console  # noqa: E402

from offload.planning import _reference as arena_reference  # noqa: E402
from offload.planning.arena import Interval, plan_arena  # noqa: E402
from offload.planning.buckets import locate, make_buckets  # noqa: E402
from offload.planning.hw import load_hw  # noqa: E402
from offload.planning.layout import STRATEGIES, layout_buffers, strategy_intervals  # noqa: E402
from offload.planning.plan import ARENA_ALIGN  # noqa: E402
from offload.planning.schedule import build_plan  # noqa: E402
from offload.tools.metatrace import trace_meta  # noqa: E402
from offload.tools.presets import MODELS, preset_inputs  # noqa: E402

MODEL_NAMES = ("gpt2-xl", "bert-large", "gpt3-6.7b")  # GPT-2 1.5B, BERT-large, a 6.7B GPT

BUCKET_BYTES = 32 << 20
ITEMSIZE = 2  # bf16 on the device
REFERENCE_MAX_BUFFERS = 200  # the Python reference is quadratic Python: check it up to this size


def model_interval_sets(name: str, seq: int) -> list[tuple[str, list[Interval]]]:
    shape = MODELS[name]
    mt = trace_meta(shape.build("meta", torch.bfloat16), preset_inputs(shape, 1, seq), load_hw("pcie4"))
    trace = mt.trace
    buckets = make_buckets(mt.specs, mt.order, BUCKET_BYTES, ITEMSIZE)
    bucket_of = locate(buckets)[0]
    out = []
    for strategy in STRATEGIES:
        specs_, _ = layout_buffers(trace, buckets, ITEMSIZE, frozenset(), strategy_intervals(trace, buckets, bucket_of, strategy))
        out.append((f"{name}: {strategy.name}, all streamed", [Interval(x[4], x[2], x[3]) for x in specs_]))
    # The scheduler's own plan (offload.planning.schedule.build_plan) with half the weights' size as budget.
    half = sum(b.nbytes(ITEMSIZE) for b in buckets) // 2
    plan = build_plan(trace, buckets, itemsize=ITEMSIZE, budget_bytes=half + trace.activation_peak_bytes
                      + trace.max_grad_bytes, fixed_bytes=0, hw=load_hw("pcie4"))
    out.append((f"{name}: build_plan on pcie4, budget {half / 2**30:.1f} GiB + activations "
                f"({len(plan.resident)}/{len(buckets)} resident)",
                [Interval(b.size, b.start, b.end) for b in plan.buffers]))
    return out


def random_interval_set(rng: random.Random, family: str) -> list[Interval]:
    n = int(math.exp(rng.uniform(math.log(10), math.log(2000))))
    horizon = max(4, int(n * rng.uniform(0.5, 4)))
    out = []
    for _ in range(n):
        start = rng.randrange(horizon)
        if family == "training-like":  # bucket-sized buffers, short lifetimes, a few whole-step ones
            size = rng.choice([16, 24, 32, 32, 32]) * (1 << 20) - rng.randrange(0, 1 << 20)
            life = horizon if rng.random() < 0.05 else rng.randint(1, max(1, horizon // 20))
        elif family == "heavy-tailed":  # sizes and lifetimes spread over orders of magnitude
            size = int(math.exp(rng.uniform(math.log(256), math.log(256 << 20))))
            life = int(math.exp(rng.uniform(0, math.log(horizon)))) + 1
        else:  # uniform
            size = rng.randint(1, 1 << 20)
            life = rng.randint(1, max(1, horizon // 4))
        out.append(Interval(size, start, min(start + life, horizon + 1)))
    return out


def ten_thousand(rng: random.Random) -> list[Interval]:
    out = []
    for _ in range(10_000):
        start = rng.randrange(0, 20_000)
        size = rng.choice([1 << 20, 4 << 20, 16 << 20]) + rng.randrange(0, 1 << 20)
        out.append(Interval(size, start, start + rng.randrange(1, 400)))
    return out


def run_case(name: str, kind: str, intervals: list[Interval], repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        layout = plan_arena(intervals, ARENA_ALIGN)
        times.append((time.perf_counter() - t0) * 1e3)
    agrees = None
    if len(intervals) <= REFERENCE_MAX_BUFFERS or kind == "model":
        sizes, starts, ends = ([getattr(iv, f) for iv in intervals] for f in ("size", "start", "end"))
        offsets, total, winner, totals = arena_reference.plan(sizes, starts, ends, ARENA_ALIGN)
        agrees = (tuple(offsets) == layout.offsets and total == layout.total_bytes and winner == layout.heuristic
                  and totals == dict(layout.candidates))
    return {
        "name": name, "kind": kind, "buffers": len(intervals), "arena_bytes": layout.total_bytes,
        "lower_bound_bytes": layout.lower_bound_bytes, "plan_ms": round(median(times), 3),
        "ratio": round(layout.overhead, 5), "heuristic": layout.heuristic, "candidates": dict(layout.candidates),
        "reference_agrees": agrees,
    }


def short(heuristic: str) -> str:
    """"greedy_by_breadth+size_classes" -> "breadth+sc"."""
    return heuristic.replace("greedy_by_", "").replace("best_fit_by_", "").replace("+size_classes", "+sc")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--random-sets", type=int, default=1000)
    ap.add_argument("--seq", type=int, default=128, help="sequence length of the traced step (meta device)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    console = Console(width=160)
    info_before = machine()
    describe(console, info_before)

    cases = []
    for name in MODEL_NAMES:
        for case_name, intervals in model_interval_sets(name, args.seq):
            cases.append(run_case(case_name, "model", intervals, repeats=5))
    rng = random.Random(args.seed)
    families = ("training-like", "heavy-tailed", "uniform")
    for i in range(args.random_sets):
        family = families[i % 3]
        cases.append(run_case(f"random-{i} ({family})", "random", random_interval_set(rng, family), repeats=1))
    cases.append(run_case("random-10000 (10,000 buffers)", "random", ten_thousand(rng), repeats=5))

    model_rows = [[c["name"], c["buffers"], f"{c['arena_bytes'] / 2**20:.1f}", f"{c['lower_bound_bytes'] / 2**20:.1f}",
                   f"{c['ratio']:.4f}", short(c["heuristic"]), f"{c['plan_ms']:.2f}", c["reference_agrees"]]
                  for c in cases if c["kind"] == "model"]
    print_table("Arena planner on model plans (32 MiB bf16 buckets)",
                ["name", "buffers", "arena MiB", "lower bound MiB", "ratio", "heuristic", "plan ms", "ref agrees"],
                model_rows, console)
    random_rows = []
    for family in families:
        fc = [c for c in cases if c["kind"] == "random" and family in c["name"]]
        checked = [c["reference_agrees"] for c in fc if c["reference_agrees"] is not None]
        wins = {short(h): sum(c["heuristic"] == h for c in fc) for h in arena_reference.HEURISTICS}
        random_rows.append([family, len(fc), f"{sum(c['ratio'] for c in fc) / len(fc):.4f}",
                            f"{max(c['ratio'] for c in fc):.4f}", f"{max(c['plan_ms'] for c in fc):.2f}",
                            f"{sum(checked)}/{len(checked)}", " ".join(f"{h}:{k}" for h, k in wins.items() if k)])
    big = cases[-1]
    random_rows.append([big["name"], 1, f"{big['ratio']:.4f}", f"{big['ratio']:.4f}", f"{big['plan_ms']:.2f}",
                        "not checked", short(big["heuristic"])])
    print_table("Arena planner on random interval sets",
                ["name", "sets", "mean ratio", "max ratio", "max plan ms", "ref agrees", "winners (+sc: size classes)"],
                random_rows, console)

    model_max = max(c["ratio"] for c in cases if c["kind"] == "model")
    all_checked = [c["reference_agrees"] for c in cases if c["reference_agrees"] is not None]
    goals = {
        "model_ratio_max": model_max, "model_ratio_goal": 1.05, "model_ratio_met": model_max <= 1.05,
        "plan_ms_10000": big["plan_ms"], "plan_ms_10000_goal": 1000.0, "plan_ms_10000_met": big["plan_ms"] < 1000,
        "reference_checked": len(all_checked), "reference_agrees": all(all_checked),
    }
    console.print(f"goals: model plans max ratio {model_max:.4f} (goal <= 1.05: "
                  f"{'met' if goals['model_ratio_met'] else 'MISSED'}); 10,000 buffers {big['plan_ms']:.0f} ms "
                  f"(goal < 1000: {'met' if goals['plan_ms_10000_met'] else 'MISSED'}); Python reference agrees on "
                  f"{sum(all_checked)}/{len(all_checked)} checked cases")
    info_after = machine()
    write_json(args.json, {
        "benchmark": "arena_planner", "machine": info_before, "load_average_after": info_after["load_average"],
        "settings": {"bucket_bytes": BUCKET_BYTES, "itemsize": ITEMSIZE, "alignment": ARENA_ALIGN,
                     "seq": args.seq, "random_sets": args.random_sets, "seed": args.seed,
                     "reference_max_buffers": REFERENCE_MAX_BUFFERS},
        "goals": goals, "cases": cases,
    })
    return 0 if goals["reference_agrees"] else 1


if __name__ == "__main__":
    sys.exit(main())
