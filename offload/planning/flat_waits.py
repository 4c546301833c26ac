"""A step's per-event waits kept flat: what the scheduler builds and the C++ lanes read, in place of a tuple of
tuples (``Program.waits`` and ``Program.grad_waits`` in simulate.py accept either)."""

from __future__ import annotations

import collections.abc
import itertools
from typing import Sequence


class FlatWaits(collections.abc.Sequence):
    """Per-event waits kept as two flat lists (what the scheduler builds and the C++ lanes read): event
    ``i`` waits for ``copies[ptr[i]:ptr[i + 1]]``. A read-only sequence of tuples, equal (and hashing
    equal) to the tuple of tuples it stands for, without building 40,000 tuples per simulated point."""

    __slots__ = ("ptr", "copies")

    def __init__(self, ptr: list[int], copies: list[int]):
        self.ptr, self.copies = ptr, copies

    def __len__(self) -> int:
        return len(self.ptr) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self)[i]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return tuple(self.copies[self.ptr[i]:self.ptr[i + 1]])

    def __iter__(self):
        c, p = self.copies, self.ptr
        return (tuple(c[p[i]:p[i + 1]]) for i in range(len(p) - 1))

    def __eq__(self, other):
        if isinstance(other, FlatWaits):
            return self.ptr == other.ptr and self.copies == other.copies
        if isinstance(other, collections.abc.Sequence):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))


def flat_waits(waits: Sequence[tuple[int, ...]]) -> tuple[list[int], list[int]]:
    """Per-event waits as (ptr, copies) (:class:`FlatWaits`' fields); ([], []) for none at all (``()``)."""
    if isinstance(waits, FlatWaits):
        return waits.ptr, waits.copies
    if not len(waits):
        return [], []
    return list(itertools.accumulate(map(len, waits), initial=0)), list(itertools.chain.from_iterable(waits))
