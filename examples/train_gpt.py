"""Train a small GPT through offload, with a device budget smaller than its weights.

Byte-level language modelling on text every Python installation has: the standard library's own source.
Runs on the CPU backend by default (the "device" is a CPU arena, copies run on worker threads), so it
works anywhere; ``--device cuda`` once the CUDA backend lands.

    python examples/train_gpt.py                 # 100 steps, 19M parameters (73 MiB of fp32 weights), budget 40 MiB
    python examples/train_gpt.py --steps 20      # quick check: loss goes down, device peak <= budget

Exit status 1 if the loss did not go down or the device peak went over the budget.

The defaults keep activations (which grow with batch x sequence x width x depth) smaller than the weights
(width^2 x depth), so that streaming the weights is what makes the model fit: wide and shallow, a small
batch. Activation checkpointing will lift that limit.
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt import GPT, GPTConfig  # noqa: E402

import offload  # noqa: E402
from offload import format_bytes  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    p.add_argument("--budget", default="40MiB", help='device memory budget (default "40MiB", about half the weights)')
    p.add_argument("--bucket-bytes", default="2MiB", help="bucket size: the unit moved to the device (default 2MiB)")
    p.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--n-layer", type=int, default=6, help="transformer blocks (default 6)")
    p.add_argument("--n-embd", type=int, default=512, help="model width (default 512)")
    p.add_argument("--n-head", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed for the weights and the batches (default 0)")
    p.add_argument("--eval-every", type=int, default=25, help="validation loss every N steps (default 25)")
    p.add_argument("--data-mib", type=float, default=4.0, help="MiB of text to read (default 4)")
    return p.parse_args(argv)


def load_text(limit_bytes: int) -> torch.Tensor:
    """The standard library's .py files, in a fixed order, as bytes (deterministic on one Python)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit_bytes:
            break
    if total < 64 * 1024:
        raise SystemExit(f"found only {total} bytes of Python source under {root}; cannot train on that")
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit_bytes]), dtype=torch.uint8).long()


def batches(data: torch.Tensor, batch: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        x = torch.stack([data[s: s + seq] for s in starts])
        y = torch.stack([data[s + 1: s + seq + 1] for s in starts])
        yield x, y


def lr_lambda(total: int, warmup: int):
    def f(step: int) -> float:  # linear warmup, then cosine down to 10 %
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


@torch.no_grad()
def evaluate(engine, data: torch.Tensor, batch: int, seq: int, device: torch.device, n: int = 4) -> float:
    engine.module.eval()
    losses = []
    for i, (x, y) in zip(range(n), batches(data, batch, seq, seed=12345)):
        _, loss = engine(x.to(device), y.to(device))
        losses.append(loss.item())
    engine.module.train()
    return sum(losses) / len(losses)


def summary_table(engine, params: int) -> Table:
    s = engine.memory_stats()
    plan = s["plan"] or {}
    t = Table(title="memory", show_header=True, header_style="bold")
    t.add_column("what")
    t.add_column("bytes", justify="right")
    t.add_column("note")
    t.add_row("device budget", format_bytes(s["budget_bytes"]), "")
    peak_ok = s["device_peak_bytes"] <= s["budget_bytes"]
    t.add_row("device peak", format_bytes(s["device_peak_bytes"]),
              "[green]within budget[/]" if peak_ok else "[red]OVER BUDGET[/]")
    t.add_row("  parameter arena", format_bytes(s["arena_bytes"]),
              f"lower bound {format_bytes(plan.get('arena_lower_bound_bytes', 0))}")
    t.add_row("  saved activations (peak)", format_bytes(plan.get("activation_bytes", 0)), "")
    t.add_row("fp32 weights + grads + Adam", format_bytes(16 * params), "what plain PyTorch keeps on the device")
    t.add_row("host arena", format_bytes(s["host_pinned_bytes"]), "fp32 masters, Adam m/v, grads (pinned on CUDA)")
    t.add_row("buckets", f"{plan.get('resident_buckets', 0)} resident / {plan.get('streamed_buckets', 0)} streamed",
              f"{plan.get('fetches_per_step', 0)} fetches per step, {plan.get('replans', 0)} re-plans")
    return t


def main(argv=None) -> int:
    args = parse_args(argv)
    console = Console()
    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd, init_seed=args.seed)
    model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    text = load_text(int(args.data_mib * 2**20))
    split = int(len(text) * 0.95)
    train, val = text[:split], text[split:]

    opt = offload.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.steps, warmup=max(1, args.steps // 10)))
    engine = offload.wrap(model, opt, budget=args.budget, bucket_bytes=args.bucket_bytes, device=args.device)
    device = engine.config.device
    console.print(f"[bold]GPT[/] {cfg.n_layer} layers x {cfg.n_embd} wide: {params / 1e6:.2f}M parameters, "
                  f"{format_bytes(4 * params)} of fp32 weights, {format_bytes(16 * params)} with grads and Adam "
                  f"state; device budget [bold]{format_bytes(engine.config.budget)}[/] on {device}; "
                  f"{len(train) / 2**20:.1f} MiB of training text")

    losses, times = [], []
    columns = [TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[ms]} ms/step"),
               TextColumn("{task.fields[tps]} tok/s"), TimeRemainingColumn()]
    data = batches(train, args.batch, args.seq, seed=args.seed)
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("training", total=args.steps, loss="-", ms="-", tps="-")
        for step in range(args.steps):
            x, y = next(data)
            t0 = time.perf_counter()
            _, loss = engine(x.to(device), y.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            dt = time.perf_counter() - t0
            losses.append(loss.item())
            times.append(dt)
            progress.update(task, advance=1, loss=f"{losses[-1]:.3f}", ms=f"{1000 * dt:.0f}",
                            tps=f"{args.batch * args.seq / dt:,.0f}")
            if args.eval_every and (step + 1) % args.eval_every == 0:
                progress.console.print(f"step {step + 1}: validation loss "
                                       f"{evaluate(engine, val, args.batch, args.seq, device):.3f}")

    console.print(summary_table(engine, params))
    k = min(5, max(1, len(losses) // 2))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    steady = times[1:] or times
    console.print(f"loss {first:.3f} -> {last:.3f} (mean of first and last {k} steps); median step "
                  f"{1000 * sorted(steady)[len(steady) // 2]:.0f} ms after the traced first step "
                  f"({1000 * times[0]:.0f} ms)")
    stats = engine.memory_stats()
    engine.close()
    ok = last < first and stats["device_peak_bytes"] <= stats["budget_bytes"]
    if not ok:
        console.print("[red]FAILED[/]: the loss did not go down or the device peak exceeded the budget")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
