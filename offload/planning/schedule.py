"""The scheduler: which buckets stay on the device, when each streamed one is fetched and released, and
where every device buffer lives in the arena (pure: data in, frozen Plan out).

Policy: the greedy cost-model scheduler (:func:`build_plan`). It starts from "everything streamed", with
each bucket's copy placed as late as possible while still arriving before use given the copy queue
(or, where memory is tighter, just in time); it simulates the step (``offload/planning/simulate.py``) and then
repeatedly takes the move that removes the most simulated stall per byte of device memory: keep a bucket
on the device for the whole step (resident), or keep it between its last forward use and its first
backward use (the last layers). Once no stall is left, it goes on taking the moves that save the most
copy time per byte, so that spare budget still cuts traffic. Every point of that sequence is simulated;
the plan is the fastest point whose memory fits the budget. The sequence does not depend on the budget
(the budget only says where it stops), so a larger budget never gives a slower plan.

[Note: event positions] A buffer lives on the half-open interval [start, end) of event indices. At event
``i`` the runtime (1) releases the buffers whose ``end == i`` (recording "compute done with it"),
(2) issues the copies of buffers whose ``start == i`` (each waits for the release of the earlier
buffers that share its memory: ``Buffer.after``), then (3) waits for the buckets event ``i`` needs.
Because of (1) before (2), two buffers with touching intervals may share memory.

[Note: waits on earlier buffers] ``Buffer.after`` lists, for each byte of a buffer's memory, the buffer
that last released that byte before it: its memory's last occupants, not every earlier one (that list
grows with the square of the buffers: 10^7 entries for 10,000 streamed buckets). That is enough: an
occupant ``j`` was itself written only after the occupants before it were released (its own ``after``)
and released only after compute was done with it, so once ``j``'s release event has completed, so have
theirs. It relies on every buffer that ended before this one having run in this step, which holds
while the runtime is on the plan (it issues and releases buffers in event order, and leaves the plan,
fetching on demand, at the first departure).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import enum
import functools
import gc
import itertools
import operator
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..config import format_bytes
from ..errors import BudgetTooSmallError
from .arena import plan_arena_columns
from .buckets import Bucket, locate
from .hw import PRESETS, HardwareModel
from .simulate import (
    STEP_START,
    Bound,
    FlatWaits,
    LaneResult,
    Program,
    SimResult,
    _each,
    physical_bound,
    simulate,
    simulate_arrays,
)
from .trace import EventKind, Trace

try:
    from .. import _C
except ImportError:  # a source tree without the built extension: the Python references run
    _C = None

ARENA_ALIGN = 256  # bytes; every bucket view starts on a 256-byte boundary (what cudaMalloc gives)
DEFAULT_HW = PRESETS["pcie4"]  # the cost model's hardware when the caller gives none (``offload probe`` measures)


class BufferKind(enum.Enum):
    PARAM = "param"
    """A bucket's parameters on the device."""
    GRAD = "grad"
    """A bucket's gradient slot: grads are gathered here, then copied to the host in one transfer."""


@dataclass(frozen=True)
class Buffer:
    bucket: int
    kind: BufferKind
    start: int
    end: int
    size: int
    offset: int
    after: tuple[int, ...]  # last earlier occupants of its memory: writing it waits for their release
    # (see [Note: waits on earlier buffers])


@dataclass(frozen=True)
class EventActions:
    release: tuple[int, ...] = ()  # buffer ids whose last use is over
    prefetch: tuple[int, ...] = ()  # buffer ids whose host-to-device copy is issued here
    need: tuple[int, ...] = ()  # buckets that must have arrived before this event's compute


@dataclass(frozen=True)
class Plan:
    buckets: tuple[Bucket, ...]
    trace: Trace
    resident: tuple[int, ...]  # buckets kept on the device across steps
    buffers: tuple[Buffer, ...]
    actions: tuple[EventActions, ...]  # one per trace event
    grad_buffer: tuple[int | None, ...]  # per bucket: its grad slot buffer id this step
    resident_buffer: tuple[int | None, ...]  # per bucket: its whole-step buffer id if resident
    arena_bytes: int
    lower_bound_bytes: int
    budget_bytes: int
    fixed_bytes: int  # module buffers and other engine memory outside the arena
    itemsize: int  # bytes per element of the compute dtype on the device
    strategy: str
    simulated: SimResult | None = None  # the cost model's prediction for this plan (greedy plans)
    hw_name: str = ""  # the hardware model that prediction used
    # what the backend's runtime holds beyond the plan (cuBLAS workspaces, allocator rounding; 0 on the CPU
    # backend): kept out of the budget ([Note: headroom] in backend/cuda.py)
    headroom_bytes: int = 0

    @property
    def activation_bytes(self) -> int:
        return self.trace.activation_peak_bytes

    @property
    def peak_bytes(self) -> int:
        """Planned device peak: arena + activations + fixed + the largest grad autograd materialises + the
        backend's headroom."""
        return (self.arena_bytes + self.trace.activation_peak_bytes + self.fixed_bytes + self.trace.max_grad_bytes
                + self.headroom_bytes)

    @property
    def capacity_bytes(self) -> int:
        """What the budget leaves for the arena: budget - activations - fixed - largest grad - headroom."""
        return (self.budget_bytes - self.trace.activation_peak_bytes - self.fixed_bytes - self.trace.max_grad_bytes
                - self.headroom_bytes)

    def summary(self) -> dict:
        resident = set(self.resident)
        streamed = [b for b in range(len(self.buckets)) if b not in resident]
        fetches = sum(1 for x in self.buffers if x.kind is BufferKind.PARAM and x.bucket not in resident)
        return {
            "num_buckets": len(self.buckets),
            "resident_buckets": len(self.resident),
            "streamed_buckets": len(streamed),
            "fetches_per_step": fetches,
            "largest_bucket_bytes": max((b.nbytes(self.itemsize) for b in self.buckets), default=0),
            "arena_bytes": self.arena_bytes,
            "arena_lower_bound_bytes": self.lower_bound_bytes,
            "activation_bytes": self.activation_bytes,
            "planned_peak_bytes": self.peak_bytes,
            "headroom_bytes": self.headroom_bytes,
            "strategy": self.strategy,
            "events": len(self.trace.events),
            "predicted_step_s": self.simulated.step_s if self.simulated is not None else None,
            "hw": self.hw_name,
        }


# ---------------------------------------------------------------------------------------------------------
# needs


def _need_intervals(trace: Trace, bucket_of: Sequence[int], merge_phase: bool) -> dict[int, list[list[int]]]:
    """Per bucket: sorted, merged [start, end) event intervals during which it must be on the device."""
    raw: dict[int, list[list[int]]] = {}
    for i, uses in enumerate(trace.uses):
        for p in uses:
            raw.setdefault(bucket_of[p], []).append([i, trace.ends[i]])
    f = trace.num_forward
    out = {}
    for b, ivs in raw.items():
        ivs.sort()
        merged = [ivs[0][:]]
        for s, e in ivs[1:]:
            last = merged[-1]
            same_phase = (last[0] < f) == (s < f)
            if s <= last[1] or (merge_phase and same_phase):
                last[1] = max(last[1], e)
            else:
                merged.append([s, e])
        out[b] = merged
    return out


