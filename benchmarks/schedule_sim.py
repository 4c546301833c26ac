"""Simulated step time of the greedy scheduler against other engines' placement rules and the physical
bound, on traces of real model shapes (built on the meta device: no weights, no GPU).

For each model, hardware preset and budget, every policy of ``offload.tools.baselines`` runs on the same
simulator with the same trace, buckets and compute times. Compute times are *estimated* from each
operator's FLOPs and bytes on the preset's assumed device roofline (see ``offload/planning/hw.py``); the hardware
presets are nominal figures, not measurements. What is measured in this run: how long tracing and
planning took on this machine.

Budget rules: (1) the step's non-parameter device memory (saved activations, the largest grad, module
buffers) plus 10 %, 25 % or 50 % of the parameters' bf16 bytes, i.e. the share of the parameters that could
stay on the device; (2) realistic GPU budgets (issue 18): gpt2-xl at 8 and 24 GiB, gpt3-6.7b at 40 GiB,
llama-7b at 24 and 80 GiB, llama-13b at 80 GiB.

Two bounds per case: ``bound_s``, with every update on the CPU (least traffic; measures the scheduler), and
``bound_placement_s``, the least over every placement that fits (device optimizer state included;
[Note: the placement bound] in offload/planning/placement.py), which the goals are measured against; and
``bound_placement_causal_s``, the same with the grad copies and the CPU AdamW starting no earlier than
backward (no grad exists before it): also a true lower bound, tighter where the CPU AdamW is the wall.
Every number is SIMULATED on nominal presets, not measured on a GPU.

    python benchmarks/schedule_sim.py --json benchmarks/results/schedule_sim.json
    python benchmarks/schedule_sim.py --models none --chain 1000,3000,10000   # planner speed only

``--explain``: per case, the greedy plan's lanes (compute, of it the device AdamW; stall; H2D, D2H and CPU
AdamW busy; the tail after compute), each bucket's placement in first-use order (``D`` device optimizer,
``r`` resident, ``k`` kept from forward to backward, ``.`` streamed), and the causal bound's terms: where
the greedy loses against the bound. No block is checkpointed in these traces (the meta trace records a step
without activation checkpointing; the simulator has no recompute model), so a case whose activations alone
exceed the budget fits no plan and no baseline.

``--checkpointing``: the realistic GiB cases again with activation checkpointing weighed (issue 18: the
planner must weigh streaming, device optimizer state and checkpointing): each policy runs with 0, 1/4, 1/2,
3/4 and all of the model's blocks checkpointed (largest saving first, as ``choose_checkpoints`` orders
them) and keeps its fastest fitting choice, as a user tuning it would; a MODEL of the checkpointed step
([Note: the recompute model] in offload/planning/activations.py: activation bytes estimated per block on the
meta device, each block's forward recomputed in one lump where backward reaches it). Summarised apart
(``goals_with_checkpointing``).

The greedy plans and is simulated with resident buckets' refreshes pipelined as the engine's runtime issues
them with overlapped updates (``build_plan(..., refresh_pipelined=True)``, what the engine plans with since
session 23: [Note: the refresh pipelined, modelled] in offload/planning/simulate.py); ``--refresh-after-drain``
plans it with the refresh after the CPU lane's drain instead (the model before, for comparison). The baselines keep the
refresh after their CPU step: DeepSpeed's ZeRO-Offload copies a param group's fp16 partition back only after
that group's whole CPU step (``stage_1_and_2.py`` ``step()``), and ZeRO-3, Gemini and double buffering are
modelled with their updates after backward or streamed weights, as before.

``--chain N,...``: the planner's own speed on a plain stack of N one-parameter layers (N buckets, 4N trace
events), the issue's "< 1 s for 10,000 buckets" case: wall and CPU seconds of ``build_plan``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from offload.config import format_bytes, parse_bytes
import torch

from offload.planning.activations import checkpointed_step
from offload.planning.buckets import ParamSpec, make_buckets
from offload.planning.hw import PRESETS
from offload.planning.placement import placement_bound, placement_bytes
from offload.planning.schedule import build_plan, least_traffic
from offload.planning.simulate import physical_bound
from offload.planning.trace import EventKind, Recorder
from offload.errors import BudgetTooSmallError
from offload.tools.baselines import POLICIES, Case, PolicyResult
from offload.tools.presets import MODELS, preset_inputs
from offload.tools.report_activations import measure_activations

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import brief_machine, trace_preset  # noqa: E402

CASES = (("gpt2-xl", 1, 1024), ("gpt3-6.7b", 1, 2048), ("bert-large", 8, 512), ("llama-7b", 1, 2048),
         ("llama-13b", 1, 2048))
FRACTIONS = (0.10, 0.25, 0.50)
FRACTION_MODELS = ("gpt2-xl", "gpt3-6.7b", "bert-large")  # the budget rule (1) cases, as before issue 18
GIB_BUDGETS = {"gpt2-xl": (8, 24), "gpt3-6.7b": (40,), "llama-7b": (24, 80), "llama-13b": (80,)}  # rule (2)
GOALS = {"zero-offload": 1.5, "twin-flow": 1.25, "gemini-cpu": 2.13, "zero3-offload": 2.2}  # median speedup
BOUND_GOAL = 1.15  # median greedy / bound_placement_s at most
ITEMSIZE = 2  # bf16 on the device


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


def time_chain(n: int, device_optimizer: bool = False, refresh_pipelined: bool = False) -> dict:
    """Wall and CPU seconds of build_plan on an n-bucket chain (budget: a quarter of the buckets)."""
    trace, buckets = chain(n)
    compute = [1e-5 if ev.kind in (EventKind.PRE, EventKind.UNPACK) else 0.0 for ev in trace.events]
    load = os.getloadavg()[0]
    w0, c0 = time.perf_counter(), time.process_time()
    plan = build_plan(trace, buckets, itemsize=4, budget_bytes=n * 1024 // 4, fixed_bytes=0, hw=PRESETS["pcie4"],
                      compute_s=compute, device_optimizer=device_optimizer, refresh_pipelined=refresh_pipelined)
    return {"buckets": n, "events": len(trace.events), "buffers": len(plan.buffers), "device_optimizer": device_optimizer,
            "refresh_pipelined": refresh_pipelined,
            "wall_s": time.perf_counter() - w0,
            "cpu_s": time.process_time() - c0, "load_avg_1m_before": load, "load_avg_1m_after": os.getloadavg()[0]}


def plan_placement(plan) -> dict[str, int]:
    """Device bytes per placement tier of a greedy plan (16-bit weights; and the device optimizer state)."""
    if plan is None:
        return {}
    return placement_bytes(plan.buckets, plan.itemsize, [plan.placement_of(b) for b in range(len(plan.buckets))])


def finite(x: float) -> float | None:
    """JSON has no infinity: a bound of no placement that fits is null (its limit says "memory")."""
    return x if x != float("inf") else None


def explain(console: Console, title: str, case: Case, greedy_result, causal) -> None:
    """Print where the greedy plan's step goes, beside the causal placement bound's terms (``--explain``)."""
    console.print(f"[bold]{title}[/bold]: causal bound {causal.seconds:.3f} s ({causal.limit}), terms "
                  + ", ".join(f"{k} {v / 2**30 if k == 'device_bytes' else v:.3f}{' GiB' if k == 'device_bytes' else ''}"
                              for k, v in causal.parts.items()))
    if not greedy_result.fits:
        console.print(f"  greedy: no plan fits; the least budget is {format_bytes(greedy_result.peak_bytes)} "
                      f"(activations {format_bytes(case.trace.activation_peak_bytes)})")
        return
    plan, sim = greedy_result.plan, greedy_result.sim
    forward = sum(case.compute_s[:case.trace.num_forward])
    console.print(f"  greedy {sim.step_s:.3f} s: compute {sim.compute_s:.3f} (device AdamW {sim.device_adam_s:.3f}, "
                  f"forward {forward:.3f}), stall {sim.stall_s:.3f} (grad slots {sim.grad_stall_s:.3f}), H2D {sim.h2d_busy_s:.3f}, D2H {sim.d2h_busy_s:.3f}, "
                  f"CPU AdamW {sim.adam_s:.3f}, tail after compute {sim.tail_s:.3f}")
    kept = {x.bucket for x in plan.buffers if x.kind.name == "PARAM" and x.start < plan.trace.num_forward <= x.end
            and x.bucket not in plan.resident}
    marks = {"device-optimizer": "D", "resident": "r", "streamed": "."}
    row = "".join("k" if b in kept and plan.placement_of(b).value == "streamed" else marks[plan.placement_of(b).value]
                  for b in range(len(plan.buckets)))
    console.print(f"  placement ({len(plan.buckets)} buckets, first use first): {row}")
    console.print("  checkpointed blocks: none (not modelled in these traces)")


def greedy_pipelined(case: Case) -> PolicyResult:
    """``baselines.greedy`` (device optimizer state allowed) with the pipelined refresh modelled."""
    try:
        plan = build_plan(case.trace, case.buckets, itemsize=case.itemsize, budget_bytes=case.budget_bytes,
                          fixed_bytes=case.fixed_bytes, hw=case.hw, compute_s=case.compute_s, device_optimizer=True,
                          refresh_pipelined=True)
    except BudgetTooSmallError as e:
        return PolicyResult("greedy", None, e.min_budget_bytes, False)
    return PolicyResult("greedy", plan.simulated, plan.peak_bytes, True, plan=plan)


def run_case(case: Case, row_base: dict, extra: int, out: list, policies=POLICIES) -> dict:
    """Every policy on one case; appends its JSON rows to ``out``; returns the table cells' inputs."""
    trace, buckets, hw = case.trace, case.buckets, case.hw
    compute = case.compute_s
    cap = case.budget_bytes - extra
    least = least_traffic(trace, buckets, ITEMSIZE, cap)
    bound = physical_bound(sum(compute), least["h2d"], least["d2h"], least["adam_numel"], hw)
    bound_p = placement_bound(trace, buckets, ITEMSIZE, cap, sum(compute), hw)
    causal = placement_bound(trace, buckets, ITEMSIZE, cap, sum(compute), hw,
                             forward_s=sum(compute[:trace.num_forward]))
    row = {}
    for pname, policy in policies.items():
        t1 = time.perf_counter()
        r = policy(case)
        row[pname] = r
        entry = {**row_base, "policy": pname, "step_s": r.step_s, "bound_s": bound.seconds,
                 "bound_limit": bound.limit, "bound_placement_s": finite(bound_p.seconds),
                 "bound_placement_limit": bound_p.limit, "bound_placement_device_bytes": bound_p.parts["device_bytes"],
                 "bound_placement_causal_s": finite(causal.seconds), "bound_placement_causal_limit": causal.limit,
                 "peak_bytes": r.peak_bytes, "fits": r.fits, "stall_s": r.sim.stall_s if r.sim else None,
                 "grad_stall_s": r.sim.grad_stall_s if r.sim else None,
                 "h2d_bytes": r.sim.h2d_bytes if r.sim else None}
        if pname == "greedy":
            entry["plan_s"] = time.perf_counter() - t1
            entry["placement"] = plan_placement(r.plan)
            entry["strategy"] = r.plan.strategy if r.plan is not None else None
        if r.ratio is not None:
            entry["ratio"] = r.ratio
        out.append(entry)
    return {"bound": bound, "bound_p": bound_p, "causal": causal, "row": row}


