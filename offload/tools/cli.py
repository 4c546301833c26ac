"""The ``offload`` command line: ``offload report`` (will this model train on this GPU, how much host RAM,
how fast) and ``offload probe`` (measure this machine). The CLI only prints what the planners and probes
return (``offload/tools/report.py``, ``offload/tools/probe.py``).

Exit status: 0 when the answer is "fits" (report) or the probe ran; 1 when the model does not fit (the report
is still printed, and one line on stderr says why) or cannot be reported on; 2 for usage errors. Errors are
one line on stderr, never a traceback."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from rich.console import Console
from rich.table import Table

from ..config import GRAD_REDUCE, format_bytes
from .report import DTYPES

USAGE_ERROR = 2


def _probe(args, console: Console) -> int:
    from ..errors import DistributedError
    from .probe import probe

    try:
        group = _probe_group(args.timeout)
    except ValueError as e:
        print(f"offload probe: error: {e}", file=sys.stderr)
        return USAGE_ERROR
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        if rank != 0:  # [Note: probing the collectives]: every rank times them, rank 0 alone reports
            probe()
            return 0
        with console.status("probing") as status:
            result = probe(progress=lambda msg: status.update(f"measuring {msg}"))
    except DistributedError as e:  # every rank says why it stopped: rank 0 may be the one that died
        print(f"offload probe: error: {e}", file=sys.stderr)
        return 1
    finally:
        if group:
            dist.destroy_process_group()
    _render_probe(result, console)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        console.print(f"wrote {args.json}")
    return 0


def _probe_group(timeout_s: float) -> bool:
    """Under torchrun (``WORLD_SIZE`` above 1) with no group yet, join the default group (gloo on the host,
    NCCL beside it on CUDA when every local rank has a GPU of its own, as NCCL needs) with ``timeout_s``; True
    when this call made it."""
    import datetime

    import torch
    import torch.distributed as dist
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if not timeout_s > 0:
        raise ValueError(f"--timeout must be positive; got {timeout_s!r}")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local
    if cuda:  # pragma: no cover - needs CUDA
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return True


def _render_probe(result: dict, console: Console) -> None:
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
                  + ' (bucket_bytes="auto"; at most 1/8 of a model\'s weights)'
                  + ("" if pcie is not None else " (from the pcie4 preset, not measured)"))
    console.print(table)
    if pcie is None:
        console.print("[yellow]PCIe was not measured (no CUDA device); the hardware model uses the pcie4 preset "
                      "link.[/yellow]")
    if "collectives" not in result and os.environ.get("WORLD_SIZE") == "1":
        console.print("collectives: one rank (WORLD_SIZE=1), nothing to measure")
    if "collectives" in result:
        console.print(f"under torch.distributed: CPU AdamW and host bandwidth measured by rank 0 alone (the other "
                      f"ranks idle), with {result['cpu_adam_threads']} threads (torchrun sets OMP_NUM_THREADS=1 "
                      "unless it is set: a rank's engine gets the same)")
        _render_collectives(result["collectives"], console)


_KIND_NAMES = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "all_reduce": "all-reduce"}


def _render_collectives(coll: dict, console: Console) -> None:
    """The collectives timed over the group ([Note: probing the collectives]) and the ring fits."""
    nodes = coll["nodes"] if coll["nodes"] is not None else "unknown"
    if coll.get("note"):
        console.print(f"collectives: {coll['note']}")
    for backend, side in coll["backends"].items():
        t = Table(title=f"{backend} collectives over {coll['world_size']} ranks (nodes: {nodes}), {side['dtype']} "
                        f"on {side['device']}: the slowest rank's time, median of {side['repeat']}")
        t.add_column("buffer")
        for kind in _KIND_NAMES.values():
            t.add_column(kind, justify="right")
        for j, n in enumerate(side["sizes"]):
            t.add_row(format_bytes(n), *(f"{side['seconds'][k][j] * 1e3:.3f} ms" for k in _KIND_NAMES))
        for key in (*_KIND_NAMES, "link"):
            fit = side["fits"][key]
            label = "ring fit, all three (the link)" if key == "link" else f"ring fit, {_KIND_NAMES[key]} only"
            t.add_row(label, *(["not fitted: " + side["fit_errors"][key], "", ""] if fit is None else [
                f"a = {fit['latency_s'] * 1e6:.1f} us", f"B = {fit['bytes_per_s'] / 1e9:.3g} GB/s",
                f"max error {fit['max_rel_error']:.0%}"]))
        console.print(t)
        if side["dropped_sizes"]:
            console.print(f"  {backend}: not timed for lack of memory: "
                          + ", ".join(format_bytes(n) for n in side["dropped_sizes"]))
    for backend, why in coll["not_measured"].items():
        console.print(f"[yellow]{backend} collectives not measured: {why}[/yellow]")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit status 2)."""

    def error(self, message: str):
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="offload", description="offload: plan and measure offloaded training")
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("report", help="will this model train on this GPU under this budget, and how fast",
                       description="Trace the model on the meta device (no GPU, no weights), plan it as the "
                       "engine would, and print memory, plan, predicted step time and a verdict.")
    r.add_argument("--model", required=True,
                   help="a preset (gpt2, gpt2-xl, bert-large, llama-7b, llama-70b, ...: a wrong name lists them "
                   "all), module:factory (factory(batch=, seq=) or factory() "
                   "returning a module or (module, inputs)), or a transformers config class such as "
                   "transformers.GPT2Config together with --config FILE")
    r.add_argument("--config", metavar="FILE", help="JSON config file for a transformers config class")
    r.add_argument("--budget", required=True, help='device memory budget, e.g. "24GiB" or a byte count')
    r.add_argument("--batch", type=int, default=1, help="micro-batch size (default 1)")
    r.add_argument("--seq", type=int, default=1024, help="sequence length in tokens (default 1024)")
    r.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="device compute dtype (default bf16)")
    r.add_argument("--hw", default="pcie4", help="pcie3, pcie4, pcie5 (nominal presets) or a JSON file written "
                   "by `offload probe --json` (default pcie4)")
    r.add_argument("--host-ram", help="host RAM to plan for, e.g. 256GiB (default: available on this machine)")
    r.add_argument("--bucket-bytes", default=None, help='bucket size, or "auto" (default: the engine\'s, "auto")')
    r.add_argument("--json", action="store_true", help="print JSON (keys documented in the README) instead")
    r.add_argument("--timeline", metavar="PATH", help="write the simulated step as Chrome-trace JSON (open it in "
                   "https://ui.perfetto.dev or chrome://tracing): a track per lane, a slice per copy/update/call")
    r.add_argument("--plot", metavar="PNG", help="draw the simulated step's device memory against the budget "
                   "(needs matplotlib)")
    r.add_argument("--gpus", type=int, default=1, help="data parallel: GPUs in all, the budget per GPU (default 1)")
    r.add_argument("--nodes", type=int, default=1, help="data parallel: nodes the GPUs are spread over (default 1)")
    r.add_argument("--intra", default=None, help="link inside a node for --gpus: nvlink3, nvlink4, pcie4-p2p, "
                   "pcie5-p2p (nominal presets, offload/planning/collectives.py; default: the NCCL link measured by "
                   "offload probe when --hw is its JSON with one, else nvlink3). Given, it wins over the measured link")
    r.add_argument("--inter", default="ib200", help="network between nodes for --nodes: eth100, ib200, ib400, ib8x400")
    r.add_argument("--micro-batches", type=int, default=1, help="data parallel: forward and backward passes per step "
                   "(gradient accumulation: the engine then runs overlap_optimizer=False; default 1)")
    r.add_argument("--no-sync", action="store_true", help="data parallel, with --micro-batches: all backward passes "
                   "but the last inside engine.no_sync() (no all-reduce)")
    r.add_argument("--share-host-copy", choices=("auto", "yes", "no"), default="auto", help="data parallel: "
                   "whether the node's ranks share one host copy of the weights, as OffloadConfig.share_host_copy "
                   "(default auto: where every rank runs on one node)")
    r.add_argument("--grad-reduce", choices=GRAD_REDUCE, default="auto", help="data parallel: where "
                   "grads are reduce-scattered, as OffloadConfig.grad_reduce (default auto: on the device with "
                   "overlapped updates, as the engine does on CUDA)")
    r.set_defaults(run=_report)
    p = sub.add_parser("probe", help="measure this machine: PCIe curve (CUDA), CPU AdamW, host bandwidth; under "
                       "torchrun the collectives over the ranks too",
                       description="Measure this machine for the cost model. Under torchrun (torchrun "
                       "--nproc-per-node N -m offload probe) every rank times all-gather, reduce-scatter and "
                       "all-reduce over the group first (NCCL on CUDA, gloo on the host); rank 0 alone then "
                       "measures the rest, prints and writes.")
    p.add_argument("--json", metavar="PATH", help="write the measurements (and a hardware model) as JSON")
    p.add_argument("--timeout", type=float, default=300.0, help="under torchrun: seconds a collective waits for "
                   "the other ranks before it fails (the group's timeout; default 300)")
    p.set_defaults(run=_probe)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)  # usage errors: one line and exit status 2
    console = Console(width=None if sys.stdout.isatty() else 140)
    return args.run(args, console)


