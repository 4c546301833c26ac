"""The fast path (offload/runtime/fast_path.py, [Note: the fast path]): a step on a verified plan whose buckets
are all resident, with nothing checkpointed, runs with no hook on module calls below the root, no use
detector and no saved-tensor hooks. Every test trains the engine and plain PyTorch + torch.optim.AdamW
(foreach=False; the engine's AdamW with fused=False: torch's arithmetic) side by side, bit for bit, through
the cases the previous attempt broke (benchmarks/results/cpu-2026-11-26/overhead-profile.md, section 5):
a data-dependent branch that skips a module (its grads must not be lost, nor waited for forever), a step
that departs from the plan mid-forward (the fast forward cannot see it: it is caught in backward), a step
with other input shapes (caught at the root: the full path runs it), and the record of a fast step (too
thin to plan from: a plan is only ever built from a full step's record). Each test also checks the fast path
really ran (``counters["fast_steps"]``), so that none passes by running the full path only."""

import copy

import pytest
import torch
from torch import nn

import offload
from offload.planning.schedule import validate_plan
from offload.planning.trace import EventKind
from offload.testing.chaos import ChaosConfig
from tests.support.compare import assert_bitwise, assert_losses_bitwise
from tests.support.fake_cuda import simulated_gpu, with_chaos  # noqa: F401 (a fixture)
from tests.support.loops import finish_step
from tests.support.models import tanh_mlp
from tests.support.warnings_filters import DEPARTING

ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _pair(model, budget_frac=4.0, bucket_frac=0.1, chaos=None, **kw):
    """(engine, opt, ref, ref_opt): the engine all resident (budget ``budget_frac`` x the weights); ``chaos``:
    random delays on the copy and AdamW lanes (a missing wait shows up as wrong numbers)."""
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    opt = offload.AdamW(model.parameters(), fused=False, **ADAMW)
    with with_chaos(chaos):
        engine = offload.wrap(model, opt, budget=int(budget_frac * nbytes),
                              bucket_bytes=max(256, int(nbytes * bucket_frac)), dtype=torch.float32, device="cpu", **kw)
    return engine, opt, ref, ref_opt


def _step(forward, opt, loss_fn, *inputs) -> float:
    return finish_step(loss_fn(forward(*inputs)), opt)


def _counters(engine) -> dict:
    return dict(engine.memory_stats()["counters"])


def _assert_same(engine, ref) -> None:
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "model")


def _x(step: int, batch: int = 8, width: int = 32) -> torch.Tensor:
    return torch.randn(batch, width, generator=torch.Generator().manual_seed(step))


