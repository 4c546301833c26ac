"""What the greedy scheduler (``greedy.py``) knows about one (trace, buckets, hardware) before any move:
computed once, as arrays, in :meth:`GreedyInputs.of`. Its first fields are the C++ move sequence's
keyword arguments (``cpp/greedy.h``'s ``GreedyConstants``, by the same names)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import Any, Sequence, TypedDict

import numpy as np

from .arrays import lexsort
from .buckets import Bucket, locate
from .hw import HardwareModel
from .intervals import grad_arrays, grad_dicts, grad_slot_reuse, needed_all
from .plan import ARENA_ALIGN
from .simulate import seconds_each
from .trace import Trace

MAX_POINTS = 32  # simulated points per mode's sequence at most ~this many moves apart (speed on huge traces)


class D2HProgram(TypedDict):
    """The device-to-host fields of every :class:`~offload.planning.simulate.Program` of one trace: per grad
    copy, by (issue, bucket), its event, bucket, bytes and its bucket's trainable elements (for AdamW)."""

    d2h_event: tuple[int, ...]
    d2h_bucket: tuple[int, ...]
    d2h_bytes: tuple[int, ...]
    adam_numel: tuple[int, ...]
    device_adam_numel: tuple[int, ...]  # per event + 1: device AdamW (device-optimizer buckets; () if none)


