"""The data path the runtime runs, as a cost model (pure, issue 20): one rank's step when every collective
runs on the host, through gloo, on the rank's CPU lane (``offload/runtime/distributed.py``,
``offload/host/shard.py``), or, with ``grad_reduce="device"``, when the grads' reduce-scatters and the
weights' all-gathers run on the device ([Note: the runtime's device reduce-scatter]). The design the issue
asks the runtime to become is the other model, ``data_parallel.py`` ([Note: the data-parallel step]); this
one is ``path="runtime"``, that one ``path="design"``.

[Note: the runtime's data-parallel step]
Every rank runs the single-GPU plan (the runtime plans each rank as one GPU: ``PlanBuilder.build``), on its own
micro-batch, so one rank's timeline stands for all (no stragglers). With ``G`` ranks on each of ``M``
nodes, ``N = G x M``, per bucket of ``S`` grad bytes (the device dtype: the overlapped path, where the grads
land in the device dtype):

* **Device to host: the whole bucket.** At the single-GPU plan's grad-copy point the whole bucket's grads
  go to the host on the device-to-host lane, as on one GPU (no device reduce-scatter, no shard).
* **Then, on the CPU lane, one thread, in submission order** ([Note: collectives on one thread]): nothing on
  it overlaps, so per bucket it runs, one after the other, once the grads have landed and the lane is free:

  1. the bucket check: a gloo all-gather of 4 int64 per rank (``DataParallel._check_same_bucket``);
  2. the reduce-scatter: on gloo an all-reduce of a clone of the whole ``S`` bytes ([Note: gloo's
     collectives]), plus the clone and the copy of the rank's ``S / N`` out;
  3. the AdamW of the rank's ``1/N`` shard, at ``1/G`` of the node's AdamW rate (the node's ``G`` ranks
     share its cores, as the design model has it);
  4. the all-gather of the updated 16-bit shards into the rank's *whole* host copy: the shard's clone
     (``S / N``), gloo's ring all-gather of ``S`` bytes, PyTorch's copy of the flat output into place
     (``S``) and ``take_gathered_copy``'s copy into the host copy (``S``).

  Host copies are charged at ``hw.host_bytes_per_s`` (read + write: ``2 x bytes / rate``).
* **Host to device: the whole bucket, after the all-gather.** Every copy is the single-GPU plan's, of the
  whole bucket from the rank's whole host copy; a bucket's copy issued after its update in the same step
  waits for its all-gather (the update's event). ``step()`` drains the CPU lane, then every rank joins
  one more check all-gather (``DataParallel.agree_replan``): the step ends there, and the next step's
  copies start after it.
* **One rank** runs no collective: ``N = 1`` is the single-GPU simulation, bit for bit (tested).

Host bytes per rank are the runtime's (``offload.tools.report_dp.runtime_host_bytes_per_rank``: the whole
16-bit copy and landing grad on every rank, ``1/N`` of the master, m, v and summed grad), not
``data_parallel.host_bytes_per_rank`` (the design's).

Simplifications (stated): the ``G`` ranks' copies run on independent PCIe links and are not charged for host
memory bandwidth, although each rank copies the *whole* model each way (a node's host copy traffic is ``G``
times one GPU's: :attr:`RuntimePathResult.node_host_copy_bytes` says how much, to set against the host's
bandwidth); gloo's reductions and TCP stacks take no cores from the AdamW; the shard padding
(``SHARD_ALIGN`` elements per rank) is left out of the collectives' bytes; device-optimizer buckets and
programs whose AdamW waits for the end of backward are not modelled on this path (refused); the deferred
path is the next note's (:func:`simulate_runtime_deferred`).

[Note: the runtime's device reduce-scatter]
With ``grad_reduce="device"`` (the runtime's default on CUDA with overlapped updates: [Note: grads reduced on
the device] in ``runtime/device_collectives.py``), :func:`simulate_runtime_path` given ``device`` (the NCCL
cluster, ``collectives.cluster_of``) runs both halves on the device. Per bucket of ``S`` grad bytes (the
device dtype's trainable prefix; the padded slot where the plan's buckets are padded to their shards, as the
engine plans them), at the single-GPU plan's grad-copy point instead of the whole bucket's copy:

1. the reduce-scatter of the slot on the device, on the collective lane, after the grads are final
   (``collectives.reduce_scatter_seconds`` of ``S`` on the NCCL links);
2. the device-to-host copy of this rank's shard only (``S / N`` bytes), on the device-to-host lane after it;
   the grad slot's reuse waits for this copy (the plan's grad waits);
3. on the CPU lane, once the shard landed: the shard's AdamW (as above), and nothing else: no gloo
   collective, no check, no copy of a gather on the lane.

Then the weights' half ([Note: weights gathered on the device] in ``runtime/device_collectives.py``), issued
by the CPU lane when that AdamW ends, bucket after bucket in the lane's order (the same on every rank):

4. the host-to-device copy of this rank's updated shard (``S / N``) on the host-to-device lane into its chunk
   of gather buffer ``r mod WEIGHT_GATHER_BUFFERS`` (``r``: the bucket's turn in the lane's order), after the
   copy back of that buffer's previous use;
5. the all-gather in place in that buffer, on the collective lane, after that copy
   (``collectives.all_gather_seconds`` of ``S``: intra-node, and inter-node where the cluster has nodes);
6. the device-to-host copy of the gathered ``S`` bytes into the rank's whole host copy, on the
   device-to-host lane, after it. The bucket's next host-to-device copy (a later one in this step, or the
   next step's) waits for it, as a copy waits for the update's event on the host path.

Then, at the start of the step, each resident bucket updated in the step before ([Note: resident weights
gathered in their slots] in ``runtime/device_collectives.py``; the program's ``STEP_START`` copies of updated
buckets), where the node has ``G > 1`` ranks:

7. the host-to-device copy of this rank's ``1/G`` chunk of the bucket (``S / G`` bytes, rounded up) into the
   bucket's slot, on the host-to-device lane, in the plan's order;
8. the all-gather of the slot over the node's ``G`` ranks, on the collective lane after that copy
   (``collectives.intra_seconds`` of the bucket's bytes: NVLink, never the network); compute waits for it,
   not for the copy. Recorded as ``"refresh_gather"``; its seconds in ``refresh_gather_busy_s``.

and ``step()`` joins one more check (``DataParallel.agree_refresh``: every rank gathers the same buckets)
after the re-plan's. With one GPU per node the buckets are copied whole, as on one GPU.

Every lane is one queue in issue order, as a CUDA stream is: the weights' three pieces are queued when the
AdamW ends, behind what the main thread issued before (prefetches, reduce-scatters, grads' shards) and ahead
of what it issues after, and a piece waiting at the head of its lane (for its buffer, its copy, its gather)
holds the lane's later work behind it. The reduce-scatters and the all-gathers share the one collective lane.
``step()``'s check runs once the CPU lane drained (the pieces issued); the step ends when every lane is idle.
The plan a rank runs is planned with the gather buffers (:func:`weight_gather_bytes`) as fixed bytes and the
grad slots padded to their shards (``tools.baselines_dp.device_reduce_plan_inputs``, what the engine does).

Simplifications (stated), beyond the first note's: the per-bucket check runs on the main thread's host side
(a gloo all-gather of 4 int64 before the reduce-scatter is issued) and is not charged (on CUDA the host runs
ahead of the device); NCCL's kernels take no SMs from compute and its NVLink or network traffic does not
share the PCIe link with the copies (the PCIe peer-to-peer presets' ``shares_host_link`` is not applied
here); the copy lanes keep the single-GPU plan's duplex factor; the copy back of step 6 is of the padded
slot (at most ``SHARD_ALIGN x N`` elements more than the prefix); a refreshed bucket's tail (under
``REFRESH_ALIGN x G`` elements, copied whole beside the chunk) is left out of step 7's bytes; a plan copy of a bucket whose weights'
pieces are not issued yet is queued once they are (the main thread waits for the update), so lane work the
main thread issues in between is queued behind it; ``copy_credit`` counts the plan's copies only (the
shards' copies hold the lane but take no credit).

[Note: the runtime's deferred data-parallel step] (accumulation, clipping, float16) is in
``data_parallel_deferred.py``, with :func:`~offload.planning.data_parallel_deferred.simulate_runtime_deferred`.

[Note: the runtime's shared host copy]
Where every rank of the group runs on one node, the runtime keeps ONE device-dtype host copy of the weights
for the node ([Note: one host copy per node] in ``host/node_copy.py``; ``OffloadConfig.share_host_copy``,
None by default: shared where possible). Each rank's AdamW writes its shard's updated device-dtype elements
straight into it (the kernel writes the 16-bit copy in the same pass: no copy more), so nothing of the
weights is gathered, on the host or on the device. ``shared=True`` (one node, several ranks) models it on
every path above; per bucket, on the CPU lane, in place of the weights' half, nothing:

* **host grads** (the first note): the check and the reduce-scatter, the shard's AdamW; no gloo all-gather
  of the weights, no copies of it;
* **device grads** (the device note): the reduce-scatter on the device and the shard's copy to the host as
  there, the shard's AdamW; no shard copied to the device, no all-gather on the device, no gathered copy
  back, and no gather buffers on the device (the plan's fixed bytes do not hold ``weight_gather_bytes``:
  ``tools.baselines_dp.device_reduce_plan_inputs(..., shared=True)``; the grad slots are still padded to
  their shards);
* **deferred** ([Note: the runtime's deferred data-parallel step], ``data_parallel_deferred.py``): in
  ``step()``, per bucket, the shard taken from the averaged sum and its AdamW, in place of the all-gather.

Then ONE check that every rank wrote its shards ([Note: the shared copy checked once per backward] in
``runtime/node_share.py``, ``DataParallel.check_copies``): a gloo all-gather of ``CHECK_BYTES`` per rank
(``gloo_all_gather_seconds`` on the gloo links), on the main thread once the CPU lane drained, at the end of
backward (the overlapped paths: at compute's end, before ``step()``'s checks) or after ``step()``'s updates
(deferred: before its check); recorded as ``("copy_ready", -1, ...)``, the lane idle meanwhile. Every bucket
updated is whole (``gathered_at``) when it ends, and the next step's copies come after it. A host-to-device
copy in the same step of a bucket updated earlier in it forces the check of what is written so far when it
is issued (recorded as ``("copy_ready", k, ...)``, ``k`` that copy) and waits for it, as it waited for the
all-gather. Until 2026-11-27 the runtime checked each bucket on its own, on the CPU lane after its AdamW
(one ``CHECK_BYTES`` all-gather per bucket; ``benchmarks/results/cpu-2026-11-27/scaling_sim_shared.json``
was simulated so). One rank shares nothing: ``N = 1`` is the single-GPU simulation whatever ``shared``
says (tested); nor does one GPU per node (each rank keeps its own copy, as the runtime does).

Over ``M > 1`` nodes of ``G > 1`` GPUs each node keeps one copy ([Note: one host copy per host] in
``host/node_copy.py``): the optimizer state stays partitioned over all ``N`` ranks, so after its AdamW a rank
brings its *column*'s other ``M - 1`` shards (its local rank on every other node) into its node's copy:

* **host grads, deferred**: on the CPU lane after the AdamW, gloo's ring all-gather over the column's ``M``
  ranks (one per node: every hop crosses nodes), the node's ``G`` columns at once charged as sharing one gloo
  stream between nodes (each ring step moves ``G`` shards, ``S / M`` bytes: conservative, ``G`` TCP streams
  may go faster up to the NIC), plus the shard's clone (``S / N``), PyTorch's copy of the flat output
  (``S / G``) and ``take_copy_shards``'s copy of the ``M - 1`` shards (:func:`column_gather_lane_seconds`),
  recorded as ``"all_gather"``;
* **device grads**: the weights' three pieces as with a copy per rank (the shard up, the all-gather over
  every rank, with its gather buffers in the budget), but the copy back brings only the column's ``M - 1``
  shards (``(M - 1) / N`` of ``S``) into the node's copy.

The bucket is then checked whole with the others (the check waits for the CPU lane and, on the device path,
for the last copy back), as on one node; the check stays one all-gather over every rank.

Simplifications (stated), beyond the previous notes': the ranks' reads of the one copy by their
host-to-device copies (``G`` GPUs reading the same pages) are not charged for host memory bandwidth, as the
per-rank copies' were not; the main thread's wait for the check holds no compute back in the model (on CUDA
the host issues the next kernels after it; compute waits for the copies anyway).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Sequence

from .buckets import Bucket
from .collectives import (Cluster, all_gather_seconds, gloo_all_gather_seconds, gloo_reduce_scatter_seconds,
                          intra_seconds, reduce_scatter_seconds)
from .data_parallel import shard
from .greedy import compute_times
from .hw import HardwareModel
from .plan import Plan
from .schedule import program_of
from .simulate import STEP_START, Lanes, Program, SimResult, add_up

PATHS = ("runtime", "design")
"""The two data-parallel cost models: what the runtime runs (this module), what issue 20 designs
(``data_parallel.py``)."""

CHECK_BYTES = 4 * 8  # the tag each rank sends in a check all-gather: 4 int64 (distributed.py's _TAG)

WEIGHT_GATHER_BUFFERS = 2
"""Device buffers the updated weights' all-gathers take turns in (``grad_reduce="device"``: [Note: weights
gathered on the device] in runtime/device_collectives.py): one bucket's copy back to the host overlaps the
next bucket's shard copy and all-gather."""


