"""What only a GPU can show: real streams and events, pinned DMA, overlap of copies with compute, and memory
that stays flat. Every test is marked `gpu` and skipped without CUDA. (The numerics and runtime tests run on
CUDA too, through the `device` fixture; the backend's logic is tested on the CPU in test_cuda_backend.py.)
"""

import copy
import time

import pytest
import torch
from torch import nn

import offload
from offload.backend import CUDABackend, make_backend
from offload.host.arena import HostArena
from tests.support.budgets import with_headroom
from tests.support.models import CASES, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("cuda_warm")]

LONG_SLEEP = 200_000_000  # GPU clock cycles: ~0.1 s at 1.5-2 GHz, far longer than any host call below


def _backend() -> CUDABackend:
    return make_backend("cuda")


def test_wrap_on_cuda_pins_the_host_arena_and_unpins_it_at_close():
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    engine = offload.wrap(model, opt, budget=with_headroom(0.6 * 6 * 65 * 64 * 4, "cuda"), device="cuda", bucket_bytes=16 * 1024)
    rt = engine._runtime
    assert isinstance(rt.ctx.backend, CUDABackend) and rt.ctx.backend.device.index is not None
    engine(torch.randn(2, 64, device="cuda")).sum().backward()
    opt.step()
    master = rt.slots.host.master[0]  # a view: keeps the arena's memory mapped after close
    assert master.is_pinned() and rt.slots.host.ring.region.is_pinned()  # (grads land in the ring: no accumulation)
    assert rt.ctx.backend.pinned_bytes == rt.slots.host.nbytes == rt.slots.host.arena.size_bytes
    assert rt.executor.arena.device.type == "cuda"
    engine.close()
    assert not master.is_pinned()
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_pin_host_exact_size_and_zero():
    backend = _backend()
    arena = HostArena(3 * 2**20 + 12345)  # not a page multiple: registered at its exact size
    view = arena.view(0, 1024, torch.float32)
    backend.pin_host(arena)
    assert view.is_pinned() and backend.pinned_bytes == 3 * 2**20 + 12345
    backend.pin_host(HostArena(0))
    backend.close()
    assert not view.is_pinned()


def test_h2d_waits_for_the_events_it_is_given():
    """The copy must land after compute that was issued before it and writes the same slot."""
    backend = _backend()
    n = 1 << 22
    src = torch.full((n,), 2.0).pin_memory()
    dst = backend.empty(4 * n).view(torch.float32)
    backend._h2d_stream()  # made now, so that only the event given below orders the copy after the fill
    torch.cuda._sleep(LONG_SLEEP)
    dst.fill_(1.0)  # compute's last write to the slot, still queued behind the sleep
    event = backend.h2d(dst, src, [backend.record()])
    event.synchronize()
    assert torch.equal(dst, torch.full_like(dst, 2.0))  # the copy came after the fill
    backend.close()


def test_compute_waits_on_the_device_not_on_the_host():
    backend = _backend()
    n = 1 << 22
    src = torch.arange(n, dtype=torch.float32).pin_memory()
    dst = backend.empty(4 * n).view(torch.float32)
    with torch.cuda.stream(backend._h2d_stream()):
        torch.cuda._sleep(LONG_SLEEP)  # keep the H2D stream busy
    event = backend.h2d(dst, src)
    backend.wait(event)  # returns at once: the current stream waits, not the host ...
    assert not event.query()
    out = dst * 1  # ... and compute issued now still reads the copied values
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), src)
    backend.close()


def test_d2h_event_marks_the_copy_end():
    backend = _backend()
    n = 1 << 22
    device = torch.zeros(n, device="cuda")
    host = torch.zeros(n).pin_memory()
    torch.cuda._sleep(LONG_SLEEP)
    device.fill_(3.0)
    event = backend.d2h(host, device, [backend.record()])
    assert not event.query()
    event.synchronize()  # what the CPU lane does before AdamW reads the grads
    assert torch.equal(host, torch.full_like(host, 3.0))
    backend.close()


