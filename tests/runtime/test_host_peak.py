"""The peak host memory of a run follows what its plan needs (issue 18, [Note: the first step's host memory] in
offload/host/state.py): buckets whose optimizer the plan keeps on the device never get m and v on the host,
not even in the first step, which runs before there is a plan.

The peak is measured twice: by the host arenas the engine makes, recorded as they are made and let go (a
subclass of ``HostArena`` that counts itself: independent of the engine's own count), and by the engine's
``memory_stats()["host_peak_bytes"]``, which also counts the pageable host copies. Both are compared with a
bound derived by hand from the plan: the arena the plan needs, plus what the first step must hold before the
plan exists (the masters and 16-bit copies of the device-homed buckets, and with the optimizer overlapped the
first step's grads, held until the plan is known). Before, the first step allocated every bucket's master, m
and v in the arena, and the plan's smaller arena beside it: over the bound by the m and v of every
device-homed bucket (checked: these tests fail on the code before this change).

Plans are pinned as in tests/runtime/test_device_optimizer.py (a steady trace clock, a slow CPU AdamW).
"""

import gc
import weakref

import pytest
import torch

import offload.host.state
import offload.planning.trace
import offload.runtime.device_optim
import offload.runtime.warmup
from tests.runtime.test_device_homed import arena_bytes, homed
from tests.runtime.test_device_optimizer import (MIXED_BF16, _SteadyClock, assert_optimizer_state_bitwise, reference,
                                                 step, wrap)
from tests.support.compare import assert_bitwise, assert_losses_bitwise
from tests.support.models import CASES, run


@pytest.fixture(autouse=True)
def _steady_trace_clock(monkeypatch):
    monkeypatch.setattr(offload.planning.trace, "time", _SteadyClock())


class ArenaLedger:
    """Host arenas live at once, at most: each arena made by ``offload.host.state`` counts from its
    construction until the engine lets go of it."""

    def __init__(self, monkeypatch) -> None:
        self.live = self.peak = 0
        ledger = self
        real = offload.host.state.HostArena

        class Counted(real):
            def __init__(self, size_bytes: int, *args, **kwargs) -> None:
                super().__init__(size_bytes, *args, **kwargs)
                ledger.live += size_bytes
                ledger.peak = max(ledger.peak, ledger.live)
                weakref.finalize(self, ledger.gone, size_bytes)

        monkeypatch.setattr(offload.host.state, "HostArena", Counted)

    def gone(self, size_bytes: int) -> None:
        self.live -= size_bytes


def first_step_bound(engine, overlap: bool) -> dict[str, int]:
    """What the run needs on the host, by hand: the plan's arena; the device-homed buckets' masters and 16-bit
    copies from the first forward until their first update (on the device, once the plan is active); and
    overlapped, the first step's grads in the device dtype, held until the plan is known."""
    host = engine._runtime.slots.host
    away = homed(engine)
    lowp = host.lowp_dtype.itemsize if host.lowp_dtype is not None else 0
    itemsize = host.device_dtype.itemsize
    return {"arena": arena_bytes(engine, away),
            "parked": sum(host.master_numel[b] * 4 + host.buckets[b].numel * lowp for b in away),
            "held_grads": sum(b.trainable_numel * itemsize for b in host.buckets) if overlap else 0}


def _steps(engine, opt, case, overlap: bool, n: int, start: int = 0) -> list[float]:
    """``n`` steps of the engine (or of the plain reference model): one backward each, or two micro-batches."""
    losses = []
    for i in range(start, start + n):
        if overlap:
            losses.append(step(engine, opt, case, i))
            continue
        for k in range(2):  # two micro-batches a step
            batch = case.make_batch(2 * i + k)
            loss = case.loss_fn(run(engine, batch), batch) / 2
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "accumulate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_first_steps_host_peak_follows_the_plan(monkeypatch, dtype, overlap):
    ledger = ArenaLedger(monkeypatch)
    case = CASES["gpt"]()
    ref, ref_opt = reference(case.model)
    engine, opt = wrap(case.model, dtype=dtype, frac=1.5 if dtype == torch.float32 else MIXED_BF16,
                       overlap_optimizer=overlap)
    rt = engine._runtime
    try:
        losses = _steps(engine, opt, case, overlap, 1)
        away = homed(engine)
        assert away, "the plan must keep some optimizer on the device, or this test shows nothing"
        host = rt.slots.host
        # every device-homed bucket took its first update on the device, and none ever had m and v on the host
        assert rt.grads.device.counters["updates"] == len(away)
        assert not host.fresh and not host.parked and host.away == away
        losses += _steps(engine, opt, case, overlap, 2, start=1)
        need = first_step_bound(engine, overlap)
        full = arena_bytes(engine, ())  # what the first step allocated before: every bucket's state
        # the arenas: never more than the plan's (no arena with the device-homed buckets' state ever existed)
        assert ledger.peak <= need["arena"] < full
        # everything the engine holds on the host: within the bound
        stats = engine.memory_stats()
        assert stats["host_peak_bytes"] >= ledger.peak
        assert stats["host_peak_bytes"] <= sum(need.values())
        assert stats["host_current_bytes"] == stats["host_pinned_bytes"] == need["arena"]
        if dtype == torch.float32:  # and the numbers are plain PyTorch's (bf16: tests/runtime/test_device_optimizer.py)
            assert_losses_bitwise(losses, _steps(ref, ref_opt, case, overlap, 3))
            assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "weights")
            assert_optimizer_state_bitwise(opt.state_dict(), ref_opt.state_dict())
    finally:
        engine.close()
    del rt, host
    gc.collect()
    assert ledger.live == 0  # and the engine let go of every arena it made


