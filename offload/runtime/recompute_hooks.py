"""The recompute coordinator: the runtime's side of activation checkpointing. It is what
offload/runtime/recompute.py's ``Checkpointer`` calls back into while backward recomputes a checkpointed
call (see its [Note: recompute and the parameter buckets]), and it chooses the blocks "auto" checkpoints
from the activations measured in the warm-up step, by planned step time (offload/planning/checkpoint_choice.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Collection

import torch

from ..config import format_bytes
from ..errors import BudgetTooSmallError, InvariantError
from ..planning.activations import (
    AUTO,
    ActivationProfile,
    CheckpointChoice,
    activation_bytes,
    checkpoint_hint,
    choose_checkpoints,
    on_demand_bytes,
    profile_of,
    recompute_seconds,
)
from ..planning.checkpoint_choice import TimedChoice, choose_by_step_time
from ..planning.schedule import budget_error, min_arena_bytes
from ..planning.trace import EventKind, Recorder, Trace
from .guards import refuse_forward_in_backward
from .phases import Pass
from .recompute import Checkpointer, candidates
from .residency import ParamRef

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from .context import RuntimeContext
    from .executor import PlanExecutor
    from .param_access import ParamAccess
    from .slots import SlotTable

_STANDIN = "_offload_weight"  # attribute of a stand-in tensor: the weight view it stands for (a ParamRef)


def _standin(t: torch.Tensor, ref: ParamRef) -> torch.Tensor:
    """A one-element tensor with ``t``'s shape, dtype and device (what checkpoint checks a recomputed tensor
    against) that names the weight view ``ref`` it stands for."""
    s = torch.empty((), dtype=t.dtype, device=t.device).expand(t.shape)
    setattr(s, _STANDIN, ref)
    return s


class RecomputeCoordinator:
    """Recompute callbacks, the activation profile and the "auto" checkpoint choice."""

    def __init__(self, ctx: RuntimeContext, slots: SlotTable, executor: PlanExecutor, access: ParamAccess,
                 begin_backward: Callable[[], None]) -> None:
        self.ctx = ctx
        self.slots = slots
        self.executor = executor
        self.access = access
        self._begin_backward = begin_backward
        spec = ctx.config.activation_checkpointing
        self.auto = spec == AUTO
        self.blocks = candidates(spec, ctx.module)
        if self.auto and not self.blocks:
            raise ValueError('activation_checkpointing="auto" found no repeated blocks (children of an '
                             "nn.ModuleList or nn.Sequential with submodules) to checkpoint in this model; "
                             "name the modules instead: activation_checkpointing=[\"layers.0\", ...]")
        self.ckpt = Checkpointer(ctx.module, self, self.blocks)
        self.choice: CheckpointChoice | None = None  # what "auto" decided after the warm-up
        self.timed: TimedChoice | None = None  # the candidates "auto" weighed for it, by planned step time
        # "auto" runs with no block checkpointed where the warm-up says that may fit: the warm-up's (trace,
        # profile), to choose blocks from if that step's plan does not fit
        self.warmup: tuple[Trace, ActivationProfile] | None = None
        self.profile: ActivationProfile | None = None  # activation bytes per block, of the last step
        # a user's reentrant recompute running: (module, region, the contexts it entered)
        self.user: tuple[int, int, list[AbstractContextManager[object]]] | None = None
        self.reset_step()

    def start(self) -> None:
        """Checkpoint the configured modules ("auto": every block in the warm-up step, then it chooses)."""
        if self.ctx.config.activation_checkpointing is not None:
            self.ckpt.set_active(self.blocks)

    def reset_step(self) -> None:
        user, self.user = self.user, None
        if user is not None:  # it raised (the backward failed): leave its contexts, which are on top
            self.ckpt.recomputing = None
            for c in reversed(user[2]):
                c.__exit__(None, None, None)
        self.ckpt.reset()
        self.forward_end_activations = 0  # saved bytes held when this step's forward ended
        self.event: dict[int, int] = {}  # checkpointed call (region) -> its RECOMPUTE event
        self.standin_regions: set[int] = set()  # regions recomputed off plan: weight views saved as stand-ins
        self.holds: dict[int, list[int]] = {}  # region -> storages of its recomputed tensors
        self.slots.reserve = 0

    # -- callbacks of the Checkpointer (offload/runtime/recompute.py) ------------------------------------

    def recompute_begin(self, region: int, module: int) -> list[AbstractContextManager[object]]:
        """Backward is about to recompute checkpointed call ``region`` of ``module``: record it as one
        RECOMPUTE event, follow the plan, and return the contexts to run the recompute under."""
        ctx, executor = self.ctx, self.executor
        with ctx.busy:
            self._begin_backward()
            self.access.new_node()
            self.event[region] = executor.recorder.recompute_begin(module)
            executor.advance(EventKind.RECOMPUTE, module)
            # On demand, fetches keep room for what the recompute will save (as measured in forward).
            self.slots.reserve = self.ckpt.region_bytes.get(region, 0)
            if not executor.on_plan:
                self.slots.make_room(0)
                self.standin_regions.add(region)  # see [Note: recomputed weights off plan]
            self.access.begin_recompute(region)
            ctx.phases.enter(Pass.RECOMPUTE)
        return [self.access.detector()]  # the weights it reads are fetched (and held) like forward's

    def recompute_saved(self, region: int, t: torch.Tensor) -> torch.Tensor | None:
        """A tensor the recompute saves for the call's backward: device memory until the call is done. A
        weight view into a slot: on plan, that bucket stays put until then; off plan, a stand-in is saved
        instead (returned), resolved when the call's backward unpacks it (``recomputed_unpacked``)."""
        ctx = self.ctx
        with ctx.busy:
            if t.device != ctx.backend.device or t.layout != torch.strided:
                return None
            ref = self.access.locate(t)
            if ref is not None:
                if region in self.standin_regions:
                    return _standin(t, ref)
                self.access.hold(region, self.slots.bucket_of[ref.param])
                return None
            storage = t.untyped_storage()
            if ctx.memory.hold(storage.data_ptr(), storage.nbytes()):
                self.slots.reserve = max(0, self.slots.reserve - storage.nbytes())
            self.holds.setdefault(region, []).append(storage.data_ptr())
            return None

    def recompute_end(self, region: int) -> None:
        phases = self.ctx.phases
        if phases.current is Pass.RECOMPUTE:
            phases.enter(Pass.BACKWARD)
        self.executor.recorder.recompute_end()
        self.access.end_recompute()
        self.slots.reserve = 0
        if region in self.standin_regions:  # no saved tensor points into its buckets: they may go
            self.access.unhold(region)
            with self.ctx.busy:
                self.slots.evict_to_fit(0)  # back within the cache's limit before the call's backward runs

    def recomputed_unpacked(self, x: torch.Tensor) -> torch.Tensor:
        """What checkpoint hands back for a tensor a checkpointed call saved: a stand-in for a weight view
        (``recompute_saved``) becomes that view, its bucket fetched first if it is not on the device (as
        the unpack hook of a call that is not checkpointed does, [Note: saved parameters]), protected
        while the node runs; any other tensor is returned as it is."""
        ref = getattr(x, _STANDIN, None)
        if ref is not None:
            x = self.access.param_view(ref)
        if torch.is_grad_enabled() and (ref is not None or self.access.locate(x) is not None):
            return self.access.graph_copy(x)  # issue 19: create_graph=True saves it in the graph it builds
        return x

    def region_saved(self, block: int, region: int, t: torch.Tensor) -> None:
        """Forward of a checkpointed call: ``t`` is what it would have saved (measured, not kept)."""
        ctx = self.ctx
        with ctx.busy:
            if t.device == ctx.backend.device and t.layout == torch.strided and self.access.locate(t) is None:
                self.ckpt.count(block, region, t)
                ctx.memory.saw_saved(t.untyped_storage().nbytes())  # saved for real once "auto" un-checkpoints it

    def region_done(self, region: int) -> None:
        """The backward of checkpointed call ``region`` is over: its buckets and recomputed tensors go."""
        with self.ctx.busy:
            i = self.event.pop(region, None)
            if i is not None:
                self.executor.recorder.region_done(i)
            self.access.unhold(region)
            for key in self.holds.pop(region, ()):
                self.ctx.memory.drop(key)

    # -- a user's own torch.utils.checkpoint(..., use_reentrant=True) (issue 19) ---------------------------
    # [Note: a user's reentrant checkpoint] torch.utils.checkpoint(fn, x, use_reentrant=True) runs ``fn`` under
    # no_grad in forward (the engine sees ordinary module calls that save nothing) and, in backward, runs it
    # again with grad inside its node's backward, then a nested backward through what it made. The engine
    # treats that forward inside backward as a recompute of its own: one RECOMPUTE event (so the plan keeps
    # its weights' fetches), the use detector fetching what it reads, the modules it calls standing aside,
    # and the engine's own saved-tensor hooks, so the weight views it saves are references resolved when the
    # nested backward unpacks them ([Note: saved parameters]): the region is over when the call returns.
    # (Before, such a forward began a new step in the middle of the backward: silently wrong numbers.)
    # A non-reentrant one recomputes under checkpoint's own saved-tensor hooks, which the engine's would
    # hide, and may stop early, inside the call: refused, naming the alternatives.

    def user_recompute_begins(self, module: int, pack: Callable[[torch.Tensor], Any],
                              unpack: Callable[[Any], torch.Tensor]) -> None:
        """A forward of ``module`` begins inside a backward: torch.utils.checkpoint with ``use_reentrant=True``
        recomputing a checkpointed call of the user's (or a forward called from a backward hook). It runs as a
        recompute of the engine's own does (see [Note: a user's reentrant checkpoint]); one under other
        saved-tensor hooks (``use_reentrant=False``) is refused (``guards.refuse_forward_in_backward``)."""
        if self.user is not None or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            refuse_forward_in_backward(self.ctx, module)
        region = len(self.ckpt.regions)
        self.ckpt.regions.append(module)
        contexts = [*self.recompute_begin(region, module),  # the use detector: weights fetched and held
                    torch.autograd.graph.saved_tensors_hooks(pack, unpack)]  # weight views saved as references
        entered: list[AbstractContextManager[object]] = []
        try:
            for c in contexts:
                c.__enter__()
                entered.append(c)
        except BaseException:
            for c in reversed(entered):
                c.__exit__(None, None, None)
            self.recompute_end(region)
            raise
        self.user = (module, region, entered)
        self.ckpt.recomputing = region  # the hooks of the modules it calls stand aside, as in a recompute

    def user_recompute_ends(self, module: int) -> bool:
        """A module's forward ended during a user's recompute: if it is the one that began it, the recompute
        is over (True)."""
        user = self.user
        if user is None or user[0] != module:
            return False
        self.user = None
        _, region, entered = user
        self.ckpt.recomputing = None
        for c in reversed(entered):
            c.__exit__(None, None, None)
        self.recompute_end(region)
        self.region_done(region)  # its weight views are references: nothing need stay on the device
        return True

    # -- what the runtime tells it -------------------------------------------------------------------------

    def count_saved(self, block: int, t: torch.Tensor) -> None:
        """The pack hook saw ``t`` saved inside ``block`` (what checkpointing it would spare)."""
        with self.ctx.busy:
            self.ckpt.count(block, None, t)

    def forward_ended(self) -> None:
        self.forward_end_activations = self.ctx.memory.parts["activations"]

    def backward_ended(self) -> None:
        """Calls whose inputs need no grad never report the end of their backward: it is over now."""
        for region in set(self.event) | set(self.holds) | set(self.access.held):
            self.region_done(region)

    def measure(self, recorder: Recorder, peak: int) -> None:
        """The activation profile of this step (per block, from what ``recorder`` saw)."""
        ckpt = self.ckpt
        self.profile = profile_of(ckpt.blocks, ckpt.saved, ckpt.inputs, recorder.calls(ckpt.blocks), ckpt.active,
                                  self.forward_end_activations or self.ctx.memory.parts["activations"], peak)

    def decided(self) -> None:
        """A plan was built: from now on "auto" only ever checkpoints more."""
        self.warmup = None

    # -- "auto" ------------------------------------------------------------------------------------------------

    def choose(self, trace: Trace) -> bool:
        """After the warm-up step (every block checkpointed): from the fewest blocks that fit the budget (none
        if nothing needs it, see [Note: auto and no checkpointing] in offload/planning/activations.py) and a few
        sets with more, checkpoint the one whose planned step is fastest from now on (:meth:`_by_step_time`);
        later, when a plan does not fit: more blocks, chosen the same way. True when that changes what is
        checkpointed."""
        profile = self._profile()
        if self.choice is None:  # after the warm-up
            return self._after_warmup(trace, profile)
        warmup, self.warmup = self.warmup, None
        if warmup is not None:  # no checkpointing gave no plan that fits: choose as if it had not been tried
            choice = self._fitting_choice(*warmup, ())
            if choice.modules:
                return self._checkpoint(self._by_step_time(*warmup, choice))
        fewest = self._fitting_choice(trace, profile, self.ckpt.active)  # only ever more
        return self._checkpoint(self._by_step_time(trace, profile, fewest))

    def _after_warmup(self, trace: Trace, profile: ActivationProfile) -> bool:
        ctx = self.ctx
        memory, budget = ctx.memory, ctx.budget
        plain = activation_bytes(profile, ())
        held = (plain + memory.fixed + memory.parts["headroom"]
                + on_demand_bytes(trace, self.slots.buckets, ctx.itemsize))
        if held <= budget and memory.peak <= budget:  # the warm-up's did too
            choice = self._by_step_time(trace, profile, CheckpointChoice((), (), plain, 0.0, True))
            # none checkpointed: the warm-up's, to choose from if that gives no plan that fits
            self.warmup = None if choice.modules else (trace, profile)
            return self._checkpoint(choice)
        try:
            return self._checkpoint(self._by_step_time(trace, profile, self._fitting_choice(trace, profile, ())))
        except BudgetTooSmallError as e:
            if held > budget:
                raise
            raise BudgetTooSmallError(  # the warm-up alone went over: what it costs, and what would not
                f'{e} The warm-up step of "auto" checkpoints every block, and each recompute needs its block\'s '
                f"weights on the device at once: it peaked at "
                f"{format_bytes(memory.peak)}. With no block checkpointed a step holds at most about "
                f"{format_bytes(held)}: activation_checkpointing=None may fit this budget.",
                min_budget_bytes=e.min_budget_bytes, budget_bytes=e.budget_bytes, breakdown=e.breakdown) from None

    def _profile(self) -> ActivationProfile:
        if self.profile is None:
            raise InvariantError("checkpoints are chosen before any step measured its activations")
        return self.profile

    def _fitting_choice(self, trace: Trace, profile: ActivationProfile, base: Collection[int]) -> CheckpointChoice:
        """The fewest blocks besides ``base`` whose activations (estimated from ``profile``) fit the budget
        beside the leanest arena ``trace`` needs; BudgetTooSmallError if even every block does not."""
        ctx = self.ctx
        parts = ctx.memory.parts
        arena = min_arena_bytes(trace, self.slots.buckets, ctx.itemsize)
        headroom = parts["headroom"]
        capacity = ctx.budget - ctx.memory.fixed - trace.max_grad_bytes - arena - headroom
        choice = choose_checkpoints(profile, capacity, base)
        if not choice.fits:
            need = dict(arena=arena, activations=choice.activation_bytes, fixed=ctx.memory.fixed,
                        grad=trace.max_grad_bytes, headroom=headroom)
            raise self.activation_hint(budget_error(ctx.budget, **need), capacity, profile)
        return choice

    def _by_step_time(self, trace: Trace, profile: ActivationProfile, fewest: CheckpointChoice) -> CheckpointChoice:
        """Of ``fewest`` (the fewest blocks that fit) and a few sets with more blocks, the one whose planned
        step is fastest (issue 18; offload/planning/checkpoint_choice.py)."""
        self.timed = choose_by_step_time(trace, profile, fewest, self.executor.plan_for)
        return self.timed.choice

    def _checkpoint(self, choice: CheckpointChoice) -> bool:
        """Checkpoint what ``choice`` says from the next forward on; True if that changes anything."""
        self.choice = choice
        if frozenset(choice.modules) == self.ckpt.active:
            return False
        self.ckpt.set_active(choice.modules)
        return True

    def activation_hint(self, err: BudgetTooSmallError, capacity: int,
                        profile: ActivationProfile | None = None) -> BudgetTooSmallError:
        """``err`` with what activation checkpointing would (or could not) do about it, when activations
        are part of the problem (measured in ``profile``, by default the last step's)."""
        if not err.breakdown.get("activations"):
            return err
        hint = checkpoint_hint(profile or self.profile, capacity, self.mode)
        if not hint:
            return err
        return BudgetTooSmallError(f"{err} Activations: {hint}.", min_budget_bytes=err.min_budget_bytes,
                                   budget_bytes=err.budget_bytes, breakdown=err.breakdown)

    @property
    def mode(self) -> str:
        spec = self.ctx.config.activation_checkpointing
        return "off" if spec is None else ("auto" if spec == AUTO else "modules")

    def stats(self) -> dict:
        """What is checkpointed and what the activations measured, for ``memory_stats()``."""
        names = self.ckpt.blocks
        choice, profile = self.choice, self.profile
        return {
            "mode": self.mode,
            "checkpointed": [names[m] for m in sorted(self.ckpt.active)],
            "blocks": len(names),
            "estimated_activation_bytes": choice.activation_bytes if choice is not None else None,
            # forward seconds of the checkpointed blocks, as measured: what recomputing adds to backward
            # (the trace's RECOMPUTE events carry the measured time into the scheduler's cost model)
            "recompute_s": (recompute_seconds(profile, self.ckpt.active & {b.module for b in profile.blocks})
                            if profile is not None else None),
            "saved_bytes_per_block": {b.name: b.saved for b in profile.blocks} if profile is not None else {},
            # "auto": the fewest blocks that fit, and the candidate sets weighed by planned step (a model)
            **self._timed_stats(names),
        }

    def _timed_stats(self, names: dict[int, str]) -> dict:
        timed = self.timed
        if timed is None:
            return {"fewest_that_fit": None, "candidates": []}
        return {
            "fewest_that_fit": [names[m] for m in timed.fewest],
            "candidates": [{"checkpointed": [names[m] for m in c.modules], "predicted_step_s": c.step_s,
                            "estimated_activation_bytes": c.activation_bytes, "recompute_s": c.recompute_s,
                            "chosen": i == timed.chosen} for i, c in enumerate(timed.candidates)],
        }
