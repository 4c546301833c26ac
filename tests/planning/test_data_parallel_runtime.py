"""The runtime's data-parallel path as a cost model (offload/planning/data_parallel_runtime.py, [Note: the
runtime's data-parallel step]; gloo's collectives in collectives.py, [Note: gloo's collectives]): gloo's ring
costs worked out by hand, one rank reproducing the single-GPU simulation bit for bit, the CPU lane running a
bucket's collectives and its AdamW one after the other, a bucket's next host-to-device copy waiting for its
all-gather, and the host bytes reported being the runtime's own arena."""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload.host.shard import ShardedHostState
from offload.planning.buckets import ParamSpec, make_buckets
from offload.planning.collectives import (
    GLOO_INTER,
    GLOO_INTER_OF,
    GLOO_INTRA,
    INTER,
    Cluster,
    Link,
    gloo_all_gather_seconds,
    gloo_all_reduce_seconds,
    gloo_cluster_of,
    gloo_reduce_scatter_seconds,
)
from offload.planning.data_parallel_runtime import (CHECK_BYTES, WEIGHT_GATHER_BUFFERS, simulate_runtime_path,
                                                   weight_gather_bytes)
from offload.planning.simulate import simulate, simulate_reference
from offload.tools.report_dp import runtime_host_bytes_per_rank
from tests.support.planning import drawn_program, flat_hw, lane_program, machines, traces

LINK = Link("x", bytes_per_s=1000.0, latency_s=0.5)

# -- gloo's ring, by hand ---------------------------------------------------------------------------------


def test_gloo_collectives_by_hand():
    two = Cluster(2, 1, intra=LINK)
    # all-gather of 1000 B over 2 ranks: 1 step of 0.5 s + 500 B at 1000 B/s
    assert gloo_all_gather_seconds(1000, two) == pytest.approx(1.0)
    # ProcessGroupGloo's reduce_scatter_tensor is an all-reduce: twice the all-gather's steps
    assert gloo_all_reduce_seconds(1000, two) == pytest.approx(2.0)
    assert gloo_reduce_scatter_seconds(1000, two) == gloo_all_reduce_seconds(1000, two)
    # a flat ring over 2 nodes x 2: every step waits for its slowest (inter-node) hop; 3 steps of 250 B
    slow = Link("net", bytes_per_s=100.0, latency_s=1.0)
    four = Cluster(2, 2, intra=LINK, inter=slow)
    assert gloo_all_gather_seconds(1000, four) == pytest.approx(3 * (1.0 + 2.5))
    assert gloo_all_gather_seconds(1000, Cluster(1, 1, intra=LINK)) == 0.0


def test_gloo_presets_are_nominal_and_not_nccls():
    for link in (*GLOO_INTRA.values(), *GLOO_INTER.values()):
        assert link.source.startswith("NOMINAL") and link.name.startswith("gloo-"), link.name
    assert set(GLOO_INTER_OF) == set(INTER) and set(GLOO_INTER_OF.values()) <= set(GLOO_INTER)
    c = gloo_cluster_of(16, 2, inter="ipoib-400")
    assert (c.gpus_per_node, c.nodes, c.intra.name, c.inter.name) == (8, 2, "gloo-loopback", "gloo-ipoib-400")
    with pytest.raises(ValueError, match="unknown link"):
        gloo_cluster_of(2, 1, intra="nvlink3")


# -- one rank is the single-GPU step ----------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), machines(), st.data())
def test_one_rank_is_the_single_gpu_simulation_bit_for_bit(case, hw, data):
    program = drawn_program(case, hw, data)
    got = simulate_runtime_path(program, hw, gloo_cluster_of(1))
    assert got.sim == simulate_reference(program, hw)  # every field, floats bitwise
    on_device = simulate_runtime_path(program, hw, gloo_cluster_of(1), device=Cluster(1, 1, intra=LINK))
    assert on_device == got  # one rank issues no collective on either grad path
    assert got.sim == simulate(program, hw)
    assert (got.reduce_scatter_busy_s, got.all_gather_busy_s, got.check_busy_s) == (0, 0, 0)
    assert (got.reduce_scatter_bytes, got.all_gather_bytes) == (0, 0)


