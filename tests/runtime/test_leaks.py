"""Leaks: steady-state training keeps every resource flat, and close() or garbage collection release all.

Flat means: after step 10 (warm-up, tracing and planning done, every lane started), host arena bytes,
device arena and accounted device bytes, the thread count and the number of Python objects the garbage
collector tracks do not change at all, and the process RSS grows by less than RSS_TOLERANCE. The default
run checks 60 steps; the slow-marked run 1,000.
"""

import gc
import threading
import weakref

import psutil
import pytest
import torch

import offload
import offload.api
from offload.backend import CUDABackend
from tests.support.fake_cuda import FakeCuda
from tests.support.models import CASES, run

pytestmark = pytest.mark.intra_op_threads  # [Note: the suite's intra-op threads] in tests/conftest.py

RSS_TOLERANCE = 8 * 2**20  # bytes of RSS growth allowed after step 10 (allocator noise; see the note)
OBJECT_TOLERANCE = 50  # Python objects tracked by gc, allowed to be added after step 10


def _wrap(case, **kw):
    nbytes = sum(p.numel() * 4 for p in case.model.parameters())
    opt = offload.AdamW(case.model.parameters(), lr=3e-4, weight_decay=0.1)
    engine = offload.wrap(case.model, opt, budget=int(0.6 * nbytes), bucket_bytes=nbytes // 10, device="cpu", **kw)
    return engine, opt


def _step(engine, opt, case, step):
    batch = case.make_batch(step)
    loss = case.loss_fn(run(engine, batch), batch)
    loss.backward()
    opt.step()
    opt.zero_grad()


def _measure(engine) -> dict:
    gc.collect()
    stats = engine.memory_stats()
    rt = engine._runtime
    return {
        "host_arena_bytes": stats["host_pinned_bytes"],
        "host_arena_reserved": rt.slots.host.arena.reserved_bytes,
        "device_arena_bytes": stats["arena_bytes"],
        "device_current_bytes": stats["device_current_bytes"],
        "device_parts": stats["device_parts"],
        "threads": threading.active_count(),
        "thread_ids": {t.ident for t in threading.enumerate()},
        "gc_objects": len(gc.get_objects()),
        "rss": psutil.Process().memory_info().rss,
    }


def check_flat(name: str, steps: int) -> dict:
    case = CASES[name]()
    engine, opt = _wrap(case)
    try:
        for step in range(10):
            _step(engine, opt, case, step)
        first = _measure(engine)
        for step in range(10, steps):
            _step(engine, opt, case, step)
        last = _measure(engine)
    finally:
        engine.close()
    exact = ("host_arena_bytes", "host_arena_reserved", "device_arena_bytes", "device_current_bytes",
             "device_parts")
    for key in exact:
        assert last[key] == first[key], (key, first[key], last[key])
    # no thread started (or replaced) in the window; an earlier test's engine, collected during it, may stop
    # its lanes here (seen after test_plain_torch / test_guards / test_idle_params / test_api in one process)
    assert last["thread_ids"] <= first["thread_ids"], (first["threads"], last["threads"])
    assert first["threads"] >= threading.active_count() + 3  # (the engine's lanes stopped at close)
    # growth only: a leak adds objects; a drop is an earlier test's garbage (lazily freed caches) going away,
    # seen after test_recompute / test_plain_torch / test_chaos / test_device_optimizer in one process
    assert last["gc_objects"] - first["gc_objects"] <= OBJECT_TOLERANCE, (first["gc_objects"], last["gc_objects"])
    assert last["rss"] - first["rss"] < RSS_TOLERANCE, (first["rss"], last["rss"])
    return {"first": first, "last": last}


@pytest.mark.parametrize("name", ["gpt", "low_density"])
def test_resources_flat_over_60_steps(name):
    check_flat(name, 60)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "low_density"])
def test_resources_flat_over_1000_steps(name):
    check_flat(name, 1000)


def test_forward_without_backward_keeps_no_activations():
    """A forward with grad enabled whose graph is dropped without backward (a loss computed for logging, a
    fault) frees its saved activations: none of them may be kept alive by the engine."""
    case = CASES["gpt"]()
    engine, opt = _wrap(case)
    for step in range(3):
        _step(engine, opt, case, step)
    for step in range(3):
        batch = case.make_batch(100 + step)
        case.loss_fn(run(engine, batch), batch)  # dropped at once
        gc.collect()
        assert engine.memory_stats()["device_parts"]["activations"] == 0
    _step(engine, opt, case, 3)
    engine.close()


def _engine_refs(engine):
    rt = engine._runtime
    threads = [lane._thread for lane in (rt.ctx.cpu, getattr(rt.ctx.backend, "_h2d", None), getattr(rt.ctx.backend, "_d2h", None))
               if lane is not None and hasattr(lane, "_thread") and lane._thread is not None]
    return threads, weakref.ref(rt.slots.host.arena), weakref.ref(rt)


def test_close_releases_everything():
    case = CASES["mlp"]()
    engine, opt = _wrap(case)
    for step in range(3):
        _step(engine, opt, case, step)
    threads, arena, _ = _engine_refs(engine)
    assert len(threads) == 3 and all(t.is_alive() for t in threads)
    engine.close()
    assert not any(t.is_alive() for t in threads)  # joined
    gc.collect()
    assert arena() is None  # the host arena is unmapped: nothing holds it (optimizer state was cleared)
    assert engine.memory_stats()["host_pinned_bytes"] == 0


def _use_fake_gpu(monkeypatch):
    """Engines get the CUDA backend on a simulated GPU; returns the simulations (not the backends, which
    must stay collectable)."""
    sims = []

    def make(device, chaos=None):
        sims.append(FakeCuda(lazy=True))
        return CUDABackend(torch.device("cpu"), api=sims[-1], chaos=chaos)

    monkeypatch.setattr(offload.api, "make_backend", make)
    return sims


def test_close_unregisters_pinned_memory(monkeypatch):
    made = _use_fake_gpu(monkeypatch)
    case = CASES["mlp"]()
    engine, opt = _wrap(case)
    for step in range(2):
        _step(engine, opt, case, step)
    cudart = made[0].fake_cudart
    assert len(cudart.registered) == 1
    engine.close()
    assert cudart.registered == {} and [c[0] for c in cudart.calls] == ["register", "unregister"]


@pytest.mark.parametrize("backend", ["cpu", "simulated-gpu"])
def test_garbage_collection_releases_everything(monkeypatch, backend):
    """An engine dropped without close(), with its model and optimizer: the lane threads are told to stop and
    joined by their finalizers, the host arena is unmapped and (simulated GPU) unregistered first."""
    made = _use_fake_gpu(monkeypatch) if backend != "cpu" else []
    case = CASES["mlp"]()
    make_batch, loss_fn = case.make_batch, case.loss_fn
    engine, opt = _wrap(case)
    for step in range(2):
        _step(engine, opt, case, step)
    threads, arena, runtime = _engine_refs(engine)
    assert threads and all(t.is_alive() for t in threads)
    del engine, opt, case
    gc.collect()
    assert runtime() is None, gc.get_referrers(runtime())
    assert arena() is None
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    if made:
        cudart = made[0].fake_cudart
        assert cudart.registered == {} and [c[0] for c in cudart.calls] == ["register", "unregister"]
    del make_batch, loss_fn
