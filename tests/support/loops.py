"""Training loops several test files share (helpers, not tests; imported as `tests.support.loops`):

* `train_streamed`: a test model (tests/support/models.py) trained by an engine with buckets streaming, with the
  training features as options (16-bit compute, gradient accumulation, clipping, chaos);
* `lockstep`: an engine and its plain-PyTorch reference trained side by side on the same losses;
* `torch_losses`: plain PyTorch + torch.optim.AdamW on a copy of a test model: the losses and weights
  `train_streamed` should give;
* `finish_step`: the end of a plain training step (backward, step, zero_grad), its loss's value;
* `wrap_on_cpu`: a model wrapped on the CPU backend at a fraction of its fp32 bytes, with `PLAIN_ADAMW`, the
  AdamW the plain-loop tests compare with `torch.optim.AdamW(**PLAIN_ADAMW)` bit for bit.
"""

import copy
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

import offload
from tests.support.fake_cuda import with_chaos
from tests.support.models import Case, run

ADAMW = dict(lr=3e-4, weight_decay=0.1)  # what train_streamed's engine trains with


class Trained(NamedTuple):
    losses: list[float]  # the last micro-batch's loss of every step
    state: dict  # the engine's final fp32 weights and buffers: engine.state_dict()["model"]
    stats: dict  # engine.memory_stats() after the last step
    extra: Any = None  # what ``inspect(engine)`` returned after the last step (None without ``inspect``)


def train_streamed(case: Case, steps: int, *, budget_frac: float = 0.6, dtype=torch.float32, accumulate: int = 1,
                   clip: float | None = None, chaos=None, on_step=None, inspect=None,
                   fused: bool | None = None) -> Trained:
    """Train ``case`` for ``steps`` steps: a device budget of ``budget_frac`` of its
    fp32 weights, buckets of a tenth of them, on the CPU backend (or whatever ``offload.api.make_backend``
    stands for in a test). ``accumulate`` backward passes per step and ``clip`` (a max norm) train with
    overlap_optimizer=False. ``on_step(engine, step)`` runs after every step; ``inspect(engine)`` once after
    the last, before the engine is closed. ``fused``: offload.AdamW's (False: torch's arithmetic, for
    comparing with plain PyTorch bit for bit)."""
    nbytes = sum(p.numel() * 4 for p in case.model.parameters())
    opt = offload.AdamW(case.model.parameters(), fused=fused, **ADAMW)
    deferred = {"overlap_optimizer": False} if accumulate > 1 or clip is not None else {}
    with with_chaos(chaos):  # chaos: an offload.testing.chaos.ChaosConfig, or None
        engine = offload.wrap(case.model, opt, budget=int(budget_frac * nbytes), bucket_bytes=nbytes // 10,
                              dtype=dtype, device="cpu", **deferred)
    losses = []
    try:
        for step in range(steps):
            for i in range(accumulate):
                batch = case.make_batch(step * accumulate + i)
                loss = case.loss_fn(run(engine, batch), batch)
                engine.backward(loss)
            if clip is not None:
                engine.clip_grad_norm_(clip)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if on_step is not None:
                on_step(engine, step)
        extra = inspect(engine) if inspect is not None else None
        return Trained(losses, engine.state_dict()["model"], engine.memory_stats(), extra)
    finally:
        engine.close()


LossFn = Callable[[Callable], torch.Tensor]  # given the model (or engine) to run, the loss of one micro-batch


def lockstep(engine, opt, ref, ref_opt, steps: int, micro_losses: Callable[[int], list[LossFn]],
             before_step: Callable[[int], None] | None = None) -> None:
    """Train ``engine`` (with ``opt``) and the plain-PyTorch ``ref`` (with ``ref_opt``) side by side: at each
    step, every loss function of ``micro_losses(step)`` is computed and back-propagated by the engine
    (``engine.backward``) and then by the reference (``loss.backward()``); then ``before_step(step)`` (to
    compare or clip the gathered grads), then both optimizers step and zero their grads."""
    for step in range(steps):
        for loss_fn in micro_losses(step):
            engine.backward(loss_fn(engine))
            loss_fn(ref).backward()
        if before_step is not None:
            before_step(step)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()


def torch_losses(case: Case, steps: int) -> tuple[list[float], torch.nn.Module]:
    """Plain PyTorch + ``torch.optim.AdamW(foreach=False)`` on a copy of ``case.model`` (with ``ADAMW``), one step
    per batch: each step's loss (what the engine with ``offload.AdamW(fused=False)`` gives bit for bit) and the
    trained copy."""
    ref = copy.deepcopy(case.model)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    losses = []
    for step in range(steps):
        batch = case.make_batch(step)
        loss = case.loss_fn(run(ref, batch), batch)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(loss.item())
    return losses, ref


def finish_step(loss: torch.Tensor, opt) -> float:
    """``loss.backward()``, ``opt.step()``, ``opt.zero_grad()``; the loss's value."""
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


PLAIN_ADAMW = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def wrap_on_cpu(model, budget_frac: float, **kw) -> tuple[offload.Engine, offload.AdamW]:
    """``model`` wrapped with ``offload.AdamW(fused=False, **PLAIN_ADAMW)`` (torch's arithmetic) on the CPU backend,
    at a budget of ``budget_frac`` of its fp32 weights and buckets of a tenth of them; ``kw`` to ``offload.wrap``."""
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    opt = offload.AdamW(model.parameters(), fused=False, **PLAIN_ADAMW)
    engine = offload.wrap(model, opt, budget=int(budget_frac * nbytes), bucket_bytes=nbytes // 10, device="cpu",
                          **kw)
    return engine, opt


def session_with_eval_and_reload(engine, opt, case: Case, steps: int, overlap: bool) -> tuple[list[float], list]:
    """``steps`` steps (overlapped: one batch each; deferred: two micro-batches and a clip at 0.05), an
    evaluation forward after step 3 and a state-dict round trip after step 4: (losses, the eval's outputs)."""
    losses: list[float] = []
    outs: list = []
    for i in range(steps):
        micro = [case.make_batch(i)] if overlap else [case.make_batch(2 * i), case.make_batch(2 * i + 1)]
        for batch in micro:
            loss = case.loss_fn(run(engine, batch), batch) / len(micro)
            loss.backward()
        if not overlap:
            engine.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if i == 3:
            with torch.no_grad():
                outs += torch.utils._pytree.tree_leaves(run(engine, case.make_batch(10_000)))
        if i == 4:
            engine.load_state_dict(copy.deepcopy(engine.state_dict()))
    return losses, outs
