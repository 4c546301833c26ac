"""The runtime's side of activation checkpointing: what offload/runtime/recompute.py's ``Checkpointer`` calls back
into while backward recomputes a checkpointed call (see its [Note: recompute and the parameter buckets]),
and how "auto" chooses the blocks to checkpoint from the activations measured in the warm-up step.

A part of :class:`offload.runtime.core.Runtime`, split out by concern; its state (``ckpt``, ``profile``,
``checkpoint_choice``, ``warmup``, ``recompute_*``, ``held``, ``reserve``) is set up in ``Runtime.__init__`` and
``Runtime._reset_step``."""

from __future__ import annotations

import torch

from ..config import format_bytes
from ..errors import BudgetTooSmallError
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
from ..planning.schedule import budget_error, min_arena_bytes
from ..planning.trace import EventKind, Trace
from .param_access import _Busy, _UseDetector

_STANDIN = "_offload_weight"  # attribute of a stand-in tensor: the weight view it stands for (a _ParamRef)


def _standin(t: torch.Tensor, ref) -> torch.Tensor:
    """A one-element tensor with ``t``'s shape, dtype and device (what checkpoint checks a recomputed tensor
    against) that names the weight view ``ref`` it stands for."""
    s = torch.empty((), dtype=t.dtype, device=t.device).expand(t.shape)
    setattr(s, _STANDIN, ref)
    return s


