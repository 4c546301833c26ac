"""A step that leaves its plan and reads a weight inside backward after that weight's bucket's grads are complete
(found with tests/MUTATIONS.md's N6, branch ``dpn6``). Overlapped, that bucket's update would run before the read
and the read, fetched again from the host copy the update rewrote, would see the updated weight, where torch's
backward reads the weight from before the step. [Note: a departed step's updates wait] (runtime/device_optim.py):
once a step has departed, every update not yet submitted waits for the end of its backward, so the read is
torch's. On the plan such a read is foreseen ([Note: streamed weights read after their update]). Where the departure
shows only in backward, after the update, fetching the bucket again raises; on a fast step, a device bucket's read
after its in-place update raises autograd's in-place error: loud, never the updated weights."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload
import offload.planning.trace
from offload.runtime import fast_path
from tests.runtime.test_device_optimizer import SLOW_CPU, DetachedReuse, _SteadyClock
from tests.support.compare import assert_bitwise
from tests.support.fake_cuda import simulated_gpu  # noqa: F401 (a fixture)

ADAMW = {"lr": 1e-2, "weight_decay": 0.1}
LATE_STEP = 3  # the one step that takes the late read (the data-dependent branch)
STEPS = 6


class LateRead(DetachedReuse):
    """DetachedReuse (the same layers and weights) whose detached read of ``b.weight`` before ``b`` runs is
    taken only while ``late`` (a data-dependent branch): in backward that read comes after ``b``'s grads are
    complete."""

    def __init__(self):
        super().__init__()
        self.late = False

    def forward(self, x):
        h = self.a0(x).tanh()
        if self.late:
            h = F.linear(h, self.b.weight.detach())
        h = self.b(self.a(h).tanh()).tanh()
        return self.out(self.c(h).tanh())


def _nbytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _pair(model: nn.Module, budget: float, overlap: bool = True, device_optimizer: bool = False):
    """(model, engine, opt, ref, ref_opt): fp32, the bitwise AdamW beside torch's, ``budget`` x the weights."""
    ref = copy.deepcopy(model)
    nbytes = _nbytes(model)
    opt = offload.AdamW(model.parameters(), fused=False, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    engine = offload.wrap(model, opt, budget=int(budget * nbytes), device="cpu", bucket_bytes=nbytes // 10,
                          overlap_optimizer=overlap, device_optimizer=device_optimizer,
                          **({"hw": SLOW_CPU} if device_optimizer else {}))
    return model, engine, opt, ref, ref_opt


def _train(pairs, steps: int = STEPS) -> list[list[float]]:
    """``steps`` steps of LateRead's regression for each (model, forward, optimizer), in turn, the late read in
    step ``LATE_STEP`` only; their losses."""
    losses: list[list[float]] = [[] for _ in pairs]
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)
        for (model, forward, o), out in zip(pairs, losses):
            model.late = i == LATE_STEP
            loss = (forward(x) - y).square().mean()
            loss.backward()
            o.step()
            o.zero_grad()
            out.append(loss.item())
    return losses


CASES = {  # id: (budget / weight bytes, overlap_optimizer, device_optimizer, the fast path allowed)
    "streamed": (1.2, True, False, True),  # buckets streamed: the read fetches ``b`` again from the host
    "resident": (4.0, True, False, False),  # all resident, full path: ``a0``'s call reads ``b.weight``, which its
    # planned call did not (``PlanExecutor.check_use``): the step departs in forward, the arena goes, and the
    # backward fetches ``b`` again from the host
    "resident-fast": (4.0, True, False, True),  # a fast step: no departure (the grads come in the plan's order);
    # the read is of ``b``'s slot, which the host update does not write
    "device-optimizer": (4.0, True, True, False),  # so too, and the departure hands the device buckets' state
    # to the host, whose updates wait
    "deferred": (1.2, False, False, True),  # updates in step(): nothing to hold, the same numbers
}


@pytest.mark.parametrize("backend", ["cpu", "simulated-gpu"])
@pytest.mark.parametrize("case", list(CASES))
def test_an_off_plan_read_after_the_update_reads_the_weights_torch_reads(simulated_gpu, monkeypatch, backend, case):
    """Fp32, the bitwise AdamW: the fourth step alone takes the late read, so (on the full path) it departs from
    its plan in forward and its backward fetches ``b``'s bucket on demand after ``b``'s grads are complete. Every
    loss and the final weights are torch's bit for bit (before the fix, with overlapped updates, the losses after
    that step differed: 1.7061436 against torch's 1.7062106 in the streamed case)."""
    budget, overlap, device_optimizer, fast = CASES[case]
    monkeypatch.setattr(offload.planning.trace, "time", _SteadyClock(1e-5))  # device buckets in the plan
    if not fast:
        monkeypatch.setattr(fast_path, "_WHOLE_STEP", ())  # no plan runs fast
    if backend == "simulated-gpu":
        made = simulated_gpu()
    model, engine, opt, ref, ref_opt = _pair(LateRead(), budget, overlap, device_optimizer)
    try:
        losses = _train([(model, engine, opt), (ref, ref, ref_opt)])
        stats = engine.memory_stats()
        got = engine.state_dict()["model"]
    finally:
        engine.close()
    counters, plan = stats["counters"], stats["plan"]
    # the case is on: the late read's step departed (or ran fast), the placements are the case's
    assert counters["fast_steps" if fast and budget > 2 else "plan_departures"] >= 1, counters
    assert (plan["streamed_buckets"] > 0) == (budget < 2), plan
    assert (stats["device_optimizer"]["updates"] > 0) == device_optimizer, stats["device_optimizer"]
    if backend == "simulated-gpu":
        assert made and made[0]._api.copies > 0
    assert losses[0] == losses[1], (losses[0][LATE_STEP + 1], losses[1][LATE_STEP + 1])
    assert_bitwise(got, ref.state_dict(), "model")


