"""A picture of one step: per-lane slices and device bytes, as Chrome-trace JSON (Perfetto, chrome://tracing)
and as a memory plot.

Two sources, one format:

* :func:`measured` (``Engine.export_timeline``): the last completed step of a running engine: its (last)
  forward and backward and the copies and updates issued from them to the end of ``step()``. The compute lane comes from the step's own trace (the
  wall time of every hook event, as the planner sees it); the copy and CPU-AdamW lanes from the start
  and end times their lane threads recorded (:class:`LaneLog`); the counter from the engine's device-byte
  accounting after every change.
* :func:`simulated` (``offload report --timeline``): the cost model's step for a plan,
  :func:`offload.planning.simulate.simulate_reference` with its ``record`` of every piece of work.

Tracks: ``compute`` (module calls nested as in the model, backward nodes, gradient events, stalls),
``H2D`` (one slice per bucket copy), ``D2H`` (one per bucket's gradient copy), ``CPU AdamW`` (one per
bucket update), and a counter track ``device memory`` with the device bytes and the budget.

[Note: lane times on CUDA] On the CUDA backend the copies run on CUDA streams, which record no host-side
times; :class:`LaneLog` keeps only work whose event says when it ran (the CPU backend's copy lanes and
the CPU-AdamW lane on any backend). On a GPU the copy tracks stay empty and the JSON says so
(``otherData.lanes_without_times``); a ``torch.profiler`` trace shows them (the backend names every phase
with ``record_function("offload::...")``).
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import OffloadError
from ..planning.schedule import program_of
from ..planning.simulate import simulate_reference

if TYPE_CHECKING:
    from ..runtime.core import Runtime

LANES = ("compute", "h2d", "d2h", "cpu_adam")
_TRACK = {"compute": (1, "compute"), "stall": (1, "compute"), "h2d": (2, "H2D (host to device)"),
          "d2h": (3, "D2H (device to host)"), "cpu_adam": (4, "CPU AdamW")}


@dataclass(frozen=True)
class Span:
    """One piece of work on one lane; times in seconds from the start of the step."""

    lane: str  # compute, stall (drawn on compute), h2d, d2h, cpu_adam
    name: str
    start: float
    end: float
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Timeline:
    source: str  # "measured" or "simulated"
    spans: tuple[Span, ...]
    memory: tuple[tuple[float, int], ...]  # (seconds from the start of the step, device bytes)
    budget_bytes: int
    other: dict = field(default_factory=dict)  # goes to the JSON's otherData

    def count(self, lane: str) -> int:
        return sum(1 for s in self.spans if s.lane == lane)

    def chrome_trace(self) -> dict:
        """The Trace Event Format dict: ``ph: X`` slices on one thread per lane, ``ph: C`` counters."""
        events: list[dict] = [{"ph": "M", "pid": 1, "name": "process_name",
                               "args": {"name": f"offload step ({self.source})"}}]
        for tid, name in sorted(set(_TRACK.values())):
            events.append({"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": name}})
            events.append({"ph": "M", "pid": 1, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
        # Longer first at equal starts: a viewer nests a module call's children inside it only in that order.
        for s in sorted(self.spans, key=lambda s: (s.start, -(s.end - s.start))):
            events.append({"ph": "X", "pid": 1, "tid": _TRACK[s.lane][0], "name": s.name, "cat": s.lane,
                           "ts": _us(s.start), "dur": max(_us(s.end) - _us(s.start), 0.0), "args": s.args})
        for t, nbytes in self.memory:
            events.append({"ph": "C", "pid": 1, "name": "device memory", "ts": _us(t),
                           "args": {"device bytes": nbytes, "budget bytes": self.budget_bytes}})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"source": self.source, "budget_bytes": self.budget_bytes, **self.other}}

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`chrome_trace` as JSON to ``path`` (open it in https://ui.perfetto.dev)."""
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)

    def plot_memory(self, path: str | os.PathLike) -> None:
        """Draw device bytes over the step against the budget line into an image (PNG by the suffix)."""
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(9, 3.5))
        if self.memory:
            t, b = zip(*self.memory)
            ax.step([x * 1e3 for x in t], [x / 2**20 for x in b], where="post", label="device bytes")
        ax.axhline(self.budget_bytes / 2**20, color="red", linestyle="--", label="budget")
        ax.set_xlabel("time in the step (ms)")
        ax.set_ylabel("MiB")
        ax.set_title(f"device memory over one step ({self.source})")
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise OffloadError('--plot needs matplotlib, which is not installed: pip install matplotlib '
                           '(or the "bench" extra)') from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    return plt


