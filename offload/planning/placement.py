"""Where each bucket lives and where its optimizer runs (issue 18), and the step-time bound over every such
choice that fits a budget (pure).

Three placements per bucket (:class:`Placement`): streamed (16-bit weights fetched per use, grads to the
host, CPU AdamW), resident weights with the host optimizer (ZeRO-Offload's rule), or resident with its
optimizer state on the device: fp32 master, m and v in the device arena, updated by a fused AdamW on the
compute stream as soon as the bucket's grads are complete, with no D2H, no CPU work, no H2D and no host
state for it.

[Note: the placement bound] Host memory bandwidth makes the CPU AdamW the wall on realistic cases (28 B per
param per step on the host); a bound that fixes every update on the CPU (``physical_bound``) measures the
scheduler, not the design. :func:`placement_bound` is the least step time over every placement that fits:

    min over sigma of max(compute + device AdamW(sigma), H2D of the rest, D2H of the rest, CPU AdamW of the rest)

where sigma <= capacity is the device memory spent on device-optimizer buckets (their 16-bit weights plus
:func:`state_nbytes`). It is a relaxation, so a true lower bound of any plan: each term is minimised on its
own for the same sigma (a fractional knapsack per term: the device AdamW term takes the buckets that cost
the least device time per byte, the others the buckets that remove the most of their own lane per byte),
buckets may be split, alignment and grad slots are not counted, and each link runs at its peak without
sharing. Every term is convex and piecewise linear in sigma, so the minimum lies on a knot of one term or
where two terms cross: evaluated there exactly, not searched.

[Note: what no placement escapes] Two facts hold for every plan and make the bound honest where the
relaxation alone is too loose (issue 18: it claimed a placement for bert-large at 10 % that no plan has):

* memory: at every event the buckets it needs are on the device and the grad slots open then are live,
  whatever the placement (device-optimizer buckets are resident, so on the device too). The most of that
  over the step, :func:`least_live_bytes` (aligned, as the arena counts), is what any plan's arena holds at
  least; a capacity below it fits no placement, and the bound is infinite (limit ``"memory"``);
* causality (``forward_s`` given): no grad exists before backward, and backward starts only once the
  forward has run and every bucket it used has reached the device. At the step's start the arena holds at
  most ``capacity`` bytes, of which the device optimizer state takes at least phi * sigma (phi: the least
  share of state in any bucket's device cost), so at least (bytes the forward uses - capacity + phi *
  sigma) cross the link during the forward: the grad copies and the CPU AdamW start no earlier than the
  larger of the forward's compute and that transfer at the link's peak. Weights
  spent on device state are weights that must stream; this term is what makes the bound weigh that.
"""

from __future__ import annotations

import enum
from typing import Sequence

import numpy as np

from .buckets import Bucket, locate
from .hw import HardwareModel
from .intervals import grad_intervals, need_intervals
from .simulate import Bound
from .trace import EventKind, Trace


class Placement(enum.Enum):
    """Where one bucket's weights and optimizer live for a whole plan."""

    STREAMED = "streamed"
    """Weights fetched for each use (or kept between uses the plan chose); grads to the host; CPU AdamW."""
    RESIDENT = "resident"
    """Weights on the device for the whole step; grads to the host; CPU AdamW; new weights copied back."""
    DEVICE_OPTIMIZER = "device-optimizer"
    """Weights and fp32 master, m, v on the device; updated there when its grads are complete (no copies,
    no CPU work, no host state)."""


def state_itemsize(itemsize: int) -> int:
    """Device bytes of optimizer state per trainable parameter of a device-optimizer bucket: m and v in fp32
    (8), plus an fp32 master where the device weight is 16-bit (with fp32 compute the weight is the master)."""
    return 8 + (4 if itemsize < 4 else 0)


def state_nbytes(bucket: Bucket, itemsize: int) -> int:
    """Device bytes of a device-optimizer bucket's optimizer state (its weights and grad slot not counted)."""
    return bucket.trainable_numel * state_itemsize(itemsize)


def updated_buckets(trace: Trace, buckets: Sequence[Bucket]) -> list[int]:
    """Buckets holding a parameter that gets a gradient in this trace (the ones with an optimizer step),
    ascending."""
    bucket_of = locate(buckets)[0]
    grad = EventKind.GRAD
    return sorted({bucket_of[ev.key] for ev in trace.events if ev.kind == grad})


