"""The segmented C++ AdamW (``_C.adamw_step_segments``, [Note: segmented AdamW] in cpp/cpu_adam.h) against the
per-range kernel (``_C.adamw_step``) bit for bit: many ranges with their own buffers, grads and hyperparameters in
one call must leave every byte that one call per range leaves, on every instruction set this CPU runs."""

from __future__ import annotations

import pytest
import torch

from offload import _C
from offload.host.cpu_adam import KERNEL_AVAILABLE
from tests.host.test_cpu_adam import DTYPE_NAMES, ISAS, bits

pytestmark = [pytest.mark.skipif(not KERNEL_AVAILABLE, reason="offload._C was built without the CPU AdamW"),
              pytest.mark.intra_op_threads]  # [Note: the suite's intra-op threads] in tests/conftest.py

# odd lengths, a length of one, an empty one, one long enough for two OpenMP workers (1 << 16 elements)
LENGTHS = (1037, 1, 15, 0, 4096, 7, 70_001, 64, 3)
HYPERS = ((1, 1e-3, 0.9, 0.999, 1e-8, 0.1, 1.0), (7, 3e-3, 0.8, 0.99, 1e-6, 0.0, 0.5),
          (2, 1e-2, 0.9, 0.999, 1e-8, 0.01, 1.0))


def _segments(grad_dtype, lowp_dtype, seed=0):
    """One flat buffer each for master, m, v and the 16-bit copy, holding LENGTHS' ranges at odd offsets (gaps
    that no range owns between them), and a separate grad tensor per range (as a parameter's ``p.grad``)."""
    gen = torch.Generator().manual_seed(seed)
    starts, at = [], 3
    for n in LENGTHS:
        starts.append(at)
        at += n + 5
    total = at
    master = torch.randn(total, generator=gen)
    m = torch.randn(total, generator=gen) * 0.1
    v = torch.rand(total, generator=gen) * 0.01
    lowp = None if lowp_dtype is None else torch.full((total,), 3.0, dtype=lowp_dtype)
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for n in LENGTHS]
    return starts, master, m, v, lowp, grads


def _table(starts, master, m, v, lowp, grads):
    rows = []
    for i, (s, g) in enumerate(zip(starts, grads)):
        rows.append([master.data_ptr() + 4 * s, m.data_ptr() + 4 * s, v.data_ptr() + 4 * s, i,
                     0 if lowp is None else lowp.data_ptr() + lowp.element_size() * s, g.numel(), i % len(HYPERS)])
    return torch.tensor(rows, dtype=torch.int64)


def _segmented(starts, master, m, v, lowp, grads, *, isa, grad_dtype, lowp_dtype, threads=2, check_finite=False,
               first=0, count=None):
    table = _table(starts, master, m, v, lowp, grads)
    addrs = torch.tensor([g.data_ptr() for g in grads], dtype=torch.int64)
    hypers = torch.tensor(HYPERS, dtype=torch.float64)
    count = len(grads) - first if count is None else count
    return _C.adamw_step_segments(table.data_ptr(), first, count, addrs.data_ptr(), len(grads), hypers.data_ptr(),
                                  len(HYPERS), DTYPE_NAMES[grad_dtype],
                                  "bfloat16" if lowp_dtype is None else DTYPE_NAMES[lowp_dtype], check_finite, threads,
                                  isa)


def _per_range(starts, master, m, v, lowp, grads, *, isa, grad_dtype, lowp_dtype, threads=2, check_finite=False):
    found = []
    for i, (s, g) in enumerate(zip(starts, grads)):
        step, lr, b1, b2, eps, wd, scale = HYPERS[i % len(HYPERS)]
        found.append(_C.adamw_step(
            master.data_ptr() + 4 * s, m.data_ptr() + 4 * s, v.data_ptr() + 4 * s, g.data_ptr(),
            DTYPE_NAMES[grad_dtype], 0 if lowp is None else lowp.data_ptr() + lowp.element_size() * s,
            "bfloat16" if lowp_dtype is None else DTYPE_NAMES[lowp_dtype], g.numel(), step, lr, b1, b2, eps, wd,
            scale, check_finite, threads, isa))
    return found


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("grad_dtype", "lowp_dtype"),
                         [(torch.float32, None), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                          (torch.float32, torch.bfloat16), (torch.bfloat16, None)])
@pytest.mark.parametrize("threads", [1, 2])
def test_one_call_over_segments_is_one_call_per_segment_bit_for_bit(isa, grad_dtype, lowp_dtype, threads):
    """Every element of master, m, v and the 16-bit copy (the gaps no segment owns included: untouched), after
    three calls, each segment with its own grad tensor and one of three hyperparameter rows (steps, betas, weight
    decay, grad scale differ)."""
    a = _segments(grad_dtype, lowp_dtype)
    b = [t if isinstance(t, list) else (None if t is None else t.clone()) for t in a]
    b[5] = a[5]  # the same grads
    kw = dict(isa=isa, grad_dtype=grad_dtype, lowp_dtype=lowp_dtype, threads=threads)
    for _ in range(3):
        assert _segmented(*a, **kw) == -1
        assert _per_range(*b, **kw) == [False] * len(LENGTHS)
    for name, x, y in zip(("master", "m", "v", "lowp"), a[1:5], b[1:5]):
        assert x is None or _same(x, y), name
    assert not _same(a[1], _segments(grad_dtype, lowp_dtype)[1])  # (the updates did move the masters)


