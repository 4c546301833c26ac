"""Bucketing and host layout (pure functions)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.planning.buckets import (
    HOST_ALIGN,
    PARAM_ALIGN,
    ParamSpec,
    host_layout,
    make_buckets,
)

specs_st = st.lists(st.tuples(st.integers(1, 5000), st.sampled_from([None, 0, 1, 2])), min_size=1, max_size=60)


def _padded(off: int, itemsize: int) -> int:
    align = max(1, PARAM_ALIGN // itemsize)
    return (off + align - 1) // align * align


@settings(max_examples=200, deadline=None)
@given(specs_st, st.integers(4, 40000), st.randoms(use_true_random=False), st.sampled_from([4, 2]))
def test_every_param_once_never_straddles_first_use_order(raw, bucket_bytes, rnd, itemsize):
    specs = [ParamSpec(n, g) for n, g in raw]
    order = list(range(len(specs)))
    rnd.shuffle(order)
    buckets = make_buckets(specs, order, bucket_bytes, itemsize=itemsize)
    seen = [p for b in buckets for p in b.params]
    assert sorted(seen) == list(range(len(specs)))  # each parameter exactly once
    for b in buckets:
        # in bucket order, each parameter at the next aligned offset: non-overlapping, no more padding than
        # alignment needs, in bounds
        pos = 0
        for off, p in zip(b.offsets, b.params):
            assert off == _padded(pos, itemsize)
            pos = off + specs[p].numel
        assert pos == b.numel
        # over-size buckets only for a single oversize parameter
        assert b.nbytes(itemsize) <= bucket_bytes or len(b.params) == 1
        # trainable prefix, grouped into runs; frozen after
        groups = [specs[p].group for p in b.params]
        n_train = sum(g is not None for g in groups)
        assert all(g is not None for g in groups[:n_train]) and all(g is None for g in groups[n_train:])
        ends = [off + specs[p].numel for off, p in zip(b.offsets, b.params)]
        assert b.trainable_numel == (ends[n_train - 1] if n_train else 0)
        run_params = [p for r in b.runs for p in r.params]
        assert run_params == list(b.params[:n_train])
        for r in b.runs:
            assert {specs[p].group for p in r.params} == {r.group}
            first, last = r.params[0], r.params[-1]
            assert r.start == b.offsets[b.params.index(first)]
            assert r.end == b.offsets[b.params.index(last)] + specs[last].numel
    # buckets follow first-use order: a bucket's members come from one contiguous stretch of ``order``
    where = {p: i for i, p in enumerate(order)}
    spans = [(min(where[p] for p in b.params), max(where[p] for p in b.params)) for b in buckets]
    for (_, hi), (lo, _) in zip(spans, spans[1:]):
        assert hi < lo


def test_greedy_packing_example():
    specs = [ParamSpec(12, 0), ParamSpec(8, None), ParamSpec(25, 0), ParamSpec(5, 1)]
    buckets = make_buckets(specs, [0, 1, 2, 3], bucket_bytes=80, itemsize=4)  # 20 elements per bucket
    assert [b.params for b in buckets] == [(0, 1), (2,), (3,)]
    assert buckets[0].trainable_numel == 12 and buckets[0].offsets == (0, 12)


@settings(max_examples=200, deadline=None)
@given(specs_st, st.integers(4, 40000), st.sampled_from([4, 2]))
def test_every_parameter_starts_16_byte_aligned_on_device_and_host(raw, bucket_bytes, itemsize):
    """fp32, bf16/fp16 buckets: each parameter's start is 16-byte aligned in the device dtype, and so in every
    host region (fp32 regions at twice the bytes, each region starting HOST_ALIGN-aligned). Issue 21, defect 6:
    packed back to back, one odd size misaligned every later parameter of its bucket."""
    specs = [ParamSpec(n, g) for n, g in raw]
    buckets = make_buckets(specs, list(range(len(specs))), bucket_bytes, itemsize)
    lowp = itemsize if itemsize == 2 else 0
    for accumulate in (False, True):
        lay = host_layout(buckets, lowp, accumulate)
        for b in buckets:
            for off in b.offsets:
                assert off * itemsize % 16 == 0
                for region, size in ((lay.master, 4), (lay.lowp, lowp), (lay.grad, lay.grad_itemsize),
                                     (lay.staging, lay.staging_itemsize), (lay.exp_avg, 4), (lay.exp_avg_sq, 4)):
                    assert (region[b.index] + off * size) % 16 == 0


def test_padding_packs_sizes_that_are_multiples_of_the_alignment_as_before():
    """Sizes already aligned pack exactly as they did without padding (the planner sees the same buckets)."""
    specs = [ParamSpec(n, 0) for n in (256, 1024, 64, 8, 512, 256)]
    buckets = make_buckets(specs, range(len(specs)), bucket_bytes=2 * 1100, itemsize=2)
    assert [b.params for b in buckets] == [(0,), (1, 2, 3), (4, 5)]
    assert [b.offsets for b in buckets] == [(0,), (0, 1024, 1088), (0, 512)]
    odd = make_buckets([ParamSpec(n, 0) for n in (3, 5, 7)], range(3), bucket_bytes=48, itemsize=2)
    assert [b.params for b in odd] == [(0, 1, 2)] and odd[0].offsets == (0, 8, 16) and odd[0].numel == 23


def test_bad_order_rejected():
    with pytest.raises(ValueError, match="permutation"):
        make_buckets([ParamSpec(1, 0)] * 2, [0, 0], 16, 4)


@given(specs_st, st.integers(4, 40000))
def test_host_layout_disjoint_and_aligned(raw, bucket_bytes):
    specs = [ParamSpec(n, g) for n, g in raw]
    buckets = make_buckets(specs, list(range(len(specs))), bucket_bytes, 4)
    lay = host_layout(buckets)
    regions = []
    for b in buckets:
        regions.append((lay.master[b.index], b.numel * 4))
        for f in (lay.grad, lay.exp_avg, lay.exp_avg_sq):
            regions.append((f[b.index], b.trainable_numel * 4))
    for off, _ in regions:
        assert off % HOST_ALIGN == 0
    spans = sorted((o, o + n) for o, n in regions if n)
    for (_, e), (s, _) in zip(spans, spans[1:]):
        assert e <= s
    assert all(e <= lay.total_bytes for _, e in spans)
    # exactly 16 bytes per trainable and 4 per frozen element, plus alignment padding only
    exact = sum(b.numel * 4 + 3 * b.trainable_numel * 4 for b in buckets)
    assert exact <= lay.total_bytes <= exact + len(regions) * HOST_ALIGN


def test_host_layout_16bit_keeps_no_master_for_frozen():
    """With a 16-bit copy, a frozen parameter is that copy only: 2 bytes, against 4 + 2 + 2 (its 16-bit grad)
    + 2 x 4 trainable; with accumulation an fp32 sum (4) and a 16-bit staging copy (2) instead of the grad."""
    specs = [ParamSpec(104, 0), ParamSpec(296, None), ParamSpec(48, 0), ParamSpec(72, None)]
    buckets = make_buckets(specs, [0, 1, 2, 3], 10_000, 2)
    assert len(buckets) == 1 and buckets[0].trainable_numel == 152  # aligned sizes: no padding
    fp32, bf16 = host_layout(buckets), host_layout(buckets, lowp_itemsize=2)
    fp32_acc, bf16_acc = host_layout(buckets, accumulate=True), host_layout(buckets, 2, accumulate=True)
    for lay, exact in ((fp32, 152 * 16 + 368 * 4), (bf16, 152 * 16 + 368 * 2),
                       (fp32_acc, 152 * 20 + 368 * 4), (bf16_acc, 152 * 20 + 368 * 2)):
        assert exact <= lay.total_bytes <= exact + 6 * HOST_ALIGN
    assert (bf16.grad_itemsize, bf16.staging_itemsize) == (2, 0)
    assert (bf16_acc.grad_itemsize, bf16_acc.staging_itemsize) == (4, 2)
    assert (fp32_acc.grad_itemsize, fp32_acc.staging_itemsize) == (4, 4)


def test_auto_bucket_size_reaches_90_percent_of_the_link_and_stays_small_next_to_the_weights():
    """Issue 18: ``bucket_bytes="auto"`` is the smallest copy at 90 % of the link's peak on the curve (the
    byte before it is under), capped at 1/8 of the weights so a small model still streams."""
    from offload.planning.buckets import auto_bucket_bytes, resolve_bucket_bytes
    from offload.planning.hw import PRESETS
    for hw in PRESETS.values():
        n = hw.bytes_reaching(0.9)
        assert n / hw.h2d_seconds(n) >= 0.9 * hw.peak_h2d > (n - 1) / hw.h2d_seconds(n - 1)
        assert n <= hw.bucket_bytes_hint(0.9)  # on the curve, not only at its measured sizes
        big = [ParamSpec(2**30, 0)] * 4  # 8 GiB in bf16: the link decides
        assert auto_bucket_bytes(big, 2, hw) == n
    hw = PRESETS["pcie4"]
    small = [ParamSpec(1000 * 1000, 0)] * 3  # 6 MB in bf16: 1/8 of it
    size = auto_bucket_bytes(small, 2, hw)
    assert size == 6_000_000 // 8 < hw.bytes_reaching(0.9)
    buckets = make_buckets(small, range(3), size, 2)
    assert len(buckets) == 3  # a parameter over the cap gets its own bucket; the model streams
    assert resolve_bucket_bytes("auto", small, 2, hw) == size and resolve_bucket_bytes(4096, small, 2, hw) == 4096
    with pytest.raises(TypeError):
        resolve_bucket_bytes("32MiB", small, 2, hw)  # OffloadConfig parses sizes; here only ints or "auto"


def test_ring_pieces_scale_with_the_model_between_4_and_32_mib():
    """[Note: ring pieces scale with the model]: 1/128 of the trainable grads in the device dtype, at least
    GRAD_RING_CHUNK_BYTES (small models keep their ring, issue 18's bytes per parameter) and at most 32 MiB."""
    from offload.planning.buckets import (GRAD_RING_CHUNK_BYTES, GRAD_RING_CHUNK_MAX_BYTES, GRAD_RING_SLOTS,
                                          grad_ring_chunk_bytes)
    assert GRAD_RING_CHUNK_BYTES == 4 << 20 and GRAD_RING_CHUNK_MAX_BYTES == 32 << 20

    def buckets(n_params: int, frozen: int = 0):
        specs = [ParamSpec(n_params // 8, 0)] * 8 + [ParamSpec(frozen, None)] * bool(frozen)  # None: frozen
        return make_buckets(specs, range(len(specs)), 2 * n_params // 8, 2)

    gpt2 = buckets(124_000_000)  # 248 MB of bf16 grads: 1/128 is 1.9 MB, under the floor
    assert grad_ring_chunk_bytes(gpt2, 2) == 4 << 20
    xl = buckets(1_558_000_000)  # 3.1 GB: 24.3 MB, between
    assert grad_ring_chunk_bytes(xl, 2) == 2 * 1_558_000_000 // 8 * 8 // 128
    assert grad_ring_chunk_bytes(buckets(2_652_000_000), 2) == 32 << 20  # 5.3 GB: the cap
    assert grad_ring_chunk_bytes(buckets(2_652_000_000), 4) == 32 << 20  # fp32 grads
    # frozen parameters send no grads: they do not count
    assert grad_ring_chunk_bytes(buckets(124_000_000, frozen=10**9), 2) == 4 << 20
    assert grad_ring_chunk_bytes(xl, 2, floor=0) == 0  # no cap at all, as chunk_bytes=0
    # the ring stays a small share of the grads it stages, and the host layout follows the pieces
    lay = host_layout(xl, 2, ring=GRAD_RING_SLOTS, chunk_bytes=grad_ring_chunk_bytes(xl, 2))
    assert lay.ring_bytes <= GRAD_RING_SLOTS * grad_ring_chunk_bytes(xl, 2) + GRAD_RING_SLOTS * HOST_ALIGN
    assert lay.ring_bytes < 0.025 * 2 * 1_558_000_000
