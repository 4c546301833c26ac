"""Which blocks ``activation_checkpointing="auto"`` checkpoints: the candidate whose planned step is fastest
(pure: data in, frozen dataclasses out).

Issue 18: budget spent on saved activations is budget not spent on resident weights or device optimizer
state. While the CPU AdamW (or PCIe) is the wall, the compute lane idles, and recomputing a block buys its
saved bytes back for a forward's compute: the planner can then keep more on the device. So "auto" does not
stop at the fewest blocks that fit (:func:`~offload.planning.activations.choose_checkpoints`): it tries a
handful of candidate sets, from the fewest that fit to every block that saves anything, in the order
``choose_checkpoints`` adds them (largest saving first), plans a model of the step each gives, and keeps
the one whose simulated step (recompute included) is fastest; within ``tie`` of a faster set with fewer
blocks, the fewer win.

[Note: the candidate step model] The runtime measures one step with some set M of blocks checkpointed (the
warm-up of "auto": all of them) and must estimate the step of another set C. From its trace:
- each block's forward seconds per call are the compute of the trace's events inside its forward call;
- a RECOMPUTE event of a block in M loses those seconds (floored at 0: what is left is the backward that
  ran under it) and gets them back if the block is in C. Its uses stay: the block's backward reads those
  weights either way, and holding them through it, as a planned recompute does, is an upper bound of what
  an un-checkpointed block's nodes hold one by one;
- a block in C but not in M is recomputed as one lump where backward first reads one of its parameters
  (as :func:`~offload.planning.activations.checkpointed_step` models it for the simulator);
- the activation peak is :func:`~offload.planning.activations.activation_bytes` of C (an upper bound).
Every candidate is thus modelled from the same events, with the same recompute cost per block, so the
comparison is fair even where the model is off in absolute terms. The chosen set is executed for real: the
runtime's next step runs it and is planned from its own trace.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

from ..errors import BudgetTooSmallError
from .activations import ActivationProfile, CheckpointChoice, activation_bytes, recompute_seconds
from .plan import Plan
from .trace import EventKind, Trace

CANDIDATES = 5  # the most candidate sets planned (planning stays a handful of build_plan calls)
TIE = 0.01  # a set with more blocks must be this much faster (relative): within it, fewer blocks win


@dataclass(frozen=True)
class Candidate:
    """One candidate set of checkpointed blocks and the step its plan simulates."""

    modules: tuple[int, ...]  # module indices, in model order
    activation_bytes: int  # estimated activation peak (see [Note: the activation estimate])
    recompute_s: float  # modelled forward seconds its recomputes add to backward
    step_s: float | None  # simulated step of its plan; None when no plan fits the budget


@dataclass(frozen=True)
class TimedChoice:
    """What :func:`choose_by_step_time` decided, and what it weighed."""

    choice: CheckpointChoice  # the set to checkpoint
    candidates: tuple[Candidate, ...]  # in the order tried: the fewest that fit first
    chosen: int  # index of the chosen candidate

    @property
    def fewest(self) -> tuple[int, ...]:
        """The fewest blocks that fit (the rule before issue 18)."""
        return self.candidates[0].modules

    @property
    def step_s(self) -> float | None:
        return self.candidates[self.chosen].step_s


def candidate_sets(profile: ActivationProfile, fewest: Sequence[int], limit: int = CANDIDATES) -> tuple[tuple[int, ...], ...]:
    """``fewest``, then more blocks in the order :func:`choose_checkpoints` adds them (largest saving first;
    blocks that save nothing are never added), up to every such block: at most ``limit`` sets, their sizes
    evenly spaced from ``fewest`` to all."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    base = set(fewest)
    order = [b.module for b in sorted(profile.blocks, key=lambda b: (-(b.saved - b.inputs), b.module))
             if b.saved > b.inputs and b.module not in base]
    n = len(order)
    steps = 1 if limit == 1 or n == 0 else min(limit, n + 1)
    counts = sorted({round(i * n / (steps - 1)) for i in range(steps)}) if steps > 1 else [0]
    return tuple(tuple(sorted(base | set(order[:k]))) for k in counts)


