"""Grad slots as the plan lays them out ([Note: double-buffered grad slots] in planning/schedule.py), run on
the CPU backend: where the plan double-buffers them, taking a bucket's grad slot never waits for the copy to
the host of the bucket just before it; with single buffering it does (so the spy below can see such a wait).
Either way the engine trains bit for bit as plain PyTorch + torch.optim.AdamW. No timing is asserted, and none
is measured: the trace reads a steady clock, so the plan does not depend on the machine."""

import copy

import pytest
import torch
from torch import nn

import offload
from offload.planning import schedule
from offload.planning.plan import BufferKind
from offload.planning.schedule import validate_plan
from tests.runtime.test_device_optimizer import _SteadyClock
from tests.support.compare import assert_bitwise, assert_losses_bitwise
from tests.support.models import tanh_mlp
from tests.support.planning import flat_hw

ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


@pytest.fixture(autouse=True)
def _steady_trace_clock(monkeypatch):
    """Whether double buffering pays follows the trace's compute times: from the real clock, this test planned
    double-buffered slots on an Intel Xeon and single ones on an AMD EPYC. The trace reads a clock that advances
    1 ms per reading instead (a bucket's grads take ~8 ms to the host at the planned 1 MB/s)."""
    monkeypatch.setattr(offload.planning.trace, "time", _SteadyClock())


def _mlp(depth=12, width=32) -> nn.Module:
    return tanh_mlp(depth, width)


def _pair(model):
    """(engine, opt, ref, ref_opt): every bucket resident (4x the weights), two layers to a bucket, planned
    for a slow link (1 MB/s: a bucket's grads take ~8 ms to the host, far longer than its backward here), so
    that backward would wait for the grad copies where consecutive slots share bytes."""
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    opt = offload.AdamW(model.parameters(), fused=False, **ADAMW)
    engine = offload.wrap(model, opt, budget=4 * nbytes, bucket_bytes=nbytes // 6, dtype=torch.float32,
                          device="cpu", hw=flat_hw(bw=1e6, adam=1e9))
    return engine, opt, ref, ref_opt


class _SlotWaits:
    """Spies on one engine: for each grad slot taken, the buckets whose grad copies the taking waited for."""

    def __init__(self, engine, monkeypatch):
        rt = engine._runtime
        grads, backend = rt.grads, rt.ctx.backend
        self.copy_of: dict[int, int] = {}  # id(event) of a grad copy -> its bucket
        self.keep: list = []  # the events, alive (their ids stay theirs)
        self.waited: list[tuple[int, int]] = []  # (bucket taking its slot, bucket whose copy it waited for)
        self.finishing: int | None = None
        self.taking: int | None = None
        finish, grad_slot, d2h, wait = grads.finish, grads._grad_slot, backend.d2h, backend.wait

        def spy_finish(b):
            self.finishing = b
            try:
                return finish(b)
            finally:
                self.finishing = None

        def spy_grad_slot(b, *args, **kw):
            self.taking = b
            try:
                return grad_slot(b, *args, **kw)
            finally:
                self.taking = None

        def spy_d2h(*args, **kw):
            event = d2h(*args, **kw)
            if self.finishing is not None:
                self.copy_of[id(event)] = self.finishing
                self.keep.append(event)
            return event

        def spy_wait(event):
            if self.taking is not None and id(event) in self.copy_of:
                self.waited.append((self.taking, self.copy_of[id(event)]))
            return wait(event)

        # a fast step's bucket is taken and sent by one routine ([Note: one routine per fast bucket]): the same
        # slot waits and copies, seen through its two methods
        fast_send = grads.fast_send
        send, send_slot = fast_send.send, fast_send._slot

        def spy_send(r, *rest):  # rest: whether the grads stay in p.grad for the exposure (plain_grads.py)
            self.finishing = r.b
            try:
                return send(r, *rest)
            finally:
                self.finishing = None

        def spy_send_slot(r):
            self.taking = r.b
            try:
                return send_slot(r)
            finally:
                self.taking = None

        monkeypatch.setattr(grads, "finish", spy_finish)
        monkeypatch.setattr(grads, "_grad_slot", spy_grad_slot)
        monkeypatch.setattr(fast_send, "send", spy_send)
        monkeypatch.setattr(fast_send, "_slot", spy_send_slot)
        monkeypatch.setattr(backend, "d2h", spy_d2h)
        monkeypatch.setattr(backend, "wait", spy_wait)


def _x(step: int) -> torch.Tensor:
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(step))


def _step(forward, opt, x) -> float:
    loss = forward(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _previous(plan) -> dict[int, int]:
    """Per bucket with grads: the bucket whose grads come just before its own (the plan's backward order)."""
    grads = sorted((x for x in plan.buffers if x.kind is BufferKind.GRAD), key=lambda x: x.start)
    return {x.bucket: y.bucket for y, x in zip(grads, grads[1:])}


def _train(monkeypatch, steps=6):
    """Trains the engine and plain torch side by side; returns (plan, previous-bucket waits seen on the plan's
    steps, every slot wait seen)."""
    engine, opt, ref, ref_opt = _pair(_mlp())
    try:
        losses, ref_losses = [], []
        for step in range(2):  # the traced step, then the first step on the plan
            losses.append(_step(engine, opt, _x(step)))
            ref_losses.append(_step(ref, ref_opt, _x(step)))
        plan = engine._runtime.executor.plan
        assert plan is not None
        validate_plan(plan)
        spy = _SlotWaits(engine, monkeypatch)
        for step in range(2, steps):
            losses.append(_step(engine, opt, _x(step)))
            ref_losses.append(_step(ref, ref_opt, _x(step)))
        assert_losses_bitwise(losses, ref_losses)
        assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "model")
        c = dict(engine.memory_stats()["counters"])
        assert c["plan_departures"] == 0 and c["replans"] == 0, c
        assert engine._runtime.executor.plan is plan
        previous = _previous(plan)
        on_previous = [(b, j) for b, j in spy.waited if previous.get(b) == j]
        return plan, on_previous, spy.waited
    finally:
        engine.close()


def test_double_buffered_grad_slots_never_wait_for_the_previous_buckets_copy(monkeypatch):
    plan, on_previous, waited = _train(monkeypatch)
    assert "double-buffered grads" in plan.strategy
    previous = _previous(plan)
    grad_buffer = {x.bucket: k for k, x in enumerate(plan.buffers) if x.kind is BufferKind.GRAD}
    assert all(grad_buffer[j] not in plan.buffers[grad_buffer[b]].after for b, j in previous.items())
    assert on_previous == []
    assert waited  # slots are reused all the same: two buckets back (the spy sees those waits)
    assert all(previous.get(previous.get(b)) == j for b, j in waited)


def test_single_buffered_grad_slots_wait_for_the_previous_buckets_copy(monkeypatch):
    """The same engine planned with single buffering only: each slot takes over the one just before it and
    waits for its copy (what the double-buffered plan removes; and proof the spy sees such waits)."""
    monkeypatch.setattr(schedule, "DOUBLE_BUFFER_GRAD_SLOTS", False)
    plan, on_previous, _ = _train(monkeypatch)
    assert "double" not in plan.strategy
    steps_spied = 4
    assert len(on_previous) == steps_spied * (len(_previous(plan)))
