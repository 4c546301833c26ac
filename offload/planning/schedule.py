"""The scheduler: which buckets stay on the device, when each streamed one is fetched and released, and
where every device buffer lives in the arena (pure: data in, frozen Plan out).

Policy: the greedy cost-model scheduler (:func:`build_plan`). It starts from "everything streamed", with
each bucket's copy placed as late as possible while still arriving before use given the copy queue
(or, where memory is tighter, just in time); it simulates the step (``offload/planning/simulate.py``) and then
repeatedly takes the move that removes the most simulated stall per byte of device memory: keep a bucket
on the device for the whole step (resident), or keep it between its last forward use and its first
backward use (the last layers). Once no stall is left, it goes on taking the moves that save the most
copy time per byte, so that spare budget still cuts traffic. Every point of that sequence is simulated
again as its plan will run (its grad slots single- or double-buffered, with waits on reused grad slots that
no layout changes: [Note: dominating grad-slot waits]); the plan is the fastest of those whose layout fits
the budget. The sequence does not depend on the budget (the budget only says which of its points fit: [Note:
points over the capacity] in greedy.py) and neither does a plan's step, so a larger budget never gives a
slower plan (issue 18).

The plan model is ``plan.py``; need intervals ``intervals.py``; arena layout ``layout.py``; the search
``greedy.py`` (its inputs ``greedy_inputs.py``); memory floors and budget errors ``budget.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import NamedTuple, Sequence

from ..errors import InvariantError
from .budget import budget_error, forward_min_budget, leanest_arena_bytes, min_arena_bytes
from .buckets import Bucket, locate
from .device_optimizer import choose_device_optimizer, restrict
from .greedy import Greedy, Point, compute_times
from .hw import PRESETS, HardwareModel
from .intervals import grad_intervals
from .layout import assemble, buffer_waits, grad_slot_waits, layout_buffers
from .plan import ARENA_ALIGN, Buffer, BufferKind, EventActions, Plan, validate_plan
from .simulate import Bound, LaneResult, Program, SimResult, physical_bound, simulate
from .trace import Trace

__all__ = [
    "ARENA_ALIGN", "DEFAULT_HW", "Buffer", "BufferKind", "EventActions", "Plan", "budget_error", "build_plan",
    "forward_min_budget", "least_traffic", "min_arena_bytes", "plan_bound", "program_of", "simulate_plan",
    "validate_plan",
]

DEFAULT_HW = PRESETS["pcie4"]  # the cost model's hardware when the caller gives none (``offload probe`` measures)


def build_plan(trace: Trace, buckets: Sequence[Bucket], *, itemsize: int, budget_bytes: int,
               fixed_bytes: int, hw: HardwareModel | None = None,
               compute_s: Sequence[float] | None = None, headroom_bytes: int = 0,
               device_optimizer: bool = False, deferred: bool = False, refresh_pipelined: bool = False) -> Plan:
    """The greedy cost-model plan (see the module docstring) that fits ``budget_bytes``.

    ``hw`` defaults to :data:`DEFAULT_HW`; ``compute_s`` (seconds of compute per trace event) defaults to
    the trace's own :attr:`Trace.compute_seconds`; ``headroom_bytes`` (the backend's, see
    :attr:`Plan.headroom_bytes`) is kept out of the budget. Raises :class:`BudgetTooSmallError` when even
    streaming everything just in time does not fit.

    ``device_optimizer``: also choose buckets whose optimizer state lives and is updated on the device
    (:class:`~offload.planning.placement.Placement`; [Note: choosing device-optimizer buckets] in
    ``device_optimizer.py``). Off by default: the runtime cannot execute such plans yet (issue 18), and
    without it plans are exactly what they were.

    ``deferred``: the engine defers updates to ``step()`` (``overlap_optimizer=False``): a device-optimizer
    bucket's grads then go to the host and come back summed in ``step()`` before its device update ([Note:
    the deferred round trip] in simulate.py), which the choice of device-optimizer buckets weighs. (The
    host buckets' CPU AdamW is modelled as overlapped with backward in both modes.)

    ``refresh_pipelined`` (and not ``deferred``): model resident buckets' refreshes as the runtime issues them
    with overlapped updates on one GPU: at ``step()`` those whose CPU AdamW ended in first-use order, then the
    rest in the CPU lane's order as each ends, the first used first where its AdamW is the lane's next ([Note:
    the refresh pipelined, modelled] in simulate.py). The engine asks for it wherever it pipelines (overlapped
    updates, no data parallel: ``runtime/executor.py``); off here by default for the other callers (the
    baselines, data parallel, reports): the refresh then follows the drain, in bucket order.
    """
    pipelined = refresh_pipelined and not deferred
    with _gc_paused():
        plan = _build_plan(trace, buckets, itemsize, budget_bytes, fixed_bytes, hw, compute_s, headroom_bytes,
                           device_optimizer, deferred, pipelined)
        if deferred or pipelined:
            return dataclasses.replace(plan, deferred=deferred, refresh_pipelined=pipelined)
        return plan


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


def _build_plan(trace, buckets, itemsize, budget_bytes, fixed_bytes, hw, compute_s, headroom_bytes,
                device_optimizer, deferred, pipelined) -> Plan:
    hw = hw or DEFAULT_HW
    compute = compute_times(trace, compute_s)
    g = Greedy.of(trace, buckets, itemsize, hw, compute, refresh_pipelined=pipelined)
    extra = trace.activation_peak_bytes + fixed_bytes + trace.max_grad_bytes + headroom_bytes
    capacity = budget_bytes - extra
    points = g.candidates(capacity)
    tried = []
    if device_optimizer and points:
        dev = choose_device_optimizer(g, points, trace, buckets, itemsize, capacity, compute, deferred)
        if dev is not None:
            tried.append(dev)  # its points first; today's (no device state) if none of them lays out
    tried.append((g, points))
    best: Plan | None = None
    for g_k, points in tried:
        plan = _fitting(trace, buckets, itemsize, g_k, points, extra, budget_bytes, fixed_bytes, hw)
        # the device-optimizer search's plan, unless today's (no device state) is faster: the search's points
        # are simulated on restricted inputs and its fitting point may lay out slower than today's best
        if plan is not None and (best is None or _step_s(plan) < _step_s(best) * (1 - 1e-12)):
            best = plan
    if best is not None:
        return dataclasses.replace(best, headroom_bytes=headroom_bytes) if headroom_bytes else best
    jit = {b: [list(iv) for iv in ivs] for b, ivs in g.uses.items()}
    _, layout = layout_buffers(trace, buckets, itemsize, frozenset(), (jit, g.inputs.grads))
    # the least budget that gives a plan, exactly: [Note: the tight minimum budget] in budget.py
    raise budget_error(budget_bytes, arena=leanest_arena_bytes(g, layout.total_bytes),
                       activations=trace.activation_peak_bytes, fixed=fixed_bytes, grad=trace.max_grad_bytes,
                       headroom=headroom_bytes)


def _step_s(plan: Plan) -> float:
    return plan.simulated.step_s if plan.simulated is not None else float("inf")


def _fitting(trace, buckets, itemsize, g, points, extra, budget_bytes, fixed_bytes, hw) -> Plan | None:
    """The fastest option ([Note: dominating grad-slot waits]) of ``points`` whose arena layout fits the
    budget, assembled; None if none does."""
    room = budget_bytes - extra
    options = _options(g, points)
    single: dict[int, tuple] = {}  # per point (its index): its single-buffered specs and layout
    while options:
        best = min(o.sim.step_s for o in options)
        # as fast: the greedy's preference (fewest bytes copied, most resident, mode order), then less stall
        # (the CPU AdamW ends the step either way: less for the model to miss), then single buffering
        option = max((o for o in options if o.sim.step_s <= best * (1 + 1e-9)),
                     key=lambda o: (o.point.rank, -o.sim.stall_s, not o.double))
        laid = _laid_out(g, option, single, room)
        if laid is not None:
            specs, layout, after, sim = laid
            device = g.inputs.device
            name = f"greedy ({option.point.mode}{', double-buffered grads' if option.double else ''})"
            return assemble(trace, buckets, itemsize, option.point.resident | frozenset(device), name,
                            specs, layout, budget_bytes, fixed_bytes, simulated=sim, hw_name=hw.name,
                            needs=g.inputs.needs, device=device, after=after)
        options = [o for o in options if o is not option]  # its arena fragments past the budget: next best
    return None


DOUBLE_BUFFER_GRAD_SLOTS = True  # [Note: double-buffered grad slots]; False: today's single buffering only
# [Note: double-buffered grad slots] A layout that packs consecutive buckets' grad slots into the same bytes
# makes backward wait, at each bucket's first grad, for the previous bucket's grads to reach the host ([Note:
# waits on a reused grad slot] in simulate.py). Holding each slot until the next bucket's grads are issued
# (``intervals.double_buffered_ends``) costs about one more slot of arena and lets each copy hide behind the
# next bucket's backward. A point whose single-buffered option waits on a grad copy gets a double-buffered
# option too (``_options``); it is kept where it is the faster option and fits (on a tie, where its compute
# waits less). The minimum budget (``budget.py``) is single buffering's: a double-buffered option needs its
# point's single-buffered layout to fit as well, and a budget without room for the extra slot keeps single.


class _Option(NamedTuple):
    """One way to lay a greedy point out: its grad slots single- or double-buffered, simulated with its
    dominating grad-slot waits (what its plan's step is, whatever the layout)."""

    at: int  # the point's place in the greedy's list
    point: Point
    double: bool
    sim: SimResult | LaneResult


def _options(g: Greedy, points) -> list[_Option]:
    """Every point single-buffered and, where that waits on a grad copy, double-buffered.

    [Note: dominating grad-slot waits] A layout decides which grad slots share bytes, and so which copies to
    the host backward waits for ([Note: waits on a reused grad slot] in simulate.py); simulating every
    point's layout to choose among them costs an arena layout each (up to a second at 10,000 buckets), and a
    choice by any estimate of those waits (the greedy's scores use the intervals' rule) lets a larger
    budget's plan come out slower than a smaller one's (issue 18). Instead each plan waits, at each grad
    slot's start, also for the latest copy in the (FIFO) device-to-host queue among the slots ended by then
    (``Greedy.dominating_waits``; added to the slot's ``Buffer.after``, which the runtime waits on). Every wait
    a layout makes is on the copy of such a slot, issued no later, so done no later: it adds nothing, and the
    plan's simulated step is that of the dominating waits alone, the same for every layout of the point.
    Single buffering's waits are the intervals' rule where slots do not overlap (a chain of layers); with
    double-buffered slots (each held until the next one's grads are issued, [Note: double-buffered grad
    slots]) a slot waits for the copy two slots back instead.

    So the plan is the fastest option (within 1e-9 relative) among those whose layout fits: the points are a
    prefix of a budget-independent sequence, an option's step does not depend on the budget, and the options
    that fit only grow with it: a larger budget never gives a slower plan (beyond that 1e-9). A double-
    buffered option counts only where the point's single-buffered layout fits too, so the minimum budget
    (``budget.py``) stays single buffering's."""
    out = []
    double = DOUBLE_BUFFER_GRAD_SLOTS and len(g.inputs.grads) > 1
    for k, p in enumerate(points):
        sim = g.simulate(p.resident, p.flat, g.dominating_waits(False)[0])[0]
        out.append(_Option(k, p, False, sim))
        if double and sim.grad_stall_s > 0:
            out.append(_Option(k, p, True, g.simulate(p.resident, p.flat, g.dominating_waits(True)[0])[0]))
    return out


def _laid_out(g: Greedy, option: _Option, single: dict[int, tuple], room: int):
    """``option`` laid out: (specs, layout, each buffer's ``after`` with its dominating wait, the plan's
    simulated step), or None where its layout, or its point's single-buffered one, exceeds ``room`` bytes."""
    p = option.point
    if option.at not in single:
        single[option.at] = g.layout(p.resident, p.flat)
    specs, layout = single[option.at]
    if layout.total_bytes > room:
        return None
    if option.double:
        specs, layout = g.layout(p.resident, p.flat, double=True)
        if layout.total_bytes > room:
            return None
    after = buffer_waits(specs, layout.offsets)
    grad = {spec[0]: k for k, spec in enumerate(specs) if spec[1] is BufferKind.GRAD}
    for b, on in g.dominating_waits(option.double)[1].items():
        k, j = grad.get(b), grad.get(on)
        if k is not None and j is not None and j not in after[k]:
            after[k] = after[k] + (j,)
    x = g.inputs
    sim = g.simulate(p.resident, p.flat, grad_slot_waits(specs, after, x.d2h_program["d2h_bucket"], x.n))[0]
    if sim.step_s != option.sim.step_s:
        raise InvariantError("a plan's simulated step is not its option's: a layout waits on a grad copy that "
                             "its dominating waits do not cover, a bug in the scheduler, please report it")
    return specs, layout, after, sim.result() if isinstance(sim, LaneResult) else sim


def program_of(plan: Plan, compute_s: Sequence[float] | None = None,
               refresh_pipelined: bool | None = None) -> Program:
    """The lane program of a plan (what :func:`offload.planning.simulate.simulate` runs). ``refresh_pipelined``:
    its refresh model ([Note: the refresh pipelined, modelled] in simulate.py); None: the plan's own."""
    if refresh_pipelined is None:
        refresh_pipelined = plan.refresh_pipelined
    g = Greedy.of(plan.trace, plan.buckets, plan.itemsize, DEFAULT_HW, compute_times(plan.trace, compute_s),
                  refresh_pipelined=refresh_pipelined and not plan.deferred)
    device = plan.device_optimizer
    if device:
        g = Greedy(restrict(g.inputs, device, plan.buckets, plan.itemsize, plan.deferred))
    resident = frozenset(plan.resident) - frozenset(device)
    streamed: dict[int, list[list[int]]] = {}
    for x in plan.buffers:
        if x.kind is BufferKind.PARAM and x.bucket not in plan.resident:
            streamed.setdefault(x.bucket, []).append([x.start, x.end])
    # compute's waits on reused grad slots: this layout's ([Note: waits on a reused grad slot] in simulate.py)
    specs = [(x.bucket, x.kind, x.start, x.end, x.size) for x in plan.buffers]
    waits = grad_slot_waits(specs, [x.after for x in plan.buffers], g.inputs.d2h_program["d2h_bucket"], g.inputs.n)
    return g.program(resident, {b: sorted(ivs) for b, ivs in streamed.items()}, grad_waits=waits)


def simulate_plan(plan: Plan, hw: HardwareModel, compute_s: Sequence[float] | None = None) -> SimResult:
    return simulate(program_of(plan, compute_s), hw)


def least_traffic(trace: Trace, buckets: Sequence[Bucket], itemsize: int, capacity: int) -> dict[str, int]:
    """The fewest bytes any plan of this engine moves per step: every updated bucket comes back to the
    device once (new weights) and sends its grads once; buckets used but not updated stream only what
    ``capacity`` (arena bytes available) cannot hold."""
    bucket_of = locate(buckets)[0]
    grads = grad_intervals(trace, buckets, bucket_of)
    used = {bucket_of[p] for uses in trace.uses for p in uses}
    updated = sum(buckets[b].nbytes(itemsize) for b in grads)
    others = sum(buckets[b].nbytes(itemsize) for b in used - set(grads))
    return {"h2d": updated + max(0, others - max(0, capacity)),
            "d2h": sum(buckets[b].grad_nbytes(itemsize) for b in grads),
            "adam_numel": sum(buckets[b].trainable_numel for b in grads)}


def plan_bound(plan: Plan, hw: HardwareModel, compute_s: Sequence[float] | None = None) -> Bound:
    """The physical bound for this plan's trace, buckets and budget (not for the plan's own choices)."""
    compute = compute_times(plan.trace, compute_s)
    t = plan.trace
    least = least_traffic(t, plan.buckets, plan.itemsize, plan.capacity_bytes)
    return physical_bound(sum(compute), least["h2d"], least["d2h"], least["adam_numel"], hw)
