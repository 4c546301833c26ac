"""Device-optimizer buckets updated by the backend's one-pass AdamW (``Backend.onepass_adamw``; on CUDA cupy's,
``offload/backend/cupy_adamw.py``), executed on the CPU backend.

The one-pass kernel's contract is the host kernel's numbers (``cpp/cpu_adam``): the 16-bit grad read as it is,
the 16-bit weights written with the master. Here the CPU backend is given the host kernel itself as its
"one-pass kernel" (same signature), so an engine whose plan puts some buckets' optimizer on the device must
train bit for bit like the host-only engine with the fused C++ kernel. That checks what the runtime does with a
one-pass kernel: no widened temporary (the kernel sees 16-bit grads), no copy of the master into the weights
after it (the kernel wrote them: a stale weight would show in the next step's loss), the deferred path's pieces.
The CUDA kernel itself is checked against the host kernel in tests/backend/test_cupy_adamw.py (gpu).
"""

import pytest
import torch

import offload
from offload.backend.cpu import CPUBackend
from offload.host import cpu_adam
from tests.runtime.test_device_optimizer import (  # noqa: F401 (_steady_trace_clock: an autouse fixture)
    MIXED_BF16, STEPS, _steady_trace_clock, assert_mixed, assert_optimizer_state_bitwise, step, wrap)
from tests.support.compare import assert_bitwise, assert_losses_bitwise
from tests.support.models import CASES, run

pytestmark = pytest.mark.skipif(not cpu_adam.KERNEL_AVAILABLE, reason="the C++ kernel is not built")


class HostKernelAsOnePass:
    """``cupy_adamw.adamw_step_device``'s signature, run by the host kernel; records the grads' dtypes."""

    def __init__(self) -> None:
        self.calls = 0
        self.grad_dtypes: set[torch.dtype] = set()
        self.lowp = 0

    def __call__(self, param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
                 grad_scale=1.0, lowp_out=None, fma=True):
        self.calls += 1
        self.grad_dtypes.add(grad.dtype)
        self.lowp += lowp_out is not None
        cpu_adam.adamw_step(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                            weight_decay=weight_decay, grad_scale=grad_scale, lowp_out=lowp_out)


def _train(device_optimizer: bool, kernel, dtype, monkeypatch, **config):
    with monkeypatch.context() as m:
        if kernel is not None:
            m.setattr(CPUBackend, "onepass_adamw", lambda self: kernel)
        return _run(device_optimizer, dtype, **config)


def _run(device_optimizer: bool, dtype, **config):
    case = CASES["gpt"]()
    engine, opt = wrap(case.model, frac=MIXED_BF16, dtype=dtype, fused=True, device_optimizer=device_optimizer,
                       **config)
    try:
        assert opt.fused
        if config.get("overlap_optimizer", True):
            losses = [step(engine, opt, case, i) for i in range(STEPS)]
        else:  # two micro-batches and a clip per step
            losses = []
            for i in range(STEPS):
                for j in range(2):
                    batch = case.make_batch(2 * i + j)
                    loss = case.loss_fn(run(engine, batch), batch) / 2
                    loss.backward()
                    losses.append(loss.item())
                engine.clip_grad_norm_(0.05)
                opt.step()
                opt.zero_grad()
        if device_optimizer:
            assert_mixed(engine)
        stats = engine.memory_stats()
        return losses, engine.state_dict(), stats
    finally:
        engine.close()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "accumulate-clip"])
def test_onepass_device_updates_are_the_host_kernels_bit_for_bit(monkeypatch, overlap):
    kernel = HostKernelAsOnePass()
    got = _train(True, kernel, torch.bfloat16, monkeypatch, overlap_optimizer=overlap)
    want = _train(False, None, torch.bfloat16, monkeypatch, overlap_optimizer=overlap)
    assert kernel.calls > 0
    assert got[2]["device_optimizer"]["kernel"] == "one-pass"
    assert got[2]["device_optimizer"]["updates"] > 0
    if overlap:
        assert kernel.grad_dtypes == {torch.bfloat16}  # read as it is: no widened fp32 temporary
    else:
        assert kernel.grad_dtypes == {torch.float32}  # the host's fp32 sums, back a piece at a time
    assert kernel.lowp == kernel.calls  # every call wrote the bucket's bf16 weights
    assert_losses_bitwise(got[0], want[0])
    assert_bitwise(got[1]["model"], want[1]["model"], "bf16 weights")
    assert_optimizer_state_bitwise(got[1]["optimizer"], want[1]["optimizer"])


def test_fp32_compute_writes_no_16bit_copy(monkeypatch):
    kernel = HostKernelAsOnePass()
    got = _train(True, kernel, torch.float32, monkeypatch)
    assert kernel.calls > 0 and kernel.lowp == 0  # the weights are the master
    assert kernel.grad_dtypes == {torch.float32}
    assert got[2]["device_optimizer"]["kernel"] == "one-pass"


def test_without_a_kernel_torch_fused_runs(monkeypatch):
    got = _train(True, None, torch.bfloat16, monkeypatch)
    assert got[2]["device_optimizer"]["kernel"] in ("torch-fused", "torch")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_buckets_train_like_the_host_only_engine():
    """On a GPU with cupy: the device-optimizer buckets' updates (cupy's one-pass kernel) give exactly the host
    kernel's numbers, so the mixed-placement engine trains bit for bit like the host-only one. Without cupy the
    device update is torch's fused CUDA AdamW, whose numbers are not the host kernel's: skipped."""
    from offload.backend import cupy_adamw
    from tests.runtime.test_device_optimizer import ADAMW, SLOW_CPU, param_bytes
    from tests.support.budgets import with_headroom

    if not cupy_adamw.available():
        pytest.skip(f"no one-pass kernel: {cupy_adamw.unavailable_reason()}")
    runs = {}
    for device_optimizer in (True, False):
        case = CASES["gpt"]()
        opt = offload.AdamW(case.model.parameters(), fused=True, **ADAMW)
        engine = offload.wrap(case.model, opt, budget=with_headroom(MIXED_BF16 * param_bytes(case.model), "cuda"),
                              dtype=torch.bfloat16, device="cuda", hw=SLOW_CPU, device_optimizer=device_optimizer,
                              bucket_bytes=param_bytes(case.model) // 10)
        try:
            losses = [step(engine, opt, case, i, "cuda") for i in range(STEPS)]
            runs[device_optimizer] = losses, engine.state_dict(), engine.memory_stats()
        finally:
            engine.close()
    stats = runs[True][2]["device_optimizer"]
    assert stats["updates"] > 0 and stats["kernel"] == "one-pass", stats
    assert_losses_bitwise(runs[True][0], runs[False][0])
    assert_bitwise(runs[True][1]["model"], runs[False][1]["model"], "bf16 weights")
    assert_optimizer_state_bitwise(runs[True][1]["optimizer"], runs[False][1]["optimizer"])
