"""Train a small GPT whose weights do not fit the device budget, with offload.

    python examples/train_gpt.py                         # 4.8M parameters, budget 3/4 of their 18 MiB
    python examples/train_gpt.py --steps 500 --budget 12MiB --dtype bfloat16
    python examples/train_gpt.py --model hf-gpt2         # transformers' GPT2LMHeadModel, same sizes (--checkpointing auto)
    python examples/train_gpt.py --steps 50 --save ckpt.pt && python examples/train_gpt.py --steps 100 --resume ckpt.pt

A byte-level language model (vocab 256: one token per byte, no tokenizer files; GPT-2's BPE tokenizer
would need its vocabulary downloaded) trained on the .py files of this Python's own standard library:
real text, available offline. The model is the built-in GPT (examples/gpt.py) or, with --model hf-gpt2,
Hugging Face's GPT2LMHeadModel built from a GPT2Config (random init, nothing downloaded). The device budget
defaults to 3/4 of the model's fp32 weights, so the weights alone do not fit, let alone weights + grads +
AdamW state (16 bytes a parameter): offload keeps the fp32 masters and the optimizer state in host memory
and streams parameter buckets to the device every step. It runs on the GPU when there is one, else on
offload's CPU backend, which runs the same plan.

--save writes a checkpoint (weights, AdamW state, LR schedule, data position, RNG) at every evaluation
and at the end; --resume continues from one up to --steps, as if training had not stopped.

Exits with 1 if the loss did not go down or the device peak went over the budget.
"""

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F
from _common import (
    add_run_args,
    checkpointing,
    default_budget,
    format_bytes,
    get_batch,
    import_transformers,
    load_stdlib_source,  # examples/_common.py, next to this file
    loss_trend,
    plan_budget,
    progress_columns,
    setup,
)
from gpt import GPT, GPTConfig  # examples/gpt.py, next to this file
from rich.console import Console
from rich.progress import Progress, TextColumn

import offload

VAL_BATCHES = 8  # batches in one validation-loss estimate (always the same ones)

console = Console()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(p, steps=100, batch=2, seq=32, lr=2e-3, checkpointing=None, helps={
        "budget": 'device memory budget, e.g. "12MiB" (default: 3/4 of the fp32 weights, plus the runtime headroom '
                  'the engine measures on CUDA)',
        "checkpointing": 'activation checkpointing: "auto" recomputes the fewest blocks that make the activations fit '
                         'the budget, "none" never recomputes (default: auto with --model hf-gpt2, whose eager '
                         'attention saves more than the default budget leaves; none with gpt)',
        "lr": "peak learning rate (linear warmup, then cosine decay)",
        "seed": "seed of the weight init and the batch sampling"})
    p.add_argument("--bucket-bytes", help='bytes per parameter bucket, e.g. "1MiB" (default: 1/12 of the weights)')
    p.add_argument("--n-layer", type=int, default=6, help="transformer blocks")
    p.add_argument("--n-head", type=int, default=8, help="attention heads; must divide --n-embd")
    p.add_argument("--n-embd", type=int, default=256, help="model width")
    p.add_argument("--model", default="gpt", choices=["gpt", "hf-gpt2"],
                   help="examples/gpt.py, or transformers' GPT2LMHeadModel (needs the hf extra)")
    p.add_argument("--save", help="checkpoint file written at every evaluation and at the end")
    p.add_argument("--resume", help="checkpoint file (from --save) to continue from")
    p.add_argument("--stop-after", type=int, help="stop after this step, as if interrupted (--save writes there)")
    p.add_argument("--eval-every", type=int, default=25, help="steps between validation-loss estimates")
    args = p.parse_args(argv)
    if args.checkpointing is None:
        args.checkpointing = "auto" if args.model == "hf-gpt2" else "none"
    if args.steps < 1 or args.eval_every < 1:
        p.error("--steps and --eval-every must be at least 1")
    return args


