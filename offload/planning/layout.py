"""Laying buffers out in the arena: the buffers a residency choice makes (per bucket, its resident buffer
or its streamed ones; the grad slots), their offsets (``arena.plan_arena_columns``), what each waits on
([Note: waits on earlier buffers] in ``plan.py``), and the frozen :class:`Plan` assembled from them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..errors import InvariantError
from .arena import ArenaLayout, plan_arena_columns
from .buckets import locate
from .greedy_inputs import grad_waits
from .intervals import grad_intervals, need_intervals, needed_all, with_prefetch
from .placement import Placement
from .plan import ARENA_ALIGN, Buffer, BufferKind, EventActions, Plan
from ._reference import buffer_waits_reference

try:
    from .. import _C
except ImportError:  # a source tree without the built extension: the Python references run
    _C = None  # type: ignore[assignment]  # mypy types _C by its stub (offload/_C.pyi)


@dataclass(frozen=True)
class Strategy:
    name: str
    merge_phase: bool
    lookahead: bool


STRATEGIES = (
    Strategy("lookahead, keep within phase", merge_phase=True, lookahead=True),
    Strategy("lookahead", merge_phase=False, lookahead=True),
    Strategy("just in time", merge_phase=False, lookahead=False),
)


def strategy_intervals(trace, buckets, bucket_of, strategy):
    """What a layout needs that does not depend on residency: per bucket its param-buffer intervals
    (prefetch moved in) and its grad-slot interval. Computed once per strategy."""
    needs = with_prefetch(need_intervals(trace, bucket_of, strategy.merge_phase), strategy.lookahead)
    return needs, grad_intervals(trace, buckets, bucket_of)


def layout_buffers(trace, buckets, itemsize, resident, intervals):
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
    return arena_of([x for x in specs if x[4] > 0])


def arena_of(specs, columns=None):
    """``specs`` (bucket, kind, start, end, size) and the arena layout of their buffers. ``columns``: their
    sizes, starts and ends as int64 arrays, where the caller has them (else taken from ``specs``)."""
    sizes, starts, ends = columns if columns is not None else ([x[4] for x in specs], [x[2] for x in specs],
                                                               [x[3] for x in specs])
    stacked = _whole_step_first(np.asarray(sizes, dtype=np.int64), np.asarray(starts, dtype=np.int64),
                                np.asarray(ends, dtype=np.int64))
    if stacked is not None:
        return specs, stacked
    layout = plan_arena_columns(sizes, starts, ends, alignment=ARENA_ALIGN, stop_at_bound=True)
    return specs, layout


def _whole_step_first(sizes: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> ArenaLayout | None:
    """The layout with the buffers live over the whole span (resident buckets) packed from offset 0 in input
    order and the others laid out above them, where that reaches the lower bound (it is then optimal: those
    buffers are a floor under every event's live bytes); None where there are none or it does not (the
    caller lays everything out together, as before).

    Why: the placer's cost grows with the buffers live at once, and a plan keeping thousands of buckets
    resident took it ~1.8 s at 10,000 buckets against 0.03 s for the rest alone (benchmarks/schedule_sim.py
    --chain), once the greedy's points counted the waits on reused grad slots and chose such plans."""
    if not len(sizes):
        return None
    whole = (starts == starts.min()) & (ends == ends.max())
    if not whole.any() or whole.all():
        return None
    rest = ~whole
    above = plan_arena_columns(sizes[rest], starts[rest], ends[rest], alignment=ARENA_ALIGN, stop_at_bound=True)
    if above.total_bytes > above.lower_bound_bytes:
        return None
    aligned = (sizes[whole] + ARENA_ALIGN - 1) // ARENA_ALIGN * ARENA_ALIGN
    base = int(aligned.sum())
    offsets = np.empty(len(sizes), dtype=np.int64)
    offsets[whole] = np.cumsum(aligned) - aligned
    offsets[rest] = np.asarray(above.offsets, dtype=np.int64) + base
    return dataclasses.replace(above, offsets=tuple(offsets.tolist()), total_bytes=above.total_bytes + base,
                               lower_bound_bytes=above.lower_bound_bytes + base,
                               candidates=tuple((h, total + base) for h, total in above.candidates))


def buffer_waits(specs, offsets) -> list[tuple[int, ...]]:
    """For each buffer, the last earlier occupants of its memory: see [Note: waits on earlier buffers].
    The sweep of :func:`buffer_waits_reference`, in C++ (``cpp/schedule_kernels.cpp``; tested against it)."""
    if _C is None or not specs:
        return buffer_waits_reference(specs, offsets)
    ptr, got = _C.last_occupants([x[2] for x in specs], [x[3] for x in specs], offsets,
                                 [o + x[4] for o, x in zip(offsets, specs)])
    return [tuple(got[a:b]) for a, b in zip(ptr, ptr[1:])]


