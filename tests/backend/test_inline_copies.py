"""The CPU backend's inline copies ([Note: inline copies] in offload/backend/cpu.py): ``Lane.run`` runs work on
the calling thread only where the lane could have started it at once, and an engine in that mode (the users'
default; the rest of the suite runs with ``OFFLOAD_CPU_COPIES=lanes``) trains bit for bit like plain torch."""

import threading

import pytest
import torch

from offload.backend import CPUBackend, cpu_copies, make_backend
from offload.backend.base import HostEvent, Lane
from offload.errors import EngineClosedError, OffloadError
from tests.runtime.test_numerics import (
    BUDGETS,
    assert_memory,
    assert_same_losses,
    assert_same_model_state,
    offloaded,
    param_bytes,
    reference_run,
    train,
)
from tests.support.models import CASES


@pytest.mark.intra_op_threads  # [Note: the suite's intra-op threads] in tests/conftest.py
def test_an_idle_lane_runs_work_on_the_calling_thread():
    lane = Lane("offload-test")
    try:
        ran_on = []
        ev = lane.run(lambda: ran_on.append(threading.current_thread()))
        assert ev.query() and ran_on == [threading.current_thread()]
        assert ev.started is not None and ev.finished is not None  # for Engine.export_timeline
        assert not lane.alive  # no thread was ever started
        assert lane.ran_inline == 1
    finally:
        lane.close()


def test_work_behind_queued_work_or_a_pending_wait_goes_to_the_lane_in_order():
    lane = Lane("offload-test")
    gate, order = threading.Event(), []
    try:
        first = lane.submit(lambda: (gate.wait(), order.append("first")))
        second = lane.run(lambda: order.append("second"))  # the lane is busy: queued behind, not run now
        assert not second.query() and order == []
        gate.set()
        second.synchronize()
        assert order == ["first", "second"] and first.query()
        pending = HostEvent()  # a wait not done yet: queued until it is
        third = lane.run(lambda: order.append("third"), [pending])
        assert not third.query()
        pending.set()
        third.synchronize()
        assert order == ["first", "second", "third"] and lane.ran_inline == 0
    finally:
        gate.set()
        lane.close()


def test_a_failure_inline_travels_with_the_event_and_drain_raises_it():
    lane = Lane("offload-test")
    try:
        ev = lane.run(lambda: 1 / 0)
        assert ev.query()
        with pytest.raises(OffloadError, match="ZeroDivisionError"):
            ev.synchronize()
        with pytest.raises(OffloadError, match="ZeroDivisionError"):
            lane.drain()
        failed = HostEvent()
        failed.set(RuntimeError("upstream"))
        with pytest.raises(OffloadError, match="upstream"):  # a failed wait fails the work, as on the lane
            lane.run(lambda: None, [failed]).synchronize()
    finally:
        lane.close()
    with pytest.raises(EngineClosedError):
        lane.run(lambda: None)


def test_a_lane_with_chaos_delays_never_runs_inline():
    delays = []
    lane = Lane("offload-test", before=lambda: delays.append(1))
    try:
        lane.run(lambda: None).synchronize()
        assert lane.alive and lane.ran_inline == 0 and delays  # went through the thread and its delays
    finally:
        lane.close()


def test_issue_runs_work_inline_only_on_a_lane_made_inline():
    """``Lane.issue`` (the runtime's AdamW updates): on the calling thread where the lane is ``inline`` and could
    start the work now, else on the lane's thread; the CPU backend makes its host lanes inline in inline mode."""
    for inline in (True, False):
        lane = Lane("offload-test", inline=inline)
        try:
            ran_on = []
            lane.issue(lambda: ran_on.append(threading.current_thread())).synchronize()
            assert (ran_on == [threading.current_thread()]) is inline
            assert lane.ran_inline == int(inline) and lane.alive is not inline
        finally:
            lane.close()
    backends = ((CPUBackend(), True), (CPUBackend(inline_copies=False), False), (CPUBackend(1e9, 1e9), False))
    for backend, inline in backends:
        lane = backend.host_lane("cpu-adam")
        assert lane.inline is inline
        lane.close()
        backend.close()


def test_the_mode_comes_from_the_environment_and_throttled_copies_stay_on_the_lanes(monkeypatch):
    monkeypatch.setenv("OFFLOAD_CPU_COPIES", "inline")
    assert cpu_copies() == "inline"
    backend = make_backend("cpu")
    assert backend.inline_copies
    backend.close()
    monkeypatch.setenv("OFFLOAD_CPU_COPIES", "lanes")
    backend = make_backend("cpu")
    assert not backend.inline_copies
    backend.close()
    throttled = CPUBackend(1e9, 1e9)  # benchmarks/sim_vs_runtime.py: a link of that bandwidth, asynchronous
    assert not throttled.inline_copies
    throttled.close()
    monkeypatch.setenv("OFFLOAD_CPU_COPIES", "fast")
    with pytest.raises(ValueError, match="OFFLOAD_CPU_COPIES must be 'inline' or 'lanes'"):
        make_backend("cpu")


def test_inline_copies_land_the_same_bytes():
    backend = CPUBackend()
    try:
        src = torch.arange(1000, dtype=torch.float32)
        dst = torch.zeros(1000)
        ev = backend.h2d(dst, src)
        assert ev.query() and torch.equal(dst, src)
        back = torch.zeros(1000)
        backend.wait(backend.d2h(back, dst, [ev]))
        assert torch.equal(back, src) and backend.threads_alive() == 0
    finally:
        backend.close()


# (name, budget): gpt and reused_module streamed are slow (~10-30 s each on 2 cores); cnn_batchnorm streams by default
_INLINE_SLOW = {("gpt", "streaming"), ("reused_module", "streaming")}


@pytest.mark.parametrize("name,budget", [
    pytest.param(n, b, id=f"{n}-{b}", marks=[pytest.mark.slow] if (n, b) in _INLINE_SLOW else [])
    for n in ["gpt", "reused_module", "cnn_batchnorm"] for b in BUDGETS])
def test_training_with_inline_copies_matches_pytorch(name, budget, monkeypatch):
    """tests/runtime/test_numerics.py's check, in the users' default mode: same losses and weights as plain torch
    (bit for bit on the CPU), within the budget; and the copies did run inline (streamed: some of them)."""
    monkeypatch.setenv("OFFLOAD_CPU_COPIES", "inline")
    ref = reference_run(name, "cpu")
    case = CASES[name]()
    with offloaded(case.model, budget, device="cpu") as (engine, opt):
        backend = engine._runtime.ctx.backend
        assert backend.inline_copies
        losses = train(engine, opt, case, 50, device="cpu")
        assert_same_losses(losses, ref.losses[:50], "cpu")
        assert_same_model_state(engine, ref.final, "cpu")
        assert_memory(engine, budget, param_bytes(case.model))
        assert backend._h2d.ran_inline > 0 and backend._d2h.ran_inline > 0
        assert engine._runtime.ctx.cpu.ran_inline > 0  # AdamW updates too ([Note: inline copies])
        # on plan too (a copy whose waits are not done yet, e.g. grad-ring bytes an AdamW still reads, goes to
        # its lane: how many do depends on timing, so only "some" is checked)
        inline = backend._h2d.ran_inline + backend._d2h.ran_inline
        train(engine, opt, case, 3, start=50, device="cpu")
        assert backend._h2d.ran_inline + backend._d2h.ran_inline > inline
