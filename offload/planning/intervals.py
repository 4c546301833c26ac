"""When each bucket must be on the device: its need intervals (from the trace's uses, merged; with the
copy's prefetch moved in), its grad slot's interval and the event its grads go to the host. Pure
functions of the trace and buckets; the numpy versions are tested against ``_reference.py``'s loops."""

from __future__ import annotations

import heapq
import itertools
import operator
from typing import Sequence

import numpy as np

from .buckets import Bucket
from .trace import EventKind, Trace


def need_intervals(trace: Trace, bucket_of: Sequence[int], merge_phase: bool) -> dict[int, list[list[int]]]:
    """Per bucket: sorted, merged [start, end) event intervals during which it must be on the device."""
    raw: dict[int, list[list[int]]] = {}
    for i, uses in enumerate(trace.uses):
        for p in uses:
            raw.setdefault(bucket_of[p], []).append([i, trace.ends[i]])
    f = trace.num_forward
    out = {}
    for b, ivs in raw.items():
        ivs.sort()
        merged = [ivs[0][:]]
        for s, e in ivs[1:]:
            last = merged[-1]
            same_phase = (last[0] < f) == (s < f)
            if s <= last[1] or (merge_phase and same_phase):
                last[1] = max(last[1], e)
            else:
                merged.append([s, e])
        out[b] = merged
    return out


def with_prefetch(needs: dict[int, list[list[int]]], lookahead: bool) -> dict[int, list[list[int]]]:
    """Move each interval's start back to when its copy is issued, merging a bucket's intervals that
    would then overlap (it simply stays)."""
    if not lookahead:
        return needs
    starts = sorted({s for ivs in needs.values() for s, _ in ivs})
    prev = {s: (starts[k - 1] if k else s) for k, s in enumerate(starts)}
    out = {}
    for b, ivs in needs.items():
        moved: list[list[int]] = []
        for s, e in ivs:
            p = prev[s]
            if moved and p <= moved[-1][1]:
                moved[-1][1] = max(moved[-1][1], e)
            else:
                moved.append([p, e])
        out[b] = moved
    return out


def grad_intervals(trace: Trace, buckets: Sequence[Bucket], bucket_of: Sequence[int]) -> dict[int, list[int]]:
    """Per bucket with grads: its grad slot's [first grad, last grad + 1), or to the end of backward,
    ``len(events)``, for a bucket flushed then."""
    return grad_info(trace, buckets, bucket_of)[0]


def grad_issue(trace: Trace, buckets: Sequence[Bucket], bucket_of: Sequence[int]) -> dict[int, int]:
    """Per bucket with grads: the event at which its grads go to the host (its last grad, or the end of
    backward, ``len(events)``, for a bucket flushed then)."""
    return grad_info(trace, buckets, bucket_of)[1]


def grad_info(trace: Trace, buckets: Sequence[Bucket], bucket_of: Sequence[int]):
    """(:func:`grad_intervals`, :func:`grad_issue`), from :func:`grad_arrays`."""
    return grad_dicts(*grad_arrays(trace, buckets, bucket_of))


def grad_dicts(b, start, end, issue):
    """:func:`grad_arrays`' arrays as :func:`grad_info`'s two dicts (slot [start, end], issue) by bucket."""
    b, start, end, issue = b.tolist(), start.tolist(), end.tolist(), issue.tolist()
    return dict(zip(b, map(list, zip(start, end)))), dict(zip(b, issue))


