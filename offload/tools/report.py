"""``offload report``: will this model train on this GPU under this budget, how much host RAM does it need,
and how fast will a step be? Answered without a GPU and without weights.

The model is built on the ``meta`` device and one forward + backward is traced there
(:func:`offload.tools.metatrace.trace_meta`: the engine's events, saved-activation bytes, roofline compute
estimates). Then exactly what the engine does after its warm-up step is done to that trace: parameters are
packed into buckets (:func:`offload.planning.buckets.make_buckets`), the plan comes from
:func:`offload.planning.schedule.build_plan` (the engine's one planner; its simulator gives the step time), and the
host arena layout from :func:`offload.planning.buckets.host_layout`. The baselines are
:mod:`offload.tools.baselines` on the same trace and buckets.

What is *estimated* rather than traced, and labelled so in the output: compute times (a per-operator
roofline on the hardware model's assumed device throughput), the activation bytes under the engine's
``activation_checkpointing="auto"`` (its own estimate and choice rules, :mod:`offload.planning.activations`, on
per-block bytes counted on the meta device), and the host bytes of the baselines (their per-parameter
rules).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import BudgetTooSmallError, ReportError
from ..host.state import HOST_RAM_HEADROOM
from ..planning.activations import (
    ActivationProfile,
    activation_bytes,
    choose_checkpoints,
    profile_of,
)
from ..planning.buckets import ParamSpec, host_layout, make_buckets
from ..planning.hw import HardwareModel
from ..planning.placement import placement_bound, placement_bytes
from ..planning.schedule import (
    ARENA_ALIGN,
    BufferKind,
    Plan,
    build_plan,
    forward_min_budget,
    plan_bound,
)
from ..planning.trace import Event, EventKind, Trace
from ..runtime.recompute import find_blocks
from .baselines import Case, gemini_cpu, zero3_offload, zero_offload
from .metatrace import MetaTrace, _Counter, _Saved, trace_meta
from .presets import MODELS, preset_inputs

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Host bytes per parameter under each baseline's placement rule (not measured; what each system keeps on the
# host for a trainable parameter with mixed precision and Adam): DeepSpeed ZeRO-Offload keeps fp32 master,
# fp32 grads and Adam m, v on the host (16); ZeRO-3 with offload_param adds the fp16 parameter (18);
# Gemini with CPU placement keeps fp16 parameter chunks (grads reuse them), fp32 masters and m, v (14).
BASELINE_HOST_BYTES_PER_PARAM = {"zero-offload": 16, "zero3-offload": 18, "gemini-cpu": 14}
BASELINES = {"zero-offload": zero_offload, "zero3-offload": zero3_offload, "gemini-cpu": gemini_cpu}

BREAKDOWN = ("params", "grads", "master_weights", "adam_m", "adam_v", "lowp_staging", "activations", "workspace")
"""Rows of the memory breakdown (keys of ``gpu_bytes`` / ``host_bytes``, each with a ``total``)."""


@dataclass(frozen=True)
class Request:
    """What to report on. ``model``: a preset name, ``module:factory``, or a transformers config class
    (``transformers.GPT2Config``) when ``config`` (a JSON file) is given."""

    model: str
    budget_bytes: int
    batch: int
    seq: int
    dtype: torch.dtype
    hw: HardwareModel
    host_ram_bytes: int
    host_ram_source: str  # "given" or "available on this machine"
    bucket_bytes: int
    config: str | None = None

    def __post_init__(self) -> None:
        if self.batch < 1 or self.seq < 1:
            raise ReportError(f"--batch and --seq must be >= 1; got {self.batch} and {self.seq}", usage=True)


# ---------------------------------------------------------------------------------------------------------
# models on the meta device

Build = Callable[[int, int], tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]]
"""(batch, seq) -> (fp32 model on the meta device, run(model) -> loss)."""


def model_source(request: Request) -> tuple[str, Build]:
    """(kind, build) for the request's model; raises :class:`ReportError` for a model it cannot build.
    Attention runs as a fused kernel in every run (see :class:`FusedAttention`)."""
    kind, build = _source(request)

    def fused(batch: int, seq: int):
        model, run = build(batch, seq)

        def run_fused(m):
            with FusedAttention():
                return run(m)
        return model, run_fused
    return kind, fused


class FusedAttention(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` as the fused kernel a GPU (and torch's CPU backend) runs, not the
    math fallback the meta device takes. The math path saves the (seq x seq) attention probabilities in
    fp32 for backward; flash attention saves q, k, v, the output and a (batch, heads, seq) log-sum-exp.
    Without a mask: the flash kernel; with one: the memory-efficient kernel; with ``enable_gqa``: as is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        opts = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"), args[3:])) | kwargs
        mask, p, causal, scale = (opts.get("attn_mask"), opts.get("dropout_p", 0.0), opts.get("is_causal", False),
                                  opts.get("scale"))
        if opts.get("enable_gqa") or q.device.type != "meta":
            return func(*args, **kwargs)
        if mask is None:
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, p, causal, scale=scale)[0]
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)  # same bytes as the additive bias
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask.to(q.dtype).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2]), True, p, causal,
            scale=scale)[0]


def _source(request: Request) -> tuple[str, Build]:
    spec = request.model
    if request.config is not None:
        return "transformers", _transformers_build(spec, request.config)
    if spec in MODELS:
        shape = MODELS[spec]

        def build(batch: int, seq: int):
            try:
                run = preset_inputs(shape, batch, seq)
            except ValueError as e:
                raise ReportError(f"{spec}: {e}", usage=True) from None
            return shape.build("meta", torch.float32), run
        return "preset", build
    if ":" in spec:
        return "factory", _factory_build(spec)
    raise ReportError(f"unknown model {spec!r}: use a preset ({', '.join(MODELS)}), module:factory, or a "
                      "transformers config class with --config FILE", usage=True)


def _factory_build(spec: str) -> Build:
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except ImportError as e:
        raise ReportError(f"cannot import {module_name!r} for --model {spec}: {e}", usage=True) from None
    except AttributeError:
        raise ReportError(f"module {module_name!r} has no {attr!r} (--model {spec})", usage=True) from None
    if not callable(factory):
        raise ReportError(f"{spec} is not callable", usage=True)
    try:
        takes_shape = {"batch", "seq"} <= set(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        takes_shape = False

    def build(batch: int, seq: int):
        try:
            with torch.device("meta"):
                made = factory(batch=batch, seq=seq) if takes_shape else factory()
        except Exception as e:
            raise ReportError(f"the factory {spec} raised {type(e).__name__}: {e}") from None
        model, inputs = made if isinstance(made, tuple) else (made, None)
        if not isinstance(model, nn.Module):
            raise ReportError(f"the factory {spec} returned {type(model).__name__}, not an nn.Module (or a "
                              "(module, inputs) pair)")
        if inputs is None:
            inputs = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        return model.to("meta").float(), _runner(_to_meta(inputs))
    return build


def _transformers_build(class_path: str, config_path: str) -> Build:
    try:
        import transformers
    except ImportError:
        raise ReportError("--config needs the transformers package: pip install 'offload[hf]'",
                          usage=True) from None
    name = class_path.removeprefix("transformers.")
    cls = getattr(transformers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PretrainedConfig)):
        raise ReportError(f"{class_path!r} is not a transformers config class (e.g. transformers.GPT2Config)",
                          usage=True)
    try:
        config = cls.from_json_file(config_path)
    except (OSError, ValueError) as e:
        raise ReportError(f"cannot read the config {config_path}: {e}", usage=True) from None

    def build(batch: int, seq: int):
        with torch.device("meta"):
            try:
                model = transformers.AutoModelForCausalLM.from_config(config)
            except ValueError:  # not a causal LM (an encoder): the bare model, loss = mean of its output
                model = transformers.AutoModel.from_config(config)
        ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        labels = {"labels": ids} if "labels" in inspect.signature(model.forward).parameters else {}
        return model.float(), _runner({"input_ids": ids, **labels})
    return build


def _to_meta(inputs):
    if isinstance(inputs, torch.Tensor):
        return inputs.to("meta")
    if isinstance(inputs, dict):
        return {k: _to_meta(v) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(_to_meta(v) for v in inputs)
    return inputs


def _runner(inputs) -> Callable[[nn.Module], torch.Tensor]:
    """run(model): call the model on ``inputs`` (a tensor, a tuple of args or a dict of kwargs); the loss
    is a scalar output, its ``.loss``, a scalar in an output tuple, or else the mean of the first output."""
    def run(model):
        if isinstance(inputs, dict):
            out = model(**inputs)
        elif isinstance(inputs, (tuple, list)):
            out = model(*inputs)
        else:
            out = model(inputs)
        return _loss(out)
    return run


def _loss(out) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    items = out if isinstance(out, (tuple, list)) else (out.to_tuple() if hasattr(out, "to_tuple") else (out,))
    tensors = [t for t in items if isinstance(t, torch.Tensor)]
    for t in tensors:
        if t.dim() == 0:
            return t
    if not tensors:
        raise ReportError(f"the model returned {type(out).__name__}; expected a tensor, a loss or a tuple")
    return tensors[0].float().mean()


# ---------------------------------------------------------------------------------------------------------
# activations: forward-only counts at other shapes, and per-block checkpointing


def measure_activations(model: nn.Module, run: Callable[[nn.Module], torch.Tensor]) -> ActivationProfile:
    """One forward on the meta device (no backward: saved activations only accumulate in forward), counted
    the way the engine counts them (per storage, inside the root module's forward, parameters excluded),
    per block of ``activation_checkpointing="auto"`` (:func:`offload.runtime.recompute.find_blocks`) too: the
    :class:`~offload.planning.activations.ActivationProfile` the engine's checkpoint planner takes (forward seconds 0:
    not measured here)."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    counter = _Counter()
    names = find_blocks(model)
    modules = list(model.modules())
    saved: dict[int, int] = {}
    inputs: dict[int, int] = {}
    calls: dict[int, tuple[int, float]] = {}
    handles, active, at = [], [], {}

    def pack(t):
        return t if t.untyped_storage()._cdata in params else _Saved(t, counter)

    def unpack(x):
        return x.tensor if isinstance(x, _Saved) else x

    def root_pre(module, args):
        ctx = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        ctx.__enter__()
        active.append(ctx)

    def root_post(module, args, out):
        if active:
            active.pop().__exit__(None, None, None)

    def block_pre(m):
        def hook(module, args):
            at[m] = counter.current
            inputs[m] = inputs.get(m, 0) + sum(a.numel() * a.element_size() for a in args
                                               if isinstance(a, torch.Tensor))
            calls.setdefault(m, (len(calls), 0.0))
        return hook

    def block_post(m):
        def hook(module, args, out):
            saved[m] = saved.get(m, 0) + counter.current - at[m]
        return hook

    handles.append(model.register_forward_pre_hook(root_pre))
    handles.append(model.register_forward_hook(root_post))
    for m in names:
        handles.append(modules[m].register_forward_pre_hook(block_pre(m)))
        handles.append(modules[m].register_forward_hook(block_post(m)))
    try:
        loss = run(model)
        del loss
    finally:
        for h in handles:
            h.remove()
        while active:
            active.pop().__exit__(None, None, None)
    return profile_of(names, saved, inputs, calls, (), forward_end=counter.current, peak=counter.peak)


