"""What every benchmark script shares: a description of the machine it ran on (load average included, taken
before and after), timing helpers, the rich table, and the ``--json`` output."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import psutil
import torch
from rich.console import Console
from rich.table import Table


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