class RecomputeMixin:
    """Recompute callbacks, the activation profile and the "auto" checkpoint choice of the runtime."""

    def recompute_begin(self, region: int, module: int) -> list:
        """Backward is about to recompute checkpointed call ``region`` of ``module``: record it as one
        RECOMPUTE event, follow the plan, and return the contexts to run the recompute under."""
        with _Busy(self):
            self._begin_backward()
            self.node_buckets = set()
            self.recompute_event[region] = self.recorder.recompute_begin(module)
            self._advance(EventKind.RECOMPUTE, module)
            # On demand, fetches keep room for what the recompute will save (as measured in forward).
            self.reserve = self.ckpt.region_bytes.get(region, 0)
            if not self.on_plan:
                self._make_room(0)
                self.standin_regions.add(region)  # see [Note: recomputed weights off plan]
            self.recompute_region = region
        return [_UseDetector(self)]  # the weights it reads are fetched (and held) like forward's

    def recompute_saved(self, region: int, t: torch.Tensor) -> torch.Tensor | None:
        """A tensor the recompute saves for the call's backward: device memory until the call is done. A
        weight view into a slot: on plan, that bucket stays put until then; off plan, a stand-in is saved
        instead (returned), resolved when the call's backward unpacks it (``recomputed_unpacked``)."""
        with _Busy(self):
            if t.device != self.backend.device or t.layout != torch.strided:
                return None
            ref = self._locate(t)
            if ref is not None:
                if region in self.standin_regions:
                    return _standin(t, ref)
                self.held.setdefault(region, set()).add(self.bucket_of[ref.param])
                return None
            storage = t.untyped_storage()
            if self.memory.hold(storage.data_ptr(), storage.nbytes()):
                self.reserve = max(0, self.reserve - storage.nbytes())
            self.recompute_holds.setdefault(region, []).append(storage.data_ptr())
            return None

    def recompute_end(self, region: int) -> None:
        self.recorder.recompute_end()
        self.recompute_region = None
        self.reserve = 0
        if region in self.standin_regions:  # no saved tensor points into its buckets: they may go
            self.held.pop(region, None)
            with _Busy(self):
                self._evict_to_fit(0)  # back within the cache's limit before the call's backward runs

    def recomputed_unpacked(self, x: torch.Tensor) -> torch.Tensor:
        """What checkpoint hands back for a tensor a checkpointed call saved: a stand-in for a weight view
        (``recompute_saved``) becomes that view, its bucket fetched first if it is not on the device (as
        the unpack hook of a call that is not checkpointed does, [Note: saved parameters]), protected
        while the node runs; any other tensor is returned as it is."""
        ref = getattr(x, _STANDIN, None)
        return x if ref is None else self._param_view(ref)

    def region_saved(self, block: int, region: int, t: torch.Tensor) -> None:
        """Forward of a checkpointed call: ``t`` is what it would have saved (measured, not kept)."""
        with _Busy(self):
            if t.device == self.backend.device and t.layout == torch.strided and self._locate(t) is None:
                self.ckpt.count(block, region, t)
                self.memory.saw_saved(t.untyped_storage().nbytes())  # saved for real once "auto" un-checkpoints it

    def region_done(self, region: int) -> None:
        """The backward of checkpointed call ``region`` is over: its buckets and recomputed tensors go."""
        with _Busy(self):
            i = self.recompute_event.pop(region, None)
            if i is not None:
                self.recorder.region_done(i)
            self.held.pop(region, None)
            for key in self.recompute_holds.pop(region, ()):
                self.memory.drop(key)

    def _profile(self, peak: int) -> ActivationProfile:
        rec = self.recorder
        return profile_of(self.ckpt.blocks, self.ckpt.saved, self.ckpt.inputs,
                          rec.calls(self.ckpt.blocks), self.ckpt.active,
                          self.forward_end_activations or self.memory.parts["activations"], peak)

    def _drop_plan(self) -> None:
        """Run the next step on demand (its calls will differ from the plan's) and plan it at its step()."""
        self.on_plan = False
        self._deactivate()  # every bucket back to the host: nothing resident keeps pre-update weights
        self.plan = self.train_plan = None

    def _choose_checkpoints(self, trace: Trace) -> bool:
        """After the warm-up step (every block checkpointed): checkpoint the fewest blocks that fit the
        budget from now on, none if nothing needs it (see [Note: auto and no checkpointing] in
        offload/planning/activations.py); later, when a plan does not fit: more blocks. True when that changes what
        is checkpointed."""
        if self.checkpoint_choice is None:  # after the warm-up
            plain = activation_bytes(self.profile, ())
            held = (plain + self.memory.parts["buffers"] + self.memory.parts["headroom"]
                    + on_demand_bytes(trace, self.buckets, self.itemsize))
            if held <= self.config.budget and self.memory.peak <= self.config.budget:  # the warm-up's did too
                self.warmup = (trace, self.profile)  # to choose from if that gives no plan that fits
                return self._checkpoint(CheckpointChoice((), (), plain, 0.0, True))
            try:
                return self._checkpoint(self._fitting_choice(trace, self.profile, ()))
            except BudgetTooSmallError as e:
                if held > self.config.budget:
                    raise
                raise BudgetTooSmallError(  # the warm-up alone went over: what it costs, and what would not
                    f'{e} The warm-up step of "auto" checkpoints every block, and each recompute needs its block\'s '
                    f"weights on the device at once: it peaked at "
                    f"{format_bytes(self.memory.peak)}. With no block checkpointed a step holds at most about "
                    f"{format_bytes(held)}: activation_checkpointing=None may fit this budget.",
                    min_budget_bytes=e.min_budget_bytes, budget_bytes=e.budget_bytes, breakdown=e.breakdown) from None
        warmup, self.warmup = self.warmup, None
        if warmup is not None:  # no checkpointing gave no plan that fits: choose as if it had not been tried
            choice = self._fitting_choice(*warmup, ())
            if choice.modules:
                return self._checkpoint(choice)
        return self._checkpoint(self._fitting_choice(trace, self.profile, self.ckpt.active))  # only ever more

    def _fitting_choice(self, trace: Trace, profile: ActivationProfile, base) -> CheckpointChoice:
        """The fewest blocks besides ``base`` whose activations (estimated from ``profile``) fit the budget
        beside the leanest arena ``trace`` needs; BudgetTooSmallError if even every block does not."""
        arena = min_arena_bytes(trace, self.buckets, self.itemsize)
        headroom = self.memory.parts["headroom"]
        capacity = self.config.budget - self.memory.parts["buffers"] - trace.max_grad_bytes - arena - headroom
        choice = choose_checkpoints(profile, capacity, base)
        if not choice.fits:
            need = dict(arena=arena, activations=choice.activation_bytes, fixed=self.memory.parts["buffers"],
                        grad=trace.max_grad_bytes, headroom=headroom)
            raise self._activation_hint(budget_error(self.config.budget, **need), capacity, profile)
        return choice

    def _checkpoint(self, choice: CheckpointChoice) -> bool:
        """Checkpoint what ``choice`` says from the next forward on; True if that changes anything."""
        self.checkpoint_choice = choice
        if frozenset(choice.modules) == self.ckpt.active:
            return False
        self.ckpt.set_active(choice.modules)
        return True

    def _activation_hint(self, err: BudgetTooSmallError, capacity: int,
                         profile: ActivationProfile | None = None) -> BudgetTooSmallError:
        """``err`` with what activation checkpointing would (or could not) do about it, when activations
        are part of the problem (measured in ``profile``, by default the last step's)."""
        if not err.breakdown.get("activations"):
            return err
        hint = checkpoint_hint(profile or self.profile, capacity, self.checkpoint_mode)
        if not hint:
            return err
        return BudgetTooSmallError(f"{err} Activations: {hint}.", min_budget_bytes=err.min_budget_bytes,
                                   budget_bytes=err.budget_bytes, breakdown=err.breakdown)

    @property
    def checkpoint_mode(self) -> str:
        spec = self.config.activation_checkpointing
        return "off" if spec is None else ("auto" if spec == AUTO else "modules")

    def checkpoint_stats(self) -> dict:
        """What is checkpointed and what the activations measured, for ``memory_stats()``."""
        names = self.ckpt.blocks
        choice = self.checkpoint_choice
        return {
            "mode": self.checkpoint_mode,
            "checkpointed": [names[m] for m in sorted(self.ckpt.active)],
            "blocks": len(names),
            "estimated_activation_bytes": choice.activation_bytes if choice is not None else None,
            # forward seconds of the checkpointed blocks, as measured: what recomputing adds to backward
            # (the trace's RECOMPUTE events carry the measured time into the scheduler's cost model)
            "recompute_s": (recompute_seconds(self.profile, self.ckpt.active & {b.module for b in self.profile.blocks})
                            if self.profile is not None else None),
            "saved_bytes_per_block": ({b.name: b.saved for b in self.profile.blocks}
                                      if self.profile is not None else {}),
        }
