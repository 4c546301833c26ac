"""Data parallelism in the cost model (pure, issue 20): the step of one rank of ``N`` when the optimizer
state is partitioned across ranks ZeRO-Offload style, simulated on the lanes of ``simulate.py`` plus a
collective lane, and the host memory that partitioning leaves each rank.

[Note: the data-parallel step]
Every rank runs the same plan (its own device budget; the same trace on its own micro-batch), so one rank's
timeline stands for all (no stragglers). With ``G`` GPUs on each of ``M`` nodes, ``N = G x M``:

* **Ownership.** Each rank owns ``1/N`` of every bucket's trainable prefix: its fp32 master, Adam m and
  v and host grad. The 16-bit copy the device computes with is split ``1/G`` over the node's ranks (one
  copy per node: per node that is 2 B/param, against 14 B/param / M of optimizer state), see
  :func:`host_bytes_per_rank`.
* **The collective lane.** One FIFO queue in issue order, beside compute and the copies: PyTorch's
  ProcessGroupNCCL runs a group's collectives on one internal stream per device, so an all-gather and a
  reduce-scatter of the same group never overlap, and a collective issued behind an all-gather whose
  shard has not landed yet waits for it (head-of-line blocking; two groups would lift it, at the price of
  sharing the links: not modelled).
* **Backward.** When a bucket's last grad is produced (the single-GPU plan's grad-copy point), its grad
  slot is reduce-scattered over all ranks on the collective lane (overlapped with the rest of backward),
  then the rank's ``1/N`` shard goes to the host on the device-to-host lane, and the CPU AdamW updates that
  shard. The ``G`` ranks of a node share its CPU: each rank's CPU lane runs at ``1/G`` of the node's AdamW
  throughput (the hardware model's figure, the same host as one GPU's), so a node spends the CPU time of
  one GPU on ``1/M`` of the model.
* **Forward (and backward refetches).** Every host-to-device copy of the plan becomes a copy of a shard
  plus an all-gather of the bucket on the collective lane (it starts when the shard has landed; compute
  waits for the all-gather, not the copy). A bucket's first copy in a step after its update gathers the
  ``1/N`` shards over every rank (hierarchically: inter-node, then intra-node); with ``M > 1`` each rank
  then copies its node's ``1/G`` of the new 16-bit weights back to the host (device-to-host lane) when the
  bucket is copied again later in the step, so that later copies gather inside the node only (``1/G``
  copied, intra-node all-gather). With ``M = 1`` the two kinds are the same. Both collectives work in
  place in the plan's buffers (NCCL allows an in-place all-gather and reduce-scatter), so a rank's device
  plan and peak are the single-GPU plan's.
* **One rank** issues no collective: ``N = 1`` is the single-GPU simulation, bit for bit (tested).

Simplifications (stated, not hidden): every rank is as fast as the others; the copies of the ``G`` ranks of
a node run on independent links (one PCIe x16 per GPU) and are not charged for host memory bandwidth, as
the single-GPU model does not charge them either (a node's ranks copy ``1/G`` each, so the node's host
traffic per step is one GPU's); where the collective link is the PCIe link itself
(``Link.shares_host_link``), a collective that starts while either copy lane is busy runs at the hardware's
duplex factor, but copies are not slowed by collectives; sharded copy sizes are whole bytes rounded up
(``ceil(S / N)``), not whole elements. Consequences to read the numbers with: where one GPU's step is
bound by the CPU AdamW, ``G`` GPUs on one node keep that step (the node's CPU does the same work), and
``M`` nodes divide it by ``M`` (each node's CPU updates ``1/M`` of the model): weak-scaling efficiency
above 100 %, bounded by the network's collective time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from .buckets import HOST_ALIGN, Bucket
from .collectives import Cluster, all_gather_seconds, intra_seconds, reduce_scatter_seconds
from .greedy import compute_times
from .hw import PROBE_SIZES, HardwareModel
from .plan import Plan
from .schedule import build_plan, program_of
from .simulate import Lanes, Program, SimResult, add_up
from .trace import Trace


@dataclass(frozen=True)
class DataParallelResult:
    """One rank's simulated step: its lanes (``sim``: per-rank copy bytes, per-rank AdamW seconds) and the
    collective lane's (all-gather and reduce-scatter seconds apart)."""

    sim: SimResult
    world: int
    all_gather_busy_s: float
    reduce_scatter_busy_s: float
    all_gather_bytes: int  # bytes of the buffers gathered (whole buckets), over the step
    reduce_scatter_bytes: int  # bytes of the grad slots reduce-scattered, over the step
    node_copy_bytes: int  # device-to-host bytes of the node's 16-bit shard after a full gather (M > 1)

    @property
    def step_s(self) -> float:
        return self.sim.step_s


