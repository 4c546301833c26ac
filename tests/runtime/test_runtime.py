"""Runtime behaviour beyond the model zoo: departures from the plan, the optimizer lane, faults, close.

Tests taking the `device` fixture run on the CPU backend and (marked `gpu`) on CUDA, where the reference
trains on the GPU too: bit-for-bit on the CPU, within the numerics tests' tolerance on CUDA (the engine's
AdamW runs on the host, the reference's on the GPU, so they round differently).

On the CPU the reference is plain PyTorch training with an *unbound* `offload.AdamW` of the same `fused`
setting as the engine's, so the comparison stays bit for bit whichever update runs: with `fused=False` that
is `torch.optim.AdamW(foreach=False)`'s arithmetic (checked bitwise against torch below); with the default
fused kernel, torch's arithmetic except for an IEEE sqrt (see [Note: fused and torch numerics] in
offload/optim.py; the one-step bound against torch is checked below and in tests/host/test_cpu_adam.py). What
these tests catch, a missing wait or a stale or misplaced bucket, shows up as a difference either way."""

import copy

import pytest
import torch
from torch import nn

import offload
from offload.planning.schedule import validate_plan
from offload.runtime.idle_params import IdleParameter
from tests.support.budgets import fresh_device_peak, with_headroom


def _ref_and_engine(model, budget_frac, bucket_frac=0.1, lr=1e-2, wd=0.01, device="cpu", fused=None,
                    ref_first=None, **kw):
    """The engine over ``model`` and a plain-PyTorch reference (a copy, and its AdamW). ``ref_first(ref,
    ref_opt)``: trains the reference before the engine is wrapped, for a test that checks the engine's device
    peak -- on CUDA that peak is the process's ([Note: peaks] in offload/backend/cuda.py), so a reference
    training beside the engine on the same GPU (its grads, AdamW state and activations) would be in it."""
    torch.manual_seed(0)
    if torch.device(device).type != "cpu":
        # Host AdamW against the GPU's: rounding differences grow with lr (test_numerics' [Note: why lr 3e-4
        # and weight_decay 0.1]); at 1e-2 the first CUDA run (2026-11-27, H200) ended 2-11x outside the
        # tolerance on a few elements of three tests. A missing wait or a stale bucket is far outside at 3e-4.
        lr = min(lr, 3e-4)
    ref = copy.deepcopy(model).to(device)
    pbytes = sum(p.numel() * 4 for p in model.parameters())
    opt = offload.AdamW(model.parameters(), lr=lr, weight_decay=wd, fused=fused)
    if torch.device(device).type == "cpu":  # the same update arithmetic as the engine's: see the docstring
        ref_opt = offload.AdamW(ref.parameters(), lr=lr, weight_decay=wd, fused=opt.fused)
    else:
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=wd, foreach=False)
    if ref_first is not None:
        ref_first(ref, ref_opt)
        fresh_device_peak(device)
    engine = offload.wrap(model, opt, budget=with_headroom(pbytes * budget_frac, device), device=device,
                          bucket_bytes=max(1024, int(pbytes * bucket_frac)), **kw)
    return engine, opt, ref, ref_opt


def _step(module, opt, loss, *inputs, device):
    """One training step of the engine or of the plain-PyTorch reference."""
    inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs]
    loss(module(*inputs)).backward()
    opt.step()
    opt.zero_grad()


def _step_both(engine, opt, ref, ref_opt, loss, *inputs):
    """One training step of the engine and of the plain-PyTorch reference on the same inputs."""
    device = next(ref.parameters()).device
    _step(engine, opt, loss, *inputs, device=device)
    _step(ref, ref_opt, loss, *inputs, device=device)


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


