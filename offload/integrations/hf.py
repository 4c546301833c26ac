"""``OffloadTrainer``: a ``transformers.Trainer`` whose model trains through an offload engine.

    from .hf import OffloadTrainer
    trainer = OffloadTrainer(model=model, args=TrainingArguments(...), train_dataset=ds, offload_budget="8GiB")
    trainer.train()          # trainer.evaluate(), trainer.save_model(), trainer.train(resume_from_checkpoint=...)

The Trainer's loop is kept; what changes is who owns the parameters. The engine is made in ``__init__`` (so
``evaluate()`` before ``train()`` already runs offloaded), from an ``offload.AdamW`` built the way
``Trainer.create_optimizer`` builds its AdamW (the same two param groups: weight decay on, and off for
biases and norms). Then:

* ``training_step`` runs ``compute_loss`` as the Trainer does and ``engine.backward`` on the loss (float16
  loss scaling is the engine's; accelerate's autocast and GradScaler are off: the engine computes in
  ``bf16``/``fp16`` itself);
* clipping is ``engine.clip_grad_norm_``, which reads the per-parameter norms the engine computed as the
  grads arrived instead of making a pass over ``p.grad`` as the Trainer's own clip does (clipping turns
  ``overlap_optimizer`` off, so ``p.grad`` does show the host's sums: README, *Plain PyTorch calls*; the
  Trainer's own clip through accelerate and ``torch.nn.utils.clip_grad_norm_`` on ``p.grad``, for a subclass
  that puts it back, gives the same numbers bit for bit: tests/test_integrations_hf.py);
* checkpoints hold ``offload.pt`` (``engine.save``: fp32 masters, AdamW state, loss scale) beside the
  Trainer's files; ``model.safetensors`` holds the real fp32 weights (``engine.state_dict()``), so
  ``from_pretrained`` on a saved folder works without offload.

See [Note: what the Trainer must not do to an offloaded model].
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any

import torch
from torch import nn

try:
    import transformers
    from transformers import Trainer
except ImportError as e:  # the hf extra is optional
    raise ImportError('offload.integrations.hf needs transformers and accelerate: pip install "offload[hf]"') from e

from ..api import Engine, wrap
from ..config import OffloadConfig
from ..errors import OffloadError
from ..optim import AdamW

OFFLOAD_CHECKPOINT = "offload.pt"  # engine.save() file inside each checkpoint-N folder
SCHEDULER_NAME = "scheduler.pt"  # the Trainer's name for the LR scheduler state

# [Note: what the Trainer must not do to an offloaded model]
# After wrap(), parameters are placeholders between steps and the engine places the weights itself. So the
# Trainer must not move the model (``_move_model_to_device``, accelerate's device placement), cast it
# (``bf16_full_eval``), wrap it (DataParallel, DDP, FSDP, DeepSpeed, torch.compile), read or write weights
# through ``model.state_dict()`` (save and resume go through the engine), or compute norms from ``p.grad``.
# Each override below removes one of those; what cannot be removed is refused up front.

_OPTIMS = {"adamw_torch": False, "adamw_torch_fused": None}
"""Accepted ``TrainingArguments.optim`` -> ``offload.AdamW(fused=...)``. ``adamw_torch`` (torch's per-tensor
AdamW) runs torch's own ops, bit for bit ``torch.optim.AdamW(foreach=False)``; ``adamw_torch_fused`` (the
Trainer's default) runs the engine's fused C++ AdamW (torch's numerics within 1-2 ulp of the master)."""


class UnsupportedTrainingArgumentError(OffloadError, ValueError):
    """A ``TrainingArguments`` setting (or Trainer argument) that ``OffloadTrainer`` cannot honour."""


class OffloadTrainer(Trainer):
    """A ``transformers.Trainer`` that trains ``model`` through ``offload.wrap``.

    ``offload_budget``: the device memory budget (``"8GiB"`` or bytes); required unless ``offload_config``
    carries it. ``offload_config``: an :class:`offload.OffloadConfig` for the other engine options (bucket
    size, activation checkpointing, hardware model, ...). Its ``device`` must be where the Trainer puts the
    batches (``args.device``; the default when no config is given), and its ``dtype`` and
    ``overlap_optimizer`` follow the TrainingArguments: ``bf16``/``fp16`` set the compute dtype, and accumulation
    (``gradient_accumulation_steps > 1``) or clipping (``max_grad_norm > 0``) need every grad before the
    update, so they turn the overlapped optimizer off.

    Honoured: ``learning_rate``, ``weight_decay``, ``adam_beta1/2``, ``adam_epsilon``, ``lr_scheduler_type``
    and warmup, ``gradient_accumulation_steps``, ``max_grad_norm``, ``bf16``/``fp16``, ``eval_strategy``,
    ``save_strategy``, ``logging_steps``, ``seed``, ``optim`` in ``adamw_torch`` / ``adamw_torch_fused``,
    ``activation_checkpointing`` (alias ``gradient_checkpointing``; see ``_checkpointing``).
    Refused with :class:`UnsupportedTrainingArgumentError`: ``deepspeed``, ``fsdp``, ``torch_compile``,
    another ``optim`` or ``optimizers=``, ``activation_checkpointing_kwargs`` other than ``use_reentrant`` and
    ``every_n_layers`` (e.g. ``offload=True``), ``bf16_full_eval``/``fp16_full_eval``, ``model_init``,
    several GPUs or processes.
    """

    def __init__(self, model: nn.Module | None = None, args: "transformers.TrainingArguments | None" = None,
                 *pos: Any, offload_budget: int | str | None = None,
                 offload_config: OffloadConfig | None = None, **kwargs: Any) -> None:
        if pos:
            raise TypeError("pass OffloadTrainer's arguments after model and args by keyword")
        if args is None:
            raise TypeError("OffloadTrainer needs args=TrainingArguments(output_dir=...)")
        config = _engine_config(args, offload_budget, offload_config)
        _refuse_unsupported(model, args, kwargs)
        args, config = _checkpointing(model, args, config)
        super().__init__(model=model, args=args, **kwargs)
        decay = set(self.get_decay_parameter_names(self.model))
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        optimizer = AdamW([g for g in groups if g["params"]], lr=args.learning_rate,
                          betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                          fused=_OPTIMS[_optim_name(args)])
        self.engine: Engine = wrap(self.model, optimizer, config=config)
        """The engine that owns the model's weights and the optimizer state (``memory_stats()``, ...)."""
        self.optimizer = optimizer  # Trainer.create_optimizer keeps an optimizer that is already set
        self.add_callback(_SkippedStep(self.engine))

    # -- setup: nothing may move, cast or wrap the model (see the Note) ------------------------------------

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """The engine places the weights; moving the module would move its placeholders."""

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        # The engine computes in bf16/fp16 and scales fp16 losses itself; accelerate's autocast and
        # GradScaler on top would do it twice, and its device placement would move the placeholders.
        return super()._build_accelerator_args(**kwargs) | {"mixed_precision": "no", "device_placement": False}

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        return self.optimizer

    # -- a step ------------------------------------------------------------------------------------------

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """``Trainer.training_step`` (same loss, same scaling for accumulation) with ``engine.backward``."""
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        scaled_for_ga = self.loss_is_scaled_for_ga
        if scaled_for_ga is None:
            scaled_for_ga = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) \
                or self.compute_loss_func is not None
        if not scaled_for_ga:
            loss = loss / self.current_gradient_accumulation_steps
        self.engine.backward(loss)
        return loss.detach()

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return self.engine.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: torch.Tensor | None = None) -> float | None:
        if grad_norm is None and not self.engine.config.overlap_optimizer:
            grad_norm = self.engine.clip_grad_norm_(float("inf"))  # the norm, no clipping
        # With overlapped updates (no accumulation, no clipping) grads are consumed during backward: no norm.
        return grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm

    # -- checkpoints -------------------------------------------------------------------------------------

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is None:
            state_dict = self.engine.state_dict()["model"]  # fp32 weights; the module holds placeholders
        super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.args.should_save:
            return
        self.engine.save(os.path.join(output_dir, OFFLOAD_CHECKPOINT))  # weights, AdamW, loss scale: atomic
        torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _save_scaler(self, output_dir: str) -> None:
        """The float16 loss scale is the engine's, saved in offload.pt."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        # Called by train() before the optimizer state is loaded; offload.pt holds the weights as well, and
        # _load_optimizer_and_scheduler loads all of it at once.
        _offload_checkpoint(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        self.engine.load(_offload_checkpoint(checkpoint))
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))

    def _load_scaler(self, checkpoint: str | None) -> None:
        """Loaded with offload.pt."""

    def _load_best_model(self) -> None:
        self.engine.load(_offload_checkpoint(self.state.best_model_checkpoint))


class _SkippedStep(transformers.TrainerCallback):
    """A float16 step the engine skipped (overflow) must not advance the LR schedule, as with the plain Trainer's
    GradScaler. The Trainer asks accelerate's optimizer wrapper, which only knows of its own scaler (off here),
    right after ``on_optimizer_step``: tell it here."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None and hasattr(optimizer, "_is_overflow"):  # accelerate's AcceleratedOptimizer
            optimizer._is_overflow = bool(self.engine.memory_stats()["optimizer"]["last_step_skipped"])


