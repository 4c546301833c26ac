"""Where the runtime is: its lifecycle and the pass a step is in, as enums with checked transitions.

A transition the code does not make is a bug of the runtime: it raises
:class:`~offload.errors.InvariantError` (never ``assert``, which ``python -O`` strips).
"""

from __future__ import annotations

import enum

from ..errors import InvariantError


class Lifecycle(enum.Enum):
    TRACING = "tracing"
    """Before the first forward has ended: parameters hold their original (host, fp32) tensors, and each
    is copied to the device on its own while a module call uses it (offload/runtime/warmup.py). There are
    no buckets and no host arena yet."""
    RUNNING = "running"
    """Buckets and the host arena exist (the traced forward ended). A step follows a plan when there is
    one (from the step after the traced one on), and fetches on demand otherwise."""
    CLOSED = "closed"
    """``close()`` ran: the parameters are ordinary fp32 tensors again; the runtime runs nothing more."""


class Pass(enum.Enum):
    IDLE = "idle"
    """No forward or backward of the wrapped module is running (between them, or between steps)."""
    FORWARD = "forward"
    """A forward of the wrapped module is running (from the root's pre-hook to its post-hook)."""
    BACKWARD = "backward"
    """A backward reached the engine (a saved weight unpacked, a grad accumulated) and has not ended."""
    RECOMPUTE = "recompute"
    """Inside a backward: a checkpointed call's forward is being recomputed."""


_LIFECYCLE = frozenset({
    (Lifecycle.TRACING, Lifecycle.RUNNING),
    (Lifecycle.TRACING, Lifecycle.CLOSED),
    (Lifecycle.RUNNING, Lifecycle.CLOSED),
})

_PASS = frozenset({
    (Pass.IDLE, Pass.FORWARD),
    (Pass.IDLE, Pass.BACKWARD),
    (Pass.FORWARD, Pass.BACKWARD),  # autograd run inside the forward (e.g. torch.autograd.grad in a module)
    (Pass.BACKWARD, Pass.RECOMPUTE),
    (Pass.RECOMPUTE, Pass.BACKWARD),
})


class Phases:
    """The runtime's lifecycle and pass; components read them, :meth:`enter` and :meth:`become` move them.
    Any pass may drop to IDLE (a pass ended, or a fault discarded it; a forward started inside a backward
    first drops the backward to IDLE, see ``Runtime._begin_forward``)."""

    __slots__ = ("lifecycle", "current")

    def __init__(self) -> None:
        self.lifecycle = Lifecycle.TRACING
        self.current = Pass.IDLE

    @property
    def tracing(self) -> bool:
        return self.lifecycle is Lifecycle.TRACING

    @property
    def in_backward(self) -> bool:
        return self.current is Pass.BACKWARD or self.current is Pass.RECOMPUTE

    def become(self, new: Lifecycle) -> None:
        if (self.lifecycle, new) not in _LIFECYCLE:
            raise InvariantError(f"illegal lifecycle change {self.lifecycle.value} -> {new.value}")
        self.lifecycle = new

    def enter(self, new: Pass) -> None:
        old = self.current
        if new is not Pass.IDLE and (old, new) not in _PASS:
            raise InvariantError(f"illegal pass change {old.value} -> {new.value}")
        self.current = new
