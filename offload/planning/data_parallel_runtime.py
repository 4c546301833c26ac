"""The data path the runtime runs today, as a cost model (pure, issue 20): one rank's step when every
collective runs on the host, through gloo, on the rank's CPU lane (``offload/runtime/distributed.py``,
``offload/host/shard.py``). The design the issue asks the runtime to become is the other model,
``data_parallel.py`` ([Note: the data-parallel step]); this one is ``path="runtime"``, that one
``path="design"``.

[Note: the runtime's data-parallel step]
Every rank runs the single-GPU plan (the runtime plans each rank as one GPU: ``Executor._build``), on its own
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
(``SHARD_ALIGN`` elements per rank) is left out of the collectives' bytes; the deferred path (accumulation,
clipping, float16: an all-reduce per backward and the updates in ``step()``), device-optimizer buckets and
programs whose AdamW waits for the end of backward are not modelled (refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .collectives import Cluster, gloo_all_gather_seconds, gloo_reduce_scatter_seconds
from .data_parallel import shard
from .greedy import compute_times
from .hw import HardwareModel
from .plan import Plan
from .schedule import program_of
from .simulate import Lanes, Program, SimResult

PATHS = ("runtime", "design")
"""The two data-parallel cost models: what the runtime runs (this module), what issue 20 designs
(``data_parallel.py``)."""

CHECK_BYTES = 4 * 8  # the tag each rank sends in a check all-gather: 4 int64 (distributed.py's _TAG)


@dataclass(frozen=True)
class RuntimePathResult:
    """One rank's simulated step on the runtime's path: its lanes (``sim``: whole-bucket copies, the
    AdamW seconds of its shard in ``adam_s``) and the CPU lane's collective seconds."""

    sim: SimResult
    world: int
    reduce_scatter_busy_s: float  # the CPU lane in reduce-scatters (gloo: all-reduces) and their copies
    all_gather_busy_s: float  # ... in all-gathers of the updated shards and their copies
    check_busy_s: float  # ... in the check all-gathers (one per bucket, one in step())
    reduce_scatter_bytes: int  # bytes of the grad buffers reduce-scattered, over the step
    all_gather_bytes: int  # bytes of the copies gathered, over the step
    node_host_copy_bytes: int  # host <-> device bytes of the node's G ranks together, over the step
    path: str = "runtime"

    @property
    def step_s(self) -> float:
        return self.sim.step_s

    @property
    def cpu_lane_busy_s(self) -> float:
        """Everything the CPU lane ran: collectives, their copies and the shard's AdamW."""
        return self.reduce_scatter_busy_s + self.all_gather_busy_s + self.check_busy_s + self.sim.adam_s


def simulate_runtime_path(program: Program, hw: HardwareModel, cluster: Cluster,
                          record: list | None = None) -> RuntimePathResult:
    """One rank's step of ``program`` (the single-GPU lane program the rank runs) under [Note: the runtime's
    data-parallel step], on ``cluster``'s gloo links (``collectives.gloo_cluster_of``). ``record`` gets
    ``(lane, index, start, end)`` as :func:`~offload.planning.simulate.simulate_reference`'s does; on the
    CPU lane each bucket's work is recorded as ``"reduce_scatter"`` (its check included), ``"adam"`` and
    ``"all_gather"``, and the step's last check as ``("check", -1, ...)``."""
    _refuse_unmodelled(program)
    lanes = _RuntimeLanes(program, hw, cluster, record)
    compute_end = lanes.run(program.compute_s)
    sim = lanes.result(lanes.step_end(compute_end), sum(program.compute_s), sum(program.h2d_bytes),
                       sum(program.d2h_bytes))
    many = cluster.world > 1
    return RuntimePathResult(
        sim, cluster.world, lanes.rs_busy, lanes.ag_busy, lanes.check_busy,
        sum(program.d2h_bytes) if many else 0, sum(program.d2h_bytes) if many else 0,
        cluster.gpus_per_node * (sum(program.h2d_bytes) + sum(program.d2h_bytes)))


def simulate_runtime_plan(plan: Plan, hw: HardwareModel, cluster: Cluster,
                          compute_s: Sequence[float] | None = None) -> RuntimePathResult:
    """:func:`simulate_runtime_path` of a plan's lane program (the plan as the runtime builds it: the
    single-GPU plan, ``schedule.build_plan`` on the rank's budget)."""
    return simulate_runtime_path(program_of(plan, compute_times(plan.trace, compute_s)), hw, cluster)