def placement_bytes(buckets: Sequence[Bucket], itemsize: int, placement: Sequence[Placement]) -> dict[str, int]:
    """Bytes per tier of a plan's placements: the 16-bit weights of each placement, and the optimizer state
    on the device (unaligned; streamed weights are on the device only while fetched)."""
    out = {p.value: 0 for p in Placement}
    out["device_optimizer_state"] = 0
    for b, where in zip(buckets, placement):
        out[where.value] += b.nbytes(itemsize)
        if where is Placement.DEVICE_OPTIMIZER:
            out["device_optimizer_state"] += state_nbytes(b, itemsize)
    return out


def placement_bound(trace: Trace, buckets: Sequence[Bucket], itemsize: int, capacity: int, compute_s: float,
                    hw: HardwareModel, forward_s: float = 0.0, least_bytes: int | None = None) -> Bound:
    """The least step time over every placement that fits ``capacity`` arena bytes (see [Note: the
    placement bound]). ``parts`` holds each term at the optimum and ``device_bytes`` (sigma there: the
    device bytes the optimum spends on device-optimizer buckets).

    ``forward_s``: the forward's compute seconds, to count that no grad copy and no CPU AdamW can start
    before backward does (every grad is produced in backward): the D2H and CPU AdamW terms start there.
    0 gives the issue's formula, which lets the host lanes overlap the forward too; with it the bound is
    still a lower bound of every schedule the simulator runs, and a tighter one where the CPU is the wall:
    the host lanes start no earlier than the forward's unavoidable transfer (see [Note: what no placement escapes]).

    A ``capacity`` below :func:`least_live_bytes` fits no placement: the bound is ``inf``, limit
    ``"memory"``. ``least_bytes``: that number where the caller has it already (the greedy's arrays give
    it faster: ``device_optimizer.least_live_bytes_of``)."""
    bucket_of = locate(buckets)[0]
    least = least_live_bytes(trace, buckets, itemsize) if least_bytes is None else least_bytes
    if capacity < least:
        return Bound(float("inf"), "memory", {"least_live_bytes": float(least), "capacity": float(capacity),
                                               "device_bytes": 0.0})
    updated = updated_buckets(trace, buckets)
    used = {bucket_of[p] for uses in trace.uses for p in uses}
    others = sum(buckets[b].nbytes(itemsize) for b in used - set(updated))
    b = [buckets[x] for x in updated if buckets[x].trainable_numel > 0]
    cost = np.array([x.nbytes(itemsize) + state_nbytes(x, itemsize) for x in b], dtype=np.float64)
    numel = np.array([x.trainable_numel for x in b], dtype=np.float64)
    h2d = np.array([x.nbytes(itemsize) for x in b], dtype=np.float64) / hw.peak_h2d
    d2h = np.array([x.grad_nbytes(itemsize) for x in b], dtype=np.float64) / hw.peak_d2h
    cpu = numel / hw.adam_params_per_s
    dev = numel / hw.device_adam_rate
    # updated buckets without trainable elements (none in practice) still come back once
    h2d_fixed = sum(buckets[x].nbytes(itemsize) for x in updated if buckets[x].trainable_numel == 0) / hw.peak_h2d
    capacity = max(0, capacity)
    top = min(float(capacity), float(cost.sum()))
    # each term as knots (sigma, value): convex, piecewise linear
    terms = {
        "compute": _cheapest(cost, dev, compute_s, top),
        "h2d": _removable(cost, h2d, h2d_fixed, top),
        "d2h": _removable(cost, d2h, 0.0, top),
        "cpu_adam": _removable(cost, cpu, 0.0, top),
    }
    # the used buckets that are not updated stream what the capacity left over cannot hold
    kinks = [float(capacity - others)]
    # the host lanes start with backward (forward_s given): convex in sigma, one kink
    phi, fwd = 0.0, 0
    if forward_s and len(b):
        weights = np.array([x.nbytes(itemsize) for x in b], dtype=np.float64)
        phi = float(((cost - weights) / np.maximum(cost, 1.0)).min())
        fwd = forward_bytes(trace, buckets, itemsize)
        if phi > 0:
            kinks.append((forward_s * hw.peak_h2d - fwd + capacity) / phi)

    def start(sigma: np.ndarray) -> np.ndarray:
        if not (forward_s and len(b)):
            return np.zeros_like(sigma)
        return np.maximum(forward_s, (fwd - capacity + phi * sigma) / hw.peak_h2d)

    knots = np.unique(np.concatenate([k for k, _ in terms.values()] + [np.array([0.0, top])]
                                     + [np.array([k]) for k in kinks if 0 < k < top]))

    def values(sigma: np.ndarray) -> np.ndarray:
        rows = [np.interp(sigma, k, v) for k, v in terms.values()]
        rows[1] = rows[1] + np.maximum(0.0, others - (capacity - sigma)) / hw.peak_h2d
        rows[2] = rows[2] + start(sigma)
        rows[3] = rows[3] + start(sigma)
        return np.stack(rows)

    # candidates: every knot, and every crossing of two terms inside an interval between knots (each term
    # is linear there, the h2d term included: the kink is a knot)
    lo, hi = knots[:-1], knots[1:]
    a, z = values(lo), values(hi)
    cands = [knots]
    for i in range(len(terms)):
        for j in range(i + 1, len(terms)):
            da, dz = a[i] - a[j], z[i] - z[j]
            cross = (da * dz < 0)
            t = np.where(cross, da / np.where(cross, da - dz, 1.0), 0.0)
            cands.append((lo + t * (hi - lo))[cross])
    sigma = np.concatenate(cands)
    v = values(sigma)
    best = int(np.argmin(v.max(axis=0)))
    parts: dict[str, float] = dict(zip(terms, v[:, best].tolist()))
    limit = max(parts, key=lambda k: parts[k])
    parts["device_bytes"] = float(sigma[best])
    return Bound(parts[limit], limit, parts)