@dataclass(frozen=True, eq=False)
class GreedyInputs:
    """Everything about one (trace, buckets, hardware) that the moves do not change (arrays are int64 or
    float64, one entry per bucket, event or need interval as named). Build it with :meth:`of`."""

    # -- the C++ kernel's keyword arguments (``GreedyInputs.kernel_args``), in its order
    n: int  # trace events
    nb: int  # buckets
    use_b: np.ndarray  # the merged need intervals, grouped by bucket, each bucket's in event order: bucket,
    use_s: np.ndarray  # start
    use_e: np.ndarray  # and end
    size: np.ndarray  # per bucket: its bytes aligned to ARENA_ALIGN (as the arena counts them)
    nbytes: np.ndarray  # per bucket: its bytes
    dur: np.ndarray  # per bucket: seconds of its host-to-device copy alone
    updated_dur: np.ndarray  # per bucket: ``dur`` if it has grads (refreshed when resident), else 0
    updated: np.ndarray  # per bucket: 1 if it has grads
    fwd_row: np.ndarray  # per keepable bucket: the row (in use_*) of its last forward interval,
    bwd_row: np.ndarray  # of its first backward one,
    fwd_at: np.ndarray  # the start of the first,
    bwd_at: np.ndarray  # and of the second (0 for the others)
    keepable: np.ndarray  # buckets used in forward and again in backward
    tau: np.ndarray  # n + 1 floats: when compute reaches each event (sequential sums from 0.0)
    grad_profile: np.ndarray  # n + 1: live grad-slot bytes change at each event (+ start, - end)
    need_b: np.ndarray  # every (event, bucket) need, flattened in event order: bucket
    need_e: np.ndarray  # and event
    compute: np.ndarray  # per event: seconds of compute
    d2h_event: np.ndarray  # per grad copy, by (issue, bucket): the event it is issued at,
    d2h_solo: np.ndarray  # its seconds alone,
    adam_s: np.ndarray  # and the seconds of its bucket's CPU AdamW
    grad_wait_ptr: np.ndarray  # n + 1, or empty (none): event i waits for the grad copies
    grad_wait_copy: np.ndarray  # grad_wait_copy[grad_wait_ptr[i]:grad_wait_ptr[i + 1]] (``grad_waits``)
    duplex: float  # the link's duplex factor
    n_used: int  # buckets any event needs
    max_points: int  # MAX_POINTS
    # -- the Python side's only
    hw: HardwareModel
    compute_s: tuple[float, ...]  # ``compute`` as floats (what a Program holds)
    needs: list[tuple[int, ...]]  # per event: the buckets it needs
    need_ptr: np.ndarray  # n + 1: event i's needs are need_*[need_ptr[i]:need_ptr[i + 1]]
    need_key: np.ndarray  # per need: bucket * (n + 1) + event
    grads: dict[int, list[int]]  # per bucket with grads: its grad slot [start, end) (intervals.grad_info)
    grad_issue: dict[int, int]  # per bucket with grads: the event its grads go to the host
    grad_bytes: dict[int, int]  # per bucket with grads: its grad slot's bytes
    d2h_program: D2HProgram  # the device-to-host fields of every Program
    d2h_total: int  # bytes copied to the host per step
    slot_wait_event: np.ndarray  # per grad slot that takes over an earlier one's bytes: its first grad event,
    slot_wait_bucket: np.ndarray  # and the earlier slot's bucket (intervals.grad_slot_reuse)
    # device-optimizer buckets (issue 18; ``device_optimizer.restrict``; empty by default): taken out of the
    # moves, resident with their optimizer state, updated on the compute lane
    device: tuple[int, ...] = ()  # their bucket ids, ascending
    device_state_bytes: tuple[int, ...] = ()  # per device bucket: its optimizer state's bytes
    device_tail_s: float = 0.0  # their device AdamW after compute ends (grads flushed at the end of backward)
    device_adam_s: float = 0.0  # their device AdamW in all (the rest is in ``compute``)
    # deferred updates ([Note: the deferred round trip] in simulate.py): their grads summed on the host come
    # back in step(), before their device AdamW (the tail)
    device_return_bytes: tuple[int, ...] = ()  # per device bucket: the bytes of its fp32 sums copied back
    device_return_s: float = 0.0  # those copies' seconds
    # the runtime pipelines resident buckets' refreshes (overlapped updates, one GPU): [Note: the refresh
    # pipelined, modelled] in simulate.py; False: refreshes at the step start (deferred updates)
    refresh_pipelined: bool = False

    @classmethod
    def of(cls, trace: Trace, buckets: Sequence[Bucket], itemsize: int, hw: HardwareModel,
           compute: tuple[float, ...], refresh_pipelined: bool = False) -> GreedyInputs:
        n, nb = len(trace.events), len(buckets)
        bucket_of = locate(buckets)[0]
        grad_b, grad_s, grad_e, grad_issue = grad_arrays(trace, buckets, bucket_of)
        grads, grad_issue_of = grad_dicts(grad_b, grad_s, grad_e, grad_issue)  # grad_info's
        needs = needed_all(trace, bucket_of)
        # every (event, bucket) need, flattened in event order: for the program's waits
        lens = [len(bs) for bs in needs]
        need_ptr = list(itertools.accumulate(lens, initial=0))  # event i's needs: [ptr[i], ptr[i + 1])
        need_b = np.fromiter(itertools.chain.from_iterable(needs), dtype=np.int64, count=need_ptr[-1])
        need_e = np.repeat(np.arange(n, dtype=np.int64), np.asarray(lens, dtype=np.int64))
        use_b, use_s, use_e = _use_intervals(need_b, need_e, trace.ends, n, nb)
        nbytes_list = [b.nbytes(itemsize) for b in buckets]
        nbytes = np.asarray(nbytes_list, dtype=np.int64).reshape(nb)
        grad_bytes = np.fromiter((buckets[b].grad_nbytes(itemsize) for b in grad_b.tolist()), dtype=np.int64,
                                 count=len(grad_b))
        seconds = {x: hw.h2d_seconds(x) for x in set(nbytes_list)}  # one call per distinct size
        dur = np.asarray([seconds[x] for x in nbytes_list], dtype=np.float64).reshape(nb)
        compute_np = np.asarray(compute, dtype=np.float64).reshape(n)
        # live grad-slot bytes change: + at each slot's start, - at its end (integer sums: exact in any order)
        slot_bytes = (grad_bytes + ARENA_ALIGN - 1) // ARENA_ALIGN * ARENA_ALIGN  # plan.align
        grad_profile = np.zeros(n + 1, dtype=np.int64)
        np.add.at(grad_profile, grad_s, slot_bytes)
        np.add.at(grad_profile, grad_e, -slot_bytes)
        # the device-to-host side of every program (it does not depend on the point): by (issue, bucket)
        d2h = np.lexsort((grad_b, grad_issue))
        d2h_b = grad_b[d2h].tolist()
        d2h_program = D2HProgram(d2h_event=tuple(grad_issue[d2h].tolist()), d2h_bucket=tuple(d2h_b),
                                 d2h_bytes=tuple(grad_bytes[d2h].tolist()),
                                 adam_numel=tuple(buckets[b].trainable_numel for b in d2h_b), device_adam_numel=())
        # compute's waits on a reused grad slot's copy, by the intervals' rule: [Note: waits on a reused grad slot]
        reuse = grad_slot_reuse(grad_s, grad_e, grad_issue)
        reused = reuse >= 0
        slot_wait_event, slot_wait_bucket = grad_s[reused], grad_b[reuse[reused]]
        grad_wait_ptr, grad_wait_copy = grad_waits(slot_wait_event, slot_wait_bucket, d2h_b, n)
        updated = np.zeros(nb, dtype=bool)  # per bucket: has grads (refreshed when resident)
        updated[grad_b] = True
        keepable, fwd_at, bwd_at, fwd_row, bwd_row = _keep_rows(use_b, use_s, trace.num_forward, nb)
        return cls(
            n=n, nb=nb, use_b=use_b, use_s=use_s, use_e=use_e,
            size=(nbytes + ARENA_ALIGN - 1) // ARENA_ALIGN * ARENA_ALIGN,  # plan.align
            nbytes=nbytes, dur=dur, updated_dur=np.where(updated, dur, 0.0), updated=updated.astype(np.int64),
            fwd_row=fwd_row, bwd_row=bwd_row, fwd_at=fwd_at, bwd_at=bwd_at, keepable=keepable,
            # compute reaches event i at tau[i]: sequential sums from 0.0 (np.add.accumulate adds in order, as
            # itertools.accumulate(compute, initial=0.0) does)
            tau=np.add.accumulate(np.concatenate([np.zeros(1), compute_np])),
            grad_profile=grad_profile, need_b=need_b, need_e=need_e, compute=compute_np,
            d2h_event=np.asarray(d2h_program["d2h_event"], dtype=np.int64),
            d2h_solo=np.asarray(seconds_each(hw.d2h_seconds, d2h_program["d2h_bytes"]), dtype=np.float64),
            adam_s=np.asarray(seconds_each(hw.adam_seconds, d2h_program["adam_numel"]), dtype=np.float64),
            grad_wait_ptr=grad_wait_ptr, grad_wait_copy=grad_wait_copy,
            duplex=hw.duplex_factor, n_used=len(np.unique(use_b)), max_points=MAX_POINTS,
            hw=hw, compute_s=compute, needs=needs, need_ptr=np.asarray(need_ptr, dtype=np.int64),
            need_key=need_b * (n + 1) + need_e, grads=grads, grad_issue=grad_issue_of,
            grad_bytes=dict(zip(grad_b.tolist(), grad_bytes.tolist())), d2h_program=d2h_program,
            d2h_total=sum(d2h_program["d2h_bytes"]), slot_wait_event=slot_wait_event,
            slot_wait_bucket=slot_wait_bucket, refresh_pipelined=refresh_pipelined)

    def kernel_args(self) -> dict[str, Any]:
        """The C++ ``GreedyKernel``'s keyword arguments: the fields from ``n`` to ``max_points``, and where the
        refresh is pipelined :attr:`refresh_after` and the device AdamW's ``tail``."""
        args = {name: getattr(self, name) for name in KERNEL_ARGS}
        if self.refresh_pipelined:
            args.update(refresh_after=self.refresh_after, tail=self.device_tail_s)
        return args

    @functools.cached_property
    def refresh_after(self) -> np.ndarray:
        """Per bucket: the grad copy its pipelined refresh follows, its last in the CPU lane's order (-1: none;
        ``steady.refresh_after``'s choice: the copies are sorted by event)."""
        out = np.full(self.nb, -1, dtype=np.int64)
        for k, b in enumerate(self.d2h_program["d2h_bucket"]):
            out[b] = k
        return out


