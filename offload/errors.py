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


class EngineClosedError(OffloadError):
    """The engine was closed (``Engine.close()`` or leaving its ``with`` block): the module holds its trained
    weights as plain tensors again; wrap it again to keep training."""


class AlreadyWrappedError(OffloadError):
    """The model (or one sharing parameters with it) is already wrapped by an open engine: close that engine
    first, or wrap another model."""


class OptimizerBoundError(OffloadError):
    """This ``offload.AdamW`` already belongs to an engine: make one optimizer per engine."""


class KernelUnavailableError(OffloadError):
    """The fused C++ AdamW was asked for (``fused=True``) but this build of ``offload._C`` lacks it: rebuild
    offload (``pip install -e .``) or use ``fused=False``."""


class NonFiniteNormError(OffloadError):
    """``clip_grad_norm_(..., error_if_nonfinite=True)`` met a total norm that is inf or NaN (as torch's
    ``clip_grad_norm_`` raises)."""


class ReportError(OffloadError, ValueError):
    """``offload report`` got bad input or a model it cannot report on; ``usage`` marks a usage error (the CLI
    exits with status 2)."""

    def __init__(self, message: str, usage: bool = False):
        super().__init__(message)
        self.usage = usage


class InvariantError(OffloadError):
    """An internal invariant broke: a bug in offload, not in your code. Raised (never ``assert``, which
    ``python -O`` strips) where continuing would compute wrong numbers; please report it with the message."""


class DistributedError(OffloadError):
    """Data parallel (issue 20): a collective failed, or this rank left the sequence of collectives the other
    ranks follow (its backward raised); the message names the rank. The ranks are out of step: restart them."""


class OffloadWarning(UserWarning):
    """Something was discarded or cannot be done as asked, and training goes on (e.g. a fault mid-step)."""
