"""The greedy cost-model scheduler's search (the policy: ``schedule.py``'s docstring): from "everything
streamed", each copy mode's sequence of moves (keep a bucket resident, or keep it between its last forward
and first backward use), every point simulated. In C++ where built (``cpp/greedy.cpp``); the Python loop
(:meth:`Greedy.candidates_reference`) is its reference and fallback."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import InvariantError
from .arrays import MaxTable, latest_issue, lexsort
from .buckets import Bucket
from .greedy_inputs import GreedyInputs
from .intervals import double_buffered_ends, latest_ended
from .hw import HardwareModel
from .layout import arena_of
from .plan import BufferKind, align
from .flat_waits import FlatWaits
from .simulate import STEP_START, LaneResult, Program, SimResult, simulate, simulate_arrays
from .trace import Trace

try:
    from .. import _C
except ImportError:  # a source tree without the built extension: the Python references run
    _C = None  # type: ignore[assignment]  # mypy types _C by its stub (offload/_C.pyi)

Streamed = dict[int, list[list[int]]]  # per streamed bucket: its buffers [issue, end), in event order
GradWaits = tuple[np.ndarray, np.ndarray]  # compute's waits on grad copies: (ptr over events + 1, copies), or empty

MODES = ("latest", "lookahead", "just in time")
"""Where a streamed bucket's copy is issued. ``latest``: as late as possible while still arriving before
use, given the copy queue (a backward pass over the copies in deadline order). ``lookahead``: when the
previous streamed use begins (double buffering). ``just in time``: at the event that needs it (the least
memory; the copy is waited for)."""


@dataclass(frozen=True)
class Point:
    """One simulated point of a mode's move sequence."""

    mode: str
    resident: frozenset
    flat: np.ndarray  # streamed buffers: rows (issue, bucket, end), in copy order
    lanes: SimResult | LaneResult  # what simulating it gave (``sim``: as a SimResult)
    peak: int  # max live arena bytes (the arena's lower bound)
    rank: tuple  # tie-break among equally fast points: fewest bytes copied, most resident, then mode order

    @property
    def step_s(self) -> float:
        return self.lanes.step_s

    @property
    def sim(self) -> SimResult:
        return self.lanes.result() if isinstance(self.lanes, LaneResult) else self.lanes

    @property
    def streamed(self) -> Streamed:
        """Per streamed bucket: its buffers [issue, end), in event order."""
        out: dict[int, list[list[int]]] = {}
        for p, b, e in self.flat.tolist():
            out.setdefault(b, []).append([p, e])
        return out