def weight_gather_bytes(buckets: Sequence[Bucket], itemsize: int) -> int:
    """Device bytes of the weights' gather buffers, outside the plan's arena and inside the budget:
    :data:`WEIGHT_GATHER_BUFFERS` of the largest padded trainable prefix (``Bucket.grad_numel``: the buckets
    are padded to their shards where grads are reduced on the device) in the device dtype."""
    largest = max((b.grad_numel for b in buckets if b.trainable_numel), default=0)
    return WEIGHT_GATHER_BUFFERS * largest * itemsize


@dataclass(frozen=True)
class RuntimePathResult:
    """One rank's simulated step on the runtime's path: its lanes (``sim``: whole-bucket copies, the
    AdamW seconds of its shard in ``adam_s``) and the CPU lane's collective seconds."""

    sim: SimResult
    world: int
    reduce_scatter_busy_s: float  # the CPU lane in reduce-scatters (gloo: all-reduces) and their copies
    all_gather_busy_s: float  # ... in all-gathers of the updated shards and their copies
    check_busy_s: float  # ... in the check all-gathers (one per bucket's sum, the shared copy's, step()'s)
    reduce_scatter_bytes: int  # bytes of the grad buffers reduce-scattered, over the step
    all_gather_bytes: int  # bytes of the copies gathered, over the step
    node_host_copy_bytes: int  # host <-> device bytes of the node's G ranks together, over the step
    path: str = "runtime"
    # the deferred path ([Note: the runtime's deferred data-parallel step]; reduce_scatter_busy_s is then the
    # shards taken locally from the averaged sums, reduce_scatter_bytes 0: no reduce-scatter runs)
    deferred: bool = False
    micro_batches: int = 1
    no_sync: bool = False  # the first micro_batches - 1 backward passes inside no_sync()
    all_reduce_busy_s: float = 0.0  # the ends of synced backward passes: all-reduces, divisions, norms' reads
    all_reduce_bytes: int = 0  # bytes of the fp32 sums all-reduced, over the step
    accumulate_busy_s: float = 0.0  # the CPU lane widening or adding each backward's grads into the sums
    # [Note: the runtime's device reduce-scatter]: the collective lane busy in the grads' reduce-scatters and
    # in the weights' all-gathers (then reduce_scatter_busy_s and all_gather_busy_s, the CPU lane's, are 0)
    grad_reduce: str = "host"
    device_reduce_busy_s: float = 0.0
    device_gather_busy_s: float = 0.0
    # [Note: the runtime's shared host copy]: one copy per node, one check of it instead of the gathers
    # (check_busy_s counts it)
    shared: bool = False
    # [Note: resident weights gathered in their slots]: the collective lane in the resident buckets' refreshes
    refresh_gather_busy_s: float = 0.0

    @property
    def host_copy(self) -> str:
        """``"shared"`` (one copy per node) or ``"per rank"``."""
        return "shared" if self.shared else "per rank"

    @property
    def step_s(self) -> float:
        return self.sim.step_s

    @property
    def cpu_lane_busy_s(self) -> float:
        """Everything the CPU lane ran: collectives, their copies and the shard's AdamW."""
        return (self.reduce_scatter_busy_s + self.all_gather_busy_s + self.check_busy_s + self.sim.adam_s
                + self.all_reduce_busy_s + self.accumulate_busy_s)


