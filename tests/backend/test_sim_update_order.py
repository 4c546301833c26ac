"""A forward between backward and step() against plain PyTorch (tests/MUTATIONS.md, R3): the H2D of a bucket must
wait for its AdamW. test_sim_strict.py's test of the same path compares the simulated GPU with the CPU backend,
both running the engine's code, so a wait missing from the runtime (not the backend) is missing from both
runs alike and goes unseen; here the reference is torch.optim.AdamW on a plain model."""

import time

import pytest
import torch

import offload
from tests.support.fake_cuda import simulated_gpu  # noqa: F401 (a fixture)
from tests.support.loops import ADAMW
from tests.support.models import CASES, run


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu_backend", "simulated_gpu"])
def test_a_forward_between_backward_and_step_sees_torchs_update(simulated_gpu, gpu):
    """Overlapped updates, the CPU lane slowed (50 ms before and after each item) so the updates queued in
    backward have not run when an evaluation forward fetches their buckets: its output is plain torch's after
    torch.optim.AdamW's step, bit for bit (offload.AdamW(fused=False): torch's arithmetic), at every step."""
    if gpu:
        simulated_gpu()
    case, ref = CASES["mlp"](), CASES["mlp"]()
    ref_opt = torch.optim.AdamW(ref.model.parameters(), foreach=False, **ADAMW)
    opt = offload.AdamW(case.model.parameters(), fused=False, **ADAMW)
    nbytes = sum(p.numel() * 4 for p in case.model.parameters())
    engine = offload.wrap(case.model, opt, budget=int(0.6 * nbytes), bucket_bytes=nbytes // 10, device="cpu")
    engine._runtime.ctx.cpu._before = lambda: time.sleep(0.05)  # read when the lane's thread starts: now
    with engine:
        for step in range(3):
            batch = case.make_batch(step)
            engine.backward(case.loss_fn(run(engine, batch), batch))
            ref.loss_fn(run(ref.model, batch), batch).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            with torch.no_grad():
                got, want = run(engine, case.make_batch(100)), run(ref.model, case.make_batch(100))
            assert torch.equal(got, want), (step, (got - want).abs().max())
            opt.step()
            opt.zero_grad()