# ---------------------------------------------------------------------------------------------------------
# measured


class LaneLog:
    """The copies and updates the runtime issued: ``(lane, bucket, bytes, issued at, event)``. Their events
    carry the lane's start and end times once run (``HostEvent.started``/``finished``).

    Held per step, so a long run keeps nothing more (the leak tests count objects): ``step_done`` moves what
    was issued since the previous step, and the device-byte samples of that time, to ``last_step`` and starts
    afresh. Bounded too (``maxlen`` each) for a loop that only evaluates and never steps."""

    MAXLEN = 1 << 14

    def __init__(self) -> None:
        self.entries: deque = deque(maxlen=self.MAXLEN)
        # (the step's last forward+backward's Recorder, when step() ended, entries, device-byte samples)
        self.last_step: tuple | None = None

    def add(self, lane: str, bucket: int, nbytes: int, event: Any) -> None:
        self.entries.append((lane, bucket, nbytes, time.perf_counter(), event))

    def step_done(self, recorder, memory) -> None:
        """``step()`` ended: the step to show is ``recorder``'s forward and backward and what was issued up to
        now (a later evaluation forward records into a new Recorder and is not part of it)."""
        self.last_step = (recorder, time.perf_counter(), self.entries, memory.take_samples())
        self.entries = deque(maxlen=self.MAXLEN)


def measured(runtime: Runtime, names: Sequence[str]) -> Timeline:
    """The last recorded step of ``runtime`` (see the module docstring). ``names``: module names in
    ``module.named_modules()`` order, which is the order the runtime numbers modules in."""
    ctx = runtime.ctx
    if ctx.lane_log.last_step is None:
        raise OffloadError("no training step to show: export_timeline shows the last completed step (forward, "
                           "backward and step()), so call it after at least one optimizer step")
    rec, t_end, entries, samples = ctx.lane_log.last_step
    runtime.wait_for_updates()
    ctx.backend.synchronize()  # the refresh copies step() issued may still be running: wait for their times
    t0 = rec.times[0]
    starts = [t - t0 for t in rec.times]
    stops = starts[1:] + starts[-1:]  # an event lasts until the next one; the last one has no measured end
    spans = _event_spans(rec.events, rec.ends, starts, stops, names, runtime.slots.bucket_of)
    no_times = set()
    for lane, bucket, nbytes, issued, event in list(entries):
        if not t0 <= issued <= t_end:
            continue
        start, end = getattr(event, "started", None), getattr(event, "finished", None)
        if start is None or end is None:
            no_times.add(lane)
            continue
        what = "AdamW" if lane == "cpu_adam" else "copy"
        args = {"bucket": bucket, "issued_ms": round((issued - t0) * 1e3, 6)} | ({"bytes": nbytes} if nbytes else {})
        spans.append(Span(lane, f"{what} bucket {bucket}", start - t0, end - t0, args))
    memory = tuple((t - t0, n) for t, n in list(samples) if t0 <= t <= t_end)
    other = {"lanes_without_times": sorted(no_times)} if no_times else {}
    return Timeline("measured", tuple(spans), memory, ctx.config.budget, other)