def simulate_runtime_path(program: Program, hw: HardwareModel, cluster: Cluster,
                          record: list | None = None, device: Cluster | None = None,
                          shared: bool = False) -> RuntimePathResult:
    """One rank's step of ``program`` (the single-GPU lane program the rank runs) under [Note: the runtime's
    data-parallel step], on ``cluster``'s gloo links (``collectives.gloo_cluster_of``). ``record`` gets
    ``(lane, index, start, end)`` as :func:`~offload.planning.simulate.simulate_reference`'s does; on the
    CPU lane each bucket's work is recorded as ``"reduce_scatter"`` (its check included), ``"adam"`` and
    ``"all_gather"``, and the step's last check as ``("check", -1, ...)``. ``device``: the grads are
    reduce-scattered and the weights all-gathered on the device over that cluster's (NCCL) links ([Note: the
    runtime's device reduce-scatter]; recorded per grad copy as ``"device_reduce_scatter"``, the grads' shard
    copy ``"d2h"``, ``"adam"``, the weights' shard copy ``"h2d_shard"``, ``"device_all_gather"`` and the
    gathered copy back ``"d2h_gathered"``). ``shared``: the node's ranks share one host copy ([Note: the
    runtime's shared host copy]): no gather of the weights (gloo's, or the device's three pieces), one check of
    the buckets written at the end of backward, recorded as ``("copy_ready", -1, ...)`` (or earlier, forced by
    a copy ``k`` of one: ``("copy_ready", k, ...)``)."""
    _refuse_unmodelled(program)
    shared = shared_copy_on(shared, cluster)
    on_device = device is not None and cluster.world > 1
    if device is not None and device.world != cluster.world:
        raise ValueError(f"the device cluster has {device.world} ranks and the gloo one {cluster.world}")
    lanes = (_DeviceReduceLanes(program, hw, cluster, record, device, shared) if on_device and device is not None
             else _RuntimeLanes(program, hw, cluster, record, shared))
    compute_end = lanes.run(program.compute_s)
    step = lanes.step_end(compute_end)
    dev = lanes if isinstance(lanes, _DeviceReduceLanes) else None
    d2h = dev.d2h_total if dev is not None else sum(program.d2h_bytes)
    h2d = sum(program.h2d_bytes) + (dev.h2d_extra if dev is not None else 0)
    sim = lanes.result(step, add_up(program.compute_s), h2d, d2h)
    many = cluster.world > 1
    return RuntimePathResult(
        sim, cluster.world, lanes.rs_busy, lanes.ag_busy, lanes.check_busy,
        sum(program.d2h_bytes) if many else 0, gathered_bytes(program.d2h_bytes, cluster, shared),
        cluster.gpus_per_node * (h2d + d2h), grad_reduce="device" if on_device else "host",
        device_reduce_busy_s=dev.coll_busy if dev is not None else 0.0,
        device_gather_busy_s=dev.gather_busy if dev is not None else 0.0, shared=shared,
        refresh_gather_busy_s=dev.refresh_busy if dev is not None else 0.0)


