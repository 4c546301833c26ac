"""The fused C++ AdamW (cpp/cpu_adam) against torch: its reference in torch ops, torch.optim.AdamW itself,
and torch's own dtype conversions."""

from __future__ import annotations

import platform

import pytest
import torch

from offload import _C
from offload.host.cpu_adam import (
    KERNEL_AVAILABLE,
    adamw_step,
    adamw_step_at,
    adamw_step_reference,
    kernel_info,
)
from offload.optim import adamw_

pytestmark = [pytest.mark.skipif(not KERNEL_AVAILABLE, reason="offload._C was built without the CPU AdamW"),
              pytest.mark.intra_op_threads]  # [Note: the suite's intra-op threads] in tests/conftest.py

X86 = platform.machine().lower() in ("x86_64", "amd64")

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _supports(isa: str) -> bool:
    """Whether the kernel can be forced onto ``isa`` here (it refuses one the CPU lacks)."""
    one = torch.zeros(1)
    try:
        _C.adamw_step(one.data_ptr(), one.data_ptr(), one.data_ptr(), one.data_ptr(), "float32", 0, "bfloat16",
                      0, 1, 0.0, 0.9, 0.999, 1e-8, 0.0, isa=isa)
    except ValueError:
        return False
    return True


ISAS = [isa for isa in ("avx512", "avx2", "baseline") if _supports(isa)]  # best first


def run_kernel(p, g, m, v, *, isa="auto", lowp=None, num_threads=2, check_finite=False, step=1, grad_scale=1.0,
               **hp):
    hp = {**HP, **hp}
    return _C.adamw_step(p.data_ptr(), m.data_ptr(), v.data_ptr(), g.data_ptr(), DTYPE_NAMES[g.dtype],
                         0 if lowp is None else lowp.data_ptr(),
                         "bfloat16" if lowp is None else DTYPE_NAMES[lowp.dtype], p.numel(), step, hp["lr"],
                         hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"], grad_scale, check_finite,
                         num_threads, isa)


def state(n: int, grad_dtype=torch.float32, seed: int = 0, offset: int = 0):
    """param, grad, m, v of length n, each a view starting ``offset`` elements into a larger buffer (so
    ``offset`` 1 or 3 gives 4-byte but not 16/64-byte alignment)."""
    gen = torch.Generator().manual_seed(seed)

    def view(t):
        buf = torch.empty(n + offset + 5, dtype=t.dtype)
        out = buf[offset:offset + n]
        out.copy_(t)
        return out

    p = view(torch.randn(n, generator=gen))
    g = view(torch.randn(n, generator=gen).to(grad_dtype))
    m = view(torch.randn(n, generator=gen) * 0.1)
    v = view(torch.rand(n, generator=gen) * 0.01)
    return p, g, m, v


def clones(*ts):
    return [t.clone() for t in ts]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()]).to(torch.int64)


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan), f"{what}: nan in different places"
    diff = (bits(actual) != bits(expected)) & ~nan
    assert not diff.any(), (f"{what}: {int(diff.sum())} of {diff.numel()} differ, first at "
                            f"{int(diff.nonzero()[0])}: {actual[diff][:3].tolist()} vs {expected[diff][:3].tolist()}")


def ulp(x: torch.Tensor) -> torch.Tensor:
    x = x.abs()
    return torch.nextafter(x, torch.full_like(x, float("inf"))) - x


