"""The engine's overhead per module call (issue 17, "The hot path"): a training step through the engine
against the same step in plain PyTorch, on the same machine, in the same process, interleaved.

    engine  offload.wrap(model, offload.AdamW(...), device="cpu"), one step = engine(x), loss,
            engine.backward(loss), opt.step(), opt.zero_grad(); measured on plan (after the traced warm-up
            step and the first planned step), in two settings:
              resident  the budget holds everything: every bucket stays on the device
              streamed  the budget is the resident run's accounted peak less half the weights: buckets stream
    torch   the same model (a copy with the same weights), loss.backward(), torch.optim.AdamW(fused=True)
            (fused AdamW runs on the CPU in the torch this was written for; where it does not, foreach is used
            and the output says so)

Per case the engine and torch run in blocks of ``--steps`` steps, alternating (engine block, torch block,
torch block, engine block, ...) ``--repeats`` times, so load from other processes hits both alike; step times
are the medians over blocks (minimum alongside), wall clock and CPU time (``time.process_time``: every thread
of the process, the engine's copy and AdamW lanes included; steadier than wall time when other processes
load the machine). The overhead per module call is

    (engine step - torch step) / module calls per step

where module calls are forward calls of any module (each one runs the engine's pre and post hooks; backward
work per module is counted in the same figure). The engine's counters over the timed steps are recorded to
show it stayed on plan (no departures, no on-demand fetches) and, streamed, that it did stream.

One torch thread by default (``--threads``): the overhead is host-side Python per call, and on a 2-core machine
that other processes load, torch's fused CPU AdamW with 2 OpenMP threads was seen taking milliseconds per
parameter tensor per step (its parallel region waits for a thread the other processes hold), which swamps the
figure being measured. The engine's own AdamW runs on its lane thread either way.

Models: ``mlp``: nn.Sequential of 100 x (Linear(64, 64), ReLU) (200 modules), batch 16; ``gpt``:
examples/gpt.py's GPT at its default size (6 blocks, width 256, 128 tokens), batch 8.

    python benchmarks/overhead.py --json benchmarks/results/cpu-<date>/overhead.json
    python benchmarks/overhead.py --smoke   # tiny sizes, seconds: the harness, not the figures

Goals (issue 17): mlp resident <= 1.15x torch (about <= 12 us per module call); gpt resident <= 1.10x torch.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import torch  # noqa: E402
from common import describe, machine, median, print_table, write_json  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from rich.console import Console  # noqa: E402
from torch import nn  # noqa: E402

import offload  # noqa: E402
from offload.backend import cpu_copies  # noqa: E402
from offload.errors import BudgetTooSmallError  # noqa: E402

HP = dict(lr=1e-3, weight_decay=0.1)
GOALS = {"mlp": 1.15, "gpt": 1.10}  # resident, engine step / torch step
COUNTERS = ("plan_departures", "replans", "on_demand_fetches", "planned_fetches", "over_budget_fetches",
            "h2d_bytes", "fast_steps")  # fast_steps: steps without per-call hooks (offload/runtime/fast_path.py)


class Model:
    """A model to time: how to build it (deterministically) and a batch and loss for it."""

    def __init__(self, name: str, build, batch, loss):
        self.name, self.build, self.batch, self.loss = name, build, batch, loss


def mlp_model(depth: int, width: int, batch: int) -> Model:
    def build():
        torch.manual_seed(0)
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*layers)

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    return Model(f"mlp ({2 * depth} modules: {depth} x Linear({width}, {width}) + ReLU, batch {batch})", build,
                 (x,), lambda out: nn.functional.mse_loss(out, y))


def gpt_model(n_layer: int, n_embd: int, n_head: int, seq: int, batch: int) -> Model:
    config = GPTConfig(vocab_size=256, block_size=seq, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    return Model(f"gpt ({n_layer} blocks, width {n_embd}, {seq} tokens, batch {batch})", lambda: GPT(config), (x, y),
                 lambda out: out[1])


def module_calls(model: nn.Module, batch) -> int:
    """Forward calls of any module (root included) in one forward: what the engine's hooks run for."""
    count = [0]
    handles = [m.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1)) for m in model.modules()]
    try:
        with torch.no_grad():
            model(*batch)
    finally:
        for h in handles:
            h.remove()
    return count[0]


def torch_adamw(params) -> tuple[torch.optim.Optimizer, str]:
    params = list(params)
    try:
        opt = torch.optim.AdamW(params, fused=True, **HP)
        probe = nn.Parameter(torch.zeros(1))
        probe.grad = torch.zeros(1)
        torch.optim.AdamW([probe], fused=True).step()  # fused may be refused only at the first step
        return opt, "fused"
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(params, foreach=True, **HP), "foreach (fused AdamW is not available on this CPU)"


class TorchRun:
    def __init__(self, model: Model):
        self.module = model.build()
        self.opt, self.adamw = torch_adamw(self.module.parameters())
        self.model = model

    def step(self) -> None:
        loss = self.model.loss(self.module(*self.model.batch))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def close(self) -> None:
        pass


