"""Bucketing: pack parameters, in first-use order, into contiguous buckets (pure).

A bucket is the unit that moves between host and device. Inside a bucket, parameters the optimizer
updates come first, grouped by param group, so that the trainable part is one contiguous prefix
(one grad slot, one flat AdamW per group run) and frozen parameters follow it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

HOST_ALIGN = 64  # bytes: a cache line, and the widest SIMD load the CPU AdamW uses


@dataclass(frozen=True)
class ParamSpec:
    """What bucketing needs to know about one parameter."""

    numel: int
    group: int | None  # optimizer param group index; None: frozen (no grad, no Adam state)


@dataclass(frozen=True)
class Run:
    """Consecutive trainable parameters of one bucket that share a param group."""

    group: int
    start: int  # element offset in the bucket
    end: int
    params: tuple[int, ...]


@dataclass(frozen=True)
class Bucket:
    index: int
    params: tuple[int, ...]  # parameter ids, in bucket order (trainable first)
    offsets: tuple[int, ...]  # element offset of each parameter inside the bucket
    numel: int
    trainable_numel: int  # length of the trainable prefix
    runs: tuple[Run, ...]

    def nbytes(self, itemsize: int) -> int:
        return self.numel * itemsize

    def grad_nbytes(self, itemsize: int) -> int:
        return self.trainable_numel * itemsize


def make_buckets(specs: Sequence[ParamSpec], order: Sequence[int], bucket_bytes: int,
                 itemsize: int) -> tuple[Bucket, ...]:
    """Greedy packing of parameters in ``order`` into buckets of at most ``bucket_bytes``.

    A parameter never straddles two buckets; one larger than ``bucket_bytes`` gets a bucket of its own.
    """
    if sorted(order) != list(range(len(specs))):
        raise ValueError("order must be a permutation of all parameter ids")
    if bucket_bytes <= 0 or itemsize <= 0:
        raise ValueError("bucket_bytes and itemsize must be positive")
    groups: list[list[int]] = []
    size = 0
    for p in order:
        nbytes = specs[p].numel * itemsize
        if groups and size + nbytes <= bucket_bytes:
            groups[-1].append(p)
            size += nbytes
        else:
            groups.append([p])
            size = nbytes
    return tuple(_bucket(i, members, specs) for i, members in enumerate(groups))


def _bucket(index: int, members: list[int], specs: Sequence[ParamSpec]) -> Bucket:
    # Stable sort: trainable first, by group; frozen last. First-use order survives inside each class.
    ordered = sorted(members, key=lambda p: (specs[p].group is None, specs[p].group or 0))
    offsets, runs, off = [], [], 0
    for p in ordered:
        offsets.append(off)
        g = specs[p].group
        if g is not None:
            if runs and runs[-1][0] == g:
                runs[-1][2] = off + specs[p].numel
                runs[-1][3].append(p)
            else:
                runs.append([g, off, off + specs[p].numel, [p]])
        off += specs[p].numel
    trainable = runs[-1][2] if runs else 0
    return Bucket(index, tuple(ordered), tuple(offsets), off, trainable,
                  tuple(Run(g, s, e, tuple(ps)) for g, s, e, ps in runs))


def locate(buckets: Sequence[Bucket]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per parameter id: (its bucket index, its element offset inside that bucket)."""
    n = sum(len(b.params) for b in buckets)
    bucket_of, offset = [0] * n, [0] * n
    for b in buckets:
        for p, off in zip(b.params, b.offsets):
            bucket_of[p], offset[p] = b.index, off
    return tuple(bucket_of), tuple(offset)


@dataclass(frozen=True)
class HostLayout:
    """Byte offsets in the host arena: per bucket an fp32 master and, when the device computes in a
    16-bit dtype, the low-precision copy the host-to-device copy sends (``lowp``, empty otherwise); for
    its trainable prefix an fp32 grad (the accumulator), Adam m and Adam v.

    With a 16-bit copy, the fp32 master covers the trainable prefix only: a frozen parameter is never
    updated, so its 16-bit copy (what the device computes with) is all the host keeps of it, 2 bytes a
    parameter. In fp32 the master is the copy the device gets, 4 bytes a frozen parameter."""

    master: tuple[int, ...]
    lowp: tuple[int, ...]
    grad: tuple[int, ...]
    exp_avg: tuple[int, ...]
    exp_avg_sq: tuple[int, ...]
    total_bytes: int


def host_layout(buckets: Sequence[Bucket], lowp_itemsize: int = 0) -> HostLayout:
    """``lowp_itemsize``: bytes per element of the low-precision copy (2 for bf16/fp16), 0 for none."""
    fields: dict[str, list[int]] = {"master": [], "lowp": [], "grad": [], "exp_avg": [], "exp_avg_sq": []}
    off = 0

    def take(nbytes: int) -> int:
        nonlocal off
        start = off
        off = _align(off + nbytes, HOST_ALIGN)
        return start

    for b in buckets:
        fields["master"].append(take((b.trainable_numel if lowp_itemsize else b.numel) * 4))
        fields["lowp"].append(take(b.numel * lowp_itemsize))
        for name in ("grad", "exp_avg", "exp_avg_sq"):
            fields[name].append(take(b.trainable_numel * 4))
    return HostLayout(**{k: tuple(v) for k, v in fields.items()}, total_bytes=off)


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a
