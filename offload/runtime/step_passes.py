"""Which forwards and backward passes make up one training step: where a pass that gathered no grad ends inside
its step, and whether a forward continues a step or begins one. The runtime (core.py) asks; the plan position
and the step's record belong to the executor (executor.py).

[Note: a backward pass inside a step] A gradient penalty runs two backward passes per step:
``torch.autograd.grad(out, x, create_graph=True)``, which accumulates nothing, then the loss's backward. The plan
is built from a record of both (a step's record ends with its last pass), so the end of the first is not the end
of the step: where a pass that gathered no grad ends on the plan and the plan's next event is another pass's (an
unpack or a grad), the step stays where it is on the plan for the next pass (``PlanExecutor.inner_pass_ends``).
Before, that end left the plan, and every such step departed and was planned again. Not with activation
checkpointing (its recompute regions end with each pass) nor on a fast step (its first pass reaches no hook at
all). A forward that comes instead of the planned pass departs then, and continues the step off plan (next
Note). "Checkpointing" is blocks checkpointed now (``ckpt.active``), not blocks measured for it
(``ckpt.block_of``, found in most models with repeated blocks): until session 24 the latter kept every such
model's two-pass steps departing.

[Note: a forward after an inner pass] (issue 17) The inner pass may come between forwards of one step: WGAN-GP's
critic (the penalty on interpolates, ``autograd.grad(D(x_hat).sum(), x_hat, create_graph=True)``, then its
forwards of real and fake samples and one backward) and adversarial training (``autograd.grad(loss, x)``, an
example made from its sign, then a forward of it and the backward). Each forward began a step, so the plan never
saw the inner pass and such steps departed every time (session 25: 17 departures and 11 re-plans in 6 WGAN-GP
steps). Now a training forward that comes while the step is between passes (``Between.PASSES``: a pass that
gathered no grad ended, no grad was received since the step began, and neither ``step()`` nor ``zero_grad()``
ran since) continues the step: its record and its plan position go on (``continues``), and so do the step's
later training forwards before its next pass (``Between.CONTINUED``: a fresh clean forward beside the adversarial
one; before this, each of them began a step, as two forwards without an inner pass still do: [Note: one forward per
fast step]). A pass ends between passes where it ends on the plan and the plan goes on with another pass
(above) or with a forward (``forward_planned_next``), or where the step runs off plan (the first, traced step,
or one that departed), so that its record holds the whole step and the plan made from it does. Off plan a step
takes at most ``MAX_FORWARDS`` forwards so (a loop of forwards and ``autograd.grad`` that never trains, a saliency
map say, would grow one record for good): the pass after the last ends the step, as every pass did before.

The record's forward/backward split (``Trace.num_forward``, which the planner reads as one split) is the end of
the step's last forward: the inner pass's reads and the forwards after it count as forward (the planner's forward
intervals, keep decisions and forward bytes, planning/intervals.py, greedy_inputs.py, placement.py), the last
backward as backward. The plan then has the inner pass at the end of the first forward (``pass_planned_here``
lets a backward begin there) and the next forward at the inner pass's end. A continued forward on plan departs
where the plan has no forward next, or where the record and the plan position differ (reads the inner pass let
by or passed over: [Note: reads the plan did not foresee]), since a forward's checks (``check_use``) read the
plan at the record's position.

A step that ends between passes (``step()`` or ``zero_grad()`` came: ``Between.ENDED``; WGAN-GP's generator step
through its frozen critic, a pass that gathers none of the critic's grads, then the critic's ``zero_grad()``) is
left as a forward no backward followed is: what it streamed is let go of and the next forward begins a step on
the plan, neither a departure nor a record to plan from. Kept as before: a no-grad forward between passes, and
with data parallel (not tested across ranks) and activation checkpointing a forward after an inner pass begins a
step (it departs where the plan expected another pass), and a fast step ends at its first pass. Not covered: the
critic's grads gathered in the generator's step (not frozen, dropped by its next ``zero_grad``) make a step of
another shape than the critic's, which departs from the critic's plan every time (the test's loop unfrozen: 6
departures and 5 re-plans in 6 iterations, 17 and 11 before; bit for bit torch); a forward after an inner pass
on data parallel, under activation checkpointing or after ``MAX_FORWARDS`` forwards departs as before.
Tests: tests/runtime/test_forward_after_inner_pass.py, test_penalty_passes.py.

[Note: one forward per fast step]
A step of two training forwards before one backward (loss = f(a) + f(b): siamese, contrastive, chosen/rejected
pairs; or a forward after an inner pass, above) records both forwards and a backward through both graphs, whose
nodes autograd interleaves by their sequence numbers. A full step adds nodes of its own (the module hooks'); a
fast step (the fast path, fast_path.py) adds none, so its backward's order is not the record's: an all-resident
plan ran fast, departed, was planned again from the departed step, departed again (session 24: 4 departures and
re-plans in 8 steps, every third step on plan; bit for bit torch throughout). So only a step of one training
forward verifies its plan for fast steps (``forwards``); such models run the full path, on their plan.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from ..planning.trace import EventKind
from .departures import Where

if TYPE_CHECKING:
    from .context import RuntimeContext
    from .executor import PlanExecutor

MAX_FORWARDS = 8  # training forwards an off-plan step may continue to ([Note: a forward after an inner pass])
_EXPECTED_PASS = Where(reason="at a forward where its plan expected another backward pass")


class Between(enum.Enum):
    NO = "no"
    """No pass of the step has ended inside it (a forward runs, or the step is over)."""
    PASSES = "passes"
    """A pass that gathered no grad ended inside the step: another pass or a training forward continues it."""
    CONTINUED = "continued"
    """A training forward continued the step: its later training forwards continue it too, until a pass begins."""
    ENDED = "ended"
    """Then ``step()`` or ``zero_grad()`` ran: the step ended between its passes; the next forward begins one."""


def forward_planned_next(executor: PlanExecutor) -> bool:
    """On plan, the plan's step goes on with a forward: its next event is a module call before its last forward's
    end."""
    plan = executor.plan
    if not executor.on_plan or plan is None:
        return False
    pos = executor.pos
    return 0 < pos < plan.trace.num_forward and plan.trace.events[pos].kind is EventKind.PRE


def pass_planned_here(executor: PlanExecutor) -> bool:
    """A backward pass begins where the plan has one: at its forward's end, or an inner pass (a planned read or
    grad) before a later forward."""
    plan = executor.plan
    if plan is None:
        return True  # nothing to depart from
    pos, nf = executor.pos, plan.trace.num_forward
    return pos == nf or (pos < nf and plan.trace.events[pos].kind in (EventKind.UNPACK, EventKind.GRAD))


class StepPasses:
    """Where the step stands between its passes, and the training forwards it has taken."""

    def __init__(self, ctx: RuntimeContext) -> None:
        self.ctx = ctx
        self.state = Between.NO
        self.forwards = 0  # training forwards since the last backward ended ([Note: one forward per fast step])

    def pass_ends(self, executor: PlanExecutor, gathered: bool, fast: bool, checkpointing: bool) -> bool:
        """A backward pass ended: whether the step goes on (the pass was inside it) rather than ends with it."""
        if fast or gathered or checkpointing:
            return False
        inside = executor.inner_pass_ends() or (
            self.ctx.dp is None and self.forwards < MAX_FORWARDS
            and (forward_planned_next(executor) or not executor.on_plan))
        if inside:
            self.state = Between.PASSES
        return inside

    def continues(self, grad_enabled: bool) -> bool:
        """A forward begins: whether it continues the step ([Note: a forward after an inner pass])."""
        return self.state in (Between.PASSES, Between.CONTINUED) and grad_enabled and self.ctx.dp is None

    def forward_continues(self, executor: PlanExecutor) -> None:
        """A forward continues the step: on plan, it departs where the plan has no forward next or the record is
        not at the plan's position."""
        self.state = Between.CONTINUED
        self.forwards += 1
        if not executor.on_plan:
            return
        if not forward_planned_next(executor):
            executor.leave(_EXPECTED_PASS)
        elif len(executor.recorder.events) != executor.pos:
            executor.leave(Where(reason="at a forward after a pass whose reads were not its plan's"))

    def step_begins(self, executor: PlanExecutor, grad_enabled: bool) -> None:
        """A forward begins a step: one that ended between its passes is left as is; one still between passes
        (a no-grad forward, data parallel) departs where its plan expected more of it, as before."""
        state, self.state = self.state, Between.NO
        self.forwards += grad_enabled
        if state is not Between.PASSES and (state is not Between.ENDED or self.ctx.dp is None) or not executor.on_plan:
            return
        executor.leave(_EXPECTED_PASS)

    def backward_begins(self) -> bool:
        """A backward pass begins: whether it comes after a pass inside the step."""
        between, self.state = self.state in (Between.PASSES, Between.ENDED), Between.NO
        return between

    def step_ran(self) -> None:
        """``step()`` or ``zero_grad()``: a step between its passes ends there."""
        if self.state in (Between.PASSES, Between.CONTINUED):
            self.state = Between.ENDED

    def forward_aborted(self) -> None:
        """A forward raised and its step's record is gone: the next forward begins a step."""
        self.state = Between.NO

    def reset(self) -> None:
        """The step's last pass ended, or a backward raised."""
        self.state = Between.NO
        self.forwards = 0
