"""A fast step's complete buckets sent after backward as one batch ([Note: sent as one batch] in
offload/runtime/bucket_send.py): where the CPU lane runs inline (the CPU backend's default, ``OFFLOAD_CPU_COPIES``
unset or ``inline``; the suite's default is ``lanes``), one CPU-lane item copies each bucket's grads from ``p.grad``
into the grad ring and updates it there, then counts every bucket's step in one op. Each test trains beside plain
PyTorch + torch.optim.AdamW (foreach=False; the engine's AdamW with fused=False) bit for bit, or beside the same
engine sending bucket by bucket (the fused kernel, bf16, padding), and checks which path really ran."""

import copy

import pytest
import torch

import offload
from offload.testing.chaos import ChaosConfig
from tests.support.compare import FusedStepChecker, assert_bitwise, assert_losses_bitwise
from tests.support.fake_cuda import with_chaos
from tests.support.loops import finish_step
from tests.support.models import tanh_mlp

ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
STEPS = 8


@pytest.fixture
def inline(monkeypatch):
    """The users' default on the CPU backend: copies and updates on the issuing thread where they can start."""
    monkeypatch.setenv("OFFLOAD_CPU_COPIES", "inline")


def _groups(model, kind):
    """``kind``: "plain" (one group), "groups" (weights and biases with their own lr and weight decay: a bucket
    updates in many runs), "frozen" (one layer's weight frozen: a bucket with a parameter that has no master step)."""
    params = list(model.parameters())
    if kind == "frozen":
        params[2].requires_grad_(False)
        return [p for p in params if p.requires_grad]
    if kind == "groups":
        return [{"params": params[0::2]}, {"params": params[1::2], "lr": 3e-3, "weight_decay": 0.0}]
    return params