@pytest.mark.parametrize("between", ["forward", "optimizer_state_dict"])
def test_reading_before_the_first_step_runs_the_first_updates_on_the_host(between):
    """Overlapped, a step's update has run when its backward returns: a forward, or a read of the optimizer
    state, between the first backward and ``step()`` sees the updated values, so the first updates waiting for
    the device run on the host then (their m and v are made there), bit for bit plain PyTorch."""
    case = CASES["gpt"]()
    ref, ref_opt = reference(case.model)
    engine, opt = wrap(case.model)
    rt = engine._runtime
    try:
        batch = case.make_batch(0)
        case.loss_fn(run(engine, batch), batch).backward()
        ref_loss = case.loss_fn(run(ref, batch), batch)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert rt.grads.device.postponed  # waiting for the plan
        if between == "forward":
            with torch.no_grad():
                got = case.loss_fn(run(engine, case.make_batch(1)), case.make_batch(1))
                want = case.loss_fn(run(ref, case.make_batch(1)), case.make_batch(1))
            assert torch.equal(got, want)
        else:
            assert_optimizer_state_bitwise(opt.state_dict(), ref_opt.state_dict())
        assert not rt.grads.device.postponed
        opt.step()
        opt.zero_grad()
        losses = [step(engine, opt, case, i) for i in range(1, 4)]
        ref_losses = [step(ref, ref_opt, case, i) for i in range(1, 4)]
        assert homed(engine)
        assert_losses_bitwise(losses, ref_losses)
        assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "weights")
        assert_optimizer_state_bitwise(opt.state_dict(), ref_opt.state_dict())
    finally:
        engine.close()


def _plan_homed() -> frozenset[int]:
    """The device-homed buckets of the tiny GPT's plan, as the tests below wrap it."""
    case = CASES["gpt"]()
    engine, opt = wrap(case.model)
    try:
        step(engine, opt, case, 0)
        return frozenset(homed(engine))
    finally:
        engine.close()


@pytest.mark.parametrize("guess", ["all", "none", "near"])
def test_a_wrong_estimate_of_the_placement_trains_the_same(monkeypatch, guess):
    """The warm-up estimates which buckets the first plan puts on the device from the first forward alone.
    Where it is far off (all buckets, or none) the plan lays the arena out again (as every first step did
    before). Where it is near ("near": one bucket the plan keeps home estimated away, one it puts on the device
    estimated home, and the re-layout's threshold lowered so that these count as small), there is no
    re-layout: the first keeps its parked copy and its updates run on the host, the second keeps its host
    regions (stale) and its updates run on the device. Numbers are plain PyTorch's in every case."""
    truth = _plan_homed()
    if guess == "near":
        monkeypatch.setattr(offload.runtime.device_optim, "RELAYOUT_SHARE", 1)
    estimates = []

    def estimate(self, forward, activations, buckets, recompute):
        wrong = {"all": frozenset(range(len(buckets))), "none": frozenset(),
                 "near": truth - {min(truth)} | {max(set(range(len(buckets))) - truth)}}[guess]
        estimates.append(frozenset(wrong))
        return estimates[-1]

    monkeypatch.setattr(offload.runtime.warmup.TracedWarmup, "_predicted_away", estimate)
    case = CASES["gpt"]()
    ref, ref_opt = reference(case.model)
    engine, opt = wrap(case.model)
    rt = engine._runtime
    try:
        losses = [step(engine, opt, case, i) for i in range(4)]
        ref_losses = [step(ref, ref_opt, case, i) for i in range(4)]
        away, host = homed(engine), rt.slots.host
        assert away == truth and estimates and estimates[0] != truth
        if guess == "near":
            assert host.away == estimates[0]  # not laid out again
            kept_home = estimates[0] - truth
            assert kept_home <= host.parked and not kept_home & set(rt.grads.device.state)  # host-updated
            assert min(truth) in rt.grads.device.state and min(truth) not in host.away  # device-updated
        else:
            assert host.away == truth and not host.parked  # laid out again
        assert_losses_bitwise(losses, ref_losses)
        assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "weights")
        assert_optimizer_state_bitwise(opt.state_dict(), ref_opt.state_dict())
    finally:
        engine.close()