def _event_spans(events, event_ends, starts, stops, names, bucket_of) -> list[Span]:
    """Compute-lane slices of a trace: one per module call (its PRE to its POST, so calls nest) and one per
    backward event (from it to the next event)."""
    spans = []
    n = len(events)
    for i, ev in enumerate(events):
        kind, key = int(ev.kind), ev.key
        if kind == 0:  # PRE: the call lasts until its POST
            j = event_ends[i] if 0 <= event_ends[i] < n else n - 1
            end = starts[j] if j > i else stops[i]
            spans.append(Span("compute", names[key] or "(model)", starts[i], end, {"module": key, "event": i}))
        elif kind in (2, 3, 4):
            args = {"event": i}
            if kind == 2:
                args["bucket"] = bucket_of[key] if key < len(bucket_of) else None
                label = f"backward (reads bucket {args['bucket']})"
            elif kind == 3:
                args["param"] = key
                label = "grad"
            else:
                label = f"recompute {names[key]}"
            spans.append(Span("compute", label, starts[i], stops[i], args))
    return spans


# ---------------------------------------------------------------------------------------------------------
# simulated


def simulated(plan, hw, names: Sequence[str] | None = None, compute_s: Sequence[float] | None = None) -> Timeline:
    """The cost model's step for ``plan`` on ``hw`` (what ``plan.simulated`` predicts, lane by lane). The
    memory counter is the plan's: the arena buffers live at each event plus module buffers, and, as one
    constant, the activations and the largest gradient autograd materialises (the trace knows their peak,
    not their shape over time), so its top is ``plan.peak_bytes``."""
    program = program_of(plan, compute_s)
    record: list = []
    result = simulate_reference(program, hw, record)
    trace = plan.trace
    n = len(trace.events)
    names = list(names) if names is not None else [f"module {i}" for i in range(max(
        (e.key for e in trace.events if int(e.kind) in (0, 1, 4)), default=-1) + 1)]
    bucket_of = {p: b for b, bucket in enumerate(plan.buckets) for p in bucket.params}
    starts, stops = [0.0] * n, [0.0] * n
    spans = []
    for lane, k, start, end in record:
        if lane == "compute":
            starts[k], stops[k] = start, end
        elif lane == "stall":
            spans.append(Span("stall", "wait for H2D", start, end, {"event": k}))
        elif lane == "h2d":
            b = program.h2d_bucket[k]
            spans.append(Span("h2d", f"copy bucket {b}", start, end, {"bucket": b, "bytes": program.h2d_bytes[k]}))
        elif lane == "d2h":
            b = program.d2h_bucket[k]
            spans.append(Span("d2h", f"copy bucket {b}", start, end, {"bucket": b, "bytes": program.d2h_bytes[k]}))
        else:
            b = program.d2h_bucket[k]
            spans.append(Span("cpu_adam", f"AdamW bucket {b}", start, end, {"bucket": b}))
    spans += _event_spans(trace.events, trace.ends, starts, stops, names, _Lookup(bucket_of))
    constant = plan.fixed_bytes + trace.activation_peak_bytes + trace.max_grad_bytes
    memory = []
    delta = [0] * (n + 1)
    for x in plan.buffers:
        delta[max(x.start, 0)] += x.size
        delta[min(x.end, n)] -= x.size
    live = 0
    for i in range(n):
        live += delta[i]
        memory.append((starts[i], constant + live))
    memory.append((result.step_s, constant + live + delta[n]))
    other = {"hw": getattr(hw, "name", ""), "predicted_step_s": result.step_s, "planned_peak_bytes": plan.peak_bytes,
             "memory_counter": "plan buffers live at each event + module buffers + activation peak + largest grad"}
    return Timeline("simulated", tuple(spans), tuple(memory), plan.budget_bytes, other)


class _Lookup:
    """``bucket_of[param]`` for a dict, as _event_spans reads a list."""

    def __init__(self, d: dict) -> None:
        self.d = d

    def __len__(self) -> int:
        return max(self.d, default=-1) + 1

    def __getitem__(self, p: int):
        return self.d.get(p)