def shard(nbytes: int, parts: int) -> int:
    """Bytes of one of ``parts`` equal shards of ``nbytes`` (rounded up)."""
    return -(-nbytes // parts)


def simulate_data_parallel(program: Program, hw: HardwareModel, cluster: Cluster,
                           record: list | None = None) -> DataParallelResult:
    """One rank's step of ``program`` (a single-GPU lane program, e.g. ``schedule.program_of(plan)``) under
    [Note: the data-parallel step]: the lanes of :func:`~offload.planning.simulate.simulate_reference`
    (:class:`~offload.planning.simulate.Lanes`: the same arithmetic in the same order) with a collective
    lane: an all-gather after each host-to-device copy, a reduce-scatter before each device-to-host copy.
    ``record`` gets ``(lane, index, start, end)`` as the reference's does, with lanes ``"all_gather"``,
    ``"reduce_scatter"`` and ``"node_copy"`` added."""
    lanes = _RankLanes(program, hw, cluster, record)
    compute_end = lanes.run(program.compute_s)
    sim = lanes.result(lanes.idle_at(compute_end), add_up(program.compute_s), sum(lanes.h2d_bytes),
                       sum(lanes.d2h_bytes) + sum(lanes.node_copy))
    n_world = cluster.world
    return DataParallelResult(sim, n_world, lanes.ag_busy, lanes.rs_busy,
                              sum(program.h2d_bytes) if n_world > 1 else 0,
                              sum(program.d2h_bytes) if n_world > 1 else 0, sum(lanes.node_copy))


class _RankLanes(Lanes):
    """One rank's lanes: the single-GPU lanes on sharded copies and AdamW, plus the collective lane."""

    def __init__(self, program: Program, hw: HardwareModel, cluster: Cluster, record: list | None):
        n_world, g, m = cluster.world, cluster.gpus_per_node, cluster.nodes
        updated = set(program.d2h_bucket)
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for k, b in enumerate(program.h2d_bucket):
            first.setdefault(b, k)
            last[b] = k
        full = [b in updated and first[b] == k for k, b in enumerate(program.h2d_bucket)]
        self.h2d_bytes = [shard(x, n_world if f else g) for x, f in zip(program.h2d_bytes, full)]
        super().__init__(program, [hw.h2d_seconds(x) for x in self.h2d_bytes],
                         [shard(x, n_world) for x in program.d2h_bytes],
                         [shard(x, n_world) for x in program.adam_numel],
                         hw, hw if g == 1 else hw.with_(adam_params_per_s=hw.adam_params_per_s / g), record)
        self.n_world = n_world
        self.shares = cluster.intra.shares_host_link and n_world > 1
        self.ag_solo = [all_gather_seconds(x, cluster) if f else intra_seconds(x, cluster)
                        for x, f in zip(program.h2d_bytes, full)]
        self.node_copy = [shard(x, g) if f and m > 1 and last[b] > k else 0
                          for k, (x, f, b) in enumerate(zip(program.h2d_bytes, full, program.h2d_bucket))]
        self.rs_solo = [reduce_scatter_seconds(x, cluster) for x in program.d2h_bytes]
        if n_world > 1:  # compute waits for the all-gather, not the copy
            self.arrival = [0.0] * len(self.h2d_solo)
        self.coll_free = self.ag_busy = self.rs_busy = 0.0

    def collective(self, solo: float, start: float) -> float:
        """A collective's seconds: slowed by the duplex factor where it shares a busy PCIe link."""
        return solo / self.duplex if self.shares and (self.h2d_free > start or self.d2h_free > start) else solo

    def issue_h2d(self, k: int, now: float) -> None:
        super().issue_h2d(k, now)
        if self.n_world == 1:  # no collective: the copy is the bucket
            return
        record = self.record
        # the bucket's all-gather: queued at issue, starts once this rank's shard has landed
        a_start = max(now, self.coll_free, self.h2d_done[k])
        a_dur = self.collective(self.ag_solo[k], a_start)
        self.coll_free = a_start + a_dur
        self.arrival[k] = self.coll_free
        self.ag_busy += a_dur
        if record is not None:
            record.append(("all_gather", k, a_start, self.coll_free))
        if self.node_copy[k]:
            s = self.to_host(self.node_copy[k], self.arrival[k])
            if record is not None:
                record.append(("node_copy", k, s, self.d2h_free))

    def issue_d2h(self, k: int, now: float) -> None:
        ready = now
        if self.n_world > 1:  # the grads' reduce-scatter first, behind the collectives issued before it
            r_start = max(now, self.coll_free)
            r_dur = self.collective(self.rs_solo[k], r_start)
            self.coll_free = ready = r_start + r_dur
            self.rs_busy += r_dur
            if self.record is not None:
                self.record.append(("reduce_scatter", k, r_start, self.coll_free))
        super().issue_d2h(k, ready)

    def idle_at(self, compute_end: float) -> float:
        return max(super().idle_at(compute_end), self.coll_free)


def planning_hw(hw: HardwareModel, cluster: Cluster) -> HardwareModel:
    """The single-GPU hardware model the greedy scheduler plans one rank with: a host-to-device copy of
    ``S`` bytes takes a shard's copy plus the all-gather (``h2d(S / N) + AG(S)``), a device-to-host copy
    the reduce-scatter plus a shard's copy, and the CPU AdamW of a bucket the rank's share of the node's CPU
    on its shard (``S / (M x rate)``). Conservative: copies and collectives run on separate lanes and
    overlap across buckets in :func:`simulate_data_parallel`. ``hw`` itself for one rank."""
    n_world = cluster.world
    if n_world == 1:
        return hw
    h2d = tuple((x, x / (hw.h2d_seconds(shard(x, n_world)) + all_gather_seconds(x, cluster))) for x in PROBE_SIZES)
    d2h = tuple((x, x / (reduce_scatter_seconds(x, cluster) + hw.d2h_seconds(shard(x, n_world))))
                for x in PROBE_SIZES)
    return dataclasses.replace(hw, name=f"{hw.name} / rank of {cluster.describe()}", h2d=h2d, d2h=d2h,
                               adam_params_per_s=hw.adam_params_per_s * cluster.nodes,
                               notes=f"per-rank planning view of {hw.name} (copies with their collectives)")


def build_rank_plan(trace: Trace, buckets: Sequence[Bucket], *, itemsize: int, budget_bytes: int,
                    fixed_bytes: int, hw: HardwareModel, cluster: Cluster,
                    compute_s: Sequence[float] | None = None, headroom_bytes: int = 0) -> Plan:
    """One rank's plan: :func:`~offload.planning.schedule.build_plan` within the rank's own budget, with
    the copies costed as the data-parallel step makes them (:func:`planning_hw`). The same plan as one GPU's
    for one rank."""
    return build_plan(trace, buckets, itemsize=itemsize, budget_bytes=budget_bytes, fixed_bytes=fixed_bytes,
                      hw=planning_hw(hw, cluster), compute_s=compute_s, headroom_bytes=headroom_bytes)


def simulate_rank_plan(plan: Plan, hw: HardwareModel, cluster: Cluster,
                       compute_s: Sequence[float] | None = None) -> DataParallelResult:
    """:func:`simulate_data_parallel` of a plan's lane program."""
    return simulate_data_parallel(program_of(plan, compute_times(plan.trace, compute_s)), hw, cluster)


def host_bytes_per_rank(buckets: Sequence[Bucket], lowp_itemsize: int, cluster: Cluster,
                        accumulate: bool = False) -> int:
    """Pinned host bytes of one rank: :func:`~offload.planning.buckets.host_layout`'s regions with each
    bucket's trainable regions (fp32 master, grad, staging, m, v) cut to ``1/N`` and its 16-bit copy to
    ``1/G`` (one per node; in fp32 the master is the copy, its frozen part cut to ``1/G``). Equals
    ``host_layout(buckets, lowp_itemsize, accumulate).total_bytes`` for one rank."""
    n_world, g = cluster.world, cluster.gpus_per_node
    device_itemsize = lowp_itemsize or 4
    grad_itemsize = 4 if accumulate else device_itemsize
    staging_itemsize = device_itemsize if accumulate else 0
    total = 0
    for b in buckets:
        t = shard(b.trainable_numel, n_world)
        master = t if lowp_itemsize else t + shard(b.numel - b.trainable_numel, g)
        for nbytes in (master * 4, shard(b.numel, g) * lowp_itemsize, t * grad_itemsize, t * staging_itemsize,
                       t * 4, t * 4):
            total += _host_align(nbytes)
    return total


def host_bytes_per_node(buckets: Sequence[Bucket], lowp_itemsize: int, cluster: Cluster,
                        accumulate: bool = False) -> int:
    """The node's ranks together: ``G x`` :func:`host_bytes_per_rank`."""
    return cluster.gpus_per_node * host_bytes_per_rank(buckets, lowp_itemsize, cluster, accumulate)


def _host_align(n: int) -> int:
    return (n + HOST_ALIGN - 1) // HOST_ALIGN * HOST_ALIGN
