"""Several buckets' AdamW read straight from their parameters' own grads, in one C++ call.

[Note: updated from p.grad] (issue 17, the hot path) What ``HostState.update`` does for a batch of buckets whose
grads lie in the grad ring (one piece each, the padding between parameters zeros: [Note: sent as one batch] in
runtime/bucket_send.py), done without the ring: every run of every bucket is cut into segments, one per parameter
(its grad read where autograd left it, ``p.grad``) and one per gap of padding between two parameters of the run
(its grad read from a buffer of zeros, as the ring's cleared padding was), and all of them go to the fused kernel
in one crossing (``_C.adamw_step_segments``, [Note: segmented AdamW] in cpp/cpu_adam.h). The kernel is
element-wise, so the segments give every element of master, m, v and the 16-bit copy the bits one call per run
gives it (tests/host/test_segments.py); the step counts go up as ``update(counts=)`` and ``count_runs`` raise them.

What it covers, and nothing else (:meth:`BatchUpdate.build` returns None, the caller keeps the ring): the fused
kernel without the per-bucket finite check (fp32 and bf16 engines: float16's is deferred and never batches), every
bucket in the host arena (none device-homed or parked), every run of a bucket wholly among the parameters that got
grads. Per call (:meth:`BatchUpdate.ready`) what can change between steps: every parameter of the batch at one step
count (else each run would take its own, and a run with mixed counts updates parameter by parameter without its
padding: ``update`` does that), the grads of the dtype, length and layout the table assumes (autograd's layout
contract makes a parameter's grad contiguous like the parameter; a grad set by hand may not be), the host views the
table's addresses came from unchanged. Where ``ready`` is False the caller updates as before, from a copy.

The table (int64 rows: master, m, v addresses, the grad's index, the 16-bit copy's address or 0, numel, the
hyperparameter row) is built once per plan and host arena; a call fills only the grads' addresses (read at C speed)
and one row of hyperparameters per param group.
"""

from __future__ import annotations

import operator
from array import array
from typing import TYPE_CHECKING, Sequence

import torch

from .. import _C
from .cpu_adam import KERNEL_AVAILABLE

if TYPE_CHECKING:
    from .state import HostState

_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_data_ptr = torch.Tensor.data_ptr
_is_contiguous = torch.Tensor.is_contiguous


