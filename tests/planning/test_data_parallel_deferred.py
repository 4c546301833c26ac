"""The runtime's deferred data-parallel path as a cost model (offload/planning/data_parallel_deferred.py,
[Note: the runtime's deferred data-parallel step]): one rank of one fp32 micro-batch reproducing the
single-GPU simulation (AdamW after backward) bit for bit, a step worked out by hand, the all-reduce charged
per synced backward (growing with micro-batches without no_sync, not with it), the accumulation charged
per backward, and the lane order at a backward's end."""

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload.planning.collectives import (
    Cluster,
    Link,
    gloo_all_gather_seconds,
    gloo_all_reduce_seconds,
    gloo_cluster_of,
)
from offload.planning.data_parallel_deferred import simulate_runtime_deferred
from offload.planning.data_parallel_runtime import CHECK_BYTES
from offload.planning.simulate import simulate, simulate_reference
from tests.support.planning import drawn_program, flat_hw, lane_program, machines, traces

LINK = Link("x", bytes_per_s=1000.0, latency_s=0.5)
FAST = Link("fast", bytes_per_s=1e6, latency_s=0.001)
HW = flat_hw(bw=1000.0, adam=1000.0).with_(host_bytes_per_s=4000.0)  # host copies: read + write at 2000 B/s
TWO = Cluster(2, 1, intra=LINK)

# two fp32 buckets of 500 params (2000 grad bytes): their grads land in the fp32 sums
FP32 = lane_program(d2h_event=(1, 2), d2h_bucket=(0, 1), d2h_bytes=(2000, 2000), adam_numel=(500, 500))
CHECK = 0.5 + CHECK_BYTES * 2 / 2 / 1000  # a check's all-gather: 1 step of 0.5 s + 32 B
AR = 2 * (0.5 + 1000 / 1000) + 2 * 2000 / 4000 + 2000 / 4000  # all-reduce of the 2000 B sum, / world, norms' read
TAKE = 2 * 2 * 1000 / 4000  # the shard (1000 B) copied out and scaled: two read + write passes
ADAM = 250 / (1000 / 2)  # the shard's 250 params at half the node's rate
AG = (0.5 + 1000 / 1000) + 2 * (1000 + 2 * 2000) / 4000  # the ring all-gather, the shard's clone, two copies


def _by_lane(record, lane):
    return [r for r in record if r[0] == lane]


# -- one rank is the single-GPU step ----------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), machines(), st.data())
def test_one_rank_of_one_micro_batch_is_the_single_gpu_simulation_bit_for_bit(case, hw, data):
    program = drawn_program(case, hw, data)  # fp32 plans: the grads land in the sums (no accumulation work)
    assert program.d2h_bytes == tuple(4 * n for n in program.adam_numel)
    got = simulate_runtime_deferred(program, hw, gloo_cluster_of(1))
    after_backward = dataclasses.replace(program, adam_after_backward=True)  # the updates in step()
    assert got.sim == simulate_reference(after_backward, hw)  # every field, floats bitwise
    assert got.sim == simulate(after_backward, hw)
    assert got.deferred and (got.all_reduce_busy_s, got.accumulate_busy_s, got.check_busy_s) == (0, 0, 0)
    assert (got.reduce_scatter_busy_s, got.all_gather_busy_s, got.all_reduce_bytes) == (0, 0, 0)


# -- by hand ------------------------------------------------------------------------------------------------


def test_a_deferred_step_by_hand():
    record: list = []
    got = simulate_runtime_deferred(FP32, HW, TWO, record=record)
    # compute ends at 3 s; the grads land at 3 s and 5 s (2 s copies, one after the other); the backward's end
    # waits for them, checks, all-reduces both sums; step() takes each shard, updates it, all-gathers it, checks
    assert got.step_s == pytest.approx(5 + CHECK + 2 * AR + 2 * (TAKE + ADAM + AG) + CHECK)
    assert got.all_reduce_busy_s == pytest.approx(2 * AR) and got.all_reduce_bytes == 2 * 2000
    assert got.reduce_scatter_busy_s == pytest.approx(2 * TAKE) and got.reduce_scatter_bytes == 0
    assert got.all_gather_busy_s == pytest.approx(2 * AG) and got.check_busy_s == pytest.approx(2 * CHECK)
    assert got.sim.adam_s == pytest.approx(2 * ADAM) and got.accumulate_busy_s == 0  # fp32: landed in the sums
    cpu = sorted((r for r in record if r[0] in ("check", "all_reduce", "take_shard", "adam", "all_gather")),
                 key=lambda r: r[2])
    assert [r[0] for r in cpu] == ["check", "all_reduce", "all_reduce"] + ["take_shard", "adam", "all_gather"] * 2 \
        + ["check"]
    for a, b in zip(cpu, cpu[1:]):  # back to back, never two at once
        assert b[2] == pytest.approx(a[3])
    assert cpu[0][2] == pytest.approx(5.0)  # after the last grads landed


def test_16_bit_grads_are_widened_then_added_on_the_cpu_lane():
    # the same buckets in bf16: 1000 grad bytes each, widened into a 2000 B fp32 sum, then added to it
    bf16 = dataclasses.replace(FP32, d2h_bytes=(1000, 1000))
    widen, add = (1000 + 2000) / 4000, (1000 + 3 * 2000) / 4000
    one = simulate_runtime_deferred(bf16, HW, TWO)
    assert one.accumulate_busy_s == pytest.approx(2 * widen)
    three = simulate_runtime_deferred(bf16, HW, TWO, micro_batches=3, no_sync=True)
    assert three.accumulate_busy_s == pytest.approx(2 * widen + 4 * add)
    assert three.sim.d2h_bytes == 3 * 2000 and three.sim.compute_s == pytest.approx(9.0)


