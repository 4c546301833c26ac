"""The host side of the copies (issue 21, part 2, defects 4-6): gradients cross to the host in the dtype they
were computed in, into the pinned host arena (accumulation staging included), and every parameter starts
16-byte aligned in its bucket, on the device and on the host. The CPU tests run the CUDA backend on the
simulated GPU (tests/support/fake_cuda.py) or the CPU backend; the `gpu` tests show the same on a real GPU."""

import json

import pytest
import torch
from torch import nn

import offload
import offload.api
from offload.backend import CUDABackend
from offload.errors import InvariantError
from tests.support.budgets import with_headroom
from tests.support.fake_cuda import FakeCuda, use_backend
from tests.support.loops import train_streamed
from tests.support.models import CASES


def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


class CopyLog(CUDABackend):
    """The CUDA backend, recording each device-to-host copy and the host arena it pins."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.d2h_copies: list[dict] = []
        self.arenas = []

    def d2h(self, dst, src, waits=()):
        self.d2h_copies.append(dict(dst_dtype=dst.dtype, src_dtype=src.dtype, address=dst.data_ptr(),
                                    nbytes=dst.numel() * dst.element_size(), numel=src.numel(),
                                    pinned=dst.is_pinned() if dst.device.type == "cpu" and torch.cuda.is_available()
                                    else None))
        return super().d2h(dst, src, waits)

    def pin_host(self, arena):
        super().pin_host(arena)
        self.arenas.append((arena, self.pinned_bytes))


def _use(monkeypatch, make):
    return use_backend(monkeypatch, lambda device, chaos: make(device))


def _simulated(monkeypatch):
    return _use(monkeypatch, lambda device: CopyLog(torch.device("cpu"), api=FakeCuda(lazy=True)))


# -- defect 4: 16-bit grads cross as 16 bits ----------------------------------------------------------------


@pytest.mark.parametrize("accumulate", [1, 2], ids=["one-backward", "accumulate"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16bit_grads_cross_in_their_own_dtype(monkeypatch, dtype, accumulate):
    """Each D2H copies the grad slot into host memory of the slot's dtype: no conversion (which CUDA would do
    on the device, into a temporary twice the slot) and 2 bytes per element, what the stats count."""
    made = _simulated(monkeypatch)
    got = train_streamed(CASES["gpt"](), 3, dtype=dtype, accumulate=accumulate)
    copies = made[0].d2h_copies
    assert copies
    assert {(c["dst_dtype"], c["src_dtype"]) for c in copies} == {(dtype, dtype)}
    assert all(c["nbytes"] == 2 * c["numel"] for c in copies)
    assert got.stats["transfers"]["d2h_bytes"] == sum(c["nbytes"] for c in copies)


def test_the_cuda_backend_refuses_a_converting_copy():
    backend = CUDABackend(torch.device("cpu"), api=FakeCuda())
    with pytest.raises(InvariantError, match="would convert on the device"):
        backend.d2h(torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(InvariantError, match="would convert on the device"):
        backend.h2d(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4))
    backend.close()


@pytest.mark.parametrize("dtype, per_param", [(torch.float32, 12), (torch.bfloat16, 14)])
def test_host_bytes_per_trainable_parameter(dtype, per_param):
    """fp32 master, m and v (12) + the 16-bit copy (2), the grad staging ring (issue 18: no per-parameter grad),
    plus only the alignment padding of each region (64 bytes at most) and of each parameter (16 bytes at most)."""
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    n = sum(p.numel() for p in model.parameters())
    opt = offload.AdamW(model.parameters())
    engine = offload.wrap(model, opt, budget=16 * n, bucket_bytes=n, dtype=dtype, device="cpu")
    try:
        engine(torch.randn(2, 64)).float().sum().backward()
        opt.step()
        host = engine.memory_stats()["host_pinned_bytes"]
        buckets = engine._runtime.slots.buckets
        ring = engine._runtime.slots.hosted().layout.ring_bytes
        assert 0 < ring <= 3 * max(b.trainable_numel for b in buckets) * dtype.itemsize + 3 * 64
        assert per_param * n + ring <= host <= (per_param * n + ring + len(buckets) * 6 * 64
                                                + len(list(model.parameters())) * 16 * 5)
    finally:
        engine.close()


# -- defect 5: accumulation stages in the pinned arena ------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_accumulation_staging_lies_in_the_pinned_host_arena(monkeypatch, dtype):
    """Every grad copy of every micro-batch lands inside the one host arena the backend registered (a
    copy into pageable memory is synchronous on CUDA: it would stall autograd's thread each time)."""
    made = _simulated(monkeypatch)
    train_streamed(CASES["gpt"](), 3, dtype=dtype, accumulate=3)
    backend = made[0]
    ((arena, pinned),) = backend.arenas
    assert pinned == arena.size_bytes > 0
    lo, hi = arena.data_ptr, arena.data_ptr + arena.size_bytes
    assert len(backend.d2h_copies) > 3 * len(backend.arenas)
    for c in backend.d2h_copies:
        assert lo <= c["address"] and c["address"] + c["nbytes"] <= hi, c


# -- defect 6: aligned parameters ---------------------------------------------------------------------------


def _odd_model() -> nn.Module:
    torch.manual_seed(5)
    widths = [37, 41, 43, 39, 31, 29, 11]  # odd sizes: packed back to back, no parameter but the first aligns
    layers = [m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.Tanh())]
    return nn.Sequential(*layers[:-1], nn.LayerNorm(widths[-1]))