@pytest.mark.parametrize("fused", [None, False], ids=["default", "torch_update"])
def test_departure_from_plan_is_correct_and_replans(device, fused):
    def steps(module, optimizer):
        for step in range(12):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
            _step(module, optimizer, lambda out: out.square().mean(), x, step % 4 == 3, device=device)

    # the reference first: this test checks the engine's device peak (see _ref_and_engine)
    engine, opt, ref, _ = _ref_and_engine(Branchy(), budget_frac=0.6, device=device, fused=fused, ref_first=steps)
    steps(engine, opt)
    _assert_same(engine, ref)
    stats = engine.memory_stats()
    assert stats["counters"]["plan_departures"] >= 3
    assert stats["plan"]["replans"] >= 3
    validate_plan(engine._runtime.executor.plan)
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


@pytest.mark.intra_op_threads  # [Note: the suite's intra-op threads] in tests/conftest.py
def test_close_returns_trained_weights_and_stops_threads(device):
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    engine, opt, ref, ref_opt = _ref_and_engine(model, budget_frac=0.6, device=device)
    copy_threads = 2 if device.type == "cpu" else 0  # the CPU backend's copy lanes; CUDA copies on streams
    for step in range(3):
        x = torch.randn(2, 32, generator=torch.Generator().manual_seed(step))
        _step_both(engine, opt, ref, ref_opt, lambda out: out.sum(), x)
    assert engine._runtime.ctx.cpu.alive and engine._runtime.ctx.backend.threads_alive() == copy_threads
    engine.close()
    engine.close()  # idempotent
    ref = ref.cpu()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.device.type == "cpu"
        torch.testing.assert_close(p.detach(), q.detach(), **_tol(device), msg=lambda m: f"{name}: {m}")
    x = torch.randn(2, 32)
    torch.testing.assert_close(model(x), ref(x), **_tol(device))  # the plain module works again
    assert not engine._runtime.ctx.cpu.alive and engine._runtime.ctx.backend.threads_alive() == 0
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
    # A streamed parameter points at a placeholder outside forward, and reads its real weights (issue 19:
    # [Note: parameters between forwards]), never NaN or stale values.
    idle = [m.weight for m in model if type(m.weight) is IdleParameter]
    assert idle, "some buckets must be streamed at this budget"
    sd = model.state_dict()
    for i, m in enumerate(model):
        assert torch.equal(m.weight.detach().cpu(), sd[f"{i}.weight"].cpu())  # (the read is on the device)
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
    # host arena: fp32 master + m + v for every (trainable) element, exactly, the grad staging ring (room for the
    # 3 largest buckets' grads, issue 18), plus alignment
    n = sum(p.numel() for p in engine.module.parameters())
    ring = engine._runtime.slots.hosted().layout.ring_bytes
    biggest = max(b.trainable_numel for b in engine._runtime.slots.buckets)
    assert 0 < ring <= 3 * 4 * biggest + 3 * 64
    assert 12 * n + ring <= stats["host_pinned_bytes"] < 12 * n + ring + 2 * 2**20


def _train_unbound_and_torch(fused: bool, steps: int = 10):
    torch.manual_seed(0)
    a = nn.Linear(96, 96)  # large enough (> ~1000 elements) for torch's sqrt to take MKL's vector path
    b = copy.deepcopy(a)
    oa = offload.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(steps):
        x = torch.randn(4, 96)
        a(x).sin().sum().backward()
        b(x).sin().sum().backward()
        oa.step(); ob.step(); oa.zero_grad(); ob.zero_grad()
    return a, b, oa, ob


def test_adamw_torch_update_matches_torch_bitwise():
    a, b, oa, ob = _train_unbound_and_torch(fused=False)
    assert not oa.fused
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)