def test_device_peak_is_measured_and_includes_the_arena():
    case = CASES["mlp"]()
    nbytes = sum(p.numel() * 4 for p in case.model.parameters())
    opt = offload.AdamW(case.model.parameters(), lr=3e-4)
    with offload.wrap(case.model, opt, budget=with_headroom(0.6 * nbytes, "cuda"), bucket_bytes=nbytes // 10, device="cuda") as engine:
        for step in range(3):
            batch = case.make_batch(step).to("cuda")
            case.loss_fn(run(engine, batch), batch).backward()
            opt.step()
        stats = engine.memory_stats()
        print(f"\ndevice peak (allocator) {stats['device_peak_bytes']} B, accounted {stats['device_peak_accounted_bytes']}"
              f" B, arena {stats['arena_bytes']} B, budget {stats['budget_bytes']} B")
        assert stats["arena_bytes"] <= stats["device_peak_bytes"] <= stats["budget_bytes"]


# -- overlap ---------------------------------------------------------------------------------------------


class _Sleep(torch.autograd.Function):
    """Fake compute of a fixed GPU duration, in forward and in backward."""

    @staticmethod
    def forward(ctx, x, cycles):
        ctx.cycles = cycles
        torch.cuda._sleep(cycles)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(ctx.cycles)
        return grad, None


class SleepyLayer(nn.Module):
    def __init__(self, width: int, cycles: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5, requires_grad=False)
        self.cycles = cycles

    def forward(self, x):
        return _Sleep.apply(torch.tanh(x @ self.weight), self.cycles)  # backward needs the weight again


class SleepyStack(nn.Module):
    """Frozen wide layers (the bytes to stream) with a fixed sleep each way (the compute), and one trainable
    gain at the input, so the gradient flows back through every layer and backward refetches them."""

    def __init__(self, width: int, depth: int, cycles: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))
        self.layers = nn.ModuleList(SleepyLayer(width, cycles) for _ in range(depth))

    def forward(self, x):
        x = x * self.gain
        for layer in self.layers:
            x = layer(x)
        return x


def _gpu_ms(fn, reps: int = 5) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _wall_ms(step, reps: int) -> float:
    step()  # warm-up: optimizer state, kernels chosen
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / reps


class _CountingH2D(CUDABackend):
    """The CUDA backend, remembering the size of every host-to-device copy while ``counting``."""

    counting = False
    sizes: list

    def h2d(self, dst, src, waits=()):
        if self.counting:
            self.sizes.append(src.numel() * src.element_size())
        return super().h2d(dst, src, waits)


