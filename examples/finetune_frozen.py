"""Fine-tune a frozen GPT with offload: only the top blocks train, or LoRA adapters on them.

    python examples/finetune_frozen.py                        # blocks 6, 7 (of 8) and ln_f train
    python examples/finetune_frozen.py --lora 8               # rank-8 adapters on blocks 6, 7; every weight frozen
    python examples/finetune_frozen.py --train-from 4 --steps 200
    python examples/finetune_frozen.py --init ckpt.pt         # start from examples/train_gpt.py --save ckpt.pt

The model (examples/gpt.py, byte-level, trained on the standard library's .py files like train_gpt.py) is
"pretrained" only if you pass --init; otherwise it is a random init, which is enough to see what the engine
does with frozen weights:

* a frozen parameter gets no gradient, no AdamW state and no fp32 master beyond the copy the device
  computes with: 4 bytes on the host in fp32, 2 in bf16/fp16, against 16 for a trainable one (20 where
  updates are deferred, float16's default: an fp32 grad sum beside the copies' landing place);
* backward reads a frozen weight only where a gradient flows through it to a trainable parameter below;
  below the lowest trainable parameter nothing is needed, so those buckets cross to the device once a step
  (forward) and never again for backward.

The script measures both (engine.memory_stats(): host bytes, bytes moved per bucket) and exits with 1 if
either does not hold, if the loss did not go down or if the device peak went over the budget.
"""

import argparse
import sys
import time

import torch
from _common import (  # next to this file
    add_run_args,
    checkpointing,
    default_budget,
    format_bytes,
    get_batch,
    load_stdlib_source,
    loss_trend,
    progress_columns,
    setup,
)
from gpt import GPT, GPTConfig  # examples/gpt.py, next to this file
from rich.console import Console
from rich.progress import Progress, TextColumn
from rich.table import Table
from torch import nn

import offload

console = Console()


class LoRALinear(nn.Module):
    """``base(x) + scale * B(A(x))`` with ``base`` frozen and the rank-``r`` A, B trained (Hu et al., 2021).
    B starts at zero, so the adapted model starts as the base model."""

    def __init__(self, base: nn.Linear, r: int, alpha: float = 16.0):
        super().__init__()
        self.base = base
        self.lora_a = nn.Linear(base.in_features, r, bias=False)
        self.lora_b = nn.Linear(r, base.out_features, bias=False)
        nn.init.normal_(self.lora_a.weight, std=1.0 / r)
        nn.init.zeros_(self.lora_b.weight)
        self.scale = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * self.lora_b(self.lora_a(x))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(p, steps=30, batch=2, seq=32, lr=1e-3,
                 helps={"budget": "device memory budget (default: half the fp32 weights, plus the runtime headroom "
                                  "on CUDA)"})
    p.add_argument("--n-layer", type=int, default=8, help="transformer blocks")
    p.add_argument("--n-embd", type=int, default=256, help="model width")
    p.add_argument("--n-head", type=int, default=8, help="attention heads; must divide --n-embd")
    p.add_argument("--train-from", type=int, help="blocks from this one up train (default: the top two)")
    p.add_argument("--lora", type=int, default=0, help="rank of LoRA adapters on those blocks (0: train them whole)")
    p.add_argument("--init", help="start from this checkpoint (examples/train_gpt.py --save, same sizes)")
    args = p.parse_args(argv)
    if args.train_from is None:
        args.train_from = max(0, args.n_layer - 2)
    if not 0 <= args.train_from < args.n_layer:
        p.error(f"--train-from must be in [0, {args.n_layer})")
    if args.steps < 2 or args.lora < 0:
        p.error("--steps must be at least 2 and --lora at least 0")
    return args