# -- the CPU lane, by hand ----------------------------------------------------------------------------------

# two buckets of 1000 grad bytes (500 bf16 params each); 2 ranks on one node; host copies at 2000 B/s
HW = flat_hw(bw=1000.0, adam=1000.0).with_(host_bytes_per_s=4000.0)
TWO = Cluster(2, 1, intra=LINK)
CHECK = 0.5 + CHECK_BYTES * 2 / 2 / 1000  # a check's all-gather: 1 step of 0.5 s + 32 B
RS = 2 * (0.5 + 0.5) + (1000 + 500) / 2000  # an all-reduce of 1000 B, the clone and the shard copied out
ADAM = 250 / (1000 / 2)  # the shard's 250 params at half the node's rate (the node's 2 ranks share it)
AG = (0.5 + 0.5) + (500 + 2 * 1000) / 2000  # the ring all-gather, the shard's clone, two copies of the bucket


def _by_lane(record, lane):
    return [r for r in record if r[0] == lane]


def test_the_cpu_lane_runs_collectives_and_adamw_one_after_the_other():
    program = lane_program(d2h_event=(1, 2), d2h_bucket=(0, 1), d2h_bytes=(1000, 1000), adam_numel=(500, 500))
    record: list = []
    got = simulate_runtime_path(program, HW, TWO, record)
    landed = _by_lane(record, "d2h")[0][3]  # the first bucket's grads on the host (1 s of copy)
    per_bucket = CHECK + RS + ADAM + AG
    # nothing on the CPU lane overlaps: the step is the first landing, both buckets' work end to end, and
    # step()'s check (the second bucket's grads landed long before the lane was free)
    assert got.step_s == pytest.approx(landed + 2 * per_bucket + CHECK)
    assert got.step_s >= landed + got.cpu_lane_busy_s - 1e-9
    assert got.sim.adam_s == pytest.approx(2 * ADAM)
    assert (got.reduce_scatter_busy_s, got.all_gather_busy_s) == (pytest.approx(2 * RS), pytest.approx(2 * AG))
    assert got.check_busy_s == pytest.approx(3 * CHECK)
    cpu = sorted((r for r in record if r[0] in ("reduce_scatter", "adam", "all_gather", "check")),
                 key=lambda r: r[2])
    assert [r[0] for r in cpu] == ["reduce_scatter", "adam", "all_gather"] * 2 + ["check"]
    for a, b in zip(cpu, cpu[1:]):  # back to back, never two at once
        assert b[2] == pytest.approx(a[3])
    assert cpu[0][2] == pytest.approx(landed)


def test_a_buckets_next_host_to_device_copy_waits_for_its_all_gather():
    # bucket 0's grads go to the host at event 0, its new weights come back at event 1 for event 2
    program = lane_program(d2h_event=(0,), d2h_bucket=(0,), d2h_bytes=(1000,), adam_numel=(500,),
                           h2d_event=(1,), h2d_bucket=(0,), h2d_bytes=(1000,), waits=((), (), (0,)))
    record: list = []
    got = simulate_runtime_path(program, HW, TWO, record)
    gathered = _by_lane(record, "all_gather")[0][3]
    assert gathered == pytest.approx(1.0 + CHECK + RS + ADAM + AG)  # the grads landed at 1 s
    h2d = _by_lane(record, "h2d")[0]
    assert h2d[2] == pytest.approx(gathered)  # issued at 1 s, started once the copy was whole
    assert got.sim.stall_s == pytest.approx(gathered + 1.0 - 2.0)  # event 2 waits for the copy (1 s)
    # another bucket's copy does not wait
    other = dataclasses.replace(program, h2d_bucket=(1,))
    assert _first_h2d_start(other) == pytest.approx(1.0)


def _first_h2d_start(program):
    record: list = []
    simulate_runtime_path(program, HW, TWO, record)
    return _by_lane(record, "h2d")[0][2]


def test_unmodelled_programs_are_refused():
    with pytest.raises(ValueError, match="end of backward"):
        simulate_runtime_path(lane_program(adam_after_backward=True), HW, TWO)
    with pytest.raises(ValueError, match="device-optimizer"):
        simulate_runtime_path(lane_program(device_adam_numel=(0, 0, 0, 5)), HW, TWO)


