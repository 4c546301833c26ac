"""``offload report``: will this model train on this GPU under this budget, how much host RAM does it need,
and how fast will a step be? Answered without a GPU and without weights.

The model is built on the ``meta`` device and one forward + backward is traced there
(:func:`offload.tools.metatrace.trace_meta`: the engine's events, saved-activation bytes, roofline compute
estimates). Then exactly what the engine does after its warm-up step is done to that trace: parameters are
packed into buckets (:func:`offload.planning.buckets.make_buckets`), the plan comes from
:func:`offload.planning.schedule.build_plan` (the engine's one planner; its simulator gives the step time), and the
host arena layout from :func:`offload.planning.buckets.host_layout`. The baselines are
:mod:`offload.tools.baselines` on the same trace and buckets. The model and the request:
``report_model.py``; activation counts per block and the analytic estimate: ``report_activations.py``.

What is *estimated* rather than traced, and labelled so in the output: compute times (a per-operator
roofline on the hardware model's assumed device throughput), the activation bytes under the engine's
``activation_checkpointing="auto"`` (its own estimate and choice rules, :mod:`offload.planning.activations`, on
per-block bytes counted on the meta device), and the host bytes of the baselines (their per-parameter
rules).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..errors import BudgetTooSmallError, InvariantError, ReportError
from ..host.state import HOST_RAM_HEADROOM
from ..planning.activations import ActivationProfile, CheckpointChoice, activation_bytes, choose_checkpoints
from ..planning.checkpoint_choice import TimedChoice, choose_by_step_time
from ..planning.buckets import GRAD_RING_SLOTS, grad_ring_chunk_bytes, host_layout, make_buckets, resolve_bucket_bytes
from ..planning.placement import placement_bound, placement_bytes
from ..runtime.device_optim import read_after_update
from ..planning.plan import BufferKind, Plan, align
from ..planning.schedule import build_plan, forward_min_budget, plan_bound
from .baselines import Case, gemini_cpu, zero3_offload, zero_offload
from .metatrace import MetaTrace, trace_meta
from .report_activations import AnalyticShape, analytic_trace, measure_activations
from .report_model import Build, FusedAttention, Request, model_source

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Host bytes per parameter under each baseline's placement rule (not measured; what each system keeps on the
# host for a trainable parameter with mixed precision and Adam): DeepSpeed ZeRO-Offload keeps fp32 master,
# fp32 grads and Adam m, v on the host (16); ZeRO-3 with offload_param adds the fp16 parameter (18);
# Gemini with CPU placement keeps fp16 parameter chunks (grads reuse them), fp32 masters and m, v (14).
BASELINE_HOST_BYTES_PER_PARAM = {"zero-offload": 16, "zero3-offload": 18, "gemini-cpu": 14}
BASELINES = {"zero-offload": zero_offload, "zero3-offload": zero3_offload, "gemini-cpu": gemini_cpu}

BREAKDOWN = ("params", "grads", "master_weights", "adam_m", "adam_v", "lowp_staging", "activations", "workspace")
"""Rows of the memory breakdown (keys of ``gpu_bytes`` / ``host_bytes``, each with a ``total``)."""


# ---------------------------------------------------------------------------------------------------------
# the report


@dataclass(frozen=True)
class Fix:
    change: str  # "activation_checkpointing", "batch", "seq" or "budget"
    value: int  # the new batch, seq or budget bytes; for checkpointing, how many blocks "auto" would pick
    min_budget_bytes: int  # what the device then needs
    estimated: bool = False  # True where the activation bytes are an estimate, not traced
    of: int | None = None  # checkpointing: of how many blocks
    fewest: int | None = None  # checkpointing: the fewest blocks that fit ("auto" may pick more: a faster plan)

    def to_json(self) -> dict:
        out = {"change": self.change, "value": self.value, "min_budget_bytes": self.min_budget_bytes,
               "estimated": self.estimated}
        if self.of is not None:
            out["blocks"] = self.of
        if self.fewest is not None:
            out["fewest_blocks"] = self.fewest
        return out


@dataclass(frozen=True)
class Report:
    request: Request
    source: str
    params: int
    trainable_params: int
    gpu_bytes: dict[str, int]
    host_bytes: dict[str, int]
    fits: bool
    min_budget_bytes: int
    overflow: str | None  # what does not fit: "activations" or "weights" (params, grads, buffers); None
    plan: Plan  # the plan at the budget, or at the minimum budget when the budget is too small
    activations: ActivationProfile | None  # per-block counts, taken only when the activations overflow
    fixes: tuple[Fix, ...]
    baselines: dict[str, dict[str, Any]]
    lanes_s: dict[str, float] = field(default_factory=dict)
    bound: str | None = None
    bound_s: float | None = None  # the physical lower bound of a step with this trace, buckets, budget
    # the same over every placement that fits (optimizer state on the device too: [Note: the placement bound])
    bound_placement_s: float | None = None
    activations_source: str = "meta trace"  # or "analytic estimate (...)" where the model cannot run on meta
    compute_s: tuple[float, ...] = ()  # per trace event: the estimated compute seconds the plan was simulated with
    module_names: tuple[str, ...] = ()  # model.named_modules() order: the trace's module keys (for timelines)
    # the planner's plan with optimizer state allowed on the device (issue 18): predicted step and bytes per
    # placement tier: what the engine runs with ``OffloadConfig(device_optimizer=True)`` (``plan``: without)
    device_optimizer_plan: dict | None = None
    bucket_bytes: int = 0  # the bucket size used (``request.bucket_bytes``, "auto" resolved as the engine does)

    @property
    def checkpointed_activation_bytes(self) -> int | None:
        """Estimated activation peak with every block checkpointed (the engine's estimate rule)."""
        if self.activations is None or not self.activations.blocks:
            return None
        return activation_bytes(self.activations, [b.module for b in self.activations.blocks])

    @property
    def host_needed_bytes(self) -> int:
        return int(self.host_bytes["total"] * HOST_RAM_HEADROOM)

    @property
    def host_fits(self) -> bool:
        return self.host_needed_bytes <= self.request.host_ram_bytes

    @property
    def predicted_step_s(self) -> float | None:
        return self.plan.simulated.step_s if self.fits and self.plan.simulated is not None else None

    @property
    def tokens_per_s(self) -> float | None:
        s = self.predicted_step_s
        return self.request.batch * self.request.seq / s if s else None

    def to_json(self) -> dict:
        r = self.request
        summary = self.plan.summary()
        return {
            "model": r.model, "source": self.source, "batch": r.batch, "seq": r.seq,
            "dtype": next(k for k, v in DTYPES.items() if v == r.dtype),
            "hw": r.hw.name, "hw_measured": r.hw.measured, "budget_bytes": r.budget_bytes,
            "bucket_bytes": self.bucket_bytes,
            "params": self.params, "trainable_params": self.trainable_params,
            "gpu_bytes": dict(self.gpu_bytes), "host_bytes": dict(self.host_bytes),
            "fits": self.fits, "min_budget_bytes": self.min_budget_bytes, "overflow": self.overflow,
            "host_bytes_per_param": self.host_bytes["total"] / self.params,
            "host_ram_bytes": r.host_ram_bytes, "host_ram_source": r.host_ram_source,
            "host_needed_bytes": self.host_needed_bytes, "host_fits": self.host_fits,
            "plan": summary if self.fits else None,
            "predicted_step_s": self.predicted_step_s, "tokens_per_s": self.tokens_per_s,
            "bound": self.bound if self.fits else None, "bound_s": self.bound_s if self.fits else None,
            "bound_placement_s": self.bound_placement_s if self.fits else None,
            "device_optimizer_plan": self.device_optimizer_plan if self.fits else None,
            "lanes_s": dict(self.lanes_s) if self.fits else None,
            "checkpointed_activation_bytes": self.checkpointed_activation_bytes,
            "fixes": [f.to_json() for f in self.fixes],
            "baselines": self.baselines,
            "activations_source": self.activations_source,
            "estimates": {"compute_s": "per-operator roofline on the hardware model's device figures",
                          "checkpointed_activation_bytes": "per-block rule on the meta trace's block bytes",
                          "baselines.host_bytes": "per-parameter rule of each system"},
        }


def make_report(request: Request, progress: Callable[[str], None] = lambda msg: None) -> Report:
    """Trace, plan and simulate ``request``. Raises :class:`ReportError` for a model it cannot handle."""
    kind, build = model_source(request)
    progress(f"building {request.model} on the meta device")
    model, run = build(request.batch, request.seq)
    fixed = sum(b.numel() * b.element_size() for b in model.buffers())  # the engine keeps buffers as built
    model = model.to(request.dtype)
    params = sum(p.numel() for p in model.parameters())
    if params == 0:
        raise ReportError(f"{request.model} has no parameters: there is nothing to offload")
    progress(f"tracing one training step of {request.model} (batch {request.batch}, seq {request.seq})")
    analytic = None
    try:
        mt = _trace(model, run, request)
    except ReportError as e:
        analytic = AnalyticShape.of(model)
        if analytic is None:
            raise ReportError(f"{e}; no analytic estimate applies either (it needs repeated transformer-like "
                              "blocks in an nn.ModuleList/nn.Sequential)") from None
        progress(f"the meta device cannot run {request.model}: using the analytic estimate")
        mt = analytic_trace(model, analytic, request)
    itemsize = request.dtype.itemsize
    bucket_bytes = resolve_bucket_bytes(request.bucket_bytes, mt.specs, itemsize, request.hw)
    buckets = make_buckets(list(mt.specs), list(mt.order), bucket_bytes, itemsize)
    compute = mt.compute_s(request.hw)
    progress("planning")
    min_budget = min_budget_bytes(mt, buckets, itemsize, fixed)
    fits = min_budget <= request.budget_bytes
    # the engine's default: updates overlapped with backward and their refreshes pipelined into the next forward
    # ([Note: the refresh pipelined, modelled] in planning/simulate.py), except float16's, deferred to step()
    pipelined = request.dtype != torch.float16
    plan = build_plan(mt.trace, buckets, itemsize=itemsize, budget_bytes=max(request.budget_bytes, min_budget),
                      fixed_bytes=fixed, hw=request.hw, compute_s=compute,
                      refresh_pipelined=pipelined)  # (at min_budget it always fits)
    weights_side = min_budget - mt.trace.activation_peak_bytes
    overflow = None if fits else ("weights" if weights_side > request.budget_bytes else "activations")
    device_plan = None
    if fits:  # where the budget leaves room, optimizer state on the device (issue 18)
        dev = build_plan(mt.trace, buckets, itemsize=itemsize, budget_bytes=request.budget_bytes, fixed_bytes=fixed,
                         hw=request.hw, compute_s=compute, device_optimizer=True, refresh_pipelined=pipelined)
        device_plan = {"predicted_step_s": dev.simulated.step_s, "device_optimizer_buckets": len(dev.device_optimizer),
                       "placement_bytes": placement_bytes(dev.buckets, itemsize, dev.placement),
                       "runtime": "what the engine runs with OffloadConfig(device_optimizer=True); `plan` without"}
        # issue 18: device-homed buckets keep no master, copy, m or v on the host ([Note: device-homed buckets])
        lowp_size = itemsize if request.dtype != torch.float32 else 0
        away = frozenset(dev.device_optimizer) - read_after_update(dev)
        device_plan["host_bytes"] = host_layout(buckets, lowp_size, request.dtype == torch.float16,
                                                ring=GRAD_RING_SLOTS, away=away,
                                                chunk_bytes=grad_ring_chunk_bytes(buckets, itemsize)).total_bytes
    acts = None
    if overflow == "activations":  # what per-block checkpointing would save: one more forward, per block
        progress("counting activations per block")
        acts = (measure_activations(model, run) if analytic is None
                else analytic.profile(request.batch, request.seq, request.dtype.itemsize))
    by_step_time = None
    if analytic is None:  # "auto"'s choice by planned step (issue 18), on the meta trace's estimated compute
        timed = dataclasses.replace(mt.trace, seconds=tuple(compute), overhead=())
        plan_at = functools.partial(build_plan, buckets=buckets, itemsize=itemsize,
                                    budget_bytes=request.budget_bytes, fixed_bytes=fixed, hw=request.hw)

        def by_step_time(profile: ActivationProfile, fewest: CheckpointChoice) -> TimedChoice:
            return choose_by_step_time(timed, profile, fewest, plan_at)
    fixes = () if fits else _fixes(request, build, acts, mt.trace.activation_peak_bytes, weights_side, progress,
                                   analytic, by_step_time)
    progress("simulating the baselines")
    case = Case(mt.trace, buckets, itemsize, request.hw, compute, request.budget_bytes, fixed)
    lowp = itemsize if request.dtype != torch.float32 else 0
    # float16 defers updates to step() by default (overlap_optimizer), so its engine keeps room to accumulate
    host = host_breakdown(buckets, lowp, accumulate=request.dtype == torch.float16)
    sim = plan.simulated
    lanes = {"compute": sim.compute_s, "h2d": sim.h2d_busy_s, "d2h": sim.d2h_busy_s, "cpu_adam": sim.adam_s,
             "stall": sim.stall_s}
    bound = max(("compute", sim.compute_s), ("pcie", max(sim.h2d_busy_s, sim.d2h_busy_s)),
                ("cpu_adam", sim.adam_s), key=lambda kv: kv[1])[0]
    return Report(
        request=request, source=kind, params=params, trainable_params=sum(b.trainable_numel for b in buckets),
        gpu_bytes=gpu_breakdown(plan), host_bytes=host, fits=fits, min_budget_bytes=min_budget,
        overflow=overflow, plan=plan, activations=acts, fixes=fixes,
        baselines=_baselines(case, params), lanes_s=lanes, bound=bound,
        bound_s=plan_bound(plan, request.hw, compute).seconds,
        bound_placement_s=placement_bound(mt.trace, buckets, itemsize, plan.capacity_bytes, sum(compute),
                                          request.hw).seconds,
        activations_source="meta trace" if analytic is None else f"analytic estimate ({analytic.describe()})",
        compute_s=tuple(compute), module_names=tuple(name for name, _ in model.named_modules()),
        device_optimizer_plan=device_plan, bucket_bytes=bucket_bytes)


def _trace(model: nn.Module, run, request: Request) -> MetaTrace:
    try:
        return trace_meta(model, run, request.hw)
    except ReportError:
        raise
    except Exception as e:  # the model does something the meta device cannot (e.g. .item() on a tensor)
        raise ReportError(f"cannot trace {request.model} on the meta device ({type(e).__name__}: {e}); "
                          "offload report needs a model whose forward runs on meta tensors") from None


def min_budget_bytes(mt: MetaTrace, buckets, itemsize: int, fixed: int) -> int:
    """The least device budget the engine accepts: the planner's exact minimum (what :func:`build_plan` names
    when asked for a plan that cannot fit: [Note: the tight minimum budget] in ``planning/budget.py``). The
    warm-up forward's check (:func:`offload.planning.schedule.forward_min_budget`) is a floor under it (tested on
    random traces); the max keeps the two consistent should that ever break."""
    t = mt.trace
    first = sum(forward_min_budget(t.events, t.uses, t.ends, buckets, mt.specs, itemsize,
                                   activations=t.activation_peak_bytes, fixed=fixed).values())
    try:
        build_plan(t, buckets, itemsize=itemsize, budget_bytes=1, fixed_bytes=fixed)
    except BudgetTooSmallError as e:
        return max(first, e.min_budget_bytes)
    return first


def gpu_breakdown(plan: Plan) -> dict[str, int]:
    """The planned device peak by part. The arena is split at its busiest event (parameter buffers and
    grad slots live then); the rest of the arena (fragmentation), module buffers and the backend's runtime
    headroom are ``workspace``. The parts add up to :attr:`Plan.peak_bytes`, the planner's own figure."""
    n = len(plan.trace.events)
    diff = {BufferKind.PARAM: [0] * (n + 1), BufferKind.GRAD: [0] * (n + 1)}
    for x in plan.buffers:
        size = align(x.size)
        diff[x.kind][x.start] += size
        diff[x.kind][x.end] -= size
    live_p = live_g = best_p = best_g = 0
    for i in range(n):
        live_p += diff[BufferKind.PARAM][i]
        live_g += diff[BufferKind.GRAD][i]
        if live_p + live_g > best_p + best_g:
            best_p, best_g = live_p, live_g
    t = plan.trace
    out = dict.fromkeys(BREAKDOWN, 0)
    out.update(params=best_p, grads=best_g + t.max_grad_bytes, activations=t.activation_peak_bytes,
               workspace=plan.arena_bytes - best_p - best_g + plan.fixed_bytes + plan.headroom_bytes)
    out["total"] = sum(out.values())
    if out["total"] != plan.peak_bytes:
        raise InvariantError(f"the device breakdown {out} does not add up to the plan's peak {plan.peak_bytes}")
    return out


def host_breakdown(buckets, lowp_itemsize: int, accumulate: bool = False) -> dict[str, int]:
    """The engine's host arena by part (the layout ``HostState`` allocates); alignment padding is
    ``workspace``. Grads are the grad staging ring (room for the few largest buckets in the device dtype) plus
    an fp32 sum per bucket with ``accumulate`` (deferred updates; see [Note: grad staging ring] in
    ``buckets.py``)."""
    numel = sum(b.numel for b in buckets)
    trainable = sum(b.trainable_numel for b in buckets)
    layout = host_layout(buckets, lowp_itemsize, accumulate, ring=GRAD_RING_SLOTS,
                         chunk_bytes=grad_ring_chunk_bytes(buckets, lowp_itemsize or 4))
    out = dict.fromkeys(BREAKDOWN, 0)
    master = trainable if lowp_itemsize else numel  # with a 16-bit copy, frozen parameters have no fp32 master
    ring = layout.ring_bytes
    out.update(master_weights=4 * master, lowp_staging=lowp_itemsize * numel,
               grads=(layout.grad_itemsize + layout.staging_itemsize) * trainable + ring,
               adam_m=4 * trainable, adam_v=4 * trainable)
    total = layout.total_bytes
    out["workspace"] = total - sum(out.values())
    out["total"] = total
    return out


def _baselines(case: Case, params: int) -> dict[str, dict[str, Any]]:
    out = {}
    for name, policy in BASELINES.items():
        r = policy(case)
        out[name] = {"gpu_peak_bytes": r.peak_bytes, "fits": r.fits,
                     "predicted_step_s": r.step_s if r.fits else None,
                     "host_bytes": BASELINE_HOST_BYTES_PER_PARAM[name] * params}
    return out


def _fixes(request: Request, build: Build, acts: ActivationProfile | None, act_bytes: int, weights_side: int,
           progress, analytic: AnalyticShape | None = None,
           by_step_time: Callable[[ActivationProfile, CheckpointChoice], TimedChoice] | None = None
           ) -> tuple[Fix, ...]:
    """Single changes that make the plan fit, most preferred first: when activations overflow, the engine's
    ``activation_checkpointing="auto"`` (its own choice rules: :func:`choose_checkpoints` on the meta counts
    for the fewest blocks that fit, then :func:`choose_by_step_time` on the meta trace; keeps batch and
    sequence), then the largest batch, then the longest sequence that fit; always
    the budget. Batch and sequence are checked by counting the activations of a forward at that shape on
    the meta device, not by scaling."""
    budget = request.budget_bytes
    out = []
    if acts is not None:  # the activations overflow
        choice = choose_checkpoints(acts, budget - weights_side) if acts.blocks else None
        if choice is not None and choice.fits:
            fewest = len(choice.modules)
            if by_step_time is not None:  # as the engine's "auto" chooses: by planned step, from the fewest on
                progress("planning the candidate sets of checkpointed blocks")
                choice = by_step_time(acts, choice).choice
            out.append(Fix("activation_checkpointing", len(choice.modules), weights_side + choice.activation_bytes,
                           estimated=True, of=len(acts.blocks), fewest=fewest))

        def fits_at(batch: int, seq: int) -> int | None:
            if analytic is not None:
                need = weights_side + analytic.activation_bytes(batch, seq, request.dtype.itemsize)
            else:
                model, run = build(batch, seq)
                need = weights_side + measure_activations(model.to(request.dtype), run).peak
            return need if need <= budget else None

        progress("looking for a batch size that fits")
        b = _largest(list(range(1, request.batch)), lambda b: fits_at(b, request.seq))
        if b is not None:
            out.append(Fix("batch", b[0], b[1], estimated=analytic is not None))
        progress("looking for a sequence length that fits")
        step = 64 if request.seq > 64 else 1
        s = _largest(list(range(step, request.seq, step)), lambda s: fits_at(request.batch, s))
        if s is not None:
            out.append(Fix("seq", s[0], s[1], estimated=analytic is not None))
    out.append(Fix("budget", weights_side + act_bytes, weights_side + act_bytes, estimated=analytic is not None))
    return tuple(out)


def _largest(candidates: list[int], need: Callable[[int], int | None]) -> tuple[int, int] | None:
    """Binary search for the largest candidate whose ``need`` is not None (need grows with the value)."""
    lo, hi, best = 0, len(candidates) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        got = need(candidates[mid])
        if got is not None:
            best, lo = (candidates[mid], got), mid + 1
        else:
            hi = mid - 1
    return best


__all__ = ["Request", "Report", "ReportError", "Fix", "make_report", "model_source", "FusedAttention", "AnalyticShape",
           "analytic_trace", "measure_activations", "min_budget_bytes", "gpu_breakdown", "host_breakdown", "DTYPES",
           "BREAKDOWN"]