def build(args) -> GPT:
    model = GPT(GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                          n_embd=args.n_embd, init_seed=args.seed))
    if args.init:
        state = torch.load(args.init, weights_only=True)["model"]
        model.load_state_dict(state)
        console.print(f"weights from {args.init}")
    model.requires_grad_(False)  # everything frozen, then the parts that train
    for block in model.blocks[args.train_from:]:
        if args.lora:
            for parent in (block.attn, block.mlp):
                for name in ("c_attn", "c_fc", "c_proj"):
                    if hasattr(parent, name):
                        setattr(parent, name, LoRALinear(getattr(parent, name), args.lora))
        else:
            block.requires_grad_(True)
    if not args.lora:
        model.ln_f.requires_grad_(True)
    return model


def below_lowest_trainable(model: nn.Module, args) -> set[int]:
    """ids of the parameters no gradient reaches: the position embedding and the blocks under the lowest
    trainable one (the token embedding is tied to the LM head at the top, so gradients do flow through it)."""
    params = [model.wpe.weight, *(p for block in model.blocks[: args.train_from] for p in block.parameters())]
    return {id(p) for p in params}


def planned_bytes(plan, b) -> tuple[int, int]:
    """Bytes the plan copies to the device for bucket ``b`` each step: in all, and in copies that stay on
    into backward or are made for it (the backward refetches). Resident buckets are not copied by the plan."""
    if b in plan.resident:
        return 0, 0
    nf = plan.trace.num_forward
    mine = [x for x in plan.buffers if x.bucket == b and x.kind.value == "param"]
    return sum(x.size for x in mine), sum(x.size for x in mine if x.end > nf)


def classify(rt, below: set[int]) -> dict[str, list]:
    kinds = {"frozen, below the lowest trainable": [], "the rest": []}
    for b in rt.slots.buckets:
        low = all(id(rt.ctx.params[p]) in below for p in b.params)
        kinds["frozen, below the lowest trainable" if low else "the rest"].append(b)
    return kinds


def transfers_table(rt, below: set[int], per_step: list[float], steps: int) -> Table:
    table = Table(title=f"host -> device copies per step (measured: mean of the last {steps} steps)")
    for col in ("buckets", "count", "bytes", "copied per step", "of which for backward (plan)"):
        table.add_column(col, justify="right" if col != "buckets" else "left")
    for name, buckets in classify(rt, below).items():
        if buckets:
            size = sum(b.nbytes(rt.ctx.itemsize) for b in buckets)
            moved = sum(per_step[b.index] for b in buckets)
            backward = sum(planned_bytes(rt.executor.train_plan, b.index)[1] for b in buckets)
            table.add_row(name, str(len(buckets)), format_bytes(size), format_bytes(moved), format_bytes(backward))
    return table


