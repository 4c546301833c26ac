"""The AdamW step counts of a host state's parameters, as ``optimizer.state[p]["step"]`` shows them."""

from __future__ import annotations

from itertools import chain
from typing import Sequence

import torch


def step_tensors(n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``n`` step counts as ``optimizer.state[p]["step"]`` shows them: 0-dim fp32 tensors, as torch.optim's.

    [Note: step tensors]
    They are views of one vector, so that counting a bucket's step is one op on the CPU lane (:func:`count_run`),
    not one ``fill_`` per parameter (~5 us each: about a quarter of that lane's busy time on a model of small
    tensors, sampled with py-spy on the 200-module MLP of ``benchmarks/overhead.py``). Each stays a 0-dim
    float32 tensor that reads, prints, compares and saves like one (``torch.save`` of a state dict stores the
    vector once); ``HostState.steps`` holds the same counts as Python ints, which the runtime reads."""
    values = torch.zeros(n, dtype=torch.float32)
    return values, [values[i] for i in range(n)]


def count_run(values: torch.Tensor, cache: dict[tuple[int, ...], torch.Tensor], params: tuple[int, ...],
              count: int) -> None:
    """The step counts of ``params`` (two or more, a bucket run's) in ``values`` all become ``count``, in one op.
    ``cache`` keeps, per run, the slice of ``values`` its counts are where its parameters are consecutive (the
    common case: a run is a bucket's parameters of one group, numbered in order), else their indices: a slice's
    ``fill_`` costs about half of an ``index_fill_`` with the same indices (issue 17, the hot path)."""
    at = cache.get(params)
    if at is None:
        lo, hi = params[0], params[-1] + 1
        consecutive = params == tuple(range(lo, hi))
        at = cache[params] = values[lo:hi] if consecutive else torch.tensor(params, dtype=torch.int64)
    if at.dtype is torch.int64:
        values.index_fill_(0, at, float(count))
    else:
        at.fill_(float(count))


def count_all(steps: list[int], values: torch.Tensor, cache: dict[tuple[int, ...], torch.Tensor],
              runs: Sequence[tuple[int, ...]]) -> bool:
    """One more step for every parameter of ``runs`` (the runs of several buckets updated one after the other:
    [Note: sent as one batch] in runtime/bucket_send.py) in ``steps`` and, with :func:`count_run`, in one op on
    ``values``, where they all have one count now (the common case: every parameter has had every step); False,
    with nothing changed, where they do not (the caller counts run by run then)."""
    flat = tuple(sorted(chain.from_iterable(runs)))  # sorted: a model's parameters are its count vector's slice
    counts = set(map(steps.__getitem__, flat))
    if len(counts) != 1 or len(flat) < 2 or len(set(flat)) != len(flat):
        return False
    count = counts.pop() + 1
    for p in flat:
        steps[p] = count
    count_run(values, cache, flat, count)
    return True
