"""[Note: transients] (offload/runtime/accounting.py): what a forward and backward allocate beyond what the
plan lays out (a loss's fp32 logits, activation gradients) is learnt from the allocator and kept out of every
later plan's budget.

On the CPU these run the CPU backend given an allocator to ask (``AllocatingCPU``): it holds what the engine's
accounting holds (less the reserve it learnt, which is only a reservation), what a "user" allocated outside the
engine (``outside``), and, for an instant inside each backward, ``spike`` bytes nothing accounts for (the
backward of ``Spike``, as a loss's fp32 logits gradient on CUDA). The `gpu` test at the end measures the real
thing: a GPT's loss at a budget its plan fills.
"""

import copy

import pytest
import torch
from torch import nn

import offload
import offload.api
from offload import OffloadWarning
from offload.backend import CPUBackend
from offload.runtime import accounting
from offload.runtime.phases import Pass
from tests.support.fake_cuda import use_backend

STEPS = 8


class AllocatingCPU(CPUBackend):
    """The CPU backend with an allocator to ask (``allocated_bytes``), simulated from the engine's accounting."""

    def __init__(self) -> None:
        super().__init__()
        self.memory = None  # the engine's DeviceMemory, set once wrapped
        self.spike = 0  # bytes each backward allocates for an instant, unaccounted
        self.live = 0  # bytes each backward allocates and holds to its end (as a logits gradient), unaccounted
        self.held = 0
        self.outside = 0  # bytes a user holds on the device outside the engine
        self.peak = 0  # since wrap (what the engine reads: it never resets it)
        self.step_peak = 0  # since the step began (what the test reads: ``peaks``, one per step)
        self.peaks: list[int] = []
        self.runtime = None  # the engine's Runtime, set once wrapped: a fast step's activations are unaccounted
        self.activations = 0  # the most activation bytes a full step's accounting held

    def _real(self) -> int:
        m = self.memory
        return m.current - m.transients + self.outside + self.held + self._unseen()

    def _unseen(self) -> int:
        """What a fast step's backward holds that its accounting does not (its activations: [Note: the fast
        path]), as a full step's accounting measured them."""
        rt = self.runtime
        if rt is None or not rt.fast.on:
            self.activations = max(self.activations, self.memory.parts["activations"])
            return 0
        return self.activations if rt.ctx.phases.current is Pass.BACKWARD else 0

    def _reached(self, nbytes: int) -> None:
        self.peak = max(self.peak, nbytes)
        self.step_peak = max(self.step_peak, nbytes)

    def transient(self) -> None:
        self.held = self.live
        self._reached(self._real() + self.spike)

    def allocated_bytes(self):
        m = self.memory
        if m is None:
            return None
        # the accounting's own window peak (its real bytes: the reserve is not allocated) since the last look
        self._reached(max(m.window_peak - m.transients + self.outside, self._real()))
        return self._real(), self.peak


class Spike(torch.autograd.Function):
    """The identity; its backward makes the backend allocate ``backend.spike`` bytes for an instant."""

    backend: AllocatingCPU | None = None

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        Spike.backend.transient()
        return g


class SpikeModule(nn.Module):
    def forward(self, x):
        return Spike.apply(x)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    def hidden():
        return [m for _ in range(4) for m in (nn.Linear(128, 128), nn.ReLU())]

    # the spike where backward begins, every activation still held (as a loss's logits gradient)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), *hidden(), *hidden(), nn.Linear(128, 64), SpikeModule())


NBYTES = sum(p.numel() * 4 for p in _model().parameters())


