"""What ``offload report`` reports on (:class:`Request`) and the model it names, built on the ``meta`` device:
a preset, a ``module:factory`` or a transformers config class, each with a ``run(model) -> loss`` that feeds
it inputs of the requested shape, attention running as a fused kernel."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import ReportError
from ..planning.hw import HardwareModel
from .presets import MODELS, preset_inputs


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
    bucket_bytes: int | str  # bytes, or "auto" (resolved by the report as the engine does)
    config: str | None = None

    def __post_init__(self) -> None:
        if self.batch < 1 or self.seq < 1:
            raise ReportError(f"--batch and --seq must be >= 1; got {self.batch} and {self.seq}", usage=True)


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