MEDIAN_NOTE = ("median_speedup: median over the cases where greedy fits of (baseline step / greedy step), a "
               "baseline that does NOT fit the budget counted too, with the step it would take if it did (it "
               "needs more memory than the budget: a lower bound of what it costs there, so these medians "
               "flatter no one but are not like-for-like); median_speedup_where_it_fits: only the cases where the "
               "baseline itself fits. ceiling_*: the same medians with greedy replaced by a bound, i.e. the most "
               "any plan could gain in this model: bound_placement_causal_s (grads and CPU AdamW no earlier than "
               "backward, the forward's unavoidable transfer first; the causal form) and bound_placement_s (the "
               "issue's formula, which lets the CPU AdamW overlap the forward, where no grad exists yet). "
               "cases_where_the_causal_bound_reaches_the_goal: in how many cases even that bound reaches the "
               "goal; where it does not, no plan can.")


CKPT_SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)  # --checkpointing: shares of the blocks tried per policy


def run_checkpointed(name: str, batch: int, seq: int, case: Case, row_base: dict, out: list,
                     policies=POLICIES) -> None:
    """``--checkpointing``: every policy on ``case`` with each share of the blocks checkpointed (largest
    saving first); its fastest fitting choice (or, where none fits, none checkpointed) as its row, with
    ``checkpointed_blocks``. The bounds are the chosen step's, for the greedy's choice."""
    shape = MODELS[name]
    profile = measure_activations(shape.build(dtype=torch.bfloat16), preset_inputs(shape, batch, seq))
    order = [b.module for b in sorted(profile.blocks, key=lambda b: (-(b.saved - b.inputs), b.module))
             if b.saved > b.inputs]
    variants = []
    for share in CKPT_SHARES:
        chosen = order[:round(share * len(order))]
        trace, compute = checkpointed_step(case.trace, case.compute_s, profile, chosen)
        variants.append((len(chosen), Case(trace, case.buckets, case.itemsize, case.hw, compute, case.budget_bytes,
                                           case.fixed_bytes)))
    rows: list[dict] = []
    greedy_case = variants[0][1]
    for pname, policy in policies.items():
        best = None
        for k, c in variants:
            r = policy(c)
            if best is None or (r.fits and (not best[1].fits or r.step_s < best[1].step_s)):
                best = (k, r, c)
        k, r, c = best
        if pname == "greedy":
            greedy_case = c
        rows.append({**row_base, "policy": pname, "step_s": r.step_s, "fits": r.fits, "peak_bytes": r.peak_bytes,
                     "checkpointed_blocks": k, "blocks": len(order), "activation_bytes": c.trace.activation_peak_bytes,
                     **({"placement": plan_placement(r.plan)} if pname == "greedy" else {}),
                     **({"ratio": r.ratio} if r.ratio is not None else {})})
    c = greedy_case
    cap = c.budget_bytes - c.extra
    bound_p = placement_bound(c.trace, c.buckets, ITEMSIZE, cap, sum(c.compute_s), c.hw)
    causal = placement_bound(c.trace, c.buckets, ITEMSIZE, cap, sum(c.compute_s), c.hw,
                             forward_s=sum(c.compute_s[:c.trace.num_forward]))
    for row in rows:
        row.update(bound_placement_s=finite(bound_p.seconds), bound_placement_limit=bound_p.limit,
                   bound_placement_causal_s=finite(causal.seconds), bound_placement_causal_limit=causal.limit)
    out.extend(rows)


