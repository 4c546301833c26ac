"""``engine.memory_stats()`` for people: a rich table, a one-line summary, and a print helper for your own loop.

    for step, batch in enumerate(loader):
        ...
        if step % 100 == 0:
            print(offload.memory_line(engine))    # device peak 5.91 GiB of 8.00 GiB budget (74 %), ...
    offload.print_memory(engine)                  # the table the examples end with
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from .config import format_bytes


def _stats(engine_or_stats: Any) -> dict:
    return engine_or_stats if isinstance(engine_or_stats, dict) else engine_or_stats.memory_stats()


def memory_table(engine_or_stats: Any, title: str = "device memory (engine.memory_stats())") -> Table:
    """The memory summary of an engine (or of a ``memory_stats()`` dict) as a ``rich.table.Table``: budget,
    device peak, arena against its lower bound, pinned host bytes, activations, buckets resident and
    streamed, re-plans, checkpointed blocks."""
    stats = _stats(engine_or_stats)
    table = Table(title=title)
    table.add_column("")
    table.add_column("bytes", justify="right")
    table.add_column("what it is")
    table.add_row("budget", format_bytes(stats["budget_bytes"]), "device memory the engine may use")
    table.add_row("device peak", format_bytes(stats["device_peak_bytes"]), "most device memory in use at once")
    headroom = stats["device_parts"].get("headroom", 0)
    if headroom:
        table.add_row("runtime headroom", format_bytes(headroom),
                      "cuBLAS workspaces, allocator rounding: measured, kept out of the plan")
    plan = stats["plan"]
    lower = f"; lower bound {format_bytes(plan['arena_lower_bound_bytes'])} (most bytes live at once)" if plan else ""
    table.add_row("arena", format_bytes(stats["arena_bytes"]), "the one device buffer the plan lays out" + lower)
    table.add_row("pinned host", format_bytes(stats["host_pinned_bytes"]),
                  "host arena: fp32 weights, AdamW m/v, grads (pinned on CUDA)")
    if "host_peak_bytes" in stats:  # a stats dict saved before issue 18's count may lack it
        table.add_row("host peak", format_bytes(stats["host_peak_bytes"]),
                      "most host memory the engine held at once (arenas, parked copies, held grads)")
    if plan:
        table.add_row("activations", format_bytes(plan["activation_bytes"]), "saved for backward, as traced")
        buckets = f"{plan['num_buckets']} x ~{format_bytes(plan['bucket_bytes'])}"
        table.add_row("buckets", buckets, f"{plan['resident_buckets']} resident, {plan['streamed_buckets']} streamed")
        table.add_row("re-plans", str(plan["replans"]), "plans rebuilt because execution left the traced order")
    ckpt = stats.get("activation_checkpointing") or {}
    if ckpt.get("mode"):
        table.add_row("checkpointed", f"{len(ckpt['checkpointed'])} of {ckpt['blocks']} blocks",
                      f'activation_checkpointing="{ckpt["mode"]}": recomputed in backward instead of saved')
    return table


def memory_line(engine_or_stats: Any) -> str:
    """One line for a progress log: device peak against the budget, pinned host bytes, buckets streamed."""
    stats = _stats(engine_or_stats)
    peak, budget = stats["device_peak_bytes"], stats["budget_bytes"]
    line = (f"device peak {format_bytes(peak)} of {format_bytes(budget)} budget ({100 * peak / budget:.0f} %), "
            f"pinned host {format_bytes(stats['host_pinned_bytes'])}")
    plan = stats["plan"]
    if plan:
        line += f", {plan['streamed_buckets']} of {plan['num_buckets']} buckets streamed"
    return line


def print_memory(engine_or_stats: Any, console: Console | None = None) -> None:
    """Print :func:`memory_table` (to ``console``, else a new rich console on stdout)."""
    (console or Console()).print(memory_table(engine_or_stats))