def simulate_runtime_plan(plan: Plan, hw: HardwareModel, cluster: Cluster,
                          compute_s: Sequence[float] | None = None, device: Cluster | None = None,
                          shared: bool = False) -> RuntimePathResult:
    """:func:`simulate_runtime_path` of a plan's lane program (the plan as the runtime builds it: the
    single-GPU plan, ``schedule.build_plan`` on the rank's budget); ``device`` and ``shared`` as there."""
    return simulate_runtime_path(program_of(plan, compute_times(plan.trace, compute_s)), hw, cluster, device=device,
                                 shared=shared)


def reduce_scatter_lane_seconds(nbytes: int, hw: HardwareModel, cluster: Cluster) -> float:
    """The CPU lane's seconds for one bucket's reduce-scatter of ``nbytes`` grad bytes: gloo's all-reduce of
    a clone, the clone and the rank's chunk copied out (host copies: read + write at ``host_bytes_per_s``)."""
    if cluster.world == 1:
        return 0.0
    return gloo_reduce_scatter_seconds(nbytes, cluster) + host_copy_seconds(nbytes + shard(nbytes, cluster.world), hw)


def all_gather_lane_seconds(nbytes: int, hw: HardwareModel, cluster: Cluster) -> float:
    """The CPU lane's seconds for one bucket's all-gather into its ``nbytes`` host copy: the shard's clone,
    gloo's ring all-gather, PyTorch's copy of the flat output into place and ``take_gathered_copy``'s."""
    if cluster.world == 1:
        return 0.0
    return gloo_all_gather_seconds(nbytes, cluster) + host_copy_seconds(shard(nbytes, cluster.world) + 2 * nbytes, hw)