def grad_slot_waits(specs, after, d2h_bucket, n: int):
    """Compute's waits on grad copies that a layout makes, as (ptr, copies) arrays over ``n`` events (what
    ``Greedy.program`` takes): at a grad slot's start, the copy to the host (among ``d2h_bucket``'s, by
    bucket) of every grad slot in its ``after`` ([Note: waits on a reused grad slot] in simulate.py)."""
    grad = BufferKind.GRAD
    pairs = [(x[2], specs[j][0]) for x, aft in zip(specs, after) if x[1] is grad for j in aft
             if specs[j][1] is grad]
    event = np.array([e for e, _ in pairs], dtype=np.int64).reshape(len(pairs))
    bucket = np.array([b for _, b in pairs], dtype=np.int64).reshape(len(pairs))
    return grad_waits(event, bucket, d2h_bucket, n)


def assemble(trace, buckets, itemsize, resident, name, specs, layout, budget, fixed, *, simulated=None,
             hw_name="", needs=None, device=(), after=None) -> Plan:
    """The frozen :class:`Plan` of laid-out buffers. ``resident``: the buckets with a whole-step PARAM
    buffer, ``device`` (a subset) the ones whose optimizer state (a STATE buffer) lives on the device.
    ``after``: :func:`buffer_waits` of the layout, where the caller has it."""
    n = len(trace.events)
    if needs is None:  # per event: the buckets it needs (the greedy scheduler has them already)
        bucket_of = locate(buckets)[0]
        needs = needed_all(trace, bucket_of)
    if after is None:
        after = buffer_waits(specs, layout.offsets)
    make = frozen_maker(Buffer)
    buffers = tuple(make(b, kind, s, e, size, off, aft)
                    for (b, kind, s, e, size), off, aft in zip(specs, layout.offsets, after))
    release: dict[int, list[int]] = {}  # per event with any: buffer ids, ascending
    prefetch: dict[int, list[int]] = {}
    grad_buffer: list[int | None] = [None] * len(buckets)
    resident_buffer: list[int | None] = [None] * len(buckets)
    state_buffer: list[int | None] = [None] * len(buckets)
    grad, state = BufferKind.GRAD, BufferKind.STATE
    for k, (b, kind, s, e, _) in enumerate(specs):
        if kind is grad:
            grad_buffer[b] = k
        elif kind is state:
            state_buffer[b] = k
        elif b in resident:
            resident_buffer[b] = k
        else:
            prefetch.setdefault(s, []).append(k)
            if e < n:
                release.setdefault(e, []).append(k)
    return Plan(
        buckets=tuple(buckets), trace=trace, resident=tuple(sorted(resident)), buffers=buffers,
        actions=event_actions(release, prefetch, needs),
        grad_buffer=tuple(grad_buffer), resident_buffer=tuple(resident_buffer),
        arena_bytes=layout.total_bytes, lower_bound_bytes=layout.lower_bound_bytes,
        budget_bytes=budget, fixed_bytes=fixed, itemsize=itemsize, strategy=name, simulated=simulated,
        hw_name=hw_name, placement=placements(len(buckets), resident, device), state_buffer=tuple(state_buffer))


def placements(nb: int, resident, device) -> tuple[Placement, ...]:
    """Per bucket: device-optimizer if in ``device``, else resident if in ``resident``, else streamed."""
    dev, res = frozenset(device), frozenset(resident)
    if dev - res:
        raise InvariantError(f"device-optimizer buckets {sorted(dev - res)} are not resident")
    on = (Placement.STREAMED, Placement.RESIDENT)
    return tuple(Placement.DEVICE_OPTIMIZER if b in dev else on[b in res] for b in range(nb))


def frozen_maker(cls):
    """A constructor for the frozen dataclass ``cls`` taking every field positionally, for the tens of
    thousands of buffers and actions of a large plan: it fills the instance dict at once (what the
    generated ``__init__`` does one ``object.__setattr__`` at a time), for about half the cost. The
    objects are the same: equal, equally hashed and printed (``tests/planning/test_schedule.py``)."""
    if hasattr(cls, "__post_init__") or "__slots__" in vars(cls):
        raise InvariantError(f"{cls.__name__} has __post_init__ or __slots__: build it with its __init__")
    names = tuple(f.name for f in dataclasses.fields(cls))
    new = object.__new__

    def make(*values):
        obj = new(cls)
        obj.__dict__.update(zip(names, values))
        return obj
    return make


def event_actions(release: dict[int, list[int]], prefetch: dict[int, list[int]], needs) -> tuple[EventActions, ...]:
    """One EventActions per event (``needs``: one per event; ``release``, ``prefetch``: buffer ids of the
    events with any); events with neither releases nor prefetches share one object per distinct need
    (they are frozen)."""
    make = frozen_maker(EventActions)
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
