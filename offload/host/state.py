"""The host side of the engine: fp32 masters, AdamW state, grad accumulators and the low-precision copies
of every bucket, laid out by ``buckets.host_layout`` in one exact-size host arena (``cpp/pinned_arena``),
and the bucket update."""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Sequence

import psutil
import torch

from ..config import format_bytes
from ..errors import HostMemoryError, InvariantError, KernelUnavailableError
from ..optim import adamw_
from ..planning.buckets import (GRAD_RING_CHUNK_BYTES, GRAD_RING_SLOTS, Bucket, HostLayout, ParamSpec,
                                chunk_numel, grad_ring_chunk_bytes, host_layout, locate)
from .arena import HostArena
from .grad_ring import GradRing, Landing, Lent
from .cpu_adam import KERNEL_AVAILABLE, adamw_step_at
from .steps import count_all, count_run, step_tensors

if TYPE_CHECKING:
    from ..backend.base import Event

_COUNT_LOCK = threading.Lock()
HOST_RAM_HEADROOM = 1.05  # leave 5 % of available RAM to everything else when sizing the host arena


class HostState:
    def __init__(self, buckets: Sequence[Bucket], specs: Sequence[ParamSpec], shapes: Sequence[torch.Size],
                 lowp_dtype: torch.dtype | None = None, fused: bool = KERNEL_AVAILABLE, accumulate: bool = False,
                 ring_slots: int | None = None, away: frozenset[int] = frozenset()):
        """``lowp_dtype``: the device's 16-bit compute dtype, whose copy of each bucket is kept here for the
        host-to-device copy and rewritten by every update; None when the device computes in fp32.
        ``fused``: updates run on the C++ kernel (``offload.AdamW.fused``); False: torch ops.
        ``accumulate``: grads may be summed over several backward passes (updates deferred to ``step()``):
        an fp32 sum per bucket (see [Note: host grads] in ``buckets.py``).
        ``ring_slots``: the grad copies land in a ring with room for that many of the largest buckets ([Note:
        grad staging ring]); None: ``GRAD_RING_SLOTS``.
        ``away``: buckets device-homed from the start, before any plan ([Note: the first step's host memory] in
        ``runtime/warmup.py``): each gets a fresh parked copy (master and 16-bit copy; m and v zeros, not made)."""
        if fused and not KERNEL_AVAILABLE:
            raise KernelUnavailableError("fused=True needs the C++ AdamW kernel, which this build of offload._C lacks "
                                         "(offload.host.cpu_adam.KERNEL_AVAILABLE is False): rebuild offload "
                                         "(pip install -e .) or use fused=False")
        self.fused = fused
        self.device_dtype = lowp_dtype or torch.float32
        # fp16 grads can overflow: the step-wide check (runtime, from the grad norms) skips such a step
        # before any update; the kernel checks each bucket again, so an inf that slipped past it could
        # never reach the weights.
        self.check_finite = lowp_dtype == torch.float16
        if ring_slots is None:
            ring_slots = GRAD_RING_SLOTS
        if ring_slots < 1:
            raise ValueError(f"ring_slots must be >= 1, got {ring_slots}")
        self.lowp_dtype, self.accumulate, self.ring_slots = lowp_dtype, accumulate, ring_slots
        # grads cross the ring in pieces of at most this many elements ([Note: chunked grad staging])
        self.chunk_bytes = grad_ring_chunk_bytes(buckets, self.device_dtype.itemsize, GRAD_RING_CHUNK_BYTES)
        self.chunk = chunk_numel(self.chunk_bytes, self.device_dtype.itemsize)
        self.buckets, self.specs, self.shapes = tuple(buckets), list(specs), list(shapes)
        # A frozen parameter has no fp32 master beside its 16-bit copy (see buckets.HostLayout).
        self.master_numel = [b.trainable_numel if lowp_dtype else b.numel for b in buckets]
        self.parked: set[int] = set()  # device-homed buckets whose state has a host copy now ([Note: device-homed buckets])
        # parked buckets whose m and v were never written: zeros, not made (:meth:`park`)
        self.fresh: set[int] = set()
        self._current = self._peak = 0  # host bytes this state holds, and their most (see ``host_bytes``)
        self._arena_counted = True
        lowp_bytes = lowp_dtype.itemsize if lowp_dtype is not None else 0
        parked = sum(self.master_numel[b] * 4 + buckets[b].numel * lowp_bytes for b in away)  # (park, below)
        self.arena, self.layout = self._allocate(frozenset(away), parked)
        for b in sorted(away):
            self.park(b, fresh=True)
        self.bucket_of, self.offset = locate(buckets)  # offset: element offset inside the bucket
        self.steps = [0] * len(specs)  # AdamW step count per parameter
        # the same, as optimizer.state[p]["step"]: 0-dim views of one vector ([Note: step tensors])
        self.step_values, self.step_tensor = step_tensors(len(specs))
        self._step_index: dict[tuple[int, ...], torch.Tensor] = {}

    # -- [Note: device-homed buckets] (issue 18) -------------------------------------------------------------
    # A bucket the training plan keeps with its optimizer on the device (``Placement.DEVICE_OPTIMIZER``) is
    # *device-homed*: ``rehome`` lays the host arena out again without its master, 16-bit copy, m and v (its
    # fp32 grad sum stays where grads are accumulated on the host: ``overlap_optimizer=False``). The host
    # arena is exact-size, so a re-plan that changes which buckets are device-homed builds a new arena of the
    # new size and copies what stays (peak: both arenas, for that moment). The state of a device-homed bucket
    # lives in the device arena; a host copy of it exists only while the host needs one: ``park`` makes one
    # (ordinary pageable memory, outside the arena: ``parked_bytes``) when the device state is copied back
    # (before a read: ``state_dict``, ``save``, ``optimizer.state_dict()``; or when the device arena goes:
    # a departure, a switch to a forward-only plan), and ``drop`` frees it once the device holds newer values
    # (the bucket's next device update). Until then the host copy serves everything a home bucket's regions
    # serve (reads, writes, a CPU update after a departure, the copy in at the next activation). Reading an
    # absent copy raises :class:`InvariantError`.
    away: frozenset[int] = frozenset()  # device-homed buckets (a class default: ShardedHostState has none)
    fresh: set[int] | frozenset[int] = frozenset()  # (ShardedHostState: none)
    _current = _peak = 0  # (ShardedHostState: none but held tensors; its arena, see host_bytes)
    _arena_counted = False

    def _allocate(self, away: frozenset[int], parked: int = 0) -> tuple[HostArena, HostLayout]:
        """Lay out and allocate the arena with ``away`` device-homed; point every region's view into it
        (device-homed buckets' views: absent, for ``rehome`` or ``park`` to fill)."""
        lowp_dtype, buckets = self.lowp_dtype, self.buckets
        lowp_itemsize = lowp_dtype.itemsize if lowp_dtype is not None else 0
        layout = host_layout(buckets, lowp_itemsize, self.accumulate, ring=self.ring_slots, away=away,
                             chunk_bytes=self.chunk_bytes)
        check_host_ram(layout.total_bytes + parked, layout, lowp_itemsize)  # parked: copies made beside it
        arena = HostArena(layout.total_bytes)
        self._count_bytes(arena.size_bytes)
        home = [b.index not in away for b in buckets]
        for b in buckets:  # claim each region, so the arena's own stats account for every byte
            if home[b.index] and self.master_numel[b.index]:
                arena.reserve(layout.master[b.index], self.master_numel[b.index] * 4)
            if home[b.index] and lowp_itemsize and b.numel:
                arena.reserve(layout.lowp[b.index], b.numel * lowp_itemsize)
            if b.trainable_numel:
                if self.accumulate:
                    arena.reserve(layout.grad[b.index], b.trainable_numel * layout.grad_itemsize)
                for region in (layout.exp_avg, layout.exp_avg_sq):
                    if home[b.index]:
                        arena.reserve(region[b.index], b.trainable_numel * 4)
        if layout.ring_bytes:
            arena.reserve(layout.ring, layout.ring_bytes)
        view = arena.view

        def views(offsets: tuple[int, ...], numel: Sequence[int], dtype: torch.dtype) -> list[torch.Tensor]:
            return [view(offsets[i], numel[i], dtype) if home[i] else _absent(dtype) for i in range(len(buckets))]

        trainable = [b.trainable_numel for b in buckets]
        self.master = views(layout.master, self.master_numel, torch.float32)
        self.lowp = views(layout.lowp, [b.numel for b in buckets], lowp_dtype) if lowp_dtype else None
        # The fp32 sums the deferred update reads (accumulation only: none with the optimizer overlapped,
        # whose update reads the ring bytes its grads landed in), and the ring: [Note: grad staging ring].
        self.grad = ([view(layout.grad[b.index], b.trainable_numel, torch.float32) for b in buckets]
                     if self.accumulate else [])
        self.ring = GradRing(view(layout.ring, layout.ring_bytes, torch.uint8), self.device_dtype)
        self.exp_avg = views(layout.exp_avg, trainable, torch.float32)
        self.exp_avg_sq = views(layout.exp_avg_sq, trainable, torch.float32)
        self.away = away
        return arena, layout

    def _state_views(self) -> dict[str, list[torch.Tensor]]:
        out = {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.lowp is not None:
            out["lowp"] = self.lowp
        return out

    def rehome(self, away: frozenset[int]) -> HostArena:
        """Make ``away`` the device-homed buckets: a new exact-size arena without their state; what stays home
        is copied over, a bucket coming home gets its parked copy (it must have one), a bucket leaving gives
        its regions up (the caller has copied its state to the device and synchronized: no copy may still
        use the old arena). Returns the old arena (the caller unpins it, then lets it go)."""
        away = frozenset(away)
        coming, leaving = self.away - away, away - self.away
        missing = sorted(b for b in coming if b not in self.parked)
        if missing:
            raise InvariantError(f"buckets {missing} come back to the host without a host copy of their state: "
                                 "a bug in offload, please report it")
        for b in coming:
            self.materialize(b)  # its zeros are copied into the new arena like any m and v
        freed = sum(self.parked_bytes_of(b) for b in coming)  # once copied into the new arena
        old_arena, old, old_grad = self.arena, self._state_views(), self.grad
        self.arena, self.layout = self._allocate(away)
        new = self._state_views()
        for name, views in new.items():
            for b in range(len(self.buckets)):
                if b in away and b not in leaving:
                    views[b] = old[name][b]  # parked or absent, as it was
                elif b not in away:
                    views[b].copy_(old[name][b])  # stays home, or comes home from its parked copy
        for dst, src in zip(self.grad, old_grad):
            dst.copy_(src)
        self.parked -= coming
        self._count_bytes(-old_arena.size_bytes - freed)  # the caller lets the old arena go once it is unpinned
        return old_arena

    def park(self, b: int, fresh: bool = False) -> None:
        """Device-homed bucket ``b`` gets a host copy of its state (pageable; its values are the caller's to
        write, from the device); nothing to do if it has one. ``fresh``: before any update, a master and 16-bit
        copy only (the warm-up writes them); m and v are zeros, made only where the host needs them
        (:meth:`materialize`; [Note: the first step's host memory] in ``runtime/warmup.py``)."""
        if b not in self.away:
            raise InvariantError(f"bucket {b} is not device-homed: its state has its place in the host arena")
        if b in self.parked:
            return
        bucket = self.buckets[b]
        self.master[b] = torch.empty(self.master_numel[b], dtype=torch.float32)
        if self.lowp is not None:
            self.lowp[b] = torch.empty(bucket.numel, dtype=self.lowp_dtype)
        if fresh:
            self.fresh.add(b)
        else:
            self.exp_avg[b] = torch.empty(bucket.trainable_numel, dtype=torch.float32)
            self.exp_avg_sq[b] = torch.empty(bucket.trainable_numel, dtype=torch.float32)
        self.parked.add(b)
        self._count_bytes(self.parked_bytes_of(b))

    def materialize(self, b: int) -> None:
        """A fresh parked bucket's m and v as tensors (zeros): the host reads or updates them."""
        if b not in self.fresh:
            return
        n = self.buckets[b].trainable_numel
        self.exp_avg[b] = torch.zeros(n, dtype=torch.float32)
        self.exp_avg_sq[b] = torch.zeros(n, dtype=torch.float32)
        self.fresh.discard(b)
        self._count_bytes(n * 8)

    def drop(self, b: int) -> None:
        """Free device-homed bucket ``b``'s host copy: the device holds newer values."""
        if b not in self.parked:
            return
        self._count_bytes(-self.parked_bytes_of(b))
        for views in self._state_views().values():
            views[b] = _absent(views[b].dtype)
        self.parked.discard(b)
        self.fresh.discard(b)

    def parked_bytes_of(self, b: int) -> int:
        """Host bytes of bucket ``b``'s parked copy (0 if none)."""
        if b not in self.parked:
            return 0
        return sum(t[b].numel() * t[b].element_size() for t in self._state_views().values())

    # -- host bytes ([Note: the first step's host memory] in runtime/warmup.py) ------------------------------

    def _count_bytes(self, n: int) -> None:
        with _COUNT_LOCK:  # held tensors are freed on the CPU lane's thread
            self._current += n
            self._peak = max(self._peak, self._current)

    def hold(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A pageable host tensor counted in :meth:`host_bytes` until it is freed (the first step's held grads)."""
        t = torch.empty(numel, dtype=dtype)
        nbytes = numel * dtype.itemsize
        self._count_bytes(nbytes)
        weakref.finalize(t, self._count_bytes, -nbytes)
        return t

    def host_bytes(self) -> tuple[int, int]:
        """(now, most since this state was made): the host bytes it holds: its arena (an old one until it is
        let go after a re-layout), the parked copies of device-homed state and the tensors of :meth:`hold`.
        Not counted: the user's own tensors, temporaries of a single call, and ``state_dict``/``save`` copies."""
        base = 0 if self._arena_counted else self.nbytes  # ShardedHostState: its one arena, never counted
        return base + self._current, base + self._peak

    def has_copy(self, b: int) -> bool:
        """Bucket ``b``'s state has a host copy: home, or device-homed and parked."""
        return b not in self.away or b in self.parked

    def require_copy(self, b: int) -> None:
        if not self.has_copy(b):
            raise InvariantError(f"bucket {b}'s optimizer state lives on the device and has no host copy now "
                                 "(see [Note: device-homed buckets]): a read of the host that did not wait for "
                                 "Runtime.wait_for_updates, a bug in offload, please report it")

    @property
    def parked_bytes(self) -> int:
        """Host bytes of the parked copies (outside the arena)."""
        return sum(self.parked_bytes_of(b) for b in self.parked)

    def region_bytes(self, b: int) -> int:
        """Host arena bytes of bucket ``b``'s regions (unaligned): 0 for master, copy, m and v when device-homed."""
        bucket, layout = self.buckets[b], self.layout
        own = 0
        if b not in self.away:
            lowp = self.lowp_dtype.itemsize if self.lowp_dtype is not None else 0
            own = self.master_numel[b] * 4 + bucket.numel * lowp + bucket.trainable_numel * 8
        return own + bucket.trainable_numel * (layout.grad_itemsize if self.accumulate else 0)

    @property
    def nbytes(self) -> int:
        return self.arena.size_bytes

    def source(self, b: int) -> torch.Tensor:
        """What the host-to-device copy of bucket ``b`` reads: its device-dtype host copy."""
        self.require_copy(b)
        return self.lowp[b] if self.lowp is not None else self.master[b]

    def refresh_lowp(self, b: int, start: int = 0, end: int | None = None) -> None:
        """Round ``master[b][start:end]`` into the low-precision copy (nearest even). ``end=None``: the end
        of the bucket's masters (a frozen tail kept only in 16 bits has none, and keeps its copy)."""
        if self.lowp is not None:
            end = self.master_numel[b] if end is None else end
            self.lowp[b][start:end].copy_(self.master[b][start:end])

    def exact(self, region: str, b: int, start: int, numel: int) -> torch.Tensor:
        """A tensor over ``numel`` fp32 elements of bucket ``b``'s ``region`` whose storage is exactly those
        bytes (no copy), so ``torch.save`` writes them and nothing else of the arena. A parked device-homed
        bucket's: a copy of those elements (the parked tensor is not the arena)."""
        self.require_copy(b)
        if b in self.away:
            if region in ("exp_avg", "exp_avg_sq"):
                self.materialize(b)
            return getattr(self, region)[b][start: start + numel].clone()
        offset = getattr(self.layout, region)[b] + start * 4
        return self.arena.exact_view(offset, numel, torch.float32)

    def has_master(self, p: int) -> bool:
        """False for a frozen parameter kept only as its 16-bit copy."""
        return self.offset[p] < self.master_numel[self.bucket_of[p]]

    def param_master(self, p: int) -> torch.Tensor:
        if not self.has_master(p):
            raise KeyError(f"parameter {p} is frozen and kept only in 16 bits: it has no fp32 master")
        self.require_copy(self.bucket_of[p])
        off = self.offset[p]
        return self.master[self.bucket_of[p]][off: off + self.specs[p].numel]

    def param_source(self, p: int) -> torch.Tensor:
        """Parameter ``p``'s slice of what its bucket's host-to-device copy reads (:meth:`source`: the value the
        device shows), shaped as the parameter; a view of the host arena."""
        off = self.offset[p]
        return self.source(self.bucket_of[p])[off: off + self.specs[p].numel].view(self.shapes[p])

    def read_param(self, p: int) -> torch.Tensor:
        """Parameter ``p``'s current value in fp32, flat (a copy): its master, or its 16-bit copy widened."""
        self.require_copy(self.bucket_of[p])
        if self.has_master(p):
            return self.param_master(p).clone()
        off = self.offset[p]
        return self.lowp[self.bucket_of[p]][off: off + self.specs[p].numel].float()

    def write_master(self, p: int, value: torch.Tensor) -> None:
        """Set parameter ``p``'s fp32 master (and its low-precision copy) to ``value``; a frozen parameter
        without a master gets ``value`` rounded to 16 bits."""
        self.require_copy(self.bucket_of[p])
        off = self.offset[p]
        if not self.has_master(p):
            self.lowp[self.bucket_of[p]][off: off + self.specs[p].numel].copy_(value.reshape(-1))
            return
        self.param_master(p).copy_(value.reshape(-1))
        self.refresh_lowp(self.bucket_of[p], off, off + self.specs[p].numel)

    def param_state(self, p: int, which: str) -> torch.Tensor:
        self.require_copy(self.bucket_of[p])
        self.materialize(self.bucket_of[p])
        off = self.offset[p]
        flat = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}[which][self.bucket_of[p]]
        return flat[off: off + self.specs[p].numel].view(self.shapes[p])

    def update(self, b: int, params: frozenset, hparams, grad_factors: Sequence[float] = (),
               grads: torch.Tensor | None = None, span: tuple[int, int] | None = None,
               counts: list[tuple[int, ...]] | None = None) -> None:
        """AdamW over bucket ``b``'s flat buffers for the parameters that got grads, one call per run of
        same-group, same-step parameters (runs a parameter with another step count apart). ``grads``: the
        bucket's grads (where they landed in the grad ring, overlapped); None: its fp32 sum (accumulation).

        ``grad_factors`` multiply the grads first (the loss-scale inverse, then the clipping coefficient:
        the order in which torch's GradScaler.unscale_ and clip_grad_norm_ apply them). The fused kernel
        takes their product as its ``grad_scale`` and writes the new 16-bit copy in the same pass; the torch
        path multiplies the grads in place one factor after the other, then rounds the copy. (With the
        default power-of-two loss scales and one clipping coefficient both round the same.)

        ``span``: ``(lo, hi)``, only those elements of the bucket, whose grads ``grads`` holds (one piece of the
        ring, [Note: chunked grad staging]); each piece updates with the step counts the bucket had, and they
        go up with the piece that ends the bucket's trainable prefix.

        ``counts``: the runs whose steps go up are added there for :meth:`count_runs`, not counted (a batch).
        """
        self.require_copy(b)
        self.materialize(b)  # a fresh device-homed bucket updated on the host (its plan keeps it home after all)
        bucket = self.buckets[b]
        grad = self.grad_sum(b) if grads is None else grads
        lo, hi = span if span is not None else (0, bucket.trainable_numel)
        base = lo if grads is not None else 0  # where ``grad``'s element 0 is in the bucket
        master, m, v = self.master[b], self.exp_avg[b], self.exp_avg_sq[b]
        lowp = self.lowp[b] if self.lowp is not None else None
        scale = 1.0
        for f in grad_factors:
            scale *= f

        def fused(s: int, e: int, step: int, hp: dict) -> None:
            found_inf = adamw_step_at(master, grad, m, v, s, s - base, e - s, lowp, step=step, **hp, grad_scale=scale,
                                      check_finite=self.check_finite)
            if found_inf:
                self._inf_error(b)

        def plain(s: int, e: int, step: int, hp: dict) -> None:
            # 16-bit grads widen first (exactly), so the update is torch's on the same fp32 grads
            g = grad[s - base:e - base] if grad.dtype == torch.float32 else grad[s - base:e - base].float()
            if self.check_finite and not bool(torch.isfinite(g).all()):
                self._inf_error(b)
            for f in grad_factors:
                if f != 1.0:
                    g.mul_(f)
            adamw_(master[s:e], g, m[s:e], v[s:e], step, **hp)
            self.refresh_lowp(b, s, e)

        one = fused if self.fused else plain
        segments = []  # (start, end, step count after it, hyperparameters, the parameters it steps)
        for run in bucket.runs:
            lr, b1, b2, eps, wd = hparams[run.group]
            hp = dict(lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd)
            steps = set(map(self.steps.__getitem__, run.params))
            if params.issuperset(run.params) and len(steps) == 1:
                segments.append((run.start, run.end, steps.pop() + 1, hp, run.params))
                continue
            for p in run.params:
                if p in params:
                    segments.append((self.offset[p], self.offset[p] + self.specs[p].numel, self.steps[p] + 1, hp,
                                     (p,)))
        for s, e, step, hp, _ in segments:
            if max(s, lo) < min(e, hi):
                one(max(s, lo), min(e, hi), step, hp)
        if hi >= bucket.trainable_numel:
            for *_, counted in segments:
                if counts is None:
                    self._count(counted)
                else:
                    counts.append(counted)

    @staticmethod
    def _inf_error(b: int) -> None:
        raise InvariantError(f"bucket {b}'s float16 grads hold an inf or NaN although the step-wide overflow check "
                             "passed; the bucket was not updated. This is a bug in offload: please report it")

    def grad_norms(self, b: int, params, ord: float = 2.0) -> dict[int, torch.Tensor]:
        """Per-parameter norm (fp32) of the accumulated host grads of ``params`` (all in bucket ``b``)."""
        grad = self.grad_sum(b)
        wide = None if grad.dtype == torch.float32 else torch.float32
        return {p: torch.linalg.vector_norm(grad[self.offset[p]: self.offset[p] + self.specs[p].numel], ord,
                                            dtype=wide)
                for p in params}

    def grad_sum(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s fp32 grad sum (accumulation only: overlapped updates read the grad ring)."""
        if not self.grad:
            raise InvariantError("the host keeps fp32 grad sums only with overlap_optimizer=False (accumulation); "
                                 "this engine updates each bucket from the grad ring: a bug in offload, please "
                                 "report it")
        return self.grad[b]

    def chunks(self, b: int, first: bool) -> list[tuple[int, int]]:
        """The pieces ``(lo, hi)`` in which bucket ``b``'s grads cross ([Note: chunked grad staging]): one, the
        whole trainable prefix, where they land in the fp32 sum itself or fit one piece."""
        n = self.buckets[b].trainable_numel
        if not self.chunk or n <= self.chunk or (first and self.grad and self.device_dtype == torch.float32):
            return [(0, n)]
        return [(lo, min(n, lo + self.chunk)) for lo in range(0, n, self.chunk)]

    def landing(self, b: int, first: bool, lo: int = 0, hi: int | None = None) -> Landing:
        """Where the device-to-host copy of bucket ``b``'s grads goes: the fp32 sum itself for the step's
        ``first`` fp32 grads with accumulation, else bytes of the grad ring, lent until
        :meth:`staged_read_by` names its reader. See [Note: grad staging ring] in ``buckets.py``. ``lo``, ``hi``:
        one of :meth:`chunks`' pieces."""
        if first and self.grad and self.device_dtype == torch.float32:
            return Landing(self.grad[b], None, ())
        hi = self.buckets[b].trainable_numel if hi is None else hi
        lent, view, after = self.ring.take(hi - lo)
        return Landing(view, lent, after)

    def staged_read_by(self, lent: Lent | None, event: Event) -> None:
        """The grads in the ring bytes ``lent`` (a :class:`Landing`'s) are read by the CPU-lane work ending with
        ``event``: the next copy over those bytes waits for it. ``None`` (nothing borrowed): nothing to do."""
        if lent is not None:
            lent.reader = event

    def reset_staging(self) -> None:
        """After a failed backward, every copy and reader finished: the ring forgets them."""
        self.ring.reset()

    def take_staged(self, b: int, first: bool, staged: torch.Tensor, lo: int = 0) -> None:
        """CPU lane, after the copy into ``staged`` (bytes of the grad ring): widen it into the fp32 sum (the
        step's ``first`` grads), or add it (exactly what adding the fp32-converted grads would give: widening is
        exact). ``lo``: where the piece ``staged`` starts in the bucket."""
        total = self.grad_sum(b)[lo: lo + staged.numel()]
        if first:
            total.copy_(staged)
        else:
            total.add_(staged)

    def count_steps(self, params) -> None:
        """One more AdamW step for each of ``params``, taken elsewhere (on the device: issue 18)."""
        self._count(params)

    def count_runs(self, runs: Sequence[tuple[int, ...]]) -> None:
        """One more step for each parameter of ``runs`` (several buckets' :meth:`update`, ``counts``): one op where
        they all have one count ([Note: sent as one batch] in runtime/bucket_send.py), else run by run."""
        if not count_all(self.steps, self.step_values, self._step_index, runs):
            for run in runs:
                self._count(run)

    def _count(self, params) -> None:
        """One more step for each of ``params`` (a bucket run's, in the common case: one count for all)."""
        steps = self.steps
        for p in params:
            steps[p] += 1
        counts = set(map(steps.__getitem__, params))
        if len(counts) != 1 or len(params) == 1:
            for p in params:
                self.step_tensor[p].fill_(float(steps[p]))
            return
        count_run(self.step_values, self._step_index, tuple(params), counts.pop())  # [Note: step tensors]

    @torch.no_grad()
    def adopt_optimizer_state(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
        """Point ``optimizer.state`` at this arena, taking over any state loaded into it before. A device-homed
        bucket without a host copy shows only its step (see :meth:`show_state`)."""
        for p, param in enumerate(params):
            if self.specs[p].group is None:
                continue
            old = optimizer.state.get(param, {})
            if not self.has_copy(self.bucket_of[p]) or (self.bucket_of[p] in self.fresh and "exp_avg" not in old):
                self.show_state(optimizer, params, (self.bucket_of[p],))
                continue
            m, v = self.param_state(p, "exp_avg"), self.param_state(p, "exp_avg_sq")
            if "exp_avg" in old and old["exp_avg"] is not m:
                m.copy_(old["exp_avg"].reshape(m.shape))
                v.copy_(old["exp_avg_sq"].reshape(v.shape))
            if "step" in old and old["step"] is not self.step_tensor[p]:
                self.steps[p] = int(float(old["step"]))
            self.step_tensor[p].fill_(float(self.steps[p]))
            optimizer.state[param] = {"step": self.step_tensor[p], "exp_avg": m, "exp_avg_sq": v}

    def show_state(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], buckets) -> None:
        """Re-point ``optimizer.state`` of the parameters of ``buckets`` at their current host views, without
        copying (after ``park``, ``drop`` or ``rehome`` moved them). A device-homed bucket without a host copy
        shows only the step: its m and v are on the device, and ``optimizer.state_dict()`` (which waits for
        the updates, and so parks them) is the way to read them; a stale value is never shown."""
        wanted = set(buckets)
        for p, param in enumerate(params):
            b = self.bucket_of[p]
            if b not in wanted or self.specs[p].group is None:
                continue
            entry: dict = {"step": self.step_tensor[p]}
            if self.has_copy(b) and b not in self.fresh:  # a fresh bucket's m and v: zeros, not made until read
                entry["exp_avg"], entry["exp_avg_sq"] = self.param_state(p, "exp_avg"), self.param_state(p, "exp_avg_sq")
            optimizer.state[param] = entry


def _absent(dtype: torch.dtype | None) -> torch.Tensor:
    """The view of a region a device-homed bucket has no host copy of (:meth:`HostState.require_copy` guards reads)."""
    return torch.empty(0, dtype=dtype)


def check_host_ram(nbytes: int, layout: HostLayout, lowp_itemsize: int = 0) -> None:
    available = psutil.virtual_memory().available
    if nbytes * HOST_RAM_HEADROOM > available:
        trainable = 12 + lowp_itemsize + layout.grad_itemsize + layout.staging_itemsize
        raise HostMemoryError(
            f"the host arena needs {format_bytes(nbytes)} of RAM (fp32 masters, Adam m and v, grad sums: "
            f"{trainable} bytes per trainable parameter, {lowp_itemsize or 4} per frozen one; grad staging "
            f"{format_bytes(layout.ring_bytes)}) but only "
            f"{format_bytes(available)} is available. Free host memory, freeze more parameters, or use a "
            "machine with more RAM.")