def grad_arrays(trace: Trace, buckets: Sequence[Bucket], bucket_of: Sequence[int]):
    """Per bucket with grads, in the order of their first grads: (bucket, slot start, slot end, issue) as
    int64 arrays (what :func:`grad_info_reference` computes with a loop over the events)."""
    events = trace.events
    n = len(events)
    kinds = np.fromiter(map(operator.attrgetter("kind"), events), dtype=np.int64, count=n)
    at = np.flatnonzero(kinds == EventKind.GRAD)
    keys = np.fromiter(map(operator.attrgetter("key"), map(events.__getitem__, at.tolist())), dtype=np.int64,
                       count=len(at))
    owner = np.asarray(bucket_of, dtype=np.int64).reshape(-1)
    b = owner[keys]
    buckets_with, first = np.unique(b, return_index=True)
    last = len(b) - 1 - np.unique(b[::-1], return_index=True)[1]
    # complete: every touched parameter of the bucket's runs has its grad (a run's parameters are its
    # bucket's, so "has a grad" is "is the key of some grad event")
    params = np.fromiter(itertools.chain.from_iterable(run.params for x in buckets_with.tolist()
                                                       for run in buckets[x].runs), dtype=np.int64)
    missing = np.zeros(len(owner), dtype=bool)
    missing[np.fromiter(trace.touched, dtype=np.int64, count=len(trace.touched))] = True
    missing[keys] = False
    incomplete = np.zeros(len(buckets), dtype=bool)
    incomplete[owner[params[missing[params]]]] = True
    by_first = np.argsort(first, kind="stable")
    buckets_with, first, last = buckets_with[by_first], at[first[by_first]], at[last[by_first]]
    # a bucket whose grads are not all seen is flushed at the end of backward: its slot is kept till then
    issue = np.where(incomplete[buckets_with], n, last)
    return buckets_with, first, np.where(issue < n, issue + 1, n), issue


def grad_slot_reuse(start: np.ndarray, end: np.ndarray, issue: np.ndarray) -> np.ndarray:
    """Per grad slot (:func:`grad_arrays`' order: by start), the slot whose bytes it takes over, or -1 for
    fresh bytes: the most recently issued slot (ties: the later one) among those ended by its start and not
    taken over yet, what a tight packer does with equal slots. The greedy's rule for compute's waits on a
    reused grad slot before any layout ([Note: waits on a reused grad slot] in simulate.py)."""
    start_l, end_l, issue_l = start.tolist(), end.tolist(), issue.tolist()
    by_end = sorted(range(len(end_l)), key=end_l.__getitem__)
    free: list[tuple[int, int]] = []  # max-heap of ended slots not taken over: (-issue, -slot)
    out = [-1] * len(start_l)
    q = 0
    for j, s in enumerate(start_l):
        while q < len(by_end) and end_l[by_end[q]] <= s:
            heapq.heappush(free, (-issue_l[by_end[q]], -by_end[q]))
            q += 1
        if free:
            out[j] = -heapq.heappop(free)[1]
    return np.asarray(out, dtype=np.int64).reshape(len(out))


def latest_ended(start: np.ndarray, end: np.ndarray, copy: np.ndarray) -> np.ndarray:
    """Per grad slot ``j``: the greatest ``copy`` (a place in the device-to-host queue; -1: none) among the
    slots ended by ``start[j]``, or -1 where there is none. The queue is FIFO, so that copy is done no
    earlier than the copy of any slot whose bytes slot ``j`` can take over ([Note: dominating grad-slot
    waits] in schedule.py)."""
    order = np.argsort(end, kind="stable")
    best = np.maximum.accumulate(copy[order]) if len(order) else copy[order]
    ended = np.searchsorted(end[order], start, side="right")
    return np.where(ended > 0, best[np.maximum(ended - 1, 0)] if len(order) else -1, -1)


def double_buffered_ends(start: np.ndarray, end: np.ndarray, n: int) -> np.ndarray:
    """Per grad slot (by start), its end held until the next slot's end (its bucket's grads issued + 1),
    so that consecutive slots never share bytes and a slot's copy to the host has the next bucket's
    backward to finish before its bytes are taken over ([Note: double-buffered grad slots] in schedule.py)."""
    if not len(end):
        return end
    nxt = np.concatenate([end[1:], end[-1:]])
    return np.minimum(np.maximum(end, nxt), n)


def needed_all(trace: Trace, bucket_of: Sequence[int]) -> list[tuple[int, ...]]:
    """Per event: the buckets it needs, in first-use order (``tuple(dict.fromkeys(bucket_of[p] for p in
    uses))``), the common cases (no use, one use) short."""
    out: list[tuple[int, ...]] = []
    for uses in trace.uses:
        if not uses:
            out.append(())
        elif len(uses) == 1:
            out.append((bucket_of[uses[0]],))
        else:
            out.append(tuple(dict.fromkeys(bucket_of[p] for p in uses)))
    return out
