"""The data-parallel cost model (issue 20): the ring collectives against formulas worked out by hand, one
rank's simulated step on programs small enough to follow by hand, one rank reproducing the single-GPU
simulation bit for bit, host bytes per rank, and properties of the collective lanes on random plans."""

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload.planning.buckets import ParamSpec, host_layout, make_buckets
from offload.planning.collectives import (
    INTER,
    INTRA,
    Cluster,
    Link,
    all_gather_seconds,
    all_reduce_seconds,
    cluster_of,
    reduce_scatter_seconds,
    ring_seconds,
)
from offload.planning.data_parallel import (
    build_rank_plan,
    host_bytes_per_node,
    host_bytes_per_rank,
    planning_hw,
    simulate_data_parallel,
)
from offload.planning.hw import PRESETS
from offload.planning.schedule import program_of
from offload.planning.simulate import STEP_START, simulate, simulate_reference
from offload.tools.baselines import Case, zero_offload
from offload.tools.baselines_dp import zero_offload_data_parallel, zero_offload_program
from tests.support.planning import draw_compute, drawn_program, flat_hw, lane_program, machines, plan_that_fits, traces

# -- the ring model ---------------------------------------------------------------------------------------


def test_ring_reduce_scatter_and_all_gather_by_hand():
    link = Link("x", bytes_per_s=100.0, latency_s=0.5)
    # 4 ranks, 1000 B: 3 steps of 0.5 s + 3/4 of the buffer at 100 B/s = 1.5 + 7.5
    assert ring_seconds(1000, 4, link) == pytest.approx(9.0)
    one_node = Cluster(4, 1, intra=link)
    assert reduce_scatter_seconds(1000, one_node) == pytest.approx(9.0)
    assert all_gather_seconds(1000, one_node) == pytest.approx(9.0)
    assert all_reduce_seconds(1000, one_node) == pytest.approx(18.0)  # 2 (p-1) a + 2 (p-1)/p S/B
    assert ring_seconds(1000, 1, link) == 0.0 and ring_seconds(0, 4, link) == 0.0


def test_hierarchical_collectives_by_hand():
    gpu = Link("gpu", bytes_per_s=100.0, latency_s=0.5)
    net = Link("net", bytes_per_s=10.0, latency_s=1.0)  # per node: the node's 4 rings share it
    c = Cluster(4, 2, intra=gpu, inter=net)
    assert c.world == 8
    # intra: 3 x 0.5 + 3/4 x 1000/100 = 9; inter: the 4 rings on 250 B each at 10/4 B/s: 1 x 1.0 + 1/2 x
    # 250 / 2.5 = 1 + 50 = 51
    assert reduce_scatter_seconds(1000, c) == pytest.approx(60.0)
    assert all_gather_seconds(1000, c) == pytest.approx(60.0)
    assert all_reduce_seconds(1000, c) == pytest.approx(120.0)
    # one GPU per node: the inter-node ring alone, with the node's whole network
    assert reduce_scatter_seconds(1000, Cluster(1, 4, intra=gpu, inter=net)) == pytest.approx(3 + 0.75 * 100)


def test_presets_state_their_sources_and_clusters_are_checked():
    for link in (*INTRA.values(), *INTER.values()):
        assert link.bytes_per_s > 0 and link.latency_s >= 0 and len(link.source) > 40, link.name
    assert not INTRA["nvlink3"].shares_host_link and INTRA["pcie4-p2p"].shares_host_link
    assert INTER["ib400"].bytes_per_s == pytest.approx(2 * INTER["ib200"].bytes_per_s)
    c = cluster_of(16, 2, "nvlink4", "ib400")
    assert (c.gpus_per_node, c.nodes, c.intra.name, c.inter.name) == (8, 2, "nvlink4", "ib400")
    with pytest.raises(ValueError, match="evenly"):
        cluster_of(6, 4)
    with pytest.raises(ValueError, match="unknown link"):
        cluster_of(2, 1, "nvlink9")
    with pytest.raises(ValueError, match="gpus_per_node"):
        Cluster(0)
    with pytest.raises(ValueError, match="bytes_per_s"):
        Link("bad", 0.0, 1e-6)


# -- one rank's step, by hand -----------------------------------------------------------------------------