def step_with_checkpoints(trace: Trace, profile: ActivationProfile, chosen: Sequence[int]) -> tuple[Trace, float]:
    """A model of ``trace`` (measured with ``profile.checkpointed`` checkpointed) had ``chosen`` been
    checkpointed instead, and the recompute seconds it carries ([Note: the candidate step model]). The
    returned trace's ``seconds`` are the modelled compute (no overhead)."""
    chosen_set = frozenset(chosen)
    blocks = {b.module for b in profile.blocks}
    unknown = chosen_set - blocks
    if unknown:
        raise ValueError(f"modules {sorted(unknown)} were not measured as blocks in this profile")
    measured = trace.compute_seconds
    compute = list(measured)
    uses = list(trace.uses)
    nf, n = trace.num_forward, len(trace.events)
    spans: dict[int, list[range]] = {}  # block -> its forward calls' event spans
    for i in range(nf):
        ev = trace.events[i]
        if ev.kind is EventKind.PRE and ev.key in blocks:
            spans.setdefault(ev.key, []).append(range(i, min(trace.ends[i], nf)))
    per_call = {m: sum(compute[j] for s in calls for j in s) / len(calls) for m, calls in spans.items()}
    recompute = 0.0
    recomputed: set[int] = set()
    for k in range(nf, n):
        ev = trace.events[k]
        if ev.kind is EventKind.RECOMPUTE and ev.key in per_call:
            recomputed.add(ev.key)
            compute[k] = max(0.0, compute[k] - per_call[ev.key])
            if ev.key in chosen_set:
                compute[k] += per_call[ev.key]
                recompute += per_call[ev.key]
    first_read: dict[int, int] = {}  # parameter -> first backward event reading it
    for j in range(nf, n):
        for p in trace.uses[j]:
            first_read.setdefault(p, j)
    for m in sorted(chosen_set - recomputed):
        for span in spans.get(m, ()):
            params = {p for j in span for p in trace.uses[j]}
            reads = [first_read[p] for p in params if p in first_read]
            if not reads:
                continue  # nothing of it is read in backward (frozen below every trainable block)
            k = min(reads)
            seconds = sum(measured[j] for j in span)
            compute[k] += seconds
            recompute += seconds
            uses[k] = tuple(sorted(set(uses[k]) | params))
    model = dataclasses.replace(trace, uses=tuple(uses), seconds=tuple(compute), overhead=(),
                                activation_peak_bytes=activation_bytes(profile, chosen_set))
    return model, recompute


def choose_by_step_time(trace: Trace, profile: ActivationProfile, fewest: CheckpointChoice,
                        build: Callable[[Trace], Plan], limit: int = CANDIDATES, tie: float = TIE) -> TimedChoice:
    """Among :func:`candidate_sets` from ``fewest`` (the fewest blocks that fit), the set whose planned step
    is fastest. ``build`` plans a trace at the engine's budget (``build_plan`` with the engine's arguments;
    raises :class:`BudgetTooSmallError` when nothing fits). Sets are planned on the model of
    :func:`step_with_checkpoints`. If the model gives ``fewest`` no plan (it errs high), ``fewest`` is kept
    (the rule before issue 18): its real step is planned from its own trace."""
    candidates = []
    for modules in candidate_sets(profile, fewest.modules, limit):
        model, recompute = step_with_checkpoints(trace, profile, modules)
        try:
            plan = build(model)
            step = plan.simulated.step_s if plan.simulated is not None else None
        except BudgetTooSmallError:
            step = None
        candidates.append(Candidate(modules, model.activation_peak_bytes, recompute, step))
    best = 0
    if candidates[0].step_s is not None:
        for i, c in enumerate(candidates[1:], 1):
            best_s = candidates[best].step_s
            if c.step_s is not None and best_s is not None and c.step_s < best_s * (1 - tie):
                best = i
    if best == 0:
        return TimedChoice(fewest, tuple(candidates), 0)
    modules = candidates[best].modules
    names = {b.module: b.name for b in profile.blocks}
    choice = CheckpointChoice(modules, tuple(names[m] for m in modules), activation_bytes(profile, modules),
                              recompute_seconds(profile, modules), True)
    return TimedChoice(choice, tuple(candidates), best)
