"""BERT masked-language-model training with offload: Hugging Face's BertForMaskedLM, unchanged.

    python examples/bert_mlm.py                       # a small BERT from a config, random init, 30 steps
    python examples/bert_mlm.py --layers 6 --hidden 384 --steps 200 --dtype bfloat16

Needs `transformers` (pip install -e ".[hf]"); nothing is downloaded: the model is built from a BertConfig
with random weights, and the text is this Python's standard library source (the same offline corpus as
train_gpt.py), read as bytes: a byte-level vocabulary (256 byte values + [PAD], [MASK], [CLS], [SEP]) instead
of BERT's WordPiece, whose vocabulary file would have to be downloaded. Masking follows BERT: 15 % of the
positions are predicted, of those 80 % shown as [MASK], 10 % as a random byte, 10 % unchanged.

Exits with 1 if the loss did not go down or the device peak went over the budget.
"""

import argparse
import sys
import time

import torch
from _common import (
    add_run_args,
    checkpointing,
    default_budget,
    format_bytes,
    import_transformers,
    load_stdlib_source,  # examples/_common.py, next to this file
    loss_trend,
    progress_columns,
    setup,
)
from rich.console import Console
from rich.progress import Progress, TextColumn

import offload

PAD, MASK, CLS, SEP = 256, 257, 258, 259
VOCAB = 260
console = Console()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(p, steps=30, batch=2, seq=64, lr=5e-4, checkpointing="auto", helps={
        "seq": "bytes per sequence, [CLS] and [SEP] included", "seed": "seed of the init, the batches and the masks"})
    p.add_argument("--layers", type=int, default=4, help="encoder layers")
    p.add_argument("--hidden", type=int, default=256, help="hidden size")
    p.add_argument("--heads", type=int, default=4, help="attention heads; must divide --hidden")
    args = p.parse_args(argv)
    if args.steps < 2 or args.seq < 8:
        p.error("--steps must be at least 2 and --seq at least 8")
    return args


def mlm_batch(data: torch.Tensor, batch: int, seq: int, g: torch.Generator) -> dict:
    """`batch` random windows of the text, framed by [CLS] ... [SEP], masked as BERT does."""
    ix = torch.randint(len(data) - seq, (batch,), generator=g).tolist()
    body = torch.stack([data[i: i + seq - 2] for i in ix]).long()
    ids = torch.cat([torch.full((batch, 1), CLS), body, torch.full((batch, 1), SEP)], dim=1)
    predict = torch.rand(ids.shape, generator=g) < 0.15
    predict[:, [0, -1]] = False  # never [CLS] / [SEP]
    predict[:, 1] |= ~predict.any(1)  # at least one prediction per sequence
    labels = torch.where(predict, ids, -100)  # -100: no loss here
    roll = torch.rand(ids.shape, generator=g)
    inputs = torch.where(predict & (roll < 0.8), MASK, ids)
    random_bytes = torch.randint(0, 256, ids.shape, generator=g)
    inputs = torch.where(predict & (roll >= 0.8) & (roll < 0.9), random_bytes, inputs)
    return {"input_ids": inputs, "attention_mask": torch.ones_like(ids), "labels": labels}


def main(argv=None) -> int:
    args = parse_args(argv)
    transformers = import_transformers("this example")
    device = setup(args)
    train_data, _, files = load_stdlib_source()
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                     num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
                                     max_position_embeddings=args.seq, pad_token_id=PAD)
    model = transformers.BertForMaskedLM(config).float().train()
    n = sum(p.numel() for p in model.parameters())
    weights = 4 * n
    console.print(f"BertForMaskedLM: {n / 1e6:.2f}M parameters ({format_bytes(weights)} fp32), "
                  f"{args.layers} layers x {args.hidden}; text: {files} stdlib files, byte-level")
    opt = offload.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    engine = offload.wrap(model, opt, budget=args.budget or default_budget(int(0.75 * weights), device),
                          bucket_bytes=max(weights // 12, 4096), dtype=getattr(torch, args.dtype), device=device,
                          activation_checkpointing=checkpointing(args))
    console.print(f"device: {device}, budget {format_bytes(engine.memory_stats()['budget_bytes'])}")
    g = torch.Generator().manual_seed(args.seed)
    losses = []
    columns = progress_columns("bert mlm", TextColumn("{task.fields[tps]:,.0f} tok/s"),
                               TextColumn("peak {task.fields[peak]}"))
    try:
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("bert", total=args.steps, loss=float("nan"), tps=0.0, peak="-")
            for _ in range(args.steps):
                t0 = time.perf_counter()
                batch = {k: v.to(device) for k, v in mlm_batch(train_data, args.batch, args.seq, g).items()}
                loss = engine(**batch).loss
                engine.backward(loss)
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                dt = time.perf_counter() - t0
                peak = format_bytes(engine.memory_stats()["device_peak_bytes"])
                progress.update(task, advance=1, loss=losses[-1], tps=batch["input_ids"].numel() / dt, peak=peak)
        stats = engine.memory_stats()
    finally:
        engine.close()
    console.print(offload.memory_table(stats))
    within = stats["device_peak_bytes"] <= stats["budget_bytes"]
    k, first, last = loss_trend(losses)
    console.print(f"[{'green' if within else 'red'}]device peak {format_bytes(stats['device_peak_bytes'])} "
                  f"{'<=' if within else '>'} budget {format_bytes(stats['budget_bytes'])}")
    console.print(f"[{'green' if last < first else 'red'}]loss {first:.3f} -> {last:.3f} "
                  f"(mean of the first {k} -> last {k} steps)")
    return 0 if within and last < first else 1


if __name__ == "__main__":
    sys.exit(main())