def column_gather_lane_seconds(nbytes: int, hw: HardwareModel, cluster: Cluster) -> float:
    """The CPU lane's seconds for one bucket's all-gather over this rank's column into its node's shared copy
    of ``nbytes`` ([Note: the runtime's shared host copy], several nodes): gloo's ring over the column's ``M``
    ranks, the node's ``G`` columns sharing one stream between nodes (a step moves ``S / M``), the shard's
    clone, PyTorch's copy of the flat output (``S / G``) and the ``M - 1`` other shards into the copy."""
    m, n = cluster.nodes, cluster.world
    if m == 1:
        return 0.0
    column = Cluster(1, m, cluster.intra, cluster.inter)
    return gloo_all_gather_seconds(nbytes, column) + host_copy_seconds(
        shard(nbytes, n) + shard(nbytes, cluster.gpus_per_node) + (m - 1) * shard(nbytes, n), hw)


def weights_lane_seconds(nbytes: int, hw: HardwareModel, cluster: Cluster, shared: bool) -> float:
    """The CPU lane's seconds that bring one bucket's updated weights into this rank's host copy on the host
    path: every rank's shards into its own copy (:func:`all_gather_lane_seconds`), nothing into one node's
    shared copy, the column's into a node's shared copy over several (:func:`column_gather_lane_seconds`)."""
    return column_gather_lane_seconds(nbytes, hw, cluster) if shared else all_gather_lane_seconds(nbytes, hw, cluster)