def test_copies_overlap_compute(monkeypatch):
    """A streamed step takes less than its compute plus its copies run one after the other (the ratio is
    printed; no absolute time is asserted). Compute per layer is set to about the copy time of a layer."""
    width, depth, reps = 4096, 8, 5
    layer_bytes = width * width * 4
    pinned = torch.empty(layer_bytes // 4).pin_memory()
    scratch = torch.empty(layer_bytes // 4, device="cuda")
    copy_ms = _gpu_ms(lambda: scratch.copy_(pinned, non_blocking=True))
    sleep_ms = _gpu_ms(lambda: torch.cuda._sleep(10_000_000))
    cycles = int(10_000_000 * copy_ms / sleep_ms)

    torch.manual_seed(0)
    model = SleepyStack(width, depth, cycles)
    plain = copy.deepcopy(model).cuda()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    x = torch.randn(8, width, device="cuda")

    def plain_step():
        plain(x).square().mean().backward()
        plain_opt.step()
        plain_opt.zero_grad()

    compute_ms = _wall_ms(plain_step, reps)

    backend = _CountingH2D(torch.device("cuda", torch.cuda.current_device()))
    backend.sizes = []
    monkeypatch.setattr(offload.api, "make_backend", lambda device: backend)
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    weight_bytes = depth * layer_bytes
    with offload.wrap(model, opt, budget=with_headroom(0.4 * weight_bytes, "cuda"), bucket_bytes=layer_bytes, device="cuda") as engine:

        def engine_step():
            engine(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        for _ in range(3):  # traced, then planned
            engine_step()
        backend.counting = True
        engine_step()
        backend.counting = False
        step_ms = _wall_ms(engine_step, reps)
        stats = engine.memory_stats()
    assert stats["plan"]["streamed_buckets"] > 0 and stats["counters"]["plan_departures"] == 0

    big = torch.empty(max(backend.sizes) // 4).pin_memory()
    dst = torch.empty(max(backend.sizes) // 4, device="cuda")
    serial_copy_ms = _gpu_ms(lambda: [dst[: n // 4].copy_(big[: n // 4], non_blocking=True) for n in backend.sizes],
                             reps=3)
    serial_ms = compute_ms + serial_copy_ms
    ratio = step_ms / serial_ms
    print(f"\noverlap: streamed step {step_ms:.2f} ms vs compute {compute_ms:.2f} ms + copies {serial_copy_ms:.2f} ms "
          f"({len(backend.sizes)} H2D copies, {sum(backend.sizes) / 2**20:.0f} MiB) one after the other: "
          f"ratio {ratio:.2f} ({torch.cuda.get_device_name()})")
    assert ratio < 1.0


# -- timing compute ([Note: timing compute] in offload/runtime/executor.py) --------------------------------


def test_the_first_planned_step_measures_compute_on_the_stream():
    """The timed step's compute (CUDA events at every hook, waits left out) is the model's forward + backward
    as CUDA events around the same model outside the engine measure it; the plan it re-planned from uses it."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(2048, 2048), nn.ReLU())])
    ref = copy.deepcopy(model).cuda()
    x = torch.randn(1024, 2048, device="cuda")
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    plain_ms = _gpu_ms(lambda: ref(x).square().mean().backward())  # weights resident, as in the plan below

    def timed(model, **options):
        opt = offload.AdamW(model.parameters(), lr=1e-4)
        with offload.wrap(model, opt, budget=with_headroom(4 * nbytes, "cuda"), device="cuda", **options) as engine:
            assert engine.config.calibrate_compute is True  # the default on CUDA
            walls = []  # each step's wall time, the device synchronized (a diagnostic: is the timed step host-bound?)
            for _ in range(4):
                torch.cuda.synchronize()
                start = time.perf_counter()
                engine.backward(engine(x).square().mean())
                opt.step()
                opt.zero_grad()
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - start) * 1e3)
            return engine.memory_stats(), engine._runtime.executor.train_plan, walls

    # First the same model with its updates in step() (nothing runs on the CPU lane during backward): a
    # diagnostic only. Of the second H200 run's 13.07 ms against 4.55 (the grad copies' waits for the CPU lane
    # already left out), it tells whether the rest comes with the CPU AdamW running beside backward.
    deferred_stats, _, deferred_walls = timed(copy.deepcopy(model), overlap_optimizer=False)
    deferred = deferred_stats["compute_timing"]["measured_compute_s"] * 1e3
    stats, plan, walls = timed(model)
    timing, counters = stats["compute_timing"], stats["counters"]
    measured_ms = timing["measured_compute_s"] * 1e3
    print(f"\ntimed step: compute {measured_ms:.2f} ms (plain forward + backward {plain_ms:.2f} ms; with the updates "
          f"in step() {deferred:.2f} ms), traced {timing['planned_compute_s'] * 1e3:.2f} ms, re-planned "
          f"{timing['replanned']} ({torch.cuda.get_device_name()}, {torch.get_num_threads()} CPU threads); step walls "
          f"(synchronized; traced, timed, then fast steps: {stats['counters']['fast_steps']}) "
          f"{', '.join(f'{w:.2f}' for w in walls)} ms, with the updates in step() "
          f"{', '.join(f'{w:.2f}' for w in deferred_walls)} ms")
    assert counters["timed_steps"] == 1 and counters["plan_departures"] == 0
    assert 0.5 < measured_ms / plain_ms < 2.0
    if timing["replanned"]:
        assert plan.trace.clock == "backend" and counters["compute_replans"] == 1


# -- memory over time ------------------------------------------------------------------------------------


def test_memory_is_flat_over_200_steps():
    """After the first planned step the device arena, the pinned host arena and the allocator's reserved
    memory do not change: no per-step device allocation for parameters, no fragmentation growth. (The first
    step on a plan is timed and may plan again: [Note: timing compute]; so "first" is the step after it.)"""
    case = CASES["gpt"]()
    nbytes = sum(p.numel() * 4 for p in case.model.parameters())
    opt = offload.AdamW(case.model.parameters(), lr=3e-4, weight_decay=0.1)
    engine = offload.wrap(case.model, opt, budget=with_headroom(0.6 * nbytes, "cuda"), bucket_bytes=nbytes // 10, device="cuda")
    rt = engine._runtime
    seen = []
    try:
        for step in range(200):
            batch = case.make_batch(step).to("cuda")
            case.loss_fn(run(engine, batch), batch).backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            if step <= 1:
                continue  # 0: traced, its step() planned and made the arena; 1: timed, its step() may plan again
            device_allocs = torch.cuda.memory_stats().get("num_device_alloc")
            seen.append({
                "reserved": torch.cuda.memory_reserved(),
                "allocated": torch.cuda.memory_allocated(),
                "cudaMalloc calls": device_allocs,
                "arena": (rt.executor.arena.data_ptr(), rt.executor.arena.numel()),
                "host arena": (rt.slots.host.arena.data_ptr, rt.slots.host.arena.size_bytes),
                "pinned": rt.ctx.backend.pinned_bytes,
                "on-demand fetches": rt.ctx.stats["on_demand_fetches"],
                "replans": rt.ctx.stats["replans"],
            })
        stats = engine.memory_stats()
    finally:
        engine.close()
    first = seen[0]
    print(f"\nafter the first planned step: {first}")
    for step, snapshot in enumerate(seen, start=3):
        # Allocated bytes may fall (the first CUDA run, 2026-11-27: 512 B fewer from step 6 on; which tensor
        # that was is not known, it went down, not up); everything else is fixed from the first planned step.
        assert {**snapshot, "allocated": 0} == {**first, "allocated": 0}, f"step {step}: {snapshot} != {first}"
        assert snapshot["allocated"] <= first["allocated"], f"step {step}: {snapshot} != {first}"
    for step, snapshot in enumerate(seen[20:], start=23):  # and then flat, to the byte
        assert snapshot == seen[20], f"step {step}: {snapshot} != {seen[20]}"
    assert first["pinned"] > 0 and stats["plan"]["streamed_buckets"] > 0