# ---------------------------------------------------------------------------------------------------------
# arguments


def _optim_name(args) -> str:
    return getattr(args.optim, "value", args.optim)


def _engine_config(args, budget, config: OffloadConfig | None) -> OffloadConfig:
    """The engine's config: the user's (or a default one), with the budget, the compute dtype from
    ``bf16``/``fp16`` and the optimizer overlap the arguments allow."""
    if config is not None and not isinstance(config, OffloadConfig):
        raise TypeError(f"offload_config must be an offload.OffloadConfig; got {type(config).__name__}")
    if budget is None and config is None:
        raise TypeError('OffloadTrainer needs a device memory budget: offload_budget="8GiB" (or '
                        "offload_config=OffloadConfig(budget=...))")
    device = args.device.type  # where the Trainer puts the batches (cpu with use_cpu=True or without CUDA)
    if config is None:
        config = OffloadConfig(budget=budget, device=device)
    elif budget is not None and OffloadConfig(budget=budget, device=device).budget != config.budget:
        raise ValueError(f"offload_budget={budget!r} and offload_config.budget={config.budget} differ; give one")
    if config.device.type != device:
        raise UnsupportedTrainingArgumentError(
            f"offload_config.device is {config.device} but the Trainer puts batches on {args.device} "
            f"(use_cpu={args.use_cpu}); make them agree (OffloadConfig(device=...) or TrainingArguments(use_cpu=...))")
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    if config.dtype not in (torch.float32, dtype):
        raise UnsupportedTrainingArgumentError(
            f"offload_config.dtype is {config.dtype} but TrainingArguments say {dtype} (bf16={args.bf16}, "
            f"fp16={args.fp16}); set the compute dtype with bf16=True / fp16=True and leave dtype unset")
    # Accumulation and clipping need every grad before any update; float16 needs them for its overflow check.
    overlap = args.gradient_accumulation_steps == 1 and not args.max_grad_norm > 0 and dtype != torch.float16
    return dataclasses.replace(config, dtype=dtype, overlap_optimizer=config.overlap_optimizer and overlap)


