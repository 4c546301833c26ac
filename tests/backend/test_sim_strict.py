"""Training on the simulated GPU (tests/support/fake_cuda.py; its own rules are tested in test_fake_cuda.py): the CUDA
defects it shows (issue 21, part 2): module buffers that never reach the device (1), a tied weight given two
grad accumulators by a device change while tracing (2), a user's own compute stream (7); and AdamW on the
host racing the next copies. tests/MUTATIONS.md lists each wait of the backend and the
runtime, removed one at a time, and the test here (or in test_cuda_backend.py) that fails without it.
"""

import time

import pytest
import torch

import offload
from offload.backend import CUDABackend
from offload.errors import StreamError
from tests.support.fake_cuda import simulated_gpu  # noqa: F401 (a fixture)
from tests.support.loops import ADAMW, train_streamed
from tests.support.models import CASES, run

# -- AdamW on the host and the next copies --------------------------------------------------------------------


def test_a_forward_between_backward_and_step_reads_the_updated_weights(simulated_gpu):
    """With overlapped updates, AdamW of a bucket may still run when an evaluation forward (before step())
    fetches the bucket: its H2D must wait for that AdamW. The CPU lane is slowed (50 ms before and after each
    update) so that the first buckets' updates, queued last in backward, have not started yet."""

    def session():
        case = CASES["mlp"]()
        nbytes = sum(p.numel() * 4 for p in case.model.parameters())
        opt = offload.AdamW(case.model.parameters(), **ADAMW)
        engine = offload.wrap(case.model, opt, budget=int(0.6 * nbytes), bucket_bytes=nbytes // 10, device="cpu")
        engine._runtime.ctx.cpu._before = lambda: time.sleep(0.05)  # read when the lane's thread starts: now
        outs = []
        with engine:
            for step in range(3):
                batch = case.make_batch(step)
                engine.backward(case.loss_fn(run(engine, batch), batch))
                with torch.no_grad():
                    outs.append(run(engine, case.make_batch(100)))
                opt.step()
        return outs

    want = session()
    simulated_gpu()
    got = session()
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_accumulation_reuses_a_staging_copy_only_after_the_previous_add(simulated_gpu):
    """overlap_optimizer=False, three backward passes per step, fp32: the first pass's grads land in the fp32
    sum, the second's and third's in the bucket's pinned staging copy, which the CPU lane adds into the sum.
    The third pass's D2H into that copy must wait for the add of the second (it reads the copy). The CPU
    lane is slowed (20 ms before and after each item) so those adds have not run when the copies are issued.
    Bit for bit with plain torch's accumulation (offload.AdamW(fused=False): torch's arithmetic)."""
    simulated_gpu()
    state, want, _ = _lockstep_with_torch(CASES["mlp"], 2, accumulate=3, lane_delay=0.02)
    for name, value in want.items():
        assert torch.equal(state[name], value), name


# -- defect 2: a tied weight keeps one grad accumulator through the traced step ------------------------------


def _lockstep_with_torch(case_fn, steps, dtype=torch.float32, budget_frac=0.6, accumulate=1, lane_delay=None):
    """The engine (offload.AdamW(fused=False): torch's arithmetic) and plain PyTorch + torch.optim.AdamW on
    the same batches, ``accumulate`` backward passes a step (then with overlap_optimizer=False); returns
    (engine's state, reference state, engine stats). ``lane_delay``: seconds the engine's CPU lane sleeps
    before and after each item, so its work lags behind the copies."""
    ref, case = case_fn(), case_fn()
    ref_opt = torch.optim.AdamW(ref.model.parameters(), foreach=False, **ADAMW)
    opt = offload.AdamW(case.model.parameters(), fused=False, **ADAMW)
    nbytes = sum(p.numel() * 4 for p in case.model.parameters())
    deferred = {"overlap_optimizer": False} if accumulate > 1 else {}
    engine = offload.wrap(case.model, opt, budget=int(budget_frac * nbytes), bucket_bytes=nbytes // 10,
                          dtype=dtype, device="cpu", **deferred)
    if lane_delay is not None:
        engine._runtime.ctx.cpu._before = lambda: time.sleep(lane_delay)  # read when the lane's thread starts: now
    with engine:
        for step in range(steps):
            for i in range(accumulate):
                batch = case.make_batch(accumulate * step + i)
                engine.backward(case.loss_fn(run(engine, batch), batch))
                ref.loss_fn(run(ref.model, batch), batch).backward()
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        state, stats = engine.state_dict()["model"], engine.memory_stats()
    return state, ref.model.state_dict(), stats


def test_tied_gpt_fp32_keeps_one_accumulator_per_weight(simulated_gpu):
    """GPT's embedding and LM head share one weight. While tracing, the runtime must never move it between
    host and device while autograd holds its accumulator: the hook would fire twice, the trace would have two
    GRAD events for it, and the planned steps would depart and plan again."""
    simulated_gpu()
    _assert_one_plan_and_torchs_weights("gpt")


def test_reused_module_fp32_keeps_one_accumulator_per_weight(simulated_gpu):
    simulated_gpu()
    _assert_one_plan_and_torchs_weights("reused_module")


def _assert_one_plan_and_torchs_weights(case):
    """Four fp32 steps of ``case``: the plan is never departed from nor made again, and every weight is
    PyTorch's, bitwise."""
    state, want, stats = _lockstep_with_torch(CASES[case], 4)
    assert stats["counters"]["plan_departures"] == 0 and stats["counters"]["replans"] == 0
    for key, value in want.items():
        assert torch.equal(state[key], value), key


# -- defect 1: module buffers live on the device while training ----------------------------------------------


def test_batchnorm_buffers_move_to_the_device_and_back(simulated_gpu):
    """BatchNorm's running statistics are read by compute next to device tensors: they must be on the
    device (the simulation raises CUDA's device-mismatch error for host buffers), and come back at close."""
    want = train_streamed(CASES["cnn_batchnorm"](), 4)
    case = CASES["cnn_batchnorm"]()
    buffers = list(case.model.buffers())
    made = simulated_gpu(host_only=tuple(buffers))
    sim_of = lambda: made[0]._api
    got = train_streamed(case, 4, inspect=lambda engine: [sim_of().is_device(b) for b in buffers])
    assert all(got.extra)  # on the device while training
    assert not any(sim_of().is_device(b) for b in case.model.buffers())  # back on the host after close
    assert got.losses == want.losses
    for key, value in want.state.items():
        assert torch.equal(got.state[key], value), key
        assert not sim_of().is_device(got.state[key]), key  # state_dict() gives host tensors
    for name, buf in case.model.named_buffers():
        assert torch.equal(buf, want.state[name]), name


def test_buffers_round_trip_through_state_dict_and_save(simulated_gpu, tmp_path):
    made = simulated_gpu()
    case = CASES["cnn_batchnorm"]()
    nbytes = sum(p.numel() * 4 for p in case.model.parameters())
    opt = offload.AdamW(case.model.parameters(), **ADAMW)
    with offload.wrap(case.model, opt, budget=int(0.6 * nbytes), bucket_bytes=nbytes // 10, device="cpu") as engine:
        for step in range(2):
            batch = case.make_batch(step)
            engine.backward(case.loss_fn(run(engine, batch), batch))
            opt.step()
        saved = engine.state_dict()
        engine.save(tmp_path / "ckpt.pt")
        bn = case.model.features[1]
        before = bn.running_mean.clone()
        batch = case.make_batch(9)
        engine.backward(case.loss_fn(run(engine, batch), batch))
        opt.step()
        assert not torch.equal(bn.running_mean, before)
        engine.load_state_dict(saved)
        assert torch.equal(bn.running_mean, before) and made[0]._api.is_device(bn.running_mean)
        engine(case.make_batch(9).args[0]).sum().backward()
        opt.step()
        engine.load(tmp_path / "ckpt.pt")
        assert torch.equal(bn.running_mean, before) and made[0]._api.is_device(bn.running_mean)
    plain = torch.load(tmp_path / "ckpt.pt", weights_only=False)["model"]
    assert torch.equal(plain["features.1.running_mean"], before)


# -- defect 7: the user's own compute stream ------------------------------------------------------------------


def test_a_user_stream_is_the_engines_compute_stream(simulated_gpu):
    """Forward and backward under the user's stream, step() outside it: every record, wait and allocation
    of the engine is on the user's stream, so the run is race-free and gives the CPU backend's numbers."""
    want = train_streamed(CASES["mlp"](), 4)
    made = simulated_gpu()
    case = CASES["mlp"]()
    nbytes = sum(p.numel() * 4 for p in case.model.parameters())
    opt = offload.AdamW(case.model.parameters(), **ADAMW)
    engine = offload.wrap(case.model, opt, budget=int(0.6 * nbytes), bucket_bytes=nbytes // 10, device="cpu")
    sim = made[0]._api
    stream = sim.user_stream()
    losses = []
    with engine:
        for step in range(4):
            batch = case.make_batch(step)
            with sim.use_stream(stream):
                loss = case.loss_fn(run(engine, batch), batch)
                engine.backward(loss)
            opt.step()  # on the default stream: the engine still works on the user's
            opt.zero_grad()
            losses.append(loss.item())
        state = engine.state_dict()["model"]
        with sim.use_stream(stream), torch.no_grad():
            run(engine, case.make_batch(0))  # an evaluation on the user's stream, then (outside it) the arena
        engine.load_state_dict(engine.state_dict())  # is freed and made again: both on the user's stream
        with pytest.raises(StreamError, match="same `with torch.cuda.stream"):
            engine(case.make_batch(0).args[0])  # the default stream now: refused, clearly
    assert losses == want.losses
    for key, value in want.state.items():
        assert torch.equal(state[key], value), key


def test_device_memory_comes_from_the_user_streams_pool():
    """What the engine allocates outside the user's `with torch.cuda.stream(s)` (the arena, made at step())
    comes from s's pool, so freeing it while s still reads it is safe (the allocator reuses it in s's order);
    from the default stream's pool it would be reused by the default stream before s's reads are done."""
    from tests.support.fake_cuda import FakeCuda

    sim = FakeCuda()
    backend = CUDABackend(sim.device, api=sim)
    with sim:
        user = sim.user_stream()
        with sim.use_stream(user):
            backend.begin_forward()  # the engine's first forward binds it to the user's stream
        arena = backend.empty(64)  # at step(): the default stream is current
        with sim.use_stream(user):
            arena.view(torch.float32).sum()  # compute reads it on the user's stream
        del arena
    assert sim.races == []