def main(argv=None) -> int:
    args = parse_args(argv)
    device = setup(args)
    train_data, _, files = load_stdlib_source()
    model = build(args)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    what = f"rank-{args.lora} adapters on" if args.lora else "whole"
    console.print(f"model: {total / 1e6:.2f}M parameters; {trainable / 1e6:.3f}M train ({what} blocks "
                  f"{args.train_from}..{args.n_layer - 1}), the rest is frozen")
    below = below_lowest_trainable(model, args)

    opt = offload.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    weights = 4 * total
    dtype = getattr(torch, args.dtype)
    engine = offload.wrap(model, opt, budget=args.budget or default_budget(weights // 2, device),
                          bucket_bytes=max(weights // 24, 4096),
                          dtype=dtype, device=device, activation_checkpointing=checkpointing(args))
    rt = engine._runtime
    g = torch.Generator().manual_seed(args.seed)
    losses, marks = [], {}
    columns = progress_columns("fine-tune", TextColumn("{task.fields[tps]:,.0f} tok/s"))
    try:
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("fine-tune", total=args.steps, loss=float("nan"), tps=0.0)
            for step in range(args.steps):
                if step == 2:  # steps 0 (traced) and 1 (first on the plan) excluded from the per-step means
                    marks["start"] = engine.memory_stats()["transfers"]
                t0 = time.perf_counter()
                x, y = get_batch(train_data, args.batch, args.seq, g)
                logits, _ = engine(x.to(device))
                loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.to(device).flatten())
                engine.backward(loss)
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                dt = time.perf_counter() - t0
                progress.update(task, advance=1, loss=losses[-1], tps=x.numel() / dt)
        stats = engine.memory_stats()
        end = stats["transfers"]
        start = marks.get("start", {"h2d_bytes_by_bucket": [0] * len(rt.slots.buckets), "d2h_bytes": 0})
        measured = max(1, args.steps - 2)
        per_step = [(a - b) / measured for a, b in zip(end["h2d_bytes_by_bucket"], start["h2d_bytes_by_bucket"])]
        console.print(transfers_table(rt, below, per_step, measured))
        ok = report(rt, stats, below, per_step, losses, trainable, total, dtype)
    finally:
        engine.close()
    return 0 if ok else 1


def report(rt, stats, below, per_step, losses, trainable, total, dtype) -> bool:
    itemsize = torch.empty((), dtype=dtype).element_size()
    host = stats["host_pinned_bytes"]
    # grads: the grad staging ring (room for the few largest buckets in the device dtype), + an fp32 sum per
    # trainable parameter where updates are deferred (accumulation)
    layout = rt.slots.host.layout
    per_trainable = 12 + layout.grad_itemsize + layout.staging_itemsize + (itemsize if itemsize < 4 else 0)
    frozen_b = itemsize if itemsize < 4 else 4
    ring = layout.ring_bytes
    all_trainable = per_trainable * total + ring
    formula = per_trainable * trainable + frozen_b * (total - trainable) + ring
    table = Table(title="host memory (engine.memory_stats()['host_pinned_bytes'])")
    table.add_column("")
    table.add_column("bytes", justify="right")
    table.add_row("host arena, measured", format_bytes(host))
    table.add_row(f"{per_trainable} B/trainable + {frozen_b} B/frozen param + grad ring", format_bytes(formula))
    table.add_row(f"if every parameter trained ({per_trainable} B/param)", format_bytes(all_trainable))
    console.print(table)
    checks = []
    checks.append(("host arena holds no optimizer state for frozen weights",
                   formula <= host <= formula + 6 * 64 * len(rt.slots.buckets) + 64))
    summary, plan = stats["plan"], rt.executor.train_plan
    below_buckets = classify(rt, below)["frozen, below the lowest trainable"]
    no_backward = all(planned_bytes(plan, b.index)[1] == 0 for b in below_buckets)
    checks.append(("buckets below the lowest trainable parameter are not copied for backward", no_backward))
    # What was measured is what the plan says: its copies, plus the refresh of updated resident buckets
    # (none after a step float16 skipped for overflow).
    planned = [planned_bytes(plan, b.index)[0] for b in rt.slots.buckets]
    refresh = [b.nbytes(rt.ctx.itemsize) if b.index in plan.resident and b.trainable_numel else 0 for b in rt.slots.buckets]
    checks.append(("bytes copied per bucket = the plan's",
                   all(p <= m <= p + r for m, p, r in zip(per_step, planned, refresh))))
    peak, budget = stats["device_peak_bytes"], stats["budget_bytes"]
    checks.append((f"device peak {format_bytes(peak)} <= budget {format_bytes(budget)} "
                   f"({summary['streamed_buckets']} of {summary['num_buckets']} buckets streamed)", peak <= budget))
    k, first, last = loss_trend(losses)
    checks.append((f"loss {first:.3f} -> {last:.3f} (mean of the first {k} -> last {k} steps)", last < first))
    for text, ok in checks:
        console.print(f"[{'green' if ok else 'red'}]{'ok ' if ok else 'FAIL'} {text}[/]")
    return all(ok for _, ok in checks)


if __name__ == "__main__":
    sys.exit(main())
