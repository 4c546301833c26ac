"""[Note: steps that keep departing]

A step that departs from its plan (``PlanExecutor.leave``) finishes off plan: its buckets are fetched on demand,
nothing is prefetched ahead of compute, and ``step()`` plans again from its record. Once, after a change in the
loop, that is the point of a plan that follows the model. Step after step it is a loop the plan cannot follow (a
submodule called outside the root's forward, a second forward after ``torch.autograd.grad`` of the input, a
forward that reads other weights every step), and training runs at on-demand speed, silently: the numbers stay
right, so nothing else would tell. So the engine warns once, when ``WINDOW - 1`` of the last ``WINDOW`` steps
departed, naming where the latest one left its plan (what the plan expected next and what came instead).
``memory_stats()["counters"]["plan_departures"]`` counts them all.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections import deque
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..errors import OffloadWarning
from ..planning.trace import EventKind

if TYPE_CHECKING:
    from types import FrameType

    from torch import nn

WINDOW = 4  # steps looked at; warned when all but one of them departed


class Where(NamedTuple):
    """Where a step left its plan: the event the plan expected (None: the plan had ended) and the one that came,
    each (kind, key); or, for a departure that is no mismatch of events, ``reason`` in words."""

    expected: tuple[EventKind, int] | None = None
    came: tuple[EventKind, int] | None = None
    reason: str = ""


class Departures:
    """Which of the latest steps departed from their plan, and where the latest one did."""

    __slots__ = ("where", "recent", "warned")

    def __init__(self) -> None:
        self.where: Where | None = None  # this step's first departure (None: it has not departed)
        self.recent: deque[bool] = deque(maxlen=WINDOW)
        self.warned = False

    def left(self, where: Where) -> None:
        """The step departs."""
        if self.where is None:
            self.where = where

    def step_ended(self, module: nn.Module) -> None:
        """``step()`` ran: count this step; warn once if steps keep departing."""
        where, self.where = self.where, None
        self.recent.append(where is not None)
        if where is None or self.warned or sum(self.recent) < WINDOW - 1:
            return
        self.warned = True
        warnings.warn(OffloadWarning(
            f"offload: {sum(self.recent)} of the last {len(self.recent)} steps departed from their plan, so they "
            f"ran off plan (buckets fetched on demand, nothing prefetched) and were planned again: the loop does "
            f"something the plan cannot follow. The latest left it {describe(where, module)}. Common causes: "
            "a submodule called outside the wrapped model's forward (call it through the model), a second forward "
            "after torch.autograd.grad of the input, a forward that reads different weights each step. "
            "memory_stats()['counters']['plan_departures'] counts departures (warned once)"), stacklevel=_user_level())


def _user_level() -> int:
    """The ``stacklevel`` of the first caller outside offload and torch (the user's ``opt.step()``, whatever
    wrappers torch.optim puts around it), as seen from :meth:`Departures.step_ended`'s ``warnings.warn``."""
    skip = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__))
    frame: FrameType | None = sys._getframe(2)  # the caller of step_ended: stacklevel 2
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def describe(where: Where, module: nn.Module) -> str:
    """``where`` in words, events named by their module or parameter (``module``'s names, in the order the
    runtime numbers them: ``modules()`` and ``parameters()``)."""
    if where.came is None:
        return where.reason
    modules = [name or "the model" for name, _ in module.named_modules()]
    params = [name for name, _ in module.named_parameters()]

    def event(e: tuple[EventKind, int]) -> str:
        kind, key = e
        if kind is EventKind.PRE:
            return f"the forward of {modules[key]!r} beginning"
        if kind is EventKind.POST:
            return f"the forward of {modules[key]!r} ending"
        return f"{'a backward node reading' if kind is EventKind.UNPACK else 'the gradient of'} {params[key]!r}"

    if where.expected is None:
        return f"at {event(where.came)}, after its plan had ended"
    return f"where it expected {event(where.expected)} and saw {event(where.came)}"
