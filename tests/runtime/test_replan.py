"""Execution order that changes from step to step: the plan is a cache of the last step's trace.

Five patterns, each trained through the engine and with plain PyTorch + torch.optim.AdamW on the same
batches: a data-dependent branch, layers skipped on some steps (LayerDrop), a mixture-of-experts router
(only the experts that receive tokens run), a shared block called a data-dependent number of times, and
two blocks whose order swaps. For each the test checks:

* numbers: every loss and the final weights equal the reference's (the numerics tests' tolerance);
* detection at the first mismatch: the runtime leaves the plan at exactly the first event where this
  step's recorded order differs from the plan's, and on no step whose order equals the previous step's;
* re-planning: every departure re-records the trace and builds a new plan (``memory_stats()`` counts
  them), and the device peak stays within the budget;
* never a hang: a watchdog fails the test (with every thread's stack) if a step takes minutes.
"""

import copy
import faulthandler
import math
import sys
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import offload
from tests.support.fake_cuda import with_chaos
from tests.support.warnings_filters import DEPARTING

ADAMW = dict(lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
TOL = dict(rtol=0, atol=0)  # bit for bit: the engine runs offload.AdamW(fused=False), torch's arithmetic (tests/support/compare.py)
WIDTH = 64


@pytest.fixture(autouse=True)
def watchdog():
    """A hang would block the run forever: dump every thread's stack and exit after 5 minutes instead."""
    faulthandler.dump_traceback_later(300, exit=True, file=sys.stderr)
    yield
    faulthandler.cancel_dump_traceback_later()


def _linear(i, o=WIDTH):
    layer = nn.Linear(i, o)
    nn.init.normal_(layer.weight, std=1.0 / math.sqrt(i))
    return layer


class Branch(nn.Module):
    """A data-dependent branch: an extra block runs when the batch's mean is positive."""

    def __init__(self):
        super().__init__()
        self.inp = _linear(16)
        self.body = nn.ModuleList(_linear(WIDTH) for _ in range(6))
        self.extra = _linear(WIDTH)
        self.out = _linear(WIDTH, 4)

    def forward(self, x, step):
        h = self.inp(x).tanh()
        for i, layer in enumerate(self.body):
            if i == 3 and x.mean() > 0:
                h = self.extra(h).tanh()
            h = layer(h).tanh()
        return self.out(h)


class LayerDrop(nn.Module):
    """Layers skipped on some steps (stochastic depth / LayerDrop), drawn from the step number."""

    def __init__(self):
        super().__init__()
        self.inp = _linear(16)
        self.body = nn.ModuleList(_linear(WIDTH) for _ in range(8))
        self.out = _linear(WIDTH, 4)

    def forward(self, x, step):
        keep = torch.rand(len(self.body), generator=torch.Generator().manual_seed(step)) > 0.3
        h = self.inp(x).tanh()
        for layer, k in zip(self.body, keep.tolist()):
            if k:
                h = h + layer(h).tanh()
        return self.out(h)


class MoE(nn.Module):
    """A mixture-of-experts layer: a router sends each row to its top-1 expert; only experts that receive
    rows run, so which experts (and in which order) changes with the data."""

    def __init__(self, experts=8):
        super().__init__()
        self.inp = _linear(16)
        self.router = _linear(WIDTH, experts)
        self.experts = nn.ModuleList(nn.Sequential(_linear(WIDTH), nn.Tanh(), _linear(WIDTH)) for _ in range(experts))
        self.out = _linear(WIDTH, 4)

    def forward(self, x, step):
        h = self.inp(x).tanh()
        gate = self.router(h).softmax(-1)
        weight, choice = gate.max(-1)
        mixed = torch.zeros_like(h)
        for e in choice.unique().tolist():  # data-dependent set of experts
            rows = (choice == e).nonzero().squeeze(1)
            mixed = mixed.index_add(0, rows, self.experts[e](h[rows]) * weight[rows, None])
        return self.out(h + mixed)


class Router(nn.Module):
    """A shared block called a data-dependent number of times (adaptive depth), 1 to 4."""

    def __init__(self):
        super().__init__()
        self.inp = _linear(16)
        self.block = nn.Sequential(_linear(WIDTH), nn.Tanh(), _linear(WIDTH))
        self.pre = nn.ModuleList(_linear(WIDTH) for _ in range(8))
        self.out = _linear(WIDTH, 4)

    def forward(self, x, step):
        h = self.inp(x).tanh()
        for layer in self.pre:
            h = layer(h).tanh()
        calls = 1 + int(x.abs().sum().item() * 1000) % 4
        for _ in range(calls):
            h = h + 0.5 * self.block(h).tanh()
        return self.out(h)


class Swap(nn.Module):
    """The same modules every step, in another order on some steps."""

    def __init__(self):
        super().__init__()
        self.inp = _linear(16)
        self.a = nn.Sequential(*[_linear(WIDTH) for _ in range(3)])
        self.b = nn.Sequential(*[_linear(WIDTH) for _ in range(3)])
        self.out = _linear(WIDTH, 4)

    def forward(self, x, step):
        h = self.inp(x).tanh()
        first, second = (self.a, self.b) if x[0, 0] > 0 else (self.b, self.a)
        return self.out(second(first(h).tanh()).tanh())


PATTERNS = {"branch": Branch, "layerdrop": LayerDrop, "moe": MoE, "repeat": Router, "swap": Swap}


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(6, 16, generator=g)
    return x, torch.randn(6, 4, generator=g)


@dataclass
class Run:
    losses: list
    state: dict
    stats: dict
    ref_losses: list
    ref_state: dict
    changed: list  # per step after the first: did the recorded order differ from the previous step's?
    departed: list  # per step after the first: did the runtime leave the plan?
    detected_at: list  # per departure: (event index where the runtime left the plan, first mismatch index)


def _first_mismatch(a, b) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def train_pattern(make, steps=12, chaos=None, budget_frac=0.6) -> Run:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = make()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    opt = offload.AdamW(model.parameters(), fused=False, **ADAMW)
    with with_chaos(chaos):
        engine = offload.wrap(model, opt, budget=int(budget_frac * nbytes), bucket_bytes=nbytes // 12, device="cpu")
    rt = engine._runtime
    leaves = []
    leave = rt.executor.leave

    def spy(*where):  # where the runtime noticed the departure, and the plan it departed from
        leaves.append((rt.executor.pos, rt.executor.plan.trace.events))
        leave(*where)

    rt.executor.leave = spy
    losses, ref_losses, changed, departed, detected, previous = [], [], [], [], [], None
    try:
        for step in range(steps):
            x, y = batch(step)
            before = rt.ctx.stats["plan_departures"]
            leaves.clear()
            loss = (engine(x, step) - y).square().mean()
            loss.backward()
            events = rt.executor.trace.events  # this step, as recorded
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if previous is not None:
                changed.append(events != previous)
                departed.append(rt.ctx.stats["plan_departures"] > before)
                detected += [(pos, _first_mismatch(planned, events)) for pos, planned in leaves]
            previous = events
            ref_loss = (ref(x, step) - y).square().mean()
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(ref_loss.item())
        return Run(losses, engine.state_dict()["model"], engine.memory_stats(), ref_losses, ref.state_dict(),
                   changed, departed, detected)
    finally:
        engine.close()


@pytest.mark.filterwarnings(DEPARTING)  # each step departs, as this test means: [Note: steps that keep departing]
@pytest.mark.parametrize("name", list(PATTERNS))
def test_changing_execution_order(name):
    run = train_pattern(PATTERNS[name])
    # the pattern really changes the order on some steps, and keeps it on others
    assert any(run.changed), "the pattern never changed the execution order"
    # numbers: as plain PyTorch
    assert run.losses == pytest.approx(run.ref_losses, rel=TOL["rtol"], abs=TOL["atol"])
    for key, want in run.ref_state.items():
        torch.testing.assert_close(run.state[key], want, **TOL, msg=lambda m, key=key: f"{key}: {m}")
    # detection: the plan is left on exactly the steps whose order changed, at the first mismatch
    assert run.departed == run.changed
    assert run.detected_at and all(pos == first for pos, first in run.detected_at), run.detected_at
    # re-planning: one new plan per departure, counted by memory_stats(), within the budget
    stats = run.stats
    assert stats["plan"]["replans"] == sum(run.departed) == stats["counters"]["plan_departures"]
    assert stats["counters"]["on_demand_fetches"] > 0  # departing steps finished by fetching on demand
    assert stats["device_peak_bytes"] <= stats["budget_bytes"]