def summarise(cases: list[dict]) -> dict:
    """The issue's goals over the cases where greedy fits: median speedup over each baseline (see
    ``MEDIAN_NOTE``), beside the most any plan could gain (the same median against the placement bounds),
    median greedy / bound_placement_s, and where greedy is slower than a baseline that fits."""
    by_case: dict[tuple, dict[str, dict]] = {}
    for c in cases:
        by_case.setdefault((c["model"], c["hw"], c["budget_bytes"]), {})[c["policy"]] = c
    others = [p for p in POLICIES if p != "greedy"]
    speedups: dict[str, list[float]] = {p: [] for p in others}
    speedups_fit: dict[str, list[float]] = {p: [] for p in others}
    ceiling: dict[str, list[float]] = {p: [] for p in others}  # baseline / causal bound
    ceiling_fit: dict[str, list[float]] = {p: [] for p in others}
    ceiling_formula: dict[str, list[float]] = {p: [] for p in others}  # baseline / bound_placement_s
    to_bound, to_causal, slower = [], [], []
    for key, rows in by_case.items():
        g = rows["greedy"]
        if not g["fits"]:
            continue
        to_bound.append(g["step_s"] / g["bound_placement_s"])
        to_causal.append(g["step_s"] / g["bound_placement_causal_s"])
        for p, r in rows.items():
            if p == "greedy" or r["step_s"] is None:
                continue
            speedups[p].append(r["step_s"] / g["step_s"])
            ceiling[p].append(r["step_s"] / g["bound_placement_causal_s"])
            ceiling_formula[p].append(r["step_s"] / g["bound_placement_s"])
            if r["fits"]:
                speedups_fit[p].append(r["step_s"] / g["step_s"])
                ceiling_fit[p].append(r["step_s"] / g["bound_placement_causal_s"])
                if g["step_s"] > r["step_s"] * (1 + 1e-9):
                    slower.append({"case": list(key), "baseline": p, "greedy_s": g["step_s"], "baseline_s": r["step_s"]})
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    goals: dict = {"note": MEDIAN_NOTE}
    for p, xs in speedups.items():
        goal = GOALS.get(p)
        goals[p] = {"median_speedup": med(xs), "min": min(xs, default=None), "max": max(xs, default=None),
                    "cases": len(xs), "median_speedup_where_it_fits": med(speedups_fit[p]),
                    "cases_where_it_fits": len(speedups_fit[p]), "goal": goal,
                    "holds": (med(xs) >= goal) if goal and xs else None,
                    "ceiling_causal_median": med(ceiling[p]), "ceiling_causal_median_where_it_fits": med(ceiling_fit[p]),
                    "ceiling_formula_median": med(ceiling_formula[p]),
                    "cases_where_the_causal_bound_reaches_the_goal":
                        sum(x >= goal for x in ceiling[p]) if goal else None}
    goals["bound_placement"] = {"median_greedy_over_bound": med(to_bound), "max": max(to_bound, default=None),
                                "cases": len(to_bound), "goal": BOUND_GOAL,
                                "holds": med(to_bound) <= BOUND_GOAL if to_bound else None,
                                "median_greedy_over_causal_bound": med(to_causal),
                                "max_over_causal_bound": max(to_causal, default=None),
                                "median_causal_over_formula_bound": med([b / a for a, b in zip(to_causal, to_bound)])}
    goals["never_slower_than_a_fitting_baseline"] = {"holds": not slower, "violations": slower}
    return goals


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--models", default=",".join(c[0] for c in CASES))
    ap.add_argument("--hw", default="pcie4,pcie5")
    ap.add_argument("--bucket-bytes", default="32MiB")
    ap.add_argument("--chain", default="", help="comma-separated bucket counts: time build_plan on a layer chain")
    ap.add_argument("--explain", action="store_true", help="print each case's greedy lanes and placements")
    ap.add_argument("--refresh-after-drain", action="store_true",
                    help="the greedy with the refresh after the CPU lane's drain (the model before session 23), not "
                         "pipelined as the runtime issues it (build_plan(refresh_pipelined=True), the default)")
    ap.add_argument("--checkpointing", action="store_true",
                    help="the GiB cases again, each policy with its best share of blocks checkpointed (a model)")
    args = ap.parse_args()
    pipelined = not args.refresh_after_drain
    console = Console(width=None if sys.stdout.isatty() else 200)
    bucket_bytes = parse_bytes(args.bucket_bytes)
    out = {"machine": brief_machine(), "bucket_bytes": bucket_bytes, "itemsize": ITEMSIZE,
           "simulated": "every step time here is SIMULATED on nominal hardware presets (offload/planning/hw.py), "
                        "not measured; the device AdamW rate is a model (memory-bound, 28 B/param)",
           "budget_rule": "fraction cases: activations + largest grad + buffers + fraction x bf16 parameter bytes; "
                          "gib cases: the named GPU budget",
           "compute_times": "estimated: per-operator roofline on the preset's assumed device throughput",
           "greedy": "build_plan(..., device_optimizer=True" + (", refresh_pipelined=True)" if pipelined
                                                                else ")"),
           "cases": [], "timings_s": {}}
    if args.checkpointing:
        out["checkpointing"] = (
            "cases_checkpointing: the GiB cases with each policy's fastest fitting share of blocks checkpointed "
            f"(shares {list(CKPT_SHARES)}, largest saving first); a MODEL of the checkpointed step (activation bytes "
            "estimated per block on the meta device; each block's forward recomputed in one lump where backward "
            "reaches it; [Note: the recompute model]); its bounds are those of the greedy's chosen share only, "
            "not the least over every share")
    policies = {**POLICIES, "greedy": greedy_pipelined} if pipelined else POLICIES
    wanted = args.models.split(",")
    table = Table(title="SIMULATED step (s), nominal presets; x = over the budget")
    for col in ("model", "hw", "budget", "bound", "bound (placement)", *POLICIES, "greedy/bound_p"):
        table.add_column(col, justify="right" if col not in ("model", "hw") else "left")
    for name, batch, seq in (c for c in CASES if c[0] in wanted):
        mt, buckets, param_bytes, extra, seconds = trace_preset(console, name, batch, seq, bucket_bytes, ITEMSIZE)
        out["timings_s"][f"trace {name}"] = seconds
        budgets = [(f"{frac:.0%}", extra + int(frac * param_bytes), frac) for frac in FRACTIONS
                   if name in FRACTION_MODELS]
        budgets += [(f"{gib} GiB", gib << 30, None) for gib in GIB_BUDGETS.get(name, ())]
        for hw_name in args.hw.split(","):
            hw = PRESETS[hw_name]
            compute = mt.compute_s(hw)
            for label, budget, frac in budgets:
                case = Case(mt.trace, buckets, ITEMSIZE, hw, compute, budget, mt.buffer_bytes)
                base = {"model": name, "batch": batch, "seq": seq, "params": mt.numel, "budget_bytes": budget,
                        "budget_fraction": frac, "budget_label": label, "hw": hw_name,
                        "activation_bytes": mt.trace.activation_peak_bytes}
                with console.status(f"{name} {hw_name} {label}"):
                    t1 = time.perf_counter()
                    got = run_case(case, base, extra, out["cases"], policies)
                    out["timings_s"][f"case {name} {hw_name} {label}"] = time.perf_counter() - t1
                row, bound, bound_p = got["row"], got["bound"], got["bound_p"]
                if args.explain:
                    explain(console, f"{name} {hw_name} {label}", case, row["greedy"], got["causal"])
                if args.checkpointing and frac is None:
                    with console.status(f"{name} {hw_name} {label} with checkpointing"):
                        t1 = time.perf_counter()
                        run_checkpointed(name, batch, seq, case, base, out.setdefault("cases_checkpointing", []),
                                         policies)
                        out["timings_s"][f"case {name} {hw_name} {label} checkpointing"] = time.perf_counter() - t1
                g = row["greedy"].step_s if row["greedy"].fits else None
                cells = [f"{r.step_s:.3f}{'' if r.fits else ' x'}" if r.step_s is not None else "-"
                         for r in row.values()]
                table.add_row(name, hw_name, label, f"{bound.seconds:.3f} {bound.limit}",
                              f"{bound_p.seconds:.3f} {bound_p.limit}", *cells,
                              f"{g / bound_p.seconds:.2f}" if g and bound_p.seconds != float("inf") else "-")
    if out["cases"]:
        console.print(table)
        out["goals"] = summarise(out["cases"])
        # the realistic GPU budgets alone (the fraction cases leave little room for optimizer state)
        out["goals_realistic_budgets"] = summarise([c for c in out["cases"] if c["budget_fraction"] is None])
        console.print_json(data={"all cases": out["goals"], "realistic budgets": out["goals_realistic_budgets"]})
    if out.get("cases_checkpointing"):
        out["goals_with_checkpointing"] = summarise(out["cases_checkpointing"])
        console.print_json(data={"with checkpointing (a model)": out["goals_with_checkpointing"]})
        for c in out["cases_checkpointing"]:
            step = "-" if c["step_s"] is None else f"{c['step_s']:.3f}"
            console.print(f"{c['model']} {c['hw']} {c['budget_label']} {c['policy']}: {step}"
                          f"{'' if c['fits'] else ' x'} ({c['checkpointed_blocks']}/{c['blocks']} blocks checkpointed)")
    if args.chain:
        out["chain"] = []
        speed = Table(title="build_plan speed on a chain of one-bucket layers")
        for col in ("buckets", "events", "buffers", "device opt", "wall s", "cpu s", "load before/after"):
            speed.add_column(col, justify="right")
        for n in (int(x) for x in args.chain.split(",")):
            for device_optimizer in (False, True):
                with console.status(f"planning a {n}-bucket chain"):
                    r = time_chain(n, device_optimizer, pipelined)
                out["chain"].append(r)
                speed.add_row(str(n), str(r["events"]), str(r["buffers"]), str(device_optimizer), f"{r['wall_s']:.2f}",
                              f"{r['cpu_s']:.2f}", f"{r['load_avg_1m_before']:.1f}/{r['load_avg_1m_after']:.1f}")
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