def test_two_ranks_on_one_node_by_hand():
    # bucket 0 (1000 B, 100 params) refreshed at the start, needed at event 0; its grads final at event 2
    p = lane_program(h2d_event=(STEP_START,), h2d_bucket=(0,), h2d_bytes=(1000,), waits=((0,), (), ()),
                 d2h_event=(2,), d2h_bucket=(0,), d2h_bytes=(1000,), adam_numel=(100,))
    # one GPU: copy 1 s, compute 1..4, grads 3..4, AdamW 4..5
    assert simulate(p, flat_hw()).step_s == pytest.approx(5.0)
    c = Cluster(2, 1, intra=Link("gpu", 500.0, 0.0))
    rec = []
    r = simulate_data_parallel(p, flat_hw(), c, record=rec)
    # two ranks: the 500 B shard 0..0.5, the all-gather of 1000 B (1/2 x 1000 / 500 = 1 s) 0.5..1.5; compute
    # 1.5..4.5; reduce-scatter at 3.5 (1 s) to 4.5; the 500 B shard to the host 4.5..5; AdamW of 50 params
    # at half the node's CPU (50/s) 5..6
    assert r.step_s == pytest.approx(6.0)
    assert r.sim.stall_s == pytest.approx(1.5)
    assert r.sim.h2d_bytes == 500 and r.sim.d2h_bytes == 500 and r.sim.adam_s == pytest.approx(1.0)
    assert r.all_gather_busy_s == pytest.approx(1.0) and r.reduce_scatter_busy_s == pytest.approx(1.0)
    spans = {lane: (s, e) for lane, _, s, e in rec}
    assert spans["all_gather"] == pytest.approx((0.5, 1.5))
    assert spans["reduce_scatter"] == pytest.approx((3.5, 4.5))
    assert spans["adam"] == pytest.approx((5.0, 6.0))


def test_two_nodes_gather_once_then_inside_the_node_by_hand():
    # 2 nodes x 2 GPUs; bucket 0 (1000 B, updated) copied at the start for event 0 and again at event 2
    # for event 3, its grads final at event 3
    p = lane_program(compute_s=(1.0, 1.0, 1.0, 1.0), h2d_event=(STEP_START, 2), h2d_bucket=(0, 0),
                 h2d_bytes=(1000, 1000), waits=((0,), (), (), (1,)), d2h_event=(3,), d2h_bucket=(0,),
                 d2h_bytes=(1000,), adam_numel=(100,))
    c = Cluster(2, 2, intra=Link("gpu", 500.0, 0.0), inter=Link("net", 250.0, 0.0))
    rec = []
    r = simulate_data_parallel(p, flat_hw(), c, record=rec)
    got = {(lane, k): (s, e) for lane, k, s, e in rec}
    # first copy: the rank's 1/4 (250 B, 0.25 s), then the full gather: inter 1/2 x 1000/250 = 2 s + intra
    # 1/2 x 1000/500 = 1 s; then the node's half of the new weights (500 B) back to the host
    assert got[("h2d", 0)] == pytest.approx((0.0, 0.25))
    assert got[("all_gather", 0)] == pytest.approx((0.25, 3.25))
    assert got[("node_copy", 0)] == pytest.approx((3.25, 3.75))
    # compute 3.25..7.25 (event 2 starts at 5.25): the second copy is the node's half (500 B, 0.5 s) and an
    # intra-node gather (1 s): 5.25..5.75..6.75, waited for at 6.25
    assert got[("h2d", 1)] == pytest.approx((5.25, 5.75))
    assert got[("all_gather", 1)] == pytest.approx((5.75, 6.75))
    assert r.sim.stall_s == pytest.approx(3.25 + 0.5)
    # grads at 6.75: reduce-scatter intra 1 s + inter 2 s, the 250 B shard 0.25 s, AdamW of 25 params at 50/s
    assert got[("reduce_scatter", 0)] == pytest.approx((6.75, 9.75))
    assert got[("adam", 0)] == pytest.approx((10.0, 10.5))
    assert r.step_s == pytest.approx(10.5)
    assert r.sim.h2d_bytes == 250 + 500 and r.node_copy_bytes == 500 and r.sim.d2h_bytes == 250 + 500


def test_a_collective_on_a_busy_pcie_link_is_slowed():
    # grads of bucket 0 (8000 B) at event 0: reduce-scatter 0..1 s, their 4000 B shard to the host 1..5 s.
    # Bucket 1 (200 B) copied at event 1: its 100 B shard (at half speed: the other direction is busy) 1..1.2 s, then
    # its all-gather (1/2 x 200 / 4000 = 0.025 s alone) while the grads still copy: over NVLink not slowed,
    # over PCIe (shares_host_link) at the duplex factor
    p = lane_program(h2d_event=(1,), h2d_bucket=(1,), h2d_bytes=(200,), waits=((), (), (0,)),
                 d2h_event=(0,), d2h_bucket=(0,), d2h_bytes=(8000,), adam_numel=(0,))
    fast = simulate_data_parallel(p, flat_hw(duplex=0.5), Cluster(2, 1, intra=Link("nv", 4000.0, 0.0)))
    slow = simulate_data_parallel(p, flat_hw(duplex=0.5), Cluster(2, 1, intra=Link("pcie", 4000.0, 0.0, True)))
    assert fast.reduce_scatter_busy_s == pytest.approx(1.0) and slow.reduce_scatter_busy_s == pytest.approx(1.0)
    assert fast.sim.h2d_busy_s == pytest.approx(0.2)
    assert fast.all_gather_busy_s == pytest.approx(0.025)
    assert slow.all_gather_busy_s == pytest.approx(0.05)