def _with_prefetch(needs: dict[int, list[list[int]]], lookahead: bool) -> dict[int, list[list[int]]]:
    """Move each interval's start back to when its copy is issued, merging a bucket's intervals that
    would then overlap (it simply stays)."""
    if not lookahead:
        return needs
    starts = sorted({s for ivs in needs.values() for s, _ in ivs})
    prev = {s: (starts[k - 1] if k else s) for k, s in enumerate(starts)}
    out = {}
    for b, ivs in needs.items():
        moved: list[list[int]] = []
        for s, e in ivs:
            p = prev[s]
            if moved and p <= moved[-1][1]:
                moved[-1][1] = max(moved[-1][1], e)
            else:
                moved.append([p, e])
        out[b] = moved
    return out


def _grad_intervals(trace: Trace, buckets: Sequence[Bucket], bucket_of: Sequence[int]) -> dict[int, list[int]]:
    """Per bucket with grads: its grad slot's [first grad, last grad + 1), or to the end of backward,
    ``len(events)``, for a bucket flushed then."""
    return _grad_info(trace, buckets, bucket_of)[0]


def _grad_issue(trace: Trace, buckets: Sequence[Bucket], bucket_of: Sequence[int]) -> dict[int, int]:
    """Per bucket with grads: the event at which its grads go to the host (its last grad, or the end of
    backward, ``len(events)``, for a bucket flushed then)."""
    return _grad_info(trace, buckets, bucket_of)[1]


def _grad_info(trace: Trace, buckets: Sequence[Bucket], bucket_of: Sequence[int]):
    """(:func:`_grad_intervals`, :func:`_grad_issue`), from :func:`_grad_arrays`."""
    return _grad_dicts(*_grad_arrays(trace, buckets, bucket_of))


def _grad_dicts(b, start, end, issue):
    """:func:`_grad_arrays`' arrays as :func:`_grad_info`'s two dicts (slot [start, end], issue) by bucket."""
    b, start, end, issue = b.tolist(), start.tolist(), end.tolist(), issue.tolist()
    return dict(zip(b, map(list, zip(start, end)))), dict(zip(b, issue))


def _grad_arrays(trace: Trace, buckets: Sequence[Bucket], bucket_of: Sequence[int]):
    """Per bucket with grads, in the order of their first grads: (bucket, slot start, slot end, issue) as
    int64 arrays (what :func:`_grad_info_reference` computes with a loop over the events)."""
    events = trace.events
    n = len(events)
    kinds = np.fromiter(map(operator.attrgetter("kind"), events), dtype=np.int64, count=n)
    at = np.flatnonzero(kinds == EventKind.GRAD)
    keys = np.fromiter(map(operator.attrgetter("key"), map(events.__getitem__, at.tolist())), dtype=np.int64,
                       count=len(at))
    owner = np.asarray(bucket_of, dtype=np.int64).reshape(-1)
    b = owner[keys]
    buckets_with, first = np.unique(b, return_index=True)
    last = len(b) - 1 - np.unique(b[::-1], return_index=True)[1]
    # complete: every touched parameter of the bucket's runs has its grad (a run's parameters are its
    # bucket's, so "has a grad" is "is the key of some grad event")
    params = np.fromiter(itertools.chain.from_iterable(run.params for x in buckets_with.tolist()
                                                       for run in buckets[x].runs), dtype=np.int64)
    missing = np.zeros(len(owner), dtype=bool)
    missing[np.fromiter(trace.touched, dtype=np.int64, count=len(trace.touched))] = True
    missing[keys] = False
    incomplete = np.zeros(len(buckets), dtype=bool)
    incomplete[owner[params[missing[params]]]] = True
    by_first = np.argsort(first, kind="stable")
    buckets_with, first, last = buckets_with[by_first], at[first[by_first]], at[last[by_first]]
    # a bucket whose grads are not all seen is flushed at the end of backward: its slot is kept till then
    issue = np.where(incomplete[buckets_with], n, last)
    return buckets_with, first, np.where(issue < n, issue + 1, n), issue


def _grad_info_reference(trace: Trace, buckets: Sequence[Bucket], bucket_of: Sequence[int]):
    """:func:`_grad_info` by a loop over the events (the reference it is tested against)."""
    n = len(trace.events)
    touched = set(trace.touched)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    got: dict[int, set[int]] = {}
    grad = EventKind.GRAD
    for i, key in [(i, ev.key) for i, ev in enumerate(trace.events) if ev.kind == grad]:
        b = bucket_of[key]
        first.setdefault(b, i)
        last[b] = i
        got.setdefault(b, set()).add(key)
    intervals, issue = {}, {}
    for b, s in first.items():
        expected = {p for run in buckets[b].runs for p in run.params if p in touched}
        # A bucket whose grads are not all seen is flushed at the end of backward: keep its slot till then.
        complete = got[b] >= expected
        intervals[b] = [s, last[b] + 1 if complete else n]
        issue[b] = last[b] if complete else n
    return intervals, issue


# ---------------------------------------------------------------------------------------------------------
# layout


@dataclass(frozen=True)
class _Strategy:
    name: str
    merge_phase: bool
    lookahead: bool


STRATEGIES = (
    _Strategy("lookahead, keep within phase", merge_phase=True, lookahead=True),
    _Strategy("lookahead", merge_phase=False, lookahead=True),
    _Strategy("just in time", merge_phase=False, lookahead=False),
)


def _intervals(trace, buckets, bucket_of, strategy):
    """What a layout needs that does not depend on residency: per bucket its param-buffer intervals
    (prefetch moved in) and its grad-slot interval. Computed once per strategy."""
    needs = _with_prefetch(_need_intervals(trace, bucket_of, strategy.merge_phase), strategy.lookahead)
    return needs, _grad_intervals(trace, buckets, bucket_of)


def _layout(trace, buckets, itemsize, resident, intervals):
    n = len(trace.events)
    needs, grads = intervals
    specs: list[tuple[int, BufferKind, int, int, int]] = []  # bucket, kind, start, end, size
    for b in range(len(buckets)):
        size = buckets[b].nbytes(itemsize)
        if b in resident:
            specs.append((b, BufferKind.PARAM, 0, n, size))
        else:
            specs.extend((b, BufferKind.PARAM, s, e, size) for s, e in needs.get(b, []))
    for b, (s, e) in sorted(grads.items()):
        specs.append((b, BufferKind.GRAD, s, e, buckets[b].grad_nbytes(itemsize)))
    return _arena_of([x for x in specs if x[4] > 0])


def _arena_of(specs, columns=None):
    """``specs`` (bucket, kind, start, end, size) and the arena layout of their buffers. ``columns``: their
    sizes, starts and ends as int64 arrays, where the caller has them (else taken from ``specs``)."""
    sizes, starts, ends = columns if columns is not None else ([x[4] for x in specs], [x[2] for x in specs],
                                                               [x[3] for x in specs])
    layout = plan_arena_columns(sizes, starts, ends, alignment=ARENA_ALIGN, stop_at_bound=True)
    return specs, layout


def _after(specs, offsets) -> list[tuple[int, ...]]:
    """For each buffer, the last earlier occupants of its memory: see [Note: waits on earlier buffers].
    The sweep of :func:`_after_reference`, in C++ (``cpp/schedule_kernels.cpp``; tested against it)."""
    if _C is None or not specs:
        return _after_reference(specs, offsets)
    ptr, got = _C.last_occupants([x[2] for x in specs], [x[3] for x in specs], offsets,
                                 [o + x[4] for o, x in zip(offsets, specs)])
    return [tuple(got[a:b]) for a, b in zip(ptr, ptr[1:])]