# -- host bytes: the runtime's arena ------------------------------------------------------------------------


@pytest.mark.parametrize("landing", [True, False], ids=["grads-on-host", "grads-on-device"])
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_host_bytes_are_the_arena_every_rank_allocates(world, dtype, landing):
    specs = [ParamSpec(n, 0) for n in (300, 17, 1000, 64, 5)] + [ParamSpec(40, None)]  # one frozen
    buckets = make_buckets(specs, range(len(specs)), bucket_bytes=4 * 800, itemsize=4)
    shapes = [torch.Size([s.numel]) for s in specs]
    itemsize = torch.empty((), dtype=dtype).element_size()
    want = runtime_host_bytes_per_rank(buckets, itemsize, world, False, landing=landing)
    for rank in range(world):
        state = ShardedHostState(buckets, specs, shapes, dtype, rank, world, lambda t: t, fused=False,
                                 landing=landing)
        assert state.nbytes == want
        assert (state.grad is None) is (not landing)  # grads reduced on the device: no whole grad on the host
    if not landing:  # the whole bucket's landing grad is what is left out
        landed = runtime_host_bytes_per_rank(buckets, itemsize, world, False)
        assert landed - want >= sum(b.trainable_numel for b in buckets) * itemsize


# -- grads reduce-scattered on the device ([Note: the runtime's device reduce-scatter]) ----------------------

NV = Cluster(2, 1, intra=Link("nv", bytes_per_s=2000.0, latency_s=0.25))
DEV_RS = 0.25 + 0.5 * 1000 / 2000  # a ring reduce-scatter of 1000 B over 2 GPUs
SHARD_D2H = 500 / 1000  # the rank's 500-byte shard over the 1000 B/s link


DEV_AG = 0.25 + 0.5 * 1000 / 2000  # a ring all-gather into a 1000 B buffer over 2 GPUs
SHARD_H2D = 500 / 1000  # the rank's updated 500-byte shard to the device
BACK = 1000 / 1000  # the gathered 1000 bytes back to the host
ADAM_DEV = 250 / (1000 / 2)  # the shard's 250 params (the test buckets' adam_numel is 500), the node's 2 ranks


def _span(record, lane, k=0):
    (got,) = [r[2:] for r in record if r[0] == lane and r[1] == k]
    return got


