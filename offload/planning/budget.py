"""Memory floors and the budget error: the least device memory a model needs (from a recorded forward, or
as the leanest plan's arena), and :class:`BudgetTooSmallError` with its breakdown and what to try."""

from __future__ import annotations

from typing import Sequence

from ..config import format_bytes
from ..errors import BudgetTooSmallError
from .buckets import Bucket, locate
from .intervals import grad_intervals, need_intervals
from .layout import layout_buffers
from .trace import EventKind, Trace


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


def min_arena_bytes(trace: Trace, buckets: Sequence[Bucket], itemsize: int) -> int:
    """Arena bytes of the leanest plan for ``trace``: every bucket streamed just in time, nothing kept
    (what :func:`build_plan` reports when even that does not fit). The rest of the budget is what
    activations, fixed buffers and the largest gradient may use at most."""
    bucket_of = locate(buckets)[0]
    needs = need_intervals(trace, bucket_of, merge_phase=False)
    grads = grad_intervals(trace, buckets, bucket_of)
    _, layout = layout_buffers(trace, buckets, itemsize, frozenset(), (needs, grads))
    return layout.total_bytes
