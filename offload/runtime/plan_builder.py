"""Training plans built for the runtime: the planner called at the engine's budget, beside what the runtime has
learnt of the transients, and its refusals made actionable.

The executor asks for a plan (``PlanExecutor.replan``, ``check_ahead``, ``plan_for``); this is the one place where
the runtime's state (the budget, the memory already committed, the headroom and transients learnt, the config's
choices) becomes the planner's inputs. Pure apart from the warning it gives once per shortfall.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from ..config import format_bytes
from ..errors import BudgetTooSmallError, OffloadWarning
from ..planning.schedule import Plan, build_plan, validate_plan
from ..planning.trace import Trace

if TYPE_CHECKING:
    from .context import RuntimeContext
    from .recompute_hooks import RecomputeCoordinator
    from .slots import SlotTable


class PlanBuilder:
    """Builds and validates a training plan for a recorded step at the engine's budget."""

    def __init__(self, ctx: RuntimeContext, slots: SlotTable) -> None:
        self.ctx = ctx
        self.slots = slots  # its buckets, once the traced warm-up has made them
        self._short_said = 0  # the transients a plan could not keep out of the budget (warned once per figure)

    def build(self, trace: Trace) -> Plan:
        """The training plan for ``trace`` at the budget, validated (raises :class:`BudgetTooSmallError`)."""
        ctx = self.ctx
        memory = ctx.memory
        headroom = memory.parts["headroom"]
        try:
            plan = self._plan(trace, headroom)
        except BudgetTooSmallError as e:
            # [Note: transients]: no plan keeps all the transients learnt out of the budget; one keeps what it
            # can (the minimum named is exact: [Note: the tight minimum budget] in planning/budget.py)
            short = e.min_budget_bytes - ctx.budget
            if short > memory.transients:
                raise
            plan = self._plan(trace, headroom - short)
            if short != self._short_said:
                self._short_said = short
                warnings.warn(
                    f"offload: no plan keeps all {format_bytes(memory.transients)} of the transients (what forward "
                    f"and backward allocate beyond the plan, measured or, before the first planned step, estimated "
                    f"as the largest saved activation: [Note: transients] in "
                    f"offload/runtime/accounting.py) out of the budget of {format_bytes(ctx.budget)}; this one keeps "
                    f"{format_bytes(memory.transients - short)}, so the device may go over the budget by up to "
                    f"{format_bytes(short)}. A larger budget, or activation checkpointing, makes room.",
                    OffloadWarning, stacklevel=4)
        return plan

    def _plan(self, trace: Trace, headroom: int) -> Plan:
        ctx = self.ctx
        plan = build_plan(trace, self.slots.buckets, itemsize=ctx.itemsize, budget_bytes=ctx.budget,
                          fixed_bytes=ctx.memory.fixed, hw=ctx.hw, headroom_bytes=headroom,
                          device_optimizer=ctx.config.device_optimizer,
                          deferred=not ctx.config.overlap_optimizer, refresh_pipelined=ctx.dp is None)
        validate_plan(plan)
        return plan

    def hinted(self, e: BudgetTooSmallError, recompute: RecomputeCoordinator) -> BudgetTooSmallError:
        """``e`` with the activation-checkpointing hint for this budget."""
        need = e.breakdown
        return recompute.activation_hint(e, self.ctx.budget - sum(need.values()) + need["activations"])
