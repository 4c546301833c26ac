"""Memory floors and the budget error: the least device memory a model needs (from a recorded forward, or
as the leanest plan's arena), and :class:`BudgetTooSmallError` with its breakdown and what to try."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..config import format_bytes
from ..errors import BudgetTooSmallError, InvariantError
from .buckets import Bucket, locate
from .intervals import grad_intervals, need_intervals
from .layout import layout_buffers
from .trace import Event, EventKind, Trace

if TYPE_CHECKING:
    from .greedy import Greedy


def forward_min_budget(events, uses, ends, buckets: Sequence[Bucket], specs, itemsize: int, *,
                       activations: int, fixed: int, headroom: int = 0) -> dict[str, int]:
    """A floor under the least device memory any plan needs, from a recorded forward (before backward is
    seen): the buckets the deepest stack of active module calls needs at once, activations, fixed buffers
    and the backend's headroom. Every part is in the minimum :func:`build_plan` names (its arena holds at
    least the buckets live at any event, beside the activation peak, buffers and headroom), so a budget
    under this floor is too small for sure, and one above it may still be (issue 18: what backward adds,
    grad slots and the largest gradient, is known only once a step was traced; counting its worst cases
    here refused budgets that train, 1.5x the real minimum on a three-layer MLP)."""
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
    return dict(buckets=worst, activations=activations, fixed=fixed, headroom=headroom)


def mirrored_step(events, uses, ends, buckets: Sequence[Bucket], specs, itemsize: int, *, activations: int,
                  seconds: Sequence[float] = ()) -> Trace:
    """A whole step made from a recorded forward alone, for an *estimate* of the minimum budget before
    backward ran: backward reads each forward call's parameters again, in reverse call order (one node per
    call), and a trainable parameter's gradient is final after the backward of its first forward call
    (``seconds``: the forward's per event; backward events reuse the forward call's). The largest gradient
    is the largest trainable parameter's. Real backwards differ (a node reads only the saved weight, not the
    bias; frozen layers at the bottom read nothing), so the plan of this step estimates; the engine's
    minimum after a traced step is exact."""
    n = len(events)
    seconds = list(seconds) if len(seconds) == n else [0.0] * n
    out_events, out_uses, out_ends = list(events), [tuple(u) for u in uses], list(ends)
    out_seconds = list(seconds)
    first_call: dict[int, int] = {}
    for i in range(n):
        for p in uses[i]:
            first_call.setdefault(p, i)
    graded: set[int] = set()
    for i in reversed(range(n)):
        if events[i].kind != EventKind.PRE or not uses[i]:
            continue
        out_events.append(Event(EventKind.UNPACK, uses[i][0]))
        out_uses.append(tuple(uses[i]))
        out_ends.append(len(out_events))
        out_seconds.append(seconds[i])
        for p in uses[i]:
            if first_call[p] == i and specs[p].group is not None and p not in graded:
                graded.add(p)
                out_events.append(Event(EventKind.GRAD, p))
                out_uses.append(())
                out_ends.append(len(out_events))
                out_seconds.append(0.0)
    touched = tuple(dict.fromkeys(p for u in uses for p in u))
    max_grad = max((specs[p].numel * itemsize for p in graded), default=0)
    return Trace(events=tuple(out_events), num_forward=n, uses=tuple(out_uses), ends=tuple(out_ends),
                 touched=touched, activation_peak_bytes=activations, max_grad_bytes=max_grad,
                 seconds=tuple(out_seconds))


def budget_error(budget: int, **parts: int) -> BudgetTooSmallError:
    names = {"arena": "parameter buckets and grad slots (streaming everything just in time)",
             "activations": "saved activations", "fixed": "module buffers",
             "grad": "largest parameter gradient in flight", "buckets": "buckets one module call needs at once",
             "headroom": "runtime headroom (cuBLAS workspaces, allocator rounding, transients measured)"}
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


def min_arena_bytes(trace: Trace, buckets: Sequence[Bucket], itemsize: int) -> int:
    """Arena bytes of the leanest plan for ``trace``: every bucket streamed just in time, nothing kept
    (what :func:`build_plan` reports when even that does not fit). The rest of the budget is what
    activations, fixed buffers and the largest gradient may use at most."""
    bucket_of = locate(buckets)[0]
    needs = need_intervals(trace, bucket_of, merge_phase=False)
    grads = grad_intervals(trace, buckets, bucket_of)
    _, layout = layout_buffers(trace, buckets, itemsize, frozenset(), (needs, grads))
    return layout.total_bytes


def leanest_arena_bytes(g: Greedy, start: int) -> int:
    """The smallest arena any point of ``g``'s move sequences lays out in: with the other device bytes
    (activations, fixed buffers, the largest gradient, headroom) on top, the least budget at which
    :func:`~offload.planning.schedule.build_plan` returns a plan (issue 18: the minimum it reports is this, not a
    sum of worst cases).

    [Note: the tight minimum budget]
    ``build_plan`` accepts a budget ``B`` when some point ``p`` of the (budget-independent) sequences has
    live bytes ``peak(p) <= B - extra`` and an arena layout of ``total(p) <= B - extra``. A layout is never
    below its live bytes, so that is ``min_p total(p) <= B - extra``: the least ``B`` is ``extra + min_p
    total(p)``, exactly. Laying out every point would cost a layout each; in increasing ``peak`` order the
    search stops at the first point whose ``peak`` is not below the best layout found (no later one can beat
    it). ``start`` (e.g. the just-in-time arena) bounds the first pass: the sequences are simulated only up
    to that many live bytes, and beyond it only if no point within it lays out in ``start`` bytes."""

    def leanest(capacity: int) -> int | None:
        best = None
        for p in sorted(g.candidates(capacity), key=lambda p: p.peak):
            if best is not None and p.peak >= best:
                break
            total = g.layout(p.resident, p.flat)[1].total_bytes
            best = total if best is None else min(best, total)
        return best

    first = leanest(start)
    if first is not None and first <= start:
        return first  # every point left out has more live bytes than start, so a larger arena
    # points with live bytes in (start, first) may still lay out in less than first
    second = leanest(2**62 if first is None else first - 1)
    found = [x for x in (first, second) if x is not None]
    if not found:
        raise InvariantError("the greedy's move sequences have no point at all")
    return min(found)