# ---------------------------------------------------------------------------------------------------------
# offload report


def _fail(message: str, status: int) -> int:
    print(f"offload report: error: {message}", file=sys.stderr)
    return status


def _request(args):
    import psutil

    from ..config import OffloadConfig, parse_bytes
    from ..planning.hw import load_hw
    from .report import ReportError, Request

    def size(value, what):
        try:
            return parse_bytes(value, what)
        except (TypeError, ValueError) as e:
            raise ReportError(str(e), usage=True) from None

    try:
        hw = load_hw(args.hw)
    except ValueError as e:
        raise ReportError(str(e), usage=True) from None
    if args.host_ram is None:
        host_ram, source = psutil.virtual_memory().available, "available on this machine"
    else:
        host_ram, source = size(args.host_ram, "--host-ram"), "given"
    bucket = args.bucket_bytes or OffloadConfig.__dataclass_fields__["bucket_bytes"].default
    return Request(model=args.model, budget_bytes=size(args.budget, "--budget"), batch=args.batch, seq=args.seq,
                   dtype=DTYPES[args.dtype], hw=hw, host_ram_bytes=host_ram, host_ram_source=source,
                   bucket_bytes="auto" if bucket == "auto" else size(bucket, "--bucket-bytes"), config=args.config)


def _report(args, console: Console) -> int:
    from .report import ReportError, make_report

    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `--model mymodels:build` finds ./mymodels.py, as `python -m` would
    err = Console(stderr=True)
    show = not args.json and err.is_terminal
    try:
        if (args.micro_batches != 1 or args.no_sync or args.grad_reduce != "auto" or args.share_host_copy != "auto") \
                and args.gpus == 1 and args.nodes == 1:
            raise ReportError("--micro-batches, --no-sync, --grad-reduce and --share-host-copy apply to the "
                              "data-parallel figures "
                              "(--gpus 2 or more): the single-GPU report models one backward per step and no "
                              "collective", usage=True)
        from .report_dp import check_accumulation
        check_accumulation(args.micro_batches, args.no_sync)  # before the report is built: fails fast
        request = _request(args)
        with err.status("offload report") if show else contextlib.nullcontext() as status:
            report = make_report(request, progress=status.update if status is not None else lambda msg: None)
        dp = None
        if args.gpus > 1 or args.nodes > 1:  # issue 20: per-rank and per-node figures with the collectives
            dp = _data_parallel(args, report)
    except ReportError as e:
        return _fail(str(e), USAGE_ERROR if e.usage else 1)
    if args.json:
        print(json.dumps(report.to_json() | ({"data_parallel": dp} if dp else {}), indent=1))
    else:
        _render(report, console)
        if dp:
            from .report_dp import render_data_parallel
            render_data_parallel(dp, console)
            _render_link_origins(dp, console)
    if args.timeline or args.plot:
        status = _timeline(args, report)
        if status:
            return status
    if not report.fits or not report.host_fits:
        return _fail(_verdict(report), 1)
    return 0