def _after_reference(specs, offsets) -> list[tuple[int, ...]]:
    """For each buffer, the last earlier occupants of its memory: see [Note: waits on earlier buffers].

    One sweep over the events, keeping a map from arena byte ranges to the buffer that last released
    them (released buffers paint their range, a newly issued buffer reads the ranges under it): O(n log n)
    plus the size of the answer, which is a few buffers each rather than every earlier one.
    """
    items = []  # (event, 0 release | 1 issue, buffer)
    for k, x in enumerate(specs):
        items.append((x[3], 0, k))
        items.append((x[2], 1, k))
    items.sort()
    bounds = [0]  # segment starts, ascending; segment i is [bounds[i], bounds[i + 1]) (the last one unbounded)
    owner: list[int | None] = [None]  # the buffer that last released each segment
    out: list[tuple[int, ...]] = [()] * len(specs)

    def split(at: int) -> int:
        """Make ``at`` a segment start; return its index."""
        i = bisect.bisect_right(bounds, at) - 1
        if bounds[i] != at:
            bounds.insert(i + 1, at)
            owner.insert(i + 1, owner[i])
            i += 1
        return i

    for _, issue, k in items:
        lo = offsets[k]
        hi = lo + specs[k][4]
        if issue:
            i = bisect.bisect_right(bounds, lo) - 1
            got = set()
            while i < len(bounds) and bounds[i] < hi:
                if owner[i] is not None:
                    got.add(owner[i])
                i += 1
            out[k] = tuple(sorted(got))
        else:
            i, j = split(lo), split(hi)
            bounds[i:j] = [lo]
            owner[i:j] = [k]
    return out


def _assemble(trace, buckets, itemsize, resident, name, specs, layout, budget, fixed, *, simulated=None,
              hw_name="", needs=None) -> Plan:
    n = len(trace.events)
    if needs is None:  # per event: the buckets it needs (the greedy scheduler has them already)
        bucket_of = locate(buckets)[0]
        needs = _needed_all(trace, bucket_of)
    after = _after(specs, layout.offsets)
    make = _maker(Buffer)
    buffers = tuple(make(b, kind, s, e, size, off, aft)
                    for (b, kind, s, e, size), off, aft in zip(specs, layout.offsets, after))
    release: dict[int, list[int]] = {}  # per event with any: buffer ids, ascending
    prefetch: dict[int, list[int]] = {}
    grad_buffer: list[int | None] = [None] * len(buckets)
    resident_buffer: list[int | None] = [None] * len(buckets)
    grad = BufferKind.GRAD
    for k, (b, kind, s, e, _) in enumerate(specs):
        if kind is grad:
            grad_buffer[b] = k
        elif b in resident:
            resident_buffer[b] = k
        else:
            prefetch.setdefault(s, []).append(k)
            if e < n:
                release.setdefault(e, []).append(k)
    return Plan(
        buckets=tuple(buckets), trace=trace, resident=tuple(sorted(resident)), buffers=buffers,
        actions=_actions(release, prefetch, needs),
        grad_buffer=tuple(grad_buffer), resident_buffer=tuple(resident_buffer),
        arena_bytes=layout.total_bytes, lower_bound_bytes=layout.lower_bound_bytes,
        budget_bytes=budget, fixed_bytes=fixed, itemsize=itemsize, strategy=name, simulated=simulated,
        hw_name=hw_name)


def _maker(cls):
    """A constructor for the frozen dataclass ``cls`` taking every field positionally, for the tens of
    thousands of buffers and actions of a large plan: it fills the instance dict at once (what the
    generated ``__init__`` does one ``object.__setattr__`` at a time), for about half the cost. The
    objects are the same: equal, equally hashed and printed (``tests/planning/test_schedule.py``)."""
    assert not hasattr(cls, "__post_init__") and "__slots__" not in vars(cls), f"{cls.__name__}: use its __init__"
    names = tuple(f.name for f in dataclasses.fields(cls))
    new = object.__new__

    def make(*values):
        obj = new(cls)
        obj.__dict__.update(zip(names, values))
        return obj
    return make


def _actions(release: dict[int, list[int]], prefetch: dict[int, list[int]], needs) -> tuple[EventActions, ...]:
    """One EventActions per event (``needs``: one per event; ``release``, ``prefetch``: buffer ids of the
    events with any); events with neither releases nor prefetches share one object per distinct need
    (they are frozen)."""
    make = _maker(EventActions)
    idle: dict[tuple[int, ...], EventActions] = {}
    out = []
    for i, need in enumerate(needs):
        r, p = release.get(i), prefetch.get(i)
        if r or p:
            out.append(make(tuple(r or ()), tuple(p or ()), need))
        else:
            x = idle.get(need)
            if x is None:
                x = idle[need] = make((), (), need)
            out.append(x)
    return tuple(out)