class EngineRun:
    def __init__(self, model: Model, budget: int, bucket_bytes: int):
        self.module = model.build()
        self.opt = offload.AdamW(self.module.parameters(), **HP)
        self.engine = offload.wrap(self.module, self.opt, budget=budget, bucket_bytes=bucket_bytes,
                                   dtype=torch.float32, device="cpu")
        self.model = model

    def step(self) -> None:
        loss = self.model.loss(self.engine(*self.model.batch))
        self.engine.backward(loss)
        self.opt.step()
        self.opt.zero_grad()

    def counters(self) -> dict:
        c = self.engine.memory_stats()["counters"]
        return {k: c.get(k, 0) for k in COUNTERS}  # .get: an engine from before a counter existed

    def close(self) -> None:
        self.engine.close()


def param_bytes(model: Model) -> int:
    return sum(p.numel() * 4 for p in model.build().parameters())


def make_engine(model: Model, mode: str, resident_peak: int | None) -> tuple[EngineRun, int]:
    """The engine for ``mode``, warmed up to its planned steps; and its budget."""
    weights = param_bytes(model)
    bucket = max(weights // 10, 4096)
    if mode == "resident":
        budget = max(64 * weights, 256 * 2**20)
    else:  # half the weights do not fit beside the resident run's peak: the plan streams them
        budget = resident_peak - weights // 2
    for _ in range(8):
        run = EngineRun(model, budget, bucket)
        try:
            for _ in range(3):  # traced warm-up, planned step, one more
                run.step()
            return run, budget
        except BudgetTooSmallError as e:
            run.close()
            budget = max(int(e.min_budget_bytes * 1.05), budget + weights // 10)
    raise RuntimeError(f"{model.name}: no streamed budget found that plans")


def time_block(run, steps: int) -> tuple[float, float]:
    """Wall and CPU (process: every thread) milliseconds per step over ``steps`` steps."""
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        run.step()
    return (time.perf_counter() - t0) / steps * 1e3, (time.process_time() - c0) / steps * 1e3


def measure(model: Model, mode: str, steps: int, repeats: int, resident_peak: int | None) -> dict:
    engine, budget = make_engine(model, mode, resident_peak)
    ref = TorchRun(model)
    try:
        for _ in range(2):
            ref.step()
        before = engine.counters()
        times = {"engine": [], "torch": []}
        cpu = {"engine": [], "torch": []}
        for r in range(repeats):
            order = (("engine", engine), ("torch", ref)) if r % 2 == 0 else (("torch", ref), ("engine", engine))
            for name, run in order:
                wall, cpu_ms = time_block(run, steps)
                times[name].append(wall)
                cpu[name].append(cpu_ms)
        after = engine.counters()
        stats = engine.engine.memory_stats()
        calls = module_calls(ref.module, model.batch)
        eng, tor = median(times["engine"]), median(times["torch"])
        counters = {k: after[k] - before[k] for k in COUNTERS}
        plan = stats["plan"] or {}
        return {
            "model": model.name, "mode": mode, "budget_bytes": budget, "param_bytes": param_bytes(model),
            "module_calls_per_step": calls, "steps_per_block": steps, "blocks": repeats,
            "engine_ms": round(eng, 4), "torch_ms": round(tor, 4), "ratio": round(eng / tor, 4),
            "us_per_module_call": round((eng - tor) * 1e3 / calls, 2),
            "engine_min_ms": round(min(times["engine"]), 4), "torch_min_ms": round(min(times["torch"]), 4),
            "ratio_min": round(min(times["engine"]) / min(times["torch"]), 4),
            "us_per_module_call_min": round((min(times["engine"]) - min(times["torch"])) * 1e3 / calls, 2),
            "engine_cpu_ms": round(median(cpu["engine"]), 4), "torch_cpu_ms": round(median(cpu["torch"]), 4),
            "ratio_cpu": round(median(cpu["engine"]) / median(cpu["torch"]), 4),
            "us_per_module_call_cpu": round((median(cpu["engine"]) - median(cpu["torch"])) * 1e3 / calls, 2),
            "engine_block_ms": [round(t, 4) for t in times["engine"]],
            "torch_block_ms": [round(t, 4) for t in times["torch"]],
            "torch_adamw": ref.adamw, "counters_timed": counters,
            "on_plan": counters["plan_departures"] == 0 and counters["replans"] == 0
            and counters["on_demand_fetches"] == 0,
            "streamed": counters["planned_fetches"] > 0,
            "plan_resident_buckets": plan.get("resident_buckets"), "plan_buckets": plan.get("buckets"),
            "device_peak_accounted_bytes": stats["device_peak_accounted_bytes"],
            "load_average": list(os.getloadavg()),
        }
    finally:
        engine.close()
        ref.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--models", default="mlp,gpt", help="comma-separated: mlp, gpt")
    ap.add_argument("--modes", default="resident,streamed", help="comma-separated: resident, streamed")
    ap.add_argument("--repeats", type=int, default=None,
                    help="blocks per implementation (default: mlp 12, gpt 8; smoke 2)")
    ap.add_argument("--steps", type=int, default=None, help="steps per block (default: mlp 20, gpt 3; smoke 2)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch.set_num_threads (default 1; 0: as is). See the module docstring")
    ap.add_argument("--cpu-copies", choices=("inline", "lanes"), default=None,
                    help="the CPU backend's copies (OFFLOAD_CPU_COPIES; default: that variable, else inline): "
                         "[Note: inline copies] in offload/backend/cpu.py")
    ap.add_argument("--smoke", action="store_true", help="tiny models, few steps: checks the harness only")
    ap.add_argument("--label", default=None, help="recorded as is (e.g. which branch the code came from)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_copies:
        os.environ["OFFLOAD_CPU_COPIES"] = args.cpu_copies
    copies = cpu_copies()
    console = Console(width=180)
    info = machine()
    describe(console, info)
    if args.smoke:
        models = {"mlp": mlp_model(depth=3, width=16, batch=4),
                  "gpt": gpt_model(n_layer=1, n_embd=32, n_head=2, seq=8, batch=2)}
        steps, repeats = {"mlp": 2, "gpt": 2}, {"mlp": 2, "gpt": 2}
    else:
        models = {"mlp": mlp_model(depth=100, width=64, batch=16),
                  "gpt": gpt_model(n_layer=6, n_embd=256, n_head=8, seq=128, batch=8)}
        steps, repeats = {"mlp": 20, "gpt": 3}, {"mlp": 12, "gpt": 8}
    repeats = {k: args.repeats or v for k, v in repeats.items()}
    cases, rows = [], []
    t_start = time.perf_counter()
    for name in args.models.split(","):
        model = models[name]
        peak = None
        for mode in args.modes.split(","):
            if mode == "streamed" and peak is None:  # the streamed budget is set from the resident run's peak
                peak = measure(model, "resident", 1, 1, None)["device_peak_accounted_bytes"]
            c = measure(model, mode, args.steps or steps[name], repeats[name], peak)
            c["name"] = name
            if mode == "resident":
                peak = c["device_peak_accounted_bytes"]
            cases.append(c)
            rows.append([name, mode, c["module_calls_per_step"], f"{c['torch_ms']:.2f}", f"{c['engine_ms']:.2f}",
                         f"{c['ratio']:.3f}x", f"{c['us_per_module_call']:.1f}",
                         f"{c['ratio_min']:.3f}x / {c['us_per_module_call_min']:.1f}",
                         f"{c['ratio_cpu']:.3f}x / {c['us_per_module_call_cpu']:.1f}",
                         "yes" if c["on_plan"] else "NO", "yes" if c["streamed"] else "no",
                         " ".join(f"{x:.1f}" for x in c["load_average"])])
    print_table("Engine overhead per module call (CPU backend, fp32; medians over interleaved blocks)",
                ["name", "mode", "calls/step", "torch ms", "engine ms", "ratio", "us/call",
                 "min: ratio / us/call", "CPU time: ratio / us/call", "on plan", "streamed", "load avg"], rows, console)
    adamw = {c["torch_adamw"] for c in cases}
    console.print(f"torch baseline: torch.optim.AdamW {', '.join(sorted(adamw))}; engine: offload.AdamW "
                  f"(fused C++ kernel: {offload.AdamW([nn.Parameter(torch.zeros(1))]).fused}); CPU backend "
                  f"copies: {copies}")
    goals = {}
    for c in cases:
        if c["mode"] == "resident" and c["name"] in GOALS and not args.smoke:
            # judged on both clocks: under load the wall-clock ratio swings either way (it has read 0.41x),
            # the CPU-time ratio far less; the goal is met only where both are within it
            met = max(c["ratio"], c["ratio_cpu"]) <= GOALS[c["name"]]
            goals[c["name"]] = {"ratio_goal": GOALS[c["name"]], "ratio": c["ratio"], "ratio_cpu": c["ratio_cpu"],
                                "met": met}
            console.print(f"{c['name']} resident: {c['ratio']:.3f}x torch by wall clock, {c['ratio_cpu']:.3f}x by "
                          f"CPU time (goal <= {GOALS[c['name']]}x on both: {'met' if met else 'MISSED'}), "
                          f"{c['us_per_module_call_cpu']:.1f} us per module call by CPU time")
    console.print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
                  f"({os.cpu_count()} logical CPUs; other processes share this machine); "
                  f"{time.perf_counter() - t_start:.0f} s")
    write_json(args.json, {
        "benchmark": "overhead", "smoke": args.smoke, "label": args.label, "machine": info,
        "load_average_after": machine()["load_average"],
        "settings": {"models": args.models, "modes": args.modes, "repeats": repeats,
                     "steps": {k: args.steps or v for k, v in steps.items()}, "threads": torch.get_num_threads(),
                     "cpu_copies": copies, "hparams": HP, "dtype": "float32", "device": "cpu"},
        "goals": goals, "cases": cases,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