@pytest.mark.skipif(not offload.host.cpu_adam.KERNEL_AVAILABLE, reason="the C++ kernel is not built")
def test_adamw_fused_one_step_bound_against_torch():
    """One step from the same state: m and v bitwise, the master within the kernel's proven bound (1 ulp of
    the weight + 2 ulp of the update, tests/host/test_cpu_adam.py), and differing at all on few elements. (The
    kernel multiplies by the reciprocal of the bias correction where torch divides, see cpp/cpu_adam.h: here,
    where the first step moves a median weight by ~20 %, that changes the master's last bit on ~5 % of elements.)"""
    a, b, oa, ob = _train_unbound_and_torch(fused=True, steps=1)
    assert oa.fused
    for p, q in ((a.weight, b.weight), (a.bias, b.bias)):
        sa, sb = oa.state[p], ob.state[q]
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
    with torch.no_grad():
        w0 = copy.deepcopy(b.weight)
        torch.manual_seed(0)
        w_init = nn.Linear(96, 96).weight  # the weight before the step (same seed as above)
        update = (w0 - w_init).abs()
        diff = (a.weight - b.weight).abs()
        ulp = lambda t: torch.nextafter(t.abs(), torch.tensor(float("inf"))) - t.abs()
        assert bool((diff <= ulp(w0) + 2 * ulp(update)).all())
        assert (diff != 0).float().mean() < 0.1


def test_adamw_fused_requires_the_kernel(monkeypatch):
    monkeypatch.setattr(offload.optim, "KERNEL_AVAILABLE", False)
    with pytest.raises(RuntimeError, match="KERNEL_AVAILABLE"):
        offload.AdamW(nn.Linear(2, 2).parameters(), fused=True)
    assert not offload.AdamW(nn.Linear(2, 2).parameters()).fused  # None falls back to torch ops


class EvalDetour(Branchy):
    """Evaluation takes a path training never takes (like generation code paths)."""

    def forward(self, x, odd: bool = False):
        return super().forward(x, odd or not self.training)


def test_eval_on_a_different_path_keeps_the_training_plan(device):
    x_eval = torch.randn(4, 16, generator=torch.Generator().manual_seed(99)).to(device)

    def run(module, optimizer, train_mode) -> list[torch.Tensor]:
        """Evaluation first (the engine must cope before it has seen a training step), then 8 steps with an
        evaluation in eval mode after every third; the evaluations' outputs."""
        with torch.no_grad():
            outs = [module(x_eval)]
        for step in range(8):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
            _step(module, optimizer, lambda out: out.square().mean(), x, device=device)
            if step % 3 == 2:
                train_mode.eval()
                with torch.no_grad():
                    outs.append(module(x_eval))
                train_mode.train()
        return outs

    # the reference first: this test checks the engine's device peak (see _ref_and_engine)
    ref_outs = []
    engine, opt, ref, _ = _ref_and_engine(EvalDetour(), budget_frac=0.6, device=device,
                                          ref_first=lambda ref, ref_opt: ref_outs.extend(run(ref, ref_opt, ref)))
    outs = run(engine, opt, engine.module)
    assert len(outs) == len(ref_outs) == 3
    for got, want in zip(outs, ref_outs):
        torch.testing.assert_close(got, want, **_tol(device))
    _assert_same(engine, ref)
    stats = engine.memory_stats()
    # Evaluation runs on forward-only plans of its own, one per no-grad path: the first evaluation (the
    # module still in training mode) takes the plain path, later ones the detour, which departs once from
    # the plain path's plan and then has its own. Training keeps its plan throughout.
    assert stats["counters"]["eval_plans_built"] == 2
    assert stats["counters"]["plan_departures"] == 1
    # on CUDA the first planned step is timed and may plan again ([Note: timing compute]), or its measured
    # transients replace the traced step's stand-in ([Note: transients]): one re-plan at most; nothing else does
    c = stats["counters"]
    assert stats["plan"]["replans"] == c["compute_replans"] + c["transient_replans"] <= (0 if device == "cpu" else 1)
    assert stats["device_peak_bytes"] <= stats["budget_bytes"]


