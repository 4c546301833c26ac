"""``offload report --gpus N [--nodes M]``: the data-parallel part of the report (issue 20). Per rank: the
device plan within the same per-GPU budget and its pinned host arena; per node: the host bytes of its
ranks; the predicted step with the collectives, beside ZeRO-Offload's data-parallel rule. Cost models on
nominal link presets, labelled so.

Two data paths, the flat keys for the one the code runs and ``*_design`` for the other:

* the **runtime** path (what runs: ``offload/planning/data_parallel_runtime.py``, [Note: the runtime's
  data-parallel step]): each rank's single-GPU plan; with overlapped updates, what runs on CUDA
  (``grad_reduce="auto"``): grads reduce-scattered on the device over the ``--intra``/``--inter`` presets and a
  1/N shard copied to the host, the shard's AdamW on the rank's CPU lane, then the updated shard copied back
  to the device, all-gathered there and the gathered bytes copied to the rank's whole host copy ([Note: the
  runtime's device reduce-scatter]: ``grad_reduce: "device"``, ``device_reduce_busy_s``,
  ``device_gather_busy_s``); whole buckets copied to the device as on one GPU. That plan is the engine's on
  this path: the grad slots padded to their shards and the weights' two gather buffers
  (``weight_gather_bytes_per_rank``) out of the budget, so its ``device_peak_bytes_per_rank`` includes both
  (not the report's single-GPU ``plan``). Where the node's ranks share one host copy (``host_copy: "shared"``,
  the default on one node, ``--share-host-copy``; [Note: the runtime's shared host copy]) nothing of the
  weights is gathered: each rank's AdamW writes its shard into the node's copy and one small check per
  backward says it is whole; no gather buffers (``weight_gather_bytes_per_rank`` 0), the grad slots
  still padded; across nodes each node keeps one copy too, and each rank brings its column's shards (its
  local rank on the other nodes) into it (the default wherever a node runs several ranks; on the device path
  from the device's all-gather, whose gather buffers stay in the budget: [Note: one host copy per host] in
  host/node_copy.py); ``host_copy: "per rank"`` with ``--share-host-copy no``. gloo, on its nominal
  presets (``collectives.GLOO_INTRA``, and over ``--inter``'s NICs ``GLOO_INTER_OF``), runs the checks there
  (``step()``'s, and with a shared copy one per backward). ``--grad-reduce host`` (the
  engine's ``grad_reduce="host"``, and what the CPU backend runs by default) costs the report's single-GPU
  plan, the whole buckets' grads copied to the host, reduce-scattered there by gloo and the updated shards
  all-gathered by gloo (a check instead where shared), on the CPU lane, instead. float16 defers
  every update to ``step()``, and so does gradient accumulation (``--micro-batches K``: K forward and backward
  passes per step, the engine with ``overlap_optimizer=False``): their figures are the deferred path's ([Note:
  the runtime's deferred data-parallel step]), whose synced backwards all-reduce every bucket's grads
  (``all_reduce_busy_s``; with ``--no-sync`` only the last of the K, the others inside ``engine.no_sync()``);
  ``runtime_path`` says which path (``overlapped`` or ``deferred``), ``micro_batches`` and ``no_sync`` what
  was asked, and tokens/s counts every micro-batch;
* the **design** path (issue 20's plan, not what runs: ``offload/planning/data_parallel.py``): the rank plan
  costed with device NCCL collectives on the ``--intra``/``--inter`` presets. It, and ZeRO-Offload's
  data-parallel rule beside it, model one backward per step: with ``--micro-batches`` above 1 their step keys
  stay None and ``design_note`` says why.

Host bytes are what the runtime allocates (``offload/host/shard.py``'s layout: its 1/N shard of the fp32
master, Adam m and v and summed grad, plus the whole device-dtype copy (shared: none in the arena, the node's
one copy in ``host_shared_bytes_per_node`` and ``host_bytes_per_node``) and, where grads are reduced on the host,
the whole landing grad; tested equal to the arena every rank allocates on either path), beside the design's (the copy once per node and only a 1/N grad shard on the
host) as ``host_bytes_per_rank_design``."""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