# -- one rank is one GPU ----------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), machines(), st.data())
def test_one_rank_is_the_single_gpu_simulation_bit_for_bit(case, hw, data):
    trace, buckets = case
    compute = draw_compute(data.draw, trace)
    plan = plan_that_fits(trace, buckets, data.draw(st.integers(0, 60000)), hw, compute)
    program = program_of(plan, compute)
    after = data.draw(st.booleans())
    if after:
        program = dataclasses.replace(program, adam_after_backward=True)
    one = Cluster(1, 1, intra=INTRA["pcie4-p2p"])  # even a link shared with the copies: no collective runs
    got = simulate_data_parallel(program, hw, one)
    assert got.sim == simulate_reference(program, hw)  # every field, floats bitwise
    assert got.sim == simulate(program, hw)
    assert (got.all_gather_busy_s, got.reduce_scatter_busy_s, got.all_gather_bytes, got.node_copy_bytes) == (0, 0, 0, 0)
    assert planning_hw(hw, one) is hw
    rank = build_rank_plan(trace, buckets, itemsize=4, budget_bytes=plan.budget_bytes, fixed_bytes=0, hw=hw,
                           cluster=one, compute_s=compute)
    assert rank == plan


def test_zero_offload_on_one_rank_is_the_single_gpu_baseline():
    trace, buckets = _chain(6, 1000)
    hw = flat_hw(bw=1e6, adam=1e5)
    case = Case(trace, buckets, 4, hw, tuple(1e-3 for _ in trace.events), budget_bytes=10**9)
    single = zero_offload(case)
    got = zero_offload_data_parallel(case, Cluster())
    assert got.step_s == pytest.approx(single.step_s, rel=1e-12)
    assert got.peak_bytes == single.peak_bytes and got.fits
    assert zero_offload_program(case).adam_after_backward


def _chain(n_layers, numel):
    from tests.support.planning import chain_trace
    return chain_trace(n_layers, numel)


# -- host memory ------------------------------------------------------------------------------------------


def test_host_bytes_per_rank_are_a_1_over_n_share():
    specs = [ParamSpec(1_000_003 + 17 * i, 0 if i % 5 else None) for i in range(40)]
    buckets = make_buckets(specs, list(range(40)), 8 << 20, 2)
    for lowp, acc in ((2, False), (2, True), (0, False)):
        whole = host_layout(buckets, lowp, acc).total_bytes
        assert host_bytes_per_rank(buckets, lowp, Cluster(), acc) == whole  # one rank: the single-GPU layout
        for g in (2, 4, 8):
            per_rank = host_bytes_per_rank(buckets, lowp, Cluster(g, 1), acc)
            assert per_rank == pytest.approx(whole / g, rel=1e-3)
            assert host_bytes_per_node(buckets, lowp, Cluster(g, 1), acc) == pytest.approx(whole, rel=1e-3)
    # over nodes: optimizer state 1/N, the 16-bit copy once per node (1/G a rank)
    trainable = sum(b.trainable_numel for b in buckets)
    numel = sum(b.numel for b in buckets)
    c = Cluster(4, 2)
    per_node = host_bytes_per_node(buckets, 2, c)
    assert per_node == pytest.approx((4 + 4 + 4 + 2) * trainable / 2 + 2 * numel, rel=1e-3)
    # bf16, no accumulation, every parameter trainable: ~16 B/param a node in all, on one node
    all_trainable = make_buckets([ParamSpec(1 << 20, 0)] * 16, list(range(16)), 8 << 20, 2)
    total = sum(b.numel for b in all_trainable)
    assert host_bytes_per_node(all_trainable, 2, Cluster(8, 1)) == pytest.approx(16 * total, rel=1e-3)


# -- properties of the collective lanes on random plans ---------------------------------------------------


@st.composite
def clusters(draw, min_world=2):
    g = draw(st.integers(1, 8))
    m = draw(st.integers(1 if g >= min_world else 2, 4))
    intra = Link("gpu", draw(st.floats(1e5, 1e9)), draw(st.floats(0, 1e-4)), draw(st.booleans()))
    inter = Link("net", draw(st.floats(1e5, 1e9)), draw(st.floats(0, 1e-4)))
    return Cluster(g, m, intra=intra, inter=inter)