def _mse(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _mlp(depth=12, width=32) -> nn.Module:
    return tanh_mlp(depth, width)


@pytest.mark.parametrize("chaos", [None, ChaosConfig(seed=3)], ids=["plain", "chaos"])
def test_resident_steps_take_the_fast_path_bit_for_bit(chaos):
    engine, opt, ref, ref_opt = _pair(_mlp(), chaos=chaos)
    rt = engine._runtime
    try:
        losses, ref_losses = [], []
        for step in range(8):
            losses.append(_step(engine, opt, _mse, _x(step)))
            ref_losses.append(_step(ref, ref_opt, _mse, _x(step)))
            if step >= 2:  # the traced step, then one full step on the plan verifies it
                assert rt.fast.hooks_removed
        assert_losses_bitwise(losses, ref_losses)
        _assert_same(engine, ref)
        c = _counters(engine)
        assert c["fast_steps"] == 6, c
        assert c["plan_departures"] == 0 and c["replans"] == 0, c
        assert engine.memory_stats()["plan"]["streamed_buckets"] == 0
    finally:
        engine.close()


def _bucket_grad_bytes(engine) -> list[int]:
    """Per bucket of the engine's plan: the bytes of its parameters' grads (fp32)."""
    params = list(engine.module.parameters())
    return [sum(params[p].numel() * 4 for run in b.runs for p in run.params)
            for b in engine._runtime.executor.plan.buckets]


def test_a_fast_steps_grads_count_in_the_device_peak():
    """A fast step leaves each grad in ``p.grad`` until its bucket's last one came, then gathers the bucket at
    once ([Note: one hook's work per bucket]) without adding its grads to the accounted bytes and taking them off
    again (``DeviceMemory.passing``): the peak still sees the grads autograd held together, a whole bucket's.
    Nothing else on the fast path changes the accounted bytes (all resident, activations not counted), so from
    a reset peak one fast step ends at exactly the largest bucket's grads above the current bytes."""
    engine, opt, ref, ref_opt = _pair(_mlp())
    try:
        for step in range(3):  # traced, planned (verifies), fast
            _step(engine, opt, _mse, _x(step))
        memory = engine._runtime.ctx.memory
        base = memory.current
        memory.peak = base
        _step(engine, opt, _mse, _x(3))
        assert _counters(engine)["fast_steps"] == 2
        assert memory.current == base and memory.parts["grads"] == 0
        held = _bucket_grad_bytes(engine)
        assert max(held) > max(p.numel() * 4 for p in engine.module.parameters())  # a bucket holds several grads
        assert memory.peak == base + max(held)
        assert memory.peak <= engine._runtime.executor.plan.budget_bytes
    finally:
        engine.close()


def test_a_bucket_whose_grads_do_not_fit_at_once_gathers_each_grad_as_it_comes():
    """Where a whole bucket's grads held at once would not fit the budget beside the plan's peak, the fast step
    gathers each grad as it comes (the peak grows by the largest grad only), bit for bit all the same."""
    engine, opt, ref, ref_opt = _pair(_mlp(), bucket_frac=0.5)
    try:
        losses, ref_losses = [], []
        for step in range(3):
            losses.append(_step(engine, opt, _mse, _x(step)))
            ref_losses.append(_step(ref, ref_opt, _mse, _x(step)))
        rt = engine._runtime
        plan = rt.executor.plan
        held = max(_bucket_grad_bytes(engine))
        # shrink the plan's budget to just what it needs with one grad at a time (plans are frozen: a copy)
        import dataclasses
        tight = dataclasses.replace(plan, budget_bytes=plan.peak_bytes + (held - plan.trace.max_grad_bytes) // 2)
        assert rt.fast.allows(tight).ok and rt.fast.allows(tight).closes is None
        assert rt.fast.allows(plan).closes is not None
        rt.fast._allowed = None
        rt.executor.train_plan = rt.executor.plan = tight
        rt.fast.verified_plan = tight
        memory = rt.ctx.memory
        base = memory.current
        memory.peak = base
        losses.append(_step(engine, opt, _mse, _x(3)))
        ref_losses.append(_step(ref, ref_opt, _mse, _x(3)))
        assert _counters(engine)["fast_steps"] == 2
        assert memory.peak == base + max(p.numel() * 4 for p in engine.module.parameters())
        assert_losses_bitwise(losses, ref_losses)
        _assert_same(engine, ref)
    finally:
        engine.close()


def test_streamed_plan_never_takes_the_fast_path():
    engine, opt, ref, ref_opt = _pair(_mlp(width=64), budget_frac=0.6)
    try:
        for step in range(5):
            _step(engine, opt, _mse, _x(step, 4, 64))
            _step(ref, ref_opt, _mse, _x(step, 4, 64))
        _assert_same(engine, ref)
        assert engine.memory_stats()["plan"]["streamed_buckets"] > 0
        assert _counters(engine)["fast_steps"] == 0
        assert not engine._runtime.fast.hooks_removed
    finally:
        engine.close()


class Gated(nn.Module):
    """``extra`` runs only where the batch says so (data-dependent): a step that skips it gives its
    parameters no grad (torch's AdamW then skips them, no weight decay either). ``extra`` shares its bucket
    with neighbours, so that bucket cannot be completed by counting grads: it must go at the end of backward."""

    def __init__(self, width=32, depth=6):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(width, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.extra = nn.Linear(width, width)
        self.out = nn.Linear(width, 4)

    def forward(self, x):
        h = self.inp(x).tanh()
        for i, layer in enumerate(self.layers):
            if i == 3 and bool(x[0, 0] > 0):
                h = self.extra(h).tanh()
            h = layer(h).tanh()
        return self.out(h)


def _gated_x(step: int, take: bool) -> torch.Tensor:
    x = _x(step)
    x[0, 0] = 1.0 if take else -1.0
    return x


def _train_gated_alike(engine, opt, ref, ref_opt, takes) -> None:
    """One step per entry of ``takes`` (whether the gated branch runs) on both; the same losses and weights."""
    losses, ref_losses = [], []
    for step, take in enumerate(takes):
        losses.append(_step(engine, opt, _mse, _gated_x(step, take)))
        ref_losses.append(_step(ref, ref_opt, _mse, _gated_x(step, take)))
    assert_losses_bitwise(losses, ref_losses)
    _assert_same(engine, ref)


@pytest.mark.filterwarnings(DEPARTING)  # each step departs, as this test means: [Note: steps that keep departing]
@pytest.mark.parametrize("bucket_frac", [0.12, 0.3], ids=["layer-buckets", "3-layer-buckets"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "deferred"])
def test_branch_that_skips_a_module_loses_no_grad(overlap, bucket_frac):
    """Planned (and verified) with the branch taken; later steps skip it now and then. Same input shapes, so
    the root cannot tell: the fast step runs, the skipped grads are noticed in backward. With buckets of
    several layers, grads of the skipped module's bucket wait in ``p.grad`` for a last grad that never comes
    ([Note: one hook's work per bucket]): the departure gathers them first."""
    engine, opt, ref, ref_opt = _pair(Gated(), bucket_frac=bucket_frac, overlap_optimizer=overlap)
    fast = engine._runtime.fast
    waited, waiting = [], fast.waiting

    def spy():
        got = waiting()
        waited.append(len(got))
        return got
    fast.waiting = spy
    try:
        takes = [True, True, True, False, True, True, False, False, True, True, True]
        _train_gated_alike(engine, opt, ref, ref_opt, takes)
        c = _counters(engine)
        assert c["fast_steps"] >= 4, c  # steps 2, 3 (skips: departs in backward), 5, 9, ...
        assert c["plan_departures"] >= 1, c  # the skipped branch was noticed
        if bucket_frac > 0.2:
            assert max(waited) > 0, waited  # grads were waiting when the step departed
    finally:
        engine.close()


@pytest.mark.filterwarnings(DEPARTING)  # each step departs, as this test means: [Note: steps that keep departing]
def test_branch_first_skipped_then_taken_gets_its_grads():
    """Planned with the branch skipped: its parameters never had a grad in the plan's step. A step that
    takes it must not lose their grads (a fast path trusting the plan's grads would finish their bucket
    early); the fast path does not take such a plan, the full path departs and re-plans as before."""
    engine, opt, ref, ref_opt = _pair(Gated(), bucket_frac=0.12)
    try:
        takes = [False, False, False, True, False, False, True, True, False]
        _train_gated_alike(engine, opt, ref, ref_opt, takes)
    finally:
        engine.close()


class Swappable(nn.Module):
    """Two blocks called in either order, by a flag set between steps (same input shapes): a changed model."""

    def __init__(self, width=32):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(width, width)
        self.a = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
        self.b = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
        self.out = nn.Linear(width, 4)
        self.swap = False

    def forward(self, x):
        h = self.inp(x).tanh()
        first, second = (self.b, self.a) if self.swap else (self.a, self.b)
        return self.out(second(first(h).tanh()).tanh())


@pytest.mark.filterwarnings(DEPARTING)  # each step departs, as this test means: [Note: steps that keep departing]
def test_departure_mid_forward_is_caught_and_the_next_step_runs_the_full_path():
    engine, opt, ref, ref_opt = _pair(Swappable(), bucket_frac=0.15)
    rt = engine._runtime
    try:
        losses, ref_losses = [], []
        for step in range(10):
            swap = step in (4, 7, 8)
            engine.module.swap = ref.swap = swap
            before = _counters(engine)
            losses.append(_step(engine, opt, _mse, _x(step)))
            ref_losses.append(_step(ref, ref_opt, _mse, _x(step)))
            after = _counters(engine)
            if step == 4:  # fast (the root cannot see the order), departs in backward: grads order differs
                assert after["fast_steps"] == before["fast_steps"] + 1
                assert after["plan_departures"] == before["plan_departures"] + 1
                assert after["replans"] == before["replans"]  # never planned from a fast step's record
                assert not rt.fast.hooks_removed  # the next step runs the full path
            if step == 5:  # the full path: departs (back to the planned order) ... as it always did
                assert after["fast_steps"] == before["fast_steps"]
        assert_losses_bitwise(losses, ref_losses)
        _assert_same(engine, ref)
        validate_plan(rt.executor.train_plan)
    finally:
        engine.close()


def test_other_input_shapes_run_the_full_path():
    engine, opt, ref, ref_opt = _pair(_mlp())
    try:
        losses, ref_losses = [], []
        for step in range(9):
            batch = 5 if step in (5, 6) else 8  # a short last batch, say
            before = _counters(engine)
            losses.append(_step(engine, opt, _mse, _x(step, batch)))
            ref_losses.append(_step(ref, ref_opt, _mse, _x(step, batch)))
            fast = _counters(engine)["fast_steps"] > before["fast_steps"]
            # other shapes: the full path, which follows the plan (smaller activations), so the next step with
            # those shapes runs fast, and the plan's own shapes stay verified
            assert fast == (step not in (0, 1, 5)), step
        assert_losses_bitwise(losses, ref_losses)
        _assert_same(engine, ref)
        assert _counters(engine)["fast_steps"] >= 4
    finally:
        engine.close()


def test_a_plan_is_only_built_from_a_full_steps_record():
    """A fast step records no uses, no saved-weight reads: the next plan must come from a full step."""
    engine, opt, ref, ref_opt = _pair(Gated(), bucket_frac=0.12)
    rt = engine._runtime
    try:
        takes = [True, True, True, True, False, False, False, False, False]
        for step, take in enumerate(takes):
            _step(engine, opt, _mse, _gated_x(step, take))
            _step(ref, ref_opt, _mse, _gated_x(step, take))
            plan = rt.executor.train_plan
            trace = plan.trace
            # a full step's record: every forward call has its uses, backward reads saved weights (UNPACK)
            assert any(e.kind is EventKind.UNPACK for e in trace.events)
            assert trace.touched and {q for u in trace.uses[:trace.num_forward] for q in u} == set(trace.touched)
        _assert_same(engine, ref)
        c = _counters(engine)
        assert c["replans"] >= 1 and c["fast_steps"] >= 3, c  # re-planned for the skipping path, then fast on it
    finally:
        engine.close()


@pytest.mark.filterwarnings(DEPARTING)  # each step departs, as this test means: [Note: steps that keep departing]
def test_submodule_called_directly_between_fast_steps():
    """With the hooks below the root removed, a direct call of a submodule is not seen by any hook: it must
    still read the updated weights, and its backward must lose no grad."""
    engine, opt, ref, ref_opt = _pair(_mlp(), chaos=ChaosConfig(seed=5, max_delay_ms=5.0))
    try:
        for step in range(8):
            for f, o, m in ((engine, opt, engine.module), (ref, ref_opt, ref)):
                _mse(f(_x(step))).backward()
                o.step()  # the new weights are being copied in (the engine's copy lane, delayed)
                with torch.no_grad():  # read at once, by a module no hook sees
                    out = m[2](_x(50)), m[22](_x(51))
                o.zero_grad()
                if f is engine:
                    got = out
            assert torch.equal(got[0], out[0]) and torch.equal(got[1], out[1]), step
        assert engine._runtime.fast.hooks_removed
        for step in range(8, 10):  # train through a submodule alone, then the whole model again
            _step(engine.module[2], opt, _mse, _x(step))
            _step(ref[2], ref_opt, _mse, _x(step))
            _step(engine, opt, _mse, _x(step))
            _step(ref, ref_opt, _mse, _x(step))
        _assert_same(engine, ref)
    finally:
        engine.close()


def test_accumulation_and_eval_between_fast_steps():
    engine, opt, ref, ref_opt = _pair(_mlp(), overlap_optimizer=False)
    try:
        for step in range(7):
            for f, o in ((engine, opt), (ref, ref_opt)):
                for micro in range(2):
                    _mse(f(_x(10 * step + micro))).backward()
                torch.nn.utils.clip_grad_norm_(engine.module.parameters() if f is engine else ref.parameters(), 0.05)
                o.step()
                o.zero_grad()
            if step == 3:
                with torch.no_grad():
                    assert torch.equal(engine(_x(99)), ref(_x(99)))
        _assert_same(engine, ref)
        assert _counters(engine)["fast_steps"] >= 8
    finally:
        engine.close()


class Faulty(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = _mlp(6)
        self.fail = False

    def forward(self, x):
        h = self.body[:5](x)
        if self.fail:
            raise RuntimeError("boom")
        return self.body[5:](h)


def test_forward_that_raises_on_the_fast_path():
    engine, opt, ref, ref_opt = _pair(Faulty())
    try:
        for step in range(7):
            if step == 4:
                engine.module.fail = True
                with pytest.raises(RuntimeError, match="boom"), pytest.warns(offload.errors.OffloadWarning):
                    engine(_x(step))
                engine.module.fail = False
            _step(engine, opt, _mse, _x(step))
            _step(ref, ref_opt, _mse, _x(step))
        _assert_same(engine, ref)
        assert _counters(engine)["fast_steps"] >= 3
    finally:
        engine.close()


def test_a_fast_steps_refresh_keeps_parameters_bound_and_they_read_the_new_weights():
    """On the fast path ``step()`` lands the refreshed weights before it returns (``settle``), so the parameters
    stay bound to their slots across the copy ([Note: parameters show landed slots] in slots.py): no unbind and
    bind per parameter per step, and a read right after ``step()`` sees the new weights, bit for bit torch's."""
    engine, opt, ref, ref_opt = _pair(_mlp())
    rt = engine._runtime
    backend = rt.ctx.backend
    binds = []
    real_bind = backend.bind

    def counting_bind(param, value):
        binds.append(param)
        real_bind(param, value)
    backend.bind = counting_bind
    try:
        for step in range(4):
            loss = _mse(engine(_x(step)))
            loss.backward()
            _mse(ref(_x(step))).backward()
            binds.clear()
            opt.step()
            ref_opt.step()
            if step >= 2:  # a fast step: its refresh lands at once (before, the weights in flight read NaN)
                assert rt.fast.hooks_removed
                assert binds == [], len(binds)
                for p, q in zip(engine.module.parameters(), ref.parameters()):
                    assert torch.equal(p.detach(), q.detach())
            opt.zero_grad()
            ref_opt.zero_grad()
        assert _counters(engine)["fast_steps"] == 2
    finally:
        engine.close()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "deferred"])
def test_fast_steps_on_the_simulated_gpu_order_the_refresh_after_backward(simulated_gpu, overlap):
    """On CUDA ``step()``'s refresh of the resident buckets writes slots the backward just read. A fast step's
    end of backward marks the boundary those copies wait for, as a full step's does (``release_all``). Before,
    nothing did: the copies were ordered after compute only through the host (the AdamW lane had waited for
    the grads' copy), which the simulated GPU, as late as CUDA allows, reported as a race at the first fast
    step's refresh. Here: no race over several fast steps, and the numbers are the CPU backend's."""
    def run():
        engine, opt, ref, ref_opt = _pair(_mlp(depth=4, width=16), overlap_optimizer=overlap)
        losses = [_step(engine, opt, _mse, _x(step, width=16)) for step in range(6)]
        counters = _counters(engine)
        state = engine.state_dict()["model"]
        engine.close()
        return losses, state, counters

    want_losses, want_state, _ = run()
    made = simulated_gpu()
    losses, state, counters = run()
    assert counters["fast_steps"] >= 3, counters  # the path under test ran
    assert_losses_bitwise(losses, want_losses)
    assert_bitwise(state, want_state, "model")
    assert made[0]._api.copies > 0 and made[0]._api.pending() == 0


def test_a_fast_steps_waiting_grads_are_taken_by_the_hooks_first_test():
    """[Note: one hook's work per bucket]: in a fast step's backward every grad that only waits for its bucket's
    last grad is taken by the grad hook's first test (``param is fast.expect``), never reaching the runtime's
    grad path; only the backward's first grad (which begins it) and the grads that close a bucket do. Outside a
    fast step's backward nothing is expected."""
    engine, opt, ref, ref_opt = _pair(_mlp(), bucket_frac=0.3)
    rt = engine._runtime
    fast = rt.fast
    took, full = [], []
    took_waiting, on_grad = fast.took_waiting, rt._on_grad

    def spy_took():
        took.append(id(fast.expect))
        took_waiting()

    def spy_on_grad(param):
        full.append(id(param))
        on_grad(param)
    fast.took_waiting, rt._on_grad = spy_took, spy_on_grad
    try:
        losses, ref_losses = [], []
        for step in range(6):
            took.clear()
            full.clear()
            losses.append(_step(engine, opt, _mse, _x(step)))
            ref_losses.append(_step(ref, ref_opt, _mse, _x(step)))
            assert fast.expect is None
            if step >= 2:  # fast steps
                allowed = fast.allows(rt.executor.train_plan)
                params = engine._runtime.ctx.params
                closes = allowed.closes
                assert closes is not None and 1 < len(closes) < len(allowed.grad_keys)
                first, *rest = allowed.grad_keys  # the backward's first grad begins it: the runtime's path
                assert took == [id(params[p]) for p in rest if p not in closes]
                assert full == [id(params[first])] + [id(params[p]) for p in rest if p in closes]
        assert_losses_bitwise(losses, ref_losses)
        _assert_same(engine, ref)
        assert _counters(engine)["fast_steps"] == 4
    finally:
        engine.close()


@pytest.mark.parametrize("width", [32, 5], ids=["whole", "padded"])
def test_a_grad_slot_the_bucket_fills_whole_is_not_cleared_first(width, monkeypatch):
    """A fast step gathering a bucket at once into a slot that its grads fill whole (no padding between
    parameters) skips clearing the slot: the copy writes every element. Checked by leaving garbage (NaN) in
    such a slot, as its previous occupant might: the weights stay bit for bit torch's. With padding (width 5:
    20-byte rows, parameters aligned to 16 bytes) the slot is cleared as before. Lanes mode: inline, the buckets go
    as one batch through no slot ([Note: sent as one batch]; its clearing: tests/runtime/test_batch_send.py)."""
    monkeypatch.setenv("OFFLOAD_CPU_COPIES", "lanes")
    engine, opt, ref, ref_opt = _pair(_mlp(depth=6, width=width), bucket_frac=0.3)
    grads = engine._runtime.grads
    grad_slot, cleared = grads._grad_slot, []

    def spy(b, clear=True):
        view = grad_slot(b, clear)
        cleared.append(clear)
        if not clear:
            view.fill_(float("nan"))
        return view
    grads._grad_slot = spy
    send = grads.fast_send  # [Note: one routine per fast bucket]: its slot, taken the same way
    send_slot = send._slot

    def send_spy(r):
        view, views = send_slot(r)
        cleared.append(not r.whole)
        if r.whole:
            view.fill_(float("nan"))
        return view, views
    send._slot = send_spy
    try:
        losses, ref_losses = [], []
        for step in range(6):
            losses.append(_step(engine, opt, _mse, _x(step, width=width)))
            ref_losses.append(_step(ref, ref_opt, _mse, _x(step, width=width)))
        assert _counters(engine)["fast_steps"] == 4
        if width == 32:
            assert cleared.count(False) >= 4 * 2, cleared  # every bucket of every fast step
        else:
            assert all(cleared), cleared
        assert_losses_bitwise(losses, ref_losses)
        _assert_same(engine, ref)
    finally:
        engine.close()