def _check_alignment(model: nn.Module, seen: list) -> list:
    """Forward pre-hooks (after the engine's, so the module's bucket is bound) recording each parameter's
    address while its module runs."""
    def hook(module, args):
        for p in module.parameters(recurse=False):
            seen.append(p.data_ptr() % 16)
    return [m.register_forward_pre_hook(hook) for m in model.modules()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_parameters_are_16_byte_aligned_on_device_and_host(dtype):
    model = _odd_model()
    nbytes = sum(p.numel() * dtype.itemsize for p in model.parameters())
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    engine = offload.wrap(model, opt, budget=int(0.9 * nbytes), bucket_bytes=nbytes // 10, dtype=dtype, device="cpu")
    seen: list[int] = []
    handles = _check_alignment(model, seen)
    try:
        for step in range(3):
            x = torch.randn(4, 37, generator=torch.Generator().manual_seed(step))
            engine(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        rt = engine._runtime
        assert seen and set(seen) == {0}, seen
        assert engine.memory_stats()["plan"]["streamed_buckets"] > 0
        host = rt.slots.host
        for p in range(len(rt.ctx.params)):
            b, off = host.bucket_of[p], host.offset[p]
            views = [host.master[b][off:], host.exp_avg[b][off:], host.exp_avg_sq[b][off:]]  # grads: the ring
            if host.lowp is not None:
                views.append(host.lowp[b][off:])
            assert all(v.data_ptr() % 16 == 0 for v in views), p
    finally:
        for h in handles:
            h.remove()
        engine.close()


def test_odd_sized_parameters_train_bit_for_bit_like_torch():
    """Padding between parameters changes no number: fp32, the bitwise path, against torch.optim.AdamW."""
    model = _odd_model()
    ref = _odd_model()
    hp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **hp)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    opt = offload.AdamW(model.parameters(), fused=False, **hp)
    engine = offload.wrap(model, opt, budget=int(0.9 * nbytes), bucket_bytes=nbytes // 10, dtype=torch.float32,
                          device="cpu")
    try:
        for step in range(6):
            x = torch.randn(4, 37, generator=torch.Generator().manual_seed(step))
            for m in (engine, ref):
                m(x).square().mean().backward()
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        assert engine.memory_stats()["plan"]["streamed_buckets"] > 0
        got = engine.state_dict()["model"]
        for name, value in ref.state_dict().items():
            assert torch.equal(got[name], value), name
    finally:
        engine.close()


# -- on a real GPU -----------------------------------------------------------------------------------------


@gpu
@pytest.mark.usefixtures("cuda_warm")
def test_gpu_d2h_moves_two_bytes_per_element_without_a_conversion_kernel(tmp_path):
    """The profiler's view of one bf16 training step: the grad copies are DtoH memcpys into pinned memory
    whose bytes are the engine's d2h_bytes (2 per element), and nothing but copies runs on their stream (a
    converting copy would run a conversion kernel there first). bf16 overlaps its updates, so nothing else
    in the step copies device to host (float16's overflow check reads its norms with .cpu())."""
    dtype = torch.bfloat16
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    engine = offload.wrap(model, opt, budget=with_headroom(0.6 * nbytes, "cuda"), bucket_bytes=nbytes // 8,
                          dtype=dtype, device="cuda")
    x = torch.randn(16, 512, device="cuda")
    try:
        for _ in range(2):  # the traced step, then the first planned one
            engine(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        before = engine.memory_stats()["transfers"]["d2h_bytes"]
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            engine(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
        d2h_bytes = engine.memory_stats()["transfers"]["d2h_bytes"] - before
        trace = tmp_path / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
        dtoh = [e for e in events if e.get("cat") == "gpu_memcpy" and e.get("name", "").startswith("Memcpy DtoH")]
        print(f"\nD2H: {len(dtoh)} memcpys, {sum(e['args']['bytes'] for e in dtoh)} bytes; engine d2h_bytes "
              f"{d2h_bytes}; names {sorted({e['name'] for e in dtoh})}")
        assert d2h_bytes > 0 and sum(e["args"]["bytes"] for e in dtoh) == d2h_bytes
        assert all("Pinned" in e["name"] for e in dtoh)
        streams = {e["args"]["stream"] for e in dtoh}
        kernels = [e["name"] for e in events if e.get("cat") == "kernel" and e.get("args", {}).get("stream") in streams]
        assert not kernels, kernels[:5]
    finally:
        engine.close()


@gpu
@pytest.mark.usefixtures("cuda_warm")
def test_gpu_accumulation_staging_is_pinned(monkeypatch):
    """With gradient accumulation on CUDA, every grad copy lands in page-locked host memory."""
    made = _use(monkeypatch, lambda device: CopyLog(torch.device("cuda", torch.cuda.current_device())))
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    engine = offload.wrap(model, opt, budget=with_headroom(0.6 * nbytes, "cuda"), bucket_bytes=nbytes // 8,
                          dtype=torch.bfloat16, device="cuda", overlap_optimizer=False)
    try:
        for step in range(3):
            for _ in range(3):
                engine(torch.randn(8, 256, device="cuda")).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        copies = made[0].d2h_copies
        print(f"\n{len(copies)} grad copies, pinned: {sum(bool(c['pinned']) for c in copies)}")
        assert len(copies) > 3 and all(c["pinned"] for c in copies)
    finally:
        engine.close()


@gpu
@pytest.mark.usefixtures("cuda_warm")
def test_gpu_parameters_are_16_byte_aligned_while_their_module_runs():
    """On CUDA, in bf16 (8-element alignment), every odd-sized parameter's device view starts 16-byte aligned,
    planned slots and on-demand ones alike."""
    model = _odd_model()
    nbytes = sum(p.numel() * 2 for p in model.parameters())
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    engine = offload.wrap(model, opt, budget=with_headroom(0.9 * nbytes, "cuda"), bucket_bytes=nbytes // 10,
                          dtype=torch.bfloat16, device="cuda")
    seen: list[int] = []
    handles = _check_alignment(model, seen)
    try:
        for step in range(3):
            engine(torch.randn(4, 37, device="cuda")).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        print(f"\n{len(seen)} parameter uses, addresses mod 16: {sorted(set(seen))}; "
              f"streamed buckets: {engine.memory_stats()['plan']['streamed_buckets']}")
        assert seen and set(seen) == {0}
    finally:
        for h in handles:
            h.remove()
        engine.close()