def assert_close_to_torch(param: torch.Tensor, expected: torch.Tensor, update: torch.Tensor, update_ulps: int) -> None:
    """The master against torch's formula. The denominator differs from torch's by a few ulps at most: the
    kernel multiplies sqrt(v) by the rounded reciprocal of the bias correction where torch divides (equal or
    1 ulp off), and plain torch's sqrt (MKL) is 1 ulp low on some elements. So the update term differs by up
    to ``update_ulps`` of its ulps (2 against torch's formula with an exact sqrt, 3 against plain torch ops,
    where both effects add) and the rounded sum by 1 ulp of its own: |diff| <= ulp(param) + update_ulps *
    ulp(update). That is at most 1 ulp of the master wherever |update| <= |master| / 4 (checked too); only
    where the update is as large as the master (cancellation) can it be more. Nearly all elements must
    still agree exactly (the masters here are ~1000x their update)."""
    diff = (param.double() - expected.double()).abs()
    bound = ulp(expected).double() + update_ulps * ulp(update).double()
    assert bool((diff <= bound).all()), f"max excess {float((diff - bound).max())}"
    small = update.abs() <= expected.abs() / 4
    assert bool((diff <= ulp(expected).double())[small].all()), "more than 1 ulp where the update is small"
    assert float((param != expected).float().mean()) < 0.02


# --- bitwise against the reference --------------------------------------------------------------------


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lowp_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "offset"), [(0, 0), (1, 0), (15, 1), (1037, 3), (70_001, 1)])
def test_bitwise_every_dtype_combination(isa, grad_dtype, lowp_dtype, n, offset):
    p, g, m, v = state(n, grad_dtype, seed=n, offset=offset)
    lowp = None if lowp_dtype is None else torch.full((n,), 7.0, dtype=lowp_dtype)
    rp, rm, rv = clones(p, m, v)
    rlowp = None if lowp is None else lowp.clone()
    kw = dict(step=3, grad_scale=0.5, **HP)
    assert run_kernel(p, g, m, v, isa=isa, lowp=lowp, **kw) is False
    # The baseline x86 kernel cannot assume an FMA unit, like torch's baseline kernels.
    fused = isa != "baseline" or not X86
    assert adamw_step_reference(rp, g, rm, rv, lowp_out=rlowp, exact_sqrt=True, fused=fused, **kw) is False
    for name, a, b in (("param", p, rp), ("exp_avg", m, rm), ("exp_avg_sq", v, rv)):
        assert_bitwise(a, b, name)
    if lowp is not None:
        assert_bitwise(lowp, rlowp, "lowp_out")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("check_finite", [False, True])
def test_16bit_grad_gives_the_update_of_the_same_grad_widened(isa, grad_dtype, check_finite):
    """The engine copies 16-bit grads to the host as they are (issue 21, defect 4) where it used to widen
    them on the device first: the kernel must not care, bit for bit (widening is exact)."""
    p, g, m, v = state(4099, grad_dtype, seed=7, offset=1)
    wp, wm, wv = clones(p, m, v)
    lowp, wlowp = torch.zeros(4099, dtype=torch.bfloat16), torch.zeros(4099, dtype=torch.bfloat16)
    kw = dict(step=5, grad_scale=2.0**-7, check_finite=check_finite, isa=isa)
    assert run_kernel(p, g, m, v, lowp=lowp, **kw) is False
    assert run_kernel(wp, g.float(), wm, wv, lowp=wlowp, **kw) is False
    for name, a, b in (("param", p, wp), ("exp_avg", m, wm), ("exp_avg_sq", v, wv), ("lowp_out", lowp, wlowp)):
        assert_bitwise(a, b, name)


@pytest.mark.parametrize(("beta1", "beta2", "weight_decay", "grad_scale"),
                         [(0.9, 0.999, 0.0, 1.0), (0.3, 0.95, 0.01, 1.0), (0.0, 0.0, 0.5, 3.0), (0.5, 0.5, 0.1, 1e-4)])
def test_bitwise_over_steps_and_hyperparameters(beta1, beta2, weight_decay, grad_scale):
    # beta1 >= 0.5 and < 0.5 take torch's two lerp formulas; beta1 = 0 makes m the grad.
    p, _, m, v = state(4099, seed=1)
    rp, rm, rv = clones(p, m, v)
    gen = torch.Generator().manual_seed(2)
    for step in range(1, 6):
        g = torch.randn(4099, generator=gen).bfloat16()
        hp = dict(lr=1e-2 / step, beta1=beta1, beta2=beta2, eps=1e-6, weight_decay=weight_decay)
        adamw_step(p, g, m, v, step=step, grad_scale=grad_scale, **hp)
        adamw_step_reference(rp, g, rm, rv, step=step, grad_scale=grad_scale, exact_sqrt=True, **hp)
    for a, b in ((p, rp), (m, rm), (v, rv)):
        assert_bitwise(a, b, "after 5 steps")


