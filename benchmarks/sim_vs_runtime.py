"""Does the simulator predict the runtime? On the CPU backend with throttled copy lanes (a copy of n bytes
takes n / bandwidth, the lane sleeping off the CPU), train an MLP under a budget that forces streaming,
and compare the measured step time with what ``offload.planning.simulate`` predicts for the plan the runtime
executes.

Inputs of the prediction, all measured in this run: compute seconds per event from a step of the same
model with everything resident and unthrottled copies (the runtime records a trace every step, its own
waits and fetches excluded: ``Trace.compute_seconds``), the CPU AdamW throughput (``offload probe``'s
measurement of the engine's update), and the configured link bandwidth. The throttled runs plan with that
hardware model (``OffloadConfig.hw``), as a user passing ``offload probe``'s JSON would. The harness reads
the engine's trace and plan (``engine._runtime``): the public API exposes only their summary.

    python benchmarks/sim_vs_runtime.py --json benchmarks/results/sim_vs_runtime_cpu.json

The prediction above uses compute times from the resident run (the simulator's accuracy) and models resident
buckets' refreshes as this runtime issues them, pipelined with the CPU lane ([Note: the refresh pipelined,
modelled] in offload/planning/simulate.py); ``predicted_step_s_drained`` is the same plan with the refresh
after the drain (the model before it, and the engine's planner's default until session 23). Beside them each case
records the engine's own prediction, ``plan.simulated`` (``engine_predicted_step_s``): the step its plan was
built for, from the compute times of the step it planned from: the traced first step, or with ``--calibrate``
(``OffloadConfig(calibrate_compute=True)``, [Note: timing compute] in offload/runtime/executor.py) the first
planned step when its compute was more than 25 % off (``compute_timing``).

``--device-optimizer`` checks plans with mixed placement (issue 18): the engine runs with
``OffloadConfig(device_optimizer=True)``, and the device AdamW rate (torch's ``_fused_adamw_`` on CPU tensors,
on the compute thread, as the CPU backend runs it) is measured too. On this backend the compute thread is
the wall, so an honest plan keeps every optimizer on the host; to get a plan with device-optimizer buckets
the engine plans for a CPU AdamW ``--plan-cpu-slowdown`` times slower than measured. The prediction
simulates the plan it then ran with the measured rates.

Load (issue 18): on a shared machine the prediction's compute comes from one run and the measured step from
another, each slowed by whatever else runs then. So right before and after every run a fixed single-thread
probe (matrix products) measures how much longer than its own CPU time it takes (``slowdown``: 1.0 on an idle
machine; a thread that shares its core with k others gets ~1/(k+1) of it); ``load_ratio`` = the measured run's
slowdown over the compute run's says how differently the two runs were slowed, and the error is read against
it (``--repeat`` runs the whole comparison that many times). Each run also records its compute thread's CPU
time per step (``compute_thread_cpu_s``: forward, backward, device updates; it includes no waiting).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from unittest import mock

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

import offload
import offload.api
from offload.backend.cpu import CPUBackend
from offload.planning.hw import HardwareModel, latency_curve
from offload.planning.schedule import program_of
from offload.planning.simulate import simulate
from offload.tools.probe import cpu_adam_params_per_s


def mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())))


def device_adam_params_per_s(numel: int = 1 << 22, repeats: int = 5) -> float:
    """Parameters per second of torch's fused AdamW on fp32 CPU tensors (the CPU backend's device update)."""
    p, g, m, v = (torch.randn(numel) for _ in range(4))
    v.abs_()
    best = float("inf")
    for i in range(repeats):
        t0 = time.perf_counter()
        torch._fused_adamw_([p], [g], [m], [v], [], [torch.tensor(float(i + 1))], lr=1e-4, beta1=0.9, beta2=0.999,
                            weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
        best = min(best, time.perf_counter() - t0)
    return numel / best


def run(budget, width, depth, batch, steps, bandwidth=None, hw=None, device_optimizer=False, calibrate=False):
    model = mlp(width, depth)
    opt = offload.AdamW(model.parameters(), lr=1e-4)
    # Copies on their lane threads either way (the throttled ones always are): the simulator's copy lanes, and
    # compute times measured without copies inline on the compute thread ([Note: inline copies])
    backend = (lambda device: CPUBackend(inline_copies=False)) if bandwidth is None else (
        lambda device: CPUBackend(bandwidth, bandwidth))
    with mock.patch.object(offload.api, "make_backend", backend):
        engine = offload.wrap(model, opt, budget=budget, device="cpu", bucket_bytes=width * width * 4 + width * 4,
                              hw=hw, device_optimizer=device_optimizer, calibrate_compute=calibrate)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(1))
    times, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        loss = engine(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    rt = engine._runtime
    stats = engine.memory_stats() | {"compute_thread_cpu_s": cpu}
    out = (times, rt.executor.trace, rt.executor.plan, stats)
    engine.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--bandwidth", type=float, default=1.0e9, help="throttled link, bytes/s")
    ap.add_argument("--budget-fraction", type=float, default=0.4, help="of the parameter bytes")
    ap.add_argument("--device-optimizer", action="store_true", help="mixed placement (see the docstring)")
    ap.add_argument("--plan-cpu-slowdown", type=float, default=50.0,
                    help="with --device-optimizer: plan for a CPU AdamW this many times slower than measured")
    ap.add_argument("--repeat", type=int, default=1, help="run the whole comparison this many times")
    ap.add_argument("--calibrate", action="store_true", help="the throttled runs re-time their first planned step "
                                                              "(calibrate_compute=True; see the docstring)")
    args = ap.parse_args()
    if args.repeat > 1:
        runs = []
        for i in range(args.repeat):
            code, out = compare(args)
            if code:
                return code
            runs.append(out)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"repeats": runs}, f, indent=1)
        return 0
    code, out = compare(args)
    if args.json and not code:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return code


def slowdown(seconds: float = 0.2) -> float:
    """Wall time over thread CPU time of a fixed single-thread workload (1.0 on an idle core)."""
    a = torch.randn(192, 192)
    wall, cpu = 0.0, 0.0
    while wall < seconds:
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(20):
            a = torch.tanh(a @ a)
        wall += time.perf_counter() - t0
        cpu += time.thread_time() - c0
    return wall / max(cpu, 1e-9)


def measured_run(*args, **kwargs):
    """:func:`run` between two :func:`slowdown` probes; their mean goes in the stats."""
    before = slowdown()
    times, trace, plan, stats = run(*args, **kwargs)
    return times, trace, plan, stats | {"slowdown": (before + slowdown()) / 2}


def compare(args) -> tuple[int, dict]:
    console = Console(width=None if sys.stdout.isatty() else 140)
    torch.set_num_threads(1)  # compute on one core; the other runs the AdamW lane
    param_bytes = args.depth * (args.width * args.width + args.width) * 4
    rows, out = [], {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                                 "load_avg_1m_before": os.getloadavg()[0]},
                     "args": vars(args), "cases": []}
    with console.status("measuring compute (everything resident, unthrottled)"):
        clean_times, clean, _, clean_stats = measured_run(param_bytes * 4, args.width, args.depth, args.batch,
                                                          args.steps)  # warm like the runs
    clean_ratio = clean_stats["slowdown"]
    out["compute_run"] = {"all_steps_s": clean_times, "compute_thread_cpu_s": clean_stats["compute_thread_cpu_s"],
                          "slowdown": clean_ratio}
    with console.status("measuring CPU AdamW"):
        adam = cpu_adam_params_per_s()
    curve = latency_curve(args.bandwidth, 0.0)
    hw = HardwareModel("cpu backend, throttled", curve, curve, duplex_factor=1.0, adam_params_per_s=adam,
                       host_bytes_per_s=1e10, device_flops_per_s=1e11, device_bytes_per_s=1e10, measured=True)
    plan_hw = hw
    if args.device_optimizer:
        with console.status("measuring the device AdamW (torch._fused_adamw_ on CPU tensors)"):
            hw = replace(hw, device_adam_params_per_s=device_adam_params_per_s())
        plan_hw = replace(hw, name="cpu backend, throttled, slow CPU AdamW for planning",
                          adam_params_per_s=adam / args.plan_cpu_slowdown)
    for frac in (args.budget_fraction, 4.0):
        extra = clean.activation_peak_bytes + clean.max_grad_bytes + (1 << 20)  # + 1 MiB slack for the arena
        budget = int(param_bytes * frac) + extra if frac < 1 else param_bytes * 4
        load = os.getloadavg()[0]
        with console.status(f"training at budget {frac:.0%} of the parameters, throttled"):
            times, trace, plan, stats = measured_run(budget, args.width, args.depth, args.batch, args.steps,
                                                     args.bandwidth, plan_hw, args.device_optimizer, args.calibrate)
        if [e for e in trace.events] != [e for e in clean.events]:
            console.print("[red]the traced events differ between runs; cannot compare[/red]")
            return 1, out
        # the runtime pipelines resident buckets' refreshes (overlapped updates, one process): the prediction
        # models that; beside it the refresh after the drain, the model before ([Note: the refresh pipelined,
        # modelled] in offload/planning/simulate.py)
        sim = simulate(program_of(plan, clean.compute_seconds, refresh_pipelined=True), hw)
        drained = simulate(program_of(plan, clean.compute_seconds, refresh_pipelined=False), hw)
        measured = statistics.median(times[3:])
        err = (sim.step_s - measured) / measured
        case = {"budget_bytes": budget, "resident": len(plan.resident), "buckets": len(plan.buckets),
                "measured_step_s": measured, "all_steps_s": times, "predicted_step_s": sim.step_s,
                "predicted_stall_s": sim.stall_s, "compute_s": sim.compute_s, "relative_error": err,
                "predicted_step_s_drained": drained.step_s,
                "relative_error_drained": (drained.step_s - measured) / measured,
                "load_avg_1m": load, "device_peak_bytes": stats["device_peak_bytes"],
                "device_optimizer_buckets": len(plan.device_optimizer),
                "placement_bytes": stats["device_optimizer"]["bytes"],
                "compute_thread_cpu_s": stats["compute_thread_cpu_s"],
                # the engine's own prediction: its plan, with the compute times it was planned from
                "engine_predicted_step_s": plan.simulated.step_s if plan.simulated is not None else None,
                "engine_plan_compute_s": sum(plan.trace.compute_seconds), "engine_plan_clock": plan.trace.clock,
                "compute_timing": stats["compute_timing"]}
        if case["engine_predicted_step_s"] is not None:
            case["engine_relative_error"] = (case["engine_predicted_step_s"] - measured) / measured
        case["slowdown"] = stats["slowdown"]
        case["load_ratio"] = stats["slowdown"] / clean_ratio
        out["cases"].append(case)
        rows.append(case)
    table = Table(title=f"simulated vs measured step, CPU backend, link {args.bandwidth / 1e9:.1f} GB/s")
    for col in ("budget", "resident/buckets", "device optimizer", "measured s", "predicted s", "error",
                "drained s", "its error", "engine's plan s", "its error", "load", "load ratio"):
        table.add_column(col, justify="right")
    for c in rows:
        table.add_row(offload.format_bytes(c["budget_bytes"]), f"{c['resident']}/{c['buckets']}",
                      str(c["device_optimizer_buckets"]),
                      f"{c['measured_step_s']:.3f}", f"{c['predicted_step_s']:.3f}", f"{c['relative_error']:+.0%}",
                      f"{c['predicted_step_s_drained']:.3f}", f"{c['relative_error_drained']:+.0%}",
                      f"{c['engine_predicted_step_s']:.3f} ({c['engine_plan_clock']})"
                      if c["engine_predicted_step_s"] is not None else "-",
                      f"{c['engine_relative_error']:+.0%}" if "engine_relative_error" in c else "-",
                      f"{c['load_avg_1m']:.1f}", f"{c['load_ratio']:.2f}")
    console.print(table)
    out["machine"]["load_avg_1m_after"] = os.getloadavg()[0]
    out["cpu_adam_params_per_s"] = adam
    out["device_adam_params_per_s"] = hw.device_adam_params_per_s or None
    out["plan_cpu_adam_params_per_s"] = plan_hw.adam_params_per_s
    console.print(out["machine"], f"CPU AdamW {adam / 1e6:.0f} M params/s; compute run's slowdown {clean_ratio:.2f}")
    return 0, out


if __name__ == "__main__":
    raise SystemExit(main())
