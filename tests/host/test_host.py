"""HostState.update, the engine's host-side AdamW, on both paths: the fused C++ kernel (the default) and the
torch ops fallback (``fused=False``, and what runs when the kernel is not built). Each against its own
reference, bit for bit: the kernel against ``adamw_step_reference(exact_sqrt=True)`` with the product of the
grad factors as its scale, the torch path against ``offload.optim.adamw_`` after scaling the grads in place."""

import pytest
import torch

from offload.errors import InvariantError, KernelUnavailableError
from offload.host.cpu_adam import KERNEL_AVAILABLE, adamw_step_reference
from offload.backend.cpu import DONE
from offload.host.state import HostState
from offload.optim import adamw_
from offload.planning.buckets import ParamSpec, make_buckets

pytestmark = pytest.mark.intra_op_threads  # [Note: the suite's intra-op threads] in tests/conftest.py

PATHS = [pytest.param(True, id="fused", marks=pytest.mark.skipif(not KERNEL_AVAILABLE, reason="kernel not built")),
         pytest.param(False, id="torch")]
LOWP = [pytest.param(None, id="fp32"), pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
# two groups, a frozen parameter, odd sizes: buckets with two runs and a frozen tail
SPECS = [ParamSpec(3001, 0), ParamSpec(517, 1), ParamSpec(2048, 0), ParamSpec(77, None), ParamSpec(1500, 1)]
HPARAMS = [(1e-2, 0.9, 0.999, 1e-8, 0.1), (3e-3, 0.8, 0.99, 1e-6, 0.0)]


def _host(lowp, fused, accumulate=False, ring_slots=3) -> tuple[HostState, list[torch.Tensor]]:
    """A host state with random masters and Adam state, and per bucket the grads its update reads: the fp32
    sums with ``accumulate``, else grads in the device dtype (what a ring slot holds when the update runs)."""
    buckets = make_buckets(SPECS, range(len(SPECS)), bucket_bytes=4 * 4000, itemsize=4)
    host = HostState(buckets, SPECS, [torch.Size([s.numel]) for s in SPECS], lowp, fused=fused,
                     accumulate=accumulate, ring_slots=ring_slots)
    gen = torch.Generator().manual_seed(0)
    grads = []
    for b, bucket in enumerate(buckets):
        host.master[b].copy_(torch.randn(host.master[b].numel(), generator=gen))
        host.refresh_lowp(b)
        host.exp_avg[b].copy_(torch.randn(host.exp_avg[b].numel(), generator=gen) * 1e-2)
        host.exp_avg_sq[b].copy_(torch.rand(host.exp_avg_sq[b].numel(), generator=gen) * 1e-4)
        g = torch.randn(bucket.trainable_numel, generator=gen) * 256
        if accumulate:
            host.grad[b].copy_(g)
            grads.append(host.grad[b])
        else:
            grads.append(g.to(lowp or torch.float32))
    return host, grads


def _expected(host: HostState, grads: list[torch.Tensor], b: int, params, factors, fused: bool):
    """What bucket b's buffers must hold after ``update(b, params, HPARAMS, factors, grads[b])``."""
    master, m, v = (t[b].clone() for t in (host.master, host.exp_avg, host.exp_avg_sq))
    grad = grads[b].clone()
    lowp = host.lowp[b].clone() if host.lowp is not None else None
    scale = 1.0
    for f in factors:
        scale *= f
    for p in host.buckets[b].params:
        if p not in params:
            continue
        s = host.offset[p]
        e = s + SPECS[p].numel
        lr, b1, b2, eps, wd = HPARAMS[SPECS[p].group]
        hp = dict(lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd)
        step = host.steps[p] + 1
        if fused:
            adamw_step_reference(master[s:e], grad[s:e], m[s:e], v[s:e], step=step, **hp, grad_scale=scale,
                                 lowp_out=None if lowp is None else lowp[s:e], exact_sqrt=True)
        else:
            g = grad[s:e] if grad.dtype == torch.float32 else grad[s:e].float()  # 16-bit grads widen first
            for f in factors:
                g.mul_(f)
            adamw_(master[s:e], g, m[s:e], v[s:e], step, **hp)
            if lowp is not None:
                lowp[s:e].copy_(master[s:e])
    return master, m, v, lowp


@pytest.mark.parametrize("lowp", LOWP)
@pytest.mark.parametrize("fused", PATHS)
@pytest.mark.parametrize("factors", [(), (2.0**-8, 0.37)], ids=["unscaled", "scaled_and_clipped"])
def test_update_matches_its_reference(fused, lowp, factors):
    host, grads = _host(lowp, fused)
    assert host.check_finite == (lowp == torch.float16)
    for b, bucket in enumerate(host.buckets):
        trainable = [p for p in bucket.params if SPECS[p].group is not None]
        for params in (frozenset(trainable), frozenset(trainable[:1])):  # whole runs, then one parameter alone
            want = _expected(host, grads, b, params, factors, fused)
            frozen_before = host.master[b][bucket.trainable_numel:].clone()
            host.update(b, params, HPARAMS, factors, grads=grads[b])
            got = (host.master[b], host.exp_avg[b], host.exp_avg_sq[b], None if lowp is None else host.lowp[b])
            for name, g, w in zip(("master", "exp_avg", "exp_avg_sq", "lowp"), got, want):
                if w is not None:
                    assert torch.equal(g, w), (b, sorted(params), name)
            assert torch.equal(host.master[b][bucket.trainable_numel:], frozen_before)
            if lowp is not None:  # the copy the next host-to-device copy sends is the master, rounded
                assert torch.equal(host.lowp[b][: bucket.trainable_numel],
                                   host.master[b][: bucket.trainable_numel].to(lowp))
    assert host.steps[0] == 2 and host.steps[3] == 0  # first parameter of bucket 0 stepped twice; frozen never


@pytest.mark.parametrize("lowp", LOWP[1:])
@pytest.mark.parametrize("fused", PATHS)
@pytest.mark.parametrize("factors", [(), (2.0**-8, 0.37)], ids=["unscaled", "scaled_and_clipped"])
def test_16bit_grads_update_exactly_as_the_same_grads_widened(fused, lowp, factors):
    """Without accumulation the grads the update reads stay in the device's 16-bit dtype (the copy moves them
    as they are, into a ring slot); the update is bit for bit the one on the same grads in fp32 (the sum of
    accumulation: widening is exact), on both paths: the numerics of the engine do not change."""
    (narrow, grads), (wide, _) = _host(lowp, fused), _host(lowp, fused, accumulate=True)
    for b in range(len(narrow.buckets)):
        assert grads[b].dtype == lowp and wide.grad[b].dtype == torch.float32
        assert torch.equal(wide.master[b], narrow.master[b]) and torch.equal(wide.exp_avg[b], narrow.exp_avg[b])
        wide.grad[b].copy_(grads[b])
        params = frozenset(p for p in narrow.buckets[b].params if SPECS[p].group is not None)
        narrow.update(b, params, HPARAMS, factors, grads=grads[b])
        wide.update(b, params, HPARAMS, factors)
        for name in ("master", "exp_avg", "exp_avg_sq", "lowp"):
            assert torch.equal(getattr(narrow, name)[b], getattr(wide, name)[b]), (b, name)


@pytest.mark.parametrize("lowp", LOWP)
def test_accumulation_lands_in_the_ring_and_sums_in_fp32(lowp):
    """[Note: grad staging ring]: with accumulation the step's first copy lands in the fp32 sum when the device
    is fp32 and in a ring slot otherwise; later copies always in a ring slot; the sum is the fp32 sum of the
    widened grads."""
    host, _ = _host(lowp, False, accumulate=True)
    device = lowp or torch.float32
    gen = torch.Generator().manual_seed(1)
    for b in range(len(host.buckets)):
        first = host.landing(b, first=True)
        assert first.view.dtype == device and (first.view is host.grad[b]) == (lowp is None)
        assert (first.lent is None) == (lowp is None)
        grads = [(torch.randn(first.view.numel(), generator=gen) * 3).to(device) for _ in range(3)]
        first.view.copy_(grads[0])
        if first.lent is not None:
            host.take_staged(b, True, first.view)
            host.staged_read_by(first.lent, DONE)
        for g in grads[1:]:
            later = host.landing(b, first=False)
            assert later.lent is not None and later.view.numel() == host.buckets[b].trainable_numel
            later.view.copy_(g)
            host.take_staged(b, False, later.view)
            host.staged_read_by(later.lent, DONE)
        want = grads[0].float()
        for g in grads[1:]:
            want = want + g.float()
        assert torch.equal(host.grad[b], want)


def test_the_ring_lends_bytes_in_turn_and_names_their_last_reader():
    """[Note: grad staging ring]: buckets land one after the other in the ring, starting again at its beginning
    when one does not fit; a copy must wait for the readers of every earlier piece it covers (``after``), and
    only for those; bytes lent again before their reader was named are a loud bug; no per-bucket grads are kept
    without accumulation (the arena holds master, copy, m, v and the ring only)."""
    buckets = make_buckets(SPECS, range(len(SPECS)), bucket_bytes=4 * 1000, itemsize=4)  # one parameter each
    host = HostState(buckets, SPECS, [torch.Size([s.numel]) for s in SPECS], torch.bfloat16, fused=False,
                     ring_slots=2)
    sizes = [b.trainable_numel for b in host.buckets]
    assert host.grad == [] and len(sizes) >= 3 and sizes[0] == max(sizes) and min(sizes[:3]) > 0
    two = sorted(sizes, reverse=True)[:2]
    assert sum(2 * n for n in two) <= host.layout.ring_bytes < sum(2 * n for n in two) + 128
    readers = [object() for _ in range(8)]
    lent = []
    for i, b in enumerate([0, 1, 2, 0, 1, 2, 0]):
        got = host.landing(b, first=True)
        assert got.view.dtype == torch.bfloat16 and got.view.numel() == sizes[b] and got.view.data_ptr() % 64 == 0
        lo = got.view.data_ptr() - host.ring.region.data_ptr()
        for j, (other, olo) in enumerate(lent):  # waits for exactly the earlier pieces it overlaps, latest ones
            overlaps = olo < lo + 2 * sizes[b] and lo < olo + 2 * sizes[other]
            if overlaps and all(not (l2 < olo + 2 * sizes[other] and olo < l2 + 2 * sizes[o2])
                                for o2, l2 in lent[j + 1:]):
                assert readers[j] in got.after, (i, j)
        assert len(got.after) <= len(lent) and None not in got.after
        assert lo + 2 * sizes[b] <= host.layout.ring_bytes
        host.staged_read_by(got.lent, readers[i])
        lent.append((b, lo))
    assert lent[1][1] > lent[0][1] and any(lo == 0 for _, lo in lent[1:])  # after the end, the beginning again
    host.landing(0, first=True)  # lent, its reader not named
    with pytest.raises(InvariantError, match="reader"):
        host.landing(0, first=True)
    host.reset_staging()
    assert host.landing(0, first=True).after == ()
    with pytest.raises(InvariantError, match="fp32 grad sums"):
        host.grad_sum(0)
    trainable = sum(bk.trainable_numel for bk in host.buckets)
    frozen = sum(bk.numel for bk in host.buckets) - trainable
    exact = 14 * trainable + 2 * frozen + host.layout.ring_bytes  # master, m, v, copy; frozen copy; the ring
    assert exact <= host.nbytes < exact + 64 * 6 * (len(host.buckets) + 1)  # + 64-byte alignment per region


@pytest.mark.parametrize("fused", PATHS)
def test_fp16_update_refuses_an_inf_grad_and_writes_nothing(fused):
    host, grads = _host(torch.float16, fused)
    bucket = host.buckets[0]
    grads[0][5] = float("inf")
    before = [t[0].clone() for t in (host.master, host.exp_avg, host.exp_avg_sq, host.lowp)]
    params = frozenset(p for p in bucket.params if SPECS[p].group is not None)
    with pytest.raises(InvariantError, match="inf or NaN"):
        host.update(0, params, HPARAMS, grads=grads[0])
    for t, was in zip((host.master, host.exp_avg, host.exp_avg_sq, host.lowp), before):
        assert torch.equal(t[0], was)


def test_fused_needs_the_kernel(monkeypatch):
    import offload.host.state
    monkeypatch.setattr(offload.host.state, "KERNEL_AVAILABLE", False)
    with pytest.raises(KernelUnavailableError, match="kernel"):
        HostState(make_buckets(SPECS, range(len(SPECS)), 4 * 4000, 4), SPECS,
                  [torch.Size([s.numel]) for s in SPECS], None, fused=True)


@pytest.mark.parametrize("lowp", LOWP)
@pytest.mark.parametrize("fused", PATHS)
def test_an_update_in_pieces_is_the_whole_update(fused, lowp):
    """[Note: chunked grad staging]: pieces of a bucket (cut across parameters and runs), each with its own grads
    view, give the whole update's bytes, and the step counts go up once, with the last piece."""
    whole, grads = _host(lowp, fused)
    pieces, _ = _host(lowp, fused)
    for b, bucket in enumerate(whole.buckets):
        params = frozenset(p for p in bucket.params if SPECS[p].group is not None)
        piece_grads = grads[b].clone()  # the torch path scales grads in place
        whole.update(b, params, HPARAMS, (0.5,), grads[b])
        n = bucket.trainable_numel
        cuts = [0, 1, 700, 701, n - 3, n]
        for lo, hi in zip(cuts, cuts[1:]):
            before = list(pieces.steps)
            pieces.update(b, params, HPARAMS, (0.5,), piece_grads[lo:hi], span=(lo, hi))
            assert pieces.steps == (before if hi < n else whole.steps)
        for name in ("master", "exp_avg", "exp_avg_sq") + (("lowp",) if lowp else ()):
            assert torch.equal(getattr(pieces, name)[b], getattr(whole, name)[b]), (b, name)


def test_rehome_moves_every_region_exactly_and_parks_on_demand():
    """[Note: device-homed buckets]: a bucket made device-homed loses its regions (a smaller arena), comes back
    home from its parked copy bit for bit; the others' regions and the grad sums move with the arena."""
    host, _ = _host(torch.bfloat16, False, accumulate=True)
    regions = ("master", "lowp", "exp_avg", "exp_avg_sq", "grad")
    before = {name: [t.clone() for t in getattr(host, name)] for name in regions}
    full = host.nbytes
    old = host.rehome(frozenset({0}))
    assert host.nbytes < full and old.size_bytes == full and host.away == {0}
    assert not host.has_copy(0) and host.parked_bytes == 0 and host.region_bytes(0) == 4 * host.buckets[0].trainable_numel
    with pytest.raises(InvariantError, match="no host copy"):
        host.read_param(0)
    with pytest.raises(InvariantError, match="without a host copy"):
        host.rehome(frozenset())  # bucket 0 has nothing to come home with
    host.park(0)  # what the device optimizer does before copying the device state back
    for name in ("master", "lowp", "exp_avg", "exp_avg_sq"):
        getattr(host, name)[0].copy_(before[name][0])
    assert host.parked_bytes > 0
    host.rehome(frozenset())
    assert host.nbytes == full and not host.parked and host.has_copy(0)
    for name in regions:
        for b, value in enumerate(before[name]):
            assert torch.equal(getattr(host, name)[b], value), (name, b)
    host.rehome(frozenset({1}))
    host.park(1)
    host.drop(1)
    assert not host.has_copy(1) and host.parked_bytes == 0


def test_step_counts_are_0_dim_views_that_follow_every_count():
    """[Note: step tensors]: a run's count is one op where its parameters agree, per parameter where
    they do not; each optimizer.state[p]["step"] is a 0-dim fp32 tensor with its own count."""
    from offload.host.state import HostState, step_tensors

    values, steps = step_tensors(4)
    assert all(t.dim() == 0 and t.dtype == torch.float32 for t in steps)

    class Counts:  # the two attributes _count uses, without a whole arena
        _count = HostState._count

        def __init__(self):
            self.steps = [0] * 4
            self.step_values, self.step_tensor = values, steps
            self._step_index = {}

    c = Counts()
    c._count((0, 1, 2))  # all at 0: one op
    c._count((0, 1, 2))
    c._count((3,))
    c._count((2, 3))  # 2 at 2 -> 3, 3 at 1 -> 2: they differ, per parameter
    assert c.steps == [2, 2, 3, 2]
    assert [float(t) for t in steps] == [2.0, 2.0, 3.0, 2.0]
    assert list(c._step_index) == [(0, 1, 2)]


def test_step_views_load_into_plain_torch_adamw_and_count_apart():
    """[Note: step tensors]: a state dict whose steps are views of one vector, saved and loaded into torch's own
    AdamW after close (leaving offload), steps each parameter on its own: one count per parameter, not shared."""
    import io

    import offload

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    engine = offload.wrap(model, opt, budget="64MiB", device="cpu")
    for _ in range(3):
        engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
        opt.step()
        opt.zero_grad()
    state = opt.state_dict()
    assert [float(s["step"]) for s in state["state"].values()] == [3.0] * 4
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    engine.close()
    plain = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plain.load_state_dict(torch.load(buf))
    model[2].weight.grad = torch.ones_like(model[2].weight)  # one parameter steps: the others must not count
    plain.step()
    assert [float(plain.state[p]["step"]) for p in model.parameters()] == [3.0, 3.0, 4.0, 3.0]


def test_a_runs_count_is_one_op_on_its_slice_where_its_parameters_are_consecutive_else_on_their_indices():
    """[Note: step tensors] (host/steps.py): ``count_run`` fills a run of consecutive parameters' counts through
    their slice of the vector (cached per run, a view of it: nothing copied) and any other run's through
    ``index_fill_`` with their indices; both give every count of the run the new value and touch no other."""
    from offload.host.steps import count_run, step_tensors

    values, steps = step_tensors(6)
    cache: dict = {}
    count_run(values, cache, (1, 2, 3), 4)
    count_run(values, cache, (0, 2, 5), 7)
    count_run(values, cache, (1, 2, 3), 5)
    assert [float(t) for t in steps] == [7.0, 5.0, 5.0, 5.0, 0.0, 7.0]
    consecutive, spread = cache[(1, 2, 3)], cache[(0, 2, 5)]
    assert consecutive.dtype == torch.float32 and consecutive.data_ptr() == values[1:].data_ptr()
    assert spread.dtype == torch.int64 and spread.tolist() == [0, 2, 5]