def test_plan_uses_the_configured_hardware_and_the_trace_excludes_waits():
    """OffloadConfig(hw=...) reaches build_plan; the engine's own fetches and waits are overhead, not compute
    (Trace.compute_seconds), so the cost model does not count the warm-up's synchronous copies as compute."""
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    engine, opt, _, _ = _ref_and_engine(model, budget_frac=0.6, hw="pcie5")
    for step in range(2):
        engine(torch.randn(2, 64, generator=torch.Generator().manual_seed(step))).sum().backward()
        opt.step()
    rt = engine._runtime
    assert rt.executor.plan.hw_name == "pcie5" and rt.executor.plan.simulated is not None
    trace = rt.executor.trace
    assert len(trace.overhead) == len(trace.seconds) and sum(trace.overhead) > 0
    assert all(0 <= c <= s for c, s in zip(trace.compute_seconds, trace.seconds))
    engine.close()


class _LoRALinear(nn.Module):
    """A frozen ``Linear`` plus a trainable rank-``r`` adapter (LoRA-like): the largest trainable parameter,
    hence the largest gradient, is tiny next to the activations the adapted blocks save."""

    def __init__(self, d_in: int, d_out: int, r: int):
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.a = nn.Linear(d_in, r, bias=False)
        self.b = nn.Linear(r, d_out, bias=False)

    def forward(self, x):
        return self.base(x) + self.b(self.a(x))


class _LoRABlock(nn.Module):
    def __init__(self, d: int, r: int):
        super().__init__()
        self.up = nn.Linear(d, 4 * d).requires_grad_(False)
        self.down = _LoRALinear(4 * d, d, r)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))  # tanh saves its 4d-wide output: 256 KiB here


class _LoRANet(nn.Module):
    def __init__(self, d: int = 64, depth: int = 8, r: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(_LoRABlock(d, r) for _ in range(depth))

    def forward(self, x, skip_first: bool = False):
        for i, block in enumerate(self.blocks):
            if not (skip_first and i == 0):
                x = block(x)
        return x.square().mean()


@pytest.mark.parametrize("why", ["auto checkpointing chose its blocks", "the step departs from the plan"])
def test_off_plan_steps_keep_room_for_the_largest_saved_activation(why):
    """Regression: off plan, buckets fetched on demand are cached up to the budget less some headroom, and
    that headroom was only the largest gradient (2 KiB for these adapters). A saved activation (256 KiB)
    is allocated before the engine hears of it, so evicting afterwards did not undo the peak: 182 KiB
    (auto) and 246 KiB (departure) over budget. examples/finetune_frozen.py --lora 4 --checkpointing auto
    went 63 KiB over its 12.3 MiB budget the same way."""
    torch.manual_seed(0)
    model = _LoRANet()
    pbytes = sum(p.numel() * 4 for p in model.parameters())
    auto = why.startswith("auto")
    # "auto": the warm-up checkpoints every block, then fewer fit: the next step runs off plan. Departure:
    # step 2 skips the first block, so it leaves the plan at its first event.
    budget = pbytes + 1_000_000 if auto else pbytes // 2 + 2_000_000
    opt = offload.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    engine = offload.wrap(model, opt, budget=budget, bucket_bytes=pbytes // 8, device="cpu",
                          activation_checkpointing="auto" if auto else None)
    g = torch.Generator().manual_seed(0)
    try:
        for step in range(4):
            engine(torch.randn(256, 64, generator=g), skip_first=not auto and step == 2).backward()
            opt.step()
            opt.zero_grad()
            stats = engine.memory_stats()
            assert stats["device_peak_bytes"] <= budget, (step, stats["device_peak_bytes"] - budget)
        rt = engine._runtime
        assert rt.ctx.stats["on_demand_fetches"] > 0  # buckets were cached off plan: the case this guards
        if auto:  # a partial choice drops the plan: the next step runs on demand
            ckpt = stats["activation_checkpointing"]
            assert 0 < len(ckpt["checkpointed"]) < ckpt["blocks"]
        else:
            assert rt.ctx.stats["plan_departures"] > 0
    finally:
        engine.close()