def _needed(trace: Trace, i: int, bucket_of: Sequence[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(bucket_of[p] for p in trace.uses[i]))


def _needed_all(trace: Trace, bucket_of: Sequence[int]) -> list[tuple[int, ...]]:
    """``[_needed(trace, i, bucket_of) for each event i]``, the common cases (no use, one use) short."""
    out = []
    for uses in trace.uses:
        if not uses:
            out.append(())
        elif len(uses) == 1:
            out.append((bucket_of[uses[0]],))
        else:
            out.append(tuple(dict.fromkeys(bucket_of[p] for p in uses)))
    return out


# ---------------------------------------------------------------------------------------------------------
# public


def build_plan(trace: Trace, buckets: Sequence[Bucket], *, itemsize: int, budget_bytes: int,
               fixed_bytes: int, hw: HardwareModel | None = None,
               compute_s: Sequence[float] | None = None, headroom_bytes: int = 0) -> Plan:
    """The greedy cost-model plan (see the module docstring) that fits ``budget_bytes``.

    ``hw`` defaults to :data:`DEFAULT_HW`; ``compute_s`` (seconds of compute per trace event) defaults to
    the trace's own :attr:`Trace.compute_seconds`; ``headroom_bytes`` (the backend's, see
    :attr:`Plan.headroom_bytes`) is kept out of the budget. Raises :class:`BudgetTooSmallError` when even
    streaming everything just in time does not fit.
    """
    with _gc_paused():
        return _build_plan(trace, buckets, itemsize, budget_bytes, fixed_bytes, hw, compute_s, headroom_bytes)


@contextlib.contextmanager
def _gc_paused():
    """Pause Python's cyclic garbage collector (not reference counting) while planning.

    A plan for 10,000 buckets allocates some 10^5 long-lived objects (buffers, actions, tuples); each
    batch of survivors triggers a full collection that walks every object in the process (torch's
    included): about half of the planning time at 10,000 buckets. The planner makes no reference cycles
    to collect; the collector is restored (if it was on) when planning ends."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _build_plan(trace, buckets, itemsize, budget_bytes, fixed_bytes, hw, compute_s, headroom_bytes) -> Plan:
    hw = hw or DEFAULT_HW
    compute = _compute_times(trace, compute_s)
    g = _Greedy(trace, buckets, itemsize, hw, compute)
    extra = trace.activation_peak_bytes + fixed_bytes + trace.max_grad_bytes + headroom_bytes
    points = g.candidates(budget_bytes - extra)
    while points:
        best = min(p.step_s for p in points)
        point = max((p for p in points if p.step_s <= best * (1 + 1e-9)), key=lambda p: p.rank)
        specs, layout = g.layout(point.resident, point.flat)
        if layout.total_bytes + extra <= budget_bytes:
            plan = _assemble(trace, buckets, itemsize, point.resident, f"greedy ({point.mode})", specs, layout,
                             budget_bytes, fixed_bytes, simulated=point.sim, hw_name=hw.name, needs=g.needs)
            return dataclasses.replace(plan, headroom_bytes=headroom_bytes) if headroom_bytes else plan
        points = [p for p in points if p is not point]  # its arena fragments past the budget: next best
    jit = {b: [list(iv) for iv in ivs] for b, ivs in g.uses.items()}
    _, layout = _layout(trace, buckets, itemsize, frozenset(), (jit, g.grads))
    raise budget_error(budget_bytes, arena=max(layout.total_bytes, budget_bytes - extra + 1),
                       activations=trace.activation_peak_bytes, fixed=fixed_bytes, grad=trace.max_grad_bytes,
                       headroom=headroom_bytes)


def _compute_times(trace: Trace, compute_s: Sequence[float] | None) -> tuple[float, ...]:
    if compute_s is None:
        compute_s = trace.compute_seconds
    if len(compute_s) != len(trace.events):
        raise ValueError(f"compute_s has {len(compute_s)} entries for {len(trace.events)} trace events")
    seconds = np.asarray(compute_s, dtype=np.float64)
    if not (seconds >= 0).all():  # negatives and NaN
        raise ValueError("compute_s must be non-negative seconds")
    return tuple(seconds.tolist())


# ---------------------------------------------------------------------------------------------------------
# the greedy cost-model scheduler

MODES = ("latest", "lookahead", "just in time")
"""Where a streamed bucket's copy is issued. ``latest``: as late as possible while still arriving before
use, given the copy queue (a backward pass over the copies in deadline order). ``lookahead``: when the
previous streamed use begins (double buffering). ``just in time``: at the event that needs it (the least
memory; the copy is waited for)."""

MAX_POINTS = 32  # simulated points per mode's sequence at most ~this many moves apart (speed on huge traces)


@dataclass(frozen=True)
class _Point:
    """One simulated point of a mode's move sequence."""

    mode: str
    resident: frozenset
    flat: np.ndarray  # streamed buffers: rows (issue, bucket, end), in copy order
    lanes: SimResult | LaneResult  # what simulating it gave (``sim``: as a SimResult)
    peak: int  # max live arena bytes (the arena's lower bound)
    rank: tuple  # tie-break among equally fast points: fewest bytes copied, most resident, then mode order

    @property
    def step_s(self) -> float:
        return self.lanes.step_s

    @property
    def sim(self) -> SimResult:
        return self.lanes.result() if isinstance(self.lanes, LaneResult) else self.lanes

    @property
    def streamed(self) -> dict[int, list[list[int]]]:
        """Per streamed bucket: its buffers [issue, end), in event order."""
        out: dict[int, list[list[int]]] = {}
        for p, b, e in self.flat.tolist():
            out.setdefault(b, []).append([p, e])
        return out


class _Greedy:
    """Everything about one (trace, buckets, hardware) that the moves do not change, computed once."""

    def __init__(self, trace: Trace, buckets: Sequence[Bucket], itemsize: int, hw: HardwareModel,
                 compute: tuple[float, ...]):
        self.trace, self.buckets, self.hw, self.compute = trace, buckets, hw, compute
        self.n = len(trace.events)
        bucket_of = locate(buckets)[0]
        grad_b, grad_s, grad_e, grad_issue = _grad_arrays(trace, buckets, bucket_of)
        self.grads, self.grad_issue = _grad_dicts(grad_b, grad_s, grad_e, grad_issue)  # _grad_info's
        self.needs = _needed_all(trace, bucket_of)
        # every (event, bucket) need, flattened in event order: for the program's waits
        lens = [len(bs) for bs in self.needs]
        self.need_ptr = list(itertools.accumulate(lens, initial=0))  # event i's needs: [ptr[i], ptr[i + 1])
        self.need_b = np.fromiter(itertools.chain.from_iterable(self.needs), dtype=np.int64, count=self.need_ptr[-1])
        self.need_e = np.repeat(np.arange(self.n, dtype=np.int64), np.asarray(lens, dtype=np.int64))
        # The need intervals, merged (``_need_intervals(merge_phase=False)``), as arrays grouped by bucket,
        # each bucket's in event order (what ``placed`` starts from): the needs sorted by (bucket, event),
        # each [event, its end); a new interval starts where one starts after every earlier one of its
        # bucket ended (a running max of the ends, offset per bucket so that it never crosses buckets).
        order = _lexsort((self.need_e, self.need_b), (self.n + 1, len(buckets)))
        b, start = self.need_b[order], self.need_e[order]
        big = self.n + 1
        reach = np.maximum.accumulate(b * big + np.asarray(trace.ends, dtype=np.int64)[start])
        new = np.ones(len(b), dtype=bool)
        new[1:] = (b[1:] != b[:-1]) | (start[1:] > reach[:-1] - b[1:] * big)
        last = np.ones(len(b), dtype=bool)
        last[:-1] = new[1:]
        self.use_b, self.use_s, self.use_e = b[new], start[new], reach[last] - b[last] * big
        self.n_used = len(np.unique(self.use_b))  # buckets any event needs
        nb = len(buckets)
        self.nbytes = [b.nbytes(itemsize) for b in buckets]
        self.nbytes_np = np.asarray(self.nbytes, dtype=np.int64).reshape(nb)
        self.size_np = (self.nbytes_np + ARENA_ALIGN - 1) // ARENA_ALIGN * ARENA_ALIGN  # _align
        self.size = self.size_np.tolist()
        grad_bytes = np.fromiter((buckets[b].grad_nbytes(itemsize) for b in grad_b.tolist()), dtype=np.int64,
                                 count=len(grad_b))
        self.grad_bytes = dict(zip(grad_b.tolist(), grad_bytes.tolist()))
        dur = {x: hw.h2d_seconds(x) for x in set(self.nbytes)}  # one call per distinct size
        self.dur = [dur[x] for x in self.nbytes]
        self.compute_np = np.asarray(compute, dtype=np.float64).reshape(self.n)
        # compute reaches event i at tau[i]: sequential sums from 0.0 (np.add.accumulate adds in order, as
        # itertools.accumulate(compute, initial=0.0) does)
        self.tau_np = np.add.accumulate(np.concatenate([np.zeros(1), self.compute_np]))
        # live grad-slot bytes change: + at each slot's start, - at its end (integer sums: exact in any order)
        slot_bytes = (grad_bytes + ARENA_ALIGN - 1) // ARENA_ALIGN * ARENA_ALIGN  # _align
        self.grad_profile_np = np.zeros(self.n + 1, dtype=np.int64)
        np.add.at(self.grad_profile_np, grad_s, slot_bytes)
        np.add.at(self.grad_profile_np, grad_e, -slot_bytes)
        # the device-to-host side of every program (it does not depend on the point): by (issue, bucket)
        d2h = np.lexsort((grad_b, grad_issue))
        d2h_b = grad_b[d2h].tolist()
        self.d2h = dict(d2h_event=tuple(grad_issue[d2h].tolist()), d2h_bucket=tuple(d2h_b),
                        d2h_bytes=tuple(grad_bytes[d2h].tolist()),
                        adam_numel=tuple(self.buckets[b].trainable_numel for b in d2h_b))
        self.dur_np = np.asarray(self.dur, dtype=np.float64).reshape(nb)
        self.updated = np.zeros(nb, dtype=bool)  # per bucket: has grads (refreshed when resident)
        self.updated[grad_b] = True
        self.updated_dur = np.where(self.updated, self.dur_np, 0.0)
        # keepable: buckets used in forward and again in backward. Per keepable bucket: the start and the row
        # of its last forward interval (``fwd_*``) and of its first backward one (``bwd_*``), which is its
        # first interval starting at or after ``num_forward`` and not its first interval.
        backward = self.use_s >= trace.num_forward
        first_bwd = backward.copy()
        first_bwd[1:] &= (self.use_b[1:] == self.use_b[:-1]) & ~backward[:-1]
        first_bwd[:1] = False
        r = np.flatnonzero(first_bwd)
        self.keepable = self.use_b[r]
        self.fwd_at = np.zeros(nb, dtype=np.int64)
        self.bwd_at = np.zeros(nb, dtype=np.int64)
        self.fwd_row = np.zeros(nb, dtype=np.int64)
        self.bwd_row = np.zeros(nb, dtype=np.int64)
        self.fwd_at[self.keepable], self.bwd_at[self.keepable] = self.use_s[r - 1], self.use_s[r]
        self.fwd_row[self.keepable], self.bwd_row[self.keepable] = r - 1, r
        self.need_key = self.need_b * (self.n + 1) + self.need_e
        self.need_ptr_np = np.asarray(self.need_ptr, dtype=np.int64)
        self._table = np.zeros((max(1, self.n.bit_length()), max(1, self.n)), dtype=np.int64)  # moves' _MaxTable
        # what every simulated point passes to the lanes unchanged
        d = self.d2h
        self.d2h_arrays = (np.asarray(d["d2h_event"], dtype=np.int64),
                           np.asarray(_each(hw.d2h_seconds, d["d2h_bytes"]), dtype=np.float64),
                           np.asarray(_each(hw.adam_seconds, d["adam_numel"]), dtype=np.float64))
        self.d2h_total = sum(d["d2h_bytes"])
        self._kernel = None  # the C++ move sequence (``candidates``), built at its first use

    @property
    def uses(self) -> dict[int, list[tuple[int, int]]]:
        """Per needed bucket: its need intervals [start, end), in event order."""
        out: dict[int, list[tuple[int, int]]] = {}
        for b, s, e in zip(self.use_b.tolist(), self.use_s.tolist(), self.use_e.tolist()):
            out.setdefault(b, []).append((s, e))
        return out

    # -- one point --------------------------------------------------------------------------------------

    def placed(self, mode: str, resident: frozenset, keep: frozenset) -> np.ndarray:
        """The streamed buffers [issue, end) with copies placed by ``mode``, as rows (issue, bucket, end)
        in copy-queue order (sorted). Vectorised over the need intervals, grouped by bucket:

        * a kept bucket's last forward and first backward intervals become one;
        * ``latest``: a backward pass over the copies in (need, bucket) order, each as late as the copy
          queue allows (sequential: each depends on the next); ``lookahead``: at the previous distinct
          need start; ``just in time``: at the need;
        * a copy issued before the bucket's previous interval ends merges into it (the bucket stays).
        """
        s, e, b = self.use_s, self.use_e.copy(), self.use_b
        nb = len(self.buckets)
        live = np.ones(len(b), dtype=bool)
        if resident:
            live &= ~np.isin(b, np.fromiter(resident, dtype=np.int64, count=len(resident)))
        if keep:
            kb = np.fromiter(keep, dtype=np.int64, count=len(keep))
            e[self.fwd_row[kb]] = e[self.bwd_row[kb]]
            live[self.bwd_row[kb]] = False
        s, e, b = s[live], e[live], b[live]  # grouped by bucket, each bucket's intervals in event order
        if mode == "just in time":
            p = s
        elif mode == "lookahead":
            starts = np.sort(s)  # np.unique(s), by sorting (faster than its hash table)
            starts = starts[np.concatenate([np.ones(min(1, len(starts)), dtype=bool), starts[1:] != starts[:-1]])]
            j = np.searchsorted(starts, s)
            p = np.where(j > 0, starts[np.maximum(j - 1, 0)], s)
        else:
            order = _lexsort((b, s), (nb, self.n + 1))
            latest = _latest_issue(self.tau_np[s[order]], self.dur_np[b[order]])
            p = np.empty(len(order), dtype=np.int64)
            p[order] = np.minimum(s[order], np.maximum(0, np.searchsorted(self.tau_np, latest, side="right") - 1))
        # merge: a new buffer starts where the bucket changes or the copy comes after the previous end
        new = np.ones(len(b), dtype=bool)
        new[1:] = (b[1:] != b[:-1]) | (p[1:] > e[:-1])
        last = np.ones(len(b), dtype=bool)
        last[:-1] = new[1:]
        rows = np.stack([p[new], b[new], e[last]], axis=1)
        return rows[_lexsort((rows[:, 2], rows[:, 1], rows[:, 0]), (self.n + 1, nb, self.n + 1))]

    def flat(self, streamed: dict) -> np.ndarray:
        """The streamed buffers as rows (issue, bucket, end), sorted: the order of their copies in the
        host-to-device queue (``program``)."""
        rows = [(p, b, e) for b, ivs in streamed.items() for p, e in ivs]
        rows.sort()
        return np.array(rows, dtype=np.int64).reshape(len(rows), 3)

    def copies(self, resident: frozenset, flat: np.ndarray):
        """The host-to-device copies of a point and what each event waits for, as arrays: (number of
        refreshes ``m``, each copy's bucket, the waits' ``ptr`` and ``copies`` as in :class:`FlatWaits`).
        The copies are the ``m`` refreshes (resident buckets updated last step: refreshed before this
        step's forward, runtime.step), then the streamed buffers in ``flat`` order."""
        n = self.n
        refresh = [b for b in sorted(resident) if b in self.grads]
        m = len(refresh)
        # A need of bucket b at event i waits for b's first copy ending after i (copies of a bucket are
        # disjoint and in event order): one search over the copies sorted by (bucket, end).
        cb = np.concatenate([np.asarray(refresh, dtype=np.int64), flat[:, 1]])
        ce = np.concatenate([np.full(m, n, dtype=np.int64), flat[:, 2]])
        order = _lexsort((ce, cb), (n + 1, len(self.buckets)))
        found = np.full(len(self.need_b), -1, dtype=np.int64)
        if len(order):
            q = np.minimum(np.searchsorted(cb[order] * (n + 1) + ce[order], self.need_key, side="right"),
                           len(order) - 1)
            hit = cb[order][q] == self.need_b
            found[hit] = order[q[hit]]
            has_copy = np.bincount(cb, minlength=len(self.buckets))[self.need_b] > 0
            assert not (has_copy & ~hit).any(), "a bucket is needed where none of its buffers is live"
        # -1: resident and not updated, already there (no wait)
        waited = found >= 0
        if waited.all():
            ptr = self.need_ptr_np
        else:
            ptr = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(np.bincount(self.need_e[waited], minlength=n), out=ptr[1:])
            found = found[waited]
        return m, cb, ptr, found

    def program(self, resident: frozenset, streamed: dict, flat: np.ndarray | None = None) -> Program:
        if flat is None:
            flat = self.flat(streamed)
        m, cb, ptr, found = self.copies(resident, flat)
        return Program(
            compute_s=self.compute, h2d_event=(STEP_START,) * m + tuple(flat[:, 0].tolist()),
            h2d_bucket=tuple(cb.tolist()), h2d_bytes=tuple(self.nbytes_np[cb].tolist()),
            waits=FlatWaits(ptr.tolist(), found.tolist()), **self.d2h)

    def simulate(self, resident: frozenset, flat: np.ndarray) -> tuple[SimResult | LaneResult, int]:
        """``simulate(self.program(resident, None, flat), hw)`` without building the Program (the same
        numbers: per-copy seconds are ``hw``'s for the same byte counts), and the number of refreshes.
        A :class:`LaneResult` where the C++ lanes ran (``.result()`` is the SimResult)."""
        m, cb, ptr, found = self.copies(resident, flat)
        if _C is not None:
            h2d_event = np.concatenate([np.full(m, STEP_START, dtype=np.int64), flat[:, 0]])
            sim = simulate_arrays(self.compute_np, h2d_event, self.dur_np[cb], ptr, found, *self.d2h_arrays,
                                  False, self.hw.duplex_factor, int(self.nbytes_np[cb].sum()), self.d2h_total,
                                  lazy=True)
            if sim is not None:
                return sim, m
        return simulate(self.program(resident, None, flat), self.hw), m

    def profile(self, resident: frozenset, streamed: dict, flat: np.ndarray | None = None) -> np.ndarray:
        """Live arena bytes at each event (aligned sizes, as the arena planner counts them)."""
        if flat is None:
            flat = self.flat(streamed)
        diff = self.grad_profile_np.copy()
        res = np.fromiter(resident, dtype=np.int64, count=len(resident))
        diff[0] += int(self.size_np[res].sum())
        diff[self.n] -= int(self.size_np[res].sum())
        size = self.size_np[flat[:, 1]]
        np.add.at(diff, flat[:, 0], size)
        np.add.at(diff, flat[:, 2], -size)
        return np.cumsum(diff[:-1])

    def layout(self, resident: frozenset, flat: np.ndarray):
        """``_layout(trace, buckets, itemsize, resident, (streamed, self.grads))`` for the point whose
        streamed buffers are ``flat``, from arrays: the same specs in the same order (per bucket, its
        resident buffer or its streamed ones in event order; then the grad slots by bucket; empty ones
        dropped) and so the same layout."""
        res = np.asarray(sorted(resident), dtype=np.int64)
        b = np.concatenate([res, flat[:, 1]])
        start = np.concatenate([np.zeros(len(res), dtype=np.int64), flat[:, 0]])
        end = np.concatenate([np.full(len(res), self.n, dtype=np.int64), flat[:, 2]])
        order = np.lexsort((end, start, b))
        b, start, end = b[order], start[order], end[order]
        size = self.nbytes_np[b]
        keep = size > 0
        b, start, end, size = b[keep], start[keep], end[keep], size[keep]
        specs = list(zip(b.tolist(), itertools.repeat(BufferKind.PARAM), start.tolist(), end.tolist(), size.tolist()))
        grad_specs, grad_columns = self._grad_specs
        specs.extend(grad_specs)
        return _arena_of(specs, [np.concatenate([x, g]) for x, g in zip((size, start, end), grad_columns)])

    @functools.cached_property
    def _grad_specs(self):
        """The grad slots' specs (by bucket; empty ones dropped) and their (sizes, starts, ends) as arrays."""
        grad = BufferKind.GRAD
        specs = [(g, grad, s, e, self.grad_bytes[g]) for g, (s, e) in sorted(self.grads.items())
                 if self.grad_bytes[g] > 0]
        columns = [np.array([x[k] for x in specs], dtype=np.int64) for k in (4, 2, 3)]
        return specs, columns

    # -- the move sequence ----------------------------------------------------------------------------

    def candidates(self, capacity: int) -> list[_Point]:
        """Every simulated point of every mode's sequence whose live bytes fit ``capacity``: the loop of
        :meth:`candidates_reference`, in C++ where built (``cpp/greedy.cpp``: the same points, field for field
        and bit for bit; ``tests/planning/test_greedy_kernel.py``). Where the C++ loop meets what the reference raises
        on (a stall on a zero-length copy, a score dividing by zero), the reference runs and raises it."""
        if _C is not None:
            points = self._candidates_cpp(capacity)
            if points is not None:
                return points
        return self.candidates_reference(capacity)

    def _candidates_cpp(self, capacity: int) -> list[_Point] | None:
        if self._kernel is None:
            self._kernel = _C.GreedyKernel(
                self.n, len(self.buckets), self.use_b, self.use_s, self.use_e, self.size_np, self.nbytes_np,
                self.dur_np, self.updated_dur, self.updated.astype(np.int64),
                self.fwd_row, self.bwd_row, self.fwd_at, self.bwd_at, self.keepable, self.tau_np,
                self.grad_profile_np, self.need_b, self.need_e, self.compute_np, *self.d2h_arrays,
                self.hw.duplex_factor, self.n_used, MAX_POINTS)
        capacity = min(max(capacity, -1), 2 ** 62)  # live bytes are >= 0 and far below 2^62
        points = []
        for m, mode in enumerate(MODES):
            got, fallback = self._kernel.points(m, capacity)
            if fallback:
                return None
            for res, flat, *lanes, h2d_bytes, peak, resident_bytes in got:
                sim = LaneResult(*lanes, h2d_bytes, self.d2h_total)
                points.append(_Point(mode, frozenset(res.tolist()), flat, sim, peak, (-h2d_bytes, resident_bytes, -m)))
        return points

    def candidates_reference(self, capacity: int) -> list[_Point]:
        """Every simulated point of every mode's sequence whose live bytes fit ``capacity`` (the Python loop)."""
        points = []
        for m, mode in enumerate(MODES):
            resident, keep = frozenset(), frozenset()
            while True:
                flat = self.placed(mode, resident, keep)
                prof = self.profile(resident, None, flat)
                peak = int(prof.max()) if len(prof) else 0
                if peak > capacity:
                    break  # resident bytes only grow along the sequence: every later point is larger too
                sim, refresh = self.simulate(resident, flat)
                rank = (-sim.h2d_bytes, sum(self.size[b] for b in resident), -m)
                points.append(_Point(mode, resident, flat, sim, peak, rank))
                moves = self.moves(keep, flat, refresh, sim, prof, peak)
                if not moves:
                    break
                res, kept = set(resident), set(keep)
                for kind, b in moves:
                    if kind == "resident":
                        res.add(b)
                        kept.discard(b)
                    else:
                        kept.add(b)
                resident, keep = frozenset(res), frozenset(kept)
        return points

    def moves(self, keep, flat, refresh, sim, prof, peak) -> list[tuple[str, int]]:
        """The next batch of moves, best first: most stall removed per byte while there is stall, then most
        copy time saved per byte. A batch covers the stall seen (at most ~1/MAX_POINTS of the buckets).

        Per streamed bucket ``b`` (vectorised over the buckets; integer byte counts are exact and every
        float is the same operation, in the same order, as a per-bucket loop would do):
        ``resident``: gain = its copies' stall credit (or, once no stall is left, their copy time, less
        one copy if it is updated: that one comes back anyway); cost = the peak increase of holding it
        everywhere. ``keep``: gain = the credit (or time) of the copy of its first backward buffer; cost =
        the peak increase of holding it between its last forward and first backward buffers.
        """
        stalled = sim.stall_s > 0
        nb, m = len(self.buckets), len(flat)
        owner, p, e = flat[:, 1], flat[:, 0], flat[:, 2]
        count = np.bincount(owner, minlength=nb)
        credit = np.asarray(sim.copy_credit[refresh:], dtype=np.float64)
        if stalled:  # sequential sums in copy order (np.bincount adds in index order)
            gain = np.bincount(owner, weights=credit, minlength=nb)
        else:
            gain = np.bincount(owner, weights=self.dur_np[owner], minlength=nb) - self.updated_dur
        rmq = _MaxTable(prof, self._table)
        # per bucket: max live bytes inside its buffers and outside them (its gaps): each bucket's buffers
        # in event order, then a max over each bucket's run (exact: integer maxima in any order)
        order = _lexsort((p, owner), (self.n + 1, nb))
        ob, op, oe = owner[order], p[order], e[order]
        first = np.ones(m, dtype=bool)
        first[1:] = ob[1:] != ob[:-1]
        last = np.ones(m, dtype=bool)
        last[:-1] = first[1:]
        runs, run_b = np.flatnonzero(first), ob[first]
        inside = np.zeros(nb, dtype=np.int64)
        outside = np.zeros(nb, dtype=np.int64)
        if m:
            inside[run_b] = np.maximum.reduceat(rmq.query(op, oe), runs)
            before = rmq.query(np.where(first, 0, np.roll(oe, 1)), op)  # the gap before each buffer
            outside[run_b] = np.maximum(np.maximum.reduceat(before, runs),
                                        rmq.query(oe[last], np.full(len(runs), self.n, dtype=np.int64)))
        size = self.size_np
        cost = np.maximum(0, np.maximum(outside + size, inside) - peak)
        # no stall left: a move of equal traffic still goes in
        res_b = np.flatnonzero((count > 0) & ((gain > 0) | ((gain >= 0) & (not stalled))))
        with np.errstate(divide="raise", invalid="raise"):
            score = gain[res_b] / (cost[res_b] + size[res_b] / 1024)
        cand = [score, res_b, np.ones(len(res_b), dtype=np.int64), gain[res_b]]
        # keep: the buffer holding its last forward use and the one holding its first backward use
        kb = self.keepable[count[self.keepable] > 0]
        if keep:
            kb = kb[~np.isin(kb, np.fromiter(keep, dtype=np.int64, count=len(keep)))]
        if len(kb):
            key = ob * (self.n + 1) + op  # sorted: bucket, then start
            fwd = np.searchsorted(key, kb * (self.n + 1) + self.fwd_at[kb], side="right") - 1
            bwd = np.searchsorted(key, kb * (self.n + 1) + self.bwd_at[kb], side="right") - 1
            split = fwd != bwd
            kb, fwd, bwd = kb[split], fwd[split], bwd[split]
            kgain = credit[order[bwd]] if stalled else self.dur_np[kb]
            kcost = np.maximum(0, rmq.query(oe[fwd], op[bwd]) + size[kb] - peak)
            pos = kgain > 0
            kb, kgain, kcost = kb[pos], kgain[pos], kcost[pos]
            with np.errstate(divide="raise", invalid="raise"):
                kscore = kgain / (kcost + size[kb] / 1024)
            cand = [np.concatenate([a, x]) for a, x in
                    zip(cand, (kscore, kb, np.zeros(len(kb), dtype=np.int64), kgain))]
        score, bs, kinds, gains = cand
        ranked = np.lexsort((bs * 2 + kinds, -score))  # best score, then bucket, then "keep" before "resident"
        cap = max(1, -(-self.n_used // MAX_POINTS))
        # each bucket's best move, in rank order; taken until ``cap`` moves or (while there is stall) until
        # their gains, summed in that order (cumsum adds sequentially), cover it
        # (a bucket is at most one resident and one keep candidate: keep the one ranked first)
        pos = np.empty(len(ranked), dtype=np.int64)
        pos[ranked] = np.arange(len(ranked), dtype=np.int64)
        first_pos = np.full(nb, len(ranked), dtype=np.int64)
        nr = len(res_b)  # each bucket at most once among the resident candidates, and among the keeps
        first_pos[bs[:nr]] = pos[:nr]
        first_pos[bs[nr:]] = np.minimum(first_pos[bs[nr:]], pos[nr:])
        best = ranked[np.sort(first_pos[first_pos < len(ranked)])]
        take = min(cap, len(best))
        if stalled and take:
            covered = np.flatnonzero(np.cumsum(gains[best[:take]]) >= sim.stall_s)
            if len(covered):
                take = int(covered[0]) + 1
        best = best[:take]
        return [("resident" if k else "keep", b) for k, b in zip(kinds[best].tolist(), bs[best].tolist())]


def _lexsort(keys, bounds) -> np.ndarray:
    """``np.lexsort(keys)`` (the last key primary) for integer keys with ``0 <= keys[i] < bounds[i]``: one
    stable argsort of a combined int64 key where it fits (the same permutation, ties included), else
    ``np.lexsort``."""
    if not len(keys[0]) or int(np.prod([float(x) for x in bounds])) >= 2 ** 62:
        return np.lexsort(keys)
    combined = np.zeros(len(keys[0]), dtype=np.int64)
    for key, bound in zip(reversed(keys), reversed(bounds)):  # primary first
        combined *= bound
        combined += key
    return np.argsort(combined, kind="stable")


def _latest_issue(deadline: np.ndarray, duration: np.ndarray):
    """``latest``'s backward pass over the copies in (need, bucket) order: each copy issues as late as
    the next one allows, ``out[q] = min(deadline[q], out[q + 1]) - duration[q]`` (sequential). In C++
    where built (``cpp/schedule_kernels.cpp``: the same float operations, so bitwise the same)."""
    if _C is None:
        return _latest_issue_reference(deadline.tolist(), duration.tolist())
    return _C.latest_issue(deadline, duration)


def _latest_issue_reference(deadline: Sequence[float], duration: Sequence[float]) -> list[float]:
    out = [0.0] * len(deadline)
    nxt = float("inf")
    for q in reversed(range(len(deadline))):
        nxt = min(deadline[q], nxt) - duration[q]
        out[q] = nxt
    return out


class _MaxTable:
    """Range maximum over a fixed array, queried for many ranges at once (a sparse table, one row per
    power-of-two span, so that a batch of queries is two gathers). ``buffer``: a (levels, len) int64
    array to build it in (reused across points), or None."""

    def __init__(self, values: np.ndarray, buffer: np.ndarray | None = None):
        values = np.asarray(values, dtype=np.int64)
        n = len(values)
        shape = (max(1, n.bit_length()), max(1, n))  # row j: max of 2^j values from each start
        self.table = buffer if buffer is not None and buffer.shape == shape else np.zeros(shape, dtype=np.int64)
        self.table[0, :n] = values
        for j in range(1, len(self.table)):
            h = 1 << (j - 1)
            m = n - 2 * h + 1
            np.maximum(self.table[j - 1, :m], self.table[j - 1, h:h + m], out=self.table[j, :m])

    def query(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """max(values[lo:hi]) for each pair; 0 for an empty range."""
        length = hi - lo
        live = length > 0
        if not live.all():
            out = np.zeros(len(lo), dtype=np.int64)
            out[live] = self.query(lo[live], hi[live])
            return out
        j = np.frexp(length.astype(np.float64))[1] - 1  # floor(log2(length)), exact
        row = j * self.table.shape[1]  # gathers from the flat table (faster than 2-D fancy indexing)
        flat = self.table.reshape(-1)
        return np.maximum(flat.take(row + lo), flat.take(row + hi - (1 << j)))


def _align(n: int) -> int:
    return (n + ARENA_ALIGN - 1) // ARENA_ALIGN * ARENA_ALIGN


# ---------------------------------------------------------------------------------------------------------
# simulating and bounding any plan


def program_of(plan: Plan, compute_s: Sequence[float] | None = None) -> Program:
    """The lane program of a plan (what :func:`offload.planning.simulate.simulate` runs)."""
    g = _Greedy(plan.trace, plan.buckets, plan.itemsize, DEFAULT_HW, _compute_times(plan.trace, compute_s))
    resident = frozenset(plan.resident)
    streamed: dict[int, list[list[int]]] = {}
    for x in plan.buffers:
        if x.kind is BufferKind.PARAM and x.bucket not in resident:
            streamed.setdefault(x.bucket, []).append([x.start, x.end])
    return g.program(resident, {b: sorted(ivs) for b, ivs in streamed.items()})


def simulate_plan(plan: Plan, hw: HardwareModel, compute_s: Sequence[float] | None = None) -> SimResult:
    return simulate(program_of(plan, compute_s), hw)


def least_traffic(trace: Trace, buckets: Sequence[Bucket], itemsize: int, capacity: int) -> dict[str, int]:
    """The fewest bytes any plan of this engine moves per step: every updated bucket comes back to the
    device once (new weights) and sends its grads once; buckets used but not updated stream only what
    ``capacity`` (arena bytes available) cannot hold."""
    bucket_of = locate(buckets)[0]
    grads = _grad_intervals(trace, buckets, bucket_of)
    used = {bucket_of[p] for uses in trace.uses for p in uses}
    updated = sum(buckets[b].nbytes(itemsize) for b in grads)
    others = sum(buckets[b].nbytes(itemsize) for b in used - set(grads))
    return {"h2d": updated + max(0, others - max(0, capacity)),
            "d2h": sum(buckets[b].grad_nbytes(itemsize) for b in grads),
            "adam_numel": sum(buckets[b].trainable_numel for b in grads)}


def plan_bound(plan: Plan, hw: HardwareModel, compute_s: Sequence[float] | None = None) -> Bound:
    """The physical bound for this plan's trace, buckets and budget (not for the plan's own choices)."""
    compute = _compute_times(plan.trace, compute_s)
    t = plan.trace
    least = least_traffic(t, plan.buckets, plan.itemsize, plan.capacity_bytes)
    return physical_bound(sum(compute), least["h2d"], least["d2h"], least["adam_numel"], hw)


def forward_min_budget(events, uses, ends, buckets: Sequence[Bucket], specs, itemsize: int, *,
                       activations: int, fixed: int, headroom: int = 0) -> dict[str, int]:
    """The least device memory any plan needs, from a recorded forward (before backward is seen): the
    buckets the deepest stack of active module calls needs at once, one grad slot, the largest grad
    autograd materialises, activations, fixed buffers and the backend's headroom."""
    bucket_of = locate(buckets)[0]
    nbytes = [b.nbytes(itemsize) for b in buckets]
    worst = 0
    stack: list[tuple[int, set[int]]] = []
    for i, ev in enumerate(events):
        while stack and stack[-1][0] <= i:
            stack.pop()
        if ev.kind == EventKind.PRE:
            stack.append((ends[i], {bucket_of[p] for p in uses[i]}))
            live = set().union(*(s for _, s in stack))
            worst = max(worst, sum(nbytes[b] for b in live))
    return dict(buckets=worst, grad_slot=max((b.grad_nbytes(itemsize) for b in buckets), default=0),
                grad=max((s.numel * itemsize for s in specs if s.group is not None), default=0),
                activations=activations, fixed=fixed, headroom=headroom)


def budget_error(budget: int, **parts: int) -> BudgetTooSmallError:
    names = {"arena": "parameter buckets and grad slots (streaming everything just in time)",
             "activations": "saved activations", "fixed": "module buffers",
             "grad": "largest parameter gradient in flight", "buckets": "buckets one module call needs at once",
             "grad_slot": "largest bucket grad slot",
             "headroom": "runtime headroom (cuBLAS workspaces, allocator rounding)"}
    need = sum(parts.values())
    parts = dict(sorted(parts.items(), key=lambda kv: -kv[1]))
    detail = ", ".join(f"{names.get(k, k)} {format_bytes(v)}" for k, v in parts.items() if v)
    top = next(iter(parts))
    hint = {"activations": "a smaller batch or sequence length",
            "arena": "a smaller bucket_bytes", "buckets": "a smaller bucket_bytes"}.get(top, "a larger budget")
    return BudgetTooSmallError(
        f"the device budget {format_bytes(budget)} is too small: this model and batch need at least "
        f"{format_bytes(need)} ({detail}). Try budget>={format_bytes(need)} or {hint}.",
        min_budget_bytes=need, budget_bytes=budget, breakdown=parts)


def validate_plan(plan: Plan) -> None:
    """Check the invariants the runtime relies on; raise AssertionError naming the first violation."""
    n = len(plan.trace.events)
    bucket_of = locate(plan.buckets)[0]
    live: list[list[int]] = [[] for _ in range(n)]
    for k, x in enumerate(plan.buffers):
        assert 0 <= x.start < x.end <= n, f"buffer {k} has a bad interval [{x.start}, {x.end})"
        assert x.offset % ARENA_ALIGN == 0 and x.offset + x.size <= plan.arena_bytes, f"buffer {k} outside arena"
        for i in range(x.start, x.end):
            live[i].append(k)
    for i in range(n):
        on_device = {plan.buffers[k].bucket for k in live[i] if plan.buffers[k].kind is BufferKind.PARAM}
        for p in plan.trace.uses[i]:
            assert bucket_of[p] in on_device, f"event {i} needs bucket {bucket_of[p]}, which is not on the device"
        spans = sorted((plan.buffers[k].offset, plan.buffers[k].offset + plan.buffers[k].size) for k in live[i])
        for (a0, a1), (b0, _) in zip(spans, spans[1:]):
            assert a1 <= b0, f"two live buffers overlap in memory at event {i}"
    for k, x in enumerate(plan.buffers):
        for j in x.after:
            y = plan.buffers[j]
            assert y.end <= x.start, f"buffer {k} waits on buffer {j}, which is still live"
    assert plan.peak_bytes <= plan.budget_bytes, (
        f"planned peak {plan.peak_bytes} exceeds the budget {plan.budget_bytes}")


def min_arena_bytes(trace: Trace, buckets: Sequence[Bucket], itemsize: int) -> int:
    """Arena bytes of the leanest plan for ``trace``: every bucket streamed just in time, nothing kept
    (what :func:`build_plan` reports when even that does not fit). The rest of the budget is what
    activations, fixed buffers and the largest gradient may use at most."""
    bucket_of = locate(buckets)[0]
    needs = _need_intervals(trace, bucket_of, merge_phase=False)
    _, layout = _layout(trace, buckets, itemsize, frozenset(), (needs, _grad_intervals(trace, buckets, bucket_of)))
    return layout.total_bytes
