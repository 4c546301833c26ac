"""Bucketing: pack parameters, in first-use order, into contiguous buckets (pure).

A bucket is the unit that moves between host and device. Inside a bucket, parameters the optimizer
updates come first, grouped by param group, so that the trainable part is one contiguous prefix
(one grad slot, one flat AdamW per group run) and frozen parameters follow it.

[Note: parameter alignment]
Every parameter starts at an element offset that is a multiple of ``PARAM_ALIGN`` bytes in the device
dtype (8 elements in bf16/fp16, 4 in fp32): packed back to back, one odd-sized parameter would misalign
every later one in its bucket, and vectorised kernels and cuBLASLt take slower paths on a weight that is
not 16-byte aligned (issue 21). The host keeps the same element offsets in every region (fp32 master, m,
v and grad; the 16-bit copy and grad staging), so one copy still moves a whole bucket and each region is
aligned at least as well (an fp32 region at twice the bytes). The padding between parameters is part of
the bucket (``numel`` counts it): it is zero everywhere (the grad slot is cleared when taken, so its
padding sends zeros and AdamW keeps zero masters zero), and no parameter view covers it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .hw import HardwareModel

HOST_ALIGN = 64  # bytes: a cache line, and the widest SIMD load the CPU AdamW uses
PARAM_ALIGN = 16  # bytes: where every parameter starts inside a bucket, see [Note: parameter alignment]
# Buckets in flight in the host's grad staging ring ([Note: grad staging ring] at HostLayout): while the CPU
# AdamW reads one bucket's grads, the next one's copy has landed and a third may be landing, so the lane never
# waits for a copy; more would only let backward run further ahead of a CPU lane that is the wall anyway.
GRAD_RING_SLOTS = 3
# The most bytes one grad copy puts in the ring ([Note: chunked grad staging] at HostLayout): larger buckets
# (a vocabulary embedding) go through it in pieces of this size, so the ring no longer scales with the largest
# bucket. 4 MiB: past the size at which a copy reaches ~90 % of the link's bandwidth on the pcie4/pcie5 curves
# (what bucket_bytes="auto" picks, 2.5 MiB on pcie4), so the pieces cost the copy engine next to nothing. That is
# the floor: a larger model's pieces are larger ([Note: ring pieces scale with the model], grad_ring_chunk_bytes).
GRAD_RING_CHUNK_BYTES = 4 << 20
GRAD_RING_CHUNK_MAX_BYTES = 32 << 20  # the most: a piece of 16 M bf16 grads, ~4 ms of CPU AdamW at 4e9 params/s
GRAD_RING_CHUNK_SHARE = 128  # between the two: 1/128 of the model's trainable grads in the device dtype


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
    offsets: tuple[int, ...]  # element offset of each parameter inside the bucket (aligned: PARAM_ALIGN)
    numel: int  # up to the end of the last parameter, the padding between parameters included
    trainable_numel: int  # length of the trainable prefix (up to the end of its last parameter)
    runs: tuple[Run, ...]
    # zeros after the trainable prefix in the device grad slot (issue 20: a slot reduce-scattered on the device
    # is padded to its shards' length, [Note: grads reduced on the device] in runtime/distributed.py); else 0
    grad_padding: int = 0

    def nbytes(self, itemsize: int) -> int:
        return self.numel * itemsize

    @property
    def grad_numel(self) -> int:
        """Elements of the bucket's device grad slot: the trainable prefix and its padding."""
        return self.trainable_numel + self.grad_padding

    def grad_nbytes(self, itemsize: int) -> int:
        return self.grad_numel * itemsize


def make_buckets(specs: Sequence[ParamSpec], order: Sequence[int], bucket_bytes: int,
                 itemsize: int) -> tuple[Bucket, ...]:
    """Greedy packing of parameters in ``order`` into buckets of at most ``bucket_bytes``.

    A parameter never straddles two buckets; one larger than ``bucket_bytes`` gets a bucket of its own.
    Each parameter starts ``PARAM_ALIGN``-aligned (see [Note: parameter alignment]); the size a bucket is
    held to counts every member padded to that alignment, so whatever order the members take inside the
    bucket, no bucket of several parameters is larger than ``bucket_bytes``. Sizes that are multiples of
    the alignment pack exactly as without it.
    """
    if sorted(order) != list(range(len(specs))):
        raise ValueError("order must be a permutation of all parameter ids")
    if bucket_bytes <= 0 or itemsize <= 0:
        raise ValueError("bucket_bytes and itemsize must be positive")
    align = param_align(itemsize)
    groups: list[list[int]] = []
    padded = 0  # elements of the current bucket's members, each padded to the alignment
    for p in order:
        numel = _align(specs[p].numel, align)
        if groups and (padded + numel) * itemsize <= bucket_bytes:
            groups[-1].append(p)
            padded += numel
        else:
            groups.append([p])
            padded = numel
    return tuple(_bucket(i, members, specs, align) for i, members in enumerate(groups))


