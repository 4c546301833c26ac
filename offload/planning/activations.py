"""Activation memory in the plan: which modules to checkpoint, and the activation bytes that choice gives
(pure: data in, frozen dataclasses out).

Long sequences make saved activations, not weights, what overflows the device budget. A step measures,
for every *block* (a module that may be checkpointed), the bytes its forward saves for backward
(``saved``; measured by the saved-tensor hooks whether the block ran checkpointed or not), the bytes of
its inputs (``inputs``: a checkpointed block keeps only those), and its forward seconds (what a recompute
costs). From that one measurement :func:`activation_bytes` tells the activation peak of any other choice
of checkpointed blocks, and :func:`choose_checkpoints` picks the fewest blocks (largest saving first)
that bring it under a capacity. (The engine's "auto" starts from that set and may checkpoint more where
that plans a faster step: offload/planning/checkpoint_choice.py.)

[Note: the activation estimate] Let F be the saved bytes held at the end of the measured forward, when
the set M of blocks was checkpointed. Checkpointing a block r that was not adds its inputs and drops
what it saved (F - saved_r + inputs_r); un-checkpointing one adds back what it saves (F + saved_r; its
inputs may stay held, so they are not subtracted). That gives F_C, the bytes held when the forward of
the set C ends. Backward then runs the blocks in reverse call order, and recomputes each checkpointed
one: its saved bytes exist again on top of what is still held, which is F_C less what the blocks called
after it have already let go of (their saved bytes, or their inputs if checkpointed). So the peak is at
most max(F_C, max over r in C of F_C - freed_after(r) + saved_r). When C is M itself the measured peak
is returned as it is. The estimate only errs high (a block's input that it also saves is counted twice;
the saved bytes outside the blocks are taken as held all through backward).

[Note: auto and no checkpointing] "auto" measures in a warm-up step that checkpoints every block, and on
plan a recompute keeps its block's weights on the device until that block's backward is over, so the arena
a plan of that step needs is more than a step without recompute needs; checked against it, a small model
whose activations fit anyway could be refused a budget that ``activation_checkpointing=None`` accepts. (The
warm-up itself runs off plan and holds the weights only during the recompute: [Note: recomputed weights off
plan] in offload/runtime/recompute.py.) So
"auto" first asks whether nothing needs checkpointing: the activations with no block checkpointed
(``activation_bytes(profile, ())``), module buffers and what a step run on demand holds at most
(:func:`on_demand_bytes`, an upper bound) within the budget. If so, the next step runs with no block
checkpointed (on demand, as the step after any choice does) and is planned like a step under None; only
if that plan does not fit does "auto" fall back to choosing blocks from the warm-up as before.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from ..config import format_bytes as _fmt
from .buckets import Bucket, locate
from .trace import EventKind, Trace

AUTO = "auto"


@dataclass(frozen=True)
class BlockProfile:
    """One block, as a step measured it (summed over its calls in that step)."""

    module: int  # module index (position in ``model.modules()``)
    name: str  # qualified name (``model.named_modules()``)
    saved: int  # bytes its forward saves for backward (distinct storages; parameters excluded)
    inputs: int  # bytes of its tensor inputs (what a checkpointed call keeps instead)
    forward_s: float  # seconds of its forward: what recomputing it costs in backward
    order: int = 0  # when it was first called in the step (backward meets the blocks in reverse)


@dataclass(frozen=True)
class ActivationProfile:
    """Saved-activation bytes of one measured step, per block and in all."""

    blocks: tuple[BlockProfile, ...]
    checkpointed: frozenset  # module indices that ran checkpointed in the measured step
    forward_end: int  # saved bytes held when the forward ended
    peak: int  # peak saved bytes over the step (recomputes in backward included)

    def block(self, module: int) -> BlockProfile:
        return next(b for b in self.blocks if b.module == module)


@dataclass(frozen=True)
class CheckpointChoice:
    """What :func:`choose_checkpoints` decided."""

    modules: tuple[int, ...]  # module indices to checkpoint, in model order
    names: tuple[str, ...]
    activation_bytes: int  # the activation peak this choice gives (see [Note: the activation estimate])
    recompute_s: float  # forward seconds added to backward by recomputing them
    fits: bool  # activation_bytes <= the capacity asked for


def activation_bytes(profile: ActivationProfile, chosen: Iterable[int]) -> int:
    """Peak saved-activation bytes if exactly the blocks ``chosen`` were checkpointed (an upper bound
    from ``profile``; see [Note: the activation estimate])."""
    chosen = frozenset(chosen)
    if chosen == profile.checkpointed:
        return profile.peak
    by_module = {b.module: b for b in profile.blocks}
    unknown = chosen - set(by_module)
    if unknown:
        raise ValueError(f"modules {sorted(unknown)} were not measured as blocks in this profile")
    held = profile.forward_end
    held += sum(by_module[m].saved for m in profile.checkpointed - chosen if m in by_module)
    held -= sum(by_module[m].saved - by_module[m].inputs for m in chosen - profile.checkpointed)
    peak, freed = held, 0
    for b in sorted(profile.blocks, key=lambda b: -b.order):  # the order backward meets them
        if b.module in chosen:
            peak = max(peak, held - freed + b.saved)
            freed += b.inputs
        else:
            freed += b.saved
    return peak


def on_demand_bytes(trace: Trace, buckets: Sequence[Bucket], itemsize: int) -> int:
    """Most device bytes, saved activations and module buffers aside, a step following ``trace`` holds when
    it runs on demand with no block checkpointed (an upper bound, from a trace in which blocks may have been
    checkpointed; see [Note: auto and no checkpointing]).

    On demand, the runtime evicts the buckets not in use before it allocates, so what it holds is what is
    in use: in forward, the buckets of the module calls active at once; in backward, the buckets of the
    autograd node running, the grad slots open (a bucket's slot opens at its first gradient and closes at
    its last) and the largest gradient autograd materialises. A node reads only weights that one forward call
    read: at an UNPACK event, its uses. Inside a block that ``trace`` recomputed, whose nodes are not
    events: a node whose gradient lands at a GRAD event read at most the buckets of the calls of the block
    that used that parameter, and ran before that gradient's slot opened; any other node, at most the buckets
    of one call of the block whose parameters get no gradient (frozen weights), at any time."""
    bucket_of = locate(buckets)[0]
    nbytes = [b.nbytes(itemsize) for b in buckets]
    nf, n = trace.num_forward, len(trace.events)
    calls = [sum(nbytes[b] for b in {bucket_of[p] for p in uses}) for uses in trace.uses]
    graded = {ev.key for ev in trace.events[nf:] if ev.kind == EventKind.GRAD}
    stack: list[tuple[int, set[int]]] = []
    forward = 0
    calls_of: dict[int, list[int]] = {}  # module -> its PRE events
    for i in range(nf):
        while stack and stack[-1][0] <= i:
            stack.pop()
        if trace.events[i].kind == EventKind.PRE:
            calls_of.setdefault(trace.events[i].key, []).append(i)
            stack.append((trace.ends[i], {bucket_of[p] for p in trace.uses[i]}))
            forward = max(forward, sum(nbytes[b] for b in set().union(*(s for _, s in stack))))

    def inside(module: int) -> tuple[int, dict[int, int]]:
        """(largest call without gradients, per parameter the largest call using it) within ``module``'s calls."""
        frozen, by_param = 0, dict[int, int]()
        for i in calls_of.get(module, ()):
            for j in range(i, min(trace.ends[i], nf)):
                if trace.events[j].kind != EventKind.PRE:
                    continue
                if not any(p in graded for p in trace.uses[j]):
                    frozen = max(frozen, calls[j])
                for p in trace.uses[j]:
                    by_param[p] = max(by_param.get(p, 0), calls[j])
        return frozen, by_param

    touched = set(trace.touched)
    expected: dict[int, set[int]] = {}  # per bucket with grads: the parameters whose grads complete it
    got: dict[int, set[int]] = {}
    open_bytes = backward = 0
    by_param: dict[int, int] = {}  # of the recomputed block whose backward runs
    frozen = block_end = 0
    for i in range(nf, n):
        ev = trace.events[i]
        if i >= block_end:
            frozen, by_param = 0, {}
        if ev.kind == EventKind.RECOMPUTE:
            (frozen, by_param), block_end = inside(ev.key), trace.ends[i]
        node = calls[i] if ev.kind == EventKind.UNPACK else frozen
        if ev.kind == EventKind.GRAD:
            # the node that made this gradient, its weights still cached, as the gradient lands
            backward = max(backward, by_param.get(ev.key, 0) + open_bytes + trace.max_grad_bytes)
            b = bucket_of[ev.key]
            if b not in got:
                got[b] = set()
                expected[b] = {p for run in buckets[b].runs for p in run.params if p in touched}
                open_bytes += buckets[b].grad_nbytes(itemsize)
            got[b].add(ev.key)
        backward = max(backward, node + open_bytes + trace.max_grad_bytes)
        if ev.kind == EventKind.GRAD and got[b] >= expected[b]:
            open_bytes -= buckets[b].grad_nbytes(itemsize)  # complete: copied out, its slot freed
    return max(forward, backward)


