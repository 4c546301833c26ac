"""This engine against ZeRO-Offload, ZeRO-3 offload, torchao's CPUOffloadOptimizer, plain PyTorch and
ColossalAI Gemini: same GPU, same GPU budget, same model, batch, sequence length, bf16 compute over fp32
masters with AdamW, no activation checkpointing for anyone (this engine's option stays off too).

For each model x budget x system, one child process (``bench_systems.py``) builds the model (random
init), trains ``--warmup`` steps untimed and ``--steps`` timed steps on synthetic tokens, and reports the
median step time, tokens/s, TFLOPS (6 x params x tokens/s), peak GPU memory (allocator) and peak host RSS.
A system that runs out of memory, crashes, hangs past ``--timeout`` or is not installed is recorded with
its status and error, never dropped. A run whose resident parameters alone exceed the budget (plain
torch 16 B/param, torchao 4, ZeRO-2 2) is recorded as ``skipped`` without spending GPU time (``--no-skip``
runs it anyway).

For this engine each result also carries the physical bound of its step (``offload.planning.simulate.physical_bound``
over the least traffic of the plan it ran: max(compute, H2D bytes / peak H2D, D2H bytes / peak D2H, CPU
AdamW)) with the compute part *measured* in a separate child (forward + backward, bf16 weights resident,
no optimizer, no budget cap) and the link / AdamW parts from ``--hw`` (``offload probe --json`` output for
measured figures; a preset name gives nominal ones, flagged ``hw_measured: false``), and the simulator's
predicted step for that plan.

    python benchmarks/vs_baselines.py --json results.json                 # the full grid, on a GPU
    python benchmarks/vs_baselines.py --cases gpt2-xl@8GiB,gpt2-xl@24GiB --hw probe.json --json r.json
    python benchmarks/vs_baselines.py --smoke --json /tmp/smoke.json      # tiny models on the CPU, seconds

Then ``python benchmarks/plot.py results.json --out DIR`` draws the plots and writes the markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from bench_runner import gib, machine, not_startable, run_child, size_label, write_json  # noqa: E402
from bench_systems import OURS, SYSTEMS  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from offload.config import parse_bytes  # noqa: E402
from offload.planning.hw import load_hw  # noqa: E402
from offload.planning.simulate import physical_bound  # noqa: E402
from offload.tools.presets import MODELS as PRESETS  # noqa: E402
from offload.tools.presets import Shape  # noqa: E402

# model -> (shape, batch, seq). Batch and sequence are fixed per model and small enough that activations
# (no checkpointing) leave room in the 8 GiB budget for the larger models to be streamed at all.
MODELS: dict[str, tuple[Shape, int, int]] = {
    "gpt2-large": (PRESETS["gpt2-large"], 2, 1024),
    "gpt2-xl": (PRESETS["gpt2-xl"], 1, 1024),
    "gpt3-2.7b": (Shape("gpt3", 50257, 2048, 2560, 32, 32, 10240), 1, 1024),  # GPT-3 2.7B's shape
    "gpt3-6.7b": (PRESETS["gpt3-6.7b"], 1, 1024),
    "bert-large": (PRESETS["bert-large"], 8, 512),
}
BUDGETS = ("8GiB", "16GiB", "24GiB")
SMOKE_MODELS: dict[str, tuple[Shape, int, int]] = {
    "tiny-gpt": (Shape("gpt2", 512, 64, 64, 2, 4, 256), 2, 32),
    "tiny-bert": (Shape("bert", 512, 64, 64, 2, 4, 256), 2, 32),
}
SMOKE_BUDGETS = ("768KiB", "4MiB")  # tiny-gpt: the first streams its buckets, the second holds all
SMOKE_BUCKET_BYTES = "32KiB"  # several buckets, so the smaller budget really streams
GOALS = {"zero_offload": 1.5, "zero3_offload": 1.84, "torchao": 1.2, "twinflow": 1.25}
"""Issue 10's goals (issue 18's for Twin-Flow, against its best ratio): this engine's tokens/s over the
baseline's, same model and budget."""
TWINFLOW_RATIOS = "0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9"
BOUND_GOAL = 1.15  # step <= 1.15 x the physical bound


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU, 1 warm-up + 2 timed steps")
    ap.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)} (default: all)")
    ap.add_argument("--budgets", help=f"comma-separated GPU budgets (default: {','.join(BUDGETS)})")
    ap.add_argument("--cases", help="explicit model@budget list instead of --models x --budgets, "
                                    "e.g. gpt2-xl@8GiB,gpt3-6.7b@16GiB")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated (default: all)")
    ap.add_argument("--device", help="cuda or cpu (default: cuda if present; cpu with --smoke)")
    ap.add_argument("--steps", type=int, help="timed steps (default 10; 2 with --smoke)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 3; 1 with --smoke)")
    ap.add_argument("--batch", type=int, help="override every model's batch")
    ap.add_argument("--seq", type=int, help="override every model's sequence length")
    ap.add_argument("--bucket-bytes", help="this engine's bucket_bytes (default: the engine's own)")
    ap.add_argument("--hw", default="pcie5", help="link and CPU AdamW figures for the bound: an `offload probe "
                                                  "--json` file (measured) or a preset name (nominal)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per child process")
    ap.add_argument("--time-budget", type=float, help="stop starting runs after this many seconds; the rest "
                                                      "are recorded as not run")
    ap.add_argument("--no-skip", action="store_true", help="also run cases whose params alone exceed the budget")
    ap.add_argument("--no-cap-offload", action="store_true",
                    help="do not cap this engine's allocator at the budget (its own budget still applies)")
    ap.add_argument("--cpu-deepspeed", action="store_true", help="let the DeepSpeed baselines run on a CPU device")
    ap.add_argument("--twinflow-ratios", default=TWINFLOW_RATIOS,
                    help="Twin-Flow's offload ratios to sweep, ascending (the fraction of the optimizer on the CPU). "
                         "Ratios whose GPU share certainly cannot fit are skipped; the sweep stops at the first that "
                         "runs, since keeping more of the optimizer on the GPU is assumed faster (not measured: "
                         "--twinflow-all runs every ratio)")
    ap.add_argument("--twinflow-all", action="store_true", help="run every Twin-Flow ratio, not only up to the first "
                                                                "that runs")
    ap.add_argument("--profile", metavar="DIR", help="also write a torch.profiler trace of one step per run")
    ap.add_argument("--logs", metavar="DIR", help="keep every child's full output here")
    ap.add_argument("--json", help="write the results here (rewritten after every run)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    smoke = args.smoke
    args.device = args.device or ("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    args.steps = args.steps if args.steps is not None else (2 if smoke else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if smoke else 3)
    if smoke and args.bucket_bytes is None:
        args.bucket_bytes = SMOKE_BUCKET_BYTES
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    table = SMOKE_MODELS if smoke else MODELS
    try:
        args.case_list = cases(args, table, SMOKE_BUDGETS if smoke else BUDGETS)
    except ValueError as e:
        ap.error(str(e))
    args.system_list = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in args.system_list if s not in SYSTEMS]
    if bad:
        ap.error(f"unknown system(s) {bad}; choose from {', '.join(SYSTEMS)}")
    try:
        args.twinflow_ratio_list = sorted({float(r) for r in args.twinflow_ratios.split(",") if r.strip()})
    except ValueError:
        ap.error(f"--twinflow-ratios: comma-separated numbers, e.g. {TWINFLOW_RATIOS}")
    if not args.twinflow_ratio_list or not all(0.0 <= r <= 1.0 for r in args.twinflow_ratio_list):
        ap.error("--twinflow-ratios: fractions in [0, 1]")
    args.table = table
    return args


def cases(args, table: dict, default_budgets) -> list[tuple[str, int]]:
    if args.cases:
        out = []
        for c in args.cases.split(","):
            model, _, budget = c.strip().partition("@")
            if model not in table or not budget:
                raise ValueError(f"bad case {c!r}: use model@budget with a model of {', '.join(table)}")
            out.append((model, parse_bytes(budget)))
        return out
    models = args.models.split(",") if args.models else list(table)
    unknown = [m for m in models if m not in table]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; choose from {', '.join(table)}")
    budgets = [parse_bytes(b) for b in (args.budgets.split(",") if args.budgets else default_budgets)]
    return [(m, b) for m in models for b in budgets]


def base_spec(args, model: str) -> dict:
    shape, batch, seq = args.table[model]
    return {"model": model, "shape": asdict(shape), "batch": args.batch or batch, "seq": args.seq or seq,
            "device": args.device, "warmup": args.warmup, "steps": args.steps, "lr": 1e-4, "seed": args.seed,
            "bucket_bytes": args.bucket_bytes, "cpu_deepspeed": args.cpu_deepspeed}


def n_params(shape: Shape) -> int:
    return sum(p.numel() for p in shape.build("meta").parameters())


def record(spec: dict, res: dict) -> dict:
    """One ``runs[]`` entry: the issue's fields first, then everything else the child reported."""
    times = res.get("step_times_s") or []
    step = statistics.median(times) if times else None
    tokens = spec["batch"] * spec["seq"]
    params = res.get("params")
    tps = tokens / step if step else None
    return {
        "system": spec["system"], "model": spec["model"], "budget_bytes": spec.get("budget_bytes"),
        "ok": bool(res.get("ok")), "step_s": step, "tokens_per_s": tps,
        "tflops": 6 * params * tps / 1e12 if tps and params else None,
        "peak_gpu_bytes": res.get("peak_gpu_bytes"), "peak_host_bytes": res.get("peak_host_bytes"),
        "error": res.get("error"), "status": res.get("status"), "params": params, "batch": spec["batch"],
        "seq": spec["seq"], "device": spec["device"], "steps": spec["steps"], "warmup": spec["warmup"],
        **{k: v for k, v in res.items() if k not in ("ok", "error", "status", "params", "peak_gpu_bytes",
                                                     "peak_host_bytes")},
    }


def budget_rule(args) -> str:
    if args.device.startswith("cpu"):
        return "none on the CPU device: only this engine's own budget applies (a smoke run, not a comparison)"
    return ("torch.cuda.set_per_process_memory_fraction(budget / total) for every system"
            + (" except offload (its own budget only)" if args.no_cap_offload else ", offload included")
            + "; offload's plan keeps its measured runtime headroom (cuBLAS workspaces, allocator rounding) inside "
              "the budget")


def add_bound(run: dict, compute: dict | None, hw) -> None:
    """This engine's physical bound for the plan it ran, and the step's ratio to it."""
    least = (run.get("details") or {}).get("least_traffic")
    if not run["ok"] or least is None:
        return
    if compute is None or not compute.get("ok"):
        run["bound"] = {"seconds": None, "reason": "no measured compute time for this model: "
                        + (compute or {}).get("error", "calibration not run")}
        return
    b = physical_bound(compute["step_s"], least["h2d"], least["d2h"], least["adam_numel"], hw)
    run["bound"] = {"seconds": b.seconds, "limit": b.limit, "parts": b.parts, "hw": hw.name,
                    "hw_measured": hw.measured, "least_traffic": least,
                    "compute_source": "measured: median forward+backward, bf16 weights resident under "
                                      "autocast, no optimizer (the calibration[] entry of this model)"}
    run["step_over_bound"] = run["step_s"] / b.seconds


def plan_line(details: dict) -> str:
    """What this engine planned, beside what it measured: the predicted step, the clock its compute times came
    from, the check of the first planned step ([Note: timing compute]) and the buckets streamed."""
    pred = details.get("predicted_step_s")
    timing = details.get("compute_timing") or {}
    plan = details.get("plan") or {}
    checked = (f"first planned step: compute {timing['measured_compute_s']:.4f} s measured against "
               f"{timing['planned_compute_s']:.4f} s planned ({'re-planned' if timing['replanned'] else 'kept'})"
               if timing else "compute not re-timed")
    devopt = (details.get("device_optimizer") or {}).get("buckets")
    return (f"plan: predicted {pred:.4f} s/step" if pred is not None else "plan: no prediction") + \
        f", compute from the {details.get('compute_clock', '?')} clock; {checked}; " + \
        f"{plan.get('streamed_buckets', '?')} of {plan.get('num_buckets', '?')} buckets streamed" + \
        (f", {devopt} with the optimizer on the device" if devopt else "")


def main(argv=None) -> int:
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 180)
    hw = load_hw(args.hw)
    out = {"benchmark": "vs_baselines", "smoke": args.smoke, "machine": machine(), "hw": hw.to_dict(),
           "settings": {"steps": args.steps, "warmup": args.warmup, "timeout_s": args.timeout,
                        "systems": args.system_list, "device": args.device, "dtype": "bfloat16 compute, fp32 masters",
                        "activation_checkpointing": False, "optimizer": "AdamW lr 1e-4 wd 0.01",
                        "tflops_formula": "6 * params * tokens_per_s", "goals": GOALS, "bound_goal": BOUND_GOAL,
                        "budget_enforcement": budget_rule(args)},
           "calibration": [], "runs": []}
    console.print(f"[bold]machine[/bold]: {out['machine']['cpu']}, gpu {out['machine']['gpu']}, "
                  f"load {out['machine']['load_average']}; hw for the bound: {hw.name} (measured={hw.measured})")
    t_start = time.perf_counter()
    calibration: dict[str, dict] = {}
    params_of: dict[str, int] = {}

    def remaining() -> float | None:
        return None if args.time_budget is None else args.time_budget - (time.perf_counter() - t_start)

    def child(spec: dict, label: str) -> dict:
        left = remaining()
        if left is not None and left <= 0:
            return {"ok": False, "status": "not_run", "error": f"time budget of {args.time_budget:.0f} s used up"}
        if args.profile and spec["system"] != "compute":
            spec["profile_path"] = str(Path(args.profile) / f"{label}.json.gz")
        log = Path(args.logs) / f"{label}.log" if args.logs else None
        with console.status(f"{label}"):
            return run_child(spec, args.timeout if left is None else min(args.timeout, left), log)

    for model, budget in args.case_list:
        base = base_spec(args, model)
        params_of.setdefault(model, n_params(args.table[model][0]))
        if set(OURS) & set(args.system_list) and model not in calibration:
            spec = base | {"system": "compute", "budget_bytes": None, "warmup": max(1, args.warmup)}
            res = record(spec, child(spec, f"{model}-compute"))
            calibration[model] = res
            out["calibration"].append(res)
        for system in args.system_list:
            ran: list[dict] = []  # Twin-Flow's ratios that ran
            for ratio in (args.twinflow_ratio_list if system == "twinflow" else [None]):
                spec = base | {"system": system, "budget_bytes": budget, "hw": args.hw,
                               "cap": not (system in OURS and args.no_cap_offload)}
                label = f"{model}-{size_label(budget)}-{system}"
                if ratio is not None:
                    spec["twinflow_ratio"] = ratio
                    label += f"-r{ratio:g}"
                if ran and not args.twinflow_all:
                    res = {"ok": False, "status": "not_run",
                           "error": f"ratio {ran[0]['twinflow_ratio']:g} ran: a larger ratio keeps less of the "
                                    "optimizer on the GPU and is assumed slower (not measured; --twinflow-all)"}
                else:
                    res = not_startable(spec, params_of[model], not args.no_skip) or child(spec, label)
                run = record(spec, res)
                if ratio is not None:
                    run["twinflow_ratio"] = ratio
                    if run["ok"]:
                        ran.append(run)
                if system == "offload":
                    add_bound(run, calibration.get(model), hw)
                out["runs"].append(run)
                write_json(args.json, out)
                console.print(f"{label}: {run['status']}" + (f", {run['step_s']:.4f} s/step" if run["ok"] else
                                                             f" ({(run['error'] or '')[:160]})"))
                if system in OURS and run["ok"]:
                    console.print(f"  {plan_line(run.get('details') or {})}")
            if ran:  # the ratio a user tuning it would keep: the fastest that ran
                min(ran, key=lambda r: r["step_s"])["twinflow_best"] = True
                write_json(args.json, out)
    out["total_s"] = time.perf_counter() - t_start
    out["machine"]["load_average_end"] = list(os.getloadavg())
    write_json(args.json, out)
    print_table(console, out)
    if args.json:
        console.print(f"wrote {args.json}")
    return 0


