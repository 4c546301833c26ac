"""The public API: ``offload.wrap(model, optimizer, budget=...)`` returns an :class:`Engine`."""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from . import persist
from .backend import make_backend
from .config import OffloadConfig
from .errors import AlreadyWrappedError, EngineClosedError, OptimizerBoundError
from .optim import AdamW
from .runtime import faults, guards
from .runtime.core import Runtime
from .tools import timeline

# The one piece of process-wide state: which modules are wrapped right now, so that wrapping one twice
# (or a module that shares parameters with a wrapped one) fails loudly instead of corrupting both.
# Keyed by id (tensors compare elementwise, so they cannot be dict keys), checked by weak reference.
_WRAPPED: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _wrapped_by(p: nn.Parameter) -> "Engine | None":
    entry = _WRAPPED.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


def wrap(model: nn.Module, optimizer: AdamW, config: OffloadConfig | None = None, **fields: Any) -> "Engine":
    """Offload ``model``'s parameters and ``optimizer``'s state; return the engine that trains it.

    Pass either a whole ``config=OffloadConfig(...)`` or its fields as keywords
    (``budget="8GiB", dtype=torch.float32, device="cpu", bucket_bytes="auto"``).
    """
    if config is not None and fields:
        raise TypeError("pass either config=OffloadConfig(...) or its fields as keywords, not both")
    if config is None:
        unknown = set(fields) - set(OffloadConfig.field_names())
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}; OffloadConfig has {list(OffloadConfig.field_names())}")
        if "budget" not in fields:
            raise TypeError('offload.wrap needs a device memory budget, e.g. budget="8GiB"')
        config = OffloadConfig(**fields)
    elif not isinstance(config, OffloadConfig):
        raise TypeError(f"config must be an offload.OffloadConfig; got {type(config).__name__}")
    return Engine(model, optimizer, config)


