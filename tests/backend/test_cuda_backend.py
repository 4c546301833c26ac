"""The CUDA backend's logic, on the CPU: its calls against a simulated GPU (tests/support/fake_cuda.py), host pinning
bookkeeping against a fake cudart, and whole training runs through the real runtime with copies as late as
CUDA allows. What only a GPU can show (real streams, DMA, the caching allocator, timing) is in test_cuda.py.
"""

import copy
import gc
import threading
import time
import weakref

import pytest
import torch
from torch import nn

import offload
import offload.api
from offload.backend import DONE, CPUBackend, CUDABackend, HostEvent, make_backend
from offload.backend.cuda_host import HostRegistry
from offload.errors import EngineClosedError, HostMemoryError, InvariantError
from offload.host.arena import HostArena
from tests.support.fake_cuda import FakeCuda, SimulatedRace, simulated_gpu, use_backend  # noqa: F401 (a fixture)
from tests.support.loops import train_streamed
from tests.support.models import CASES


def _backend(lazy=True):
    sim = FakeCuda(lazy=lazy)
    return CUDABackend(sim.device, api=sim), sim


# -- make_backend -----------------------------------------------------------------------------------------


def test_make_backend_cpu_and_bad_devices():
    assert isinstance(make_backend("cpu"), CPUBackend)
    assert isinstance(make_backend(torch.device("cpu")), CPUBackend)
    with pytest.raises(ValueError, match="no backend for device type 'meta'"):
        make_backend("meta")
    with pytest.raises(ValueError, match="device must be"):
        make_backend("not a device")


def test_make_backend_cuda_without_cuda_says_what_to_do():
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="does not exist"):
            make_backend(f"cuda:{torch.cuda.device_count()}")
        return
    with pytest.raises(ValueError, match="is_available.*device='cpu'"):
        make_backend("cuda")


# -- streams, events, copies ------------------------------------------------------------------------------


def test_streams_are_made_once_on_first_use():
    backend, sim = _backend()
    backend.empty(64)
    backend.record()
    assert sim.streams == []  # an engine that never copies makes no stream
    a, b = torch.zeros(4), torch.ones(4)
    for _ in range(3):
        backend.h2d(a, b)
    assert [s.name for s in sim.streams] == ["side0"]
    # the new H2D stream first waits for everything compute issued before it ([Note: stream-ordered memory])
    first = sim.streams[0].ops[0]
    assert first[0] == "wait" and first[1].stream is sim.compute
    backend.d2h(a, b)
    backend.d2h(a, b)
    assert [s.name for s in sim.streams] == ["side0", "side1"]


def test_h2d_waits_then_copies_then_records():
    backend, sim = _backend()
    dst, src = torch.zeros(8), torch.arange(8.0)
    compute = backend.record()
    event = backend.h2d(dst, src, [compute, DONE])
    h2d = sim.streams[0]
    kinds = [op[0] for op in h2d.ops]
    assert kinds == ["wait", "wait", "copy"]  # the stream's own first wait, then the one asked for, then the copy
    assert h2d.ops[1][1] is compute
    assert event.stream is h2d and event.position == len(h2d.ops)  # recorded after the copy
    assert not event.query() and torch.equal(dst, torch.zeros(8))  # nothing ran yet: copies are lazy here
    backend.wait(event)  # compute waits: the copy must have happened before compute goes on
    assert event.query() and torch.equal(dst, src)


def test_wait_makes_compute_wait_without_blocking_the_host_for_device_events():
    backend, sim = _backend()
    dst = torch.zeros(4)
    event = backend.h2d(dst, torch.ones(4))
    backend.wait(event)
    assert ("wait", "compute", "side0", event.position) in sim.log


def test_host_events_are_waited_for_on_the_host():
    """A CPU-lane event (AdamW writing the master the copy reads) cannot be waited on by a stream: the host
    blocks until it is set, and its failure surfaces."""
    backend, _ = _backend()
    lane_done = HostEvent(what="AdamW")
    timer = threading.Timer(0.05, lane_done.set)
    start = time.perf_counter()
    timer.start()
    backend.h2d(torch.zeros(2), torch.ones(2), [lane_done])
    assert lane_done.query() and time.perf_counter() - start >= 0.04
    failed = HostEvent(what="AdamW of bucket 3")
    failed.set(ValueError("boom"))
    with pytest.raises(offload.OffloadError, match="AdamW of bucket 3"):
        backend.wait(failed)
    with pytest.raises(offload.OffloadError, match="AdamW of bucket 3"):
        backend.d2h(torch.zeros(2), torch.ones(2), [failed])