def _data_parallel(args, report) -> dict:
    """``--gpus``: the data-parallel figures, on the links ``offload probe`` measured where ``--hw`` is its JSON
    with a ``collectives`` entry (the NCCL fit as ``--intra`` unless ``--intra`` is given, the gloo fit as
    gloo's intra-node link), else on the nominal presets."""
    from .probe_collectives import link_origins, links_of_hw
    from .report import ReportError
    from .report_dp import data_parallel
    try:
        measured = links_of_hw(args.hw)
    except ValueError as e:
        raise ReportError(f"--hw: {e}", usage=True) from None
    nccl = measured.nccl if measured is not None else None
    gloo = measured.gloo if measured is not None else None
    dp = data_parallel(report, args.gpus, args.nodes, args.intra or nccl or "nvlink3", args.inter,
                       args.micro_batches, args.no_sync, args.grad_reduce, gloo_intra=gloo or "loopback",
                       share_host_copy=args.share_host_copy)
    if measured is not None:  # a JSON without collectives: the report as it was
        dp.update(link_origins(dp["links"], measured, dp["gpus_per_node"], args.intra is not None))
        if "measured by offload probe" in dp["link_origin"].values():
            dp["simulated"] = ("cost model on the links of link_origin: fitted to offload probe's measurements "
                               "where it says so, nominal presets otherwise")
    return dp