AUTO_LINK_FRACTION = 0.9
"""``bucket_bytes="auto"``: a bucket is the smallest copy that reaches this share of the link's peak bandwidth..."""
AUTO_MAX_SHARE = 8
"""...and at most 1/8 of the model's weights, so that the least budget (a streamed bucket or two, its grad
slot, activations) is not a bucket's size several times over (issue 18: with a fixed 32 MiB, a model under
~64 MiB was one or two buckets, which cannot stream)."""


def auto_bucket_bytes(specs: Sequence[ParamSpec], itemsize: int, hw: HardwareModel) -> int:
    """The bucket size ``bucket_bytes="auto"`` picks: the smallest copy reaching :data:`AUTO_LINK_FRACTION`
    of ``hw``'s host-to-device peak (:meth:`HardwareModel.bytes_reaching`), capped at 1/:data:`AUTO_MAX_SHARE`
    of the weights in the device dtype (a parameter larger than that still gets a bucket of its own)."""
    if itemsize <= 0:
        raise ValueError("itemsize must be positive")
    align = param_align(itemsize)
    weights = sum(_align(s.numel, align) for s in specs) * itemsize
    return max(PARAM_ALIGN, min(hw.bytes_reaching(AUTO_LINK_FRACTION), weights // AUTO_MAX_SHARE))


def resolve_bucket_bytes(bucket_bytes: int | str, specs: Sequence[ParamSpec], itemsize: int,
                         hw: HardwareModel) -> int:
    """``bucket_bytes`` as given (bytes), or :func:`auto_bucket_bytes` for ``"auto"``."""
    if bucket_bytes == "auto":
        return auto_bucket_bytes(specs, itemsize, hw)
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int):
        raise TypeError(f'bucket_bytes must be an int number of bytes or "auto"; got {bucket_bytes!r}')
    return bucket_bytes


def param_align(itemsize: int) -> int:
    """Elements between parameter starts in a bucket of ``itemsize``-byte elements: ``PARAM_ALIGN`` bytes."""
    return max(1, PARAM_ALIGN // itemsize)


def _bucket(index: int, members: list[int], specs: Sequence[ParamSpec], align: int) -> Bucket:
    # Stable sort: trainable first, by group; frozen last. First-use order survives inside each class.
    ordered = sorted(members, key=lambda p: (specs[p].group is None, specs[p].group or 0))
    offsets: list[int] = []
    runs: list[tuple[int, int, list[int]]] = []  # (group, start, params) of each run, in order
    run_end: list[int] = []  # each run's end
    off = 0
    for p in ordered:
        off = _align(off, align)
        offsets.append(off)
        g = specs[p].group
        if g is not None:
            if runs and runs[-1][0] == g:
                runs[-1][2].append(p)
                run_end[-1] = off + specs[p].numel
            else:
                runs.append((g, off, [p]))
                run_end.append(off + specs[p].numel)
        off += specs[p].numel
    trainable = run_end[-1] if runs else 0
    return Bucket(index, tuple(ordered), tuple(offsets), off, trainable,
                  tuple(Run(g, s, e, tuple(ps)) for (g, s, ps), e in zip(runs, run_end)))


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
    its trainable prefix the grad the update reads (``grad``), the accumulation staging (``staging``,
    empty without accumulation), Adam m and Adam v.

    With a 16-bit copy, the fp32 master covers the trainable prefix only: a frozen parameter is never
    updated, so its 16-bit copy (what the device computes with) is all the host keeps of it, 2 bytes a
    parameter. In fp32 the master is the copy the device gets, 4 bytes a frozen parameter.

    [Note: host grads] The device-to-host copy of a bucket's grads never converts: it moves the grad
    slot's bytes as they are (2 per element in bf16/fp16) into pinned memory of the slot's dtype (a copy
    into another dtype converts on the device first: a temporary twice the slot, and twice the bytes over
    PCIe; see [Note: stream-ordered memory] in ``backend/cuda.py``). So ``grad`` is in the device dtype
    (``grad_itemsize``), and the fused AdamW reads 16-bit grads as they are. Gradient accumulation needs an
    fp32 sum (16-bit sums lose the small grads): with ``accumulate`` the ``grad`` is fp32 and every copy
    lands in ``staging`` (device dtype) instead, except the first of a step in fp32, which lands in the sum
    itself; the CPU lane widens or adds staging into the sum. Trainable bytes per parameter: 16 (fp32 or
    16-bit, no accumulation: 4 master + 4 m + 4 v + grad 4, or 2 + the 2-byte copy) and 20 with
    accumulation (a 4-byte sum + the staging in the device dtype).

    [Note: grad staging ring] (issue 18) With ``ring`` the copies land in a ring instead: one region shared
    by every bucket, as large as the ``ring`` largest trainable prefixes in the device dtype, filled in turn
    (a bucket that does not fit before the end starts again at the beginning); a copy may overwrite bytes only
    after the CPU lane has read what they held (the AdamW of the bucket that had them, or its widening or adding
    into the fp32 sum). Grads are consumed as they arrive, so only the buckets in flight need room: no
    per-bucket grad at all with the optimizer overlapped (14 bytes per trainable parameter in 16 bits: 4 master
    + 4 m + 4 v + the 2-byte copy; 12 in fp32, where the master is the copy), and the fp32 sum (``grad``, 4)
    only with accumulation, which must keep every bucket's grads until ``step()`` (18 in 16 bits, 16 in fp32,
    whose step's first copy lands in the sum itself). Sized by the largest prefixes, not ``ring`` times the
    largest, so that one big bucket (a vocabulary embedding) costs its size once. ``ring=0`` keeps the
    per-bucket layout above (data parallel ranks: their reduce-scatter reads a padded per-bucket grad,
    offload/host/shard.py).

    [Note: chunked grad staging] (issue 18) Sized by whole prefixes, one big bucket still costs its size (GPT-2
    124M's tied 38.6M-parameter embedding: 0.7 bytes a parameter in bf16). With ``chunk_bytes`` a bucket's
    grads cross in pieces of at most that size, each its own copy into the ring, read by its own piece of the
    bucket's update on the CPU lane (AdamW is elementwise: the same numbers; every piece updates with the step
    count the bucket had, which goes up with its last piece) or its own widening or adding into the fp32 sum:
    the ring holds ``ring`` pieces, not ``ring`` buckets, whatever the largest bucket."""

    master: tuple[int, ...]
    lowp: tuple[int, ...]
    grad: tuple[int, ...]
    staging: tuple[int, ...]
    exp_avg: tuple[int, ...]
    exp_avg_sq: tuple[int, ...]
    total_bytes: int
    grad_itemsize: int = 4  # bytes per element of ``grad``: 4 (fp32) or the 16-bit dtype's
    staging_itemsize: int = 0  # bytes per element of ``staging``: the device dtype's, 0 without accumulation
    ring: int = 0  # offset of the grad staging ring ([Note: grad staging ring])
    ring_bytes: int = 0  # its size: the ``ring`` largest trainable prefixes in the device dtype; 0 without


def host_layout(buckets: Sequence[Bucket], lowp_itemsize: int = 0, accumulate: bool = False,
                ring: int = 0, away: frozenset[int] = frozenset(), chunk_bytes: int = 0) -> HostLayout:
    """``lowp_itemsize``: bytes per element of the low-precision copy (2 for bf16/fp16), 0 for none.
    ``accumulate``: room for gradient accumulation (an fp32 sum and a staging copy, see [Note: host grads]).
    ``ring``: grads land in a ring with room for that many of the largest buckets instead of per-bucket
    buffers ([Note: grad staging ring]; 0: per-bucket, as data parallel ranks keep them).
    ``away``: buckets whose optimizer state lives on the device (issue 18, [Note: device-homed buckets] in
    ``host/state.py``): no master, 16-bit copy, m or v here; only their grad sum with ``accumulate``. The ring
    is still sized over every bucket (a departure from the plan sends their grads through it).
    ``chunk_bytes``: the ring holds grads in pieces of at most that many bytes ([Note: chunked grad staging]);
    0: whole buckets."""
    if ring < 0:
        raise ValueError(f"ring must be >= 0, got {ring}")
    device_itemsize = lowp_itemsize or 4
    if chunk_bytes < 0:
        raise ValueError(f"chunk_bytes must be >= 0, got {chunk_bytes}")
    piece = chunk_numel(chunk_bytes, device_itemsize)
    largest = sorted((min(b.trainable_numel, piece) if piece else b.trainable_numel
                      for b in buckets if b.trainable_numel), reverse=True)[:ring]
    ring_bytes = sum(_align(n * device_itemsize, HOST_ALIGN) for n in largest)
    grad_itemsize = 4 if accumulate else (0 if ring else device_itemsize)
    staging_itemsize = device_itemsize if accumulate and not ring else 0
    fields: dict[str, list[int]] = {k: [] for k in ("master", "lowp", "grad", "staging", "exp_avg", "exp_avg_sq")}
    off = 0

    def take(nbytes: int) -> int:
        nonlocal off
        start = off
        off = _align(off + nbytes, HOST_ALIGN)
        return start

    for b in buckets:
        home = b.index not in away
        fields["master"].append(take((b.trainable_numel if lowp_itemsize else b.numel) * 4 * home))
        fields["lowp"].append(take(b.numel * lowp_itemsize * home))
        fields["grad"].append(take(b.trainable_numel * grad_itemsize))
        fields["staging"].append(take(b.trainable_numel * staging_itemsize))
        for name in ("exp_avg", "exp_avg_sq"):
            fields[name].append(take(b.trainable_numel * 4 * home))
    ring_offset = take(ring_bytes)
    return HostLayout(**{k: tuple(v) for k, v in fields.items()}, total_bytes=off, grad_itemsize=grad_itemsize,
                      staging_itemsize=staging_itemsize, ring=ring_offset, ring_bytes=ring_bytes)


def grad_ring_chunk_bytes(buckets: Sequence[Bucket], itemsize: int, floor: int = GRAD_RING_CHUNK_BYTES) -> int:
    """The most bytes one grad copy puts in the ring for these buckets in the device dtype of ``itemsize`` bytes:
    1/``GRAD_RING_CHUNK_SHARE`` of their trainable grads, at least ``floor`` (0: no cap at all) and at most
    ``GRAD_RING_CHUNK_MAX_BYTES``.

    [Note: ring pieces scale with the model] Each ring piece is one item of the CPU lane: its grad copy's wait,
    then the update (or the widening into the fp32 sum) of those elements. Read from the first H200 traces
    (benchmarks/results/2026-11-27-h200/analysis.md, run 3): an item costs a fixed 128-205 us besides its AdamW
    (the lane's hand-off, two host waits, the update's Python, an OpenMP region), and with 4 MiB pieces gpt3-2.7b's
    step had 1474 of them (0.25 s of a 1.26 s step; gpt2-xl 904, 0.13 s of 0.65 s), and three 4 MiB pieces held
    ~1.5 ms of AdamW, less than the autograd thread's host work between buckets, so the lane ran dry (0.16 s).
    Pieces of 1/128 of the grads keep the ring (``GRAD_RING_SLOTS`` pieces) under 2.5 % of the 16-bit grads
    (0.05 B a parameter in bf16), so small models keep their 4 MiB and the host bytes per parameter of issue 18;
    from ~1B parameters on (2 GiB of bf16 grads) pieces are whole buckets up to 32 MiB, where the fixed cost is a
    few percent of a piece's AdamW. Not yet measured on a GPU."""
    if not floor:
        return 0
    grad_bytes = sum(b.trainable_numel for b in buckets) * itemsize
    return max(floor, min(GRAD_RING_CHUNK_MAX_BYTES, grad_bytes // GRAD_RING_CHUNK_SHARE))


def chunk_numel(chunk_bytes: int, itemsize: int) -> int:
    """Elements of one ring piece of at most ``chunk_bytes`` (a multiple of ``HOST_ALIGN`` bytes; 0: no cap)."""
    if not chunk_bytes:
        return 0
    return max(HOST_ALIGN, chunk_bytes // HOST_ALIGN * HOST_ALIGN) // itemsize


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a
