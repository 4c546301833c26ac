"""``offload report --gpus N [--nodes M]``: the data-parallel part of the report (issue 20). Per rank: the
device plan within the same per-GPU budget and its pinned host arena; per node: the host bytes of its
ranks; the predicted step with the collectives, beside ZeRO-Offload's data-parallel rule. Cost models on
nominal link presets, labelled so.

Two data paths, the flat keys for the one the code runs and ``*_design`` for the other:

* the **runtime** path (what runs: ``offload/planning/data_parallel_runtime.py``, [Note: the runtime's
  data-parallel step]): each rank's single-GPU plan (the report's ``plan``), whole buckets copied each way,
  every collective on the host through gloo, serial with the shard's AdamW on the rank's CPU lane; on gloo's
  nominal presets (``collectives.GLOO_INTRA``, and over ``--inter``'s NICs ``GLOO_INTER_OF``). float16 defers
  every update to ``step()``: its figures are the deferred path's ([Note: the runtime's deferred data-parallel
  step]) for one backward per step (``micro_batches`` 1: the report has no accumulation option), whose end
  all-reduces every bucket's grads (``all_reduce_busy_s``); ``runtime_path`` says which path (``overlapped``
  or ``deferred``);
* the **design** path (issue 20's plan, not what runs: ``offload/planning/data_parallel.py``): the rank plan
  costed with device NCCL collectives on the ``--intra``/``--inter`` presets.

Host bytes are what the runtime allocates (``offload/host/shard.py``'s layout: its 1/N shard of the fp32
master, Adam m and v and summed grad, plus the whole device-dtype copy and landing grad; tested equal to the
arena every rank allocates), beside the design's (the copy once per node and only a 1/N grad shard on the
host) as ``host_bytes_per_rank_design``."""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

from ..config import format_bytes
from ..errors import BudgetTooSmallError, ReportError
from ..planning.collectives import GLOO_INTER_OF, cluster_of, gloo_cluster_of
from ..planning.data_parallel import build_rank_plan, host_bytes_per_node, host_bytes_per_rank, simulate_rank_plan
from ..planning.data_parallel_runtime import simulate_runtime_deferred_plan, simulate_runtime_plan
from ..host.shard import shard_layout, shard_of
from .baselines import Case
from .baselines_dp import zero_offload_data_parallel
from .report import Report

RUNS = "runtime"
DEFERRED_FP16 = ("float16 defers every update to step() (loss scaling): the deferred path, one backward per step "
                 "(its end all-reduces every bucket's grads over the ranks; step() updates each rank's shard and "
                 "all-gathers the 16-bit copy)")


def data_parallel(report: Report, gpus: int, nodes: int, intra: str, inter: str) -> dict:
    """The data-parallel figures of ``report``'s model and budget on ``gpus`` GPUs over ``nodes`` nodes."""
    try:
        cluster = cluster_of(gpus, nodes, intra, inter)
        gloo = gloo_cluster_of(gpus, nodes, "loopback", GLOO_INTER_OF[cluster.inter.name])
    except ValueError as e:
        raise ReportError(f"--gpus/--nodes/--intra/--inter: {e}", usage=True) from None
    r, plan = report.request, report.plan
    lowp = plan.itemsize if r.dtype != torch.float32 else 0
    accumulate = r.dtype == torch.float16  # as the single-GPU report's host breakdown
    links = (cluster.intra, cluster.inter, gloo.intra, gloo.inter) if cluster.nodes > 1 else (cluster.intra,
                                                                                              gloo.intra)
    per_rank = runtime_host_bytes_per_rank(plan.buckets, plan.itemsize, cluster.world, accumulate)
    out = {
        "gpus": cluster.world, "nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
        "intra": cluster.intra.name, "inter": cluster.inter.name if cluster.nodes > 1 else None,
        "gloo_intra": gloo.intra.name, "gloo_inter": gloo.inter.name if cluster.nodes > 1 else None,
        "links": {x.name: x.source for x in links},
        "simulated": "cost model on nominal link presets, not measured",
        "runs": "runtime: the flat keys are the path the code runs (host gloo collectives, whole-bucket copies); "
                "*_design keys are issue 20's design (device NCCL collectives), which does not run yet",
        "host_bytes_per_rank": per_rank, "host_bytes_per_node": cluster.gpus_per_node * per_rank,
        "host_bytes_per_rank_design": host_bytes_per_rank(plan.buckets, lowp, cluster, accumulate),
        "host_bytes_per_node_design": host_bytes_per_node(plan.buckets, lowp, cluster, accumulate),
        "fits": False, "device_peak_bytes_per_rank": None, "predicted_step_s": None, "tokens_per_s": None,
        "all_gather_busy_s": None, "reduce_scatter_busy_s": None, "check_busy_s": None, "runtime_note": None,
        "runtime_path": "deferred" if accumulate else "overlapped", "micro_batches": 1, "all_reduce_busy_s": None,
        "accumulate_busy_s": None,
        "fits_design": False, "device_peak_bytes_per_rank_design": None, "predicted_step_s_design": None,
        "tokens_per_s_design": None, "all_gather_busy_s_design": None, "reduce_scatter_busy_s_design": None,
        "zero_offload_step_s": None,
    }
    if not report.fits:
        return out
    tokens = cluster.world * r.batch * r.seq
    out.update(fits=True, device_peak_bytes_per_rank=plan.peak_bytes)
    if accumulate:  # float16: updates deferred to step() ([Note: the runtime's deferred data-parallel step])
        rt = simulate_runtime_deferred_plan(plan, r.hw, gloo, report.compute_s, micro_batches=1)
        out.update(runtime_note=DEFERRED_FP16)
    else:
        rt = simulate_runtime_plan(plan, r.hw, gloo, report.compute_s)
    out.update(predicted_step_s=rt.step_s, tokens_per_s=tokens / rt.step_s,
               all_gather_busy_s=rt.all_gather_busy_s, reduce_scatter_busy_s=rt.reduce_scatter_busy_s,
               check_busy_s=rt.check_busy_s, all_reduce_busy_s=rt.all_reduce_busy_s,
               accumulate_busy_s=rt.accumulate_busy_s)
    try:
        rank = build_rank_plan(plan.trace, plan.buckets, itemsize=plan.itemsize, budget_bytes=r.budget_bytes,
                               fixed_bytes=plan.fixed_bytes, hw=r.hw, cluster=cluster, compute_s=report.compute_s)
    except BudgetTooSmallError:
        return out
    dp = simulate_rank_plan(rank, r.hw, cluster, report.compute_s)
    case = Case(plan.trace, plan.buckets, plan.itemsize, r.hw, report.compute_s, r.budget_bytes, plan.fixed_bytes)
    zo = zero_offload_data_parallel(case, cluster)
    out.update(fits_design=True, device_peak_bytes_per_rank_design=rank.peak_bytes, predicted_step_s_design=dp.step_s,
               tokens_per_s_design=tokens / dp.step_s, all_gather_busy_s_design=dp.all_gather_busy_s,
               reduce_scatter_busy_s_design=dp.reduce_scatter_busy_s, zero_offload_step_s=zo.step_s,
               zero_offload_fits=zo.fits)
    return out


