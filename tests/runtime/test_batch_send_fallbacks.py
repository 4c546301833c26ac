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