def gathered_bytes(nbytes: Sequence[int], cluster: Cluster, shared: bool) -> int:
    """The bytes of the weights' all-gathers (their outputs) over a step of buckets of ``nbytes``: every rank's
    shards with a copy per rank, none into one node's shared copy, the column's ``M`` shards (``S / G``) into
    a node's shared copy over several."""
    if cluster.world == 1:
        return 0
    return sum(shard(s, cluster.gpus_per_node) if cluster.nodes > 1 else 0 for s in nbytes) if shared else sum(nbytes)


def shared_copy_on(shared: bool, cluster: Cluster) -> bool:
    """Whether the step runs with one shared copy per node ([Note: the runtime's shared host copy]): never
    with one rank, nor with one GPU per node (nothing to share: each rank keeps its own, as the runtime)."""
    return bool(shared) and cluster.world > 1 and cluster.gpus_per_node > 1


def host_copy_seconds(nbytes: int, hw: HardwareModel) -> float:
    """A host copy of ``nbytes``: read + write at ``hw.host_bytes_per_s``."""
    return 2 * nbytes / hw.host_bytes_per_s


def _refuse_unmodelled(program: Program) -> None:
    if program.adam_after_backward:
        raise ValueError("the runtime's data-parallel path updates each bucket as its grads land (overlapped); "
                         "a program whose AdamW waits for the end of backward is not modelled on it: use "
                         "data_parallel.simulate_data_parallel (path='design')")
    refuse_device_optimizer(program)


def refuse_device_optimizer(program: Program) -> None:
    """Device-optimizer buckets are not modelled on the runtime's data-parallel paths: a ValueError."""
    if any(program.device_adam_numel) or any(program.device_return_bytes):
        raise ValueError("device-optimizer buckets are not modelled on the runtime's data-parallel path")


def rank_lane_inputs(program: Program, hw: HardwareModel, cluster: Cluster) -> tuple[
        list[float], Sequence[int], list[int], HardwareModel, HardwareModel]:
    """What ``Lanes`` takes for one rank of ``cluster`` (after ``program``): the single-GPU copies, the AdamW of
    the rank's shards, on ``1 / G`` of the node's CPU (its ``G`` ranks share it)."""
    g = cluster.gpus_per_node
    return ([hw.h2d_seconds(x) for x in program.h2d_bytes], program.d2h_bytes,
            [shard(x, cluster.world) for x in program.adam_numel],
            hw, hw if g == 1 else hw.with_(adam_params_per_s=hw.adam_params_per_s / g))