def test_both_halves_on_the_device_by_hand():
    """Two buckets of 1000 grad bytes whose grads are final at 1 s and 2 s: each is reduce-scattered on the
    collective lane, its shard (half) copied to the host after it, its AdamW on the CPU lane (nothing else
    there); then, issued when that AdamW ends: the updated shard to the device, the all-gather on the collective
    lane, the gathered bytes back to the host. step()'s check once the CPU lane drained; the step ends when the
    last copy back does."""
    program = lane_program(d2h_event=(1, 2), d2h_bucket=(0, 1), d2h_bytes=(1000, 1000), adam_numel=(500, 500))
    record: list = []
    got = simulate_runtime_path(program, HW, TWO, record, device=NV)
    spans = {lane: [_span(record, lane, k) for k in (0, 1)]
             for lane in ("device_reduce_scatter", "d2h", "adam", "h2d_shard", "device_all_gather", "d2h_gathered")}
    approx = pytest.approx
    assert spans == {
        "device_reduce_scatter": [approx((1.0, 1.5)), approx((2.0, 2.5))],  # DEV_RS = 0.5 s each
        "d2h": [approx((1.5, 2.0)), approx((2.5, 3.0))],  # the grads' shards: SHARD_D2H after each reduce
        "adam": [approx((2.0, 2.5)), approx((3.0, 3.5))],  # ADAM_DEV once each shard landed
        "h2d_shard": [approx((2.5, 3.0)), approx((3.5, 4.0))],  # SHARD_H2D once each AdamW ended
        "device_all_gather": [approx((3.0, 3.5)), approx((4.0, 4.5))],  # DEV_AG after each shard's copy
        "d2h_gathered": [approx((3.5, 4.5)), approx((4.5, 5.5))],  # BACK after each gather, one after the other
    }
    assert (DEV_RS, SHARD_D2H, ADAM_DEV, SHARD_H2D, DEV_AG, BACK) == (0.5, 0.5, 0.5, 0.5, 0.5, 1.0)
    # once the CPU lane drained: step()'s two checks (re-plans, then the buckets gathered in their slots)
    assert _span(record, "check", -1) == approx((3.5, 3.5 + 2 * CHECK))
    assert got.step_s == approx(5.5)
    assert not [r for r in record if r[0] in ("reduce_scatter", "all_gather")]  # nothing of gloo's
    assert (got.grad_reduce, got.reduce_scatter_busy_s, got.all_gather_busy_s) == ("device", 0.0, 0.0)
    assert got.device_reduce_busy_s == approx(2 * DEV_RS) and got.device_gather_busy_s == approx(2 * DEV_AG)
    assert got.check_busy_s == approx(2 * CHECK)  # step()'s only: the buckets' checks are not on the lane
    assert got.cpu_lane_busy_s == approx(2 * ADAM_DEV + 2 * CHECK)
    assert (got.sim.d2h_bytes, got.sim.h2d_bytes) == (2 * 500 + 2 * 1000, 2 * 500)  # shards down, gathers back
    assert got.node_host_copy_bytes == 2 * (2 * 500 + 2 * 1000 + 2 * 500)
    one = simulate_runtime_path(program, HW, gloo_cluster_of(1), device=Cluster(1, 1, intra=LINK))
    assert one.sim == simulate(program, HW) and one.grad_reduce == "host"  # one rank: nothing to reduce
    with pytest.raises(ValueError, match="the device cluster has 2 ranks"):
        simulate_runtime_path(program, HW, gloo_cluster_of(1), device=NV)


def test_the_gather_buffers_take_turns():
    """Three buckets' grads final at once: their weights' pieces are issued at 1.5, 2 and 2.5 s. The first two
    take buffers 0 and 1 at once; the third's shard copy waits for buffer 0's copy back (3.5 s), and holds the
    host-to-device lane until then."""
    program = lane_program(d2h_event=(0, 0, 0), d2h_bucket=(0, 1, 2), d2h_bytes=(1000,) * 3, adam_numel=(500,) * 3)
    record: list = []
    got = simulate_runtime_path(program, HW, TWO, record, device=NV)
    approx = pytest.approx
    assert [_span(record, "adam", k)[1] for k in range(3)] == [approx(1.5), approx(2.0), approx(2.5)]
    assert [_span(record, "h2d_shard", k) for k in range(3)] == [approx((1.5, 2.0)), approx((2.0, 2.5)),
                                                                  approx((3.5, 4.0))]
    assert [_span(record, "d2h_gathered", k) for k in range(3)] == [approx((2.5, 3.5)), approx((3.5, 4.5)),
                                                                     approx((4.5, 5.5))]
    assert _span(record, "h2d_shard", 2)[0] == approx(_span(record, "d2h_gathered", 0)[1])  # buffer 0 again
    assert got.step_s == approx(5.5)
    assert WEIGHT_GATHER_BUFFERS == 2


def test_weight_gather_bytes_are_two_of_the_largest_padded_prefix():
    buckets = make_buckets([ParamSpec(300, 0), ParamSpec(100, 0), ParamSpec(1000, None)], range(3), 2 * 300, 2)
    assert [(b.trainable_numel, b.numel) for b in buckets] == [(300, 300), (100, 100), (0, 1000)]
    assert weight_gather_bytes(buckets, 2) == 2 * 300 * 2  # a frozen bucket, however large, gathers nothing
    padded = (dataclasses.replace(buckets[0], grad_padding=20), *buckets[1:])
    assert weight_gather_bytes(padded, 4) == 2 * 320 * 4
    assert weight_gather_bytes(buckets[2:], 2) == 0


