"""Peak host memory over a run's first steps, phase by phase (issue 18, "the first step's peak host RAM").

A GPT-2 124M-shaped model (examples/gpt.py, as ``benchmarks/host_bytes.py``) wrapped with
``OffloadConfig(device_optimizer=True)`` on the CPU backend (bf16, 4 GiB budget, planned for a hardware model
whose CPU AdamW is slow, so that the planner puts the optimizer of most buckets on the device), trained for
``--steps`` steps on random tokens (batch 1, 32 tokens). After each phase (wrap, forward, backward, step) it
prints, measured in the run:

* ``arena``: the pinned host arena's bytes (``memory_stats()["host_pinned_bytes"]``) at the end of the phase;
* ``host peak``: the engine's own count of its host bytes at their highest so far
  (``memory_stats()["host_peak_bytes"]``: the host arenas, the parked copies of device-homed state, the first
  step's held grads), where the engine has it;
* ``rss`` and ``peak rss``: the process's resident memory at the end of the phase and its highest during the
  phase (``VmHWM`` of ``/proc/self/status``, reset before each phase by writing 5 to ``/proc/self/clear_refs``).
  On the CPU backend the "device" is host memory too, so RSS includes the device arena and activations
  (``device``: the engine's accounted device bytes at the end of the phase) and the user's own model tensors
  (``model``: the fp32 parameters as built, 4 bytes each, given back to the allocator once wrapped and traced).

Each setting runs in a process of its own (``--overlap both``, the default, starts two).

    python benchmarks/host_peak.py [--steps 3] [--overlap both|on|off] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import offload  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from offload.planning.hw import PRESETS  # noqa: E402

GPT2_124M = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
SLOW_CPU_ADAM = dataclasses.replace(PRESETS["pcie4"], name="pcie4-slow-cpu-adam", adam_params_per_s=1e6)


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")


def measure(overlap: bool, steps: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    torch.manual_seed(0)
    _reset_peak()
    base = _status("VmRSS")
    model = GPT(GPT2_124M)
    params = sum(p.numel() for p in model.parameters())
    opt = offload.AdamW(model.parameters(), lr=1e-4)
    rows: list[dict] = []
    engine = None

    def phase(name: str) -> None:
        gc.collect()
        stats = engine.memory_stats() if engine is not None else {}
        rows.append({"phase": name, "rss": _status("VmRSS") - base, "peak_rss": _status("VmHWM") - base,
                     "arena": stats.get("host_pinned_bytes", 0), "host_peak": stats.get("host_peak_bytes"),
                     "device": stats.get("device_current_bytes", 0)})
        _reset_peak()

    phase("model built")
    engine = offload.wrap(model, opt, budget="4GiB", dtype=dtype, device="cpu", overlap_optimizer=overlap,
                          device_optimizer=True, hw=SLOW_CPU_ADAM)
    phase("wrap")
    g = torch.Generator().manual_seed(0)
    try:
        for s in range(steps):
            for _ in range(1 if overlap else 2):
                idx = torch.randint(0, GPT2_124M.vocab_size, (1, 32), generator=g)
                _, loss = engine(idx, idx)
                phase(f"step {s + 1} forward")
                engine.backward(loss)
                del loss
                phase(f"step {s + 1} backward")
            opt.step()
            opt.zero_grad()
            phase(f"step {s + 1} step()")
        stats = engine.memory_stats()
        dev = stats["device_optimizer"]
        summary = {"homed_buckets": dev["device_homed_buckets"], "buckets": stats["plan"]["num_buckets"],
                   "final_arena": stats["host_pinned_bytes"], "host_peak": stats.get("host_peak_bytes")}
    finally:
        engine.close()
    return {"dtype": str(dtype).removeprefix("torch."), "overlap_optimizer": overlap, "params": params,
            "model_bytes": params * 4, "phases": rows, **summary}


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:9.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--overlap", choices=["both", "on", "off"], default="both")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.overlap == "both":  # each case in a process of its own: RSS starts from the same point
        out = []
        for which in ("on", "off"):
            with tempfile.TemporaryDirectory() as tmp:
                subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--overlap", which,
                                "--json", f"{tmp}/case.json"], check=True)
                out += json.loads(Path(f"{tmp}/case.json").read_text())["cases"]
        if args.json:
            args.json.write_text(json.dumps({"model": "gpt2-124m (examples/gpt.py)", "device": "cpu backend",
                                             "cases": out}, indent=1) + "\n")
        return
    out = []
    for overlap in {"on": [True], "off": [False]}[args.overlap]:
        r = measure(overlap, args.steps)
        out.append(r)
        n = r["params"]
        print(f"\nbf16, overlap_optimizer={overlap}: {n:,} params (model fp32 {_mib(r['model_bytes'])} MiB), "
              f"{r['homed_buckets']} of {r['buckets']} buckets device-homed")
        print(f"{'phase':>18} {'arena MiB':>10} {'host peak':>10} {'rss MiB':>10} {'peak rss':>10} {'device':>10}"
              f" {'peak rss B/param':>17}")
        for row in r["phases"]:
            print(f"{row['phase']:>18} {_mib(row['arena']):>10} {_mib(row['host_peak']):>10} {_mib(row['rss']):>10} "
                  f"{_mib(row['peak_rss']):>10} {_mib(row['device']):>10} {row['peak_rss'] / n:17.2f}")
        hp = r["host_peak"]
        print(f"engine host peak: {'-' if hp is None else f'{hp / n:.2f} B/param'}; final arena "
              f"{r['final_arena'] / n:.2f} B/param")
    if args.json:
        args.json.write_text(json.dumps({"model": "gpt2-124m (examples/gpt.py)", "device": "cpu backend",
                                         "cases": out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
