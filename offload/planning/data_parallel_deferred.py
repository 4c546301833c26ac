"""The runtime's deferred data-parallel step as a cost model (pure, issue 20): gradient accumulation,
clipping and float16, where every update waits for ``step()``. The overlapped paths, the results and the
shared host copy are ``data_parallel_runtime.py``'s ([Note: the runtime's data-parallel step], [Note: the
runtime's shared host copy]).

[Note: the runtime's deferred data-parallel step]
With deferred updates (``overlap_optimizer=False``: gradient accumulation, clipping, float16) the runtime
runs a step of ``k`` micro-batches (``micro_batches``), each the single-GPU plan's forward and backward, then
``step()`` ([Note: averaged p.grad] and [Note: no_sync] in ``runtime/distributed.py``; ``runtime/grads.py``'s
``_copy_piece``, ``_accumulate``, ``_step_deferred``). :func:`simulate_runtime_deferred` runs, per rank:

* **Per micro-batch, the single-GPU lanes**: the plan's copies and compute, each bucket's whole grads to
  the host at its grad-copy point, then, on the CPU lane, their host accumulation into the bucket's fp32
  sum (``ShardedHostState.take_staged``): the step's first grads of a 16-bit bucket are widened into it
  (read ``S``, write ``2 S``), fp32 ones land in it (nothing to do); a later micro-batch's are added (read
  the staged ``S``, read and write the sum) and the sum's norms renewed (one more read of it). No AdamW
  runs during backward. Resident buckets are refreshed only at the step's start (``step()`` does it); a
  later micro-batch's forward starts once the previous backward's grad copies are done (``wait_for_copies``).
* **The end of a synced backward** (every backward, or with ``no_sync`` only the last: [Note: no_sync]),
  with several ranks: on the main thread, once the CPU lane drained (the accumulation) and every grad
  copy landed (``average_gathered``), one check all-gather of the bucket set, then per bucket gloo's ring
  all-reduce of its fp32 sum (``4 x`` the trainable elements), its division by ``world`` and the norms'
  read of it (host passes at ``host_bytes_per_s``), one after the other: they are charged to the CPU lane
  (it is idle then) and the next micro-batch's forward (or ``step()``) starts after them.
* **step()**: per bucket, on the CPU lane, the rank's shard of the averaged sum taken locally (no
  reduce-scatter: ``_take_shard``'s copy and scaling of ``S_fp32 / N``), the shard's AdamW at ``1/G`` of
  the node's rate, the all-gather of the 16-bit shards (as the overlapped path's); then the lane drains and
  every rank joins ``agree_replan``'s check all-gather. With one rank: no collective, the AdamW of the
  whole bucket from its sum.

``micro_batches=k, no_sync=True`` is the usual DDP idiom (the first ``k - 1`` backward passes inside
``no_sync``, the last outside: one all-reduce per bucket per step); ``no_sync=False`` all-reduces after every
backward (``k`` per step). ``offload report --gpus N`` shows float16 as ``micro_batches=1`` (one backward per
step, its end all-reduces): the report has no accumulation option.

Simplifications (stated), beyond the previous note's: the updates in ``step()`` run in the order the
grads' copies were issued, not in bucket order (``sorted(pending)``): with several ranks every grad is on
the host and averaged before ``step()``, so the order moves no time; with one rank the runtime's first
update (bucket 0, whose grads land last) waits for the last copy, so its tail may be longer by up to that
copy's landing after compute end; with it, one rank of ``k = 1`` in fp32 (grads land in the sum) is the
single-GPU simulation with AdamW after backward (``Program.adam_after_backward``) bit for bit (tested). The
16-bit widening and the norms are not in the single-GPU simulator (planning does not charge them). The
device-side norms of the first grads (``_slot_norms``), the overflow check and ``clip_grad_norm_`` (no
collective once averaged) are not charged; a step whose last backward ran inside ``no_sync`` (``step()``
then reduce-scatters the local sums) is not modelled; copy credit over ``k > 1`` micro-batches sums each
micro-batch's stalls on the last micro-batch's copy durations.
"""

from __future__ import annotations

from typing import Sequence

from .collectives import Cluster, gloo_all_gather_seconds, gloo_all_reduce_seconds
from .data_parallel import shard
from .data_parallel_runtime import (CHECK_BYTES, RuntimePathResult, gathered_bytes, host_copy_seconds,
                                    rank_lane_inputs, refuse_device_optimizer, shared_copy_on, weights_lane_seconds)
from .greedy import compute_times
from .hw import HardwareModel
from .plan import Plan
from .schedule import program_of
from .simulate import STEP_START, Lanes, Program, add_up