def _render_link_origins(dp: dict, console: Console) -> None:
    if "link_origin" not in dp:
        return
    measured = [k for k, v in dp["link_origin"].items() if v != "nominal preset"]
    nominal = [k for k, v in dp["link_origin"].items() if v == "nominal preset"]
    console.print(f"  links measured by offload probe: {', '.join(measured) or 'none'}; nominal presets: "
                  f"{', '.join(nominal) or 'none'}")
    for note in dp["link_notes"]:
        console.print(f"  [yellow]{note}[/yellow]")


_ROWS = {"params": "params", "grads": "grads", "master_weights": "master weights (fp32)", "adam_m": "Adam m",
         "adam_v": "Adam v", "lowp_staging": "low-precision staging", "activations": "activations",
         "workspace": "workspace"}
_FIX = {"activation_checkpointing": 'activation_checkpointing="auto" ({} blocks)', "batch": "--batch {}",
        "seq": "--seq {}", "budget": "--budget {}"}
_SYSTEMS = {"zero-offload": "DeepSpeed ZeRO-Offload", "zero3-offload": "DeepSpeed ZeRO-3 offload",
            "gemini-cpu": "ColossalAI Gemini (CPU placement)"}


def _timeline(args, report) -> int:
    """--timeline / --plot: the simulated step of the report's plan (messages on stderr: stdout may be JSON)."""
    from ..errors import OffloadError
    from .timeline import simulated

    tl = simulated(report.plan, report.request.hw, report.module_names, report.compute_s)
    if not report.fits:  # the plan at the minimum budget, as the tables show
        tl.other["note"] = "the budget does not fit this model: this is the plan at the minimum budget"
    if args.timeline:
        tl.save(args.timeline)
        print(f"wrote {args.timeline} (Chrome trace: open in https://ui.perfetto.dev)", file=sys.stderr)
    if args.plot:
        try:
            tl.plot_memory(args.plot)
        except OffloadError as e:
            return _fail(str(e), 1)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _fix_text(fix) -> str:
    value = format_bytes(fix.value).replace(" ", "") if fix.change == "budget" else fix.value
    if fix.change == "activation_checkpointing":
        value = f"{fix.value} of {fix.of}"
        if fix.fewest is not None and fix.fewest != fix.value:  # "auto" plans more than the fewest: faster
            value += f"; {fix.fewest} fit, more plan a faster step"
    text = _FIX[fix.change].format(value)
    note = "; estimated" if fix.estimated else ""
    return f"{text} (needs {format_bytes(fix.min_budget_bytes)}{note})"


def _verdict(report) -> str:
    """The verdict in one line: fits, or what overflows and the smallest change that fits."""
    r = report.request
    if report.fits:
        line = (f"fits: {r.model} trains with batch {r.batch} x seq {r.seq} in {format_bytes(r.budget_bytes)} "
                f"(needs at least {format_bytes(report.min_budget_bytes)})")
    else:
        gpu = report.gpu_bytes
        if report.overflow == "activations":
            what = (f"the activations ({format_bytes(gpu['activations'])}) overflow the "
                    f"{format_bytes(r.budget_bytes)} budget; the weights stream and need only "
                    f"{format_bytes(report.min_budget_bytes - gpu['activations'])}")
        else:
            what = (f"the streamed weights, grads and buffers alone need "
                    f"{format_bytes(report.min_budget_bytes - gpu['activations'])} of the "
                    f"{format_bytes(r.budget_bytes)} budget")
        fixes = [_fix_text(f) for f in report.fixes]
        line = f"does not fit: {what}. Smallest change: {fixes[0]}"
        if len(fixes) > 1:
            line += "; or " + "; or ".join(fixes[1:])
    if not report.host_fits:
        line += (f". Host RAM: needs {format_bytes(report.host_needed_bytes)} but "
                 f"{format_bytes(r.host_ram_bytes)} is {r.host_ram_source}: use a machine with more RAM, "
                 "freeze parameters, or pass --host-ram for the target machine")
    return line


