"""Runtime behaviour beyond the model zoo: departures from the plan, the optimizer lane, faults, close.

Tests taking the `device` fixture run on the CPU backend and (marked `gpu`) on CUDA, where the reference
trains on the GPU too: bit-for-bit on the CPU, within the numerics tests' tolerance on CUDA (the engine's
AdamW runs on the host, the reference's on the GPU, so they round differently)."""

import copy

import pytest
import torch
from torch import nn

import offload
from offload.schedule import validate_plan


def _ref_and_engine(model, budget_frac, bucket_frac=0.1, lr=1e-2, wd=0.01, device="cpu", **kw):
    torch.manual_seed(0)
    ref = copy.deepcopy(model).to(device)
    pbytes = sum(p.numel() * 4 for p in model.parameters())
    opt = offload.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    engine = offload.wrap(model, opt, budget=int(pbytes * budget_frac), device=device,
                          bucket_bytes=max(1024, int(pbytes * bucket_frac)), **kw)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=wd, foreach=False)
    return engine, opt, ref, ref_opt


def _step_both(engine, opt, ref, ref_opt, loss, *inputs):
    """One training step of the engine and of the plain-PyTorch reference on the same inputs."""
    device = next(ref.parameters()).device
    inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs]
    loss(engine(*inputs)).backward()
    opt.step()
    loss(ref(*inputs)).backward()
    ref_opt.step()
    ref_opt.zero_grad()


def _tol(device) -> dict:
    return dict(rtol=0, atol=0) if torch.device(device).type == "cpu" else dict(rtol=1e-5, atol=1e-6)


def _assert_same(engine, ref):
    got = engine.state_dict()["model"]
    tol = _tol(next(ref.parameters()).device)
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(got[name], want.cpu(), **tol, msg=lambda m: f"{name}: {m}")


class Branchy(nn.Module):
    """Takes a different path on odd steps: the plan recorded on even steps does not hold on odd ones."""

    def __init__(self, width=128, depth=8):
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.extra = nn.Linear(width, width)
        self.out = nn.Linear(width, 4)

    def forward(self, x, odd: bool):
        h = self.inp(x).tanh()
        for i, layer in enumerate(self.layers):
            if odd and i == 3:
                h = self.extra(h).tanh()  # data-dependent detour
            h = layer(h).tanh()
        return self.out(h)


def test_departure_from_plan_is_correct_and_replans(device):
    engine, opt, ref, ref_opt = _ref_and_engine(Branchy(), budget_frac=0.6, device=device)
    for step in range(12):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        odd = step % 4 == 3
        _step_both(engine, opt, ref, ref_opt, lambda out: out.square().mean(), x, odd)
    _assert_same(engine, ref)
    stats = engine.memory_stats()
    assert stats["counters"]["plan_departures"] >= 3
    assert stats["plan"]["replans"] >= 3
    validate_plan(engine._runtime.plan)
    assert stats["device_peak_bytes"] <= stats["budget_bytes"]


