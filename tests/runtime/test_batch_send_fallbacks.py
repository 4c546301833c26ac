"""The paths of a batch updated from ``p.grad`` ([Note: updated from p.grad] in offload/host/segments.py, [Note:
sent as one batch] in offload/runtime/bucket_send.py) that the batch's own tests (test_batch_send.py) do not run:
the table refused at the call (its parameters at different step counts), a kernel call that fails (one call for
every bucket on the issuing thread; one per bucket on the lane's thread), and bf16 beside plain torch. Each trains
beside plain PyTorch + torch.optim.AdamW(foreach=False), or beside the same engine sending bucket by bucket, and
checks which path really ran."""

import time

import pytest
import torch

import offload
from tests.runtime.test_batch_send import ADAMW, _engine, _host, _loss, _sent, _x, inline  # noqa: F401 (fixture)
from tests.support.compare import FusedStepChecker, assert_bitwise
from tests.support.loops import finish_step
from tests.support.models import tanh_mlp

STEPS = 9
SKIPPED_STEP = 3  # the step whose forward leaves one layer out: its parameters' step counts lag from then on
SKIPPED_LAYER = 4  # body[4]: a Linear(32, 32), so the shapes still chain


class Skipping(torch.nn.Module):
    """An MLP whose forward, while ``skip`` is set, leaves out one linear layer (a skipped branch): its parameters
    get no grad in that step, so torch's AdamW (and the engine) leave their step counts one behind the others'."""

    def __init__(self):
        super().__init__()
        self.body = tanh_mlp(12, 32)
        self.skip = False

    def forward(self, x):
        for i, layer in enumerate(self.body):
            if not (self.skip and i == SKIPPED_LAYER):
                x = layer(x)
        return x


def test_a_batch_whose_parameters_lag_in_step_count_is_updated_from_a_copy_as_torch(inline):
    """After a step that left one layer out (its parameters' counts now one behind), every fast step's batch is
    refused by ``BatchUpdate.ready`` (-1: not all at one step count) and updated from a copy of its grads
    (``FastSend.copied``): at every step, from the engine's own state, torch.optim.AdamW(foreach=False) takes the
    same step (m, v and step counts bit for bit; the masters within the fused kernel's bound: the kernel is
    ``offload.AdamW``'s default, and only it has the table), and every byte of the host state (masters, m, v, the
    step counts) is bit for bit the same engine's sending bucket by bucket."""
    model, single_model = Skipping(), Skipping()
    single_model.load_state_dict(model.state_dict())
    checker = FusedStepChecker(model, ADAMW)
    (engine, opt), (single, single_opt) = _engine(model=model), _engine(model=single_model, batch=False)
    send = engine._runtime.grads.fast_send
    copied_at = {}
    try:
        for step in range(STEPS):
            for m in (model, single_model, checker.model):
                m.skip = step == SKIPPED_STEP
            checker.before_step(engine)
            copied = send.copied
            for e, o in ((engine, opt), (single, single_opt)):
                finish_step(_loss(e(_x(step))), o)
            checker.after_step(engine, lambda m, s=step: _loss(m(_x(s))), f"step {step}")
            assert_bitwise(_host(engine), _host(single), f"step {step}: host state")
            copied_at[step] = send.copied - copied
        steps = [int(v["step"]) for v in opt.state_dict()["state"].values()]
        lagging = {SKIPPED_LAYER, SKIPPED_LAYER + 1}  # body[4]'s weight and bias (body[0], body[2]: params 0-3)
        assert steps == [STEPS - 1 if i in lagging else STEPS for i in range(len(steps))]
        fast, buckets, sent, batches = _sent(engine)
        after = list(range(SKIPPED_STEP + 2, STEPS))  # the fast steps after the counts diverged (the next verifies)
        assert fast >= len(after) and batches == fast and buckets > 2
        assert all(copied_at[s] == 1 for s in after), copied_at  # each such batch from a copy
        assert send.copied == len(after) and send.direct == batches - send.copied  # before it, from p.grad
        assert send.direct >= 1
    finally:
        engine.close()
        single.close()


