"""The host side of the copies (issue 21, part 2, defects 4-6): gradients cross to the host in the dtype they
were computed in, into the pinned host arena (accumulation staging included), and every parameter starts
16-byte aligned in its bucket, on the device and on the host. The CPU tests run the CUDA backend on the
simulated GPU (tests/fake_cuda.py) or the CPU backend; the `gpu` tests show the same on a real GPU."""

import json

import pytest
import torch
from torch import nn

import offload
import offload.api
from fake_cuda import FakeCuda
from loops import train_streamed
from models import CASES
from offload.backend import CUDABackend


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
    made = []

    def factory(device, chaos=None):
        made.append(make(device))
        return made[-1]

    monkeypatch.setattr(offload.api, "make_backend", factory)
    return made


def _simulated(monkeypatch):
    return _use(monkeypatch, lambda device: CopyLog(torch.device("cpu"), api=FakeCuda(lazy=True)))


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
        host = rt.host
        for p in range(len(rt.params)):
            b, off = host.bucket_of[p], host.offset[p]
            views = [host.master[b][off:], host.exp_avg[b][off:], host.exp_avg_sq[b][off:], host.grad[b][off:]]
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
