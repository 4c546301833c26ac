"""Exception types. Each one says what went wrong and what to do about it."""

from __future__ import annotations


class OffloadError(RuntimeError):
    """Base class for errors raised by the engine."""


class BudgetTooSmallError(OffloadError, ValueError):
    """The device budget cannot hold the smallest feasible plan.

    ``min_budget_bytes`` is the smallest budget that would work for this model, batch and bucket size;
    ``breakdown`` names the parts it is made of (bytes each), largest first.
    """

    def __init__(self, message: str, *, min_budget_bytes: int, budget_bytes: int, breakdown: dict[str, int]):
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes
        self.budget_bytes = budget_bytes
        self.breakdown = dict(breakdown)


class HostMemoryError(OffloadError, MemoryError):
    """Host RAM is too small for the pinned host arena (fp32 masters, Adam state, grad staging)."""


class CheckpointError(OffloadError, ValueError):
    """A checkpoint cannot be loaded: not an offload checkpoint, truncated or corrupt, or of another model."""


class StreamError(OffloadError):
    """The engine's forward ran on another CUDA stream than its first forward did: the plan's arena, slots and
    events belong to that stream (see [Note: the compute stream] in backend/cuda.py)."""


class OffloadWarning(UserWarning):
    """Something was discarded or cannot be done as asked, and training goes on (e.g. a fault mid-step)."""
