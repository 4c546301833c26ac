"""The ``offload`` command line: ``offload probe`` (measure this machine). ``offload report`` (will this model
train on this GPU, and how fast) is to come (issue 5). The CLI only prints what the planners and probes
return."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from .config import format_bytes

USAGE_ERROR = 2


def _probe(args, console: Console) -> int:
    from .probe import probe

    with console.status("probing") as status:
        result = probe(progress=lambda msg: status.update(f"measuring {msg}"))
    table = Table(title="offload probe")
    table.add_column("what")
    table.add_column("measured", justify="right")
    table.add_row(f"CPU AdamW, {result['cpu_adam_impl']}, {result['cpu_adam_threads']} threads",
                  f"{result['cpu_adam_params_per_s'] / 1e9:.2f} G params/s")
    table.add_row("host memory bandwidth", f"{result['host_bytes_per_s'] / 1e9:.1f} GB/s")
    pcie = result["pcie"]
    if pcie is None:
        table.add_row("PCIe", "not measured: no CUDA device")
    else:  # pragma: no cover - needs CUDA
        for n, up, down, upd, downd in zip(pcie["sizes"], pcie["h2d"], pcie["d2h"], pcie["h2d_duplex"],
                                           pcie["d2h_duplex"]):
            table.add_row(f"PCIe {format_bytes(n)}",
                          f"H2D {up / 1e9:.1f} / D2H {down / 1e9:.1f} GB/s (both at once: {upd / 1e9:.1f} / "
                          f"{downd / 1e9:.1f})")
    table.add_row("default bucket size", format_bytes(result["bucket_bytes_hint"])
                  + ("" if pcie is not None else " (from the pcie4 preset, not measured)"))
    console.print(table)
    if pcie is None:
        console.print("[yellow]PCIe was not measured (no CUDA device); the hardware model uses the pcie4 preset "
                      "link.[/yellow]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        console.print(f"wrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="offload", description="offload: plan and measure offloaded training")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("probe", help="measure this machine: PCIe curve (CUDA), CPU AdamW, host bandwidth")
    p.add_argument("--json", metavar="PATH", help="write the measurements (and a hardware model) as JSON")
    p.set_defaults(run=_probe)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)  # usage errors: argparse prints one line and exits with 2
    console = Console(width=None if sys.stdout.isatty() else 140)
    return args.run(args, console)