def test_d2h_event_covers_the_copy():
    backend, sim = _backend()
    host, device = torch.zeros(6), torch.full((6,), 3.0)
    event = backend.d2h(host, device, [backend.record()])
    assert torch.equal(host, torch.zeros(6))
    event.synchronize()  # what the CPU lane does before AdamW reads the grads
    assert torch.equal(host, device)


def test_empty_orders_the_h2d_stream_after_compute():
    """A block compute freed may be handed out again while kernels reading it are queued: the H2D stream
    must not write it before them."""
    backend, sim = _backend()
    backend.h2d(torch.zeros(2), torch.ones(2))
    before = len(sim.streams[0].ops)
    t = backend.empty(100)
    assert t.dtype == torch.uint8 and t.numel() == 100 and t.device == backend.device
    op = sim.streams[0].ops[before]
    assert op[0] == "wait" and op[1].stream is sim.compute


def test_placeholders_share_one_nan_per_dtype():
    backend, _ = _backend()
    a = backend.placeholder(torch.Size([3, 4]), torch.float32)
    b = backend.placeholder(torch.Size([7]), torch.float32)
    c = backend.placeholder(torch.Size([2]), torch.bfloat16)
    assert a.shape == (3, 4) and torch.isnan(a).all() and c.dtype == torch.bfloat16 and torch.isnan(c).all()
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() != c.untyped_storage().data_ptr()
    with pytest.raises(RuntimeError):
        a.add_(1)  # an expanded scalar refuses in-place writes


def test_synchronize_and_close():
    backend, sim = _backend()
    dst = torch.zeros(3)
    backend.h2d(dst, torch.ones(3))
    backend.d2h(torch.zeros(3), torch.ones(3))
    assert sim.pending() > 0
    backend.synchronize()
    assert sim.pending() == 0 and torch.equal(dst, torch.ones(3))
    backend.h2d(dst, torch.full((3,), 2.0))
    backend.close()
    assert sim.pending() == 0 and torch.equal(dst, torch.full((3,), 2.0))  # close waits for the copies
    backend.close()  # idempotent
    assert backend.threads_alive() == 0
    with pytest.raises(EngineClosedError, match="closed"):
        backend.h2d(dst, dst)


def test_peak_is_none_when_nothing_measures_it():
    backend, _ = _backend()
    assert backend.peak_bytes() is None  # the engine then reports its own accounting


# -- pinning -----------------------------------------------------------------------------------------------


def test_pin_host_registers_the_exact_arena_once_and_close_unregisters():
    backend, sim = _backend()
    arena = HostArena(3 * 2**20 + 12345)  # not a power of two, not a page multiple
    backend.pin_host(arena)
    backend.pin_host(arena)  # once only
    assert sim.fake_cudart.calls == [("register", arena.data_ptr, 3 * 2**20 + 12345, 1)]  # 1: portable
    assert backend.pinned_bytes == arena.size_bytes
    backend.pin_host(HostArena(0))  # nothing to pin
    assert len(sim.fake_cudart.calls) == 1
    backend.close()
    assert sim.fake_cudart.calls[-1] == ("unregister", arena.data_ptr)
    assert sim.fake_cudart.registered == {} and backend.pinned_bytes == 0
    backend.close()
    assert len(sim.fake_cudart.calls) == 2


def test_unpin_host_unregisters_that_arena_only():
    """Issue 18: a re-plan that re-sizes the host arena unpins the old one (so its memory can go)."""
    backend, sim = _backend()
    old, new = HostArena(2**20), HostArena(3 * 2**20)
    backend.pin_host(old)
    backend.pin_host(new)
    ref = weakref.ref(old)
    backend.unpin_host(old)
    assert sim.fake_cudart.calls[-1] == ("unregister", old.data_ptr)
    assert backend.pinned_bytes == new.size_bytes
    backend.unpin_host(old)  # not pinned any more: nothing to do
    assert sim.fake_cudart.calls[-1] == ("unregister", old.data_ptr) and len(sim.fake_cudart.calls) == 3
    del old
    gc.collect()
    assert ref() is None  # the registry no longer keeps it alive
    backend.close()
    assert sim.fake_cudart.registered == {}


def test_pinned_arena_lives_until_unregistered_and_gc_unregisters():
    backend, sim = _backend()
    arena = HostArena(2**20)
    ref = weakref.ref(arena)
    backend.pin_host(arena)
    del arena
    gc.collect()
    assert ref() is not None  # never unmapped while registered
    del backend
    gc.collect()  # an engine dropped without close() still unregisters
    assert sim.fake_cudart.calls[-1][0] == "unregister" and sim.fake_cudart.registered == {}
    gc.collect()
    assert ref() is None


