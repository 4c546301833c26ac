"""Pinned host bytes per parameter, measured from the engine's host arena (issue 18, "Host bytes per parameter").

A GPT-2 124M-shaped model (examples/gpt.py: 12 layers, 12 heads, width 768, vocabulary 50257, 1024 positions,
tied head: 124.4M parameters) wrapped with ``offload.wrap(..., device="cpu")`` on the CPU backend, trained for
``--steps`` steps on random tokens (batch 1, 32 tokens: the figure does not depend on the batch), in each of
four settings: bf16 and fp32 compute, each with the optimizer overlapped with backward (the default) and
deferred to ``step()`` (``overlap_optimizer=False``, two backward passes per step). It prints
``memory_stats()["host_bytes_per_param"]`` (the arena's bytes, as allocated, over the model's parameters) and
``host_pinned_bytes``; ``--json PATH`` writes them.

    python benchmarks/host_bytes.py [--steps 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import offload  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402

GPT2_124M = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)


def measure(dtype: torch.dtype, overlap: bool, steps: int) -> dict:
    model = GPT(GPT2_124M)
    params = sum(p.numel() for p in model.parameters())
    opt = offload.AdamW(model.parameters(), lr=1e-4)
    engine = offload.wrap(model, opt, budget="2GiB", dtype=dtype, device="cpu", overlap_optimizer=overlap)
    g = torch.Generator().manual_seed(0)
    try:
        for _ in range(steps):
            for _ in range(1 if overlap else 2):
                idx = torch.randint(0, GPT2_124M.vocab_size, (1, 32), generator=g)
                _, loss = engine(idx, idx)
                engine.backward(loss)
            opt.step()
            opt.zero_grad()
        stats = engine.memory_stats()
    finally:
        engine.close()
    return {"dtype": str(dtype).removeprefix("torch."), "overlap_optimizer": overlap, "params": params,
            "host_pinned_bytes": stats["host_pinned_bytes"], "host_bytes_per_param": stats["host_bytes_per_param"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for overlap in (True, False):
            r = measure(dtype, overlap, args.steps)
            rows.append(r)
            print(f"{r['dtype']:>9} overlap={str(overlap):5} params {r['params']:,}  host arena "
                  f"{r['host_pinned_bytes'] / 2**20:8.1f} MiB  {r['host_bytes_per_param']:.2f} B/param", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": "gpt2-124m (examples/gpt.py)", "cases": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
