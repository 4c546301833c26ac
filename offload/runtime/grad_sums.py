"""The gradients a grad pipeline gathered since the last ``step()`` (offload/runtime/grads.py), as the code that
shows them in ``p.grad`` (issue 19, offload/runtime/plain_grads.py) and data parallel (issue 20,
offload/runtime/distributed.py) read and change them: the host fp32 sums, their norms and the clip factor.

The pipeline owns that state (``GradPipeline.pending``, ``norms``, ``clip_factor``) and changes it itself as
grads are gathered and consumed; everything else changes it only through these methods
(``grads.sums``)."""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING, Iterable

import torch

from .grad_records import PendingGrads

if TYPE_CHECKING:
    from .grads import GradPipeline


class GatheredSums:
    """The gathered sums of one :class:`~offload.runtime.grads.GradPipeline` (its ``sums``)."""

    def __init__(self, grads: GradPipeline) -> None:
        self.grads = grads
        # the last answer of pending_params, and the buckets' parameter sets it was sorted from
        self._sorted: tuple[tuple[frozenset[int], ...], list[int]] = ((), [])

    def pending_params(self) -> list[int]:
        """The parameters with a gradient gathered since the last ``step()``, in order. Sorted again only when
        the buckets' sets differ from the last call's (a fast step's are the same sets every step: compared by
        identity at C speed, where sorting 200 parameters was ~10-30 us a step; issue 17, the hot path)."""
        key = tuple(pending.params for pending in self.grads.pending.values())
        if key != self._sorted[0]:
            self._sorted = (key, sorted(chain.from_iterable(key)))
        return list(self._sorted[1])

    def grad_sum(self, p: int) -> torch.Tensor:
        """Parameter ``p``'s slice (flat) of its bucket's host gradient sum (writes go into the update)."""
        host = self.grads.slots.hosted()
        off = host.offset[p]
        return host.grad_sum(host.bucket_of[p])[off: off + self.grads.ctx.specs[p].numel]

    def wait_gathered(self) -> None:
        """Wait until every gathered sum is final: its copy to the host, or the CPU lane's widening or
        accumulation into it, is done (each ``PendingGrads.ready``)."""
        for pending in self.grads.pending.values():
            pending.ready.synchronize()

    def scale_sums(self, factor: float) -> None:
        """Multiply every gathered sum by ``factor`` (after :meth:`wait_gathered`); norms are not renewed."""
        host = self.grads.slots.hosted()
        with torch.no_grad():
            for b in self.grads.pending:
                host.grad_sum(b).mul_(factor)

    def zero_sums(self) -> None:
        """Every gathered sum becomes zeros, still gathered (after :meth:`wait_gathered`): the next step
        updates with zero grads, the next backward adds to zeros; no clipping is pending."""
        host = self.grads.slots.hosted()
        with torch.no_grad():
            for b in self.grads.pending:
                host.grad_sum(b).zero_()
        zero = torch.zeros(())
        self.grads.norms.update({p: zero for p in self.pending_params()})
        self.grads.clip_factor = 1.0

    def take_clip_factor(self) -> float:
        """The clipping coefficient the next step would apply, handed over: from now on it is 1.0 (the
        caller applied it to the sums)."""
        factor, self.grads.clip_factor = self.grads.clip_factor, 1.0
        return factor

    def drop_param(self, p: int) -> None:
        """Parameter ``p``'s gathered grad is dropped (``p.grad = None``): the step skips it, as torch's
        optimizers skip a parameter without a grad; its sum is zeroed (a later backward adds to zeros)."""
        b = self.grads.slots.bucket_of[p]
        with torch.no_grad():
            self.grad_sum(p).zero_()
        params, ready = self.grads.pending[b]
        rest = params - {p}
        if rest:
            self.grads.pending[b] = PendingGrads(rest, ready)
        else:
            del self.grads.pending[b]
        self.grads.norms.pop(p, None)

    def refresh_norms(self, params: Iterable[int]) -> None:
        """The sums of ``params`` changed outside the pipeline: recompute the norms of those still gathered
        (the clip and the float16 overflow check read them)."""
        host = self.grads.slots.hosted()
        by_bucket: dict[int, list[int]] = {}
        for p in params:
            if host.bucket_of[p] in self.grads.pending:
                by_bucket.setdefault(host.bucket_of[p], []).append(p)
        for b, ps in by_bucket.items():
            self.grads.norms.update(host.grad_norms(b, ps))

    def slot_norms(self, view: torch.Tensor, params: Iterable[int]) -> dict[int, torch.Tensor]:
        """The norms of ``params``' grads in a device grad slot ``view`` (the bucket's layout), in fp32."""
        grads = self.grads
        dtype = None if grads.ctx.dtype == torch.float32 else torch.float32
        off, specs = grads.slots.hosted().offset, grads.ctx.specs
        return {p: torch.linalg.vector_norm(view[off[p]: off[p] + specs[p].numel], dtype=dtype) for p in params}

    def fold(self, b: int, got: frozenset[int], first: bool, staged: torch.Tensor, lo: int = 0,
             last: bool = True) -> None:
        """CPU lane: fold one backward's grads of bucket ``b`` (in the grad ring, ``staged``, from element ``lo``)
        into the fp32 sum: widen them (the step's ``first``) or add them, and, with the ``last`` piece, renew
        the norms of an added sum."""
        host = self.grads.slots.hosted()
        host.take_staged(b, first, staged, lo)
        if not first and last:
            self.grads.norms.update(host.grad_norms(b, got))