# ---------------------------------------------------------------------------------------------------------
# the analytic estimate, where the meta device cannot run the model


@dataclass(frozen=True)
class AnalyticShape:
    """What the analytic estimate reads off a model whose forward cannot run on meta tensors (it calls
    ``.item()``, builds data-dependent shapes, ...): its repeated blocks, their width, the largest embedding.

    Saved activations per block follow the transformer rule of Korthikanti et al., "Reducing Activation
    Recomputation in Large Transformer Models" (2022): ``seq * batch * hidden * 34`` bytes with 16-bit
    activations and 1-byte dropout masks, with a fused attention kernel (no ``seq x seq`` term). Here that
    is ``16 * itemsize + 2`` bytes per ``seq * batch * hidden``; the logits add ``seq * batch * vocab``
    elements in the compute dtype plus their fp32 copy for the loss. Compute is ``2 * tokens * params`` FLOPs
    per module in forward and twice that in backward. Labelled as an estimate wherever it is shown."""

    blocks: tuple[int, ...]  # module indices of the repeated blocks
    hidden: int
    vocab: int  # rows of the largest embedding (0: none)

    @staticmethod
    def of(model: nn.Module) -> "AnalyticShape | None":
        blocks = find_blocks(model)
        if not blocks:
            return None
        modules = list(model.modules())
        widths: dict[int, int] = {}
        for m in modules[min(blocks)].modules():
            if isinstance(m, nn.Linear):
                widths[m.in_features] = widths.get(m.in_features, 0) + 1
        embeddings = [m for m in modules if isinstance(m, nn.Embedding)]
        vocab = max((e.num_embeddings for e in embeddings), default=0)
        if widths:  # the most common input width of the block's linear layers (ties: the smaller)
            hidden = min(widths, key=lambda w: (-widths[w], w))
        elif embeddings:
            hidden = max(embeddings, key=lambda e: e.num_embeddings).embedding_dim
        else:
            return None
        return AnalyticShape(tuple(sorted(blocks)), hidden, vocab)

    def describe(self) -> str:
        return (f"{len(self.blocks)} blocks of width {self.hidden}, vocabulary {self.vocab}: 34 bytes per token "
                "and width per block at 16 bits (Korthikanti et al. 2022) plus the logits")

    def block_bytes(self, batch: int, seq: int, itemsize: int) -> int:
        return batch * seq * self.hidden * (16 * itemsize + 2)

    def activation_bytes(self, batch: int, seq: int, itemsize: int) -> int:
        logits = batch * seq * self.vocab * (itemsize + 4)
        return len(self.blocks) * self.block_bytes(batch, seq, itemsize) + logits

    def profile(self, batch: int, seq: int, itemsize: int) -> ActivationProfile:
        """The per-block profile the engine's checkpoint rule takes, from the same rule (forward seconds 0)."""
        inputs = batch * seq * self.hidden * itemsize
        names = {m: str(m) for m in self.blocks}
        saved = {m: self.block_bytes(batch, seq, itemsize) for m in self.blocks}
        calls = {m: (i, 0.0) for i, m in enumerate(self.blocks)}
        total = self.activation_bytes(batch, seq, itemsize)
        return profile_of(names, saved, {m: inputs for m in self.blocks}, calls, (), forward_end=total, peak=total)


