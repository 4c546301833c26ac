"""Forward-only plans: which plan a forward under ``torch.no_grad()`` follows, and keeping the plans of
recent no-grad paths.

[Note: forward-only plans] A forward under torch.no_grad() (evaluation, generate()) has no backward to keep
buckets for or prefetch for: it runs its own plan, built from a recorded no-grad forward. Recent no-grad
paths keep their plans. A forward takes the path that followed the previous one last time, if it starts at
the module called, else the latest that does (generate() on T5 calls the encoder, then the model computing
cross-attention keys, then the model reading them from its cache: three paths, always in that order).
Switching plans frees one arena before the other is allocated (``Runtime._begin_forward``).

A part of :class:`offload.runtime.core.Runtime`, split out by concern; its state (``eval_plans``, ``eval_next``,
``eval_last``, ``eval_plan``) is set up in ``Runtime.__init__``."""

from __future__ import annotations

from ..errors import BudgetTooSmallError
from ..planning.schedule import Plan, build_plan, validate_plan
from ..planning.trace import Event, EventKind, Trace

EVAL_PLANS_KEPT = 4  # forward-only plans kept, one per recent no-grad path (see [Note: forward-only plans])


class ForwardOnlyMixin:
    """Chooses and builds the forward-only plans of the runtime."""

    def _eval_plan_for(self, root: int) -> Plan | None:
        start = Event(EventKind.PRE, root)
        plan = self.eval_plans.get(self.eval_next.get(self.eval_last))
        if plan is not None and plan.trace.events[0] == start:
            return plan
        for plan in reversed(self.eval_plans.values()):
            if plan.trace.events[0] == start:
                return plan
        return None  # no path seen starts here: fetch on demand and record one

    def _plan_forward_only(self, trace: Trace) -> None:
        """Make the plan of this no-grad forward's path the one the next no-grad forward follows (see
        [Note: forward-only plans]). Paths seen recently (generate(): the first call and the later ones)
        keep their plans, so alternating between them does not plan again."""
        key = (trace.events, trace.uses)
        if self.eval_last is not None:
            self.eval_next[self.eval_last] = key
        self.eval_last = key
        plan = self.eval_plans.get(key)
        if plan is None:
            try:
                plan = build_plan(trace, self.buckets, itemsize=self.itemsize, budget_bytes=self.config.budget,
                                  fixed_bytes=self.memory.parts["buffers"],
                                  headroom_bytes=self.memory.parts["headroom"])
            except BudgetTooSmallError:
                return  # no plan fits: the next no-grad forward fetches on demand, as this one did
            validate_plan(plan)
            self.stats["eval_plans_built"] += 1
            self.eval_plans[key] = plan
            while len(self.eval_plans) > EVAL_PLANS_KEPT:
                gone, _ = self.eval_plans.popitem(last=False)
                self.eval_next = {a: b for a, b in self.eval_next.items() if gone not in (a, b)}
        self.eval_plans.move_to_end(key)
        self.eval_plan = plan