class Greedy:
    """The greedy scheduler's moves over one :class:`GreedyInputs`: lay out, simulate and rank points, and
    the sequence of points each copy mode goes through (:meth:`candidates`)."""

    def __init__(self, inputs: GreedyInputs):
        self.inputs = inputs
        n = inputs.n
        self._table = np.zeros((max(1, n.bit_length()), max(1, n)), dtype=np.int64)  # moves' MaxTable
        self._kernel: _C.GreedyKernel | None = None  # the C++ move sequence (``candidates``), built at its first use
        self._dominating: dict[bool, tuple[GradWaits, dict[int, int]]] = {}  # ``dominating_waits``, by ``double``

    @classmethod
    def of(cls, trace: Trace, buckets: Sequence[Bucket], itemsize: int, hw: HardwareModel,
           compute: tuple[float, ...], refresh_pipelined: bool = False) -> Greedy:
        """``refresh_pipelined``: the runtime refreshes resident buckets as their updates end (overlapped
        updates, one GPU): [Note: the refresh pipelined, modelled] in simulate.py."""
        return cls(GreedyInputs.of(trace, buckets, itemsize, hw, compute, refresh_pipelined))

    @property
    def uses(self) -> dict[int, list[tuple[int, int]]]:
        """Per needed bucket: its need intervals [start, end), in event order."""
        x = self.inputs
        out: dict[int, list[tuple[int, int]]] = {}
        for b, s, e in zip(x.use_b.tolist(), x.use_s.tolist(), x.use_e.tolist()):
            out.setdefault(b, []).append((s, e))
        return out

    # -- one point --------------------------------------------------------------------------------------

    def placed(self, mode: str, resident: frozenset, keep: frozenset) -> np.ndarray:
        """The streamed buffers [issue, end) with copies placed by ``mode``, as rows (issue, bucket, end)
        in copy-queue order (sorted). Vectorised over the need intervals, grouped by bucket:

        * a kept bucket's last forward and first backward intervals become one;
        * ``latest``: a backward pass over the copies in (need, bucket) order, each as late as the copy
          queue allows (sequential: each depends on the next); ``lookahead``: at the previous distinct
          need start; ``just in time``: at the need;
        * a copy issued before the bucket's previous interval ends merges into it (the bucket stays).
        """
        x = self.inputs
        s, e, b = x.use_s, x.use_e.copy(), x.use_b
        nb = x.nb
        live = np.ones(len(b), dtype=bool)
        if resident:
            live &= ~np.isin(b, np.fromiter(resident, dtype=np.int64, count=len(resident)))
        if keep:
            kb = np.fromiter(keep, dtype=np.int64, count=len(keep))
            e[x.fwd_row[kb]] = e[x.bwd_row[kb]]
            live[x.bwd_row[kb]] = False
        s, e, b = s[live], e[live], b[live]  # grouped by bucket, each bucket's intervals in event order
        if mode == "just in time":
            p = s
        elif mode == "lookahead":
            starts = np.sort(s)  # np.unique(s), by sorting (faster than its hash table)
            starts = starts[np.concatenate([np.ones(min(1, len(starts)), dtype=bool), starts[1:] != starts[:-1]])]
            j = np.searchsorted(starts, s)
            p = np.where(j > 0, starts[np.maximum(j - 1, 0)], s)
        else:
            order = lexsort((b, s), (nb, x.n + 1))
            latest = latest_issue(x.tau[s[order]], x.dur[b[order]])
            p = np.empty(len(order), dtype=np.int64)
            p[order] = np.minimum(s[order], np.maximum(0, np.searchsorted(x.tau, latest, side="right") - 1))
        # merge: a new buffer starts where the bucket changes or the copy comes after the previous end
        new = np.ones(len(b), dtype=bool)
        new[1:] = (b[1:] != b[:-1]) | (p[1:] > e[:-1])
        last = np.ones(len(b), dtype=bool)
        last[:-1] = new[1:]
        rows = np.stack([p[new], b[new], e[last]], axis=1)
        return rows[lexsort((rows[:, 2], rows[:, 1], rows[:, 0]), (x.n + 1, nb, x.n + 1))]

    def _rows(self, streamed: Streamed | None, flat: np.ndarray | None) -> np.ndarray:
        """``flat``, or the rows of ``streamed`` where ``flat`` is None (one of them is given)."""
        if flat is not None:
            return flat
        if streamed is None:
            raise InvariantError("a point needs its streamed buffers, as a dict or as rows")
        return self.flat(streamed)

    def flat(self, streamed: Streamed) -> np.ndarray:
        """The streamed buffers as rows (issue, bucket, end), sorted: the order of their copies in the
        host-to-device queue (``program``)."""
        rows = [(p, b, e) for b, ivs in streamed.items() for p, e in ivs]
        rows.sort()
        return np.array(rows, dtype=np.int64).reshape(len(rows), 3)

    def copies(self, resident: frozenset, flat: np.ndarray):
        """The host-to-device copies of a point and what each event waits for, as arrays: (number of
        refreshes ``m``, each copy's bucket, the waits' ``ptr`` and ``copies`` as in :class:`FlatWaits`).
        The copies are the ``m`` refreshes (resident buckets updated last step: refreshed before this
        step's forward, runtime.step; by bucket, whatever order the lanes issue them in), then the streamed
        buffers in ``flat`` order."""
        x = self.inputs
        n = x.n
        refresh = [b for b in sorted(resident) if b in x.grads]
        m = len(refresh)
        # A need of bucket b at event i waits for b's first copy ending after i (copies of a bucket are
        # disjoint and in event order): one search over the copies sorted by (bucket, end).
        cb = np.concatenate([np.asarray(refresh, dtype=np.int64), flat[:, 1]])
        ce = np.concatenate([np.full(m, n, dtype=np.int64), flat[:, 2]])
        order = lexsort((ce, cb), (n + 1, x.nb))
        found = np.full(len(x.need_b), -1, dtype=np.int64)
        if len(order):
            q = np.minimum(np.searchsorted(cb[order] * (n + 1) + ce[order], x.need_key, side="right"),
                           len(order) - 1)
            hit = cb[order][q] == x.need_b
            found[hit] = order[q[hit]]
            has_copy = np.bincount(cb, minlength=x.nb)[x.need_b] > 0
            if (has_copy & ~hit).any():
                raise InvariantError("a bucket is needed where none of its buffers is live: a bug in the "
                                     "scheduler, please report it")
        # -1: resident and not updated, already there (no wait)
        waited = found >= 0
        if waited.all():
            ptr = x.need_ptr
        else:
            ptr = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(np.bincount(x.need_e[waited], minlength=n), out=ptr[1:])
            found = found[waited]
        return m, cb, ptr, found

    def program(self, resident: frozenset[int], streamed: Streamed | None,
                flat: np.ndarray | None = None, grad_waits: GradWaits | None = None) -> Program:
        """The lane program of a point. ``grad_waits``: compute's waits on grad copies as (ptr, copies)
        arrays (a layout's: ``layout.grad_slot_waits``), else the intervals' rule ([Note: waits on a reused
        grad slot] in simulate.py)."""
        x = self.inputs
        flat = self._rows(streamed, flat)
        m, cb, ptr, found = self.copies(resident, flat)
        gptr, gcopy = grad_waits if grad_waits is not None else (x.grad_wait_ptr, x.grad_wait_copy)
        return Program(
            compute_s=x.compute_s, h2d_event=(STEP_START,) * m + tuple(flat[:, 0].tolist()),
            h2d_bucket=tuple(cb.tolist()), h2d_bytes=tuple(x.nbytes[cb].tolist()),
            waits=FlatWaits(ptr.tolist(), found.tolist()), device_return_bytes=x.device_return_bytes,
            grad_waits=FlatWaits(gptr.tolist(), gcopy.tolist()) if len(gptr) else (),
            refresh_pipelined=x.refresh_pipelined, **x.d2h_program)

    def simulate(self, resident: frozenset, flat: np.ndarray,
                 grad_waits: GradWaits | None = None) -> tuple[SimResult | LaneResult, int]:
        """``simulate(self.program(resident, None, flat, grad_waits), hw)`` without building the Program
        (the same numbers: per-copy seconds are ``hw``'s for the same byte counts), and the number of
        refreshes. A :class:`LaneResult` where the C++ lanes ran (``.result()`` is the SimResult)."""
        x = self.inputs
        m, cb, ptr, found = self.copies(resident, flat)
        if _C is not None:
            gptr, gcopy = grad_waits if grad_waits is not None else (x.grad_wait_ptr, x.grad_wait_copy)
            h2d_event = np.concatenate([np.full(m, STEP_START, dtype=np.int64), flat[:, 0]])
            after = x.refresh_after[cb[:m]] if x.refresh_pipelined and m else ()
            sim = simulate_arrays(x.compute, h2d_event, x.dur[cb], ptr, found, x.d2h_event, x.d2h_solo, x.adam_s,
                                  False, x.duplex, int(x.nbytes[cb].sum()), x.d2h_total,
                                  lazy=True, grad_wait_ptr=gptr, grad_wait_copy=gcopy, refresh_after=after,
                                  tail=x.device_tail_s)
            if isinstance(sim, LaneResult):  # (lazy: a LaneResult, or None)
                return sim.with_device_adam(x.device_tail_s, x.device_adam_s, x.device_return_s,
                                            sum(x.device_return_bytes)), m
        return simulate(self.program(resident, None, flat, grad_waits), x.hw), m

    def profile(self, resident: frozenset[int], streamed: Streamed | None,
                flat: np.ndarray | None = None) -> np.ndarray:
        """Live arena bytes at each event (aligned sizes, as the arena planner counts them)."""
        x = self.inputs
        flat = self._rows(streamed, flat)
        diff = x.grad_profile.copy()
        res = np.fromiter(resident, dtype=np.int64, count=len(resident))
        diff[0] += int(x.size[res].sum())
        diff[x.n] -= int(x.size[res].sum())
        size = x.size[flat[:, 1]]
        np.add.at(diff, flat[:, 0], size)
        np.add.at(diff, flat[:, 2], -size)
        return np.cumsum(diff[:-1])

    def layout(self, resident: frozenset, flat: np.ndarray, double: bool = False):
        """``_layout(trace, buckets, itemsize, resident, (streamed, x.grads))`` for the point whose
        streamed buffers are ``flat``, from arrays: the same specs in the same order (per bucket, its
        resident buffer or its streamed ones in event order; then the grad slots by bucket; empty ones
        dropped) and so the same layout. ``double``: the grad slots double-buffered ([Note: double-buffered
        grad slots] in schedule.py).

        Device-optimizer buckets (``inputs.device``): their weights and optimizer state live the whole step,
        under every other buffer, so they go first, packed from offset 0, and the rest is laid out above
        them as without them (the same lower bound plus their bytes; no search over layouts that must
        all keep them whole)."""
        x = self.inputs
        if x.device:
            return self._layout_with_device(resident, flat, double)
        res = np.asarray(sorted(resident), dtype=np.int64)
        b = np.concatenate([res, flat[:, 1]])
        start = np.concatenate([np.zeros(len(res), dtype=np.int64), flat[:, 0]])
        end = np.concatenate([np.full(len(res), x.n, dtype=np.int64), flat[:, 2]])
        order = np.lexsort((end, start, b))
        b, start, end = b[order], start[order], end[order]
        size = x.nbytes[b]
        keep = size > 0
        b, start, end, size = b[keep], start[keep], end[keep], size[keep]
        specs = list(zip(b.tolist(), itertools.repeat(BufferKind.PARAM), start.tolist(), end.tolist(), size.tolist()))
        grad_specs, grad_columns = self._grad_specs_double if double else self._grad_specs
        specs.extend(grad_specs)
        return arena_of(specs, [np.concatenate([c, g]) for c, g in zip((size, start, end), grad_columns)])

    def _layout_with_device(self, resident: frozenset, flat: np.ndarray, double: bool):
        x = self.inputs
        specs, layout = Greedy(dataclasses.replace(x, device=(), device_state_bytes=())).layout(resident, flat,
                                                                                                   double)
        whole = [(b, BufferKind.PARAM, 0, x.n, int(x.nbytes[b])) for b in x.device if x.nbytes[b] > 0]
        whole += [(b, BufferKind.STATE, 0, x.n, nbytes) for b, nbytes in zip(x.device, x.device_state_bytes)
                  if nbytes > 0]
        offsets = np.cumsum([0] + [align(spec[4]) for spec in whole]).tolist()
        base = offsets.pop()
        return whole + specs, dataclasses.replace(
            layout, offsets=tuple(offsets) + tuple(o + base for o in layout.offsets),
            total_bytes=layout.total_bytes + base, lower_bound_bytes=layout.lower_bound_bytes + base,
            candidates=tuple((h, total + base) for h, total in layout.candidates))

    def dominating_waits(self, double: bool = False) -> tuple[GradWaits, dict[int, int]]:
        """Compute's waits on grad copies that no layout's waits can outlast ([Note: dominating grad-slot
        waits] in schedule.py), as (ptr, copies) arrays (what ``program``/``simulate`` take), and the same per
        waiting bucket as {bucket: the bucket whose copy it waits for}. ``double``: with double-buffered
        slots (``intervals.double_buffered_ends``)."""
        cached = self._dominating.get(double)
        if cached is None:
            cached = self._dominating[double] = self._dominating_waits(double)
        return cached

    def _dominating_waits(self, double: bool) -> tuple[GradWaits, dict[int, int]]:
        x = self.inputs
        # the slots a layout has (empty ones dropped), by start; each copy's place in the D2H queue
        by_start = sorted(((s, b, e) for b, (s, e) in x.grads.items() if x.grad_bytes[b] > 0))
        b = np.array([r[1] for r in by_start], dtype=np.int64).reshape(len(by_start))
        start = np.array([r[0] for r in by_start], dtype=np.int64).reshape(len(by_start))
        end = np.array([r[2] for r in by_start], dtype=np.int64).reshape(len(by_start))
        if double:
            end = double_buffered_ends(start, end, x.n)
        d2h_bucket = x.d2h_program["d2h_bucket"]
        copy_of = dict(zip(d2h_bucket, range(len(d2h_bucket))))
        copy = np.fromiter((copy_of.get(v, -1) for v in b.tolist()), dtype=np.int64, count=len(b))
        last = latest_ended(start, end, copy)
        waits = last >= 0
        event, copies = start[waits], last[waits]
        none = np.zeros(0, dtype=np.int64)
        if not len(copies):
            return (none, none), {}
        order = np.argsort(event, kind="stable")
        ptr = np.zeros(x.n + 1, dtype=np.int64)
        np.cumsum(np.bincount(event, minlength=x.n), out=ptr[1:])
        on = np.asarray(d2h_bucket, dtype=np.int64)[copies]
        return (ptr, copies[order]), dict(zip(b[waits].tolist(), on.tolist()))

    @functools.cached_property
    def _grad_specs(self):
        """The grad slots' specs (by bucket; empty ones dropped) and their (sizes, starts, ends) as arrays."""
        return self._slot_specs(self.inputs.grads)

    @functools.cached_property
    def _grad_specs_double(self):
        """:attr:`_grad_specs` with each slot held until the next one's end (``double_buffered_ends``)."""
        x = self.inputs
        by_start = sorted(x.grads.items(), key=lambda kv: (kv[1][0], kv[0]))  # grad_arrays' order
        start = np.array([s for _, (s, _) in by_start], dtype=np.int64)
        end = double_buffered_ends(start, np.array([e for _, (_, e) in by_start], dtype=np.int64), x.n)
        return self._slot_specs({b: [s, e] for (b, _), s, e in zip(by_start, start.tolist(), end.tolist())})

    def _slot_specs(self, grads: dict[int, list[int]]):
        x = self.inputs
        grad = BufferKind.GRAD
        specs = [(g, grad, s, e, x.grad_bytes[g]) for g, (s, e) in sorted(grads.items()) if x.grad_bytes[g] > 0]
        columns = [np.array([spec[k] for spec in specs], dtype=np.int64) for k in (4, 2, 3)]
        return specs, columns

    # -- the move sequence ----------------------------------------------------------------------------

    def candidates(self, capacity: int, modes: Sequence[str] = MODES) -> list[Point]:
        """Every simulated point of every mode's sequence whose live bytes fit ``capacity``: the loop of
        :meth:`candidates_reference`, in C++ where built (``cpp/greedy.cpp``: the same points, field for field
        and bit for bit; ``tests/planning/test_greedy_kernel.py``). Where the C++ loop meets what the reference raises
        on (a stall on a zero-length copy, a score dividing by zero), the reference runs and raises it.
        ``modes``: only these copy modes' sequences (the device-optimizer search's quick evaluations)."""
        if _C is not None:
            points = self._candidates_cpp(capacity, modes)
            if points is not None:
                return points
        return self.candidates_reference(capacity, modes)

    def _candidates_cpp(self, capacity: int, modes: Sequence[str] = MODES) -> list[Point] | None:
        x = self.inputs
        if self._kernel is None:
            self._kernel = _C.GreedyKernel(**x.kernel_args())
        capacity = min(max(capacity, -1), 2 ** 62)  # live bytes are >= 0 and far below 2^62
        points = []
        for m, mode in enumerate(MODES):
            if mode not in modes:
                continue
            got, fallback = self._kernel.points(m, capacity)
            if fallback:
                return None
            for (res, flat, step, compute, stall, h2d_busy, d2h_busy, adam, compute_end, per_event, credit,
                 h2d_bytes, peak, resident_bytes, grad_stall, passes) in got:
                sim = LaneResult(step, compute, stall, h2d_busy, d2h_busy, adam, compute_end, per_event, credit,
                                 h2d_bytes, x.d2h_total, grad_stall_s=grad_stall,
                                 refresh_passes=passes).with_device_adam(x.device_tail_s, x.device_adam_s,
                                                                          x.device_return_s,
                                                                          sum(x.device_return_bytes))
                points.append(Point(mode, frozenset(res.tolist()), flat, sim, peak, (-h2d_bytes, resident_bytes, -m)))
        return points

    def candidates_reference(self, capacity: int, modes: Sequence[str] = MODES) -> list[Point]:
        """Every simulated point of every mode's sequence whose live bytes fit ``capacity`` (the Python loop)."""
        x = self.inputs
        points = []
        for m, mode in enumerate(MODES):
            if mode not in modes:
                continue
            resident: frozenset[int] = frozenset()
            keep: frozenset[int] = frozenset()
            while True:
                flat = self.placed(mode, resident, keep)
                prof = self.profile(resident, None, flat)
                peak = int(prof.max()) if len(prof) else 0
                resident_bytes = sum(int(x.size[b]) for b in resident)
                if peak > capacity and self.least_peak(resident) > capacity:
                    break  # no later point fits: [Note: points over the capacity]
                sim, refresh = self.simulate(resident, flat)
                if peak <= capacity:
                    # (the bytes this point's copies move: the deferred round trip's, the same at every point, aside)
                    rank = (-(sim.h2d_bytes - sum(x.device_return_bytes)), resident_bytes, -m)
                    points.append(Point(mode, resident, flat, sim, peak, rank))
                moves = self.moves(keep, flat, refresh, sim, prof, peak)
                if not moves:
                    break
                res, kept = set(resident), set(keep)
                for kind, b in moves:
                    if kind == "resident":
                        res.add(b)
                        kept.discard(b)
                    else:
                        kept.add(b)
                resident, keep = frozenset(res), frozenset(kept)
        return points

    def least_peak(self, resident: frozenset) -> int:
        """The least peak of any point whose resident buckets include ``resident``: the live bytes with the
        other buckets held for their need intervals only, at their most ([Note: points over the capacity])."""
        x = self.inputs
        diff = x.grad_profile.copy()
        res = np.fromiter(resident, dtype=np.int64, count=len(resident))
        diff[0] += int(x.size[res].sum())
        diff[x.n] -= int(x.size[res].sum())
        live = ~np.isin(x.use_b, res)
        size = x.size[x.use_b[live]]
        np.add.at(diff, x.use_s[live], size)
        np.add.at(diff, x.use_e[live], -size)
        return int(np.cumsum(diff[:-1]).max(initial=0))

    # [Note: points over the capacity]
    # A mode's sequence only adds resident (and kept) buckets, yet its points' live bytes are not monotone in
    # it: where the copies outlast the compute they are issued ahead of their use (``latest`` most of all, up
    # to the step's start), and every copy queued ahead holds its buffer from its issue. A bucket made resident
    # leaves the queue, and the copies before it are issued later by its copy time: their buffers shrink by
    # about what residency adds, and the peak can fall (issue 18, gpt3-6.7b with every block checkpointed,
    # pcie4, 40 GiB, 96 device-optimizer buckets: ``latest`` starts at 38.7 GiB of live bytes, over the 37.9
    # GiB of capacity, falls as buckets become resident and fits from 37.8 GiB: 2.366 s at best, where the
    # best point of the other modes that fits is 2.471 s). So a point over the capacity is simulated (its moves need its lanes) and left out,
    # and the sequence goes on; it stops where no later point can fit. That is ``least_peak``: at every event a
    # point holds its resident buckets and every other bucket the event needs (and the grad slots open then),
    # i.e. the bytes of (resident | needed there); a later point's resident set only grows, so that union
    # does, and its peak is at least this point's ``least_peak``. The sequence itself does not depend on the
    # capacity, so the points that fit still only grow with it (a larger budget never gives a slower plan).

    def moves(self, keep, flat, refresh, sim, prof, peak) -> list[tuple[str, int]]:
        """The next batch of moves, best first: most stall removed per byte while there is stall, then most
        copy time saved per byte. A batch covers the stall seen (at most ~1/x.max_points of the buckets).

        Per streamed bucket ``b`` (vectorised over the buckets; integer byte counts are exact and every
        float is the same operation, in the same order, as a per-bucket loop would do):
        ``resident``: gain = its copies' stall credit (or, once no stall is left, their copy time, less
        one copy if it is updated: that one comes back anyway); cost = the peak increase of holding it
        everywhere. ``keep``: gain = the credit (or time) of the copy of its first backward buffer; cost =
        the peak increase of holding it between its last forward and first backward buffers.
        """
        x = self.inputs
        copy_stall = sim.copy_stall_s  # waits for grad copies are not the moves' to remove
        stalled = copy_stall > 0
        nb, m = x.nb, len(flat)
        owner, p, e = flat[:, 1], flat[:, 0], flat[:, 2]
        count = np.bincount(owner, minlength=nb)
        credit = np.asarray(sim.copy_credit[refresh:], dtype=np.float64)
        if stalled:  # sequential sums in copy order (np.bincount adds in index order)
            gain = np.bincount(owner, weights=credit, minlength=nb)
        else:
            gain = np.bincount(owner, weights=x.dur[owner], minlength=nb) - x.updated_dur
        rmq = MaxTable(prof, self._table)
        # per bucket: max live bytes inside its buffers and outside them (its gaps): each bucket's buffers
        # in event order, then a max over each bucket's run (exact: integer maxima in any order)
        order = lexsort((p, owner), (x.n + 1, nb))
        ob, op, oe = owner[order], p[order], e[order]
        first = np.ones(m, dtype=bool)
        first[1:] = ob[1:] != ob[:-1]
        last = np.ones(m, dtype=bool)
        last[:-1] = first[1:]
        runs, run_b = np.flatnonzero(first), ob[first]
        inside = np.zeros(nb, dtype=np.int64)
        outside = np.zeros(nb, dtype=np.int64)
        if m:
            inside[run_b] = np.maximum.reduceat(rmq.query(op, oe), runs)
            before = rmq.query(np.where(first, 0, np.roll(oe, 1)), op)  # the gap before each buffer
            outside[run_b] = np.maximum(np.maximum.reduceat(before, runs),
                                        rmq.query(oe[last], np.full(len(runs), x.n, dtype=np.int64)))
        size = x.size
        cost = np.maximum(0, np.maximum(outside + size, inside) - peak)
        # no stall left: a move of equal traffic still goes in
        res_b = np.flatnonzero((count > 0) & ((gain > 0) | ((gain >= 0) & (not stalled))))
        with np.errstate(divide="raise", invalid="raise"):
            score = gain[res_b] / (cost[res_b] + size[res_b] / 1024)
        cand = [score, res_b, np.ones(len(res_b), dtype=np.int64), gain[res_b]]
        # keep: the buffer holding its last forward use and the one holding its first backward use
        kb = x.keepable[count[x.keepable] > 0]
        if keep:
            kb = kb[~np.isin(kb, np.fromiter(keep, dtype=np.int64, count=len(keep)))]
        if len(kb):
            key = ob * (x.n + 1) + op  # sorted: bucket, then start
            fwd = np.searchsorted(key, kb * (x.n + 1) + x.fwd_at[kb], side="right") - 1
            bwd = np.searchsorted(key, kb * (x.n + 1) + x.bwd_at[kb], side="right") - 1
            split = fwd != bwd
            kb, fwd, bwd = kb[split], fwd[split], bwd[split]
            kgain = credit[order[bwd]] if stalled else x.dur[kb]
            kcost = np.maximum(0, rmq.query(oe[fwd], op[bwd]) + size[kb] - peak)
            pos = kgain > 0
            kb, kgain, kcost = kb[pos], kgain[pos], kcost[pos]
            with np.errstate(divide="raise", invalid="raise"):
                kscore = kgain / (kcost + size[kb] / 1024)
            cand = [np.concatenate([a, x]) for a, x in
                    zip(cand, (kscore, kb, np.zeros(len(kb), dtype=np.int64), kgain))]
        score, bs, kinds, gains = cand
        ranked = np.lexsort((bs * 2 + kinds, -score))  # best score, then bucket, then "keep" before "resident"
        cap = max(1, -(-x.n_used // x.max_points))
        # each bucket's best move, in rank order; taken until ``cap`` moves or (while there is stall) until
        # their gains, summed in that order (cumsum adds sequentially), cover it
        # (a bucket is at most one resident and one keep candidate: keep the one ranked first)
        pos = np.empty(len(ranked), dtype=np.int64)
        pos[ranked] = np.arange(len(ranked), dtype=np.int64)
        first_pos = np.full(nb, len(ranked), dtype=np.int64)
        nr = len(res_b)  # each bucket at most once among the resident candidates, and among the keeps
        first_pos[bs[:nr]] = pos[:nr]
        first_pos[bs[nr:]] = np.minimum(first_pos[bs[nr:]], pos[nr:])
        best = ranked[np.sort(first_pos[first_pos < len(ranked)])]
        take = min(cap, len(best))
        if stalled and take:
            covered = np.flatnonzero(np.cumsum(gains[best[:take]]) >= copy_stall)
            if len(covered):
                take = int(covered[0]) + 1
        best = best[:take]
        return [("resident" if k else "keep", b) for k, b in zip(kinds[best].tolist(), bs[best].tolist())]


def compute_times(trace: Trace, compute_s: Sequence[float] | None) -> tuple[float, ...]:
    """Seconds of compute per trace event: ``compute_s``, or the trace's own; checked."""
    if compute_s is None:
        compute_s = trace.compute_seconds
    if len(compute_s) != len(trace.events):
        raise ValueError(f"compute_s has {len(compute_s)} entries for {len(trace.events)} trace events")
    seconds = np.asarray(compute_s, dtype=np.float64)
    if not (seconds >= 0).all():  # negatives and NaN
        raise ValueError("compute_s must be non-negative seconds")
    return tuple(seconds.tolist())
