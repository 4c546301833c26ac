"""The host's grad staging ring ([Note: grad staging ring] in ``planning/buckets.py``): where device-to-host grad
copies land before the CPU lane reads them, lent piece by piece, each piece's next copy ordered after its reader."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from ..errors import InvariantError
from ..planning.buckets import HOST_ALIGN

if TYPE_CHECKING:
    from ..backend.base import Event


class Landing(NamedTuple):
    """Where one device-to-host grad copy goes (:meth:`HostState.landing`)."""

    view: torch.Tensor  # the bucket's trainable prefix, in the device dtype (or the fp32 sum itself)
    lent: Lent | None  # the bytes of the grad ring it borrows (hand them back with HostState.staged_read_by)
    after: tuple[Event, ...]  # the copy may overwrite ``view`` only after these: those bytes' previous readers


class Lent:
    """Bytes ``[start, end)`` of the grad ring and the CPU-lane work that reads the grads they hold (None while
    the runtime has not named it yet)."""

    __slots__ = ("start", "end", "reader")

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.reader: Event | None = None


class GradRing:
    """[Note: grad staging ring] in ``buckets.py``: bucket after bucket in one byte region, starting again at
    the beginning when a bucket does not fit before the end; each piece is lent to one copy, and the copy that
    next covers any of its bytes waits for its reader. Holds events but never waits: the runtime puts them
    among the copy's waits."""

    def __init__(self, region: torch.Tensor, dtype: torch.dtype) -> None:
        self.region, self.dtype = region, dtype  # region: uint8
        self.head = 0
        self.live: list[Lent] = []  # pieces whose bytes no later piece has covered yet
        # typed views by (start, end): a steady step takes the same pieces every time (a view costs ~5 us)
        self._views: dict[tuple[int, int], torch.Tensor] = {}

    def take(self, numel: int) -> tuple[Lent, torch.Tensor, tuple[Event, ...]]:
        size, capacity = numel * self.dtype.itemsize, self.region.numel()
        if size > capacity:
            raise InvariantError(f"a grad copy of {size} bytes does not fit the host's grad staging ring of "
                                 f"{capacity} bytes (sized by the largest pieces): a bug in offload, please report it")
        start = self.head if self.head + size <= capacity else 0
        end = start + size
        covered = [x for x in self.live if x.start < end and start < x.end]
        if any(x.reader is None for x in covered):  # nothing would keep this copy off grads not read yet
            raise InvariantError("host grad staging bytes are lent out again before the reader of the grads they "
                                 "hold was recorded: a bug in offload, please report it")
        self.live = [x for x in self.live if x not in covered] + [piece := Lent(start, end)]
        self.head = -(-end // HOST_ALIGN) * HOST_ALIGN
        view = self._views.get((start, end))
        if view is None:
            if len(self._views) >= 256:  # pieces that keep moving (sizes that change): no unbounded cache
                self._views.clear()
            view = self._views[(start, end)] = self.region[start:end].view(self.dtype)
        return piece, view, tuple(x.reader for x in covered if x.reader is not None)

    def reset(self) -> None:
        """Every copy and reader is done (the runtime drained and synchronized): forget them."""
        self.head = 0
        self.live = []