class _RuntimeLanes(Lanes):
    """One rank's lanes on the runtime's path: the single-GPU lanes (whole-bucket copies), with each
    bucket's reduce-scatter before, and all-gather after, its shard's AdamW on the CPU lane."""

    def __init__(self, program: Program, hw: HardwareModel, cluster: Cluster, record: list | None,
                 shared: bool = False):
        n_world = cluster.world
        super().__init__(program, *rank_lane_inputs(program, hw, cluster), record)
        self.world = n_world
        # [Note: the runtime's shared host copy]: one check of what was written, no gather (over several
        # nodes the column's)
        self.shared = shared
        self.check_s = gloo_all_gather_seconds(CHECK_BYTES * n_world, cluster)
        self.rs_s = [reduce_scatter_lane_seconds(s, hw, cluster) for s in program.d2h_bytes]
        self.ag_s = [weights_lane_seconds(s, hw, cluster, shared) for s in program.d2h_bytes]
        self.gathered_at: dict[int, float] = {}  # bucket -> when its all-gather ended (its new copy is whole)
        self.unchecked: list[int] = []  # shared: buckets written since the last check that they are whole
        self.written_at = 0.0  # shared, device grads: when the last copy back into the node's copy ends
        self.rs_busy = self.ag_busy = self.check_busy = 0.0
        self.step_checks = 1  # step()'s checks after the lane drained (agree_replan's)

    def issue_h2d(self, k: int, now: float) -> None:
        # a bucket updated earlier in this step is copied from its host copy once the all-gather made it whole,
        # or (shared) once the check of what is written so far, which this read forces, said so
        b = self.program.h2d_bucket[k]
        if b in self.unchecked:
            self.check_copies(now, k)
        ready = self.gathered_at.get(b)
        super().issue_h2d(k, now if ready is None else max(now, ready))

    def check_copies(self, now: float, at: int) -> float:
        """[Note: the runtime's shared host copy]: the check that every rank wrote the buckets written since the
        last one, on the main thread at ``now`` once the CPU lane drained; returns when it ends (the lane is
        idle until then). Recorded as ``("copy_ready", at, ...)``: ``at`` the copy that forced it, -1 the end
        of backward (or ``step()``'s updates)."""
        start = max(now, self.cpu_free, self.written_at)
        self.cpu_free = start + self.check_s
        self.check_busy += self.check_s
        for b in self.unchecked:
            self.gathered_at[b] = self.cpu_free
        self.unchecked = []
        if self.record is not None:
            self.record.append(("copy_ready", at, start, self.cpu_free))
        return self.cpu_free

    def issue_d2h(self, k: int, now: float) -> None:
        record = self.record
        mark = len(record) if record is not None else 0
        super().issue_d2h(k, now)  # the whole bucket's grads to the host, then the shard's AdamW on the CPU lane
        if self.world == 1:  # no collective: the single-GPU step
            return
        # The CPU lane is one thread: where the AdamW started, the check and the reduce-scatter run first,
        # then the AdamW, then the all-gather (with a shared copy only the column's, over several nodes:
        # checked with the others, later); the lane is free again only after it.
        adam = self.cpu.adam_seconds(self.adam_numel[k])
        start = self.cpu_free - adam
        before, after = self.check_s + self.rs_s[k], self.ag_s[k]
        self.cpu_free += before + after
        self.check_busy += self.check_s
        self.rs_busy += self.rs_s[k]
        self.ag_busy += after
        if self.shared:
            self.unchecked.append(self.program.d2h_bucket[k])
        else:
            self.gathered_at[self.program.d2h_bucket[k]] = self.cpu_free
        if record is not None:
            mine = [x for x in record[mark:] if x[0] == "adam" and x[1] == k]
            for x in mine:
                record.remove(x)
            record.extend([("reduce_scatter", k, start, start + before),
                           ("adam", k, start + before, start + before + adam)])
            if after:
                record.append(("all_gather", k, self.cpu_free - after, self.cpu_free))

    def step_end(self, compute_end: float) -> float:
        """When the step ends (call once, after :meth:`run`): every lane idle and, with several ranks,
        ``step()``'s check after the CPU lane drained (every rank joins it: ``DataParallel.agree_replan``),
        after the end of backward's check of the shared copy, if any."""
        if self.unchecked:  # the end of backward (the main thread waits for it, then calls step())
            compute_end = self.check_copies(compute_end, -1)
        end = self.idle_at(compute_end)
        if self.world == 1:
            return end
        check_start = max(compute_end, self.cpu_free)
        checks = self.step_checks * self.check_s
        self.check_busy += checks
        if self.record is not None:
            self.record.append(("check", -1, check_start, check_start + checks))
        return max(end, check_start + checks)