@pytest.mark.parametrize("isa", ISAS)
def test_a_sub_range_of_rows_updates_those_segments_only(isa):
    """``first`` and ``count`` pick rows of the table: those segments move (as one call each would move them: the
    next test), the others do not."""
    a = _segments(torch.bfloat16, torch.bfloat16, seed=1)
    before = a[1].clone()
    kw = dict(isa=isa, grad_dtype=torch.bfloat16, lowp_dtype=torch.bfloat16)
    assert _segmented(*a, first=2, count=3, **kw) == -1
    starts = a[0]
    moved = (a[1] != before).nonzero().flatten()
    assert int(moved.min()) >= starts[2] and int(moved.max()) < starts[5]
    for s, n in zip(starts[:2] + starts[5:], LENGTHS[:2] + LENGTHS[5:]):
        assert torch.equal(a[1][s:s + n], before[s:s + n])


def test_rows_name_their_hyperparameters_as_one_call_each_would():
    """A row's hyper index is the row's own (rows 2-4 here use rows 2, 0 and 1 of the hyperparameters)."""
    a = _segments(torch.float32, None, seed=2)
    b = [t if isinstance(t, list) else (None if t is None else t.clone()) for t in a]
    kw = dict(isa="auto", grad_dtype=torch.float32, lowp_dtype=None)
    assert _segmented(*a, first=2, count=3, **kw) == -1
    starts, grads = b[0], b[5]
    for i in range(2, 5):
        step, lr, b1, b2, eps, wd, scale = HYPERS[i % len(HYPERS)]
        s = starts[i]
        _C.adamw_step(b[1].data_ptr() + 4 * s, b[2].data_ptr() + 4 * s, b[3].data_ptr() + 4 * s, grads[i].data_ptr(),
                      "float32", 0, "bfloat16", grads[i].numel(), step, lr, b1, b2, eps, wd, scale, False, 2)
    for x, y in zip(a[1:4], b[1:4]):
        assert _same(x, y)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16])
def test_check_finite_stops_at_the_first_segment_with_an_inf(grad_dtype):
    """With ``check_finite`` a segment with an inf or nan and every later one are left unwritten; the earlier
    ones are updated; its index comes back."""
    a = _segments(grad_dtype, None, seed=3)
    a[5][4][3] = float("inf")  # segment 4 (4096 elements)
    before = [t.clone() for t in a[1:4]]
    kw = dict(isa="auto", grad_dtype=grad_dtype, lowp_dtype=None, check_finite=True)
    assert _segmented(*a, **kw) == 4
    starts = a[0]
    for s, n, moves in zip(starts, LENGTHS, (True, True, True, False, False, False, False, False, False)):
        for now, old in zip(a[1:4], before):
            assert torch.equal(now[s:s + n], old[s:s + n]) != (moves and n > 0)


def test_bad_tables_are_refused_before_anything_is_written():
    a = _segments(torch.float32, None, seed=4)
    before = a[1].clone()
    starts, master, m, v, lowp, grads = a
    table = _table(*a)
    addrs = torch.tensor([g.data_ptr() for g in grads], dtype=torch.int64)
    hypers = torch.tensor(HYPERS, dtype=torch.float64)
    n = len(grads)

    def call(t=table, h=hypers, n_grads=n, n_hypers=len(HYPERS), threads=1, isa="auto"):
        return _C.adamw_step_segments(t.data_ptr(), 0, n, addrs.data_ptr(), n_grads, h.data_ptr(), n_hypers,
                                      "float32", "bfloat16", False, threads, isa)

    bad_grad, bad_hyper, bad_step = table.clone(), table.clone(), hypers.clone()
    bad_grad[-1, 3] = n
    bad_hyper[-1, 6] = len(HYPERS)
    bad_step[2, 0] = 0.0
    with pytest.raises(ValueError, match="names grad"):
        call(bad_grad)
    with pytest.raises(ValueError, match="names grad .* or hyper 3 of 3"):
        call(bad_hyper)
    with pytest.raises(ValueError, match="step must be an integer >= 1"):
        call(h=bad_step)
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        call(threads=0)
    with pytest.raises(ValueError, match="instruction set 'sse9'"):
        call(isa="sse9")
    with pytest.raises(ValueError, match="grad_dtype must be"):
        _C.adamw_step_segments(table.data_ptr(), 0, n, addrs.data_ptr(), n, hypers.data_ptr(), 3, "int8",
                               "bfloat16", False, 1, "auto")
    assert torch.equal(a[1], before)
    assert _C.adamw_step_segments(0, 0, 0, 0, 0, 0, 0, "float32", "bfloat16", False, 1, "auto") == -1