def _lanes(rec):
    out: dict[str, dict[int, tuple[float, float]]] = {}
    for lane, k, s, e in rec:
        out.setdefault(lane, {})[k] = (s, e)
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), machines(), clusters(), st.data())
def test_collectives_follow_the_grads_and_precede_every_use(case, hw, cluster, data):
    trace, buckets = case
    compute = draw_compute(data.draw, trace)
    plan = plan_that_fits(trace, buckets, data.draw(st.integers(0, 60000)), hw, compute)
    program = program_of(plan, compute)
    rec = []
    r = simulate_data_parallel(program, hw, cluster, record=rec)
    lanes = _lanes(rec)
    starts = {i: s for i, (s, _) in lanes.get("compute", {}).items()}
    compute_end = max((e for _, e in lanes.get("compute", {}).values()), default=0.0)
    eps = 1e-12
    # a bucket's reduce-scatter starts only once its last grad is produced (its grad event is reached, or
    # backward is over for a bucket flushed then), its shard goes to the host after it, AdamW after that
    for k, e in enumerate(program.d2h_event):
        rs_start, rs_end = lanes["reduce_scatter"][k]
        assert rs_start >= (starts[e] if e < len(program.compute_s) else compute_end) - eps
        d2h_start, d2h_end = lanes["d2h"][k]
        assert d2h_start >= rs_end - eps
        adam_start, _ = lanes["adam"][k]
        assert adam_start >= d2h_end - eps
    # no event computes with a bucket before the all-gather of its copy finished, and no all-gather starts
    # before this rank's shard landed
    for i, ks in enumerate(program.waits):
        for k in ks:
            assert starts[i] >= lanes["all_gather"][k][1] - eps
    assert len(lanes.get("all_gather", {})) == len(program.h2d_bucket)
    for k, (s, _) in lanes.get("all_gather", {}).items():
        assert s >= lanes["h2d"][k][1] - eps
    # every need is covered by a copy waited for, or by a resident bucket not updated (already there)
    copied = set(program.h2d_bucket)
    bucket_of = {p: b.index for b in buckets for p in b.params}
    for i, uses in enumerate(trace.uses):
        waited = {program.h2d_bucket[k] for k in program.waits[i]}
        for p in uses:
            b = bucket_of[p]
            assert b in waited or (b in plan.resident and b not in copied)
    assert r.step_s >= max(r.all_gather_busy_s, r.reduce_scatter_busy_s, r.sim.compute_s) - eps


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), machines(), clusters(), st.floats(1.0, 100.0), st.data())
def test_step_is_non_increasing_in_inter_node_bandwidth(case, hw, cluster, faster, data):
    """With a duplex factor of 1 every lane is max and + of durations, so a faster network never makes
    the step slower. (With a duplex factor below 1 the simulator samples link sharing at a copy's start,
    which is not monotone by construction; those runs are not claimed here.)"""
    hw = hw.with_(duplex_factor=1.0)
    program = drawn_program(case, hw, data)
    if data.draw(st.booleans()):
        program = dataclasses.replace(program, adam_after_backward=True)
    cluster = dataclasses.replace(cluster, nodes=max(2, cluster.nodes))
    better = dataclasses.replace(cluster, inter=dataclasses.replace(
        cluster.inter, bytes_per_s=cluster.inter.bytes_per_s * faster))
    slow = simulate_data_parallel(program, hw, cluster).step_s
    fast = simulate_data_parallel(program, hw, better).step_s
    assert fast <= slow * (1 + 1e-12) + 1e-15


def test_eight_gpus_on_one_node_keep_the_single_gpu_plan_and_a_1_over_8_host_share():
    """A rank's device plan is planned within its own budget; its copies carry 1/8 of the bytes."""
    trace, buckets = _chain(16, 4096)
    hw = PRESETS["pcie4"]
    compute = [1e-4] * len(trace.events)
    c = cluster_of(8, 1, "nvlink3")
    budget = 6 * 4096 * 4
    plan = build_rank_plan(trace, buckets, itemsize=4, budget_bytes=budget, fixed_bytes=0, hw=hw, cluster=c,
                           compute_s=compute)
    assert plan.peak_bytes <= budget
    one = simulate_data_parallel(program_of(plan, compute), hw, Cluster())
    eight = simulate_data_parallel(program_of(plan, compute), hw, c)
    assert eight.sim.h2d_bytes == pytest.approx(one.sim.h2d_bytes / 8, rel=0.01)
    assert eight.all_gather_bytes == one.sim.h2d_bytes