def _pair(kind="plain", chaos=None, depth=12, width=32, **kw):
    """(engine, opt, ref, ref_opt): an MLP all resident (budget 4x its weights) in buckets of ~a tenth of it."""
    model = tanh_mlp(depth, width)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(_groups(ref, kind), foreach=False, **ADAMW)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    opt = offload.AdamW(_groups(model, kind), fused=False, **ADAMW)
    with with_chaos(chaos):
        engine = offload.wrap(model, opt, budget=4 * nbytes, bucket_bytes=max(256, nbytes // 10),
                              dtype=torch.float32, device="cpu", **kw)
    return engine, opt, ref, ref_opt


def _engine(fused=True, dtype=torch.float32, width=32, depth=12, batch=True, kind="plain", model=None):
    """An engine alone (the fused kernel by default), all resident with room to hold every grad at once (budget 64x
    its weights); ``batch=False``: its fast steps send bucket by bucket. ``kind``: as :func:`_groups`."""
    model = tanh_mlp(depth, width) if model is None else model
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    opt = offload.AdamW(_groups(model, kind), fused=fused, **ADAMW)
    engine = offload.wrap(model, opt, budget=64 * nbytes, bucket_bytes=max(256, nbytes // 10), dtype=dtype,
                          device="cpu")
    if not batch:
        send = engine._runtime.grads.fast_send
        send.send_all = lambda closings, leave: [send.grads.gather_bucket(*c, leave=leave) for c in closings]
    return engine, opt


def _x(step: int, width: int = 32) -> torch.Tensor:
    return torch.randn(8, width, generator=torch.Generator().manual_seed(step))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def _adam_state(opt) -> dict:
    """Every parameter's AdamW state (step, m, v), keyed by its position."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return {f"{i}.{k}": v for i, p in enumerate(params) for k, v in opt.state[p].items()}


def _lanes(engine) -> list[tuple[str, int, int]]:
    """What the last step issued, as the lane log shows it: (lane, bucket, bytes) in issue order."""
    _, _, entries, _ = engine._runtime.ctx.lane_log.last_step
    return [(lane, b, nbytes) for lane, b, nbytes, _, _ in entries]


def _host(engine) -> dict:
    """Every byte of the host state the updates write (padding between parameters included), and the counts."""
    host = engine._runtime.slots.hosted()
    out = {"steps": torch.tensor(host.steps), "step_values": host.step_values.clone()}
    for name in ("master", "exp_avg", "exp_avg_sq", "lowp"):
        for b, t in enumerate(getattr(host, name) or ()):
            out[f"{name}{b}"] = t.clone()
    return out


def _sent(engine) -> tuple[int, int, int, int]:
    """(fast steps, buckets, buckets sent by the routine or a batch, batches)."""
    rt = engine._runtime
    send = rt.grads.fast_send
    return rt.ctx.stats["fast_steps"], len(rt.slots.buckets), send.sent, send.batches


def _train(engine, opt, ref, ref_opt, steps=STEPS, width=32, clip=None, micro=1):
    losses, ref_losses = [], []
    for step in range(steps):
        for f, o, out in ((engine, opt, losses), (ref, ref_opt, ref_losses)):
            for m in range(micro):
                loss = _loss(f(_x(micro * step + m, width)))
                loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(f.module.parameters() if f is engine else f.parameters(), clip)
            o.step()
            o.zero_grad()
            out.append(loss.item())
    assert_losses_bitwise(losses, ref_losses)
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "model")
    assert_bitwise(_adam_state(opt), _adam_state(ref_opt), "AdamW state")


@pytest.mark.parametrize("kind", ["plain", "groups", "frozen"])
def test_a_fast_steps_buckets_go_as_one_batch_bit_for_bit_torch(inline, kind):
    """Every fast step sends all of its buckets in one batch (one CPU-lane item), and trains as plain torch bit for
    bit: weights, losses, AdamW's m, v and step counts (one group; two groups, whose runs alternate within a bucket;
    a frozen weight in a bucket)."""
    engine, opt, ref, ref_opt = _pair(kind)
    try:
        _train(engine, opt, ref, ref_opt)
        fast, buckets, sent, batches = _sent(engine)
        assert fast >= STEPS - 3 and buckets > 2
        assert batches == fast and sent == fast * buckets  # every fast step, every bucket, as one batch
        assert engine._runtime.fast.at_end
    finally:
        engine.close()


CASES = {"fp32": {}, "bf16": dict(dtype=torch.bfloat16), "padded": dict(width=5, depth=6),
         "groups": dict(kind="groups"), "frozen": dict(kind="frozen"),
         "bf16-groups": dict(dtype=torch.bfloat16, kind="groups"),
         "padded-ring": dict(width=5, depth=6, fused=False)}


@pytest.mark.parametrize("case", list(CASES))
def test_a_batch_leaves_what_sending_bucket_by_bucket_leaves(inline, case):
    """Beside the same engine sending each bucket by the routine (``FastSend.send``), with the default fused kernel
    (the batch updated from ``p.grad`` in one kernel call: [Note: updated from p.grad]) or with torch's ops
    ("padded-ring": the batch's grads through the grad ring): the same lane-log entries (lane, bucket, bytes, in
    order), counters, weights, and every byte of the host state (masters, 16-bit copies, m, v, the padding between
    parameters, whose grads must be zeros: width 5) and step counts, after every step; fp32 and bf16, two param
    groups, a frozen weight."""
    kw = CASES[case]
    width = kw.get("width", 32)
    (engine, opt), (single, single_opt) = _engine(**kw), _engine(**kw, batch=False)
    try:
        for step in range(STEPS):
            for e, o in ((engine, opt), (single, single_opt)):
                finish_step(_loss(e(_x(step, width))), o)
            assert_bitwise(_host(engine), _host(single), f"step {step}: host state")
        assert _lanes(engine) == _lanes(single)
        assert dict(engine.memory_stats()["counters"]) == dict(single.memory_stats()["counters"])
        assert_bitwise(engine.state_dict()["model"], single.state_dict()["model"], "model")
        fast, buckets, sent, batches = _sent(engine)
        assert fast >= STEPS - 3 and batches == fast and sent == fast * buckets
        assert engine._runtime.grads.fast_send.direct == (0 if case == "padded-ring" else batches)
        assert _sent(single)[2:] == (sent, 0)
        if case.startswith("padded"):  # the grads do not fill the bucket: padding between parameters
            assert not all(r is None or r.whole for r in engine._runtime.grads.fast_send._routes.values())
    finally:
        engine.close()
        single.close()


class KernelCalls:
    """Counts ``_C.adamw_step_segments`` calls made by ``offload.host.segments`` (and can slow each one)."""

    def __init__(self, monkeypatch, delay: float = 0.0):
        import offload.host.segments as segments

        self.real, self.calls, self.delay = segments._C, 0, delay
        monkeypatch.setattr(segments, "_C", self)

    def __getattr__(self, name):
        return getattr(self.real, name)

    def adamw_step_segments(self, *args):
        import time

        self.calls += 1
        if self.delay:
            time.sleep(self.delay)
        return self.real.adamw_step_segments(*args)


@pytest.mark.parametrize("kind", ["plain", "groups", "frozen", "padded"])
def test_a_batch_updated_from_p_grad_in_one_kernel_call_steps_as_torch(inline, monkeypatch, kind):
    """The default fused kernel: every fast step's buckets are updated in ONE kernel call straight from the
    parameters' grads ([Note: updated from p.grad]): the grad ring is not written, and at every step, from the
    engine's own weights and AdamW state, plain PyTorch + torch.optim.AdamW takes the same step: m, v and the step
    counts bit for bit, the masters within the fused kernel's bound (tests/support/compare.py); one group, two
    groups, a frozen weight, padding between parameters (width 5)."""
    width, depth = (5, 6) if kind == "padded" else (32, 12)
    model = tanh_mlp(depth, width)
    checker = FusedStepChecker(model, ADAMW, params=lambda m: _groups(m, "plain" if kind == "padded" else kind))
    engine, opt = _engine(kind="plain" if kind == "padded" else kind, width=width, depth=depth, model=model)
    calls = KernelCalls(monkeypatch)
    try:
        written = None
        for step in range(STEPS):
            fast_before = engine._runtime.ctx.stats["fast_steps"]
            checker.before_step(engine)
            finish_step(_loss(engine(_x(step, width))), opt)
            checker.after_step(engine, lambda m, s=step: _loss(m(_x(s, width))), f"step {step}")
            if engine._runtime.ctx.stats["fast_steps"] > fast_before:
                ring = engine._runtime.slots.hosted().ring.region
                if written is None:
                    written = ring, ring.clone()  # the ring as the steps before the fast ones left it
                assert ring is written[0] and torch.equal(ring, written[1]), f"step {step}: the grad ring was written"
        fast, buckets, sent, batches = _sent(engine)
        assert fast >= STEPS - 3 and buckets > 2 and batches == fast and sent == fast * buckets
        assert engine._runtime.grads.fast_send.direct == batches == calls.calls  # one kernel call a batch
        steps = {int(v["step"]) for v in opt.state_dict()["state"].values()}
        assert steps == {STEPS}
    finally:
        engine.close()


def test_a_grad_not_laid_out_as_its_parameter_is_copied_before_the_update(inline):
    """A grad that a hook replaced by one of another layout (the same values, transposed strides) is not read as if
    it were contiguous: that batch is updated from a copy of its grads, as before, bit for bit what sending bucket
    by bucket gives."""
    def engine_with_hook(batch):
        engine, opt = _engine(batch=batch)
        weight = engine.module[0].weight

        def relayout(p):
            if p.grad is not None:  # (a step that is not fast has taken it already)
                p.grad = p.grad.t().contiguous().t()
        weight.register_post_accumulate_grad_hook(relayout)
        return engine, opt

    (engine, opt), (single, single_opt) = engine_with_hook(True), engine_with_hook(False)
    try:
        for step in range(STEPS):
            for e, o in ((engine, opt), (single, single_opt)):
                finish_step(_loss(e(_x(step))), o)
            assert_bitwise(_host(engine), _host(single), f"step {step}: host state")
        fast, _, _, batches = _sent(engine)
        assert fast >= STEPS - 3 and batches == fast
        assert engine._runtime.grads.fast_send.direct == 0  # every batch from a copy
    finally:
        engine.close()
        single.close()


def test_under_chaos_a_batch_waits_for_the_refresh_copies_and_the_lane(inline):
    """With random delays on every lane (the batch then goes to the CPU lane's thread, and step()'s refresh copies
    run late on theirs), the batch still trains bit for bit as torch: it waits for each bucket's last host-to-device
    copy (which reads the masters it rewrites) and its last update."""
    engine, opt, ref, ref_opt = _pair(chaos=ChaosConfig(seed=7))
    try:
        _train(engine, opt, ref, ref_opt)
        fast, buckets, sent, batches = _sent(engine)
        assert fast >= STEPS - 3 and batches == fast and sent == fast * buckets
    finally:
        engine.close()


@pytest.mark.intra_op_threads  # [Note: the suite's intra-op threads] in tests/conftest.py
def test_with_the_lanes_on_threads_each_bucket_goes_at_its_last_grad(monkeypatch):
    """``OFFLOAD_CPU_COPIES=lanes`` (and CUDA): the buckets go during backward, each by the routine on its own,
    overlapped with backward; no batch."""
    monkeypatch.setenv("OFFLOAD_CPU_COPIES", "lanes")
    engine, opt, ref, ref_opt = _pair()
    try:
        _train(engine, opt, ref, ref_opt)
        fast, buckets, sent, batches = _sent(engine)
        assert fast >= STEPS - 3 and sent == fast * buckets and batches == 0
        assert not engine._runtime.fast.at_end
    finally:
        engine.close()


@pytest.mark.parametrize("how", ["clip", "accumulate"])
def test_deferred_updates_send_no_batch_and_train_as_torch(inline, how):
    """Clipping and accumulation defer the updates to ``step()`` (``overlap_optimizer=False``): their fast steps
    send each bucket as before, during backward, and train as torch bit for bit (torch's ``clip_grad_norm_`` on
    ``p.grad``)."""
    engine, opt, ref, ref_opt = _pair(overlap_optimizer=False)
    try:
        _train(engine, opt, ref, ref_opt, clip=0.05 if how == "clip" else None, micro=2 if how == "accumulate" else 1)
        fast, _, _, batches = _sent(engine)
        assert fast >= STEPS - 3 and batches == 0 and not engine._runtime.fast.at_end
    finally:
        engine.close()


def test_an_fp16_step_that_overflows_is_skipped_and_sends_no_batch(inline):
    """float16 (deferred updates, loss scaling): fast steps send no batch; a step whose grads overflow is skipped
    whole (no master moves, the scale halves), as before."""
    engine, opt = _engine(dtype=torch.float16, fused=True)
    try:
        for step in range(5):
            engine.backward(_loss(engine(_x(step))))
            opt.step()
            opt.zero_grad()
        before = _host(engine)
        scale = engine.memory_stats()["optimizer"]["loss_scale"]
        engine.backward(_loss(engine(_x(5))) * float("inf"))
        opt.step()
        opt.zero_grad()
        stats = engine.memory_stats()["optimizer"]
        assert stats["last_step_skipped"] and stats["loss_scale"] == scale / 2
        assert_bitwise(_host(engine), before, "host state after the skipped step")
        fast, _, _, batches = _sent(engine)
        assert fast >= 3 and batches == 0
    finally:
        engine.close()


class Swapped(torch.nn.Module):
    """An MLP whose forward, while ``swap`` is set, runs its first two linear layers in the other order: the same
    root call (a fast step), but its bottom layers' grads come out of the plan's order (a departure late in
    backward, after the top buckets' grads all came)."""

    def __init__(self):
        super().__init__()
        self.body = tanh_mlp(12, 32)
        self.swap = False

    def forward(self, x):
        layers = list(self.body)
        if self.swap:
            layers[0], layers[2] = layers[2], layers[0]
        for layer in layers:
            x = layer(x)
        return x


def test_a_departure_sends_the_complete_buckets_as_one_batch_first(inline):
    """A fast step that departs in backward sends the buckets whose grads all came as one batch (with their
    grads out of ``p.grad`` at once, not left for the exposure), then goes on grad by grad; bit for bit torch, the
    steps before and after it too."""
    model = Swapped()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    opt = offload.AdamW(model.parameters(), fused=False, **ADAMW)
    engine = offload.wrap(model, opt, budget=4 * nbytes, bucket_bytes=max(256, nbytes // 10), dtype=torch.float32,
                          device="cpu")
    rt = engine._runtime
    try:
        losses, ref_losses = [], []
        for step in range(STEPS):
            model.swap = ref.swap = step == 5
            departures, batches = rt.ctx.stats["plan_departures"], rt.grads.fast_send.batches
            losses.append(finish_step(_loss(engine(_x(step))), opt))
            ref_losses.append(finish_step(_loss(ref(_x(step))), ref_opt))
            if step == 5:  # departed; its complete buckets went as one batch
                assert rt.ctx.stats["plan_departures"] == departures + 1
                assert rt.grads.fast_send.batches == batches + 1
        assert_losses_bitwise(losses, ref_losses)
        assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "model")
        assert_bitwise(_adam_state(opt), _adam_state(ref_opt), "AdamW state")
        assert rt.ctx.stats["fast_steps"] >= 4
    finally:
        engine.close()


def test_a_batch_queued_on_a_slow_lane_keeps_the_refresh_pipelined(inline):
    """A batch queued on the CPU lane's thread (here slowed: 20 ms before and after each item, 10 ms before each
    bucket's update, so that under load its updates do not all end before ``step()`` copies) sets each bucket's
    update event as soon as that update ran, so ``step()`` copies each bucket's new weights while the later
    buckets' updates still run ([Note: the refresh pipelined] in executor.py), as per-bucket items did; bit for bit
    torch."""
    import time

    engine, opt, ref, ref_opt = _pair()
    rt = engine._runtime
    try:
        _train(engine, opt, ref, ref_opt, steps=3)  # planned, verified, fast
        rt.ctx.cpu._before = lambda: time.sleep(0.02)  # read when the lane's thread starts: now
        host, update = rt.slots.host, rt.slots.host.update

        def slow_update(*args, **kwargs):  # each bucket's update 10 ms: the batch's last ends well after its first
            time.sleep(0.01)
            return update(*args, **kwargs)
        host.update = slow_update  # (read by the batch when it runs)
        batches = rt.grads.fast_send.batches
        for step in range(3, 5):
            finish_step(_loss(engine(_x(step))), opt)
            finish_step(_loss(ref(_x(step))), ref_opt)
            _, _, entries, _ = rt.ctx.lane_log.last_step
            rt.ctx.backend.synchronize()  # every copy ran: its lane's times are set
            last_update = max(ev.finished for lane, _, _, _, ev in entries if lane == "cpu_adam")
            copies = [ev.started for lane, _, _, _, ev in entries if lane == "h2d"]
            assert copies and min(copies) < last_update, step  # the first copy before the batch's last update
        assert rt.grads.fast_send.batches == batches + 2
        assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "model")
    finally:
        engine.close()


def test_a_batch_from_p_grad_queued_on_a_slow_lane_calls_the_kernel_per_bucket(inline, monkeypatch):
    """[Note: updated from p.grad] on the lane's thread (the batch queued: here the lane slowed 20 ms before and
    after each item, each kernel call 10 ms): one kernel call per bucket, each bucket's event set as its call ends,
    so ``step()`` copies each bucket's new weights while later buckets still update ([Note: the refresh pipelined]
    in executor.py), as with the grad ring; the host state bit for bit what sending bucket by bucket gives."""
    import time

    (engine, opt), (single, single_opt) = _engine(), _engine(batch=False)
    rt = engine._runtime
    try:
        for step in range(3):  # planned, verified, fast
            for e, o in ((engine, opt), (single, single_opt)):
                finish_step(_loss(e(_x(step))), o)
        rt.ctx.cpu._before = lambda: time.sleep(0.02)  # read when the lane's thread starts: now
        calls = KernelCalls(monkeypatch, delay=0.01)
        batches, buckets = rt.grads.fast_send.batches, len(rt.slots.buckets)
        for step in range(3, 5):
            for e, o in ((engine, opt), (single, single_opt)):
                finish_step(_loss(e(_x(step))), o)
            _, _, entries, _ = rt.ctx.lane_log.last_step
            rt.ctx.backend.synchronize()  # every copy ran: its lane's times are set
            last_update = max(ev.finished for lane, _, _, _, ev in entries if lane == "cpu_adam")
            copies = [ev.started for lane, _, _, _, ev in entries if lane == "h2d"]
            assert copies and min(copies) < last_update, step  # the first copy before the batch's last update
        assert rt.grads.fast_send.batches == batches + 2 and calls.calls == 2 * buckets
        assert_bitwise(_host(engine), _host(single), "host state")
    finally:
        engine.close()
        single.close()
