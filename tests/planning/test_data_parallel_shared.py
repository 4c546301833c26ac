"""The runtime's data-parallel paths with one host copy per node, as a cost model
(offload/planning/data_parallel_runtime.py, [Note: the runtime's shared host copy]): per bucket the CPU lane
runs the shard's AdamW and no gather of the weights (gloo's on the host path, the device's three pieces on
the device path, gloo's in step() on the deferred path); one small check of every bucket written follows at
the end of backward (or of step()'s updates), or earlier where a copy reads a bucket updated in the same
step, and a bucket's next host-to-device copy waits for it, worked out by hand on each path; one rank is
still the single-GPU simulation bit for bit; over several nodes each node keeps one copy and each rank gathers
its column's shards into it ([Note: one host copy per host])."""

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload.planning.collectives import Cluster, Link, gloo_cluster_of
from offload.planning.data_parallel_deferred import simulate_runtime_deferred
from offload.planning.data_parallel_runtime import CHECK_BYTES, simulate_runtime_path
from offload.planning.simulate import simulate_reference
from tests.support.planning import drawn_program, flat_hw, lane_program, machines, traces

LINK = Link("x", bytes_per_s=1000.0, latency_s=0.5)
NV = Cluster(2, 1, intra=Link("nv", bytes_per_s=2000.0, latency_s=0.25))
HW = flat_hw(bw=1000.0, adam=1000.0).with_(host_bytes_per_s=4000.0)  # host copies: read + write at 2000 B/s
TWO = Cluster(2, 1, intra=LINK)

CHECK = 0.5 + CHECK_BYTES * 2 / 2 / 1000  # a check's all-gather: 1 step of 0.5 s + 32 B
RS = 2 * (0.5 + 0.5) + (1000 + 500) / 2000  # gloo: an all-reduce of 1000 B, the clone and the shard copied out
ADAM = 250 / (1000 / 2)  # the shard's 250 params at half the node's rate (the node's 2 ranks share it)
AG = (0.5 + 0.5) + (500 + 2 * 1000) / 2000  # what the per-rank copy's gloo all-gather would cost
TWO_BUCKETS = lane_program(d2h_event=(1, 2), d2h_bucket=(0, 1), d2h_bytes=(1000, 1000), adam_numel=(500, 500))
# bucket 0's grads go to the host at event 0, its new weights come back at event 1 for event 2
REFETCH = lane_program(d2h_event=(0,), d2h_bucket=(0,), d2h_bytes=(1000,), adam_numel=(500,),
                       h2d_event=(1,), h2d_bucket=(0,), h2d_bytes=(1000,), waits=((), (), (0,)))


def _span(record, lane, k=0):
    (got,) = [r[2:] for r in record if r[0] == lane and r[1] == k]
    return got


def _cpu_lane(record):
    lanes = ("reduce_scatter", "adam", "all_gather", "copy_ready", "check", "take_shard", "all_reduce")
    return sorted((r for r in record if r[0] in lanes), key=lambda r: r[2])


# -- host grads -----------------------------------------------------------------------------------------------


def test_host_path_runs_one_check_instead_of_the_all_gathers():
    record: list = []
    got = simulate_runtime_path(TWO_BUCKETS, HW, TWO, record, shared=True)
    landed = _span(record, "d2h")[1]  # the first bucket's grads on the host (1 s of copy)
    per_bucket = CHECK + RS + ADAM  # the bucket check and reduce-scatter, AdamW; the copy checked later
    # the end of backward's check of both buckets' copies, then step()'s
    assert got.step_s == pytest.approx(landed + 2 * per_bucket + 2 * CHECK)
    cpu = _cpu_lane(record)
    assert [r[0] for r in cpu] == ["reduce_scatter", "adam"] * 2 + ["copy_ready", "check"]
    for a, b in zip(cpu, cpu[1:]):  # back to back, never two at once
        assert b[2] == pytest.approx(a[3])
    assert _span(record, "copy_ready", -1) == pytest.approx((landed + 2 * per_bucket, landed + 2 * per_bucket + CHECK))
    assert (got.all_gather_busy_s, got.all_gather_bytes) == (0.0, 0)  # no gather of the weights at all
    assert got.check_busy_s == pytest.approx(4 * CHECK)  # one per bucket's sum, the copies' one and step()'s
    assert (got.shared, got.host_copy) == (True, "shared")
    per_rank = simulate_runtime_path(TWO_BUCKETS, HW, TWO)
    assert (per_rank.shared, per_rank.host_copy) == (False, "per rank")
    assert per_rank.step_s - got.step_s == pytest.approx(2 * AG - CHECK)