def analytic_trace(model: nn.Module, shape: AnalyticShape, request: Request) -> MetaTrace:
    """A trace in the engine's terms, built from the module tree instead of running it: each module that owns
    parameters is called once, in registration order (PRE with its parameters, POST), and backward meets
    them in reverse (UNPACK with its parameters, then GRAD for each parameter whose last reader that was).
    Activation bytes and compute are :class:`AnalyticShape`'s rules."""
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    owners = [(mi, [index[id(p)] for p in m.parameters(recurse=False)]) for mi, m in enumerate(model.modules())]
    owners = [(mi, ps) for mi, ps in owners if ps]
    itemsize = request.dtype.itemsize
    tokens = request.batch * request.seq
    events: list[Event] = []
    uses: list[tuple[int, ...]] = []
    ends: list[int] = []
    ops: list[tuple[tuple[float, int], ...]] = []

    def add(kind, key, used=(), flops=0.0, nbytes=0, end=None):
        events.append(Event(kind, key))
        uses.append(tuple(used))
        ends.append(len(events) if end is None else end)
        ops.append(((flops, nbytes),) if flops or nbytes else ())

    def size(ps):
        n = sum(params[p].numel() for p in ps)
        return n, n * itemsize

    for mi, ps in owners:
        n, nb = size(ps)
        add(EventKind.PRE, mi, ps, 2.0 * tokens * n, nb + 2 * tokens * shape.hidden * itemsize)
        ends[-1] = len(events)  # the POST that follows
        add(EventKind.POST, mi)
    num_forward = len(events)
    last_reader = {}
    for k, (mi, ps) in enumerate(reversed(owners)):
        for p in ps:
            last_reader[p] = k
    for k, (mi, ps) in enumerate(reversed(owners)):
        n, nb = size(ps)
        add(EventKind.UNPACK, ps[0], ps, 4.0 * tokens * n, 2 * nb + 4 * tokens * shape.hidden * itemsize)
        for p in ps:
            if last_reader[p] == k and params[p].requires_grad:
                add(EventKind.GRAD, p)
    touched = tuple(dict.fromkeys(p for _, ps in owners for p in ps))
    max_grad = max((p.numel() * itemsize for p in params if p.requires_grad), default=0)
    base = Trace(tuple(events), num_forward, tuple(uses), tuple(ends), touched,
                 shape.activation_bytes(request.batch, request.seq, itemsize), max_grad, (0.0,) * len(events))
    flops = sum(f for op in ops for f, _ in op)
    mt = MetaTrace(base, (), (), 0, flops, tuple(ops))
    trace = Trace(base.events, base.num_forward, base.uses, base.ends, base.touched, base.activation_peak_bytes,
                  base.max_grad_bytes, seconds=mt.compute_s(request.hw))
    specs = tuple(ParamSpec(p.numel(), 0 if p.requires_grad else None) for p in params)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    return MetaTrace(trace, specs, touched + tuple(p for p in range(len(params)) if p not in set(touched)),
                     buffer_bytes, flops, tuple(ops))


