"""The largest GPT each system trains (one warm-up step and one more step) under a GPU budget: layers at a
fixed width, found by doubling then bisection, every probe in its own child process (``bench_systems.py``).
Plus this engine's host-RAM bound: host RAM / the host bytes per parameter its arena took in this run.

A probe that runs out of GPU or host memory (``oom``, ``budget_too_small``, ``host_oom``, ``crashed``, or
``skipped`` because the system's resident params alone exceed the budget) means "too big". Any other failure
(``error``, ``timeout``, ``not_installed``, ...) stops that search: the entry keeps the largest size that
worked, ``incomplete: true`` and the error. Every probe is listed in the entry. This engine's search stops
at its host-RAM bound (``capped: true`` when the bound itself trained), as does any search at
``--max-layers``.

    python benchmarks/max_model.py --json max_model.json                    # on a GPU
    python benchmarks/max_model.py --systems offload,zero_offload --budgets 24GiB --hw probe.json --json m.json
    python benchmarks/max_model.py --smoke --json /tmp/max_smoke.json       # tiny widths on the CPU
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from bench_runner import gib, machine, not_startable, run_child, size_label, write_json  # noqa: E402
from bench_systems import SYSTEMS  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from offload.config import parse_bytes  # noqa: E402
from offload.tools.presets import Shape  # noqa: E402

TOO_BIG = {"oom", "budget_too_small", "host_oom", "crashed", "skipped"}
WIDTH = dict(kind="gpt3", vocab=50257, n_ctx=2048, d=2560, n_head=32, ffn=4 * 2560)  # GPT-3 2.7B's width
SMOKE_WIDTH = dict(kind="gpt2", vocab=512, n_ctx=64, d=64, n_head=4, ffn=256)
BUDGETS = ("8GiB", "16GiB", "24GiB")
DEFAULT_SYSTEMS = ("offload", "zero_offload", "zero3_offload", "torchao", "torch")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny width on the CPU, at most --max-layers 4")
    ap.add_argument("--systems", default=None, help=f"comma-separated (default: {','.join(DEFAULT_SYSTEMS)}; "
                                                    "offload,torch with --smoke)")
    ap.add_argument("--budgets", help=f"comma-separated GPU budgets (default {','.join(BUDGETS)}; 768KiB with --smoke)")
    ap.add_argument("--d", type=int, help="model width (default 2560, GPT-3 2.7B's; heads = d / 80)")
    ap.add_argument("--batch", type=int, help="default 1 (2 with --smoke)")
    ap.add_argument("--seq", type=int, help="default 1024 (32 with --smoke)")
    ap.add_argument("--max-layers", type=int, help="never probe deeper (default 256; 4 with --smoke)")
    ap.add_argument("--bucket-bytes", help="this engine's bucket_bytes (default: the engine's own)")
    ap.add_argument("--device", help="cuda or cpu (default: cuda if present; cpu with --smoke)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per probe")
    ap.add_argument("--time-budget", type=float, help="stop starting probes after this many seconds")
    ap.add_argument("--logs", metavar="DIR", help="keep every probe's full output here")
    ap.add_argument("--json", help="write the results here (rewritten after every probe)")
    args = ap.parse_args(argv)
    s = args.smoke
    args.device = args.device or ("cpu" if s or not torch.cuda.is_available() else "cuda")
    args.system_list = (args.systems or ("offload,torch" if s else ",".join(DEFAULT_SYSTEMS))).split(",")
    choices = [x for x in SYSTEMS if x != "twinflow"]  # Twin-Flow needs a ratio: vs_baselines.py sweeps it
    bad = [x for x in args.system_list if x not in choices]
    if bad:
        ap.error(f"unknown system(s) {bad}; choose from {', '.join(choices)}")
    args.budget_list = [parse_bytes(b) for b in (args.budgets.split(",") if args.budgets else
                                                 (["768KiB"] if s else BUDGETS))]
    width = dict(SMOKE_WIDTH if s else WIDTH)
    if args.d:
        width.update(d=args.d, n_head=max(1, args.d // 80), ffn=4 * args.d)
    args.width = width
    args.batch = args.batch or (2 if s else 1)
    args.seq = args.seq or (32 if s else 1024)
    args.max_layers = args.max_layers or (4 if s else 256)
    if s and args.bucket_bytes is None:
        args.bucket_bytes = "32KiB"
    return args


def shape(args, n_layer: int) -> Shape:
    return Shape(n_layer=n_layer, **args.width)


def params_at(args, n_layer: int) -> int:
    return sum(p.numel() for p in shape(args, n_layer).build("meta").parameters())


class Search:
    """Doubling, then bisection, over the layer count for one system and budget."""

    def __init__(self, args, system: str, budget: int, probe):
        self.args, self.system, self.budget, self.probe = args, system, budget, probe
        self.probes: list[dict] = []
        self.error: str | None = None

    def fits(self, n_layer: int) -> bool | None:
        """True / False, or None when the probe failed for a reason other than size."""
        res = self.probe(self.system, self.budget, n_layer)
        self.probes.append({"n_layer": n_layer, "params": params_at(self.args, n_layer), "status": res["status"],
                            "error": res.get("error"), "peak_gpu_bytes": res.get("peak_gpu_bytes"),
                            "peak_host_bytes": res.get("peak_host_bytes"),
                            "host_pinned_bytes": (res.get("details") or {}).get("host_pinned_bytes"),
                            "wall_s": res.get("wall_s")})
        if res.get("ok"):
            return True
        if res["status"] in TOO_BIG:
            return False
        self.error = f"probe at {n_layer} layers: {res['status']}: {res.get('error')}"
        return None

    def run(self, cap) -> dict:
        """``cap()``: the deepest size worth probing, asked again after every probe (this engine's host-RAM
        bound becomes known after its first successful probe)."""
        lo, hi, n = 0, None, 1
        while True:
            ok = self.fits(n)
            if ok is None:
                break
            if not ok:
                hi = n
                break
            lo = n
            if n >= cap():
                break
            n = min(2 * n, cap())
        while hi is not None and self.error is None and hi - lo > 1:
            mid = (lo + hi) // 2
            ok = self.fits(mid)
            if ok is None:
                break
            lo, hi = (mid, hi) if ok else (lo, mid)
        return {"system": self.system, "budget_bytes": self.budget, "n_layer": lo or None,
                "params": params_at(self.args, lo) if lo else None, "capped": bool(lo and lo >= cap()),
                "incomplete": self.error is not None, "error": self.error, "probes": self.probes}


def host_bound(args, out: dict, probes: list[dict]) -> dict | None:
    """host RAM / host bytes per parameter of this engine's arena, from its largest successful probe."""
    ok = [p for p in probes if p["status"] == "ok" and p["host_pinned_bytes"]]
    if not ok:
        return out["host_ram_bound"]
    best = max(ok, key=lambda p: p["params"])
    if out["host_ram_bound"] and out["host_ram_bound"]["from_params"] >= best["params"]:
        return out["host_ram_bound"]
    per_param = best["host_pinned_bytes"] / best["params"]
    ram = out["machine"]["host_ram_bytes"]
    p1, p2 = params_at(args, 1), params_at(args, 2)
    layers = int((ram / per_param - p1) // (p2 - p1)) + 1
    return {"host_ram_bytes": ram, "bytes_per_param": per_param, "params": int(ram / per_param),
            "n_layer": layers, "from_params": best["params"],
            "source": f"host RAM / (host arena bytes / params of the {best['n_layer']}-layer probe)"}


def main(argv=None) -> int:
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 180)
    out = {"benchmark": "max_model", "smoke": args.smoke, "machine": machine(),
           "settings": {"width": args.width, "batch": args.batch, "seq": args.seq, "max_layers": args.max_layers,
                        "device": args.device, "steps": "1 warm-up + 1",
                        "dtype": "bfloat16 compute, fp32 masters", "activation_checkpointing": False},
           "max_model": [], "host_ram_bound": None}
    t0 = time.perf_counter()
    params_cache: dict[int, int] = {}

    def probe(system: str, budget: int, n_layer: int) -> dict:
        spec = {"system": system, "model": f"gpt-d{args.width['d']}-L{n_layer}",
                "shape": asdict(shape(args, n_layer)), "batch": args.batch, "seq": args.seq,
                "device": args.device, "budget_bytes": budget, "warmup": 1, "steps": 1, "lr": 1e-4, "seed": 0,
                "bucket_bytes": args.bucket_bytes, "cap": True}
        params = params_cache.setdefault(n_layer, params_at(args, n_layer))
        pre = not_startable(spec, params)
        if pre is not None:
            return pre
        left = None if args.time_budget is None else args.time_budget - (time.perf_counter() - t0)
        if left is not None and left <= 0:
            return {"ok": False, "status": "not_run", "error": f"time budget of {args.time_budget:.0f} s used up"}
        label = f"max-{system}-{size_label(budget)}-L{n_layer}"
        log = Path(args.logs) / f"{label}.log" if args.logs else None
        with console.status(label):
            res = run_child(spec, args.timeout if left is None else min(args.timeout, left), log)
        console.print(f"{label}: {res['status']}" + ("" if res.get("ok") else f" ({(res.get('error') or '')[:140]})"))
        return res

    for budget in args.budget_list:
        for system in args.system_list:
            search = Search(args, system, budget, probe)

            def cap() -> int:
                if system != "offload":
                    return args.max_layers
                out["host_ram_bound"] = host_bound(args, out, search.probes)
                bound = out["host_ram_bound"]
                return args.max_layers if bound is None else max(1, min(args.max_layers, bound["n_layer"]))

            out["max_model"].append(search.run(cap))
            write_json(args.json, out)
    out["total_s"] = time.perf_counter() - t0
    write_json(args.json, out)
    print_table(console, out)
    return 0


def print_table(console: Console, out: dict) -> None:
    t = Table(title="largest model that trains (layers at fixed width)")
    for c in ("system", "budget", "layers", "params", "probes", "note"):
        t.add_column(c, justify="left" if c in ("system", "note") else "right")
    for m in out["max_model"]:
        note = "capped" if m["capped"] else (m["error"] or "")[:80]
        if not m["n_layer"] and m["probes"] and not note:
            note = f"1 layer: {m['probes'][0]['status']}"
        t.add_row(m["system"], gib(m["budget_bytes"]), str(m["n_layer"] or "-"),
                  f"{m['params']:,}" if m["params"] else "-", str(len(m["probes"])), note)
    console.print(t)
    b = out["host_ram_bound"]
    if b:
        console.print(f"offload host-RAM bound: {gib(b['host_ram_bytes'])} / {b['bytes_per_param']:.2f} B/param = "
                      f"{b['params']:,} params ({b['n_layer']} layers at this width)")


if __name__ == "__main__":
    raise SystemExit(main())
