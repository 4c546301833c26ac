"""The host side of one data-parallel rank (issue 20): every bucket's optimizer state partitioned across the
ranks of a group, ZeRO-Offload style.

[Note: host shards]
A bucket's trainable prefix (``n`` elements) is cut into ``world`` contiguous shards of ``c`` elements
(``c = ceil(n / world)`` rounded up to ``SHARD_ALIGN``; the last shards may be short or empty). Rank ``r``
owns elements ``[r*c, min((r+1)*c, n))``: only it keeps their fp32 master, Adam m and v, and only it
updates them. Every rank keeps, in full:

- the device-dtype copy of the whole bucket (``lowp``: what the host-to-device copy sends; in fp32 it is
  the fp32 weights, and the owned shard of it *is* the rank's master, so fp32 keeps no second master); or,
  where the node's ranks share one copy ([Note: one host copy per node] in node_copy.py), a view of that
  (outside the rank's arena), of which the rank writes only its shard;
- the grad the device-to-host copy lands in (``grad``, padded to ``c * world`` elements with zeros so it
  is the input of one reduce-scatter), and the accumulation staging copy;
- ``grad_shard``: the rank's ``c`` elements of the grads summed over the ranks (the reduce-scatter's output),
  which the update reads (scaled by ``1 / world``: the average, as DDP's).

So a trainable parameter costs ``lowp + grad (+ staging)`` bytes on every rank plus ``(4 + 4 + 4 + grad) /
world`` for the shard (fp32: ``4 + grad (+ staging) + (4 + 4 + grad) / world``). This class does no
communication: the runtime (``offload/runtime/distributed.py``) runs the collectives and hands it
``gather``, which all-gathers a shard, for the reads that need values other ranks own (``read_param``,
``param_state``, ``exact``: checkpoints and ``state_dict``, collective calls every rank must make).

The update of a shard is elementwise AdamW over the same fp32 inputs as one process's update of the whole
bucket, so a rank's shard is bit for bit what one process would compute from the same summed grads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import psutil
import torch

from ..config import format_bytes
from ..errors import HostMemoryError, InvariantError, KernelUnavailableError
from ..optim import adamw_
from ..planning.buckets import HOST_ALIGN, Bucket, ParamSpec, locate
from .arena import HostArena
from .cpu_adam import KERNEL_AVAILABLE, adamw_step_unchecked
from .node_copy import NodeCopy, node_copy_layout
from .grad_ring import Landing
from .state import HOST_RAM_HEADROOM, HostState
from .steps import step_tensors

SHARD_ALIGN = 16  # elements: every shard starts 64-byte aligned in fp32 (the SIMD loads of the CPU AdamW)

Gather = Callable[[torch.Tensor], torch.Tensor]  # a rank's shard -> the ``world`` shards, concatenated


@dataclass(frozen=True)
class Shard:
    """This rank's part of one bucket's trainable prefix: elements ``[start, end)``, ``size`` per rank."""

    start: int
    end: int
    size: int  # c: elements per rank (the padded length is size * world)

    @property
    def numel(self) -> int:
        return self.end - self.start


def shard_of(n: int, rank: int, world: int) -> Shard:
    """[Note: host shards]: rank ``rank``'s part of a trainable prefix of ``n`` elements."""
    c = -(-n // world) if n else 0
    c = -(-c // SHARD_ALIGN) * SHARD_ALIGN
    return Shard(min(rank * c, n), min((rank + 1) * c, n), c)


@dataclass(frozen=True)
class ShardLayout:
    """Byte offsets in one rank's host arena (see [Note: host shards])."""

    lowp: tuple[int, ...]  # the whole bucket in the device dtype
    master: tuple[int, ...]  # the shard's fp32 master (16-bit device dtypes only; empty in fp32)
    grad: tuple[int, ...]  # the landing grad, padded to size * world (empty: grads reduced on the device)
    staging: tuple[int, ...]
    grad_shard: tuple[int, ...]
    exp_avg: tuple[int, ...]
    exp_avg_sq: tuple[int, ...]
    total_bytes: int


def shard_layout(buckets: Sequence[Bucket], shards: Sequence[Shard], world: int, device_itemsize: int,
                 accumulate: bool, landing: bool = True, own_copy: bool = True) -> ShardLayout:
    """Pure: the regions of [Note: host shards], each ``HOST_ALIGN``-aligned, bucket after bucket. ``landing``:
    whether the whole bucket's grad lands on the host (False where grads are reduce-scattered on the device and
    only the shard comes: [Note: grads reduced on the device] in runtime/device_collectives.py; then the
    landing grad's region is empty). ``own_copy``: whether the rank keeps its own device-dtype copy (False:
    the node's ranks share one, [Note: one host copy per node] in node_copy.py; its region is empty)."""
    lowp16 = device_itemsize != 4
    grad_itemsize = 4 if accumulate else device_itemsize
    fields: dict[str, list[int]] = {k: [] for k in ("lowp", "master", "grad", "staging", "grad_shard",
                                                     "exp_avg", "exp_avg_sq")}
    off = 0
    for b, s in zip(buckets, shards):
        sizes = {"lowp": b.numel * device_itemsize if own_copy else 0, "master": s.size * 4 if lowp16 else 0,
                 "grad": s.size * world * grad_itemsize if landing else 0,
                 "staging": b.trainable_numel * device_itemsize if accumulate else 0,
                 "grad_shard": s.size * grad_itemsize, "exp_avg": s.size * 4, "exp_avg_sq": s.size * 4}
        for name, nbytes in sizes.items():
            fields[name].append(off)
            off = -(-(off + nbytes) // HOST_ALIGN) * HOST_ALIGN
    return ShardLayout(**{k: tuple(v) for k, v in fields.items()}, total_bytes=off)


class ShardedHostState(HostState):
    """One rank's host state: :class:`offload.host.state.HostState`'s interface over sharded buckets. It builds
    its own arena (HostState's ``__init__`` is not called) and overrides every method that reads or writes
    a region; what it inherits (``_inf_error``, ``_count``) touches none."""

    def __init__(self, buckets: Sequence[Bucket], specs: Sequence[ParamSpec], shapes: Sequence[torch.Size],
                 device_dtype: torch.dtype, rank: int, world: int, gather: Gather,
                 fused: bool = KERNEL_AVAILABLE, accumulate: bool = False, landing: bool = True,
                 node_copy: NodeCopy | None = None) -> None:
        """``node_copy``: the device-dtype copy shared by the node's ranks ([Note: one host copy per node]);
        None: this rank keeps its own, in its arena."""
        if not landing and accumulate:
            raise InvariantError("accumulated grads are summed on the host: they need the landing grad (a bug in "
                                 "offload, please report it)")
        if fused and not KERNEL_AVAILABLE:
            raise KernelUnavailableError("fused=True needs the C++ AdamW kernel, which this build of offload._C "
                                         "lacks: rebuild offload or use fused=False")
        # no super().__init__(): its arena and regions are HostState's, unsharded
        self.fused, self.rank, self.world, self._gather = fused, rank, world, gather
        self.device_dtype = device_dtype
        self.check_finite = device_dtype == torch.float16
        self.buckets, self.specs, self.shapes = tuple(buckets), list(specs), list(shapes)
        self.shards = [shard_of(b.trainable_numel, rank, world) for b in buckets]
        itemsize = torch.empty((), dtype=device_dtype).element_size()
        self.node_copy = node_copy
        layout = shard_layout(buckets, self.shards, world, itemsize, accumulate, landing, own_copy=node_copy is None)
        available = psutil.virtual_memory().available
        if layout.total_bytes * HOST_RAM_HEADROOM > available:
            raise HostMemoryError(f"rank {rank}'s host arena needs {format_bytes(layout.total_bytes)} of RAM (its "
                                  f"shard of the optimizer state, the whole device-dtype copy and grads) but only "
                                  f"{format_bytes(available)} is available: free host memory, or use more ranks")
        self.arena = HostArena(layout.total_bytes)
        self.layout = layout
        grad_dtype = torch.float32 if accumulate else device_dtype
        view = self.arena.view
        fp32 = device_dtype == torch.float32
        if node_copy is None:
            self.lowp = [view(layout.lowp[b.index], b.numel, device_dtype) for b in buckets]
        else:
            offsets, need = node_copy_layout(buckets, itemsize)
            if need > node_copy.size_bytes:
                raise InvariantError(f"the node's shared copy holds {node_copy.size_bytes} bytes, these buckets need "
                                     f"{need}: a bug in offload, please report it")
            self.lowp = [node_copy.view(offsets[b.index], b.numel, device_dtype) for b in buckets]
        # The whole bucket's grad as it lands on the host (the host collectives' buffer); None where only the
        # shard comes to the host ([Note: grads reduced on the device]): nothing reads it there.
        self.grad_padded: list[torch.Tensor] | None = None
        self.grad: list[torch.Tensor] | None = None
        if landing:
            self.grad_padded = [view(layout.grad[b.index], s.size * world, grad_dtype)
                                for b, s in zip(buckets, self.shards)]
            for g in self.grad_padded:
                g.zero_()  # the padding past the trainable prefix is never written: zeros for the reduce-scatter
            self.grad = [g[: b.trainable_numel] for g, b in zip(self.grad_padded, buckets)]
        self.staging = ([view(layout.staging[b.index], b.trainable_numel, device_dtype) for b in buckets]
                        if accumulate else None)
        self.grad_shard = [view(layout.grad_shard[b.index], s.size, grad_dtype) for b, s in zip(buckets, self.shards)]
        # The shard's fp32 master: in fp32 the owned part of the device copy itself.
        self.master = [self.lowp[b.index][s.start: s.end] if fp32 else view(layout.master[b.index], s.size, torch.float32)
                       for b, s in zip(buckets, self.shards)]
        self.exp_avg = [view(layout.exp_avg[b.index], s.size, torch.float32) for b, s in zip(buckets, self.shards)]
        self.exp_avg_sq = [view(layout.exp_avg_sq[b.index], s.size, torch.float32) for b, s in zip(buckets, self.shards)]
        for t in (*self.master, *self.exp_avg, *self.exp_avg_sq):
            t.zero_()  # the padding of a short last shard is gathered: zeros, never stale bytes
        self.bucket_of, self.offset = locate(buckets)
        self.steps = [0] * len(specs)
        self.step_values, self.step_tensor = step_tensors(len(specs))  # [Note: step tensors] in steps.py
        self._step_index: dict[tuple[int, ...], torch.Tensor] = {}
        self._full: dict[tuple[str, int], torch.Tensor] = {}  # gathered regions, until the next update

    @property
    def nbytes(self) -> int:
        return self.arena.size_bytes

    def source(self, b: int) -> torch.Tensor:
        return self.lowp[b]

    def refresh_lowp(self, b: int, start: int = 0, end: int | None = None) -> None:
        """HostState's rounding of whole-bucket masters: a rank holds only its shard (update and write_master
        write the copy themselves)."""
        raise InvariantError("refresh_lowp on a sharded host state (each rank holds only its shard of the "
                             "masters): a bug in offload, please report it")

    # -- reads and writes of whole parameters (collective where another rank owns part: see the Note) ----------

    def has_master(self, p: int) -> bool:
        """False for a frozen parameter kept only as its device-dtype copy (16-bit devices)."""
        return self.specs[p].group is not None or self.device_dtype == torch.float32

    def _gathered(self, region: str, b: int) -> torch.Tensor:
        """Bucket ``b``'s ``region`` ("master", "exp_avg", "exp_avg_sq") over its whole trainable prefix, in
        fp32 (a collective: every rank must ask for the same regions in the same order)."""
        key = (region, b)
        if key not in self._full:
            shard = self.shards[b]
            mine = getattr(self, region)[b]
            if region == "master" and self.device_dtype == torch.float32:  # a view of the copy: pad it
                mine = torch.cat([mine, mine.new_zeros(shard.size - mine.numel())])
            self._full[key] = self._gather(mine.contiguous())[: self.buckets[b].trainable_numel]
        return self._full[key]

    def param_master(self, p: int) -> torch.Tensor:
        """Parameter ``p``'s fp32 master (a copy gathered from the ranks that own it)."""
        off = self.offset[p]
        return self._gathered("master", self.bucket_of[p])[off: off + self.specs[p].numel]

    def read_param(self, p: int) -> torch.Tensor:
        off, b = self.offset[p], self.bucket_of[p]
        if self.device_dtype == torch.float32:  # every rank holds the full fp32 copy
            return self.lowp[b][off: off + self.specs[p].numel].clone()
        if not self.has_master(p):
            return self.lowp[b][off: off + self.specs[p].numel].float()
        return self.param_master(p).clone()

    def write_master(self, p: int, value: torch.Tensor) -> None:
        """Every rank passes the whole value: each keeps its shard of the master and the whole copy (of a copy
        shared by the node, the elements it writes: :meth:`writes`)."""
        b, off, numel = self.bucket_of[p], self.offset[p], self.specs[p].numel
        flat = value.reshape(-1)
        for lo, hi in self.writes(b, off, off + numel):
            self.lowp[b][lo:hi].copy_(flat[lo - off: hi - off])
        if self.device_dtype != torch.float32 and self.specs[p].group is not None:
            s = self.shards[b]
            lo, hi = max(off, s.start), min(off + numel, s.end)
            if lo < hi:
                self.master[b][lo - s.start: hi - s.start].copy_(flat[lo - off: hi - off])
        self._full.pop(("master", b), None)

    def writes(self, b: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """The parts of bucket ``b``'s elements ``[lo, hi)`` this rank writes in the device-dtype copy: all of
        them in its own copy; in the node's ([Note: one host copy per node]) the shards of its column of the
        trainable prefix (its own alone, on one host: [Note: one host copy per host] in node_copy.py), and its
        host's lowest rank the elements past it."""
        if self.node_copy is None:
            return [(lo, hi)]
        hosts, n = self.node_copy.hosts, self.buckets[b].trainable_numel
        shards = [shard_of(n, r, self.world) for r in hosts.column]
        owned = [(max(lo, s.start), min(hi, s.end)) for s in shards]
        if self.rank == hosts.leader:
            owned.append((max(lo, n), hi))
        return [(a, e) for a, e in owned if a < e]

    def param_state(self, p: int, which: str) -> torch.Tensor:
        off = self.offset[p]
        return self._gathered(which, self.bucket_of[p])[off: off + self.specs[p].numel].view(self.shapes[p])

    def exact(self, region: str, b: int, start: int, numel: int) -> torch.Tensor:
        """As HostState.exact, for checkpoints: here a gathered copy (collective), not an alias of the arena."""
        return self._gathered(region, b)[start: start + numel].clone()

    def write_state(self, p: int, which: str, value: torch.Tensor) -> None:
        """Set this rank's part of parameter ``p``'s Adam ``which`` from its whole value."""
        b, off, numel = self.bucket_of[p], self.offset[p], self.specs[p].numel
        s = self.shards[b]
        lo, hi = max(off, s.start), min(off + numel, s.end)
        if lo < hi:
            getattr(self, which)[b][lo - s.start: hi - s.start].copy_(value.reshape(-1)[lo - off: hi - off])
        self._full.pop((which, b), None)

    # -- the update ----------------------------------------------------------------------------------------

    def update(self, b: int, params: frozenset, hparams, grad_factors: Sequence[float] = (),
               grads: torch.Tensor | None = None) -> None:
        """AdamW of this rank's shard of bucket ``b`` from ``grad_shard[b]`` (the sum over ranks: scaled by
        ``1 / world`` first, then ``grad_factors`` as HostState.update); writes the shard of the device copy,
        which the runtime then all-gathers. Step counts advance for every parameter in ``params``, owned or
        not, so that every rank agrees on them. ``grads`` (where the copy landed) is not read: the
        reduce-scatter of it into ``grad_shard`` is."""
        bucket, s = self.buckets[b], self.shards[b]
        master, grad, m, v = self.master[b], self.grad_shard[b], self.exp_avg[b], self.exp_avg_sq[b]
        lowp = self.lowp[b] if self.device_dtype != torch.float32 else None
        factors = (1.0 / self.world, *grad_factors)
        scale = 1.0
        for f in factors:
            scale *= f

        def one(lo: int, hi: int, step: int, hp: dict) -> None:  # [lo, hi): bucket offsets inside the shard
            a, e = lo - s.start, hi - s.start
            if self.fused:
                found_inf = adamw_step_unchecked(master[a:e], grad[a:e], m[a:e], v[a:e], step=step, **hp,
                                                 grad_scale=scale, lowp_out=None if lowp is None else lowp[lo:hi],
                                                 check_finite=self.check_finite)
                if found_inf:
                    self._inf_error(b)
                return
            g = grad[a:e] if grad.dtype == torch.float32 else grad[a:e].float()
            if self.check_finite and not bool(torch.isfinite(g).all()):
                self._inf_error(b)
            for f in factors:
                if f != 1.0:
                    g.mul_(f)
            adamw_(master[a:e], g, m[a:e], v[a:e], step, **hp)
            if lowp is not None:
                lowp[lo:hi].copy_(master[a:e])

        for run in bucket.runs:
            lr, b1, b2, eps, wd = hparams[run.group]
            hp = dict(lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd)
            steps = {self.steps[p] for p in run.params}
            if params.issuperset(run.params) and len(steps) == 1:
                pieces = [(run.start, run.end, steps.pop() + 1, run.params)]
            else:
                pieces = [(self.offset[p], self.offset[p] + self.specs[p].numel, self.steps[p] + 1, (p,))
                          for p in run.params if p in params]
            for lo, hi, step, counted in pieces:
                lo, hi = max(lo, s.start), min(hi, s.end)
                if lo < hi:
                    one(lo, hi, step, hp)
                self._count(counted)
        for region in ("master", "exp_avg", "exp_avg_sq"):
            self._full.pop((region, b), None)

    def shard_of_copy(self, b: int) -> torch.Tensor:
        """This rank's updated elements of bucket ``b``'s device copy, padded to the shard size (what the
        runtime all-gathers)."""
        s = self.shards[b]
        mine = self.lowp[b][s.start: s.end]
        if mine.numel() == s.size:
            return mine.clone()
        return torch.cat([mine, mine.new_zeros(s.size - mine.numel())])

    def take_gathered_copy(self, b: int, full: torch.Tensor) -> None:
        """Every rank's updated shard of bucket ``b``'s device copy, concatenated: into the copy."""
        self.take_copy_shards(b, full, range(self.world))

    def take_copy_shards(self, b: int, full: torch.Tensor, ranks: Sequence[int]) -> None:
        """The updated shards of bucket ``b``'s device copy of ``ranks`` (each padded to the shard size),
        concatenated: into the copy, but for this rank's own (its update wrote it). ``ranks``: every rank
        (this rank's own copy) or its column ([Note: one host copy per host] in node_copy.py)."""
        n, size = self.buckets[b].trainable_numel, self.shards[b].size
        for k, r in enumerate(ranks):
            s = shard_of(n, r, self.world)
            if r != self.rank and s.numel:
                self.lowp[b][s.start: s.end].copy_(full[k * size: k * size + s.numel])

    # -- the local grads (as HostState) ------------------------------------------------------------------

    def grad_norms(self, b: int, params, ord: float = 2.0) -> dict[int, torch.Tensor]:
        """Norms of this rank's own (not yet summed) grads: for the accumulation bookkeeping only; the
        runtime replaces them by the norms over every rank before it clips or checks for overflow."""
        grad = self.landed(b)
        wide = None if grad.dtype == torch.float32 else torch.float32
        return {p: torch.linalg.vector_norm(grad[self.offset[p]: self.offset[p] + self.specs[p].numel], ord,
                                            dtype=wide)
                for p in params}

    def shard_sq_norms(self, params: Sequence[int]) -> torch.Tensor:
        """Per parameter, the sum of squares (fp64) of this rank's part of its summed grad (``grad_shard``)."""
        out = torch.zeros(len(params), dtype=torch.float64)
        for i, p in enumerate(params):
            b, off, numel = self.bucket_of[p], self.offset[p], self.specs[p].numel
            s = self.shards[b]
            lo, hi = max(off, s.start), min(off + numel, s.end)
            if lo < hi:
                out[i] = torch.linalg.vector_norm(self.grad_shard[b][lo - s.start: hi - s.start],
                                                  dtype=torch.float64) ** 2
        return out

    def chunks(self, b: int, first: bool) -> list[tuple[int, int]]:
        """One piece, the whole bucket: a rank has no ring to send pieces through."""
        return [(0, self.buckets[b].trainable_numel)]

    def landing(self, b: int, first: bool, lo: int = 0, hi: int | None = None) -> Landing:
        """The bucket's own padded grad (the reduce-scatter's input) or staging copy: a rank keeps no grad
        ring ([Note: grad staging ring] in ``buckets.py``: ``ring=0``), so no slot is lent."""
        if first and self.landed(b).dtype == self.device_dtype:
            return Landing(self.landed(b), None, ())
        if self.staging is None:
            raise InvariantError("gradient accumulation needs the host's fp32 sum and staging copy, which this "
                                 "engine was not built with: a bug in offload, please report it")
        return Landing(self.staging[b], None, ())

    def reset_staging(self) -> None:
        """No ring to forget (see :meth:`landing`)."""

    def take_staged(self, b: int, first: bool, staged: torch.Tensor, lo: int = 0) -> None:
        if self.staging is None or staged is not self.staging[b]:
            raise InvariantError("a sharded host state folds only its own staging copy into the sum: a bug in "
                                 "offload, please report it")
        if first:
            self.landed(b).copy_(staged)
        else:
            self.landed(b).add_(staged)

    def landed(self, b: int, padded: bool = False) -> torch.Tensor:
        """Bucket ``b``'s landing grad: its trainable prefix, or ``padded`` to the shards (the host collectives'
        buffer). There is none where grads are reduced on the device."""
        if self.grad is None or self.grad_padded is None:
            raise InvariantError(f"bucket {b}: the whole grad was asked for on the host, but this rank reduces "
                                 "grads on the device and keeps only its shard there: a bug in offload, please "
                                 "report it")
        return self.grad_padded[b] if padded else self.grad[b]

    @torch.no_grad()
    def adopt_optimizer_state(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
        """Take over Adam state loaded into ``optimizer.state`` (this rank keeps its shard of it). Afterwards
        ``optimizer.state[p]`` holds only ``step``: m and v are spread over the ranks (``Engine.state_dict``
        and checkpoints gather them)."""
        for p, param in enumerate(params):
            if self.specs[p].group is None:
                continue
            old = optimizer.state.get(param, {})
            if "exp_avg" in old:
                self.write_state(p, "exp_avg", old["exp_avg"])
                self.write_state(p, "exp_avg_sq", old["exp_avg_sq"])
            if "step" in old and old["step"] is not self.step_tensor[p]:
                self.steps[p] = int(float(old["step"]))
            self.step_tensor[p].fill_(float(self.steps[p]))
            optimizer.state[param] = {"step": self.step_tensor[p]}