class BatchUpdate:
    """The segment table of one batch of buckets (see [Note: updated from p.grad])."""

    def __init__(self, host: HostState, buckets: tuple[int, ...], order: tuple[int, ...], rows: list[list[int]],
                 spans: list[tuple[int, int]], groups: tuple[int, ...], zeros: torch.Tensor,
                 runs: list[tuple[int, ...]], bucket_runs: list[tuple[tuple[int, ...], ...]], views: tuple[torch.Tensor, ...]) -> None:
        self.host, self.buckets = host, buckets
        self.order = order  # the parameters whose grads a call takes, in this order (the routes' grad order)
        self.table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 7)
        self.spans = spans  # per bucket of the batch: its rows [first, first + count)
        self.groups = groups  # hyperparameter row i is param group groups[i]'s
        self.zeros = zeros  # the padding's grads
        self.runs = runs  # the runs whose step counts go up (``HostState.count_runs``)
        self.bucket_runs = bucket_runs  # the same, per bucket of the batch
        self.views = views  # the host views the addresses came from (a new arena, a parked copy: not ready)
        self.params = tuple(sorted(order))
        self.lo, self.hi = self.params[0], self.params[-1] + 1
        # the common case: the batch's parameters are consecutive (a model's, in order): their counts one slice
        self.span = self.params == tuple(range(self.lo, self.hi))
        self.values = host.step_values
        self.counts = host.step_values[self.lo:self.hi]  # (read only where ``span``)
        self.arena = host.arena
        self.rows = int(self.table.shape[0])
        self.table_at = self.table.data_ptr()
        self.grad_dtype = _NAMES[host.device_dtype]
        self.lowp_dtype = _NAMES[host.lowp_dtype] if host.lowp_dtype is not None else "bfloat16"

    @staticmethod
    def build(host: HostState, buckets: Sequence[tuple[int, frozenset[int], tuple[int, ...]]]) -> BatchUpdate | None:
        """The table for ``buckets`` (bucket, the parameters that get grads, their grad order), or None where the
        batch is not one this covers (see the Note)."""
        if not (KERNEL_AVAILABLE and host.fused and not host.check_finite and hasattr(_C, "adamw_step_segments")):
            return None
        if host.device_dtype not in (torch.float32, torch.bfloat16) or host.accumulate:
            return None
        order = tuple(p for _, _, ps in buckets for p in ps)
        index = {p: i for i, p in enumerate(order)}
        if len(index) != len(order):
            return None
        zero_at = len(order)  # the zeros' address follows the grads'
        rows: list[list[int]] = []
        spans, groups, runs, views, gap = [], [], [], [], 0
        bucket_runs: list[tuple[tuple[int, ...], ...]] = []
        for b, got, _ in buckets:
            if b in host.away or b in host.parked or b in host.fresh:
                return None
            bucket, first = host.buckets[b], len(rows)
            master, m, v = host.master[b], host.exp_avg[b], host.exp_avg_sq[b]
            lowp = host.lowp[b] if host.lowp is not None else None
            views += _views_of(host, b)
            item = 0 if lowp is None else lowp.element_size()
            for run in bucket.runs:
                if not got.issuperset(run.params):
                    return None
                if run.group not in groups:
                    groups.append(run.group)
                hyper = groups.index(run.group)

                def row(start: int, numel: int, grad: int) -> list[int]:
                    return [master.data_ptr() + 4 * start, m.data_ptr() + 4 * start, v.data_ptr() + 4 * start, grad,
                            0 if lowp is None else lowp.data_ptr() + item * start, numel, hyper]

                at = run.start
                for p in run.params:
                    off = host.offset[p]
                    if off > at:
                        rows.append(row(at, off - at, zero_at))
                        gap = max(gap, off - at)
                    rows.append(row(off, host.specs[p].numel, index[p]))
                    at = off + host.specs[p].numel
                if run.end > at:
                    rows.append(row(at, run.end - at, zero_at))
                    gap = max(gap, run.end - at)
                runs.append(run.params)
            spans.append((first, len(rows) - first))
            bucket_runs.append(tuple(run.params for run in bucket.runs))
        zeros = torch.zeros(max(gap, 1), dtype=host.device_dtype)
        return BatchUpdate(host, tuple(b for b, _, _ in buckets), order, rows, spans, tuple(groups), zeros, runs,
                           bucket_runs, tuple(views))

    def ready(self, host: HostState, grads: list[torch.Tensor]) -> int:
        """The step count every parameter of the batch has now, if a call may update from ``grads`` (the
        parameters' grads in ``order``) now, else -1 (see the Note). The grads' lengths and dtype are torch's to
        keep: a parameter's grad has its shape and dtype (autograd's accumulation and the ``grad`` setter both
        refuse another), and a fast step's parameters are the host state's shapes in the device dtype."""
        if host is not self.host or host.arena is not self.arena:
            return -1
        now = [t for b in self.buckets for t in _views_of(host, b)]
        if not all(map(operator.is_, now, self.views)):
            return -1
        steps = host.steps
        counts = steps[self.lo:self.hi] if self.span else list(map(steps.__getitem__, self.params))
        if counts.count(counts[0]) != len(counts) or not all(map(_is_contiguous, grads)):
            return -1
        return counts[0]

    def prepare(self, grads: list[torch.Tensor], hparams, count: int) -> tuple[array, array]:
        """The grads' addresses (the zeros' last) and one row of hyperparameters per param group, for
        :meth:`run`: the batch's parameters at step ``count`` now (:meth:`ready`)."""
        addrs = array("q", list(map(_data_ptr, grads)))  # (from a list: an iterator costs ~half again)
        addrs.append(self.zeros.data_ptr())
        step = float(count + 1)
        hypers = array("d")
        for g in self.groups:
            lr, b1, b2, eps, wd = hparams[g]
            hypers.extend((step, lr, b1, b2, eps, wd, 1.0))
        return addrs, hypers

    def run(self, prepared: tuple[array, array], first: int = 0, count: int | None = None) -> None:
        """The updates of table rows ``[first, first + count)`` (all by default; a bucket's: ``spans``) with
        :meth:`prepare`'s grads and hyperparameters. Counts nothing (:meth:`count`)."""
        addrs, hypers = prepared
        if count is None:
            count = self.rows - first
        _C.adamw_step_segments(self.table_at, first, count, addrs.buffer_info()[0], len(addrs),
                               hypers.buffer_info()[0], len(self.groups), self.grad_dtype, self.lowp_dtype, False,
                               torch.get_num_threads(), "auto")

    def count(self, count: int) -> None:
        """Every parameter of the batch, all at step ``count`` before its update (:meth:`ready`), one step
        further, in ``HostState.steps`` and its count vector ([Note: step tensors] in steps.py)."""
        host = self.host
        if self.span and host.step_values is self.values:
            host.steps[self.lo:self.hi] = [count + 1] * (self.hi - self.lo)
            self.counts.fill_(float(count + 1))
        else:
            host.count_runs(self.runs)


def _views_of(host: HostState, b: int) -> list[torch.Tensor]:
    """Bucket ``b``'s host views an update writes: master, m, v and its 16-bit copy where there is one."""
    out = [host.master[b], host.exp_avg[b], host.exp_avg_sq[b]]
    if host.lowp is not None:
        out.append(host.lowp[b])
    return out