def _train(monkeypatch, budget: int, spikes, outside=lambda step: 0, steps: int = STEPS, live=lambda step: 0,
           fast_activations: bool = False):
    """Train at ``budget`` with ``spikes(step)`` unaccounted bytes for an instant and ``live(step)`` held through
    each backward (and, with ``fast_activations``, a fast step's activations held unaccounted, as on CUDA); the
    losses, the engine's memory_stats() per step, and the backend."""
    backend = AllocatingCPU()
    use_backend(monkeypatch, lambda device, chaos: backend)
    Spike.backend = backend
    model = _model()
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    losses, stats = [], []
    with offload.wrap(model, opt, budget=budget, bucket_bytes=NBYTES // 10, device="cpu") as engine:
        backend.memory = engine._runtime.ctx.memory
        if fast_activations:
            backend.runtime = engine._runtime
        for step in range(steps):
            backend.spike, backend.outside, backend.live = spikes(step), outside(step), live(step)
            loss = engine(x).square().mean()
            engine.backward(loss)
            backend.held = 0  # the backward's live transient is gone with its graph
            opt.step()
            opt.zero_grad()
            backend.allocated_bytes()  # the step's own peak, step() included
            backend.peaks.append(backend.step_peak)
            backend.step_peak = 0
            losses.append(loss.item())
            stats.append(engine.memory_stats())
    return losses, stats, backend


BUDGET = NBYTES * 6 // 10  # a plan streams, and fills its budget to within a few buckets
# Without a reserve for it, the planned steps go over BUDGET by about 110 KB; its excess over the accounting's
# peak is more than any plan of this model leaves free under the budget, whatever compute times the plan was
# made from (plans follow the measured times, which vary with the load: a smaller one left some plans room).
LIVE = NBYTES // 3


def _not_learning(monkeypatch) -> None:
    """The engine as before [Note: transients]: windows that learn nothing."""
    def window_ends(self, allocation):
        self.window_peak, self.live = self.current, 0
        return 0
    monkeypatch.setattr(accounting.DeviceMemory, "window_ends", window_ends)


def test_a_live_transient_is_kept_out_of_the_plans(monkeypatch):
    """The first plan keeps the traced step's stand-in (its largest saved storage) out of the budget; what a
    backward holds over the accounting's own peak is measured in the first planned step, replaces it, and step()
    plans again beside it: no later step's allocator peak goes over the budget (every one did before), and the
    plan's headroom is the learnt reserve. With no transient the measure replaces the stand-in by 0."""
    base_losses, base, _ = _train(monkeypatch, BUDGET, lambda step: 0)
    losses, stats, backend = _train(monkeypatch, BUDGET, lambda step: 0, live=lambda step: LIVE)
    learnt = [s["transient_bytes"] for s in stats]
    seed = backend.memory.largest_saved  # the traced step's stand-in (a storage of the model's activations)
    assert learnt[0] == seed == stats[0]["plan"]["headroom_bytes"] > 0  # the first plan keeps it out
    assert seed < learnt[1] <= LIVE and learnt[1:] == [learnt[1]] * (STEPS - 1)
    assert stats[0]["plan"]["planned_peak_bytes"] - seed + learnt[1] > BUDGET  # the plan no longer fits
    assert stats[1]["plan"]["replans"] == stats[0]["plan"]["replans"] + 1
    assert stats[-1]["plan"]["headroom_bytes"] == learnt[1]  # the CPU backend's own headroom is 0
    assert stats[-1]["plan"]["planned_peak_bytes"] <= BUDGET
    assert max(backend.peaks[2:]) <= BUDGET  # every step after the one that taught it
    assert [s["transient_bytes"] for s in base] == [seed] + [0] * (STEPS - 1)  # measured: none
    assert losses == base_losses  # another plan, the same arithmetic
    _not_learning(monkeypatch)
    _, _, before = _train(monkeypatch, BUDGET, lambda step: 0, live=lambda step: LIVE)
    assert min(before.peaks[1:]) > BUDGET


def test_a_plan_that_outgrows_a_later_transient_is_planned_again(monkeypatch):
    """A transient first seen at step 4 (a longer batch's loss, say) makes step() plan again, beside it."""
    base_losses, _, _ = _train(monkeypatch, BUDGET, lambda step: 0)
    losses, stats, backend = _train(monkeypatch, BUDGET, lambda step: 0, live=lambda step: LIVE if step >= 4 else 0)
    learnt = [s["transient_bytes"] for s in stats]
    assert learnt[1:4] == [0] * 3 and learnt[4] > 0 and learnt[4:] == [learnt[4]] * (STEPS - 4)
    assert stats[3]["plan"]["planned_peak_bytes"] + learnt[4] > BUDGET  # the plan no longer fits
    assert stats[4]["plan"]["replans"] == stats[3]["plan"]["replans"] + 1
    assert stats[-1]["plan"]["planned_peak_bytes"] <= BUDGET
    assert max(backend.peaks[5:]) <= BUDGET
    assert losses == base_losses


def test_the_allocator_peak_teaches_an_instant_transient(monkeypatch):
    """A transient gone before the backward's first hook (an op's workspace) is seen only where it raised the
    allocator's peak: its excess over the accounting's peak of the window is learnt, and later steps fit."""
    spike = NBYTES // 3
    _, stats, backend = _train(monkeypatch, BUDGET, lambda step: spike)
    learnt = stats[-1]["transient_bytes"]
    assert 0 < learnt < spike  # the accounting's own peak was above where the spike came
    assert stats[-1]["plan"]["headroom_bytes"] == learnt
    assert backend.peaks[1] > BUDGET >= max(backend.peaks[2:])


def test_bytes_a_user_holds_outside_the_engine_are_not_its_transients(monkeypatch):
    """A tensor the user put on the device (held from step 3 on) raises the allocator's peak, but it was there
    when the forward began: nothing is learnt, and the plan stays."""
    _, stats, _ = _train(monkeypatch, BUDGET, lambda step: 0, outside=lambda step: NBYTES if step >= 3 else 0)
    assert [s["transient_bytes"] for s in stats][1:] == [0] * (STEPS - 1)  # after the traced step's stand-in
    assert stats[-1]["plan"]["replans"] == stats[2]["plan"]["replans"]


def test_transients_no_plan_keeps_out_are_kept_out_in_part_with_a_warning(monkeypatch):
    """A transient so large that no plan keeps all of it out of the budget: the plan keeps what it can, step()
    says so, and training goes on with the same arithmetic."""
    base_losses, _, _ = _train(monkeypatch, BUDGET, lambda step: 0)
    with pytest.warns(OffloadWarning, match="no plan keeps all"):
        losses, stats, _ = _train(monkeypatch, BUDGET, lambda step: 0, live=lambda step: BUDGET if step >= 4 else 0)
    assert stats[-1]["transient_bytes"] > BUDGET // 2
    assert 0 < stats[-1]["plan"]["headroom_bytes"] < BUDGET and stats[-1]["plan"]["planned_peak_bytes"] == BUDGET
    assert losses == base_losses


def test_a_fast_steps_unaccounted_activations_are_not_transients(monkeypatch):
    """A fast step's accounting leaves its activations out ([Note: the fast path]) while the allocator holds them:
    its window teaches nothing, or the activations would be reserved a second time (on the H200, run 7, gpt2-xl
    at 8 GiB learnt 2.84 GB so, and streamed 379 of 386 buckets: 0.78 s a step against 0.55 s)."""
    _, stats, backend = _train(monkeypatch, NBYTES * 4, lambda step: 0, fast_activations=True)
    assert stats[-1]["plan"]["streamed_buckets"] == 0 and stats[-1]["counters"]["fast_steps"] >= STEPS - 3
    assert backend.activations > 0  # held unaccounted by every fast step's backward
    assert [s["transient_bytes"] for s in stats][1:] == [0] * (STEPS - 1)
    assert stats[-1]["plan"]["replans"] == stats[1]["plan"]["replans"]


class _GPT(nn.Module):
    """Embedding, MLP blocks, an untied head: logits whose fp32 loss is the largest transient of a step."""

    def __init__(self, vocab: int, dim: int, blocks: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(),
                                                    nn.Linear(4 * dim, dim)) for _ in range(blocks)])
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        return self.head(self.blocks(self.embed(idx)))