KERNEL_ARGS = tuple(f.name for f in dataclasses.fields(GreedyInputs))[:28]


def grad_waits(event: np.ndarray, bucket: np.ndarray, d2h_bucket: Sequence[int], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Compute's waits on grad copies as (ptr, copies) over ``n`` events (:class:`FlatWaits`' fields): at
    ``event[j]``, the copy of ``bucket[j]`` among the grad copies ``d2h_bucket`` (one per bucket; a bucket
    without one, a device-optimizer bucket updated from its slot on the compute lane, is no wait). Both
    empty where no event waits."""
    copy_of = dict(zip(d2h_bucket, range(len(d2h_bucket))))
    copy = np.fromiter((copy_of.get(b, -1) for b in bucket.tolist()), dtype=np.int64, count=len(bucket))
    keep = copy >= 0
    event, copy = event[keep], copy[keep]
    if not len(copy):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    order = np.argsort(event, kind="stable")
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(event, minlength=n), out=ptr[1:])
    return ptr, copy[order]


def _use_intervals(need_b: np.ndarray, need_e: np.ndarray, ends: Sequence[int], n: int,
                   nb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The need intervals, merged (``intervals.need_intervals(merge_phase=False)``), as arrays grouped by
    bucket, each bucket's in event order (what ``Greedy.placed`` starts from): the needs sorted by
    (bucket, event), each [event, its end); a new interval starts where one starts after every earlier one
    of its bucket ended (a running max of the ends, offset per bucket so that it never crosses buckets)."""
    order = lexsort((need_e, need_b), (n + 1, nb))
    b, start = need_b[order], need_e[order]
    big = n + 1
    reach = np.maximum.accumulate(b * big + np.asarray(ends, dtype=np.int64)[start])
    new = np.ones(len(b), dtype=bool)
    new[1:] = (b[1:] != b[:-1]) | (start[1:] > reach[:-1] - b[1:] * big)
    last = np.ones(len(b), dtype=bool)
    last[:-1] = new[1:]
    return b[new], start[new], reach[last] - b[last] * big


def _keep_rows(use_b: np.ndarray, use_s: np.ndarray, num_forward: int, nb: int):
    """keepable: buckets used in forward and again in backward. Per keepable bucket: the start and the row
    of its last forward interval (``fwd_*``) and of its first backward one (``bwd_*``), which is its first
    interval starting at or after ``num_forward`` and not its first interval. (keepable, fwd_at, bwd_at,
    fwd_row, bwd_row)."""
    backward = use_s >= num_forward
    first_bwd = backward.copy()
    first_bwd[1:] &= (use_b[1:] == use_b[:-1]) & ~backward[:-1]
    first_bwd[:1] = False
    r = np.flatnonzero(first_bwd)
    keepable = use_b[r]
    fwd_at = np.zeros(nb, dtype=np.int64)
    bwd_at = np.zeros(nb, dtype=np.int64)
    fwd_row = np.zeros(nb, dtype=np.int64)
    bwd_row = np.zeros(nb, dtype=np.int64)
    fwd_at[keepable], bwd_at[keepable] = use_s[r - 1], use_s[r]
    fwd_row[keepable], bwd_row[keepable] = r - 1, r
    return keepable, fwd_at, bwd_at, fwd_row, bwd_row