class FailingKernel:
    """``_C.adamw_step_segments`` as ``offload.host.segments`` calls it, raising on call number ``fail_at`` (counted
    from the first call made after ``arm``); each call may be slowed by ``delay`` seconds."""

    def __init__(self, monkeypatch, delay: float = 0.0):
        import offload.host.segments as segments

        self.real, self.calls, self.fail_at, self.delay = segments._C, 0, None, delay
        monkeypatch.setattr(segments, "_C", self)

    def arm(self, nth: int) -> None:
        self.fail_at = self.calls + nth

    def __getattr__(self, name):
        return getattr(self.real, name)

    def adamw_step_segments(self, *args):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("kernel failed on purpose")
        if self.delay:
            time.sleep(self.delay)
        return self.real.adamw_step_segments(*args)


def _bucket_state(engine, b: int) -> dict:
    """Bucket ``b``'s host state an update writes (master, m, v, its 16-bit copy where there is one) and the step
    counts of its parameters."""
    host = engine._runtime.slots.hosted()
    params = [p for run in host.buckets[b].runs for p in run.params]
    out = {"steps": torch.tensor([host.steps[p] for p in params])}
    for name in ("master", "exp_avg", "exp_avg_sq", "lowp"):
        if getattr(host, name) is not None:
            out[name] = getattr(host, name)[b].clone()
    return out


@pytest.mark.parametrize("where", ["inline", "queued"])
def test_a_kernel_call_that_fails_raises_at_step_and_counts_only_the_buckets_it_updated(inline, monkeypatch, where):
    """A segmented kernel call that raises: on the issuing thread ("inline": ONE call for every bucket) no bucket is
    updated or counted; on the lane's thread ("queued": the lane slowed, one call per bucket) the second call's
    bucket alone is not, and every other bucket is updated and counted exactly as the same engine sending bucket by
    bucket updates it. Either way the failure surfaces at ``opt.step()`` as an ``OffloadError`` caused by the
    kernel's exception ([Note: the refresh pipelined] in executor.py: a failed update raises from the refresh copy's
    wait or the lane's drain), and the engine does not go on as if it had not happened: the next ``step()`` and
    ``zero_grad()`` refuse, the next forward raises the failed bucket's update (its refresh copy's wait), and so
    does the one after it (not the guard's "changed outside the engine": the parameters of the refresh that did not
    land show their placeholders, as the guard expects), ``state_dict()`` and ``close()`` raise the failure."""
    (engine, opt), (single, single_opt) = _engine(), _engine(batch=False)
    rt, send = engine._runtime, engine._runtime.grads.fast_send
    kernel = FailingKernel(monkeypatch, delay=0.01 if where == "queued" else 0.0)
    closed = False
    try:
        for step in range(3):  # planned, verified, fast
            for e, o in ((engine, opt), (single, single_opt)):
                finish_step(_loss(e(_x(step))), o)
        assert _sent(engine)[3] == 1 and send.direct == 1
        if where == "queued":
            rt.ctx.cpu._before = lambda: time.sleep(0.02)  # read when the lane's thread starts: now
        buckets = len(rt.slots.buckets)
        before = [_bucket_state(engine, b) for b in range(buckets)]
        (batch,) = [t for t in send._direct.values() if t is not None]
        failed = set(batch.buckets) if where == "inline" else {batch.buckets[1]}  # the second call: the 2nd bucket
        kernel.arm(1 if where == "inline" else 2)
        finish_step(_loss(single(_x(3))), single_opt)
        _loss(engine(_x(3))).backward()
        with pytest.raises(offload.OffloadError, match="kernel failed on purpose") as raised:
            opt.step()
        cause = raised.value
        while cause.__cause__ is not None:
            cause = cause.__cause__
        assert isinstance(cause, RuntimeError) and str(cause) == "kernel failed on purpose"
        assert kernel.calls == kernel.fail_at + (0 if where == "inline" else buckets - 2)  # every other bucket tried
        for b in range(buckets):
            want = before[b] if b in failed else _bucket_state(single, b)
            assert_bitwise(_bucket_state(engine, b), want, f"bucket {b} ({'failed' if b in failed else 'updated'})")
        assert send.batches == 2 and send.direct == 2 and send.copied == 0  # the batch from p.grad ran
        with pytest.raises(offload.OffloadError, match="no backward ran"):
            opt.step()
        with pytest.raises(offload.OffloadError, match="between backward and step"):
            opt.zero_grad()
        with pytest.raises(offload.OffloadError, match=f"AdamW of bucket {min(failed)} failed"):
            engine(_x(4))  # the first failed bucket the forward uses
        # [Note: a refresh that did not land] (fast_path.py): the refresh's parameters show their placeholders, so
        # the next forward raises the failure again, not a false "parameters ... changed outside the engine"
        with pytest.raises(offload.OffloadError, match="kernel failed on purpose"):
            engine(_x(5))
        with pytest.raises(offload.OffloadError, match="kernel failed on purpose"):
            engine.state_dict()
        closed = True
        with pytest.raises(offload.OffloadError, match="kernel failed on purpose"):
            engine.close()
    finally:
        if not closed:
            try:
                engine.close()
            except offload.OffloadError:
                pass
        single.close()


