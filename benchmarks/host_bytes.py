"""Pinned host bytes per parameter, measured from the engine's host arena (issue 18, "Host bytes per parameter").

A GPT-2 124M-shaped model (examples/gpt.py: 12 layers, 12 heads, width 768, vocabulary 50257, 1024 positions,
tied head: 124.4M parameters) wrapped with ``offload.wrap(..., device="cpu")`` on the CPU backend, trained for
``--steps`` steps on random tokens (batch 1, 32 tokens: the figure does not depend on the batch), in each of
four settings: bf16 and fp32 compute, each with the optimizer overlapped with backward (the default) and
deferred to ``step()`` (``overlap_optimizer=False``, two backward passes per step). It prints
``memory_stats()["host_bytes_per_param"]`` (the arena's bytes, as allocated, over the model's parameters) and
``host_pinned_bytes``; ``--json PATH`` writes them.

``--device-optimizer`` measures instead the same model with ``OffloadConfig(device_optimizer=True)`` (bf16,
overlapped and deferred) at a 4 GiB budget, planned for a hardware model whose CPU AdamW is slow (the
``pcie4`` preset at 1e6 parameters/s, as tests/runtime/test_device_optimizer.py does) so that the planner
puts the optimizer of some buckets on the device whatever this CPU's measured compute times: the host
arena's bytes per parameter in all, and per placement (``memory_stats()["device_optimizer"]``, regions
without alignment or the shared ring): device-homed buckets keep no host state ([Note: device-homed
buckets] in offload/host/state.py), only their fp32 grad sum when deferred.

    python benchmarks/host_bytes.py [--steps 2] [--device-optimizer] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import dataclasses

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import offload  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from offload.planning.hw import PRESETS  # noqa: E402

GPT2_124M = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)


SLOW_CPU_ADAM = dataclasses.replace(PRESETS["pcie4"], name="pcie4-slow-cpu-adam", adam_params_per_s=1e6)


def measure(dtype: torch.dtype, overlap: bool, steps: int, device_optimizer: bool = False) -> dict:
    model = GPT(GPT2_124M)
    params = sum(p.numel() for p in model.parameters())
    opt = offload.AdamW(model.parameters(), lr=1e-4)
    extra = dict(device_optimizer=True, hw=SLOW_CPU_ADAM) if device_optimizer else {}
    engine = offload.wrap(model, opt, budget="4GiB" if device_optimizer else "2GiB", dtype=dtype, device="cpu",
                          overlap_optimizer=overlap, **extra)
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
    out = {"dtype": str(dtype).removeprefix("torch."), "overlap_optimizer": overlap, "params": params,
           "host_pinned_bytes": stats["host_pinned_bytes"], "host_bytes_per_param": stats["host_bytes_per_param"]}
    if device_optimizer:
        dev = stats["device_optimizer"]
        out |= {"device_optimizer": True, "device_homed_buckets": dev["device_homed_buckets"],
                "buckets": stats["plan"]["num_buckets"], "placement_weight_bytes": dev["bytes"],
                "host_bytes_by_placement": dev["host_bytes"], "host_bytes_per_param_by_placement":
                dev["host_bytes_per_param"], "host_ring_bytes": dev["host_ring_bytes"],
                "host_parked_bytes": dev["host_parked_bytes"],
                "host_grad_sum_bytes_device_homed": dev["host_grad_sum_bytes_device_homed"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--device-optimizer", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    cases = ([(torch.bfloat16, True), (torch.bfloat16, False)] if args.device_optimizer else
             [(d, o) for d in (torch.bfloat16, torch.float32) for o in (True, False)])
    for dtype, overlap in cases:
        r = measure(dtype, overlap, args.steps, args.device_optimizer)
        rows.append(r)
        print(f"{r['dtype']:>9} overlap={str(overlap):5} params {r['params']:,}  host arena "
              f"{r['host_pinned_bytes'] / 2**20:8.1f} MiB  {r['host_bytes_per_param']:.2f} B/param", flush=True)
        if args.device_optimizer:
            per = ", ".join(f"{k} {v:.2f}" for k, v in r["host_bytes_per_param_by_placement"].items())
            print(f"          {r['device_homed_buckets']} of {r['buckets']} buckets device-homed; per placement "
                  f"(B/param, regions only): {per}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": "gpt2-124m (examples/gpt.py)", "cases": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