def simulate_runtime_deferred(program: Program, hw: HardwareModel, cluster: Cluster, micro_batches: int = 1,
                              no_sync: bool = False, record: list | None = None,
                              shared: bool = False) -> RuntimePathResult:
    """One rank's step of ``micro_batches`` forward and backward passes of ``program`` (the single-GPU lane
    program the rank runs) and ``step()``, with deferred updates: [Note: the runtime's deferred data-parallel
    step]. ``no_sync``: the first ``micro_batches - 1`` backward passes end inside ``no_sync()`` (no
    collective). ``record`` as :func:`simulate_runtime_path`'s, every micro-batch's work at its time; the CPU
    lane's work recorded as ``"accumulate"`` (copy index), ``"check"`` (-2: a backward's end, -1: ``step()``'s),
    ``"all_reduce"``, ``"take_shard"``, ``"adam"`` and ``"all_gather"`` (copy index; ``"copy_ready"`` in its
    place where ``shared``: [Note: the runtime's shared host copy])."""
    if not (isinstance(micro_batches, int) and micro_batches >= 1):
        raise ValueError(f"micro_batches must be an integer >= 1; got {micro_batches!r}")
    refuse_device_optimizer(program)
    shared = shared_copy_on(shared, cluster)
    lanes = _DeferredLanes(program, hw, cluster, record, shared)
    start = compute_end = ended = 0.0
    for j in range(micro_batches):
        compute_end = lanes.micro_batch(j, start)
        synced = lanes.world > 1 and (not no_sync or j == micro_batches - 1)
        ended = lanes.average(compute_end) if synced else compute_end  # where the backward call returns
        start = max(ended, lanes.d2h_free)  # the next forward waits for this backward's grad copies
    step = lanes.step(compute_end, ended)
    k = micro_batches
    d2h = k * sum(program.d2h_bytes)
    sim = lanes.result(step, add_up(program.compute_s) * k, lanes.h2d_total, d2h)
    return RuntimePathResult(
        sim, cluster.world, lanes.take_busy, lanes.ag_busy, lanes.check_busy, 0,
        gathered_bytes(program.d2h_bytes, cluster, shared), cluster.gpus_per_node * (lanes.h2d_total + d2h),
        deferred=True, micro_batches=k, no_sync=no_sync, all_reduce_busy_s=lanes.ar_busy,
        all_reduce_bytes=lanes.ar_bytes, accumulate_busy_s=lanes.acc_busy, shared=shared)


def simulate_runtime_deferred_plan(plan: Plan, hw: HardwareModel, cluster: Cluster,
                                   compute_s: Sequence[float] | None = None, micro_batches: int = 1,
                                   no_sync: bool = False, shared: bool = False) -> RuntimePathResult:
    """:func:`simulate_runtime_deferred` of a plan's lane program (the single-GPU plan the runtime builds)."""
    return simulate_runtime_deferred(program_of(plan, compute_times(plan.trace, compute_s)), hw, cluster,
                                     micro_batches, no_sync, shared=shared)