def test_pin_failure_is_an_actionable_error():
    backend, sim = _backend()
    sim.fake_cudart.fail_with = 2  # cudaErrorMemoryAllocation
    with pytest.raises(HostMemoryError, match=r"cudaHostRegister .* error 2.*ulimit -l"):
        backend.pin_host(HostArena(2**20))
    assert backend.pinned_bytes == 0
    backend.close()
    assert [c[0] for c in sim.fake_cudart.calls] == ["register"]  # nothing to unregister


def test_host_registry_rejects_overlaps_and_reports_unregister_failures():
    sim = FakeCuda()
    registry = HostRegistry(sim.cudart)
    owner = object()
    assert registry.register(1 << 30, 4096, owner)
    with pytest.raises(InvariantError, match="overlaps"):
        registry.register((1 << 30) + 100, 4096, owner)
    with pytest.raises(InvariantError, match="already pinned with 4096"):
        registry.register(1 << 30, 8192, owner)
    assert registry.register(1 << 31, 10, owner) and registry.nbytes == 4106
    del sim.fake_cudart.registered[1 << 31]  # the driver forgot it: unregister fails
    with pytest.raises(offload.OffloadError, match="1 range"):
        registry.release_all()
    assert registry.nbytes == 0 and sim.fake_cudart.registered == {}  # the other one was still released


# -- whole training runs through the runtime, on the simulated GPU ----------------------------------------


class Recording(CUDABackend):
    """Counts the runtime's calls, per step."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.calls: list[str] = []
        self.pinned_arena = None

    def empty(self, nbytes):
        self.calls.append("empty")
        return super().empty(nbytes)

    def h2d(self, dst, src, waits=()):
        arena = self.pinned_arena
        inside = arena is not None and arena.data_ptr <= src.data_ptr() < arena.data_ptr + arena.size_bytes
        self.calls.append("h2d:host-arena" if inside else "h2d")
        return super().h2d(dst, src, waits)

    def d2h(self, dst, src, waits=()):
        self.calls.append("d2h")
        return super().d2h(dst, src, waits)

    def pin_host(self, arena):
        self.calls.append("pin_host")
        self.pinned_arena = arena
        super().pin_host(arena)


def _use_backend(monkeypatch, factory):
    return use_backend(monkeypatch, lambda device, chaos: factory())


@pytest.fixture
def strict(simulated_gpu):
    """Engines wrapped in the test run on a simulated GPU that watches compute (races fail the test)."""
    return simulated_gpu


@pytest.mark.parametrize("name", ["mlp", "gpt", "frozen_layers", "reused_module", "low_density"])
def test_simulated_gpu_trains_bit_for_bit_like_the_cpu_backend(strict, name):
    """Same plan, same arithmetic; only when copies happen differs (as late as CUDA allows, here). Any
    missing wait would read a slot before its copy, or a gradient before its D2H."""
    want = train_streamed(CASES[name](), 8)
    made = strict()
    deferred = []
    got = train_streamed(CASES[name](), 8, on_step=lambda e, s: deferred.append(made[0]._api.pending()))
    assert max(deferred) > 0  # copies really were left pending across steps (resident refreshes, prefetches)
    assert got.losses == want.losses
    for key, value in want.state.items():
        assert torch.equal(got.state[key], value), key
    sim = made[0]._api
    assert sim.copies > 0 and sim.pending() == 0
    assert got.stats["plan"]["streamed_buckets"] > 0


@pytest.mark.parametrize("features", [dict(dtype=torch.bfloat16), dict(dtype=torch.float16),
                                      dict(accumulate=2, clip=0.5)], ids=["bf16", "fp16", "accumulate-clip"])
def test_simulated_gpu_training_features_bit_for_bit_like_the_cpu_backend(strict, features):
    """16-bit copies, loss scaling, accumulation staging and clipping norms through the CUDA backend's
    ordering rules give the CPU backend's numbers exactly."""
    want = train_streamed(CASES["gpt"](), 6, budget_frac=0.6, **features)
    made = strict()
    got = train_streamed(CASES["gpt"](), 6, budget_frac=0.6, **features)
    assert got.losses == want.losses
    for key, value in want.state.items():
        assert torch.equal(got.state[key], value), key
    assert made[0]._api.copies > 0 and made[0]._api.pending() == 0
    assert got.stats["plan"]["streamed_buckets"] > 0