def recompute_seconds(profile: ActivationProfile, chosen: Iterable[int]) -> float:
    """Forward seconds that recomputing ``chosen`` adds to a step's backward (as measured)."""
    by_module = {b.module: b for b in profile.blocks}
    return sum(by_module[m].forward_s for m in chosen)


def choose_checkpoints(profile: ActivationProfile, capacity: int, base: Iterable[int] = ()) -> CheckpointChoice:
    """The fewest blocks to checkpoint (besides those of ``base``, kept) so that the activation peak fits
    ``capacity`` bytes: greedily the block whose checkpointing saves the most first. ``fits`` is False (and
    every block is chosen) when even that is not enough."""
    order = sorted(profile.blocks, key=lambda b: (-(b.saved - b.inputs), b.module))
    chosen: list[int] = sorted(set(base))
    need = activation_bytes(profile, chosen)
    for b in order:
        if need <= capacity:
            break
        if b.saved <= b.inputs or b.module in chosen:
            continue  # checkpointing it keeps as much as it saves: no gain
        chosen.append(b.module)
        need = activation_bytes(profile, chosen)
    names = {b.module: b.name for b in profile.blocks}
    modules = tuple(sorted(chosen))
    return CheckpointChoice(modules, tuple(names[m] for m in modules), need,
                            recompute_seconds(profile, modules), need <= capacity)


