"""What one training step did, recorded as it ran: the events the plan is keyed on.

Forward events are module calls (PRE/POST, keyed by module index); the parameters a call needs are the
ones touched by tensor ops while it was the innermost active call (so tied weights, a parent reading a
child's weight, and functional uses are all seen). Backward events are autograd nodes that read saved
parameters (UNPACK, one event per node, keyed by the first parameter it reads) and gradient
accumulations (GRAD, keyed by parameter); a checkpointed module call that backward recomputes is one
RECOMPUTE event (keyed by module index) whose uses are the parameters the recompute reads and which ends
when that call's backward is over (see offload/runtime/recompute.py). Recording is cheap (list appends), so every step is recorded
and a step that departs from the plan can be planned again from its own record.

Times come from the host's clock (``time.perf_counter``) between hooks, except on a step the runtime times
with the backend's clock of compute (a :class:`offload.backend.base.Timer`, CUDA events on CUDA): then
``Trace.seconds`` and ``Trace.overhead`` are that clock's, and ``Trace.clock`` says "backend" ([Note: timing
compute] in offload/runtime/executor.py). ``Recorder.times`` stays the host's either way (the timeline's).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..backend.base import Timer


class EventKind(enum.IntEnum):
    PRE = 0
    """A module's forward begins. Key: module index."""
    POST = 1
    """A module's forward ended. Key: module index."""
    UNPACK = 2
    """A backward node reads saved parameter tensors. Key: the first parameter it reads."""
    GRAD = 3
    """A parameter's gradient is final for this backward. Key: parameter id."""
    RECOMPUTE = 4
    """Backward recomputes a checkpointed module call; its needs last until that call's backward is over.
    Key: module index."""


@dataclass(frozen=True)
class Event:
    kind: EventKind
    key: int


@dataclass(frozen=True)
class Trace:
    events: tuple[Event, ...]
    num_forward: int  # events[:num_forward] happened in forward
    uses: tuple[tuple[int, ...], ...]  # per event: parameters it needs on the device
    ends: tuple[int, ...]  # per event: index of the event at which those needs end (exclusive)
    touched: tuple[int, ...]  # parameters touched in forward, in first-touch order
    activation_peak_bytes: int  # peak bytes of saved activations (parameters excluded)
    max_grad_bytes: int  # largest gradient autograd materialises before the engine takes it
    seconds: tuple[float, ...]  # wall time from each event to the next
    overhead: tuple[float, ...] = ()  # per event: part of ``seconds`` the engine spent waiting or fetching
    clock: str = "host"  # "host": host time between hooks; "backend": the backend's clock of compute (Timer)

    @property
    def compute_seconds(self) -> tuple[float, ...]:
        """Per event: the compute time the scheduler's cost model uses, ``seconds`` less ``overhead``."""
        if not self.overhead:
            return self.seconds
        return tuple(max(0.0, s - o) for s, o in zip(self.seconds, self.overhead))

    @property
    def complete(self) -> bool:
        """Forward and backward were both seen."""
        return 0 < self.num_forward < len(self.events)