def test_against_plain_torch_ops_m_v_bitwise_param_within_one_ulp():
    # Plain torch (offload.optim.adamw_): its sqrt on large tensors is MKL's, which is not correctly
    # rounded, and it divides by the bias correction where the kernel multiplies by its reciprocal, so the
    # master may differ by 1 ulp; m and v involve neither and agree exactly.
    p, g, m, v = state(50_000, seed=3)
    rp, rm, rv = clones(p, m, v)
    for step in (1, 2, 3):
        before = p * (1 - HP["lr"] * HP["weight_decay"])
        adamw_step(p, g, m, v, step=step, **HP)
        adamw_(rp, g, rm, rv, step, **HP)
        assert_bitwise(m, rm, "exp_avg")
        assert_bitwise(v, rv, "exp_avg_sq")
        assert_close_to_torch(p, rp, rp - before, update_ulps=3)
        rp.copy_(p)  # keep the 1-ulp differences from compounding through the next steps


def test_against_torch_optim_adamw():
    # The real thing: torch.optim.AdamW(foreach=False) on a parameter tensor, five steps.
    p0 = torch.randn(3000, generator=torch.Generator().manual_seed(4))
    param = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([param], foreach=False, fused=False, lr=3e-3, betas=(0.8, 0.99), eps=1e-7,
                            weight_decay=0.05)
    p, m, v = p0.clone(), torch.zeros(3000), torch.zeros(3000)
    gen = torch.Generator().manual_seed(5)
    for step in range(1, 6):
        g = torch.randn(3000, generator=gen)
        param.grad = g.clone()
        before = param.detach() * (1 - 3e-3 * 0.05)
        opt.step()
        adamw_step(p, g, m, v, step=step, lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-7, weight_decay=0.05)
        st = opt.state[param]
        assert_bitwise(m, st["exp_avg"], "exp_avg")
        assert_bitwise(v, st["exp_avg_sq"], "exp_avg_sq")
        assert_close_to_torch(p, param.detach(), param.detach() - before, update_ulps=3)
        p.copy_(param.detach())


@pytest.mark.parametrize(("beta2", "step"), [(0.999, 1), (0.999, 3), (0.95, 7), (0.5, 2), (0.999, 1000)])
@pytest.mark.parametrize("scale", [1.0, 1e-3])
def test_reciprocal_against_torch_formula(beta2, step, scale):
    # The one op the kernel changes: sqrt(v) * r, r = 1 / float(bias_correction2_sqrt) rounded once, where
    # torch computes sqrt(v) / bias_correction2_sqrt. Against torch's formula with a correctly rounded sqrt
    # (the reference with reciprocal=False): m and v bitwise, that term within 1 ulp, the master within
    # ulp(master) + 2 ulp(update) and within 1 ulp where the update is small (see assert_close_to_torch).
    # scale 1e-3 makes masters as small as their updates: there many differ, so the check has teeth.
    n = 200_003
    gen = torch.Generator().manual_seed(step)
    p, m = torch.randn(n, generator=gen) * scale, torch.randn(n, generator=gen) * 0.1
    v, g = torch.rand(n, generator=gen) * 0.01, torch.randn(n, generator=gen).bfloat16()
    rp, rm, rv = clones(p, m, v)
    before = p * (1 - HP["lr"] * HP["weight_decay"])
    hp = dict(HP, beta2=beta2)
    adamw_step(p, g, m, v, step=step, num_threads=2, **hp)
    adamw_step_reference(rp, g, rm, rv, step=step, exact_sqrt=True, reciprocal=False, **hp)
    assert_bitwise(m, rm, "exp_avg")
    assert_bitwise(v, rv, "exp_avg_sq")
    update = rp - before
    if scale == 1.0:
        assert_close_to_torch(p, rp, update, update_ulps=2)
    else:
        diff = (p.double() - rp.double()).abs()
        assert bool((diff <= ulp(rp).double() + 2 * ulp(update).double()).all())
        assert bool((diff <= ulp(rp).double())[update.abs() <= rp.abs() / 4].all())
        assert not torch.equal(p, rp)
    root = v.double().sqrt().float()
    bc2_sqrt = (1 - beta2**step) ** 0.5
    inv = (torch.tensor(1.0) / torch.tensor(bc2_sqrt, dtype=torch.float32)).item()
    quotient, product = root / bc2_sqrt, root * inv
    assert bool(((product.double() - quotient.double()).abs() <= ulp(quotient).double()).all())


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_thread_count_does_not_change_results(threads):
    p, g, m, v = state(200_003, torch.bfloat16, seed=6, offset=1)
    lowp = torch.empty(200_003, dtype=torch.bfloat16)
    rp, rm, rv = clones(p, m, v)
    rlowp = lowp.clone()
    run_kernel(p, g, m, v, lowp=lowp, num_threads=threads)
    run_kernel(rp, g, rm, rv, lowp=rlowp, num_threads=1)
    for a, b in ((p, rp), (m, rm), (v, rv), (lowp, rlowp)):
        assert_bitwise(a, b, f"{threads} threads")