def reduce_scatter_lane_seconds(nbytes: int, hw: HardwareModel, cluster: Cluster) -> float:
    """The CPU lane's seconds for one bucket's reduce-scatter of ``nbytes`` grad bytes: gloo's all-reduce of
    a clone, the clone and the rank's chunk copied out (host copies: read + write at ``host_bytes_per_s``)."""
    if cluster.world == 1:
        return 0.0
    return gloo_reduce_scatter_seconds(nbytes, cluster) + _copies(nbytes + shard(nbytes, cluster.world), hw)


def all_gather_lane_seconds(nbytes: int, hw: HardwareModel, cluster: Cluster) -> float:
    """The CPU lane's seconds for one bucket's all-gather into its ``nbytes`` host copy: the shard's clone,
    gloo's ring all-gather, PyTorch's copy of the flat output into place and ``take_gathered_copy``'s."""
    if cluster.world == 1:
        return 0.0
    return gloo_all_gather_seconds(nbytes, cluster) + _copies(shard(nbytes, cluster.world) + 2 * nbytes, hw)


def _copies(nbytes: int, hw: HardwareModel) -> float:
    return 2 * nbytes / hw.host_bytes_per_s


def _refuse_unmodelled(program: Program) -> None:
    if program.adam_after_backward:
        raise ValueError("the runtime's data-parallel path updates each bucket as its grads land (overlapped); "
                         "a program whose AdamW waits for the end of backward is not modelled on it: use "
                         "data_parallel.simulate_data_parallel (path='design')")
    if any(program.device_adam_numel) or any(program.device_return_bytes):
        raise ValueError("device-optimizer buckets are not modelled on the runtime's data-parallel path")


class _RuntimeLanes(Lanes):
    """One rank's lanes on the runtime's path: the single-GPU lanes (whole-bucket copies), with each
    bucket's reduce-scatter before, and all-gather after, its shard's AdamW on the CPU lane."""

    def __init__(self, program: Program, hw: HardwareModel, cluster: Cluster, record: list | None):
        n_world, g = cluster.world, cluster.gpus_per_node
        super().__init__(program, [hw.h2d_seconds(x) for x in program.h2d_bytes], program.d2h_bytes,
                         [shard(x, n_world) for x in program.adam_numel],
                         hw, hw if g == 1 else hw.with_(adam_params_per_s=hw.adam_params_per_s / g), record)
        self.world = n_world

        self.check_s = gloo_all_gather_seconds(CHECK_BYTES * n_world, cluster)
        self.rs_s = [reduce_scatter_lane_seconds(s, hw, cluster) for s in program.d2h_bytes]
        self.ag_s = [all_gather_lane_seconds(s, hw, cluster) for s in program.d2h_bytes]
        self.gathered_at: dict[int, float] = {}  # bucket -> when its all-gather ended (its new copy is whole)
        self.rs_busy = self.ag_busy = self.check_busy = 0.0

    def issue_h2d(self, k: int, now: float) -> None:
        # a bucket updated earlier in this step is copied from its host copy once the all-gather made it whole
        ready = self.gathered_at.get(self.program.h2d_bucket[k])
        super().issue_h2d(k, now if ready is None else max(now, ready))

    def issue_d2h(self, k: int, now: float) -> None:
        record = self.record
        mark = len(record) if record is not None else 0
        super().issue_d2h(k, now)  # the whole bucket's grads to the host, then the shard's AdamW on the CPU lane
        if self.world == 1:  # no collective: the single-GPU step
            return
        # The CPU lane is one thread: where the AdamW started, the check and the reduce-scatter run first,
        # then the AdamW, then the all-gather; the lane is free again only after it.
        adam = self.cpu.adam_seconds(self.adam_numel[k])
        start = self.cpu_free - adam
        before, after = self.check_s + self.rs_s[k], self.ag_s[k]
        self.cpu_free += before + after
        self.check_busy += self.check_s
        self.rs_busy += self.rs_s[k]
        self.ag_busy += after
        self.gathered_at[self.program.d2h_bucket[k]] = self.cpu_free
        if record is not None:
            mine = [x for x in record[mark:] if x[0] == "adam" and x[1] == k]
            for x in mine:
                record.remove(x)
            record.extend([("reduce_scatter", k, start, start + before),
                           ("adam", k, start + before, start + before + adam),
                           ("all_gather", k, self.cpu_free - after, self.cpu_free)])

    def step_end(self, compute_end: float) -> float:
        """When the step ends (call once, after :meth:`run`): every lane idle and, with several ranks,
        ``step()``'s check after the CPU lane drained (every rank joins it: ``DataParallel.agree_replan``)."""
        end = self.idle_at(compute_end)
        if self.world == 1:
            return end
        check_start = max(compute_end, self.cpu_free)
        self.check_busy += self.check_s
        if self.record is not None:
            self.record.append(("check", -1, check_start, check_start + self.check_s))
        return max(end, check_start + self.check_s)