# ---------------------------------------------------------------------------------------------------------
# the report


@dataclass(frozen=True)
class Fix:
    change: str  # "activation_checkpointing", "batch", "seq" or "budget"
    value: int  # the new batch, seq or budget bytes; for checkpointing, how many blocks "auto" would pick
    min_budget_bytes: int  # what the device then needs
    estimated: bool = False  # True where the activation bytes are an estimate, not traced
    of: int | None = None  # checkpointing: of how many blocks

    def to_json(self) -> dict:
        out = {"change": self.change, "value": self.value, "min_budget_bytes": self.min_budget_bytes,
               "estimated": self.estimated}
        if self.of is not None:
            out["blocks"] = self.of
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
    # placement tier. The runtime cannot execute such a plan yet; ``plan`` is what it runs
    device_optimizer_plan: dict | None = None

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
            "bucket_bytes": r.bucket_bytes,
            "params": self.params, "trainable_params": self.trainable_params,
            "gpu_bytes": dict(self.gpu_bytes), "host_bytes": dict(self.host_bytes),
            "fits": self.fits, "min_budget_bytes": self.min_budget_bytes, "overflow": self.overflow,
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
    buckets = make_buckets(list(mt.specs), list(mt.order), request.bucket_bytes, itemsize)
    compute = mt.compute_s(request.hw)
    progress("planning")
    min_budget = min_budget_bytes(mt, buckets, itemsize, fixed)
    fits = min_budget <= request.budget_bytes
    plan = build_plan(mt.trace, buckets, itemsize=itemsize, budget_bytes=max(request.budget_bytes, min_budget),
                      fixed_bytes=fixed, hw=request.hw, compute_s=compute)  # (at min_budget it always fits)
    weights_side = min_budget - mt.trace.activation_peak_bytes
    overflow = None if fits else ("weights" if weights_side > request.budget_bytes else "activations")
    device_plan = None
    if fits:  # where the budget leaves room, optimizer state on the device (planner only, issue 18)
        dev = build_plan(mt.trace, buckets, itemsize=itemsize, budget_bytes=request.budget_bytes, fixed_bytes=fixed,
                         hw=request.hw, compute_s=compute, device_optimizer=True)
        device_plan = {"predicted_step_s": dev.simulated.step_s, "device_optimizer_buckets": len(dev.device_optimizer),
                       "placement_bytes": placement_bytes(dev.buckets, itemsize, dev.placement),
                       "runtime": "not executable yet (issue 18): the runtime runs `plan`"}
    acts = None
    if overflow == "activations":  # what per-block checkpointing would save: one more forward, per block
        progress("counting activations per block")
        acts = (measure_activations(model, run) if analytic is None
                else analytic.profile(request.batch, request.seq, request.dtype.itemsize))
    fixes = () if fits else _fixes(request, build, acts, mt.trace.activation_peak_bytes, weights_side, progress,
                                   analytic)
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
        device_optimizer_plan=device_plan)