from ..config import GRAD_REDUCE, format_bytes
from ..errors import BudgetTooSmallError, ReportError
from ..host.node_copy import node_copy_layout
from ..planning.collectives import GLOO_INTER_OF, Link, cluster_of, gloo_cluster_of
from ..planning.data_parallel import build_rank_plan, host_bytes_per_node, host_bytes_per_rank, simulate_rank_plan
from ..planning.data_parallel_deferred import simulate_runtime_deferred_plan
from ..planning.data_parallel_runtime import WEIGHT_GATHER_BUFFERS, simulate_runtime_plan, weight_gather_bytes
from ..planning.plan import Plan
from ..planning.schedule import build_plan
from ..host.shard import shard_layout, shard_of
from .baselines import Case
from .baselines_dp import device_reduce_plan_inputs, zero_offload_data_parallel
from .report import Report

RUNS = "runtime"
DEFERRED_FP16 = ("float16 defers every update to step() (loss scaling): the deferred path, one backward per step "
                 "(its end all-reduces every bucket's grads over the ranks; step() updates each rank's shard and "
                 "{weights})")
# what step() does with the updated 16-bit shards, per host copy ([Note: the runtime's shared host copy])
WEIGHTS_BACK = {"shared": "writes it into the node's shared 16-bit copy (a check per backward, no all-gather)",
                "per rank": "all-gathers the 16-bit copy"}
DESIGN_ONE_BACKWARD = ("the design path and ZeRO-Offload's data-parallel rule are modelled for one backward per "
                       "step only: no figure with --micro-batches above 1")


def check_accumulation(micro_batches: int, no_sync: bool) -> None:
    """``--micro-batches`` / ``--no-sync`` make sense (a usage :class:`ReportError` if not)."""
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ReportError(f"--micro-batches must be an integer >= 1; got {micro_batches!r}", usage=True)
    if no_sync and micro_batches < 2:
        raise ReportError("--no-sync needs --micro-batches 2 or more: it leaves out the all-reduce of every backward "
                          "but the last of a step", usage=True)


def deferred_note(fp16: bool, micro_batches: int, no_sync: bool, host_copy: str = "per rank") -> str:
    """What the deferred figures stand for (``host_copy``: "shared" or "per rank")."""
    if micro_batches == 1:
        return DEFERRED_FP16.format(weights=WEIGHTS_BACK[host_copy])
    why = "float16 and gradient accumulation defer" if fp16 else "gradient accumulation defers"
    synced = ("only the last backward all-reduces every bucket's grads over the ranks, the others run inside "
              "engine.no_sync()" if no_sync else "every backward's end all-reduces every bucket's grads over the ranks")
    return (f"{micro_batches} forward and backward passes per step; {why} every update to step() "
            f"(overlap_optimizer=False): the deferred path. Grads are summed on the host; {synced}; step() updates "
            f"each rank's shard and {WEIGHTS_BACK[host_copy]}")


def device_peak_note(gather_bytes: int) -> str:
    """What the device path's peak per rank counts beyond the single-GPU plan (``gather_bytes``: 0 where the
    node's ranks share one host copy and nothing is gathered on the device)."""
    if not gather_bytes:
        return ("grad_reduce=\"device\": the engine's plan on this path, with each grad slot padded to its shards "
                "(the node's ranks share one host copy of the weights: nothing of them is all-gathered on the "
                "device); the device peak includes the padding")
    return (f"grad_reduce=\"device\": the engine's plan on this path, with each grad slot padded to its shards "
            f"and the weights' {WEIGHT_GATHER_BUFFERS} gather buffers ({format_bytes(gather_bytes)}, outside the "
            "arena) out of the budget; the device peak includes both")