class Recorder:
    """Builds a :class:`Trace` from the hooks of one step; with a ``timer``, its seconds are the timer's."""

    def __init__(self, timer: Timer | None = None) -> None:
        self.events: list[Event] = []
        self.uses: list[list[int]] = []
        self.ends: list[int] = []
        self.times: list[float] = []
        self.stack: list[int] = []  # event indices of the active PRE events
        self.touched: dict[int, None] = {}  # insertion-ordered set
        self.num_forward = 0
        self.last_node: object | None = None
        self.activation_peak = 0
        self.max_grad = 0
        self.overhead: list[float] = []  # per event, seconds spent inside ``excluded()``
        self._excluded_since: float | None = None
        self.timer = timer
        self.marks: list[object] = []  # with a timer: per event, its mark
        self.excluded_marks: list[tuple[int, object, object]] = []  # with a timer: (event, begin, end)
        self._excluded_mark: object | None = None

    def _add(self, kind: EventKind, key: int) -> int:
        self.events.append(Event(kind, key))
        self.uses.append([])
        self.ends.append(len(self.events))
        self.times.append(time.perf_counter())
        self.overhead.append(0.0)
        if self.timer is not None:
            self.marks.append(self.timer.mark())
        return len(self.events) - 1

    def exclude_begin(self) -> None:
        """The engine starts work that is not the model's compute (an on-demand fetch, a wait for a copy):
        time until :meth:`exclude_end` is not counted as the current event's compute. With a timer that is
        the time compute stood still between the two marks: on CUDA, the stream wait enqueued between them."""
        self._excluded_since = time.perf_counter()
        if self.timer is not None:
            self._excluded_mark = self.timer.mark()

    def exclude_end(self) -> None:
        if self._excluded_since is not None and self.overhead:
            self.overhead[-1] += time.perf_counter() - self._excluded_since
            if self.timer is not None and self._excluded_mark is not None:
                self.excluded_marks.append((len(self.overhead) - 1, self._excluded_mark, self.timer.mark()))
        self._excluded_since = None
        self._excluded_mark = None

    def pre(self, module: int) -> None:
        self.stack.append(self._add(EventKind.PRE, module))

    def post(self, module: int) -> None:
        i = self._add(EventKind.POST, module)
        if self.stack:
            self.ends[self.stack.pop()] = i
        if not self.stack:
            self.num_forward = len(self.events)

    def recompute_begin(self, module: int) -> int:
        """A checkpointed call of ``module`` is recomputed; parameters touched until :meth:`recompute_end`
        are its uses, needed until :meth:`region_done` (or the end of backward)."""
        i = self._add(EventKind.RECOMPUTE, module)
        self.ends[i] = -1  # open until region_done
        self.stack.append(i)
        return i

    def recompute_end(self) -> None:
        if self.stack and self.events[self.stack[-1]].kind == EventKind.RECOMPUTE:
            self.stack.pop()

    def region_done(self, i: int) -> None:
        """The backward of the call recomputed at event ``i`` is over: its needs end at the next event."""
        self.ends[i] = len(self.events)

    def calls(self, modules) -> dict[int, tuple[int, float]]:
        """Per module of ``modules`` called in forward: (event index of its first call, seconds its calls
        took in all, PRE to POST as recorded)."""
        out: dict[int, tuple[int, float]] = {}
        now = time.perf_counter()
        for i, ev in enumerate(self.events[:self.num_forward or len(self.events)]):
            if ev.kind == EventKind.PRE and ev.key in modules and self.ends[i] > i:
                end = self.times[self.ends[i]] if self.ends[i] < len(self.times) else now
                first, s = out.get(ev.key, (i, 0.0))
                out[ev.key] = (first, s + end - self.times[i])
        return out

    def touch(self, param: int) -> None:
        self.touched.setdefault(param)
        if self.stack:
            uses = self.uses[self.stack[-1]]
            if not uses or uses[-1] != param:
                uses.append(param)

    def unpack(self, param: int, node: object) -> bool:
        """Record a saved parameter read by ``node``; True when it starts a new event."""
        if node is not None and node is self.last_node and self.events[-1].kind == EventKind.UNPACK:
            if param not in self.uses[-1]:
                self.uses[-1].append(param)
            return False
        self.last_node = node
        self.uses[self._add(EventKind.UNPACK, param)].append(param)
        return True

    def grad(self, param: int, nbytes: int) -> None:
        self.last_node = None
        self._add(EventKind.GRAD, param)
        self.max_grad = max(self.max_grad, nbytes)

    def finish(self) -> Trace:
        now = time.perf_counter()
        seconds = tuple(b - a for a, b in zip(self.times, self.times[1:] + [now]))
        overhead = tuple(self.overhead)
        clock = "host"
        if self.timer is not None and self.marks:
            seconds, overhead = self._timed()
            clock = "backend"
        return Trace(
            events=tuple(self.events),
            num_forward=self.num_forward,
            uses=tuple(tuple(dict.fromkeys(u)) for u in self.uses),
            ends=tuple(len(self.events) if e < 0 else e for e in self.ends),
            touched=tuple(self.touched),
            activation_peak_bytes=self.activation_peak,
            max_grad_bytes=self.max_grad,
            seconds=seconds,
            overhead=overhead,
            clock=clock,
        )

    def _timed(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per event, the timer's seconds to the next event (the last: to now) and the excluded part."""
        if self.timer is None:
            raise ValueError("no timer")
        n = len(self.marks)
        flat: list[object] = list(self.marks)
        for _, begin, end in self.excluded_marks:
            flat += [begin, end]
        flat.append(self.timer.mark())  # the end of the last event, and the latest mark: Timer.seconds waits for it
        at = self.timer.seconds(flat)
        seconds = tuple(max(0.0, b - a) for a, b in zip(at[:n], [*at[1:n], at[-1]]))
        overhead = [0.0] * n
        for j, (i, _, _) in enumerate(self.excluded_marks):
            overhead[i] += max(0.0, at[n + 1 + 2 * j] - at[n + 2 * j])
        return seconds, tuple(overhead)