def param_groups(model: torch.nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """Weight decay on matrices (Linear and Embedding weights) only, as in nanoGPT."""
    params = list(model.parameters())  # the tied embedding / LM head weight once
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def lr_lambda(total_steps: int):
    """Linear warmup over the first 10 % of the steps, then cosine decay to 10 % of the peak."""
    warmup = max(1, total_steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_model(args):
    """The built-in GPT, or transformers' GPT-2 with the same sizes (tied embedding and LM head in both)."""
    if args.model == "gpt":
        return GPT(GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                             n_embd=args.n_embd, init_seed=args.seed))
    transformers = import_transformers("--model hf-gpt2")
    config = transformers.GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=args.n_embd,
                                     n_layer=args.n_layer, n_head=args.n_head, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(args.seed)
    return transformers.GPT2LMHeadModel(config).float().train()


def lm_loss(forward, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-byte cross-entropy of either model (the built-in GPT returns (logits, loss); HF an output)."""
    out = forward(x)
    logits = out[0] if isinstance(out, tuple) else out.logits
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


@torch.no_grad()
def evaluate(engine, batches, device: str) -> float:
    engine.module.eval()  # under no_grad the engine runs a forward-only plan: no gradients, no backward
    losses = [lm_loss(engine, x.to(device), y.to(device)).item() for x, y in batches]
    engine.module.train()
    return sum(losses) / len(losses)


def train(engine, opt, sched, train_data, val_data, args, device: str, start: int = 0,
          g: torch.Generator | None = None) -> list[float]:
    """The training loop, as with any torch optimizer, from step ``start``. Returns the loss of every step."""
    g = g or torch.Generator().manual_seed(args.seed)
    g_val = torch.Generator().manual_seed(args.seed + 1)
    val_batches = [get_batch(val_data, args.batch, args.seq, g_val) for _ in range(VAL_BATCHES)]
    columns = progress_columns("train", TextColumn("{task.fields[ms]:.0f} ms/step"),
                               TextColumn("{task.fields[tps]:,.0f} tok/s"), TextColumn("device peak {task.fields[peak]}"))
    losses = []
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("train", total=args.steps, completed=start, loss=float("nan"), ms=0.0, tps=0.0,
                                 peak="-")
        end = min(args.steps, args.stop_after or args.steps)
        for step in range(start, end):
            t0 = time.perf_counter()
            x, y = get_batch(train_data, args.batch, args.seq, g)
            loss = lm_loss(engine, x.to(device), y.to(device))  # step 1 is traced; the plan is built after it
            engine.backward(loss)  # grads go to the host bucket by bucket during backward (loss-scaled in fp16)
            opt.step()
            opt.zero_grad()
            sched.step()
            losses.append(loss.item())
            dt = time.perf_counter() - t0
            peak = format_bytes(engine.memory_stats()["device_peak_bytes"])
            progress.update(task, advance=1, loss=losses[-1], ms=1000 * dt, tps=x.numel() / dt, peak=peak)
            if (step + 1) % args.eval_every == 0 or step + 1 == end:
                val = evaluate(engine, val_batches, device)
                progress.console.print(f"step {step + 1}: train loss {losses[-1]:.3f}, val loss {val:.3f}")
                if args.save:
                    engine.save(args.save, extra={"step": step + 1, "scheduler": sched.state_dict(),
                                                  "data_rng": g.get_state(), "args": vars(args)})
    return losses


def report(stats: dict, losses: list[float]) -> bool:
    """Print the memory summary and the verdict; True if the loss went down within the budget."""
    console.print(offload.memory_table(stats))
    peak, budget = format_bytes(stats["device_peak_bytes"]), format_bytes(stats["budget_bytes"])
    within = stats["device_peak_bytes"] <= stats["budget_bytes"]
    if within:
        console.print(f"[green]device peak {peak} <= budget {budget}: within budget[/green]")
    else:
        console.print(f"[red]device peak {peak} > budget {budget}: OVER BUDGET[/red]")
    k, first, last = loss_trend(losses)
    colour = "green" if last < first else "red"
    console.print(f"[{colour}]loss {first:.3f} -> {last:.3f} (mean of the first {k} steps -> of the last {k})")
    return within and last < first


def main(argv=None) -> int:
    args = parse_args(argv)
    device = setup(args)
    train_data, val_data, files = load_stdlib_source()
    console.print(
        f"data: {format_bytes(len(train_data) + len(val_data))} of stdlib source from {files} files; "
        f"{format_bytes(len(val_data))} held out"
    )
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())  # the tied embedding / LM head weight once
    weights = 4 * n_params
    console.print(f"model: {type(model).__name__}, {n_params / 1e6:.2f}M parameters, "
                  f"{format_bytes(weights)} of fp32 weights; byte-level tokens (vocab 256)")
    console.print(f"plain PyTorch keeps weights + grads + AdamW state on the device: {format_bytes(4 * weights)}")

    opt = offload.AdamW(param_groups(model), lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.steps))
    engine = None
    try:
        engine = offload.wrap(
            model,
            opt,
            budget=args.budget or default_budget(int(0.75 * weights), device),
            bucket_bytes=args.bucket_bytes or weights // 12,
            dtype=getattr(torch, args.dtype),
            device=device,
            activation_checkpointing=checkpointing(args),
        )
        stats = engine.memory_stats()
        budget, room = stats["budget_bytes"], plan_budget(stats)
        verdict = "the weights alone do not fit" if room < weights else "the weights fit"
        beside = f" ({format_bytes(room)} beside the runtime headroom)" if room != budget else ""
        console.print(f"device: {device}, budget {format_bytes(budget)}{beside}: {verdict}")
        start, g = 0, torch.Generator().manual_seed(args.seed)
        if args.resume:
            extra = engine.load(args.resume)
            start = extra["step"]
            sched.load_state_dict(extra["scheduler"])
            g.set_state(extra["data_rng"])
            console.print(f"resumed from {args.resume} at step {start}")
            if start >= args.steps:
                console.print(f"nothing to do: the checkpoint is at step {start}, --steps is {args.steps}")
                return 0
        losses = train(engine, opt, sched, train_data, val_data, args, device, start, g)
        stats = engine.memory_stats()
    except offload.BudgetTooSmallError as e:  # raised by wrap, or after the traced first step
        console.print(str(e), style="red", markup=False)
        console.print(f"Try --budget {math.ceil(e.min_budget_bytes / 2**20)}MiB or more.")
        return 2
    finally:
        if engine is not None:
            engine.close()
    return 0 if report(stats, losses) else 1


if __name__ == "__main__":
    sys.exit(main())