def _render(report, console: Console) -> None:
    r = report.request
    hw = f"{r.hw.name} ({'measured by offload probe' if r.hw.measured else 'nominal preset, not measured'})"
    console.print(f"[bold]offload report[/bold]: {r.model} ({report.source}), batch {r.batch} x seq {r.seq}, "
                  f"{next(k for k, v in DTYPES.items() if v == r.dtype)}, budget {format_bytes(r.budget_bytes)}, "
                  f"hardware {hw}")
    console.print(f"parameters: {report.params:,} ({report.trainable_params:,} trainable)")

    title = "memory (planned device peak)" if report.fits else "memory at the minimum budget (plan does not fit)"
    t = Table(title=title)
    for col, just in (("part", "left"), ("GPU", "right"), ("pinned host", "right")):
        t.add_column(col, justify=just)
    for key, label in _ROWS.items():
        t.add_row(label, format_bytes(report.gpu_bytes[key]), format_bytes(report.host_bytes[key]))
    t.add_row("[bold]total[/bold]", format_bytes(report.gpu_bytes["total"]), format_bytes(report.host_bytes["total"]))
    console.print(t)
    console.print("GPU workspace = module buffers + arena fragmentation (allocator temporaries and the CUDA "
                  f"context are not modelled); activations: {report.activations_source}")

    s = report.plan.summary()
    console.print(f"[bold]plan[/bold] ({s['strategy']}): {s['num_buckets']} buckets of up to "
                  f"{format_bytes(report.bucket_bytes)}, {s['resident_buckets']} resident, {s['streamed_buckets']} "
                  f"streamed ({s['fetches_per_step']} fetches per step); arena {format_bytes(s['arena_bytes'])} "
                  f"vs lower bound {format_bytes(s['arena_lower_bound_bytes'])}")
    if report.fits:
        lanes = report.lanes_s
        console.print(
            f"[bold]step[/bold] (estimated; compute from a roofline on {r.hw.name}'s assumed device): "
            f"{report.predicted_step_s:.3f} s, {report.tokens_per_s:,.0f} tokens/s, bound: {report.bound} "
            f"(compute {lanes['compute']:.3f} s, H2D {lanes['h2d']:.3f} s, D2H {lanes['d2h']:.3f} s, "
            f"CPU AdamW {lanes['cpu_adam']:.3f} s, stall {lanes['stall']:.3f} s; physical lower bound "
            f"{report.bound_s:.3f} s with every update on the CPU, {report.bound_placement_s:.3f} s over every "
            "placement that fits, optimizer state on the device included)")
        dev = report.device_optimizer_plan
        if dev is not None:
            tiers = dev["placement_bytes"]
            console.print(
                f"[bold]with optimizer state on the device[/bold] (what OffloadConfig(device_optimizer=True) runs): "
                f"{dev['predicted_step_s']:.3f} s; weights streamed {format_bytes(tiers['streamed'])}, resident "
                f"{format_bytes(tiers['resident'])}, with device optimizer {format_bytes(tiers['device-optimizer'])} "
                f"(+ {format_bytes(tiers['device_optimizer_state'])} of fp32 master, m, v); host arena "
                f"{format_bytes(dev['host_bytes'])}, {dev['host_bytes'] / report.params:.2f} bytes per parameter "
                "(no host state for device-optimizer buckets)")
    ckpt = report.checkpointed_activation_bytes
    if ckpt is not None:
        console.print(f'activations with every block checkpointed (estimate, the engine\'s rule for '
                      f'activation_checkpointing="auto"): {format_bytes(ckpt)}')
    host_ok = "[green]fits[/green]" if report.host_fits else "[red]does not fit[/red]"
    console.print(f"[bold]host RAM[/bold]: needs {format_bytes(report.host_needed_bytes)} (host arena + 5 % "
                  f"headroom), {format_bytes(r.host_ram_bytes)} {r.host_ram_source}: {host_ok}; host arena "
                  f"{report.host_bytes['total'] / report.params:.2f} bytes per parameter")

    b = Table(title=f"the same model under other systems' memory rules (budget {format_bytes(r.budget_bytes)})")
    for col in ("system", "GPU peak", "fits", "step (s)", "host bytes (rule)"):
        b.add_column(col, justify="left" if col == "system" else "right")
    b.add_row("offload (this plan)" if report.fits else "offload (plan at the minimum budget)",
              format_bytes(report.gpu_bytes["total"]), "yes" if report.fits else "no", f"{report.predicted_step_s:.3f}" if report.fits else "-",
              format_bytes(report.host_bytes["total"]))
    for name, x in report.baselines.items():
        b.add_row(_SYSTEMS[name], format_bytes(x["gpu_peak_bytes"]), "yes" if x["fits"] else "no",
                  f"{x['predicted_step_s']:.3f}" if x["predicted_step_s"] is not None else "-",
                  format_bytes(x["host_bytes"]))
    console.print(b)
    colour = "green" if report.fits and report.host_fits else "red"
    console.print(f"[bold {colour}]verdict[/bold {colour}]: {_verdict(report)}")
