"""PyTorch's DCGAN training loop with both networks wrapped, against the same loop in plain PyTorch, on the same
machine, in the same process, interleaved ([Note: reads the plan did not foresee] in
offload/runtime/unforeseen_reads.py).

One step: the discriminator's pass over real samples and one over detached fake ones, each with its backward, its
step; then the generator's pass through the discriminator, whose backward reads the discriminator's first weight
once more (its input needs a gradient there). Networks: MLPs of ``--layers`` x Linear(``--width``) + Tanh, batch
``--batch``. The engine: ``offload.wrap`` on the CPU backend, the generator with overlapped updates, the
discriminator deferred (its grads from the generator's pass are dropped by its next ``zero_grad``), in two
settings: ``resident`` (the budget holds everything: fast steps) and ``streamed`` (0.9 x the weights). torch:
``torch.optim.AdamW(foreach=False)``. Engine and torch run in blocks of ``--steps`` steps, alternating, ``--repeats``
times; step times are medians over blocks (wall clock), one torch thread. The discriminator's departures and
re-plans over the timed steps show whether its plan held.

    python benchmarks/gan_loop.py --json benchmarks/results/cpu-<date>/gan_loop.json
    python benchmarks/gan_loop.py --smoke   # tiny sizes, seconds: the harness, not the figures
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import describe, machine, median, print_table, write_json  # noqa: E402
from rich.console import Console  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.functional import binary_cross_entropy_with_logits as bce  # noqa: E402

import offload  # noqa: E402

NOISE, SAMPLE = 16, 8
BUDGETS = {"resident": 10.0, "streamed": 0.9}  # x the fp32 weights of each network


def _mlp(seed: int, inputs: int, outputs: int, width: int, layers: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(inputs, width), nn.Tanh(),
                         *[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers - 2)],
                         nn.Linear(width, outputs))


def _wrap(model: nn.Module, budget: float, overlap: bool) -> tuple[offload.Engine, offload.AdamW]:
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    opt = offload.AdamW(model.parameters(), fused=False, lr=2e-4, betas=(0.5, 0.999))
    return offload.wrap(model, opt, budget=int(budget * nbytes), bucket_bytes=nbytes // 10, device="cpu",
                        overlap_optimizer=overlap), opt


class Loop:
    """One DCGAN setup: ``step(i)`` runs step ``i``."""

    def __init__(self, width: int, layers: int, batch: int, budget: float | None) -> None:
        self.g, self.d = _mlp(0, NOISE, SAMPLE, width, layers), _mlp(1, SAMPLE, 1, width, layers)
        self.batch = batch
        self.engines: tuple[offload.Engine, ...] = ()
        if budget is None:
            self.g_opt = torch.optim.AdamW(self.g.parameters(), lr=2e-4, betas=(0.5, 0.999), foreach=False)
            self.d_opt = torch.optim.AdamW(self.d.parameters(), lr=2e-4, betas=(0.5, 0.999), foreach=False)
        else:
            g_engine, self.g_opt = _wrap(self.g, budget, overlap=True)
            d_engine, self.d_opt = _wrap(self.d, budget, overlap=False)
            self.engines = (g_engine, d_engine)
        self.ones, self.zeros = torch.ones(batch, 1), torch.zeros(batch, 1)

    def step(self, i: int) -> None:
        gen = torch.Generator().manual_seed(i)
        real, noise = torch.randn(self.batch, SAMPLE, generator=gen), torch.randn(self.batch, NOISE, generator=gen)
        self.d_opt.zero_grad()
        bce(self.d(real), self.ones).backward()
        fake = self.g(noise)
        bce(self.d(fake.detach()), self.zeros).backward()
        self.d_opt.step()
        self.g_opt.zero_grad()
        bce(self.d(fake), self.ones).backward()
        self.g_opt.step()

    def counters(self) -> dict[str, int]:
        c = self.engines[1].memory_stats()["counters"]
        return {k: c[k] for k in ("plan_departures", "replans", "fast_steps")}

    def close(self) -> None:
        for e in self.engines:
            e.close()


def _block(loop: Loop, first: int, steps: int) -> float:
    t = time.perf_counter()
    for i in range(first, first + steps):
        loop.step(i)
    return (time.perf_counter() - t) / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5, help="steps per timed block")
    ap.add_argument("--repeats", type=int, default=6, help="blocks per side")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: the harness, not the figures")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.width, args.layers, args.batch, args.steps, args.repeats = 64, 6, 8, 2, 2
    torch.set_num_threads(args.threads)
    console = Console()
    info = machine()
    describe(console, info)
    rows, results = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", offload.OffloadWarning)  # the departures are counted and shown instead
        for setting, budget in BUDGETS.items():
            engine, torch_loop = Loop(args.width, args.layers, args.batch, budget), Loop(
                args.width, args.layers, args.batch, None)
            for i in range(3):  # the traced step, the first plans
                engine.step(i)
                torch_loop.step(i)
            before = engine.counters()
            times: dict[str, list[float]] = {"engine": [], "torch": []}
            first = 3
            for r in range(args.repeats):
                order = (("engine", engine), ("torch", torch_loop))
                for name, loop in order if r % 2 == 0 else order[::-1]:
                    times[name].append(_block(loop, first, args.steps))
                first += args.steps
            after = engine.counters()
            timed = {k: after[k] - before[k] for k in after}
            engine.close()
            eng_ms, torch_ms = 1e3 * median(times["engine"]), 1e3 * median(times["torch"])
            rows.append([setting, f"{eng_ms:.2f}", f"{torch_ms:.2f}", f"{eng_ms / torch_ms:.2f}x",
                         timed["plan_departures"], timed["replans"], timed["fast_steps"]])
            results.append({"setting": setting, "budget_x_weights": budget, "engine_step_ms": eng_ms,
                            "torch_step_ms": torch_ms, "ratio": eng_ms / torch_ms,
                            "discriminator_over_timed_steps": timed,
                            "timed_steps": args.steps * args.repeats})
    print_table(f"DCGAN loop, MLPs {args.layers} x {args.width}, batch {args.batch} (median step, wall)",
                ["setting", "engine ms", "torch ms", "ratio", "D departures", "D re-plans", "D fast passes"], rows,
                console)
    write_json(args.json, {"benchmark": "gan_loop", "smoke": args.smoke, "machine": info, "args": vars(args),
                           "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
