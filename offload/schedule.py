"""The first scheduler: which buckets stay on the device, when each streamed one is fetched and
released, and where every device buffer lives in the arena (pure: data in, frozen Plan out).

Policy (the greedy cost-model scheduler replaces it): stream every bucket with a one-bucket lookahead
(a bucket's copy is issued when the previous group of buckets starts being used), release it after its
last use in each phase, refetch it for backward; then make buckets resident, most-fetched first, as long
as the planned peak fits the budget.

[Note: event positions] A buffer lives on the half-open interval [start, end) of event indices. At event
``i`` the runtime (1) releases the buffers whose ``end == i`` (recording "compute done with it"),
(2) issues the copies of buffers whose ``start == i`` (each waits for the release of every earlier
buffer that shares its memory: ``Buffer.after``), then (3) waits for the buckets event ``i`` needs.
Because of (1) before (2), two buffers with touching intervals may share memory.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

from .buckets import Bucket, locate
from .config import format_bytes
from .errors import BudgetTooSmallError
from .memory import Interval, plan_arena
from .trace import EventKind, Trace

ARENA_ALIGN = 256  # bytes; every bucket view starts on a 256-byte boundary (what cudaMalloc gives)


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
    after: tuple[int, ...]  # earlier buffers sharing memory: writing this one waits for their release


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

    @property
    def activation_bytes(self) -> int:
        return self.trace.activation_peak_bytes

    @property
    def peak_bytes(self) -> int:
        """Planned device peak: arena + activations + fixed + the largest grad autograd materialises."""
        return self.arena_bytes + self.trace.activation_peak_bytes + self.fixed_bytes + self.trace.max_grad_bytes

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
            "strategy": self.strategy,
            "events": len(self.trace.events),
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
    n = len(trace.events)
    touched = set(trace.touched)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    got: dict[int, set[int]] = {}
    for i, ev in enumerate(trace.events):
        if ev.kind == EventKind.GRAD:
            b = bucket_of[ev.key]
            first.setdefault(b, i)
            last[b] = i
            got.setdefault(b, set()).add(ev.key)
    out = {}
    for b, s in first.items():
        expected = {p for run in buckets[b].runs for p in run.params if p in touched}
        # A bucket whose grads are not all seen is flushed at the end of backward: keep its slot till then.
        out[b] = [s, last[b] + 1 if got[b] >= expected else n]
    return out


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
    specs = [x for x in specs if x[4] > 0]
    layout = plan_arena([Interval(size=x[4], start=x[2], end=x[3]) for x in specs], alignment=ARENA_ALIGN)
    return specs, layout


def _after(specs, offsets) -> list[tuple[int, ...]]:
    """For each buffer, the earlier buffers (ended before it starts) whose memory it reuses."""
    order = sorted(range(len(specs)), key=lambda k: specs[k][2])
    out: list[tuple[int, ...]] = [()] * len(specs)
    for k in order:
        lo, hi = offsets[k], offsets[k] + specs[k][4]
        out[k] = tuple(j for j in range(len(specs))
                       if specs[j][3] <= specs[k][2] and offsets[j] < hi and lo < offsets[j] + specs[j][4])
    return out


def _assemble(trace, buckets, itemsize, resident, strategy, specs, layout, budget, fixed) -> Plan:
    n = len(trace.events)
    bucket_of = locate(buckets)[0]
    after = _after(specs, layout.offsets)
    buffers = tuple(Buffer(b, kind, s, e, size, layout.offsets[k], after[k])
                    for k, (b, kind, s, e, size) in enumerate(specs))
    release: list[list[int]] = [[] for _ in range(n)]
    prefetch: list[list[int]] = [[] for _ in range(n)]
    grad_buffer: list[int | None] = [None] * len(buckets)
    resident_buffer: list[int | None] = [None] * len(buckets)
    for k, x in enumerate(buffers):
        if x.kind is BufferKind.GRAD:
            grad_buffer[x.bucket] = k
        elif x.bucket in resident:
            resident_buffer[x.bucket] = k
        else:
            prefetch[x.start].append(k)
            if x.end < n:
                release[x.end].append(k)
    return Plan(
        buckets=tuple(buckets), trace=trace, resident=tuple(sorted(resident)), buffers=buffers,
        actions=tuple(EventActions(tuple(release[i]), tuple(prefetch[i]), _needed(trace, i, bucket_of))
                      for i in range(n)),
        grad_buffer=tuple(grad_buffer), resident_buffer=tuple(resident_buffer),
        arena_bytes=layout.total_bytes, lower_bound_bytes=layout.lower_bound_bytes,
        budget_bytes=budget, fixed_bytes=fixed, itemsize=itemsize, strategy=strategy.name)


def _needed(trace: Trace, i: int, bucket_of: Sequence[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(bucket_of[p] for p in trace.uses[i]))


# ---------------------------------------------------------------------------------------------------------
# public


def build_plan(trace: Trace, buckets: Sequence[Bucket], *, itemsize: int, budget_bytes: int,
               fixed_bytes: int) -> Plan:
    """The plan with the most resident buckets that fits ``budget_bytes``.

    Raises :class:`BudgetTooSmallError` when even streaming everything just in time does not fit.
    """
    bucket_of = locate(buckets)[0]
    extra = trace.activation_peak_bytes + fixed_bytes + trace.max_grad_bytes
    chosen = None
    for strategy in STRATEGIES:
        intervals = _intervals(trace, buckets, bucket_of, strategy)
        specs, layout = _layout(trace, buckets, itemsize, frozenset(), intervals)
        if layout.total_bytes + extra <= budget_bytes:
            chosen = strategy
            break
    if chosen is None:
        raise budget_error(budget_bytes, arena=layout.total_bytes, activations=trace.activation_peak_bytes,
                           fixed=fixed_bytes, grad=trace.max_grad_bytes)
    # Greedy residency: the buckets fetched most often first (each saves that many copies per step), then
    # the smallest (more buckets fit). Keep one only if the whole plan still fits.
    needs = intervals[0]
    candidates = sorted(range(len(buckets)),
                        key=lambda b: (-len(needs.get(b, ())), buckets[b].numel, b))
    resident: set[int] = set()
    for b in candidates:
        trial = resident | {b}
        t_specs, t_layout = _layout(trace, buckets, itemsize, trial, intervals)
        if t_layout.total_bytes + extra <= budget_bytes:
            resident, specs, layout = trial, t_specs, t_layout
    return _assemble(trace, buckets, itemsize, resident, chosen, specs, layout, budget_bytes, fixed_bytes)


def forward_min_budget(events, uses, ends, buckets: Sequence[Bucket], specs, itemsize: int, *,
                       activations: int, fixed: int) -> dict[str, int]:
    """The least device memory any plan needs, from a recorded forward (before backward is seen): the
    buckets the deepest stack of active module calls needs at once, one grad slot, the largest grad
    autograd materialises, activations and fixed buffers."""
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
                activations=activations, fixed=fixed)


def budget_error(budget: int, **parts: int) -> BudgetTooSmallError:
    names = {"arena": "parameter buckets and grad slots (streaming everything just in time)",
             "activations": "saved activations", "fixed": "module buffers",
             "grad": "largest parameter gradient in flight", "buckets": "buckets one module call needs at once",
             "grad_slot": "largest bucket grad slot"}
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