def print_table(console: Console, out: dict) -> None:
    t = Table(title="vs baselines (same GPU budget); step = median of the timed steps")
    for c in ("model", "budget", "system", "status", "step s", "tokens/s", "TFLOPS", "peak GPU",
              "peak host", "x bound", "offload speedup"):
        t.add_column(c, justify="left" if c in ("model", "system", "status") else "right")
    ours = {(r["model"], r["budget_bytes"]): r for r in out["runs"] if r["system"] == "offload" and r["ok"]}
    for r in out["runs"]:
        o = ours.get((r["model"], r["budget_bytes"]))
        speed = (f"{o['tokens_per_s'] / r['tokens_per_s']:.2f}x" if o and r["ok"] and r["system"] not in OURS
                 else "")
        system = r["system"] + (f" r={r['twinflow_ratio']:g}" + (" (best)" if r.get("twinflow_best") else "")
                                 if r.get("twinflow_ratio") is not None else "")
        t.add_row(r["model"], gib(r["budget_bytes"]), system, r["status"],
                  f"{r['step_s']:.4f}" if r["step_s"] else "-",
                  f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "-",
                  f"{r['tflops']:.2f}" if r["tflops"] else "-", gib(r["peak_gpu_bytes"]), gib(r["peak_host_bytes"]),
                  f"{r['step_over_bound']:.2f}" if r.get("step_over_bound") else "", speed)
    console.print(t)


if __name__ == "__main__":
    raise SystemExit(main())