def least_live_bytes(trace: Trace, buckets: Sequence[Bucket], itemsize: int) -> int:
    """The most device bytes, over the step's events, that every plan holds at once in its arena: the
    buckets each event needs and the grad slots open then (aligned sizes; see [Note: what no placement
    escapes]). It is the live bytes of streaming every bucket just in time; that plan's arena
    (:func:`~offload.planning.budget.min_arena_bytes`) is at least this much."""
    from .plan import align  # (plan.py imports this module)

    bucket_of = locate(buckets)[0]
    n = len(trace.events)
    diff = np.zeros(n + 1, dtype=np.int64)
    for b, ivs in need_intervals(trace, bucket_of, merge_phase=False).items():
        size = align(buckets[b].nbytes(itemsize))
        for s, e in ivs:
            diff[s] += size
            diff[e] -= size
    for b, (s, e) in grad_intervals(trace, buckets, bucket_of).items():
        size = align(buckets[b].grad_nbytes(itemsize))
        diff[s] += size
        diff[e] -= size
    return int(np.cumsum(diff[:-1]).max(initial=0))


def forward_bytes(trace: Trace, buckets: Sequence[Bucket], itemsize: int) -> int:
    """Bytes of the buckets the forward uses: each is on the device before the forward ends (see [Note:
    what no placement escapes])."""
    bucket_of = locate(buckets)[0]
    used = {bucket_of[p] for uses in trace.uses[:trace.num_forward] for p in uses}
    return sum(buckets[b].nbytes(itemsize) for b in used)


def _cheapest(cost: np.ndarray, dev: np.ndarray, base: float, top: float) -> tuple[np.ndarray, np.ndarray]:
    """``base`` + the least device AdamW time that spends sigma bytes: buckets by device seconds per byte,
    cheapest first, fractions allowed."""
    order = np.argsort(dev / np.maximum(cost, 1.0), kind="stable")
    return _knots(cost[order], dev[order], base, +1.0, top)


def _removable(cost: np.ndarray, lane: np.ndarray, fixed: float, top: float) -> tuple[np.ndarray, np.ndarray]:
    """A lane's least time once sigma bytes went to device-optimizer buckets: its total minus the most that
    sigma bytes can remove (buckets by lane seconds per byte, largest first, fractions allowed)."""
    order = np.argsort(-lane / np.maximum(cost, 1.0), kind="stable")
    return _knots(cost[order], lane[order], fixed + float(lane.sum()), -1.0, top)


def _knots(cost, amount, base, sign, top) -> tuple[np.ndarray, np.ndarray]:
    x = np.concatenate([[0.0], np.cumsum(cost)])
    y = base + sign * np.concatenate([[0.0], np.cumsum(amount)])
    if top < x[-1]:  # cut at top (np.interp clamps beyond the last knot)
        k = int(np.searchsorted(x, top, side="right"))
        y_top = np.interp(top, x, y)
        x, y = np.concatenate([x[:k], [top]]), np.concatenate([y[:k], [y_top]])
    return x, y