def runtime_host_bytes_per_rank(buckets, device_itemsize: int, world: int, accumulate: bool) -> int:
    """The pinned host arena one rank of ``world`` allocates for ``buckets`` ([Note: host shards]: every rank's
    shards have the same size, so every rank's arena is this size)."""
    shards = [shard_of(b.trainable_numel, 0, world) for b in buckets]
    return shard_layout(buckets, shards, world, device_itemsize, accumulate).total_bytes


def render_data_parallel(dp: dict, console: Console) -> None:
    t = Table(title=f"data parallel on {dp['gpus']} GPUs ({dp['nodes']} node(s) x {dp['gpus_per_node']}): "
                    "SIMULATED, link presets")
    t.add_column("")
    t.add_column("runtime path (what runs)", justify="right")
    t.add_column("design path (issue 20, not run)", justify="right")
    t.add_row("collectives", "gloo on the host: " + dp["gloo_intra"] + (f" + {dp['gloo_inter']}" if dp["gloo_inter"]
              else ""), "NCCL on the device: " + dp["intra"] + (f" + {dp['inter']}" if dp["inter"] else ""))
    t.add_row("device peak per rank", _bytes(dp["device_peak_bytes_per_rank"]),
              _bytes(dp["device_peak_bytes_per_rank_design"]))
    t.add_row("pinned host per rank", format_bytes(dp["host_bytes_per_rank"]),
              format_bytes(dp["host_bytes_per_rank_design"]))
    t.add_row("pinned host per node", format_bytes(dp["host_bytes_per_node"]),
              format_bytes(dp["host_bytes_per_node_design"]))
    t.add_row("step (with collectives)", _seconds(dp["predicted_step_s"]),
              _seconds(dp["predicted_step_s_design"]))
    t.add_row("tokens/s (all ranks)", _rate(dp["tokens_per_s"]), _rate(dp["tokens_per_s_design"]))
    t.add_row("all-gather / reduce-scatter busy", _pair(dp["all_gather_busy_s"], dp["reduce_scatter_busy_s"]),
              _pair(dp["all_gather_busy_s_design"], dp["reduce_scatter_busy_s_design"]))
    if dp["runtime_path"] == "deferred" and dp["all_reduce_busy_s"] is not None:
        t.add_row("all-reduce per backward busy", f"{dp['all_reduce_busy_s']:.3f} s", "")
    if dp["zero_offload_step_s"] is not None:
        t.add_row("ZeRO-Offload's DP rule, step", "", f"{dp['zero_offload_step_s']:.3f} s"
                  + ("" if dp["zero_offload_fits"] else " (over the budget)"))
    console.print(t)
    if dp["runtime_note"]:
        console.print(f"  runtime path: {dp['runtime_note']}")
    for name, source in dp["links"].items():
        console.print(f"  {name}: {source}")


def _bytes(n: int | None) -> str:
    return format_bytes(n) if n is not None else "does not fit"


def _seconds(s: float | None) -> str:
    return f"{s:.3f} s" if s is not None else "does not fit"


def _rate(x: float | None) -> str:
    return f"{x:,.0f}" if x is not None else "-"


def _pair(a: float | None, b: float | None) -> str:
    return f"{a:.3f} / {b:.3f} s" if a is not None and b is not None else "-"
