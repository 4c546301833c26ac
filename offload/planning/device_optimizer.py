"""Which buckets keep their optimizer on the device (issue 18): an outer search around the greedy
scheduler (pure).

[Note: choosing device-optimizer buckets] A device-optimizer bucket (:class:`~offload.planning.placement.
Placement`) is resident with its fp32 master, m and v in the arena and is updated on the compute lane when
its grads are complete: it leaves the copy lanes and the CPU entirely. Its bytes (16-bit weights + state,
16 B per parameter in bf16) then cannot serve residency. Where the CPU AdamW is the wall, those bytes remove
the most step time; where PCIe is, residency does. The search weighs both by simulating:

* the candidates are prefixes of the updated buckets ordered by when their grads complete, latest first:
  the first layers, whose CPU update comes last, after backward has ended and nothing is left to hide it
  behind (the step's tail), and whose weights are needed first in the next forward (a stall nothing
  overlaps). Every bucket of the prefix costs the same bytes per parameter, so the order only decides
  which work leaves the critical path first;
* for each prefix length ``k`` the existing greedy runs on what is left (:func:`restrict`: the prefix's
  buckets are taken out of the need intervals, waits and grad copies, their bytes are a constant floor of
  the live-bytes profile, their device AdamW is added to the compute of the event where their grads
  complete), and the fastest of its points is ``k``'s step time;
* ``k`` is searched on a coarse grid of the lengths that fit (with the length the placement bound's
  optimum spends, :func:`~offload.planning.placement.placement_bound`), then refined around the best by
  bisection of its bracket: some twenty greedy runs at most (a few hundredths of a second each on the
  benchmark's 300-bucket traces; the step is not convex in ``k``: a denser search found up to 1 % more); on a
  large trace (more than :data:`QUICK_ABOVE` need intervals) a coarser search, each length judged by the one
  copy mode that won without device state (a third of a full run), and the chosen ``k`` then runs every
  mode. ``k = 0`` (today's plan) is always a candidate
  and wins ties, so the result is never slower than the plan without device optimizer state;
* it is skipped outright where the plan without device state is already within 1 % of the placement bound
  (its causal form, ``forward_s``: nothing left to win).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from ..errors import InvariantError
from .buckets import Bucket
from .greedy import MODES, Greedy, Point
from .greedy_inputs import D2HProgram, GreedyInputs, grad_waits
from .placement import placement_bound, state_nbytes
from .plan import align
from .simulate import seconds_each
from .trace import Trace

SKIP_WITHIN = 0.01  # skip the search where the plan without device state is this close to the placement bound
GRID = 8  # coarse grid points over the prefix lengths that fit
REFINE = 5  # bisection steps around the best grid point
QUICK_GRID, QUICK_REFINE = 4, 3  # the same on a large trace (planning speed)
QUICK_ABOVE = 4096  # need intervals above which a length is judged by one copy mode (planning speed)


def choose_device_optimizer(g: Greedy, points: Sequence[Point], trace: Trace, buckets: Sequence[Bucket],
                            itemsize: int, capacity: int, compute: Sequence[float], deferred: bool = False
                            ) -> tuple[Greedy, list[Point]] | None:
    """The device-optimizer buckets that make the greedy plan fastest (see [Note: choosing device-optimizer
    buckets]), as the restricted greedy and its points; None where none beats ``points`` (the greedy's
    without device state). ``deferred``: updates run in ``step()`` (see :func:`restrict`)."""
    base = min(p.step_s for p in points)
    x = g.inputs
    bound = placement_bound(trace, buckets, itemsize, capacity, sum(compute), x.hw,  # (the tighter of the two)
                            forward_s=sum(compute[:trace.num_forward]), least_bytes=least_live_bytes_of(x))
    if base <= bound.seconds * (1 + SKIP_WITHIN):
        return None
    order = device_order(x, buckets)
    cost = [align(buckets[b].nbytes(itemsize)) + align(state_nbytes(buckets[b], itemsize)) for b in order]
    # on a large trace each length is judged by the copy mode that won without device state (one sequence
    # instead of three; all three where none of its points fits), on a coarser search; the chosen length then
    # runs every mode, so its plan is at least as fast as judged
    quick = len(x.use_b) > QUICK_ABOVE
    kmax, grid = prefix_lengths(order, cost, capacity, bound.parts["device_bytes"], QUICK_GRID if quick else GRID)
    if not kmax:
        return None
    modes = (min(points, key=lambda p: (p.step_s, MODES.index(p.mode))).mode,) if quick else MODES

    runs: dict[int, tuple[Greedy, list[Point]]] = {}  # every mode's points (kept where not quick)

    def evaluate(k: int) -> float:
        g_k = Greedy(restrict(x, order[:k], buckets, itemsize, deferred))
        got = g_k.candidates(capacity, modes=modes)
        if not quick:
            runs[k] = (g_k, got)
        elif not got:  # none of that mode's points fits: every mode
            got = g_k.candidates(capacity)
        return min((p.step_s for p in got), default=float("inf"))

    k = search(evaluate, kmax, grid, base, QUICK_REFINE if quick else REFINE)
    if not k:
        return None
    if k not in runs:
        g_k = Greedy(restrict(x, order[:k], buckets, itemsize, deferred))
        runs[k] = (g_k, g_k.candidates(capacity))
    return runs[k]


def restrict(x: GreedyInputs, device: Sequence[int], buckets: Sequence[Bucket], itemsize: int,
             deferred: bool = False) -> GreedyInputs:
    """The greedy's inputs with the buckets ``device`` placed as device-optimizer buckets (see [Note:
    choosing device-optimizer buckets]): no need intervals, waits or grad copies for them; their weights and
    optimizer state live for the whole step (a floor under the live-bytes profile); their device AdamW in
    the compute of the event where their grads complete (``d2h_program``'s ``device_adam_numel`` for the
    Program; the lanes' ``compute`` with the same seconds added, so that both simulate the same step).

    ``deferred`` (updates in ``step()``: [Note: the deferred round trip] in simulate.py): their grads still go
    to the host (their copies stay, with no CPU AdamW), come back as fp32 sums in ``step()``, and their
    device AdamW runs after backward."""
    if not len(device):
        return x
    n, nb = x.n, x.nb
    dev = np.zeros(nb, dtype=bool)
    dev[np.asarray(device, dtype=np.int64)] = True
    if not x.updated[dev].all():
        raise InvariantError("only buckets with grads can keep their optimizer on the device")
    # need intervals and keep rows: a removed row shifts every later row index down
    keep_row = ~dev[x.use_b]
    shift = np.concatenate([[0], np.cumsum(~keep_row)])
    keepable = x.keepable[~dev[x.keepable]]
    fwd_row, bwd_row = np.zeros(nb, dtype=np.int64), np.zeros(nb, dtype=np.int64)
    fwd_row[keepable] = x.fwd_row[keepable] - shift[x.fwd_row[keepable]]
    bwd_row[keepable] = x.bwd_row[keepable] - shift[x.bwd_row[keepable]]
    fwd_at, bwd_at = np.where(dev, 0, x.fwd_at), np.where(dev, 0, x.bwd_at)
    use_b = x.use_b[keep_row]
    keep_need = ~dev[x.need_b]
    need_b, need_e = x.need_b[keep_need], x.need_e[keep_need]
    need_ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(need_e, minlength=n), out=need_ptr[1:])
    # the floor: weights and state of every device bucket, the whole step
    floor = sum(align(buckets[b].nbytes(itemsize)) + align(state_nbytes(buckets[b], itemsize)) for b in device)
    grad_profile = x.grad_profile.copy()
    grad_profile[0] += floor
    grad_profile[n] -= floor
    # grad copies and CPU AdamW: only the host-optimizer buckets'
    d2h_bucket = np.asarray(x.d2h_program["d2h_bucket"], dtype=np.int64)
    host = ~dev[d2h_bucket] | deferred  # deferred: every grad copy stays (summed on the host)
    def kept(v: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(np.asarray(v, dtype=np.int64)[host].tolist())
    # the device AdamW where its grads complete (x.grad_issue: its last grad, or n for a flushed bucket), or
    # after backward (deferred)
    device_numel = [0] * (n + 1)
    for b in device:
        device_numel[n if deferred else x.grad_issue[b]] += buckets[b].trainable_numel
    p = x.d2h_program
    cpu_numel = kept(p["adam_numel"])
    adam_s = x.adam_s[host]
    if deferred:  # the device buckets' copies feed no CPU AdamW
        on_host = ~dev[d2h_bucket[host]]
        cpu_numel = tuple(np.where(on_host, np.asarray(cpu_numel, dtype=np.int64), 0).tolist())
        adam_s = np.where(on_host, adam_s, 0.0)
    grad_wait_ptr, grad_wait_copy = grad_waits(x.slot_wait_event, x.slot_wait_bucket, kept(p["d2h_bucket"]), n)
    d2h_program = D2HProgram(d2h_event=kept(p["d2h_event"]), d2h_bucket=kept(p["d2h_bucket"]),
                             d2h_bytes=kept(p["d2h_bytes"]), adam_numel=cpu_numel,
                             device_adam_numel=tuple(device_numel))
    ordered = sorted(int(b) for b in device)
    back = tuple(4 * buckets[b].trainable_numel for b in ordered) if deferred else ()
    hw = x.hw
    compute = x.compute.copy()
    total = 0.0
    for i in sorted({x.grad_issue[b] for b in device} - {n}):
        s = hw.device_adam_seconds(device_numel[i])  # the same operations as simulate.with_device_adam
        compute[i] = float(compute[i]) + s
        total += s
    tail = hw.device_adam_seconds(device_numel[n]) if device_numel[n] else 0.0
    return dataclasses.replace(
        x, use_b=use_b, use_s=x.use_s[keep_row], use_e=x.use_e[keep_row], fwd_row=fwd_row, bwd_row=bwd_row,
        fwd_at=fwd_at, bwd_at=bwd_at, keepable=keepable, tau=np.add.accumulate(np.concatenate([np.zeros(1), compute])),
        grad_profile=grad_profile, need_b=need_b, need_e=need_e, compute=compute,
        d2h_event=x.d2h_event[host], d2h_solo=x.d2h_solo[host], adam_s=adam_s,
        grad_wait_ptr=grad_wait_ptr, grad_wait_copy=grad_wait_copy,
        n_used=len(np.unique(use_b)), need_ptr=need_ptr, need_key=need_b * (n + 1) + need_e,
        d2h_program=d2h_program, d2h_total=sum(d2h_program["d2h_bytes"]),
        device=tuple(ordered), device_state_bytes=tuple(state_nbytes(buckets[b], itemsize) for b in ordered),
        device_tail_s=tail, device_adam_s=total + tail, device_return_bytes=back,
        device_return_s=sum(seconds_each(hw.h2d_seconds, back)))


def least_live_bytes_of(x: GreedyInputs) -> int:
    """:func:`~offload.planning.placement.least_live_bytes` from the greedy's arrays (the inputs without
    device buckets): the merged need intervals' aligned bytes and the grad slots', at their most."""
    diff = x.grad_profile.copy()
    size = x.size[x.use_b]
    np.add.at(diff, x.use_s, size)
    np.add.at(diff, x.use_e, -size)
    return int(np.cumsum(diff[:-1]).max(initial=0))


def device_order(x: GreedyInputs, buckets: Sequence[Bucket]) -> list[int]:
    """Updated buckets with trainable elements, latest grads first (ties: the higher bucket index, i.e. the
    later in first-use order, first)."""
    cands = [b for b in x.grad_issue if buckets[b].trainable_numel > 0]
    return sorted(cands, key=lambda b: (-x.grad_issue[b], -b))


def prefix_lengths(order: Sequence[int], cost: Sequence[int], capacity: int, hint_bytes: float,
                   points: int = GRID) -> tuple[int, list[int]]:
    """The longest prefix whose bytes fit ``capacity``, and the coarse grid of lengths to simulate first
    (0 excluded: the caller has it), the length closest to ``hint_bytes`` among them."""
    spent = np.cumsum(np.asarray(cost, dtype=np.int64)) if len(cost) else np.zeros(0, dtype=np.int64)
    kmax = int(np.searchsorted(spent, capacity, side="right"))
    if kmax == 0:
        return 0, []
    grid = {max(1, round(kmax * j / points)) for j in range(1, points + 1)}
    hint = int(np.searchsorted(spent, hint_bytes, side="right"))
    if 0 < hint <= kmax:
        grid.add(hint)
    return kmax, sorted(grid)


def search(evaluate: Callable[[int], float], kmax: int, grid: Sequence[int], base: float,
           refine: int = REFINE) -> int:
    """The prefix length with the least ``evaluate(k)`` (step seconds; ``base`` is k = 0's): the coarse
    ``grid``, then ``refine`` rounds of bisecting both sides of the best point's bracket. Ties go to the shorter prefix,
    and k = 0 wins unless strictly faster by more than 1e-9 relative."""
    seen = {0: base}
    for k in grid:
        seen[k] = evaluate(k)
    for _ in range(refine):
        ks = sorted(seen)
        best = min(ks, key=lambda k: (seen[k], k))
        i = ks.index(best)
        lo, hi = ks[max(0, i - 1)], ks[min(len(ks) - 1, i + 1)]
        # probe the middle of each side of the bracket (a minimum inside, or at the edge of what fits: the
        # step often falls until the device state no longer leaves room to stream the rest)
        mids = {m for m in ((lo + best) // 2, (best + hi + 1) // 2) if m not in seen and 0 < m <= kmax}
        if not mids:
            break
        for m in sorted(mids):
            seen[m] = evaluate(m)
    best = min(seen, key=lambda k: (seen[k], k))
    return best if seen[best] < base * (1 - 1e-9) else 0
