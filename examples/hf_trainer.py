"""Hugging Face Trainer with offload: transformers' own training loop, the model's weights and AdamW state offloaded.

    python examples/hf_trainer.py                              # GPT-2 (4.8M) from a config, 40 steps, budget 3/4 of its weights
    python examples/hf_trainer.py --dtype bfloat16 --accum 2   # bf16 compute, 2 micro-batches per step
    python examples/hf_trainer.py --resume out/checkpoint-20   # goes on exactly where that checkpoint stopped

The one change against a plain Trainer script is the class and its budget:

    trainer = OffloadTrainer(model=model, args=TrainingArguments(...), train_dataset=..., offload_budget="8GiB")

Needs transformers and accelerate (pip install -e ".[hf]"); nothing is downloaded: GPT2LMHeadModel from a
GPT2Config (random init), trained byte-level on this Python's standard library source. It evaluates every
--eval-every steps, checkpoints at the same steps (output_dir/checkpoint-N: offload.pt + the Trainer's files),
writes the last step's timeline (--timeline, Chrome trace) and prints the memory table.

Exits with 1 if the loss did not go down or the device peak went over the budget.
"""

import argparse
import sys

import torch
from _common import (  # examples/_common.py, next to this file
    format_bytes,
    import_transformers,
    load_stdlib_source,
)
from rich.console import Console

import offload

console = Console()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--budget", help='device memory budget, e.g. "12MiB" (default: 3/4 of the fp32 weights)')
    p.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--seq", type=int, default=64, help="bytes per sequence")
    p.add_argument("--accum", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--lr", type=float, default=1e-3, help="learning_rate (cosine schedule, 10 %% warmup)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="compute dtype: TrainingArguments(bf16=...) / (fp16=...)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available, else cpu")
    p.add_argument("--eval-every", type=int, default=20, help="eval_steps and save_steps")
    p.add_argument("--output-dir", default="hf_trainer_out", help="TrainingArguments(output_dir=...)")
    p.add_argument("--resume", help="resume_from_checkpoint: a checkpoint-N folder this script wrote")
    p.add_argument("--timeline", default=None, help="write the last step as Chrome-trace JSON to this path")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class Windows(torch.utils.data.Dataset):
    """Fixed windows of the text: example i is the same bytes on every run (the Trainer shuffles them)."""

    def __init__(self, data: torch.Tensor, seq: int, count: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.data, self.seq = data, seq
        self.starts = torch.randint(len(data) - seq, (count,), generator=g).tolist()

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict:
        ids = self.data[self.starts[i]: self.starts[i] + self.seq].long()
        return {"input_ids": ids, "labels": ids}  # GPT2LMHeadModel shifts the labels itself


def main(argv=None) -> int:
    args = parse_args(argv)
    tf = import_transformers("examples/hf_trainer.py")
    from offload.integrations.hf import OffloadTrainer

    train, val, files = load_stdlib_source()
    console.print(f"data: {format_bytes(len(train) + len(val))} of stdlib source from {files} files")
    torch.manual_seed(args.seed)
    config = tf.GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=256, n_layer=6, n_head=4,
                           bos_token_id=0, eos_token_id=0)
    model = tf.GPT2LMHeadModel(config)
    weights = sum(p.numel() * 4 for p in model.parameters())
    budget = offload.parse_bytes(args.budget) if args.budget else weights * 3 // 4
    use_cpu = args.device == "cpu" or (args.device is None and not torch.cuda.is_available())
    training = tf.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch, gradient_accumulation_steps=args.accum, learning_rate=args.lr,
        lr_scheduler_type="cosine", warmup_steps=max(1, args.steps // 10), weight_decay=0.1, max_grad_norm=1.0,
        bf16=args.dtype == "bfloat16", fp16=args.dtype == "float16", eval_strategy="steps",
        eval_steps=args.eval_every, save_strategy="steps", save_steps=args.eval_every, logging_steps=max(1, min(5, args.steps // 4)),
        seed=args.seed, report_to=[], use_cpu=use_cpu, disable_tqdm=True)
    trainer = OffloadTrainer(
        model=model, args=training, train_dataset=Windows(train, args.seq, 4096, args.seed),
        eval_dataset=Windows(val, args.seq, 32, args.seed + 1),
        offload_config=offload.OffloadConfig(budget=budget, device="cpu" if use_cpu else "cuda",
                                             bucket_bytes=max(weights // 16, 1 << 16),
                                             # GPT-2's eager attention saves more than the budget leaves: the
                                             # engine checkpoints the fewest blocks that make the step fit
                                             activation_checkpointing="auto"))
    console.print(f"GPT2LMHeadModel: {weights / 4e6:.2f}M parameters ({format_bytes(weights)} fp32), device "
                  f"budget {format_bytes(budget)}, {args.dtype}")
    trainer.train(resume_from_checkpoint=args.resume)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    evals = [log["eval_loss"] for log in trainer.state.log_history if "eval_loss" in log]
    if args.timeline:
        trainer.engine.export_timeline(args.timeline)
        console.print(f"wrote {args.timeline}: open it in https://ui.perfetto.dev")
    stats = trainer.engine.memory_stats()
    offload.print_memory(stats, console)
    trainer.engine.close()
    within = stats["device_peak_bytes"] <= stats["budget_bytes"]
    curve = evals if len(evals) >= 2 else losses  # held-out loss where there are two evaluations
    went_down = len(curve) >= 2 and curve[-1] < curve[0]
    console.print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; eval loss " + " -> ".join(f"{x:.3f}" for x in evals))
    console.print(f"[{'green' if within else 'red'}]{offload.memory_line(stats)}")
    return 0 if within and (went_down or args.resume) else 1


if __name__ == "__main__":
    sys.exit(main())
