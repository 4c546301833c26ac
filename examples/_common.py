"""What the examples share: their common command-line flags, the device they run on, the offline text they
train on (this Python's standard library source, as bytes), the progress bar and the loss verdict. (The
memory summary they end with is the library's: ``offload.memory_table``.)

Not an example itself: train_gpt.py, finetune_frozen.py and bert_mlm.py import it from their own folder, so
each still runs as ``python examples/X.py`` from the repository root or from examples/.
"""

import argparse
import os
import sys
import sysconfig
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

DATA_BYTES = 4 * 2**20  # how much standard-library source to read
VAL_FRACTION = 0.05  # held out for validation: the last 5 % of the bytes

# flag -> (type, help); add_run_args gives each example's defaults, and its own help where it means more
_RUN_ARGS = {
    "steps": (int, "training steps"),
    "budget": (str, "device memory budget (default: 3/4 of the fp32 weights, plus the runtime headroom on CUDA)"),
    "batch": (int, "sequences per step"),
    "seq": (int, "tokens (bytes) per sequence"),
    "lr": (float, "learning rate"),
    "dtype": (str, "compute dtype"),
    "device": (str, "cuda or cpu (default: cuda if available, else cpu)"),
    "seed": (int, "seed of the init and the batches"),
    "checkpointing": (str, 'activation checkpointing: "auto" recomputes the fewest blocks that make the activations '
                           'fit the budget, "none" never recomputes'),
}
_CHOICES = {"dtype": ["float32", "bfloat16", "float16"], "checkpointing": ["auto", "none"]}


def add_run_args(p: argparse.ArgumentParser, *, steps: int, batch: int, seq: int, lr: float,
                 checkpointing: str | None = "none", helps: dict[str, str] | None = None) -> None:
    """Add --steps --budget --batch --seq --lr --dtype --device --seed --checkpointing with this example's defaults;
    ``helps`` (flag name without dashes -> text) replaces a generic help text."""
    defaults = {"steps": steps, "budget": None, "batch": batch, "seq": seq, "lr": lr, "dtype": "float32",
                "device": None, "seed": 0,
                "checkpointing": checkpointing}
    helps = helps or {}
    for name, (kind, text) in _RUN_ARGS.items():
        extra = {"choices": _CHOICES[name]} if name in _CHOICES else {}
        p.add_argument(f"--{name}", type=kind, default=defaults[name], help=helps.get(name, text), **extra)


def checkpointing(args: argparse.Namespace):
    """The wrap() value of --checkpointing: "auto" or None."""
    return None if args.checkpointing == "none" else args.checkpointing


def setup(args: argparse.Namespace) -> str:
    """Seed torch's global RNG with --seed; the device to run on (--device, else cuda if available)."""
    torch.manual_seed(args.seed)
    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def default_budget(plan_bytes: int, device: str) -> int:
    """A default --budget: ``plan_bytes`` for what the engine lays out (weights, activations, grads), plus the
    headroom it keeps beside its plan on ``device`` (on CUDA the cuBLAS workspaces and allocator rounding it
    measures, 0 on the CPU), so that a default budget streams the same share of the weights on any device."""
    from offload.backend import headroom_bytes
    return plan_bytes + headroom_bytes(device)


def plan_budget(stats: dict) -> int:
    """The part of the budget the plan may fill: the budget less the engine's measured headroom."""
    return stats["budget_bytes"] - stats["device_parts"]["headroom"]


def import_transformers(who: str):
    """transformers, set to never reach for the network (models are built from configs); exits with the
    install command if it is missing."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # built from a config: never reach for the network
    try:
        import transformers
    except ImportError:
        sys.exit(f'{who} needs transformers: pip install -e ".[hf]"')
    return transformers


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def load_stdlib_source(limit: int = DATA_BYTES) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The first `limit` bytes of the standard library's .py files, walked in sorted order (the same bytes
    on every run with this Python). Returns (train bytes, validation bytes, number of files read)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total, files = [], 0, 0
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(n for n in names if n.endswith(".py")):
            chunks.append(Path(root, name).read_bytes())
            total, files = total + len(chunks[-1]), files + 1
            if total >= limit:
                break
        if total >= limit:
            break
    if total < 100_000:
        sys.exit(f"found only {total} bytes of .py source under {stdlib}; this example needs the stdlib sources")
    data = torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8)
    n_val = int(len(data) * VAL_FRACTION)
    return data[:-n_val], data[-n_val:], files


def get_batch(data: torch.Tensor, batch: int, seq: int, g: torch.Generator):
    """`batch` random windows of `seq` bytes; the targets are the same windows shifted by one byte."""
    ix = torch.randint(len(data) - seq - 1, (batch,), generator=g).tolist()
    x = torch.stack([data[i : i + seq] for i in ix]).long()
    y = torch.stack([data[i + 1 : i + 1 + seq] for i in ix]).long()
    return x, y


def progress_columns(label: str, *fields: TextColumn) -> tuple:
    """Columns of a training progress bar: ``label``, steps done, the bar, the loss, ``fields``, time."""
    return (TextColumn(f"[bold]{label}"), MofNCompleteColumn(), BarColumn(),
            TextColumn("loss {task.fields[loss]:.3f}"), *fields, TimeElapsedColumn())


def loss_trend(losses: list[float]) -> tuple[int, float, float]:
    """(k, mean of the first k losses, mean of the last k), k up to 5: did the loss go down?"""
    k = max(1, min(5, len(losses) // 2))
    return k, sum(losses[:k]) / k, sum(losses[-k:]) / k