def test_bf16_batches_from_p_grad_follow_the_autocast_loss_curve(inline):
    """bf16 through the segments path (every fast step's buckets updated from the bf16 ``p.grad`` in one kernel
    call, writing the bf16 copies) beside plain PyTorch: torch.autocast(bf16) over fp32 parameters +
    torch.optim.AdamW(foreach=False), the reference and tolerances of tests/runtime/test_training.py's
    ``test_mixed_precision_loss_curve_follows_autocast`` ([Note: mixed-precision tolerance] there: 10-step mean
    losses within ``CURVE_RTOL``, the first update's sign agreeing on ``SIGN_AGREEMENT`` of the weights), the tiny
    GPT, 100 steps; here all resident, so that the steps are fast and batched."""
    from tests.runtime.test_training import (CURVE_RTOL, MIXED_LR, SIGN_AGREEMENT, _autocast_reference, _masters,
                                             _train, _wrap)
    from tests.support.models import CASES

    case = CASES["gpt"]()
    steps = 100
    want, want_first = _autocast_reference(case, torch.bfloat16, steps)
    initial = {n: p.detach().clone() for n, p in case.model.named_parameters()}
    engine, opt = _wrap(case.model, budget_frac=64, dtype=torch.bfloat16, lr=MIXED_LR)
    send = engine._runtime.grads.fast_send
    updates = []

    def first_update():
        if not updates:
            updates.append({n: w - initial[n] for n, w in _masters(engine).items() if n in initial})
    try:
        assert opt.fused  # the default kernel: the one the segments path runs
        losses = _train(engine, opt, case, steps, after_step=first_update)
        fast, buckets, sent, batches = _sent(engine)
        assert fast >= steps - 3 and buckets > 2 and batches == fast and sent == fast * buckets
        assert send.direct == batches and send.copied == 0  # every fast step's batch from p.grad
        windows = [(sum(losses[i:i + 10]) / 10, sum(want[i:i + 10]) / 10) for i in range(0, steps, 10)]
        for ours, theirs in windows:
            assert abs(ours - theirs) <= CURVE_RTOL * theirs, windows
        assert windows[-1][0] < 0.9 * windows[0][0], "the model must learn"
        first = updates[0]
        same = sum(int((torch.sign(first[n]) == torch.sign(d)).sum()) for n, d in want_first.items())
        total = sum(d.numel() for d in want_first.values())
        assert same / total >= SIGN_AGREEMENT, same / total
        assert all(v.dtype == torch.float32 for v in _masters(engine).values() if v.is_floating_point())
    finally:
        engine.close()