def _gpu_steps(budget: int, steps: int) -> tuple[dict, int]:
    """Train a fresh _GPT at ``budget`` on CUDA; its last memory_stats() and the allocator's peak above what was
    allocated at wrap over every step after the first two (the traced one, and the first planned one, which
    teaches the transients: the test owns the process's peak statistic)."""
    torch.manual_seed(0)
    vocab, seq = 32768, 256
    model = _GPT(vocab, 1024, 4)
    idx = torch.randint(0, vocab, (1, seq + 1), device="cuda")
    opt = offload.AdamW(model.parameters(), lr=1e-4)
    base = torch.cuda.memory_allocated()
    with offload.wrap(model, opt, budget=budget, device="cuda") as engine:
        for step in range(steps):
            if step == 2:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            logits = engine(idx[:, :-1])
            loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
            engine.backward(loss)
            del logits, loss
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        return engine.memory_stats(), torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_loss_transient_fits_the_budget(monkeypatch):
    """On CUDA: a GPT whose loss makes fp32 logits and their gradient, which no plan lays out, at the budget its
    plan would fill exactly without a reserve for them: the steps after the one that learns them stay within it.
    (On the H200, run 6, this model did not go over that budget even learning nothing, by 1 MB: the figure
    learning nothing is printed, not asserted; the bench's gpt3-2.7b at 8 GiB is the case that ran out of memory.)"""
    roomy, _ = _gpu_steps(4 << 30, 4)
    learnt = roomy["transient_bytes"]
    budget = roomy["plan"]["planned_peak_bytes"] - learnt  # every bucket resident, nothing kept for transients
    stats, peak = _gpu_steps(budget, 7)
    _not_learning(monkeypatch)
    before, peak_before = _gpu_steps(budget, 7)
    print(f"\ntransients learnt {learnt} B (roomy budget, {roomy['counters']['fast_steps']} fast steps of 4), "
          f"{stats['transient_bytes']} B at the budget of {budget} B: "
          f"allocator peak after the second step {peak} B ({peak_before} B learning nothing); plan "
          f"{stats['plan']['resident_buckets']}/{stats['plan']['num_buckets']} buckets resident "
          f"({before['plan']['resident_buckets']} learning nothing), planned peak "
          f"{stats['plan']['planned_peak_bytes']} B ({torch.cuda.get_device_name()})")
    assert peak <= budget
