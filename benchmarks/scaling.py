"""SIMULATED data-parallel scaling (issue 20): step time and tokens/s of one rank on 1 to 64 GPUs (1 to 8
nodes), on two data paths side by side, against DeepSpeed ZeRO-Offload's data-parallel rule at the same
per-GPU budgets, on traces of real model shapes built on the meta device (no weights, no GPU).

* ``runtime`` (first: it is what the code runs): ``offload/planning/data_parallel_runtime.py`` ([Note: the
  runtime's data-parallel step]): each rank's single-GPU plan, what runs on CUDA (``grad_reduce="auto"``,
  [Note: the runtime's device reduce-scatter]): each bucket's grads reduce-scattered on the device over
  NCCL's link presets and this rank's 1/N shard copied to the host, the shard's AdamW on the rank's CPU lane.
  Then, on ONE node (the engine's default ``share_host_copy=None`` shares there: [Note: the runtime's shared
  host copy]), the AdamW writes the shard into the node's one host copy and one small gloo check per backward
  says every rank has ([Note: the shared copy checked once per backward]; until 2026-11-27 one per bucket):
  nothing of the weights is gathered, and the plan has no gather buffers.
  Over SEVERAL nodes each node keeps one host copy too ([Note: one host copy per host]; until 2026-11-28 each
  rank its own): the updated shard is copied to the device, all-gathered there (NCCL) and only the rank's
  column's other shards (its local rank on the other nodes: ``(M - 1) / N`` of the bucket) copied back into
  the node's copy, with the weights' two gather buffers out of the plan's budget; the same check per
  backward. After ``step()`` each resident bucket updated comes up as this
  rank's 1/G chunk, all-gathered in its slot over the node's G GPUs (NVLink; [Note: resident weights gathered
  in their slots]); other copies are of whole buckets, as on one GPU. The grad slots are padded to the
  shards (as the engine plans it); gloo (NOMINAL presets, [Note: gloo's collectives]) runs the checks
  (``step()``'s two, and the shared copy's one per backward).
* ``design``: ``offload/planning/data_parallel.py`` ([Note: the data-parallel step]): what issue 20 asks
  the runtime to become (NCCL reduce-scatter of the grad slot on the device, a shard copied, an all-gather
  on the device before each use, from a 1/N shard), on NCCL's link presets. The runtime gathers after the
  update instead, and copies whole buckets to the device.

Everything here is a cost model (``offload/planning/collectives.py``: [Note: the alpha-beta ring model],
[Note: gloo's collectives]), not a measurement: the host presets (``pcie4``, ``pcie5``:
``offload/planning/hw.py``) and the link presets (NVLink, InfiniBand; gloo over loopback and TCP) are
nominal figures whose sources and assumptions are written next to them and copied into the JSON. Compute
times are estimated per operator on the preset's assumed device roofline (as ``schedule_sim.py`` does).
What is measured in this run: how long tracing and planning took on this machine.

Weak scaling: every rank runs the traced micro-batch (``batch x seq`` tokens), so ``tokens/s = N x batch x
seq / step`` and the scaling efficiency is ``tokens/s at N / (N x tokens/s at 1) = step at 1 / step at N``.

Host bytes: the runtime path's rows give the runtime's arena (``report_dp.runtime_host_bytes_per_rank``: no
landing grad, grads are reduced on the device; no 16-bit copy in it where the node's ranks share one) and the
node's one shared copy (``host_shared_bytes_per_node``, in ``host_bytes_per_node``; every config with more
than one GPU a node; ``host_bytes_per_node_per_rank_copy`` is what the node would hold with a copy per rank);
the design's rows the design's.

Budgets (per GPU): ``zero-offload``: the smallest that holds ZeRO-Offload's rule (every 16-bit parameter on
the device, the grad slots, activations), so both policies fit; and the step's non-parameter memory plus 25 %
of the parameters' bf16 bytes, where ZeRO-Offload's rule does not fit (its step is shown, marked ``x``).

    python benchmarks/scaling.py --json benchmarks/results/scaling_sim.json
    python benchmarks/scaling.py --models gpt2 --configs 1,2,4/2 --inter eth100      # small and quick
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from offload.config import format_bytes
from offload.host.node_copy import node_copy_layout
from offload.planning.collectives import GLOO_INTER_OF, GLOO_INTRA, INTER, INTRA, cluster_of, gloo_cluster_of
from offload.planning.data_parallel import host_bytes_per_node, host_bytes_per_rank
from offload.planning.hw import PRESETS
from offload.tools.baselines import Case, zero_offload
from offload.tools.baselines_dp import POLICIES, runtime_data_parallel
from offload.tools.report_dp import runtime_host_bytes_per_rank
from offload.tools.presets import MODELS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import brief_machine, trace_preset  # noqa: E402

# model:batch:seq per rank. Sequences whose ZeRO-Offload budget fits an 80 GB card (no activation
# checkpointing here); gpt2-xl at batch 8 is the case where compute, not the CPU AdamW, is the longest lane.
CASES = "gpt2-xl:1:1024,gpt2-xl:8:1024,llama-7b:1:2048,llama-13b:1:2048"
CONFIGS = "1,2,4,8,16/2,32/4,64/8"  # GPUs in all / nodes (8 GPUs a node beyond one node)
INTRA_OF = {"pcie3": "pcie4-p2p", "pcie4": "nvlink3", "pcie5": "nvlink4"}  # the GPU generation's NVLink
ITEMSIZE = 2  # bf16 on the device
BUCKET_BYTES = 32 << 20
FRACTION = 0.25
GOAL_EFFICIENCY_8 = 0.90
SHORT = {"zero-offload": "ZO-min"}  # the table's name of a budget
GLOO_INTRA_PRESET = "loopback"
RUNS = "runtime"  # the path the code runs today
PATHS = {
    "runtime": "what the code runs on CUDA (grad_reduce=\"device\", share_host_copy=None): grads "
               "reduce-scattered on the device (NCCL), a 1/N shard copied to the host and updated by the shard's "
               "AdamW on each rank's CPU lane; on one node the AdamW writes it into the node's one shared host "
               "copy and one gloo check per backward says the copy is whole (no all-gather of the weights, no gather "
               "buffers: [Note: the runtime's shared host copy]); over several nodes each node keeps one copy "
               "too: the updated shard is copied back to the device, all-gathered there (NCCL, two gather "
               "buffers in turn, out of the budget) and the rank's column's other shards copied into the node's "
               "copy ([Note: one host copy per host]); after step() each "
               "updated resident bucket comes up as a 1/G chunk all-gathered in its slot over the node's GPUs "
               "([Note: resident weights gathered in their slots]), other copies whole as on one GPU; planned "
               "with the grad slots padded "
               "(offload/planning/data_parallel_runtime.py, [Note: the runtime's device reduce-scatter])",
    "design": "what issue 20 designs, NOT what runs: device NCCL reduce-scatter, a 1/N shard copied, the "
              "weights all-gathered on the device at each fetch from a 1/N shard (offload/planning/"
              "data_parallel.py); zero-offload rows use this model's NCCL collectives too"}


def parse_case(spec: str) -> tuple[str, int, int]:
    name, *rest = spec.split(":")
    if name not in MODELS:
        raise SystemExit(f"unknown model {name!r}: use one of {sorted(MODELS)}")
    return name, int(rest[0]) if rest else 1, int(rest[1]) if len(rest) > 1 else 1024


def parse_configs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        gpus, _, nodes = item.partition("/")
        out.append((int(gpus), int(nodes or 1)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--models", default=CASES, help="model presets as name[:batch[:seq]] (default batch 1, seq 1024)")
    ap.add_argument("--hw", default="pcie4,pcie5", help="host presets (offload/planning/hw.py)")
    ap.add_argument("--intra", default="", help=f"intra-node link preset for every hw ({sorted(INTRA)}); default: "
                    f"{INTRA_OF}")
    ap.add_argument("--inter", default="eth100,ib400",
                    help=f"inter-node link presets ({sorted(INTER)}), per node; each multi-node config runs on each")
    ap.add_argument("--configs", default=CONFIGS, help="GPUs in all, '/nodes' when over several nodes")
    args = ap.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 230)
    configs = parse_configs(args.configs)
    inters = args.inter.split(",")
    if configs[0] != (1, 1):
        configs.insert(0, (1, 1))  # the efficiency's reference
    out: dict = {
        "benchmark": "scaling", "label": "SIMULATED: a cost model, not a measurement", "machine": brief_machine(),
        "runs": RUNS, "paths": PATHS,
        "host_copy": "runtime path: shared (one host copy per node, share_host_copy=None's default) wherever a "
                     "node runs several GPUs, on one node or several (each row's host_copy)",
        "itemsize": ITEMSIZE, "bucket_bytes": BUCKET_BYTES, "weak_scaling": "every rank runs batch x seq tokens",
        "efficiency": "tokens/s at N / (N x tokens/s at 1)",
        "budgets": {"zero-offload": "the smallest per-GPU budget ZeRO-Offload's rule fits in",
                    f"{FRACTION:.0%}": "activations + largest grad + buffers + 25 % of the bf16 parameter bytes"},
        "compute_times": "estimated: per-operator roofline on the preset's assumed device throughput",
        "hw": {}, "links": {}, "rows": [], "timings_s": {}, "goals": []}
    table = Table(title="SIMULATED data-parallel scaling (cost model; presets, not measurements). "
                        "The code runs the RUNTIME path; the design path is issue 20's plan")
    for col in ("model", "hw", "budget/GPU", "GPUs", "links (design; runtime: gloo)", "runtime step s",
                "runtime tok/s", "runtime eff", "design step s", "design tok/s", "design eff", "ZeRO-Off step s",
                "ZeRO-Off eff", "design / ZeRO-Off", "host/node runtime", "host/node design",
                "runtime dev coll s", "runtime D2H s"):
        table.add_column(col, justify="left" if col in ("model", "hw") or col.startswith("links") else "right")
    for spec in args.models.split(","):
        name, batch, seq = parse_case(spec)
        label = f"{name} {batch}x{seq}"
        mt, buckets, param_bytes, extra, seconds = trace_preset(console, name, batch, seq, BUCKET_BYTES, ITEMSIZE)
        out["timings_s"][f"trace {label}"] = seconds
        for hw_name in args.hw.split(","):
            hw = PRESETS[hw_name]
            out["hw"][hw_name] = hw.notes
            compute = mt.compute_s(hw)
            zo_budget = zero_offload(Case(mt.trace, buckets, ITEMSIZE, hw, compute, 0, mt.buffer_bytes)).peak_bytes
            budgets = (("zero-offload", zo_budget), (f"{FRACTION:.0%}", extra + int(FRACTION * param_bytes)))
            for budget_name, budget in budgets:
                case = Case(mt.trace, buckets, ITEMSIZE, hw, compute, budget, mt.buffer_bytes)
                base: dict[str, float] = {}
                for gpus, nodes, inter in ((g, n, x) for g, n in configs for x in (inters if n > 1 else inters[:1])):
                    cluster = cluster_of(gpus, nodes, args.intra or INTRA_OF[hw_name], inter)
                    gloo = gloo_cluster_of(gpus, nodes, GLOO_INTRA_PRESET, GLOO_INTER_OF[inter])
                    for link in (cluster.intra, cluster.inter, gloo.intra, gloo.inter):
                        out["links"][link.name] = link.source
                    where = f"{name} {hw_name} {budget_name} {cluster.describe()}"
                    t1 = time.perf_counter()
                    # the engine's default: one host copy per node wherever a node runs several ranks
                    shared = cluster.gpus_per_node > 1
                    with console.status(where):
                        res = {"runtime": runtime_data_parallel(case, gloo, device=cluster, shared=shared)}
                        res.update((p, f(case, cluster)) for p, f in POLICIES.items())
                    out["timings_s"][where] = time.perf_counter() - t1
                    own_copy = runtime_host_bytes_per_rank(buckets, ITEMSIZE, cluster.world, False,
                                                           landing=False)  # grads reduced on the device
                    host_rank = {"runtime": runtime_host_bytes_per_rank(buckets, ITEMSIZE, cluster.world, False,
                                                                        landing=False, own_copy=not shared),
                                 "design": host_bytes_per_rank(buckets, ITEMSIZE, cluster)}
                    node_copy = node_copy_layout(buckets, ITEMSIZE)[1] if shared else 0
                    host_node = {"runtime": cluster.gpus_per_node * host_rank["runtime"] + node_copy,
                                 "design": cluster.gpus_per_node * host_rank["design"]}
                    cells = {}
                    for p, r in res.items():
                        path = "runtime" if p == "runtime" else "design"
                        step = r.step_s
                        if (gpus, nodes) == (1, 1) and step:
                            base[p] = step
                        tok = gpus * batch * seq / step if step else None
                        eff = base[p] / step if step and p in base else None
                        cells[p] = (step, tok, eff, r.fits)
                        dp = r.dp
                        out["rows"].append({
                            "case": label, "model": name, "batch": batch, "seq": seq, "params": mt.numel, "hw": hw_name,
                            "budget": budget_name, "budget_bytes": budget, "gpus": gpus, "nodes": nodes,
                            "gpus_per_node": cluster.gpus_per_node, "path": path,
                            "intra": (gloo if path == "runtime" else cluster).intra.name,
                            "inter": (gloo if path == "runtime" else cluster).inter.name if nodes > 1 else None,
                            "inter_nics": inter if nodes > 1 else None,
                            "policy": "greedy" if p == "runtime" else p, "step_s": step,
                            "tokens_per_s": tok, "efficiency": eff, "fits": r.fits, "peak_bytes": r.peak_bytes,
                            "host_bytes_per_rank": host_rank[path],
                            "host_bytes_per_node": host_node[path],
                            # [Note: the runtime's shared host copy]: "shared" where a node runs several GPUs
                            "host_copy": ("shared" if shared else "per rank") if path == "runtime" else None,
                            "host_shared_bytes_per_node": node_copy if path == "runtime" else None,
                            "host_bytes_per_node_per_rank_copy": (cluster.gpus_per_node * own_copy
                                                                  if path == "runtime" else None),
                            "check_busy_s": getattr(dp, "check_busy_s", None) if dp else None,
                            "h2d_bytes_per_rank": dp.sim.h2d_bytes if dp else None,
                            "stall_s": dp.sim.stall_s if dp else None,
                            "cpu_adam_s": dp.sim.adam_s if dp else None,
                            "all_gather_busy_s": dp.all_gather_busy_s if dp else None,
                            "reduce_scatter_busy_s": dp.reduce_scatter_busy_s if dp else None,
                            "device_reduce_busy_s": getattr(dp, "device_reduce_busy_s", None) if dp else None,
                            "device_gather_busy_s": getattr(dp, "device_gather_busy_s", None) if dp else None,
                            # [Note: resident weights gathered in their slots]: the node's all-gathers after step()
                            "refresh_gather_busy_s": getattr(dp, "refresh_gather_busy_s", None) if dp else None,
                            "compute_s": dp.sim.compute_s if dp else None,
                            "h2d_busy_s": dp.sim.h2d_busy_s if dp else None,
                            "d2h_busy_s": dp.sim.d2h_busy_s if dp else None,
                            # the runtime's node: G ranks each copying whole buckets both ways (not charged
                            # against host memory bandwidth: [Note: the runtime's data-parallel step])
                            "node_host_copy_bytes": getattr(dp, "node_host_copy_bytes", None) if dp else None})
                    run, ours, zo = cells["runtime"], cells["greedy"], cells["zero-offload"]
                    rdp = res["runtime"].dp
                    table.add_row(
                        label, hw_name, f"{SHORT.get(budget_name, budget_name)} {format_bytes(budget)}",
                        f"{gpus}" + (f" ({nodes}x{cluster.gpus_per_node})" if nodes > 1 else ""),
                        cluster.intra.name + (f"+{cluster.inter.name}" if nodes > 1 else ""),
                        *_cells(run), *_cells(ours), *_cells(zo)[::2],
                        f"{zo[0] / ours[0]:.2f}x" if ours[0] and zo[0] else "-",
                        format_bytes(host_node["runtime"]) + (" sh" if shared else ""),
                        format_bytes(host_node["design"]),
                        f"{rdp.device_reduce_busy_s + rdp.device_gather_busy_s + rdp.refresh_gather_busy_s:.3f}"
                        if rdp else "-",
                        f"{rdp.sim.d2h_busy_s:.3f}" if rdp else "-")
                out["goals"].extend(_goals(out["rows"], label, hw_name, budget_name))
    console.print(table)
    console.print(f"The code runs the [bold]{RUNS}[/] path: {PATHS[RUNS]}. The design path: {PATHS['design']}.")
    console.print("host/node runtime: 'sh' marks one host copy of the weights per node, shared by its ranks "
                  "(share_host_copy=None, the default); without 'sh' each rank keeps its own copy")
    for g in out["goals"]:
        console.print(f"goal [{'green' if g['holds'] else 'red'}]{'holds' if g['holds'] else 'FAILS'}[/]: {g['what']}")
    console.print("SIMULATED: every number above is the cost model's (offload/planning/collectives.py, "
                  "data_parallel_runtime.py, data_parallel.py) on nominal presets:")
    for k, v in {**out["hw"], **out["links"]}.items():
        console.print(f"  {k}: {v}")
    console.print(f"machine (tracing/planning only): {out['machine']}")
    console.print({k: round(v, 2) for k, v in out["timings_s"].items() if k.startswith("trace")})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        console.print(f"wrote {args.json}")
    return 0


def _cells(c) -> list[str]:
    step, tok, eff, fits = c
    if step is None:
        return ["does not fit", "-", "-"]
    mark = "" if fits else " x"
    return [f"{step:.3f}{mark}", f"{tok:,.0f}", f"{eff:.0%}" if eff is not None else "-"]


def _goals(rows: list[dict], model: str, hw: str, budget: str) -> list[dict]:
    """The issue's goals for one (model, hw, budget), per path: >= 90 % efficiency at 8 GPUs on one node, and
    never slower than ZeRO-Offload's rule at any GPU count (where that rule fits the budget)."""
    mine = [r for r in rows if (r["case"], r["hw"], r["budget"]) == (model, hw, budget)]
    zo = {(r["gpus"], r["nodes"], r["inter_nics"]): r for r in mine if r["policy"] == "zero-offload"}
    out = []
    for path in ("runtime", "design"):
        ours = {(r["gpus"], r["nodes"], r["inter_nics"]): r for r in mine
                if r["policy"] == "greedy" and r["path"] == path}
        eight = ours.get((8, 1, None))
        runs = " (what runs)" if path == RUNS else " (not what runs)"
        if eight is not None and eight["efficiency"] is not None:
            out.append({"model": model, "hw": hw, "budget": budget, "path": path,
                        "goal": "efficiency_8_gpus_one_node", "value": eight["efficiency"],
                        "holds": eight["efficiency"] >= GOAL_EFFICIENCY_8,
                        "what": f"{model} {hw} {budget}, {path} path{runs}: efficiency at 8 GPUs on one node "
                                f"{eight['efficiency']:.0%} (goal >= {GOAL_EFFICIENCY_8:.0%})"})
        worse = [k for k, r in ours.items() if zo[k]["fits"] and (r["step_s"] is None or r["step_s"] > zo[k]["step_s"])]
        compared = [k for k in ours if zo[k]["fits"]]
        if compared:
            out.append({"model": model, "hw": hw, "budget": budget, "path": path,
                        "goal": "never_below_zero_offload",
                        "value": [f"{g}/{n} {x or ''}".strip() for g, n, x in worse], "holds": not worse,
                        "what": f"{model} {hw} {budget}, {path} path{runs}: never slower than ZeRO-Offload at "
                                f"{len(compared)} cluster configs"
                                + (f"; slower at {len(worse)}: {worse}" if worse else "")})
    return out


if __name__ == "__main__":
    raise SystemExit(main())