def _trace(model: nn.Module, run, request: Request) -> MetaTrace:
    try:
        return trace_meta(model, run, request.hw)
    except ReportError:
        raise
    except Exception as e:  # the model does something the meta device cannot (e.g. .item() on a tensor)
        raise ReportError(f"cannot trace {request.model} on the meta device ({type(e).__name__}: {e}); "
                          "offload report needs a model whose forward runs on meta tensors") from None


def min_budget_bytes(mt: MetaTrace, buckets, itemsize: int, fixed: int) -> int:
    """The least device budget the engine accepts: the larger of its two checks, the one at the end of the
    warm-up forward (:func:`offload.planning.schedule.forward_min_budget`) and the planner's (every bucket streamed
    just in time: what :func:`build_plan` reports when asked for a plan that cannot fit)."""
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
        size = -(-x.size // ARENA_ALIGN) * ARENA_ALIGN
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
    assert out["total"] == plan.peak_bytes, (out, plan.peak_bytes)
    return out


def host_breakdown(buckets, lowp_itemsize: int, accumulate: bool = False) -> dict[str, int]:
    """The engine's host arena by part (the layout ``HostState`` allocates); alignment padding is
    ``workspace``. Grads are what the device's grad copies land in, in the device dtype, plus an fp32 sum with
    ``accumulate`` (deferred updates; see [Note: host grads] in ``buckets.py``)."""
    numel = sum(b.numel for b in buckets)
    trainable = sum(b.trainable_numel for b in buckets)
    layout = host_layout(buckets, lowp_itemsize, accumulate)
    out = dict.fromkeys(BREAKDOWN, 0)
    master = trainable if lowp_itemsize else numel  # with a 16-bit copy, frozen parameters have no fp32 master
    out.update(master_weights=4 * master, lowp_staging=lowp_itemsize * numel,
               grads=(layout.grad_itemsize + layout.staging_itemsize) * trainable,
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
           progress, analytic: AnalyticShape | None = None) -> tuple[Fix, ...]:
    """Single changes that make the plan fit, most preferred first: when activations overflow, the engine's
    ``activation_checkpointing="auto"`` (its own choice rule, :func:`choose_checkpoints`, on the meta
    counts; keeps batch and sequence), then the largest batch, then the longest sequence that fit; always
    the budget. Batch and sequence are checked by counting the activations of a forward at that shape on
    the meta device, not by scaling."""
    budget = request.budget_bytes
    out = []
    if acts is not None:  # the activations overflow
        choice = choose_checkpoints(acts, budget - weights_side) if acts.blocks else None
        if choice is not None and choice.fits:
            out.append(Fix("activation_checkpointing", len(choice.modules), weights_side + choice.activation_bytes,
                           estimated=True, of=len(acts.blocks)))

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


__all__ = ["Request", "Report", "ReportError", "Fix", "make_report", "model_source", "AnalyticShape", "analytic_trace",
           "measure_activations", "min_budget_bytes", "gpu_breakdown", "host_breakdown", "DTYPES", "BREAKDOWN"]