class ParentReadsChild(nn.Module):
    """The parent uses a child's weight directly (never calling the child), like tied LM heads written
    functionally or ``self.pos.weight[:T]``."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 96)
        self.pos = nn.Embedding(16, 96)
        self.body = nn.Sequential(*[nn.Linear(96, 96) for _ in range(6)])

    def forward(self, idx):
        h = self.emb(idx) + self.pos.weight[: idx.shape[1]]
        h = self.body(h)
        return torch.nn.functional.linear(h, self.emb.weight)  # tied, functional head


def test_functional_and_tied_uses(device):
    engine, opt, ref, ref_opt = _ref_and_engine(ParentReadsChild(), budget_frac=0.85, device=device)
    for step in range(6):
        idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        _step_both(engine, opt, ref, ref_opt, lambda out: out.logsumexp(-1).mean(), idx)
    _assert_same(engine, ref)
    assert engine.memory_stats()["counters"]["plan_departures"] == 0


@pytest.mark.parametrize("budget_frac", [0.5, 3.0])
def test_update_during_backward_equals_update_in_step(budget_frac, device):
    results = []
    for overlap in (True, False):
        torch.manual_seed(1)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(10)])
        engine, opt, _, _ = _ref_and_engine(model, budget_frac, overlap_optimizer=overlap, device=device)
        for step in range(5):
            engine(torch.randn(3, 64, generator=torch.Generator().manual_seed(step)).to(device)).sum().backward()
            opt.step()
        results.append(engine.state_dict())
        engine.close()
    for name in results[0]["model"]:
        assert torch.equal(results[0]["model"][name], results[1]["model"][name])


def test_low_arithmetic_density_streaming(device):
    """Copies dominate compute here (2 flops per weight per step): a missing wait on the copy lanes shows
    up as wrong numbers."""
    model = nn.Sequential(*[nn.Linear(32, 16384) if i % 2 == 0 else nn.Linear(16384, 32) for i in range(8)])
    engine, opt, ref, ref_opt = _ref_and_engine(model, budget_frac=0.6, bucket_frac=0.12, device=device)
    for step in range(8):
        x = torch.randn(1, 32, generator=torch.Generator().manual_seed(step))
        _step_both(engine, opt, ref, ref_opt, lambda out: out.square().sum(), x)
    _assert_same(engine, ref)
    assert engine.memory_stats()["plan"]["streamed_buckets"] > 0


def test_second_backward_without_step_is_refused():
    engine, opt, _, _ = _ref_and_engine(nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]), 3.0)
    x = torch.randn(2, 32)
    engine(x).sum().backward()
    with pytest.raises(offload.OffloadError, match="overlap_optimizer=False"):
        engine(x).sum().backward()


def test_exception_in_forward_leaves_engine_usable(device):
    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
            self.fail = False

        def forward(self, x):
            h = self.layers[:3](x)
            if self.fail:
                raise RuntimeError("boom")
            return self.layers[3:](h)

    model = Flaky()
    engine, opt, ref, ref_opt = _ref_and_engine(model, budget_frac=0.6, device=device)
    for step in range(6):
        x = torch.randn(2, 32, generator=torch.Generator().manual_seed(step))
        if step in (0, 3):
            model.fail = True
            with pytest.raises(RuntimeError, match="boom"), pytest.warns(offload.OffloadWarning, match="Discarded"):
                engine(x.to(device))
            model.fail = False
        _step_both(engine, opt, ref, ref_opt, lambda out: out.sum(), x)
    _assert_same(engine, ref)


def test_close_returns_trained_weights_and_stops_threads(device):
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    engine, opt, ref, ref_opt = _ref_and_engine(model, budget_frac=0.6, device=device)
    copy_threads = 2 if device.type == "cpu" else 0  # the CPU backend's copy lanes; CUDA copies on streams
    for step in range(3):
        x = torch.randn(2, 32, generator=torch.Generator().manual_seed(step))
        _step_both(engine, opt, ref, ref_opt, lambda out: out.sum(), x)
    assert engine._runtime.cpu.alive and engine._runtime.backend.threads_alive() == copy_threads
    engine.close()
    engine.close()  # idempotent
    ref = ref.cpu()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.device.type == "cpu"
        torch.testing.assert_close(p.detach(), q.detach(), **_tol(device), msg=lambda m: f"{name}: {m}")
    x = torch.randn(2, 32)
    torch.testing.assert_close(model(x), ref(x), **_tol(device))  # the plain module works again
    assert not engine._runtime.cpu.alive and engine._runtime.backend.threads_alive() == 0
    with pytest.raises(RuntimeError, match="closed"):
        engine(x)
    # and it can be wrapped again
    offload.wrap(model, offload.AdamW(model.parameters()), budget="1MiB", device="cpu").close()


def test_placeholders_outside_forward(device):
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
    engine, opt, _, _ = _ref_and_engine(model, budget_frac=0.6, device=device)
    engine(torch.randn(2, 16, device=device)).sum().backward()
    opt.step()
    w = model[0].weight
    assert w.shape == (16, 16) and w.dtype == torch.float32
    streamed = [m.weight for m in model if torch.isnan(m.weight).all()]
    assert streamed, "a streamed parameter must not keep stale values outside forward"
    assert all(p.grad is None for p in model.parameters())


def test_memory_stats_keys(device):
    engine, opt, _, _ = _ref_and_engine(nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]), 2.0, device=device)
    stats = engine.memory_stats()
    assert stats["plan"] is None
    engine(torch.randn(2, 16, device=device)).sum().backward()
    opt.step()
    stats = engine.memory_stats()
    for key in ("budget_bytes", "device_peak_bytes", "arena_bytes", "host_pinned_bytes", "plan"):
        assert key in stats
    for key in ("num_buckets", "resident_buckets", "streamed_buckets", "bucket_bytes",
                "arena_lower_bound_bytes", "activation_bytes", "replans"):
        assert key in stats["plan"]
    # host arena: fp32 master + grad + m + v for every (trainable) element, exactly, plus alignment
    n = sum(p.numel() for p in engine.module.parameters())
    assert 16 * n <= stats["host_pinned_bytes"] < 16 * n + 2 * 2**20


def test_adamw_unbound_matches_torch_bitwise():
    torch.manual_seed(0)
    a = nn.Linear(8, 8)
    b = copy.deepcopy(a)
    oa = offload.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(10):
        x = torch.randn(4, 8)
        a(x).sin().sum().backward()
        b(x).sin().sum().backward()
        oa.step(); ob.step(); oa.zero_grad(); ob.zero_grad()
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)


class EvalDetour(Branchy):
    """Evaluation takes a path training never takes (like generation code paths)."""

    def forward(self, x, odd: bool = False):
        return super().forward(x, odd or not self.training)


def test_eval_on_a_different_path_keeps_the_training_plan(device):
    engine, opt, ref, ref_opt = _ref_and_engine(EvalDetour(), budget_frac=0.6, device=device)
    x_eval = torch.randn(4, 16, generator=torch.Generator().manual_seed(99)).to(device)
    with torch.no_grad():  # evaluation first: the engine must cope before it has seen a training step
        torch.testing.assert_close(engine(x_eval), ref(x_eval), **_tol(device))
    for step in range(8):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        _step_both(engine, opt, ref, ref_opt, lambda out: out.square().mean(), x)
        if step % 3 == 2:
            engine.module.eval()
            ref.eval()
            with torch.no_grad():
                torch.testing.assert_close(engine(x_eval), ref(x_eval), **_tol(device))
            engine.module.train()
            ref.train()
    _assert_same(engine, ref)
    stats = engine.memory_stats()
    assert stats["counters"]["plan_departures"] >= 2  # each evaluation departs ...
    assert stats["plan"]["replans"] == 0  # ... but training keeps its plan
    assert stats["device_peak_bytes"] <= stats["budget_bytes"]
