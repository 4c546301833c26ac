"""Array helpers of the greedy scheduler: a combined-key lexsort, the copies' latest issue times (C++ where
built), and a range-maximum table."""

from __future__ import annotations


import numpy as np

from ._reference import latest_issue_reference

try:
    from .. import _C
except ImportError:  # a source tree without the built extension: the Python references run
    _C = None  # type: ignore[assignment]  # mypy types _C by its stub (offload/_C.pyi)


def lexsort(keys, bounds) -> np.ndarray:
    """``np.lexsort(keys)`` (the last key primary) for integer keys with ``0 <= keys[i] < bounds[i]``: one
    stable argsort of a combined int64 key where it fits (the same permutation, ties included), else
    ``np.lexsort``."""
    if not len(keys[0]) or int(np.prod([float(x) for x in bounds])) >= 2 ** 62:
        return np.lexsort(keys)
    combined = np.zeros(len(keys[0]), dtype=np.int64)
    for key, bound in zip(reversed(keys), reversed(bounds)):  # primary first
        combined *= bound
        combined += key
    return np.argsort(combined, kind="stable")


def latest_issue(deadline: np.ndarray, duration: np.ndarray) -> np.ndarray | list[float]:
    """``latest``'s backward pass over the copies in (need, bucket) order: each copy issues as late as
    the next one allows, ``out[q] = min(deadline[q], out[q + 1]) - duration[q]`` (sequential). In C++
    where built (``cpp/schedule_kernels.cpp``: the same float operations, so bitwise the same)."""
    if _C is None:
        return latest_issue_reference(deadline.tolist(), duration.tolist())
    return _C.latest_issue(deadline, duration)


class MaxTable:
    """Range maximum over a fixed array, queried for many ranges at once (a sparse table, one row per
    power-of-two span, so that a batch of queries is two gathers). ``buffer``: a (levels, len) int64
    array to build it in (reused across points), or None."""

    def __init__(self, values: np.ndarray, buffer: np.ndarray | None = None):
        values = np.asarray(values, dtype=np.int64)
        n = len(values)
        shape = (max(1, n.bit_length()), max(1, n))  # row j: max of 2^j values from each start
        self.table = buffer if buffer is not None and buffer.shape == shape else np.zeros(shape, dtype=np.int64)
        self.table[0, :n] = values
        for j in range(1, len(self.table)):
            h = 1 << (j - 1)
            m = n - 2 * h + 1
            np.maximum(self.table[j - 1, :m], self.table[j - 1, h:h + m], out=self.table[j, :m])

    def query(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """max(values[lo:hi]) for each pair; 0 for an empty range."""
        length = hi - lo
        live = length > 0
        if not live.all():
            out = np.zeros(len(lo), dtype=np.int64)
            out[live] = self.query(lo[live], hi[live])
            return out
        j = np.frexp(length.astype(np.float64))[1] - 1  # floor(log2(length)), exact
        row = j * self.table.shape[1]  # gathers from the flat table (faster than 2-D fancy indexing)
        flat = self.table.reshape(-1)
        return np.maximum(flat.take(row + lo), flat.take(row + hi - (1 << j)))