def test_host_path_copy_in_the_same_step_forces_the_check_and_waits_for_it():
    record: list = []
    got = simulate_runtime_path(REFETCH, HW, TWO, record, shared=True)
    ready = _span(record, "copy_ready", 0)[1]  # forced by copy 0, issued at 1 s: once the lane drained
    assert ready == pytest.approx(1.0 + CHECK + RS + ADAM + CHECK)  # the grads landed at 1 s
    assert _span(record, "h2d")[0] == pytest.approx(ready)  # started once every rank wrote
    assert got.sim.stall_s == pytest.approx(ready + 1.0 - 2.0)  # event 2 waits for the copy (1 s)
    assert [r[1] for r in record if r[0] == "copy_ready"] == [0]  # nothing left for the end of backward
    record = []  # another bucket's copy waits for nothing, and the check comes at the end of backward
    simulate_runtime_path(dataclasses.replace(REFETCH, h2d_bucket=(1,)), HW, TWO, record, shared=True)
    assert _span(record, "h2d")[0] == pytest.approx(1.0)
    assert [r[1] for r in record if r[0] == "copy_ready"] == [-1]


# -- device grads ---------------------------------------------------------------------------------------------

DEV_RS = 0.25 + 0.5 * 1000 / 2000  # a ring reduce-scatter of 1000 B over 2 GPUs
SHARD_D2H = 500 / 1000  # the rank's 500-byte shard over the 1000 B/s link


def test_device_path_gathers_nothing_and_checks_once():
    """Two buckets of 1000 grad bytes final at 1 s and 2 s: reduce-scattered on the device, the shard copied
    down, its AdamW; nothing goes back to the device, nothing is gathered; one check of both copies at the
    end of backward, once the lane drained."""
    record: list = []
    got = simulate_runtime_path(TWO_BUCKETS, HW, TWO, record, device=NV, shared=True)
    approx = pytest.approx
    assert (DEV_RS, SHARD_D2H, ADAM) == (0.5, 0.5, 0.5)
    spans = {lane: [_span(record, lane, k) for k in (0, 1)] for lane in ("device_reduce_scatter", "d2h", "adam")}
    assert spans == {
        "device_reduce_scatter": [approx((1.0, 1.5)), approx((2.0, 2.5))],
        "d2h": [approx((1.5, 2.0)), approx((2.5, 3.0))],
        "adam": [approx((2.0, 2.5)), approx((3.0, 3.5))],  # the second shard landed at 3 s
    }
    assert _span(record, "copy_ready", -1) == approx((3.5, 3.5 + CHECK))  # after the last AdamW
    assert not [r for r in record if r[0] in ("h2d_shard", "device_all_gather", "d2h_gathered", "all_gather")]
    # then step()'s two checks (re-plans; the buckets gathered in their slots, none here)
    assert _span(record, "check", -1) == approx((3.5 + CHECK, 3.5 + 3 * CHECK))
    assert got.step_s == approx(3.5 + 3 * CHECK)
    assert (got.grad_reduce, got.device_gather_busy_s, got.all_gather_busy_s, got.all_gather_bytes) == (
        "device", 0.0, 0.0, 0)
    assert got.device_reduce_busy_s == approx(2 * DEV_RS) and got.check_busy_s == approx(3 * CHECK)
    assert got.cpu_lane_busy_s == approx(2 * ADAM + 3 * CHECK)
    assert (got.sim.d2h_bytes, got.sim.h2d_bytes) == (2 * 500, 0)  # the grads' shards down, nothing up
    assert got.node_host_copy_bytes == 2 * 2 * 500
    per_rank = simulate_runtime_path(TWO_BUCKETS, HW, TWO, device=NV)
    assert per_rank.step_s == approx(5.5)  # the device gather's three pieces (test_data_parallel_runtime)


def test_device_path_copy_in_the_same_step_forces_the_check_and_waits_for_it():
    record: list = []
    got = simulate_runtime_path(REFETCH, HW, TWO, record, device=NV, shared=True)
    approx = pytest.approx
    assert _span(record, "adam") == approx((1.0, 1.5))  # reduce-scatter 0-0.5, shard down 0.5-1
    assert _span(record, "copy_ready", 0) == approx((1.5, 1.5 + CHECK))  # issued at 1 s, once the lane drained
    assert _span(record, "h2d") == approx((1.5 + CHECK, 2.5 + CHECK))
    assert got.sim.stall_s == approx(2.5 + CHECK - 2.0)
    record = []
    other = simulate_runtime_path(dataclasses.replace(REFETCH, h2d_bucket=(1,)), HW, TWO, record, device=NV,
                                  shared=True)
    assert _span(record, "h2d") == approx((1.0, 2.0)) and other.sim.stall_s == 0