class _DeferredLanes(Lanes):
    """One rank's lanes on the runtime's deferred path ([Note: the runtime's deferred data-parallel step]):
    the single-GPU lanes run once per micro-batch (:meth:`micro_batch`, in times relative to its start),
    each grad copy followed by its accumulation on the CPU lane; the ends of synced backward passes
    (:meth:`average`) and ``step()`` (:meth:`step`) in absolute times."""

    def __init__(self, program: Program, hw: HardwareModel, cluster: Cluster, record: list | None,
                 shared: bool = False):
        n_world = cluster.world
        super().__init__(program, *rank_lane_inputs(program, hw, cluster), record)
        self.world, self.micro, self.shared = n_world, 0, shared
        rate = hw.host_bytes_per_s
        sums = [4 * n for n in program.adam_numel]  # the fp32 sum of each copy's bucket
        # the step's first grads: fp32 ones land in the sum, 16-bit ones are widened into it (read S, write 2S)
        self.acc_first = [0.0 if s == w else (s + w) / rate for s, w in zip(program.d2h_bytes, sums)]
        # a later micro-batch's: read the staged S, read and write the sum, read it for the norms
        self.acc_add = [(s + 3 * w) / rate for s, w in zip(program.d2h_bytes, sums)]
        self.check_s = gloo_all_gather_seconds(CHECK_BYTES * n_world, cluster)
        # the all-reduce of the sum, its division by world (read + write), the norms' read of it
        self.ar_s = [gloo_all_reduce_seconds(w, cluster) + host_copy_seconds(w, hw) + w / rate for w in sums]
        self.sum_bytes = sums
        # _take_shard: the shard of the averaged sum copied out and scaled by world (two read + write passes)
        self.take_s = [host_copy_seconds(2 * shard(w, n_world), hw) for w in sums]
        self.ag_s = [weights_lane_seconds(s, hw, cluster, shared) for s in program.d2h_bytes]
        self.ready = [0.0] * len(program.d2h_bytes)  # per grad copy: when its sum is up to date (absolute)
        self.stall_sum = [0.0] * len(program.compute_s)
        self.h2d_total = 0
        self.take_busy = self.ag_busy = self.check_busy = self.ar_busy = self.acc_busy = 0.0
        self.ar_bytes = 0

    def micro_batch(self, j: int, start: float) -> float:
        """Micro-batch ``j``'s forward and backward from ``start``: returns when its compute ends."""
        self.micro = j
        self.h2d_free -= start
        self.d2h_free -= start
        self.cpu_free -= start
        mark = len(self.record) if self.record is not None else 0
        end = self.run(self.program.compute_s) + start
        self.h2d_free += start
        self.d2h_free += start
        self.cpu_free += start
        self.compute_end = end
        self.ready = [x + start for x in self.ready]
        self.stall_sum = [a + b for a, b in zip(self.stall_sum, self.stall)]
        if self.record is not None:
            self.record[mark:] = [(lane, i, a + start, b + start) for lane, i, a, b in self.record[mark:]]
        return end

    def issue_h2d(self, k: int, now: float) -> None:
        if self.micro and self.program.h2d_event[k] == STEP_START:
            # a resident bucket is refreshed in step() only: later micro-batches find it on the device
            self.h2d_done[k], self.cum[k], self.period_of[k] = -1.0, 1.0, k
            return
        self.h2d_total += self.program.h2d_bytes[k]
        super().issue_h2d(k, now)

    def issue_d2h(self, k: int, now: float) -> None:
        """The whole bucket's grads to the host, then their accumulation into its sum on the CPU lane."""
        start = self.to_host(self.d2h_bytes[k], now)
        self.d2h_done[k] = self.d2h_free
        if self.record is not None:
            self.record.append(("d2h", k, start, self.d2h_free))
        acc = self.acc_add[k] if self.micro else self.acc_first[k]
        if not acc:
            self.ready[k] = self.d2h_free
            return
        self.cpu_free = max(self.cpu_free, self.d2h_free) + acc
        self.ready[k] = self.cpu_free
        self.acc_busy += acc
        if self.record is not None:
            self.record.append(("accumulate", k, self.cpu_free - acc, self.cpu_free))

    def average(self, compute_end: float) -> float:
        """The end of a synced backward ([Note: averaged p.grad]): once the lane drained and every copy
        landed, the check and each bucket's all-reduce, one after the other; returns when they are done."""
        t = max(compute_end, self.cpu_free, self.d2h_free)
        pieces = [("check", -2, self.check_s)] + [("all_reduce", k, s) for k, s in enumerate(self.ar_s)]
        for lane, k, s in pieces:
            if self.record is not None:
                self.record.append((lane, k, t, t + s))
            t += s
        self.check_busy += self.check_s
        self.ar_busy += sum(self.ar_s)
        self.ar_bytes += sum(self.sum_bytes)
        self.cpu_free = t
        return t

    def step(self, compute_end: float, called: float) -> float:
        """``step()``, called at ``called`` (the last backward's end): every bucket's update on the CPU lane
        (with several ranks: its shard taken, AdamW, all-gather), then ``agree_replan``'s check; returns the
        step's end."""
        record, many = self.record, self.world > 1
        for k in range(len(self.ready)):
            adam = self.cpu.adam_seconds(self.adam_numel[k])
            self.adam_total += adam
            # a shared copy is written in place (over several nodes after its column's gather): checked whole
            # once, below ([Note: the runtime's shared host copy])
            gather = self.ag_s[k] if many else 0.0
            take = self.take_s[k] if many else 0.0
            start = max(self.cpu_free, self.ready[k], called)
            self.cpu_free = start + take + adam + gather if many else start + adam
            self.take_busy += take
            self.ag_busy += gather
            if record is not None:
                if many:
                    record.append(("take_shard", k, start, start + take))
                record.append(("adam", k, start + take, start + take + adam))
                if gather:
                    record.append(("all_gather", k, self.cpu_free - gather, self.cpu_free))
        self.stall = self.stall_sum
        end = self.idle_at(compute_end)
        if not many:
            return end
        check_start = max(called, self.cpu_free)
        if self.shared:  # the check that every rank wrote the step's updates, then agree_replan's
            if record is not None:
                record.append(("copy_ready", -1, check_start, check_start + self.check_s))
            self.check_busy += self.check_s
            check_start += self.check_s
        self.check_busy += self.check_s
        if record is not None:
            record.append(("check", -1, check_start, check_start + self.check_s))
        return max(end, check_start + self.check_s)
