"""Data parallel, on the simulator of ``offload/planning/data_parallel.py`` (pure): this engine's rank plan
against DeepSpeed ZeRO-Offload's data-parallel rule on the same trace, buckets, hardware and collectives.

* ``greedy``: each rank's plan within its own budget (:func:`~offload.planning.data_parallel.build_rank_plan`),
  grads reduce-scattered per bucket as backward produces them, CPU AdamW on the rank's shard overlapped
  with backward, updated shards gathered before their next use.
* ``zero-offload``: ZeRO-Offload as published (Ren et al., "ZeRO-Offload", USENIX ATC 2021, section 4 and
  its multi-GPU scaling): every fp16 parameter resident on every GPU; grads reduce-scattered during backward
  (ZeRO-2 partitioning) and each rank's partition copied to the host; CPU Adam on the partition after
  backward; each rank copies its updated fp16 partition to the device and the parameters are all-gathered
  before the next forward. Modelled on this engine's buckets and grad points (DeepSpeed's 5e8-element
  reduce bucket is larger), with the same hierarchical collective costs as ``greedy`` (DeepSpeed's
  all-gather is a flat ring over the world: this is kind to it across nodes); its optional one-step
  delayed parameter update (DPU, which changes the maths) is not modelled.
* ``runtime``: what the runtime runs today ([Note: the runtime's data-parallel step],
  ``offload/planning/data_parallel_runtime.py``): each rank's single-GPU plan (the runtime plans each rank
  as one GPU), gloo's collectives and the shard's AdamW one after the other on the CPU lane. Give it a
  cluster with gloo's links (``collectives.gloo_cluster_of``), and the NCCL cluster as ``device`` for what
  runs on CUDA ([Note: the runtime's device reduce-scatter]: grads reduce-scattered on the device, a 1/N
  shard copied, the updated shards all-gathered on the device; planned with the grad slots padded and the
  gather buffers out of the budget); without it, whole buckets are copied and reduce-scattered by gloo (the
  CPU backend's path). ``shared``: the node's ranks share one host copy of the weights, as the runtime does
  by default on one node ([Note: the runtime's shared host copy]: each rank writes its updated shard into
  it, one small check per backward, no all-gather of the weights and no gather buffers on the device).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from ..errors import BudgetTooSmallError
from ..planning.buckets import Bucket
from ..planning.collectives import Cluster
from ..planning.data_parallel import DataParallelResult, build_rank_plan, simulate_data_parallel, simulate_rank_plan
from ..planning.data_parallel_runtime import RuntimePathResult, simulate_runtime_plan, weight_gather_bytes
from ..planning.greedy import Greedy
from ..planning.schedule import build_plan
from ..planning.simulate import Program
from ..runtime.device_collectives import pad_buckets
from .baselines import Case, zero_offload


@dataclass(frozen=True)
class RankResult:
    """One policy's step on one rank of a cluster: the simulation (None: no plan fits the budget) and the
    rank's planned device peak."""

    policy: str
    dp: DataParallelResult | RuntimePathResult | None
    peak_bytes: int
    fits: bool

    @property
    def step_s(self) -> float | None:
        return self.dp.step_s if self.dp is not None else None


def zero_offload_program(case: Case) -> Program:
    """ZeRO-Offload's single-GPU lane program: every bucket resident, the updated ones copied to the device
    at the start of the step, grads to the host at this engine's points, CPU Adam after backward."""
    g = Greedy.of(case.trace, case.buckets, case.itemsize, case.hw, case.compute_s)
    program = g.program(frozenset(range(len(case.buckets))), {})
    return dataclasses.replace(program, adam_after_backward=True)


def zero_offload_data_parallel(case: Case, cluster: Cluster) -> RankResult:
    single = zero_offload(case)  # its device peak: every parameter resident, the grad slots
    dp = simulate_data_parallel(zero_offload_program(case), case.hw, cluster)
    return RankResult("zero-offload", dp, single.peak_bytes, single.fits)


def greedy_data_parallel(case: Case, cluster: Cluster) -> RankResult:
    try:
        plan = build_rank_plan(case.trace, case.buckets, itemsize=case.itemsize, budget_bytes=case.budget_bytes,
                               fixed_bytes=case.fixed_bytes, hw=case.hw, cluster=cluster, compute_s=case.compute_s)
    except BudgetTooSmallError as e:
        return RankResult("greedy", None, e.min_budget_bytes, False)
    return RankResult("greedy", simulate_rank_plan(plan, case.hw, cluster, case.compute_s), plan.peak_bytes, True)


def device_reduce_plan_inputs(buckets: Sequence[Bucket], itemsize: int, world: int,
                              fixed_bytes: int, shared: bool = False) -> tuple[tuple[Bucket, ...], int]:
    """The buckets and fixed bytes the engine plans a rank of ``world`` with where grads are reduced on the
    device ([Note: the runtime's device reduce-scatter]): each grad slot padded to its shards (the runtime's
    own ``pad_buckets``), and, where the weights are gathered on the device (each rank its own host copy:
    ``shared`` False), the gather buffers (:func:`weight_gather_bytes`, device memory outside the arena)
    counted beside ``fixed_bytes``. With the node's shared copy (``shared``) the runtime makes no gather
    buffer ([Note: the runtime's shared host copy]): ``fixed_bytes`` as given."""
    padded = pad_buckets(buckets, world)
    return padded, fixed_bytes + (0 if shared else weight_gather_bytes(padded, itemsize))


def runtime_data_parallel(case: Case, gloo: Cluster, device: Cluster | None = None,
                          shared: bool = False) -> RankResult:
    """The runtime's path on ``gloo`` (a cluster with gloo's links), grads reduced (and, without ``shared``,
    weights gathered) on ``device`` if given: the single-GPU plan within the rank's budget, as
    ``PlanBuilder.build`` makes it (on the device path with the grad slots padded and any gather buffers out of
    the budget: :func:`device_reduce_plan_inputs`), simulated by :func:`simulate_runtime_plan`. ``shared``: each
    node's ranks share one host copy ([Note: the runtime's shared host copy])."""
    buckets, fixed = case.buckets, case.fixed_bytes
    if device is not None and device.world > 1:
        # over several nodes a shared copy still takes its column's shards from the device's all-gather
        buckets, fixed = device_reduce_plan_inputs(buckets, case.itemsize, device.world, fixed,
                                                   shared and device.nodes == 1)
    try:
        plan = build_plan(case.trace, buckets, itemsize=case.itemsize, budget_bytes=case.budget_bytes,
                          fixed_bytes=fixed, hw=case.hw, compute_s=case.compute_s)
    except BudgetTooSmallError as e:
        return RankResult("runtime", None, e.min_budget_bytes, False)
    return RankResult("runtime", simulate_runtime_plan(plan, case.hw, gloo, case.compute_s, device, shared),
                      plan.peak_bytes, True)


POLICIES = {"greedy": greedy_data_parallel, "zero-offload": zero_offload_data_parallel}
