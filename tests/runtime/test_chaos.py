"""Chaos mode: random, seeded delays on every copy lane and the CPU AdamW lane must not change one bit.

Each test trains the same model twice from the same initial weights on the same batches, once with chaos
off and once with ``ChaosConfig(seed, max_delay_ms=2)`` (``offload.testing.chaos``: test support, no engine
option; the backend factory takes it, tests/support/fake_cuda.py's ``with_chaos``), and requires the losses
of every step and the final fp32 weights (and buffers) to be bitwise equal. A missing wait in the runtime would let a copy or
an update land late and change the numbers (see test_chaos_catches_a_missing_wait, which removes one on
purpose and is caught).
"""

import threading

import pytest
import torch

import offload
import offload.api
from offload.backend import CUDABackend
from offload.testing.chaos import ChaosConfig
from tests.support.compare import assert_bitwise as assert_same_as_torch
from tests.support.fake_cuda import FakeCuda, use_backend
from tests.support.loops import Trained, torch_losses, train_streamed
from tests.support.models import CASES
from tests.support.warnings_filters import DEPARTING

pytestmark = pytest.mark.intra_op_threads  # [Note: the suite's intra-op threads] in tests/conftest.py

CHAOS = ChaosConfig(seed=0, max_delay_ms=2)
STEPS = 8  # per model in the default run; the slow soak runs 1,000


def train(case, steps, chaos=None, **features) -> Trained:
    """Streamed training of a test model (tests/support/loops.py); ``extra`` holds the chaos delays drawn per lane
    (empty without chaos)."""
    return train_streamed(case, steps, chaos=chaos, inspect=_draws, **features)


def _draws(engine) -> dict[str, int]:
    rt = engine._runtime
    lanes = {"cpu-adam": rt.ctx.cpu}
    if hasattr(rt.ctx.backend, "_h2d") and hasattr(rt.ctx.backend._h2d, "_before"):
        lanes |= {"h2d": rt.ctx.backend._h2d, "d2h": rt.ctx.backend._d2h}
    return {name: lane._before.draws for name, lane in lanes.items() if lane._before is not None}


def assert_bitwise(got, want):
    losses, state = got[0], got[1]
    assert losses == want[0], "losses differ under chaos"
    assert state.keys() == want[1].keys()
    for name, value in want[1].items():
        assert torch.equal(state[name], value), f"{name} differs under chaos"


def test_chaos_config_validation():
    assert ChaosConfig().max_delay_ms == 2.0
    for bad in (0, -1, float("nan"), float("inf"), 1001, "2"):
        with pytest.raises(ValueError, match="max_delay_ms"):
            ChaosConfig(max_delay_ms=bad)
    with pytest.raises(TypeError, match="seed"):
        ChaosConfig(seed=1.5)


def test_chaos_delays_are_seeded_per_lane():
    from offload.testing.chaos import ChaosDelay
    a, b = ChaosDelay(CHAOS, "h2d"), ChaosDelay(CHAOS, "h2d")
    seq = [a.draw() for _ in range(50)]
    assert seq == [b.draw() for _ in range(50)]
    assert all(0 <= d <= 0.002 for d in seq) and len(set(seq)) == 50
    assert seq != [ChaosDelay(CHAOS, "d2h").draw() for _ in range(50)]
    assert seq != [ChaosDelay(ChaosConfig(seed=1), "h2d").draw() for _ in range(50)]


@pytest.mark.parametrize("name", list(CASES))
def test_numerics_models_bitwise_equal_under_chaos(name):
    want = train(CASES[name](), STEPS)
    got = train(CASES[name](), STEPS, chaos=CHAOS)
    assert_bitwise(got, want)
    draws = got[3]
    assert set(draws) == {"h2d", "d2h", "cpu-adam"} and min(draws.values()) > 0, draws  # chaos really ran
    assert got[2]["plan"]["streamed_buckets"] > 0  # buckets streamed, so the copy lanes had work to delay