# -- deferred -------------------------------------------------------------------------------------------------

FP32 = lane_program(d2h_event=(1, 2), d2h_bucket=(0, 1), d2h_bytes=(2000, 2000), adam_numel=(500, 500))
AR = 2 * (0.5 + 1000 / 1000) + 2 * 2000 / 4000 + 2000 / 4000  # all-reduce of the 2000 B sum, / world, norms
TAKE = 2 * 2 * 1000 / 4000  # the shard (1000 B) copied out and scaled: two read + write passes


def test_deferred_step_checks_once_instead_of_gathering():
    record: list = []
    got = simulate_runtime_deferred(FP32, HW, TWO, record=record, shared=True)
    # as test_a_deferred_step_by_hand, with step()'s all-gathers replaced by one check of the copies
    assert got.step_s == pytest.approx(5 + CHECK + 2 * AR + 2 * (TAKE + ADAM) + CHECK + CHECK)
    assert [r[0] for r in _cpu_lane(record)] == ["check", "all_reduce", "all_reduce"] + [
        "take_shard", "adam"] * 2 + ["copy_ready", "check"]
    assert (got.all_gather_busy_s, got.all_gather_bytes) == (0.0, 0)
    assert got.check_busy_s == pytest.approx(3 * CHECK) and got.shared
    per_rank = simulate_runtime_deferred(FP32, HW, TWO)
    assert not per_rank.shared and per_rank.all_gather_busy_s > 0
    assert per_rank.step_s > got.step_s


# -- limits ---------------------------------------------------------------------------------------------------


FOUR = Cluster(2, 2, intra=LINK, inter=LINK)  # two nodes of two ranks
CHECK4 = 3 * (0.5 + CHECK_BYTES * 4 / 4 / 1000)  # a check over the four ranks: 3 ring steps of 32 B
RS4 = 2 * 3 * (0.5 + 250 / 1000) + (1000 + 250) / 2000  # gloo's all-reduce of 1000 B over 4, the clone, the shard
ADAM4 = 125 / (1000 / 2)  # the shard's 125 params at half the node's rate
# the column's all-gather (one rank a node: 1 step, the node's 2 columns sharing the stream: 500 B), the shard's
# clone (250 B), the flat output copied (500 B), the other node's shard into the copy (250 B)
COL = (0.5 + 500 / 1000) + (250 + 500 + 250) / 2000
AG4 = 3 * (0.5 + 250 / 1000) + (250 + 2 * 1000) / 2000  # a copy per rank: every rank's shards


def test_several_nodes_keep_one_copy_each_and_gather_the_column():
    """[Note: one host copy per host]: two nodes of two ranks, host grads: after each AdamW the column's
    all-gather (the other node's shard into this node's copy) on the CPU lane, then one check of both copies
    at the end of backward over every rank, then step()'s."""
    record: list = []
    got = simulate_runtime_path(TWO_BUCKETS, HW, FOUR, record, shared=True)
    landed = _span(record, "d2h")[1]
    per_bucket = CHECK4 + RS4 + ADAM4 + COL
    assert got.step_s == pytest.approx(landed + 2 * per_bucket + 2 * CHECK4)
    cpu = _cpu_lane(record)
    assert [r[0] for r in cpu] == ["reduce_scatter", "adam", "all_gather"] * 2 + ["copy_ready", "check"]
    assert [r[3] - r[2] for r in cpu if r[0] == "all_gather"] == [pytest.approx(COL)] * 2
    assert got.all_gather_busy_s == pytest.approx(2 * COL) and got.all_gather_bytes == 2 * 500  # the column's
    assert (got.shared, got.host_copy) == (True, "shared")
    per_rank = simulate_runtime_path(TWO_BUCKETS, HW, FOUR, shared=False)
    assert per_rank.all_gather_bytes == 2 * 1000
    assert per_rank.step_s - got.step_s == pytest.approx(2 * (AG4 - COL) - CHECK4)
    deferred = simulate_runtime_deferred(FP32, HW, FOUR, record=(rec := []), shared=True)
    assert [r[0] for r in _cpu_lane(rec)][-8:] == ["take_shard", "adam", "all_gather"] * 2 + ["copy_ready", "check"]
    assert deferred.shared and deferred.all_gather_bytes == 2 * 1000  # the column's half of 2000-byte buckets