def test_a_buckets_next_copy_waits_for_its_gathered_copy_back():
    """Bucket 0's grads at event 0; its copy to the device is issued at event 1 (1 s), before its AdamW ended
    (1.5 s): it is queued once the weights' pieces are, and starts once the gathered bytes are back (3.5 s)."""
    program = lane_program(d2h_event=(0,), d2h_bucket=(0,), d2h_bytes=(1000,), adam_numel=(500,),
                           h2d_event=(1,), h2d_bucket=(0,), h2d_bytes=(1000,), waits=((), (), (0,)))
    record: list = []
    got = simulate_runtime_path(program, HW, TWO, record, device=NV)
    approx = pytest.approx
    assert (_span(record, "h2d_shard"), _span(record, "device_all_gather"), _span(record, "d2h_gathered")) == (
        approx((1.5, 2.0)), approx((2.0, 2.5)), approx((2.5, 3.5)))
    assert _span(record, "h2d") == approx((3.5, 4.5))
    assert got.sim.stall_s == approx(4.5 - 2.0)  # event 2 waits for that copy
    assert got.step_s == approx(5.5 + 2 * CHECK)  # compute ends at 5.5; step()'s two checks after it
    # another bucket's copy waits for nothing
    record = []
    other = simulate_runtime_path(dataclasses.replace(program, h2d_bucket=(1,)), HW, TWO, record, device=NV)
    assert _span(record, "h2d") == approx((1.0, 2.0)) and other.sim.stall_s == 0


def test_the_weights_pieces_queue_in_issue_order():
    """Pieces issued at 1.5 s (bucket 0's AdamW end) go behind a prefetch issued at 1 s and ahead of one
    issued at 2 s, on the host-to-device lane as on a stream."""
    program = lane_program(d2h_event=(0,), d2h_bucket=(0,), d2h_bytes=(1000,), adam_numel=(500,),
                           h2d_event=(1, 2), h2d_bucket=(1, 2), h2d_bytes=(1000, 1000))
    record: list = []
    simulate_runtime_path(program, HW, TWO, record, device=NV)
    approx = pytest.approx
    assert [_span(record, "h2d", k) for k in (0, 1)] == [approx((1.0, 2.0)), approx((2.5, 3.5))]
    assert _span(record, "h2d_shard") == approx((2.0, 2.5))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), machines(), st.data())
def test_device_lanes_keep_their_order_on_any_plan(case, hw, data):
    """On random plans: per grad copy, reduce-scatter -> shard down -> AdamW -> shard up -> all-gather -> copy
    back; every lane runs one thing at a time; a buffer's next shard copy after its last copy back; a bucket's
    copy to the device after its gathered copy back; the step ends after every piece."""
    program = drawn_program(case, hw, data)
    g = data.draw(st.integers(2, 4))
    record: list = []
    got = simulate_runtime_path(program, hw, gloo_cluster_of(g), record, device=Cluster(g, 1, intra=LINK))
    eps = 1e-9
    by: dict = {}
    for lane, k, a, b in record:
        by.setdefault(lane, {})[k] = (a, b)
    chain = ("device_reduce_scatter", "d2h", "adam", "h2d_shard", "device_all_gather", "d2h_gathered")
    for k in range(len(program.d2h_bytes)):
        spans = [by[lane][k] for lane in chain]
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert start >= end - eps
        assert spans[0][0] >= 0 and got.step_s >= spans[-1][1] - eps
    for lanes in (("h2d", "h2d_shard"), ("d2h", "d2h_gathered"), ("device_reduce_scatter", "device_all_gather"),
                  ("adam",)):
        spans = sorted(s for lane in lanes for s in by.get(lane, {}).values())
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert start >= end - eps, lanes
    turns = sorted(by.get("h2d_shard", {}), key=lambda k: by["adam"][k][1])  # the lane's order
    for r in range(WEIGHT_GATHER_BUFFERS, len(turns)):
        assert by["h2d_shard"][turns[r]][0] >= by["d2h_gathered"][turns[r - WEIGHT_GATHER_BUFFERS]][1] - eps
    for j, b in enumerate(program.h2d_bucket):
        for k, kb in enumerate(program.d2h_bucket):
            if kb == b and program.d2h_event[k] < program.h2d_event[j]:  # issued after its grads: waits
                assert by["h2d"][j][0] >= by["d2h_gathered"][k][1] - eps