# --- the work split ([Note: work split under contention] in cpp/cpu_adam.cpp) ---------------------------

MIN_PER_WORKER, CHUNKS_PER_WORKER, MIN_CHUNK, LINE = 1 << 15, 8, 1 << 15, 16  # cpp/cpu_adam.cpp's constants


def chunk_bounds(n: int, threads: int) -> list[tuple[int, int]]:
    """The chunks cpp/cpu_adam.cpp's split_of cuts [0, n) into on ``threads`` threads: a copy of its arithmetic,
    used only to place values at chunk borders (were the two to drift apart, the tests below would still check
    every element bit for bit, but no longer exactly at the borders)."""
    workers = min(threads, max(1, n // MIN_PER_WORKER))
    if workers == 1:
        return [(0, n)]
    per_worker = min(max(n // (workers * MIN_CHUNK), 1), CHUNKS_PER_WORKER)
    chunk = (-(-n // (workers * per_worker)) + LINE - 1) // LINE * LINE
    return [(begin, min(n, begin + chunk)) for begin in range(0, n, chunk)]


# Sizes not a multiple of a chunk (the last is shorter) nor of a cache line. On 2, 3 and 7 threads the first
# gets the most chunks per worker (16, 24, 56 chunks), the second fewer (8, 9 and 7: one per worker).
SPLIT_SIZES = (7 * CHUNKS_PER_WORKER * MIN_CHUNK + 777, 3 * 3 * MIN_CHUNK + 4321)
SPLIT_THREADS = (1, 2, 3, 7)
INT_OF = {4: torch.int32, 2: torch.int16}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("grad_dtype", "lowp_dtype"),
                         [(torch.float32, None), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                          (torch.float32, torch.bfloat16)])
def test_split_into_chunks_is_bitwise_the_reference(isa, grad_dtype, lowp_dtype):
    # Every element, at every chunk border, exactly as the reference computes it, on 1, 2, 3 and 7 threads:
    # a chunk dropped, repeated or overlapping its neighbour by one element shows here.
    kw = dict(step=2, grad_scale=0.25, **HP)
    fused = isa != "baseline" or not X86  # see test_bitwise_every_dtype_combination
    for n in SPLIT_SIZES:
        assert [len(chunk_bounds(n, t)) for t in SPLIT_THREADS] in ([1, 16, 24, 56], [1, 8, 9, 7])
        p0, g, m0, v0 = state(n, grad_dtype, seed=n, offset=1)
        lowp0 = None if lowp_dtype is None else torch.full((n,), 7.0, dtype=lowp_dtype)
        rp, rm, rv = clones(p0, m0, v0)
        rlowp = None if lowp0 is None else lowp0.clone()
        adamw_step_reference(rp, g, rm, rv, lowp_out=rlowp, exact_sqrt=True, fused=fused, **kw)
        for threads in SPLIT_THREADS:
            p, m, v = clones(p0, m0, v0)
            lowp = None if lowp0 is None else lowp0.clone()
            assert run_kernel(p, g, m, v, isa=isa, lowp=lowp, num_threads=threads, **kw) is False
            outputs = (("param", p, rp), ("exp_avg", m, rm), ("exp_avg_sq", v, rv), ("lowp_out", lowp, rlowp))
            for name, a, ref in outputs:
                same = a is None or torch.equal(a.view(INT_OF[a.element_size()]), ref.view(INT_OF[a.element_size()]))
                if not same:  # (a fast check first: assert_bitwise takes ~60 ms on these sizes)
                    assert_bitwise(a, ref, f"{name}, n={n}, {threads} threads")


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_found_inf_in_any_chunk_skips_the_update(grad_dtype):
    # One non-finite grad anywhere (first element, a middle chunk's first and last, the last element of the
    # shorter last chunk), whichever worker checks its chunk and in whatever order the chunks are taken:
    # found, and nothing written, on 1, 2, 3 and 7 threads. With the grad finite again the update happens.
    n = SPLIT_SIZES[0]
    p, g, m, v = state(n, grad_dtype, seed=11)
    lowp = torch.full((n,), 3.0, dtype=torch.bfloat16)
    before = clones(p, m, v, lowp)
    for threads in SPLIT_THREADS:
        chunks = chunk_bounds(n, threads)
        middle = chunks[len(chunks) // 2]
        for at in (0, middle[0], middle[1] - 1, n - 1):
            good = g[at].item()
            for bad in (float("nan"), float("inf")):
                g[at] = bad
                found = run_kernel(p, g, m, v, lowp=lowp, check_finite=True, num_threads=threads)
                assert found is True, f"{bad} at {at} of {n}, {threads} threads"
                for a, b in zip((p, m, v, lowp), before):
                    size = a.element_size()
                    assert torch.equal(a.view(INT_OF[size]), b.view(INT_OF[size])), "found-inf must write nothing"
            g[at] = good
    assert run_kernel(p, g, m, v, lowp=lowp, check_finite=True, num_threads=7) is False
    assert not torch.equal(p, before[0])


def test_default_threads_follow_torch(monkeypatch):
    seen = []
    monkeypatch.setattr(_C, "adamw_step", lambda *args: seen.append(args[-1]) or False)
    p, g, m, v = state(10)
    adamw_step(p, g, m, v, step=1, **HP)
    adamw_step(p, g, m, v, step=1, num_threads=1, **HP)
    assert seen == [torch.get_num_threads(), 1]


# --- conversions -----------------------------------------------------------------------------------


def special_floats() -> torch.Tensor:
    """fp32 values around every bf16/fp16 rounding boundary, subnormals, overflow, signed zeros."""
    halves = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    edges = [halves.view(torch.float16).float(), halves.view(torch.bfloat16).float()]
    raw = torch.cat([t[torch.isfinite(t)] for t in edges])
    nudged = [raw, torch.nextafter(raw, torch.tensor(float("inf"))), torch.nextafter(raw, torch.tensor(-float("inf")))]
    ties = halves.view(torch.float16).float()  # midpoints between neighbouring halves: exact ties
    ties = ties[torch.isfinite(ties)]
    mid = ((ties[:-1].double() + ties[1:].double()) / 2).float()
    extra = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e30, -1e30, 2.0**-24, 2.0**-25, 3 * 2.0**-26,
                          1e-45, -1e-45, 3.4e38, float("inf"), -float("inf")])
    return torch.cat([*nudged, mid, extra])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("lowp_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_copy_rounds_like_torch(isa, lowp_dtype):
    # lr = 0, wd = 0, m = 0: the master is left as it is and the copy is just its rounding.
    p = special_floats()
    n = p.numel()
    g, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    lowp = torch.empty(n, dtype=lowp_dtype)
    before = p.clone()
    run_kernel(p, g, m, v, isa=isa, lowp=lowp, lr=0.0, weight_decay=0.0)
    assert_bitwise(p, before, "master")
    assert_bitwise(lowp, before.to(lowp_dtype), "rounded copy")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("lowp_dtype", [torch.bfloat16, torch.float16])
def test_nan_master_gives_nan_copy(isa, lowp_dtype):
    p = torch.tensor([float("nan"), -float("nan"), 1.0] * 11)
    lowp = torch.empty(33, dtype=lowp_dtype)
    run_kernel(p, torch.zeros(33), torch.zeros(33), torch.zeros(33), isa=isa, lowp=lowp, lr=0.0)
    assert lowp.isnan().tolist() == [True, True, False] * 11


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_every_finite_16_bit_grad_widens_exactly(isa, grad_dtype):
    # Every 16-bit pattern (subnormals included) as a grad: m = lerp(0, g, 1) = g exactly when beta1 = 0.
    g = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(grad_dtype)
    g = g[torch.isfinite(g)].contiguous()
    n = g.numel()
    p, m, v = torch.zeros(n), torch.full((n,), 5.0), torch.zeros(n)
    run_kernel(p, g, m, v, isa=isa, beta1=0.0, lr=0.0)
    assert_bitwise(m, g.float(), "widened grad")


# --- found-inf -------------------------------------------------------------------------------------


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
@pytest.mark.parametrize("where", [0, 40_000, 99_999])  # first, inside the second thread's run, last
def test_found_inf_skips_the_update(grad_dtype, bad, where):
    p, g, m, v = state(100_000, grad_dtype, seed=7)
    g[where] = bad
    lowp = torch.full((100_000,), 3.0, dtype=torch.bfloat16)
    before = clones(p, m, v, lowp)
    assert adamw_step(p, g, m, v, step=1, lowp_out=lowp, check_finite=True, num_threads=2, **HP) is True
    for a, b in zip((p, m, v, lowp), before):
        assert torch.equal(bits(a), bits(b)), "found-inf must write nothing"
    assert adamw_step_reference(*before[:1], g, *before[1:3], step=1, check_finite=True, **HP) is True


def test_found_inf_from_grad_scale_overflow():
    p, g, m, v = state(1000, torch.float16, seed=8)
    g.fill_(60000.0)  # finite in fp16 and fp32; times 1e35 it overflows fp32
    assert adamw_step(p, g, m, v, step=1, grad_scale=1e35, check_finite=True, **HP) is True
    assert adamw_step(p, g, m, v, step=1, grad_scale=1e-3, check_finite=True, **HP) is False


def test_no_check_lets_inf_through_like_torch():
    p, g, m, v = state(100, seed=9)
    g[5] = float("inf")
    rp, rm, rv = clones(p, m, v)
    assert adamw_step(p, g, m, v, step=1, **HP) is False
    adamw_step_reference(rp, g, rm, rv, step=1, exact_sqrt=True, **HP)
    for a, b in ((p, rp), (m, rm), (v, rv)):
        assert_bitwise(a, b, "with an inf grad")
    assert p[5].isnan() and not p[4].isnan()


# --- the Python wrapper's checks ------------------------------------------------------------------


@pytest.mark.parametrize("lowp_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_a_step_at_an_offset_is_the_step_of_those_slices_and_touches_nothing_else(grad_dtype, lowp_dtype):
    """``adamw_step_at`` (HostState.update's call, by address) updates exactly the range it names, as
    ``adamw_step`` of those slices does, bit for bit; every element outside the range is untouched."""
    g = torch.Generator().manual_seed(7)
    n, start, grad_start, numel = 300, 37, 11, 200
    master, m, v = torch.randn(n, generator=g), torch.rand(n, generator=g) * 1e-2, torch.rand(n, generator=g) * 1e-4
    grad = torch.randn(n, generator=g).to(grad_dtype)
    lowp = None if lowp_dtype is None else master.to(lowp_dtype)
    want = [t.clone() for t in (master, m, v)] + ([] if lowp is None else [lowp.clone()])
    before = master.clone()
    adamw_step(want[0][start:start + numel], grad[grad_start:grad_start + numel], want[1][start:start + numel],
               want[2][start:start + numel], step=3, **HP, grad_scale=0.5,
               lowp_out=None if lowp is None else want[3][start:start + numel])
    adamw_step_at(master, grad, m, v, start, grad_start, numel, lowp, step=3, **HP, grad_scale=0.5)
    for got, expected in zip((master, m, v) + (() if lowp is None else (lowp,)), want):
        assert torch.equal(got, expected)
    changed = (master != before).nonzero().flatten()
    assert changed.min() == start and changed.max() == start + numel - 1  # that range, and only it, moved


def test_kernel_info():
    info = kernel_info()
    assert info["available"] and info["isa"] in ISAS and isinstance(info["openmp"], bool)
    assert info["isa"] == ISAS[0]  # the best the CPU has


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda p, g, m, v: dict(param=p.double()), TypeError, "param must be a float32"),
        (lambda p, g, m, v: dict(grad=g.int()), TypeError, "grad must be a float32, bfloat16 or float16"),
        (lambda p, g, m, v: dict(lowp_out=torch.empty(8)), TypeError, "lowp_out must be None or a bfloat16"),
        (lambda p, g, m, v: dict(exp_avg=torch.zeros(16)[::2]), ValueError, "contiguous 1-D"),
        (lambda p, g, m, v: dict(exp_avg_sq=torch.zeros(2, 4)), ValueError, "contiguous 1-D"),
        (lambda p, g, m, v: dict(grad=torch.zeros(9)), ValueError, "grad has 9 elements but param has 8"),
        (lambda p, g, m, v: dict(exp_avg=p), ValueError, "exp_avg and param overlap"),
        (lambda p, g, m, v: dict(lowp_out=p.view(torch.bfloat16)[:8]), ValueError, "overlap"),
        (lambda p, g, m, v: dict(step=0), ValueError, "step must be an int >= 1"),
        (lambda p, g, m, v: dict(step=1.0), ValueError, "step must be an int >= 1"),
    ],
)
def test_bad_arguments(make, error, match):
    p, g, m, v = state(8)
    args = dict(param=p, grad=g, exp_avg=m, exp_avg_sq=v, step=1, **HP)
    args.update(make(p, g, m, v))
    with pytest.raises(error, match=match):
        adamw_step(**args)


def test_c_level_errors():
    p, g, m, v = state(8)
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        run_kernel(p, g, m, v, num_threads=0)
    with pytest.raises(ValueError, match="step must be >= 1"):
        run_kernel(p, g, m, v, step=0)
    with pytest.raises(ValueError, match="grad_dtype must be"):
        _C.adamw_step(p.data_ptr(), m.data_ptr(), v.data_ptr(), g.data_ptr(), "int8", 0, "bfloat16", 8, 1,
                      1e-3, 0.9, 0.999, 1e-8, 0.0)
    with pytest.raises(ValueError, match="instruction set 'sse9'"):
        run_kernel(p, g, m, v, isa="sse9")


def test_memory_traffic_probe_touches_every_buffer():
    # The benchmark's bandwidth bound: the kernel's loads and stores with trivial arithmetic.
    p, g, m, v = state(70_001, torch.bfloat16, seed=10, offset=1)
    lowp = torch.zeros(70_001, dtype=torch.bfloat16)
    p0, m0, v0 = clones(p, m, v)
    _C.adamw_memory_traffic(p.data_ptr(), m.data_ptr(), v.data_ptr(), g.data_ptr(), "bfloat16", lowp.data_ptr(),
                            p.numel(), 2)
    for new, old in ((p, p0), (m, m0), (v, v0)):
        assert torch.equal(new, old + g.float())
    assert torch.equal(bits(lowp), (bits(p) >> 16).to(torch.int16).to(torch.int64))