def data_parallel(report: Report, gpus: int, nodes: int, intra: str | Link, inter: str | Link,
                  micro_batches: int = 1, no_sync: bool = False, grad_reduce: str = "auto",
                  gloo_intra: str | Link = "loopback", share_host_copy: str = "auto") -> dict:
    """The data-parallel figures of ``report``'s model and budget on ``gpus`` GPUs over ``nodes`` nodes, with
    ``micro_batches`` forward and backward passes per step (``no_sync``: all but the last inside
    ``engine.no_sync()``) and ``OffloadConfig.grad_reduce`` as the engine would run it on CUDA ("auto": on the
    device with overlapped updates, else on the host). ``share_host_copy``: "auto" (the engine's default:
    the node's ranks share one host copy of the weights where every rank runs on one node, [Note: one host copy
    per node] in host/node_copy.py), "yes" or "no"."""
    check_accumulation(micro_batches, no_sync)
    try:
        cluster = cluster_of(gpus, nodes, intra, inter)
        gloo = gloo_cluster_of(gpus, nodes, gloo_intra, GLOO_INTER_OF[cluster.inter.name])
    except ValueError as e:
        raise ReportError(f"--gpus/--nodes/--intra/--inter: {e}", usage=True) from None
    r, plan = report.request, report.plan
    lowp = plan.itemsize if r.dtype != torch.float32 else 0
    fp16 = r.dtype == torch.float16
    accumulate = fp16 or micro_batches > 1  # deferred updates, fp32 grad sums on the host
    if grad_reduce not in GRAD_REDUCE:
        raise ReportError(f"--grad-reduce must be one of {', '.join(GRAD_REDUCE)}; got {grad_reduce!r}", usage=True)
    if grad_reduce == "device" and accumulate:
        raise ReportError("--grad-reduce device needs overlapped updates, but float16 and --micro-batches above 1 "
                          "defer them to step() (the engine refuses grad_reduce=\"device\" there too)", usage=True)
    on_device = grad_reduce == "device" or (grad_reduce == "auto" and not accumulate)
    links = (cluster.intra, cluster.inter, gloo.intra, gloo.inter) if cluster.nodes > 1 else (cluster.intra,
                                                                                              gloo.intra)
    # with grads reduced on the device only this rank's shard lands on the host: no landing grad there
    if share_host_copy not in ("auto", "yes", "no"):
        raise ReportError(f"--share-host-copy must be auto, yes or no; got {share_host_copy!r}", usage=True)
    if share_host_copy == "yes" and cluster.nodes > 1 and cluster.gpus_per_node == 1:
        raise ReportError("--share-host-copy yes: with one GPU per node there is nothing to share (the engine "
                          "raises with share_host_copy=True there)", usage=True)
    # [Note: one host copy per host]: one copy per node wherever a node runs several ranks
    shared = share_host_copy != "no" and cluster.gpus_per_node > 1
    per_rank = runtime_host_bytes_per_rank(plan.buckets, plan.itemsize, cluster.world, accumulate,
                                           landing=not on_device, own_copy=not shared)
    node_copy = node_copy_layout(plan.buckets, plan.itemsize)[1] if shared else 0
    out = {
        "gpus": cluster.world, "nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
        "intra": cluster.intra.name, "inter": cluster.inter.name if cluster.nodes > 1 else None,
        "gloo_intra": gloo.intra.name, "gloo_inter": gloo.inter.name if cluster.nodes > 1 else None,
        "links": {x.name: x.source for x in links},
        "simulated": "cost model on nominal link presets, not measured",
        "runs": "runtime: the flat keys are the path the engine runs with grad_reduce (the key; by default on "
                "CUDA, overlapped: grads reduce-scattered on the device, a shard to the host; deferred: every "
                "collective on the host) and host_copy (the key; by default shared on one node: each rank writes "
                "its updated shard into the node's one copy, a check per backward, no all-gather of the weights; "
                "per rank: the updated shards all-gathered, on the device with grad_reduce device, else by gloo); "
                "*_design keys are issue 20's design (weights gathered on the device at each fetch), which does "
                "not run",
        # [Note: the runtime's shared host copy]: "shared" (one copy per node, a check per backward instead of
        # any all-gather of the weights) or "per rank" (each rank's own copy, all-gathered)
        "host_copy": "shared" if shared else "per rank",
        "host_bytes_per_rank": per_rank, "host_bytes_per_node": cluster.gpus_per_node * per_rank + node_copy,
        "host_shared_bytes_per_node": node_copy,  # [Note: one host copy per node]: 0 where each rank keeps its own
        "host_bytes_per_rank_design": host_bytes_per_rank(plan.buckets, lowp, cluster, accumulate),
        "host_bytes_per_node_design": host_bytes_per_node(plan.buckets, lowp, cluster, accumulate),
        "fits": False, "device_peak_bytes_per_rank": None, "predicted_step_s": None, "tokens_per_s": None,
        "all_gather_busy_s": None, "reduce_scatter_busy_s": None, "check_busy_s": None, "runtime_note": None,
        "runtime_path": "deferred" if accumulate else "overlapped", "micro_batches": micro_batches,
        "no_sync": no_sync, "all_reduce_busy_s": None, "accumulate_busy_s": None,
        "grad_reduce": "device" if on_device else "host", "device_reduce_busy_s": None,
        "device_gather_busy_s": None, "weight_gather_bytes_per_rank": None, "device_peak_note": None,
        "design_note": DESIGN_ONE_BACKWARD if micro_batches > 1 else None,  # fits_design None then: not known
        "fits_design": False if micro_batches == 1 else None, "device_peak_bytes_per_rank_design": None,
        "predicted_step_s_design": None,
        "tokens_per_s_design": None, "all_gather_busy_s_design": None, "reduce_scatter_busy_s_design": None,
        "zero_offload_step_s": None,
    }
    if not report.fits:
        return out
    tokens = cluster.world * r.batch * r.seq * micro_batches
    run_plan: Plan | None = plan
    if on_device:  # the engine's plan on this path: padded grad slots, any gather buffers out of the budget
        gathered = not shared or cluster.nodes > 1  # over several nodes the column's shards come back from it
        buckets, fixed = device_reduce_plan_inputs(plan.buckets, plan.itemsize, cluster.world, plan.fixed_bytes,
                                                   not gathered)
        gather = weight_gather_bytes(buckets, plan.itemsize) if gathered else 0
        out.update(weight_gather_bytes_per_rank=gather, device_peak_note=device_peak_note(gather))
        try:
            run_plan = build_plan(plan.trace, buckets, itemsize=plan.itemsize, budget_bytes=r.budget_bytes,
                                  fixed_bytes=fixed, hw=r.hw, compute_s=report.compute_s,
                                  headroom_bytes=plan.headroom_bytes)
        except BudgetTooSmallError as e:
            what = "the gather buffers and padded grad slots" if gathered else "padded grad slots"
            out.update(runtime_note=f"grad_reduce=\"device\" does not fit the budget: with {what} it needs at "
                                    f"least {format_bytes(e.min_budget_bytes)}")
            run_plan = None
    if run_plan is not None:
        out.update(fits=True, device_peak_bytes_per_rank=run_plan.peak_bytes)
        if accumulate:  # updates deferred to step() ([Note: the runtime's deferred data-parallel step])
            rt = simulate_runtime_deferred_plan(run_plan, r.hw, gloo, report.compute_s, micro_batches=micro_batches,
                                                no_sync=no_sync, shared=shared)
            out.update(runtime_note=deferred_note(fp16, micro_batches, no_sync, "shared" if shared else "per rank"))
        else:
            rt = simulate_runtime_plan(run_plan, r.hw, gloo, report.compute_s, device=cluster if on_device else None,
                                       shared=shared)
        out.update(predicted_step_s=rt.step_s, tokens_per_s=tokens / rt.step_s,
                   device_reduce_busy_s=rt.device_reduce_busy_s, device_gather_busy_s=rt.device_gather_busy_s,
                   all_gather_busy_s=rt.all_gather_busy_s, reduce_scatter_busy_s=rt.reduce_scatter_busy_s,
                   check_busy_s=rt.check_busy_s, all_reduce_busy_s=rt.all_reduce_busy_s,
                   accumulate_busy_s=rt.accumulate_busy_s)
    if micro_batches > 1:
        return out  # DESIGN_ONE_BACKWARD
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


