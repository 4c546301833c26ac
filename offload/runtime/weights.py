"""The fp32 values of the parameters, read and written from outside a step (``state_dict``, ``load``,
``close``): the original tensors while the first forward is traced, the host masters after it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import DistributedError
from .idle_params import show

if TYPE_CHECKING:
    from .context import RuntimeContext
    from .executor import PlanExecutor
    from .slots import SlotTable
    from .warmup import TracedWarmup


class Weights:
    """Reads and writes parameters' fp32 values; gives them back as ordinary tensors at close."""

    def __init__(self, ctx: RuntimeContext, slots: SlotTable, executor: PlanExecutor, warmup: TracedWarmup) -> None:
        self.ctx, self.slots, self.executor, self.warmup = ctx, slots, executor, warmup

    def read(self, p: int) -> torch.Tensor:
        """Current fp32 value of parameter ``p`` (a copy)."""
        if self.ctx.phases.tracing:
            return self.warmup.originals()[p].detach().to(torch.float32, copy=True)
        return self.slots.hosted().read_param(p).view(self.ctx.params[p].shape)

    def shown_value(self, p: int) -> torch.Tensor:
        """Parameter ``p``'s value as its bucket shows it on the device: its host copy in the compute dtype (a
        view of the host arena: the caller copies it, after ``Runtime.wait_for_updates``). Under data parallel,
        this rank's own whole copy (offload/host/shard.py): no collective."""
        ctx = self.ctx
        if ctx.phases.tracing:
            return self.warmup.originals()[p].detach().to(ctx.dtype)
        return self.slots.hosted().param_source(p)

    def write(self, p: int, value: torch.Tensor) -> None:
        with torch.no_grad():
            if self.ctx.phases.tracing:
                self.warmup.originals()[p].copy_(value)
            else:
                # A copy in flight (a resident bucket's refresh after step()) may still read the host copy
                # written here: host buffers are touched only after the copies reading them finished.
                self.ctx.backend.synchronize()
                self.slots.hosted().write_master(p, value)

    def written(self) -> None:
        """Masters changed behind the plan's back: refresh whatever is on the device."""
        if self.slots.host is None:
            return
        if self.ctx.dp is not None:  # issue 20: every rank's part of the node's shared copy is in first
            self.ctx.dp.copy_written()
        self.slots.note_updates(range(len(self.slots.versions)))  # [Note: stale graphs] (slots.py)
        with torch.no_grad():
            self.executor.deactivate()
            if self.executor.plan is not None:
                self.executor.activate(self.executor.plan)

    def adopt_optimizer_state(self) -> None:
        if self.slots.host is not None:
            self.slots.host.adopt_optimizer_state(self.ctx.optimizer, list(self.ctx.params))

    def _restored(self, p: int) -> torch.Tensor:
        """Issue 20: after a data-parallel fault the other ranks no longer answer a gather: this rank's own copy
        (``close()`` then says so)."""
        dp = self.ctx.dp
        if dp is not None and dp.failed is None:
            try:
                return self.read(p)
            except DistributedError:
                pass
        return self.read(p) if dp is None else dp.local_weight(self.slots.hosted(), p)

    def restore(self) -> None:
        """Every parameter gets its fp32 value back as an ordinary tensor (as when wrapped)."""
        ctx = self.ctx
        if self.slots.host is not None:
            for p, param in enumerate(ctx.params):
                show(param)
                ctx.backend.bind(param, self._restored(p))
        elif self.warmup.original is not None:
            for param, value in zip(ctx.params, self.warmup.original):
                show(param)
                ctx.backend.bind(param, value)