@pytest.mark.parametrize("features", [dict(dtype=torch.bfloat16), dict(dtype=torch.float16),
                                      dict(accumulate=2, clip=0.5)], ids=["bf16", "fp16", "accumulate-clip"])
def test_training_features_bitwise_equal_under_chaos(features):
    """16-bit host copies, loss scaling, accumulation staging on the CPU lane and clipping norms."""
    want = train(CASES["gpt"](), 5, **features)
    got = train(CASES["gpt"](), 5, chaos=CHAOS, **features)
    assert_bitwise(got, want)


@pytest.mark.filterwarnings(DEPARTING)  # each step departs, as this test means: [Note: steps that keep departing]
def test_plan_changes_bitwise_equal_under_chaos():
    """Departures from the plan (fetch on demand, arena dropped, replan) with every lane delayed."""
    from tests.runtime.test_replan import MoE, Router, train_pattern
    for make in (MoE, Router):
        want = train_pattern(make, steps=8)
        got = train_pattern(make, steps=8, chaos=CHAOS)
        assert got.losses == want.losses
        for k, v in want.state.items():
            assert torch.equal(got.state[k], v), k
        assert got.stats["plan"]["replans"] >= 1


def _use_backend(monkeypatch, factory):
    return use_backend(monkeypatch, lambda device, chaos: factory(chaos))