def test_simulated_gpu_call_sequence(monkeypatch):
    """Pinned once, at the host arena's exact size, before any copy reads it; unpinned at close; and once
    planned, a step allocates nothing on the device (the arena is made once) and repeats the same copies."""
    made = _use_backend(monkeypatch, lambda: Recording(torch.device("cpu"), api=FakeCuda()))
    marks = []
    train_streamed(CASES["mlp"](), 6, on_step=lambda engine, step: marks.append(len(made[0].calls)))
    backend = made[0]
    calls, sim = backend.calls, backend._api
    assert calls.count("pin_host") == 1
    first_arena_copy = calls.index("h2d:host-arena")
    assert calls.index("pin_host") < first_arena_copy
    assert not any(c == "h2d" for c in calls[first_arena_copy:])  # after tracing, every H2D reads the pinned arena
    register = [c for c in sim.fake_cudart.calls if c[0] == "register"]
    assert register == [("register", backend.pinned_arena.data_ptr, backend.pinned_arena.size_bytes, 1)]
    assert sim.fake_cudart.calls[-1] == ("unregister", backend.pinned_arena.data_ptr)
    # Step 1 is traced; its step() plans and makes the arena. Steps 2..6 run on the plan.
    assert calls[:marks[0]].count("empty") > 1  # per-parameter copies while tracing, then the arena
    steady = [calls[a:b] for a, b in zip(marks, marks[1:])]
    assert all(s.count("empty") == 0 for s in steady), [s.count("empty") for s in steady]
    assert len({tuple(s) for s in steady}) == 1  # the same copies, in the same order, every planned step
    assert steady[0].count("h2d:host-arena") > 0 and steady[0].count("d2h") > 0


class NoComputeWait(CUDABackend):
    """Broken on purpose: compute does not wait for copies."""

    def wait(self, event):
        if isinstance(event, HostEvent):
            event.synchronize()


class EventBeforeCopy(CUDABackend):
    """Broken on purpose: the event a copy returns is recorded before the copy is enqueued."""

    def _copy(self, stream, dst, src, waits):
        for event in waits:
            self._stream_wait(stream, event)
        done = self._api.new_event(blocking=True)
        done.record(stream)
        self._api.copy(stream, dst, src)
        return done


@pytest.mark.parametrize("broken", [NoComputeWait, EventBeforeCopy])
def test_simulated_gpu_catches_a_missing_wait(strict, broken):
    """The simulation is worth something only if a backend that gets the ordering wrong fails it: with a
    race it reports (tests/support/fake_cuda.py) or with wrong numbers (more such backends: test_sim_strict.py)."""
    want = train_streamed(CASES["mlp"](), 4)
    made = strict(broken)
    try:
        got = train_streamed(CASES["mlp"](), 4)
        same = got.losses == want.losses and all(torch.equal(got.state[k], v) for k, v in want.state.items())
    except (SimulatedRace, offload.OffloadError):
        same = False
    assert not same
    assert made[0]._api.races or not same
    made[0]._api.races.clear()  # seen: the fixture would fail the test on them


def test_simulated_gpu_departures_evaluation_and_checkpoint(strict):
    """Off-plan steps (on-demand slots from empty()), evaluation and a state-dict round trip on the
    simulated GPU give what the CPU backend gives."""
    from tests.runtime.test_runtime import Branchy

    def session():
        torch.manual_seed(0)
        model = Branchy()
        opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        nbytes = sum(p.numel() * 4 for p in model.parameters())
        engine = offload.wrap(model, opt, budget=int(nbytes * 0.6), device="cpu", bucket_bytes=nbytes // 10)
        outs = []
        for step in range(8):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
            engine(x, step % 4 == 3).square().mean().backward()
            opt.step()
            if step % 3 == 1:
                with torch.no_grad():
                    outs.append(engine(x, True))
            if step == 4:
                engine.load_state_dict(copy.deepcopy(engine.state_dict()))
        state = engine.state_dict()["model"]
        engine.close()
        return state, outs

    want, want_outs = session()
    made = strict()
    got, outs = session()
    for a, b in zip(outs, want_outs, strict=True):
        assert torch.equal(a, b)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    assert made[0]._api.pending() == 0


def test_profiler_shows_the_backend_phases(monkeypatch):
    """Each backend phase is a record_function range, so a torch profiler trace shows copies and waits."""
    _use_backend(monkeypatch, lambda: CUDABackend(torch.device("cpu"), api=FakeCuda()))
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    opt = offload.AdamW(model.parameters())
    with offload.wrap(model, opt, budget=int(0.6 * 6 * 33 * 32 * 4), bucket_bytes=4096, device="cpu") as engine:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                engine(torch.randn(2, 32)).sum().backward()
                opt.step()
    names = {e.key for e in prof.key_averages()}
    assert {"offload::pin_host", "offload::h2d", "offload::d2h", "offload::wait", "offload::synchronize"} <= names