# -- the all-reduce per synced backward -----------------------------------------------------------------------


def _step(link, k, no_sync):
    return simulate_runtime_deferred(FP32, HW, Cluster(2, 1, intra=link), micro_batches=k, no_sync=no_sync)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_the_all_reduce_is_charged_per_synced_backward(k):
    slow_cost = {ns: _step(LINK, k, ns).step_s - _step(FAST, k, ns).step_s for ns in (False, True)}
    one = _step(LINK, 1, False).step_s - _step(FAST, 1, False).step_s
    # what one backward's end costs on the slow link beyond the fast one: its check and two all-reduces
    per_backward = (CHECK - gloo_all_gather_seconds(CHECK_BYTES * 2, Cluster(2, 1, intra=FAST))) + 2 * (
        gloo_all_reduce_seconds(2000, TWO) - gloo_all_reduce_seconds(2000, Cluster(2, 1, intra=FAST)))
    assert slow_cost[False] == pytest.approx(one + (k - 1) * per_backward)  # every backward all-reduces
    assert slow_cost[True] == pytest.approx(one)  # no_sync: only the last one does
    assert _step(LINK, k, False).all_reduce_busy_s == pytest.approx(k * 2 * AR)
    assert _step(LINK, k, True).all_reduce_busy_s == pytest.approx(2 * AR)
    assert _step(LINK, k, False).check_busy_s == pytest.approx((k + 1) * CHECK)
    if k > 1:
        assert _step(LINK, k, False).step_s > _step(LINK, k, True).step_s + (k - 1) * 2 * AR - 1e-9


def test_the_all_reduce_runs_after_the_accumulation_of_its_bucket():
    # bf16 grads, 2 micro-batches synced each: at each backward's end the check and the all-reduces follow
    # the lane's accumulation of every bucket (average_gathered drains the lane first)
    bf16 = dataclasses.replace(FP32, d2h_bytes=(1000, 1000))
    record: list = []
    simulate_runtime_deferred(bf16, HW, TWO, micro_batches=2, record=record)
    acc, ar, checks = _by_lane(record, "accumulate"), _by_lane(record, "all_reduce"), _by_lane(record, "check")
    assert len(acc) == 4 and len(ar) == 4 and [c[1] for c in checks] == [-2, -2, -1]
    for j in range(2):  # micro-batch j: accumulations acc[2j:2j+2], then check j, then all-reduces ar[2j:2j+2]
        lane_done = max(a[3] for a in acc[2 * j: 2 * j + 2])
        assert checks[j][2] >= lane_done - 1e-12
        for r in ar[2 * j: 2 * j + 2]:
            mine = next(a for a in acc[2 * j: 2 * j + 2] if a[1] == r[1])
            assert r[2] >= mine[3] - 1e-12 and r[2] >= checks[j][3] - 1e-12
        assert ar[2 * j][2] == pytest.approx(checks[j][3]) and ar[2 * j + 1][2] == pytest.approx(ar[2 * j][3])
    # the second micro-batch's compute starts after the first one's all-reduces
    second = [c for c in _by_lane(record, "compute") if c[2] >= ar[1][3] - 1e-12]
    assert len(second) == 3


def test_one_rank_accumulates_without_collectives_and_bad_micro_batches_are_refused():
    bf16 = dataclasses.replace(FP32, d2h_bytes=(1000, 1000))
    got = simulate_runtime_deferred(bf16, HW, gloo_cluster_of(1), micro_batches=3)
    assert (got.all_reduce_busy_s, got.check_busy_s, got.all_gather_busy_s) == (0, 0, 0)
    assert got.accumulate_busy_s > 0 and got.sim.adam_s == pytest.approx(2 * 500 / 1000)  # whole buckets
    with pytest.raises(ValueError, match="micro_batches"):
        simulate_runtime_deferred(FP32, HW, TWO, micro_batches=0)
    with pytest.raises(ValueError, match="device-optimizer"):
        simulate_runtime_deferred(lane_program(device_adam_numel=(0, 0, 0, 5)), HW, TWO)


def test_later_micro_batches_do_not_refresh_resident_buckets():
    # a resident bucket's copy at the step's start (1000 B: 1 s) is made once, not once per micro-batch
    program = dataclasses.replace(FP32, h2d_event=(-1,), h2d_bucket=(2,), h2d_bytes=(1000,), waits=((0,), (), ()))
    got = simulate_runtime_deferred(program, HW, TWO, micro_batches=3, no_sync=True)
    assert got.sim.h2d_bytes == 1000 and got.sim.stall_s == pytest.approx(1.0)


def test_the_next_forward_waits_for_the_previous_backwards_grad_copies():
    # no collective between the micro-batches (one rank; or inside no_sync): the second forward starts when
    # the first backward's last grads landed (5 s: wait_for_copies), not when its compute ended (3 s)
    for cluster, no_sync in ((gloo_cluster_of(1), False), (TWO, True)):
        record: list = []
        simulate_runtime_deferred(FP32, HW, cluster, micro_batches=2, no_sync=no_sync, record=record)
        compute = _by_lane(record, "compute")
        assert compute[2][3] == pytest.approx(3.0) and compute[3][2] == pytest.approx(5.0)
