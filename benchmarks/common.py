"""What every benchmark script shares: a description of the machine it ran on (load average included, taken
before and after), timing helpers, the rich table, the ``--json`` output, and a preset model traced on the
meta device (the simulated benchmarks)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import psutil
import torch
from rich.console import Console
from rich.table import Table

from offload.planning.buckets import Bucket, make_buckets
from offload.planning.hw import PRESETS
from offload.tools.metatrace import MetaTrace, trace_meta
from offload.tools.presets import MODELS, preset_inputs


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """The machine and its state now (load average: other processes share this machine)."""
    vm = psutil.virtual_memory()
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ram_bytes": vm.total,
        "ram_available_bytes": vm.available,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "load_average": list(os.getloadavg()),
    }


def brief_machine() -> dict:
    """The platform, versions, CPU count and 1-minute load: what the simulated benchmarks record (only their
    tracing and planning times depend on the machine)."""
    return {"platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
            "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}


def time_ms(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Wall times of ``repeats`` calls of ``fn`` in milliseconds, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def print_table(title: str, columns: list[str], rows: list[list[object]], console: Console | None = None) -> None:
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right" if c not in ("impl", "name", "kind", "note", "status") else "left")
    for r in rows:
        table.add_row(*("" if x is None else str(x) for x in r))
    (console or Console()).print(table)


def describe(console: Console, info: dict) -> None:
    console.print(f"[bold]machine[/bold]: {info['cpu']}, {info['logical_cpus']} logical CPUs, "
                  f"{info['ram_bytes'] / 2**30:.1f} GiB RAM ({info['ram_available_bytes'] / 2**30:.1f} available), "
                  f"kernel {info['kernel']}, torch {info['torch']} ({info['torch_threads']} threads), "
                  f"load average {' '.join(f'{x:.2f}' for x in info['load_average'])}")


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2) + "\n")


class TracedPreset(NamedTuple):
    """A preset model traced on the meta device and bucketed, for the simulated benchmarks."""

    meta: MetaTrace
    buckets: list[Bucket]
    param_bytes: int  # the buckets' bytes at the benchmark's itemsize
    extra_bytes: int  # the step's device bytes besides parameters: activations + largest grad + buffers
    seconds: float  # how long tracing took on this machine (measured)


def trace_preset(console: Console, name: str, batch: int, seq: int, bucket_bytes: int, itemsize: int) -> TracedPreset:
    """Trace preset ``name`` (offload/tools/presets.py, bf16) on the meta device on ``batch x seq`` inputs (no
    weights, no GPU; compute priced on the ``pcie4`` preset's roofline), and bucket it."""
    shape = MODELS[name]
    t0 = time.perf_counter()
    with console.status(f"tracing {name} on the meta device"):
        mt = trace_meta(shape.build(dtype=torch.bfloat16), preset_inputs(shape, batch, seq), PRESETS["pcie4"])
    seconds = time.perf_counter() - t0
    buckets = make_buckets(list(mt.specs), list(mt.order), bucket_bytes, itemsize)
    param_bytes = sum(b.nbytes(itemsize) for b in buckets)
    extra = mt.trace.activation_peak_bytes + mt.trace.max_grad_bytes + mt.buffer_bytes
    return TracedPreset(mt, buckets, param_bytes, extra, seconds)