def _refuse_unsupported(model, args, kwargs: dict) -> None:
    def refuse(what: str, fix: str) -> None:
        raise UnsupportedTrainingArgumentError(f"OffloadTrainer cannot use {what}: {fix}")

    if model is None:
        refuse("model=None (model_init)", "build the model first and pass model=...; the engine wraps one model")
    if kwargs.get("model_init") is not None:
        refuse("model_init", "build the model first and pass model=...; the engine wraps one model")
    if args.deepspeed:
        refuse("deepspeed=", "offload replaces DeepSpeed ZeRO-Offload here; drop deepspeed= and set offload_budget")
    if args.fsdp:
        refuse("fsdp=", "offload trains one model on one device; drop fsdp=")
    if args.torch_compile:
        refuse("torch_compile=True", "the engine's hooks run in eager mode; leave torch_compile=False")
    if _optim_name(args) not in _OPTIMS:
        refuse(f"optim={_optim_name(args)!r}", f"the engine's optimizer is AdamW; use optim in {sorted(_OPTIMS)}")
    if args.optim_args:
        refuse("optim_args", "pass AdamW's settings through learning_rate, adam_beta1/2, adam_epsilon, weight_decay")
    optimizers = kwargs.get("optimizers", (None, None))
    if optimizers[0] is not None or kwargs.get("optimizer_cls_and_kwargs") is not None:
        refuse("optimizers= / optimizer_cls_and_kwargs=", "the engine makes its offload.AdamW from the arguments "
               "(learning_rate, weight_decay, adam_beta1/2, adam_epsilon)")
    if args.bf16_full_eval or args.fp16_full_eval:
        refuse("bf16_full_eval / fp16_full_eval", "evaluation runs in the training dtype (bf16=True / fp16=True)")
    if args.n_gpu > 1 or args.world_size > 1:
        refuse(f"{max(args.n_gpu, args.world_size)} devices", "offload trains on one device; run one process on one GPU")
    if getattr(args, "use_liger_kernel", False):
        refuse("use_liger_kernel=True", "it patches the model's modules after wrapping; leave it off")


