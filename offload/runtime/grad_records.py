"""The grad pipeline's typed records (offload/runtime/grads.py): a slot being filled, the grads gathered per
bucket since the last ``step()``, what a failed backward discarded; and the error a second backward through
one forward's graph raises."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from ..backend.base import Event


class GradSlot(NamedTuple):
    """Where a bucket's grads are gathered on the device during a backward."""

    view: torch.Tensor  # typed, the bucket's trainable prefix
    buffer: int | None  # plan buffer, None when allocated on demand


class PendingGrads(NamedTuple):
    """A bucket's grads gathered since the last ``step()``: what its next update covers, and what
    accumulation adds to."""

    params: frozenset[int]  # parameters whose grads were gathered
    ready: Event  # after it, the host grad buffer holds them


class BackwardDiscard(NamedTuple):
    """What :meth:`GradPipeline.abort` dropped or kept (for the warning of offload/runtime/faults.py)."""

    arrived: int  # parameters whose grads had reached the engine in this backward
    updated: list[int]  # buckets already updated (overlap): kept
    dropped: list[int]  # buckets whose gathered grads were dropped
    problems: list[str]  # background work that failed too


# A second backward through the graph of one forward: the engine gathers one backward's grads per forward
SECOND_BACKWARD = (
    "a second backward ran through the graph of a forward whose gradients an earlier backward already gathered "
    "(e.g. loss.backward(retain_graph=True), then loss.backward() again, with or without optimizer.step() "
    "between): offload gathers one backward's gradients per forward, so this one's would be lost. Run the forward "
    "again before each backward, or add the losses and call backward once (torch.autograd.grad(..., "
    "create_graph=True) before the backward, as for a gradient penalty, is fine: it accumulates nothing)")

# A backward reads a weight its forward saved before a step changed it ([Note: stale graphs] in slots.py)
STALE_GRAPH = (
    "this backward runs through the graph of a forward that ran before its weights changed (optimizer.step() "
    "or a state dict loaded since; e.g. loss.backward(retain_graph=True), step(), then loss.backward() again, or "
    "a loss kept from before the step): it would read the new weights and its gradients would be wrong. torch "
    "refuses it too (\"one of the variables needed for gradient computation has been modified by an inplace "
    "operation\"). Run the forward again before each backward")