class Engine:
    """Trains one wrapped module. Call it like the module; ``backward``, ``step``, ``zero_grad``,
    ``memory_stats``, ``state_dict``/``load_state_dict`` and ``close`` do what their names say."""

    def __init__(self, model: nn.Module, optimizer: AdamW, config: OffloadConfig):
        params, groups = _validate(model, optimizer)
        self.module = model
        self.optimizer = optimizer
        self.config = config
        backend = make_backend(config.device)
        guards.check_budget(config.budget, backend)
        self._runtime = Runtime(model, optimizer, config, backend, params, groups)
        self._buffers = _buffers_to_device(model, backend)  # [(buffer, its device before wrap)]
        buffer_bytes = sum(b.numel() * b.element_size() for b, _ in self._buffers)
        self._runtime.ctx.memory.add("buffers", buffer_bytes)
        optimizer._bind(self)
        for p in params:
            _WRAPPED[id(p)] = (weakref.ref(p), weakref.ref(self))
        self._closed = False
        # issue 20: code written for DDP calls model.no_sync(); a model without one gets the engine's
        self._added_no_sync = not hasattr(model, "no_sync")
        if self._added_no_sync:
            setattr(model, "no_sync", _no_sync_of(weakref.ref(self)))

    # -- training -------------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._check_open()
        rt = self._runtime
        outer, rt.engine_call = rt.engine_call, True
        try:
            return self.module(*args, **kwargs)
        except BaseException as e:  # KeyboardInterrupt too: the engine must stay usable
            faults.abort_forward(rt, e)
            raise
        finally:
            rt.engine_call = outer

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` (multiplied by the loss scale with float16); grads go to the host as they are
        made, and with ``overlap_optimizer`` each bucket's update starts as soon as its grads are there."""
        self._check_open()
        rt = self._runtime
        loss = rt.grads.scale_loss(loss)
        try:
            loss.backward(**kwargs)
        except BaseException as e:  # KeyboardInterrupt too: see offload/runtime/faults.py
            faults.abort_backward(rt, e)
            raise
        finally:
            rt.grads.forget_scale()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the gradients gathered since the last step, as ``torch.nn.utils.clip_grad_norm_`` would, and
        return their total norm (unscaled). Call it between the last backward and ``step()``; it needs
        ``overlap_optimizer=False``. The norms were computed as the grads were made, so this reads no grads."""
        self._check_open()
        return self._runtime.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def no_sync(self) -> ContextManager[None]:
        """DDP's ``no_sync()``: data parallel, a backward that ends inside it communicates nothing and its grads
        add up on this rank (``p.grad`` shows this rank's own sum); the next backward outside it averages the
        whole sum over the ranks (see the README's "Data parallel"). In one process it changes nothing.
        ``model.no_sync()`` is the same, for a model that had none."""
        self._check_open()
        rt = self._runtime
        return contextlib.nullcontext() if rt.ctx.dp is None else rt.ctx.dp.no_sync(rt.grads.deferred)

    def step(self) -> None:
        """Wait for every bucket's AdamW update; the next forward streams the new weights. The same as
        ``optimizer.step()``, which it calls: the optimizer's step hooks run and an LR scheduler sees the step
        (session 25: before, they did not, and a scheduler warned that optimizer.step() was never called)."""
        self._check_open()
        self.optimizer.step()

    def _run_step(self) -> None:
        """What the bound optimizer's ``step()`` does (``offload.AdamW.step``)."""
        self._check_open()
        self._runtime.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients gathered since the last step (``set_to_none=False``: keep them, zeroed, so that
        a ``step()`` right after updates with zero gradients, as torch's optimizers do)."""
        self._check_open()
        self._runtime.zero_grad(set_to_none)

    def wait_for_updates(self) -> None:
        self._runtime.wait_for_updates()

    # -- introspection --------------------------------------------------------------------------------

    def memory_stats(self) -> dict[str, Any]:
        """Device and host bytes, and what the plan decided (``plan``: the training plan, None until the
        first step; ``eval_plan``: the forward-only plan no-grad forwards follow). ``transfers`` counts the
        bytes copied since wrap: host to device (in all and per bucket) and gradients device to host."""
        rt = self._runtime
        ctx, grads, host = rt.ctx, rt.grads, rt.slots.host
        memory, stats = ctx.memory, ctx.stats
        plan, eval_plan = rt.executor.train_plan, rt.evals.latest
        # On CUDA the allocator's measured peak since wrap (arena, activations, grads, temporaries); on the
        # CPU backend, which has no allocator to ask, the runtime's own accounting.
        measured = ctx.backend.peak_bytes()
        summary = None
        if plan is not None:
            summary = plan.summary() | {"bucket_bytes": ctx.bucket_bytes, "replans": stats["replans"]}
        return {
            "budget_bytes": self.config.budget,
            "device_peak_bytes": memory.peak if measured is None else measured,
            "device_peak_accounted_bytes": memory.peak,
            "device_current_bytes": memory.current,
            "device_parts": dict(memory.parts),
            # the part of device_parts["headroom"] learnt from the allocator's peaks ([Note: transients] in
            # runtime/accounting.py): what forward and backward allocate beyond the plan; 0 on the CPU backend
            "transient_bytes": memory.transients,
            "arena_bytes": plan.arena_bytes if plan is not None else 0,
            "host_pinned_bytes": host.nbytes if host is not None else 0,
            # issue 18: the host bytes the engine holds (arena, an old one during a re-layout, parked copies of
            # device-homed state, the first step's held grads), now and at most since wrap; not the user's tensors
            "host_current_bytes": host.host_bytes()[0] if host is not None else 0,
            "host_peak_bytes": host.host_bytes()[1] if host is not None else 0,
            # issue 20: the node's shared copy of the weights this rank maps (once per node, not per rank: [Note: one
            # host copy per node] in host/node_copy.py); 0 without one
            "host_shared_bytes": (ctx.dp.node_copy.size_bytes if ctx.dp is not None and ctx.dp.node_copy is not None
                                  else 0),
            # the host arena's bytes (as allocated: every region and its alignment) over the model's parameters
            "host_bytes_per_param": (host.nbytes / sum(s.numel for s in ctx.specs)
                                     if host is not None and ctx.specs else None),
            "plan": summary,
            "eval_plan": eval_plan.summary() if eval_plan is not None else None,
            "transfers": {"h2d_bytes": stats["h2d_bytes"], "d2h_bytes": stats["d2h_bytes"],
                          "h2d_bytes_by_bucket": list(rt.slots.h2d_by_bucket)},
            "optimizer": {
                "overlap": not grads.deferred,
                "loss_scale": grads.scaler.scale if grads.scaler is not None else None,
                "skipped_steps": stats["skipped_steps"],
                "last_step_skipped": grads.last_step_skipped,
            },
            "activation_checkpointing": rt.recompute.stats(),
            "device_optimizer": rt.grads.device.stats(plan),  # issue 18: bytes per placement, counters
            # the last check of the plan's compute times on a timed step ([Note: timing compute]); None: none yet
            "compute_timing": dict(rt.executor.timing) if rt.executor.timing is not None else None,
            "counters": dict(stats),
        }

    def export_timeline(self, path: str | os.PathLike) -> "timeline.Timeline":
        """Write the last measured step as Chrome-trace JSON to ``path`` (open it in https://ui.perfetto.dev
        or chrome://tracing) and return it: a track per lane (compute with module calls nested, H2D copies,
        D2H copies, CPU AdamW; one slice per bucket copy or update) and a counter of device bytes against the
        budget. Call it after a training step, before the next forward. ``.plot_memory("mem.png")`` on the
        result draws the memory line (needs matplotlib). See offload/tools/timeline.py."""
        self._check_open()
        names = [name for name, _ in self.module.named_modules()]
        result = timeline.measured(self._runtime, names)
        result.save(path)
        return result

    # -- checkpoints ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"model": fp32 weights and buffers keyed like model.state_dict(), "optimizer": ...}``."""
        self._check_open()
        rt = self._runtime
        rt.wait_for_updates()
        weights = {}
        with rt.ctx.backend.compute():  # buffers live on the device: read after the compute that updates them
            for name, value in self.module.state_dict(keep_vars=True).items():
                p = rt.ctx.param_index.get(id(value))
                weights[name] = rt.weights.read(p) if p is not None else value.detach().to("cpu", copy=True)
        if rt.ctx.dp is not None:  # issue 20: m and v gathered from every rank's shard (a collective call)
            return {"model": weights, "optimizer": persist.optimizer_state(self, rt)}
        return {"model": weights, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_open()
        if set(state_dict) != {"model", "optimizer"}:
            raise ValueError('expected {"model": ..., "optimizer": ...} as returned by Engine.state_dict()')
        rt = self._runtime
        rt.wait_for_updates()
        own = self.module.state_dict(keep_vars=True)
        missing, unexpected = set(own) - set(state_dict["model"]), set(state_dict["model"]) - set(own)
        if missing or unexpected:
            raise KeyError(f"state dict does not match the model: missing {sorted(missing)}, "
                           f"unexpected {sorted(unexpected)}")
        wrong = [f"{name}: {tuple(value.shape)} where the model has {tuple(own[name].shape)}"
                 for name, value in state_dict["model"].items() if tuple(value.shape) != tuple(own[name].shape)]
        if wrong:  # checked before anything is written: a refused state dict changes nothing
            raise ValueError(f"state dict does not match the model's shapes: {'; '.join(wrong[:8])}"
                             + (f" (and {len(wrong) - 8} more)" if len(wrong) > 8 else ""))
        self.optimizer.check_state_shapes(state_dict["optimizer"])
        with torch.no_grad(), rt.ctx.backend.compute():
            for name, value in state_dict["model"].items():
                target = own[name]
                p = rt.ctx.param_index.get(id(target))
                if p is not None:
                    rt.weights.write(p, value.to(torch.float32))
                else:
                    target.copy_(value)
        rt.weights.written()
        self.optimizer.load_state_dict(state_dict["optimizer"])

    def save(self, path: str | os.PathLike, extra: dict | None = None) -> None:
        """Write a checkpoint to ``path`` atomically: fp32 weights and buffers under ``["model"]`` (keyed
        like ``model.state_dict()``, so plain ``model.load_state_dict(torch.load(path)["model"])`` works),
        AdamW state, loss-scaler state, RNG states, and ``extra`` (e.g. an LR scheduler's state_dict).
        A crash or kill during the write leaves the previous file at ``path`` intact."""
        self._check_open()
        persist.save(self, self._runtime, path, extra)

    def load(self, path: str | os.PathLike) -> dict | None:
        """Resume from a checkpoint written by :meth:`save`; returns its ``extra``. Training then goes on
        exactly as if it had not stopped (same weights, AdamW state, loss scale and RNG streams)."""
        self._check_open()
        return persist.load(self, self._runtime, path)

    def _adopt_optimizer_state(self) -> None:
        self._runtime.adopt_optimizer_state()

    # -- lifetime -------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the engine: the module gets its trained weights back as ordinary CPU tensors, threads stop,
        and host and device memory are released. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            try:
                with self._runtime.ctx.backend.compute(), torch.no_grad():
                    for buf, device in self._buffers:  # back where they were, with their trained values
                        buf.data = buf.data.to(device, copy=True)
            finally:
                self._runtime.close()
        finally:
            if self._added_no_sync:
                self.module.__dict__.pop("no_sync", None)
            self.optimizer._unbind()
            self.optimizer.state.clear()
            for p in self._runtime.ctx.params:
                if _wrapped_by(p) is self:
                    del _WRAPPED[id(p)]

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("this engine is closed; wrap the model again to keep training")

    def __repr__(self) -> str:
        return (f"Engine({type(self.module).__name__}, budget={self.config.budget}, "
                f"device={self.config.device}, dtype={self.config.dtype})")


def _no_sync_of(engine: "weakref.ref[Engine]") -> Callable[[], ContextManager[None]]:
    """``model.no_sync`` for a wrapped model without one (weak: the module must not keep the engine alive)."""
    def no_sync() -> ContextManager[None]:
        e = engine()
        if e is None:
            raise EngineClosedError("model.no_sync() of an offload engine that no longer exists")
        return e.no_sync()
    return no_sync


def _buffers_to_device(model: nn.Module, backend) -> list[tuple[torch.Tensor, torch.device]]:
    """Put every module buffer (BatchNorm's running statistics, HF BERT's ``position_ids``) on the device for
    the engine's lifetime: compute reads them next to the weights and activations, so on CUDA a buffer left
    on the host fails with a device mismatch. The buffer objects stay (``.data`` is rebound), so references
    to them see the moved values; ``Engine.close()`` moves them back. Their bytes are device memory the plan
    counts (``fixed_bytes``)."""
    moved, seen = [], set()
    with torch.no_grad():
        for buf in model.buffers():
            if id(buf) in seen:
                continue
            seen.add(id(buf))
            nbytes = buf.numel() * buf.element_size()
            device = backend.empty(nbytes).view(buf.dtype).view(buf.shape)
            device.copy_(buf)
            moved.append((buf, buf.device))
            buf.data = device
    return moved


def _validate(model: nn.Module, optimizer: AdamW) -> tuple[list[nn.Parameter], list[int | None]]:
    """Check the model and optimizer before anything is touched; return params and their group index."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"offload.wrap expects a torch.nn.Module; got {type(model).__name__}")
    if not isinstance(optimizer, AdamW):
        raise TypeError(f"offload.wrap expects an offload.AdamW optimizer; got {type(optimizer).__name__}. "
                        "Create it with offload.AdamW(model.parameters(), ...)")
    params = list(model.parameters())
    if not params:
        raise ValueError(f"{type(model).__name__} has no parameters: there is nothing to offload")
    for p in params:
        if _wrapped_by(p) is not None:
            raise AlreadyWrappedError("this model (or one sharing parameters with it) is already wrapped by an offload "
                               "engine; call engine.close() on that engine first")
        if p.device.type != "cpu":
            raise ValueError(f"parameters must be on the CPU when wrapping (found one on {p.device}); the engine "
                             "places them itself. Build or load the model on the CPU, then wrap it")
        if p.dtype != torch.float32:
            raise TypeError(f"parameters must be torch.float32 (the engine keeps fp32 masters and computes in "
                            f"the configured dtype); found {p.dtype}. Convert the model with model.float() first")
    if optimizer._engine is not None:
        raise OptimizerBoundError("this offload.AdamW is already bound to an engine; make one optimizer per engine")
    group_of: dict[int, int] = {}
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            group_of[id(p)] = g
    in_model = {id(p) for p in params}
    strangers = [k for k in group_of if k not in in_model]
    if strangers:
        raise ValueError(f"the optimizer holds {len(strangers)} parameter(s) that are not in the model")
    groups: list[int | None] = []
    for p in params:
        g = group_of.get(id(p))
        if p.requires_grad and g is None:
            raise ValueError("a parameter requires grad but is not in the optimizer; add it to the optimizer "
                             "or set requires_grad=False (frozen)")
        groups.append(g if p.requires_grad else None)
    return params, groups