def test_in_bfloat16_an_off_plan_late_read_trains_as_deferred_updates():
    """Bf16 (no bitwise torch reference): overlapped updates, whose departed step holds them to the end of its
    backward, give the deferred engine's numbers bit for bit (its updates all run in ``step()``, after every read)."""
    runs = []
    for overlap in (True, False):
        torch.manual_seed(0)
        model = LateRead()
        nbytes = _nbytes(model)
        opt = offload.AdamW(model.parameters(), fused=False, **ADAMW)
        engine = offload.wrap(model, opt, budget=int(0.6 * nbytes), device="cpu", bucket_bytes=nbytes // 20,
                              dtype=torch.bfloat16, overlap_optimizer=overlap)
        try:
            losses = _train([(model, engine, opt)])[0]
            runs.append((losses, engine.state_dict()["model"], engine.memory_stats()))
        finally:
            engine.close()
    (losses, weights, stats), (want_losses, want_weights, _) = runs
    assert stats["counters"]["plan_departures"] >= 1 and stats["plan"]["streamed_buckets"] > 0, stats["plan"]
    assert losses == want_losses
    assert_bitwise(weights, want_weights, "model")


class ReadsItself(nn.Linear):
    """A linear layer that, while ``late``, first reads its own weight detached: ``W (W.detach() h)``."""

    late = False

    def forward(self, h):
        if self.late:
            h = F.linear(h, self.weight.detach())
        return super().forward(h)


class SameCall(nn.Module):
    """``b``'s own call reads ``b.weight`` detached before its linear, only while ``late``: that call touches the
    same parameters either way, so the forward cannot tell the step from its plan; the backward can, at the read,
    which comes after ``b``'s grads are complete (the detached linear's node runs after ``b``'s own)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a0, self.a, self.c = (nn.Linear(32, 32) for _ in range(3))
        self.b = ReadsItself(32, 32)
        self.out = nn.Linear(32, 4)
        for m in (self.a0, self.a, self.b, self.c, self.out):
            nn.init.normal_(m.weight, std=0.2, generator=g)
        self.late = False

    def forward(self, x):
        self.b.late = self.late
        h = self.b(self.a(self.a0(x).tanh()).tanh()).tanh()
        return self.out(self.c(h).tanh())


@pytest.mark.parametrize("backend", ["cpu", "simulated-gpu"])
@pytest.mark.parametrize("budget", [1.2, 4.0], ids=["streamed", "resident"])
def test_a_read_only_the_backward_shows_after_the_update_is_refused(simulated_gpu, monkeypatch, backend, budget):
    """The step departs only in backward, at the read, after ``b``'s overlapped update was issued: fetching ``b``
    again would read the updated weights (silently not torch's before: the losses after that step differed).
    Refused with an OffloadError that names the fix; with ``overlap_optimizer=False`` the same steps are
    torch's bit for bit."""
    monkeypatch.setattr(fast_path, "_WHOLE_STEP", ())  # the full path, whose departure drops the arena
    if backend == "simulated-gpu":
        simulated_gpu()
    model, engine, opt, ref, ref_opt = _pair(SameCall(), budget)
    try:
        with pytest.raises(offload.OffloadError, match="inside the backward that already applied its AdamW"):
            _train([(model, engine, opt), (ref, ref, ref_opt)])
        assert engine.memory_stats()["counters"]["plan_departures"] >= 1
    finally:
        engine.close()
    model, engine, opt, ref, ref_opt = _pair(SameCall(), budget, overlap=False)
    try:
        losses = _train([(model, engine, opt), (ref, ref, ref_opt)])
        got = engine.state_dict()["model"]
    finally:
        engine.close()
    assert losses[0] == losses[1]
    assert_bitwise(got, ref.state_dict(), "model")


def test_on_a_fast_step_a_device_bucket_read_after_its_update_raises(monkeypatch):
    """All resident, ``b``'s optimizer on the device, fast steps: the late read's step runs fast (no hook sees the
    read, and its grads come in the plan's order), and ``b``'s update rewrites its slot in place before the read.
    The update bumps the parameters' version counters, so autograd refuses the read, as torch refuses a saved
    tensor written in place (silently the updated weights before)."""
    monkeypatch.setattr(offload.planning.trace, "time", _SteadyClock(1e-5))  # device buckets in the plan
    model, engine, opt, ref, ref_opt = _pair(LateRead(), 4.0, device_optimizer=True)
    try:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            _train([(model, engine, opt), (ref, ref, ref_opt)])
        stats = engine.memory_stats()
    finally:
        engine.close()
    assert stats["counters"]["fast_steps"] >= 1 and stats["device_optimizer"]["updates"] > 0, stats["counters"]
