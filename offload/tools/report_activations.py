"""Activation bytes for ``offload report`` beyond the traced step: per block of
``activation_checkpointing="auto"`` by one forward on the meta device (:func:`measure_activations`), and
the analytic estimate for a model whose forward cannot run on meta tensors (:class:`AnalyticShape`,
:func:`analytic_trace`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..planning.activations import ActivationProfile, profile_of
from ..planning.buckets import ParamSpec
from ..planning.trace import Event, EventKind, Trace
from ..runtime.recompute import find_blocks
from .metatrace import CountedActivation, MetaTrace, SavedBytes
from .report_model import Request


def measure_activations(model: nn.Module, run: Callable[[nn.Module], torch.Tensor]) -> ActivationProfile:
    """One forward on the meta device (no backward: saved activations only accumulate in forward), counted
    the way the engine counts them (per storage, inside the root module's forward, parameters excluded),
    per block of ``activation_checkpointing="auto"`` (:func:`offload.runtime.recompute.find_blocks`) too: the
    :class:`~offload.planning.activations.ActivationProfile` the engine's checkpoint planner takes (forward seconds 0:
    not measured here)."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    counter = SavedBytes()
    names = find_blocks(model)
    modules = list(model.modules())
    saved: dict[int, int] = {}
    inputs: dict[int, int] = {}
    calls: dict[int, tuple[int, float]] = {}
    handles, active, at = [], [], {}

    def pack(t):
        return t if t.untyped_storage()._cdata in params else CountedActivation(t, counter)

    def unpack(x):
        return x.tensor if isinstance(x, CountedActivation) else x

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
