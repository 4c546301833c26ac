"""``offload report --gpus N [--nodes M]``: the data-parallel part of the report (issue 20). Per rank: the
device plan within the same per-GPU budget and its pinned host arena; per node: the host bytes of its
ranks; the predicted step with the collectives (``offload/planning/data_parallel.py``), beside
ZeRO-Offload's data-parallel rule. A cost model on nominal link presets, labelled so.

Host bytes are what the runtime allocates today (``offload/host/shard.py``'s layout: its 1/N shard of the
fp32 master, Adam m and v and summed grad, plus the whole device-dtype copy and landing grad; tested equal
to the arena two gloo ranks allocate), not the simulated design's, which keeps the copy once per node and
only a 1/N grad shard on the host (grads reduce-scattered on the device): that figure is reported beside it
as ``host_bytes_per_rank_design``, since the step time is simulated for that design."""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

from ..config import format_bytes
from ..errors import BudgetTooSmallError, ReportError
from ..planning.collectives import cluster_of
from ..planning.data_parallel import build_rank_plan, host_bytes_per_node, host_bytes_per_rank, simulate_rank_plan
from ..host.shard import shard_layout, shard_of
from .baselines import Case
from .baselines_dp import zero_offload_data_parallel
from .report import Report


def data_parallel(report: Report, gpus: int, nodes: int, intra: str, inter: str) -> dict:
    """The data-parallel figures of ``report``'s model and budget on ``gpus`` GPUs over ``nodes`` nodes."""
    try:
        cluster = cluster_of(gpus, nodes, intra, inter)
    except ValueError as e:
        raise ReportError(f"--gpus/--nodes/--intra/--inter: {e}", usage=True) from None
    r, plan = report.request, report.plan
    lowp = plan.itemsize if r.dtype != torch.float32 else 0
    accumulate = r.dtype == torch.float16  # as the single-GPU report's host breakdown
    out = {
        "gpus": cluster.world, "nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
        "intra": cluster.intra.name, "inter": cluster.inter.name if cluster.nodes > 1 else None,
        "links": {x.name: x.source for x in (cluster.intra, cluster.inter)[:1 + (cluster.nodes > 1)]},
        "simulated": "cost model on nominal link presets, not measured",
        "host_bytes_per_rank": runtime_host_bytes_per_rank(plan.buckets, plan.itemsize, cluster.world, accumulate),
        "host_bytes_per_node": cluster.gpus_per_node * runtime_host_bytes_per_rank(plan.buckets, plan.itemsize,
                                                                                 cluster.world, accumulate),
        "host_bytes_per_rank_design": host_bytes_per_rank(plan.buckets, lowp, cluster, accumulate),
        "host_bytes_per_node_design": host_bytes_per_node(plan.buckets, lowp, cluster, accumulate),
        "fits": False, "device_peak_bytes_per_rank": None, "predicted_step_s": None, "tokens_per_s": None,
        "all_gather_busy_s": None, "reduce_scatter_busy_s": None, "zero_offload_step_s": None,
    }
    if not report.fits:
        return out
    try:
        rank = build_rank_plan(plan.trace, plan.buckets, itemsize=plan.itemsize, budget_bytes=r.budget_bytes,
                               fixed_bytes=plan.fixed_bytes, hw=r.hw, cluster=cluster, compute_s=report.compute_s)
    except BudgetTooSmallError:
        return out
    dp = simulate_rank_plan(rank, r.hw, cluster, report.compute_s)
    case = Case(plan.trace, plan.buckets, plan.itemsize, r.hw, report.compute_s, r.budget_bytes, plan.fixed_bytes)
    zo = zero_offload_data_parallel(case, cluster)
    out.update(fits=True, device_peak_bytes_per_rank=rank.peak_bytes, predicted_step_s=dp.step_s,
               tokens_per_s=cluster.world * r.batch * r.seq / dp.step_s, all_gather_busy_s=dp.all_gather_busy_s,
               reduce_scatter_busy_s=dp.reduce_scatter_busy_s, zero_offload_step_s=zo.step_s,
               zero_offload_fits=zo.fits)
    return out


def runtime_host_bytes_per_rank(buckets, device_itemsize: int, world: int, accumulate: bool) -> int:
    """The pinned host arena one rank of ``world`` allocates for ``buckets`` ([Note: host shards]: every rank's
    shards have the same size, so every rank's arena is this size)."""
    shards = [shard_of(b.trainable_numel, 0, world) for b in buckets]
    return shard_layout(buckets, shards, world, device_itemsize, accumulate).total_bytes


def render_data_parallel(dp: dict, console: Console) -> None:
    t = Table(title=f"data parallel on {dp['gpus']} GPUs ({dp['nodes']} node(s) x {dp['gpus_per_node']}, "
                    f"{dp['intra']}" + (f" + {dp['inter']}" if dp["inter"] else "") + "): SIMULATED, link presets")
    for col in ("", "value"):
        t.add_column(col, justify="left" if not col else "right")
    t.add_row("device peak per rank", format_bytes(dp["device_peak_bytes_per_rank"])
              if dp["device_peak_bytes_per_rank"] is not None else "does not fit")
    t.add_row("pinned host per rank (runtime)", format_bytes(dp["host_bytes_per_rank"]))
    t.add_row("pinned host per node (runtime)", format_bytes(dp["host_bytes_per_node"]))
    t.add_row("pinned host per node (simulated design)", format_bytes(dp["host_bytes_per_node_design"]))
    if dp["fits"]:
        t.add_row("step (with collectives)", f"{dp['predicted_step_s']:.3f} s")
        t.add_row("tokens/s (all ranks)", f"{dp['tokens_per_s']:,.0f}")
        t.add_row("all-gather / reduce-scatter busy", f"{dp['all_gather_busy_s']:.3f} / "
                  f"{dp['reduce_scatter_busy_s']:.3f} s")
        t.add_row("ZeRO-Offload's DP rule, step", f"{dp['zero_offload_step_s']:.3f} s"
                  + ("" if dp["zero_offload_fits"] else " (over the budget)"))
    console.print(t)
    for name, source in dp["links"].items():
        console.print(f"  {name}: {source}")