def checkpoint_hint(profile: ActivationProfile | None, capacity: int, mode: str) -> str:
    """One sentence for a budget error whose activations do not fit ``capacity`` bytes: what activation
    checkpointing would do about it. ``mode``: the engine's ``"off"``, ``"auto"`` or ``"modules"``."""
    if mode == "modules":
        return ('activation_checkpointing="auto" checkpoints as many transformer blocks as the budget needs '
                "(the named modules are not enough)")
    if profile is None or not profile.blocks:
        if mode == "auto":
            return ""
        return ('activation_checkpointing=["name.of.block", ...] (modules to recompute in backward) may fit; '
                'no repeated blocks were found for "auto"')
    choice = choose_checkpoints(profile, capacity)
    n = len(profile.blocks)
    if choice.fits and mode == "off":
        return (f'activation_checkpointing="auto" fits: checkpointing {len(choice.modules)} of {n} blocks brings '
                f"them to about {_fmt(choice.activation_bytes)}")
    every = activation_bytes(profile, [b.module for b in profile.blocks])
    return (f"even with all {n} blocks checkpointed they need about {_fmt(every)}, so a budget of about "
            f"{_fmt(every - capacity)} more would fit; or a smaller batch or sequence length")


def profile_of(names: Mapping[int, str], saved: Mapping[int, int], inputs: Mapping[int, int],
               calls: Mapping[int, tuple[int, float]], checkpointed: Iterable[int], forward_end: int,
               peak: int) -> ActivationProfile:
    """An :class:`ActivationProfile` from per-module measurements; ``calls``: module -> (index of its first
    call, seconds of its calls). Modules never called are left out."""
    blocks = tuple(BlockProfile(m, names[m], saved.get(m, 0), inputs.get(m, 0), calls[m][1], calls[m][0])
                   for m in sorted(names) if m in calls)
    return ActivationProfile(blocks, frozenset(checkpointed), forward_end, peak)


def checkpointed_step(trace: Trace, compute: Sequence[float], profile: ActivationProfile,
                      chosen: Iterable[int]) -> tuple[Trace, tuple[float, ...]]:
    """A model of ``trace`` (recorded with no block checkpointed) had the blocks ``chosen`` been
    checkpointed, for the simulator (``benchmarks/schedule_sim.py``): the activation peak of
    :func:`activation_bytes`, and each chosen block's forward recomputed where backward first reaches it,
    i.e. at the first backward event that reads one of the block's parameters: that event needs every
    parameter the block's forward used and takes the block's forward compute seconds more.

    [Note: the recompute model] An estimate, not the runtime's trace of a checkpointed step (which records
    the recompute's own events): the recompute is one lump at one event, its weights all needed there (the
    runtime also fetches them for the recompute), and the activation peak is the estimate's upper bound. A
    block whose parameters no backward event reads (frozen, below every trainable one) is not recomputed."""
    chosen = frozenset(chosen)
    if not chosen:
        return trace, tuple(compute)
    nf, n = trace.num_forward, len(trace.events)
    uses = list(trace.uses)
    seconds = list(compute)
    first_read: dict[int, int] = {}  # parameter -> first backward event reading it
    for j in range(nf, n):
        for p in trace.uses[j]:
            first_read.setdefault(p, j)
    for i in range(nf):
        ev = trace.events[i]
        if ev.kind is not EventKind.PRE or ev.key not in chosen:
            continue
        span = range(i, min(trace.ends[i], nf))
        params = {p for j in span for p in trace.uses[j]}
        reads = [first_read[p] for p in params if p in first_read]
        if not reads:
            continue
        k = min(reads)
        seconds[k] += sum(compute[j] for j in span)
        uses[k] = tuple(sorted(set(uses[k]) | params))
    peak = activation_bytes(profile, chosen)
    return dataclasses.replace(trace, uses=tuple(uses), activation_peak_bytes=peak), tuple(seconds)