def _checkpointing(model: nn.Module, args, config: OffloadConfig) -> tuple[Any, OffloadConfig]:
    """``activation_checkpointing=True`` (alias ``gradient_checkpointing``; issue 19): the TrainingArguments and
    engine config the Trainer and the engine then get.

    transformers' default (``use_reentrant=False``) runs ``torch.utils.checkpoint`` non-reentrantly, whose
    recompute the engine cannot follow (``guards.refuse_forward_in_backward``); the engine's own activation
    checkpointing runs the same non-reentrant recompute of the same modules, within its plan. So it is mapped:
    the engine checkpoints the model's ``GradientCheckpointingLayer`` modules that transformers would (every
    ``every_n_layers``-th), transformers' switch is turned on with a checkpoint function that only calls the
    layer (so the layers change their arguments as under checkpointing: no cache), and the Trainer is given a copy
    of ``args`` with checkpointing off. Same numbers as the plain Trainer with checkpointing
    (tests/test_integrations_hf.py).
    ``use_reentrant=True`` is left to transformers: the engine follows a reentrant recompute ([Note: a user's
    reentrant checkpoint] in offload/runtime/recompute_hooks.py)."""
    if not (getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False)):
        return args, config

    def refuse(what: str, fix: str) -> None:
        raise UnsupportedTrainingArgumentError(f"OffloadTrainer cannot use activation_checkpointing=True with {what}: "
                                               f"{fix}")

    kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None)
                  or getattr(args, "gradient_checkpointing_kwargs", None) or {})
    every = kwargs.pop("every_n_layers", 1)
    if kwargs.pop("offload", False):
        refuse("offload=True (save_on_cpu inside the model's forward)", "the engine keeps weights on the host "
               "already and cannot let a saved-tensor hook inside the forward see weight views; drop offload=True")
    reentrant = kwargs.pop("use_reentrant", False)
    if kwargs:
        refuse(f"checkpoint arguments {sorted(kwargs)}", "only use_reentrant and every_n_layers are supported")
    if reentrant:
        return args, config
    if config.activation_checkpointing is not None:
        refuse(f"offload_config.activation_checkpointing={config.activation_checkpointing!r}",
               "give one of them (the TrainingArguments' flag is mapped to the engine's checkpointing)")
    from transformers.modeling_layers import GradientCheckpointingLayer
    set_checkpointing = getattr(model, "_set_gradient_checkpointing", None)
    names: list[str] = []
    if set_checkpointing is not None and "value" not in inspect.signature(set_checkpointing).parameters:
        # transformers' own switch, with a checkpoint function that just calls the layer: its layers change
        # their arguments as under checkpointing (use_cache=False, no cache: a recompute must not write a cache
        # twice) and pick every every_n_layers-th layer; the engine checkpoints those layers
        set_checkpointing(enable=True, gradient_checkpointing_func=_call, every_n_layers=every)
        names = [n for n, m in model.named_modules()
                 if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
        names = [n for n in names if not any(n.startswith(o + ".") for o in names)]  # the outermost, as the engine's
    if not names:
        refuse(f"{type(model).__name__} (no GradientCheckpointingLayer modules)", "name the blocks to checkpoint "
               "in offload_config=OffloadConfig(..., activation_checkpointing=[...]) (or \"auto\") and leave "
               "activation_checkpointing off, or pass activation_checkpointing_kwargs={\"use_reentrant\": True}")
    fields = {f: False for f in ("activation_checkpointing", "gradient_checkpointing") if hasattr(args, f)}
    return dataclasses.replace(args, **fields), dataclasses.replace(config, activation_checkpointing=names)


def _call(function: Any, *args: Any, **kwargs: Any) -> Any:
    """The checkpoint function transformers' layers get when the engine checkpoints them (``_checkpointing``)."""
    return function(*args, **kwargs)


def _offload_checkpoint(folder: str) -> str:
    path = os.path.join(folder, OFFLOAD_CHECKPOINT)
    if not os.path.isfile(path):
        raise OffloadError(
            f"{folder} has no {OFFLOAD_CHECKPOINT}: OffloadTrainer resumes only from checkpoints it wrote (they hold "
            "the engine's fp32 weights and AdamW state). To start from plain weights, load them into the model "
            "before making the trainer")
    return path