def runtime_host_bytes_per_rank(buckets, device_itemsize: int, world: int, accumulate: bool,
                                landing: bool = True, own_copy: bool = True) -> int:
    """The pinned host arena one rank of ``world`` allocates for ``buckets`` ([Note: host shards]: every rank's
    shards have the same size, so every rank's arena is this size). ``landing``: False where grads are
    reduce-scattered on the device (only the shard lands on the host). ``own_copy``: False where the node's
    ranks share one copy of the weights (outside the arena: ``node_copy_layout``)."""
    shards = [shard_of(b.trainable_numel, 0, world) for b in buckets]
    return shard_layout(buckets, shards, world, device_itemsize, accumulate, landing, own_copy).total_bytes


def render_data_parallel(dp: dict, console: Console) -> None:
    k = dp["micro_batches"]
    steps = (f", {k} micro-batches a step" + (" (no_sync on all but the last)" if dp["no_sync"] else "")
             if k > 1 else "")
    t = Table(title=f"data parallel on {dp['gpus']} GPUs ({dp['nodes']} node(s) x {dp['gpus_per_node']}){steps}: "
                    "SIMULATED, link presets")
    t.add_column("")
    t.add_column("runtime path (what runs)", justify="right")
    t.add_column("design path (issue 20, not run)", justify="right")
    nccl = dp["intra"] + (f" + {dp['inter']}" if dp["inter"] else "")
    gloo = "gloo on the host: " + dp["gloo_intra"] + (f" + {dp['gloo_inter']}" if dp["gloo_inter"] else "")
    shared = dp["host_copy"] == "shared"
    several = dp["nodes"] > 1  # a shared copy over several nodes still gathers its column's shards
    if dp["grad_reduce"] == "device":
        where = (f"grads NCCL on the device ({nccl}), checks {gloo}" if shared and not several
                 else f"grads and weights NCCL on the device ({nccl}), checks {gloo}")
    else:
        where = gloo + ((" (grads, weights over the nodes; a check)" if several else " (grads; weights: a check)")
                        if shared else "")
    t.add_row("collectives", where, "NCCL on the device: " + nccl)
    t.add_row("host copy of the weights", "one shared by the node's ranks" if shared else "one per rank",
              "one per node")
    design = dp["design_note"] is None  # else: not modelled (the note says why)
    gather = dp["weight_gather_bytes_per_rank"]
    t.add_row("device peak per rank" + (" (with the gather buffers)" if gather else ""),
              _bytes(dp["device_peak_bytes_per_rank"]),
              _bytes(dp["device_peak_bytes_per_rank_design"]) if design else "not modelled")
    if gather:
        t.add_row("  of which weights' gather buffers", format_bytes(gather), "")
    t.add_row("pinned host per rank", format_bytes(dp["host_bytes_per_rank"]),
              format_bytes(dp["host_bytes_per_rank_design"]))
    t.add_row("pinned host per node" + (" (one shared copy)" if dp["host_shared_bytes_per_node"] else ""),
              format_bytes(dp["host_bytes_per_node"]),
              format_bytes(dp["host_bytes_per_node_design"]))
    t.add_row("step (with collectives)", _seconds(dp["predicted_step_s"]),
              _seconds(dp["predicted_step_s_design"]) if design else "not modelled")
    t.add_row("tokens/s (all ranks)", _rate(dp["tokens_per_s"]), _rate(dp["tokens_per_s_design"]))
    on_device = dp["grad_reduce"] == "device"  # the collectives row says where they run
    reduce = dp["device_reduce_busy_s"] if on_device else dp["reduce_scatter_busy_s"]
    t.add_row("all-gather / reduce-scatter busy",
              (f"none / {reduce:.3f} s" if reduce is not None else "-") if shared and not several
              else _pair(dp["device_gather_busy_s"], reduce) if on_device else _pair(dp["all_gather_busy_s"], reduce),
              _pair(dp["all_gather_busy_s_design"], dp["reduce_scatter_busy_s_design"]))
    if dp["check_busy_s"] is not None:  # with a shared copy, one more per backward
        t.add_row("checks busy (gloo, CPU lane)", f"{dp['check_busy_s']:.4f} s", "")
    if dp["runtime_path"] == "deferred" and dp["all_reduce_busy_s"] is not None:
        t.add_row("all-reduce busy (every synced backward)" if k > 1 else "all-reduce per backward busy",
                  f"{dp['all_reduce_busy_s']:.3f} s", "")
    if dp["zero_offload_step_s"] is not None:
        t.add_row("ZeRO-Offload's DP rule, step", "", f"{dp['zero_offload_step_s']:.3f} s"
                  + ("" if dp["zero_offload_fits"] else " (over the budget)"))
    console.print(t)
    if dp["runtime_note"]:
        console.print(f"  runtime path: {dp['runtime_note']}")
    if dp["device_peak_note"]:
        console.print(f"  runtime path's device peak: {dp['device_peak_note']}")
    if dp["design_note"]:
        console.print(f"  design path: {dp['design_note']}")
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