class _DeviceReduceLanes(_RuntimeLanes):
    """[Note: the runtime's device reduce-scatter]: each bucket's grads reduce-scattered on the collective lane,
    this rank's shard copied to the host after it and updated on the CPU lane; then its weights' pieces (the
    shard to the device, the all-gather, the gathered copy back), queued in the lanes' issue order."""

    def __init__(self, program: Program, hw: HardwareModel, cluster: Cluster, record: list | None,
                 device: Cluster, shared: bool = False):
        super().__init__(program, hw, cluster, record, shared)
        self.dev_rs_s = [reduce_scatter_seconds(s, device) for s in program.d2h_bytes]
        self.dev_ag_s = [all_gather_seconds(s, device) for s in program.d2h_bytes]
        self.shard_bytes = [shard(s, cluster.world) for s in program.d2h_bytes]
        self.nodes = cluster.nodes
        self.coll_free = self.coll_busy = self.gather_busy = 0.0
        self.d2h_total = self.h2d_extra = 0
        # the weights' pieces the CPU lane issues when each AdamW ends, not yet queued on the lanes (the
        # compute lane's clock has not reached them): (grad copy, when issued), in issue order
        self.pending: collections.deque[tuple[int, float]] = collections.deque()
        self.pending_of: dict[int, float] = {}  # bucket -> when its latest pending pieces are issued
        self.buffer_free = [0.0] * WEIGHT_GATHER_BUFFERS  # per gather buffer: when its last copy back is done
        self.turn = 0
        # [Note: resident weights gathered in their slots]: the step's first copies of the buckets updated in
        # the step before, each a 1/G chunk all-gathered over the node (G > 1), and agree_refresh's check
        g, updated = cluster.gpus_per_node, set(program.d2h_bucket)
        self.refreshed = [g > 1 and e == STEP_START and b in updated
                          for e, b in zip(program.h2d_event, program.h2d_bucket)]
        self.refresh_s = [intra_seconds(x, device) if f else 0.0 for x, f in zip(program.h2d_bytes, self.refreshed)]
        self.refresh_busy = 0.0
        self.step_checks = 2
        if any(self.refreshed):
            self.h2d_solo = [hw.h2d_seconds(shard(x, g)) if f else t
                             for x, f, t in zip(program.h2d_bytes, self.refreshed, self.h2d_solo)]
            self.h2d_extra = sum(shard(x, g) - x for x, f in zip(program.h2d_bytes, self.refreshed) if f)
            self.arrival = [0.0] * len(self.h2d_solo)  # compute waits for the all-gather, not the copy

    def issue_h2d(self, k: int, now: float) -> None:
        issued = self.pending_of.get(self.program.h2d_bucket[k])
        if issued is not None and issued > now:  # its weights are not back: queued once their pieces are
            now = issued
        self.flush(now)
        super().issue_h2d(k, now)  # waits for the gathered copy back (gathered_at)
        if self.arrival is self.h2d_done:
            return
        self.arrival[k] = self.h2d_done[k]
        if self.refreshed[k]:  # the chunk landed: the node's all-gather in the slot
            start = max(self.h2d_done[k], self.coll_free)
            self.coll_free = self.arrival[k] = start + self.refresh_s[k]
            self.refresh_busy += self.refresh_s[k]
            if self.record is not None:
                self.record.append(("refresh_gather", k, start, self.coll_free))

    def issue_d2h(self, k: int, now: float) -> None:
        self.flush(now)
        rs_start = max(now, self.coll_free)
        self.coll_free = rs_start + self.dev_rs_s[k]
        self.coll_busy += self.dev_rs_s[k]
        start = self.to_host(self.shard_bytes[k], self.coll_free)
        self.d2h_total += self.shard_bytes[k]
        self.d2h_done[k] = self.d2h_free
        adam = self.cpu.adam_seconds(self.adam_numel[k])
        self.adam_total += adam
        begin = max(self.cpu_free, self.d2h_free)
        self.cpu_free = begin + adam
        if self.record is not None:
            self.record.extend([("device_reduce_scatter", k, rs_start, self.coll_free),
                                ("d2h", k, start, self.d2h_free), ("adam", k, begin, self.cpu_free)])
        if self.shared:  # [Note: the runtime's shared host copy]: written in place, checked whole later
            self.unchecked.append(self.program.d2h_bucket[k])
            if self.nodes == 1:  # (over several nodes the column's shards come back from the device first)
                return
        self.pending.append((k, self.cpu_free))
        self.pending_of[self.program.d2h_bucket[k]] = self.cpu_free

    def flush(self, now: float) -> None:
        """Queue the weights' pieces issued by ``now``, in their order."""
        while self.pending and self.pending[0][1] <= now:
            self.weights_back(*self.pending.popleft())

    def weights_back(self, k: int, issued: float) -> None:
        """Grad copy ``k``'s bucket: its updated shard to the device, the all-gather, the gathered copy back."""
        buffer = self.turn % WEIGHT_GATHER_BUFFERS
        self.turn += 1
        start = max(issued, self.h2d_free, self.buffer_free[buffer])  # the buffer's previous copy back is done
        solo = self.hw.h2d_seconds(self.shard_bytes[k])
        dur = solo / self.duplex if self.d2h_free > start else solo
        self.h2d_free = start + dur
        self.h2d_busy += dur
        self.h2d_extra += self.shard_bytes[k]
        ag_start = max(self.h2d_free, self.coll_free)
        self.coll_free = ag_start + self.dev_ag_s[k]
        self.gather_busy += self.dev_ag_s[k]
        # the gathered prefix into this rank's copy, or the column's other shards into the node's shared one
        nbytes = (self.nodes - 1) * self.shard_bytes[k] if self.shared else self.program.d2h_bytes[k]
        back = self.to_host(nbytes, self.coll_free)
        self.d2h_total += nbytes
        self.buffer_free[buffer] = self.d2h_free
        b = self.program.d2h_bucket[k]
        if self.shared:  # whole once checked ([Note: the runtime's shared host copy])
            self.written_at = max(self.written_at, self.d2h_free)
        else:
            self.gathered_at[b] = self.d2h_free
        if self.pending_of.get(b) == issued:
            del self.pending_of[b]
        if self.record is not None:
            self.record.extend([("h2d_shard", k, start, self.h2d_free),
                                ("device_all_gather", k, ag_start, self.coll_free),
                                ("d2h_gathered", k, back, self.d2h_free)])

    def step_end(self, compute_end: float) -> float:
        self.flush(math.inf)
        return super().step_end(compute_end)

    def idle_at(self, compute_end: float) -> float:
        return max(super().idle_at(compute_end), self.coll_free)