def test_several_nodes_on_the_device_copy_back_the_column_only():
    """Device grads over two nodes of two ranks: the weights' three pieces as with a copy per rank, but the
    copy back is the other node's shard (250 of the 1000 bytes), and the end of backward's check waits for
    the last one; the gather buffers stay."""
    nv4 = Cluster(2, 2, intra=NV.intra, inter=NV.intra)
    record: list = []
    got = simulate_runtime_path(TWO_BUCKETS, HW, FOUR, record, device=nv4, shared=True)
    backs = [_span(record, "d2h_gathered", k) for k in (0, 1)]
    assert [b - a for a, b in backs] == [pytest.approx(250 / 1000)] * 2  # the other node's 250-byte shard
    ready = _span(record, "copy_ready", -1)
    assert ready[0] >= max(b for _, b in backs) - 1e-9
    assert got.sim.d2h_bytes == 2 * 250 + 2 * 250  # the grads' shards, the column's shards back
    per_rank = simulate_runtime_path(TWO_BUCKETS, HW, FOUR, device=nv4)
    assert per_rank.sim.d2h_bytes == 2 * 250 + 2 * 1000 and not per_rank.shared
    assert got.device_gather_busy_s == pytest.approx(per_rank.device_gather_busy_s)  # the same all-gathers


def test_one_rank_or_one_gpu_a_node_shares_nothing():
    assert not simulate_runtime_path(TWO_BUCKETS, HW, gloo_cluster_of(1), shared=True).shared
    one_a_node = Cluster(1, 2, intra=LINK, inter=LINK)
    assert not simulate_runtime_path(TWO_BUCKETS, HW, one_a_node, shared=True).shared
    assert not simulate_runtime_deferred(FP32, HW, one_a_node, shared=True).shared


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), machines(), st.data())
def test_one_rank_sharing_is_the_single_gpu_simulation_bit_for_bit(case, hw, data):
    program = drawn_program(case, hw, data)
    want = simulate_reference(program, hw)
    assert simulate_runtime_path(program, hw, gloo_cluster_of(1), shared=True).sim == want
    device = Cluster(1, 1, intra=LINK)
    assert simulate_runtime_path(program, hw, gloo_cluster_of(1), device=device, shared=True).sim == want
    after_backward = dataclasses.replace(program, adam_after_backward=True)
    assert simulate_runtime_deferred(program, hw, gloo_cluster_of(1), shared=True).sim == \
        simulate_reference(after_backward, hw)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), machines(), st.data())
def test_shared_lanes_keep_their_order_on_any_plan(case, hw, data):
    """On random plans, either grad path: one thing at a time on the CPU lane; every updated bucket's copy is
    checked whole after its AdamW and before the step ends, once at the end of backward unless a copy of it
    to the device in the same step forced the check earlier, which that copy then waits for; nothing gathered."""
    program = drawn_program(case, hw, data)
    g = data.draw(st.integers(2, 4))
    device = data.draw(st.sampled_from([None, Cluster(g, 1, intra=LINK)]))
    record: list = []
    got = simulate_runtime_path(program, hw, gloo_cluster_of(g), record, device=device, shared=True)
    eps = 1e-9
    by: dict = {}
    for lane, k, a, b in record:
        by.setdefault(lane, {})[k] = (a, b)
    assert not set(by) & {"all_gather", "h2d_shard", "device_all_gather", "d2h_gathered"}
    checks = sorted(x[2:] for x in record if x[0] == "copy_ready")
    assert len(checks) <= 1 + len(program.h2d_bucket)  # the end of backward's, and those copies forced
    cpu = sorted(s for lane in ("reduce_scatter", "adam", "copy_ready") for s in by.get(lane, {}).values())
    for (_, end), (start, _) in zip(cpu, cpu[1:]):
        assert start >= end - eps
    for k in range(len(program.d2h_bytes)):  # checked after its AdamW, before the step ends
        covering = [c for c in checks if c[0] >= by["adam"][k][1] - eps]
        assert covering and got.step_s >= covering[0][1] - eps
    for j, b in enumerate(program.h2d_bucket):
        for k, kb in enumerate(program.d2h_bucket):
            if kb == b and program.d2h_event[k] < program.h2d_event[j]:  # read after its update in this step
                covering = [c for c in checks if c[0] >= by["adam"][k][1] - eps]
                assert by["h2d"][j][0] >= covering[0][1] - eps
