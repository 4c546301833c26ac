"""Forward-only plans: which plan a forward under ``torch.no_grad()`` follows, and keeping the plans of
recent no-grad paths.

[Note: forward-only plans] A forward under torch.no_grad() (evaluation, generate()) has no backward to keep
buckets for or prefetch for: it runs its own plan, built from a recorded no-grad forward. Recent no-grad
paths keep their plans. A forward takes the path that followed the previous one last time, if it starts at
the module called, else the latest that does (generate() on T5 calls the encoder, then the model computing
cross-attention keys, then the model reading them from its cache: three paths, always in that order).
Switching plans frees one arena before the other is allocated (``PlanExecutor.choose``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from ..errors import BudgetTooSmallError
from ..planning.schedule import Plan, build_plan, validate_plan
from ..planning.trace import Event, EventKind, Trace

if TYPE_CHECKING:
    from ..planning.buckets import Bucket
    from .context import RuntimeContext

EVAL_PLANS_KEPT = 4  # forward-only plans kept, one per recent no-grad path (see [Note: forward-only plans])

PathKey = tuple  # (trace.events, trace.uses) of a no-grad path


class EvalPlans:
    """The plans of recent no-grad paths, and which path followed which."""

    def __init__(self, ctx: RuntimeContext) -> None:
        self.ctx = ctx
        self.plans: OrderedDict[PathKey, Plan] = OrderedDict()  # recent forward-only plans by path
        self.next: dict[PathKey, PathKey] = {}  # path -> the path the no-grad forward after it took
        self.last: PathKey | None = None  # path of the latest no-grad forward
        self.latest: Plan | None = None  # the plan the next no-grad forward is expected to follow

    def plan_for(self, root: int) -> Plan | None:
        start = Event(EventKind.PRE, root)
        after = self.next.get(self.last) if self.last is not None else None
        plan = self.plans.get(after) if after is not None else None
        if plan is not None and plan.trace.events[0] == start:
            return plan
        for plan in reversed(self.plans.values()):
            if plan.trace.events[0] == start:
                return plan
        return None  # no path seen starts here: fetch on demand and record one

    def record(self, trace: Trace, buckets: tuple[Bucket, ...]) -> None:
        """Make the plan of this no-grad forward's path the one the next no-grad forward follows (see
        [Note: forward-only plans]). Paths seen recently (generate(): the first call and the later ones)
        keep their plans, so alternating between them does not plan again."""
        ctx = self.ctx
        key = (trace.events, trace.uses)
        if self.last is not None:
            self.next[self.last] = key
        self.last = key
        plan = self.plans.get(key)
        if plan is None:
            try:
                plan = build_plan(trace, buckets, itemsize=ctx.itemsize, budget_bytes=ctx.budget,
                                  fixed_bytes=ctx.memory.fixed,
                                  headroom_bytes=ctx.memory.parts["headroom"])
            except BudgetTooSmallError:
                return  # no plan fits: the next no-grad forward fetches on demand, as this one did
            validate_plan(plan)
            ctx.stats["eval_plans_built"] += 1
            self.plans[key] = plan
            while len(self.plans) > EVAL_PLANS_KEPT:
                gone, _ = self.plans.popitem(last=False)
                self.next = {a: b for a, b in self.next.items() if gone not in (a, b)}
        self.plans.move_to_end(key)
        self.latest = plan