def test_chaos_on_the_simulated_gpu_puts_sleeps_on_the_copy_streams(monkeypatch):
    """On the CUDA backend, chaos enqueues a torch.cuda._sleep before and after every copy on its stream
    (simulated GPU, tests/support/fake_cuda.py); training stays bit-identical."""
    want = train(CASES["mlp"](), 4)
    made = _use_backend(monkeypatch, lambda chaos: CUDABackend(torch.device("cpu"), api=FakeCuda(lazy=True),
                                                               chaos=chaos))
    got = train(CASES["mlp"](), 4, chaos=CHAOS)
    assert_bitwise(got, want)
    sim = made[0]._api
    assert sim.copies > 0 and sim.sleeps == 2 * sim.copies
    for stream in sim.streams:  # every copy sits between two sleeps on its own stream
        kinds = [kind for kind, _ in stream.ops if kind != "wait"]
        assert kinds == ["sleep", "copy", "sleep"] * (len(kinds) // 3) and kinds
    delays = [entry[2] for entry in sim.log if entry[0] == "sleep"]
    assert all(0 <= d <= 0.002 for d in delays) and len(set(delays)) > 1


def test_cuda_api_sleep_converts_to_cycles():
    """CudaAPI.sleep asks torch.cuda._sleep for cycles of the device clock (checked with a stand-in)."""
    from offload.backend.cuda import CudaAPI

    class Api(CudaAPI):
        def cycles_per_second(self):
            return 2e9

    calls = []
    api = Api(torch.device("cpu"))
    orig_sleep, orig_stream = torch.cuda._sleep, torch.cuda.stream
    try:
        torch.cuda._sleep = calls.append
        torch.cuda.stream = lambda s: _Null()
        api.sleep(None, 0.001)
        api.sleep(None, 0.0)
    finally:
        torch.cuda._sleep, torch.cuda.stream = orig_sleep, orig_stream
    assert calls == [2_000_000, 1]


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_chaos_catches_a_missing_wait(monkeypatch):
    """Take one wait out of the runtime (the host-to-device copy a bucket's first use must wait for): with
    chaos on, the copies land late and the numbers change, so chaos mode does catch this class of bug."""
    from offload.runtime.residency import Residency
    from offload.runtime.slots import SlotTable

    def no_wait(self, b):  # SlotTable.land without waiting for the copy event (and the rest as land does)
        self.set_state(b, Residency.DEVICE)
        if b not in self._kept or not self._still_bound(b):
            self.bind(b, self.slot[b])
        self._kept.discard(b)
        self.touch(b)

    want = train(CASES["low_density"](), 3)
    monkeypatch.setattr(SlotTable, "land", no_wait)
    got = train(CASES["low_density"](), 3, chaos=ChaosConfig(seed=0, max_delay_ms=5))
    assert got[0] != want[0] or any(not torch.equal(got[1][k], v) for k, v in want[1].items())


@pytest.mark.parametrize("features", [dict(), dict(dtype=torch.bfloat16), dict(dtype=torch.bfloat16, accumulate=2)],
                         ids=["fp32", "bf16", "bf16-accumulate"])
def test_one_slot_grad_ring_bitwise_equal_under_chaos(monkeypatch, features):
    """[Note: grad staging ring] (issue 18): with room for one bucket only, every bucket's grad copy must wait for
    the CPU lane to have read the previous bucket's (its AdamW, or its widening or adding into the fp32 sum);
    with every lane delayed at random the numbers do not change."""
    import offload.host.state
    want = train(CASES["gpt"](), 4, **features)
    monkeypatch.setattr(offload.host.state, "GRAD_RING_SLOTS", 1)
    got = train_streamed(CASES["gpt"](), 4, chaos=ChaosConfig(seed=0, max_delay_ms=5), inspect=_ring_slots,
                         **features)
    assert got[0] == want[0]
    for name, value in want[1].items():
        assert torch.equal(got[1][name], value), name
    assert got[3] == 1 and got[2]["plan"]["num_buckets"] > 2  # room for one bucket, shared by several


def _ring_slots(engine) -> int:
    host = engine._runtime.slots.hosted()
    return host.layout.ring_bytes // (max(b.trainable_numel for b in host.buckets) * host.device_dtype.itemsize)


def test_chaos_catches_a_grad_copy_that_does_not_wait_for_its_ring_slot(monkeypatch):
    """Take the wait on the ring slot's previous reader out (HostState.landing forgets it): with one slot and
    chaos on, a copy overwrites grads the CPU AdamW has not read yet, and the numbers change."""
    import offload.host.state
    from offload.host.grad_ring import Landing
    from offload.host.state import HostState

    landing = HostState.landing

    def no_wait(self, b, first, *piece):
        got = landing(self, b, first, *piece)
        return Landing(got.view, got.lent, ())

    want = train(CASES["gpt"](), 3)
    monkeypatch.setattr(offload.host.state, "GRAD_RING_SLOTS", 1)
    monkeypatch.setattr(HostState, "landing", no_wait)
    got = train(CASES["gpt"](), 3, chaos=ChaosConfig(seed=0, max_delay_ms=5))
    assert got[0] != want[0] or any(not torch.equal(got[1][k], v) for k, v in want[1].items())


@pytest.mark.slow
def test_chaos_soak_1000_steps():
    """1,000 steps with chaos on, every loss and the final weights bitwise equal to chaos off."""
    steps = 1000
    want = train(CASES["low_density"](), steps)
    threads = threading.active_count()
    got = train(CASES["low_density"](), steps, chaos=CHAOS)
    assert threading.active_count() <= threads
    divergent = sum(a != b for a, b in zip(got[0], want[0]))
    assert divergent == 0 and len(got[0]) == steps
    assert_bitwise(got, want)
    assert min(got[3].values()) >= steps  # every lane drew delays on every step


def test_reference_agrees():
    """The engine the chaos tests run is right: plain PyTorch + torch.optim.AdamW, bit for bit with chaos on
    (offload.AdamW(fused=False): torch's arithmetic; see tests/support/compare.py)."""
    case = CASES["mlp"]()
    want, ref = torch_losses(case, STEPS)
    losses, state, _, _ = train(case, STEPS, chaos=CHAOS, fused=False)
    assert losses == want
    assert_same_as_torch(state, ref.state_dict())

