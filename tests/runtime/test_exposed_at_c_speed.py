"""[Note: exposed at C speed] in offload/runtime/plain_grads.py: on the hot path (fast steps, their buckets sent as one
batch after backward, overlapped updates) every step's data-less ``p.grad`` are the spares of the step before, set by
one ``map`` of torch's grad setter, and a data-less grad is current while ``exposed`` holds it for its parameter
(no epoch renewed per grad). What a user sees of ``p.grad`` must not change: as plain PyTorch, after backward every
trainable parameter has a grad and after ``step()`` + ``zero_grad()`` none; each grad refuses to be used (the
update already ran) with the overlap message while current and with "no longer current" once taken back, also when
its parameter has been given another grad since; a grad dropped or replaced by the user is named at ``step()``."""

import pytest
import torch

import offload
from tests.runtime.test_batch_send import _engine, _loss, _sent, _x, inline  # noqa: F401 (fixture)
from tests.support.models import tanh_mlp

STEPS = 6


def _torch_twin(engine):
    """Plain PyTorch beside the engine: the same model (its current fp32 weights) and torch.optim.AdamW."""
    model = tanh_mlp(12, 32)
    model.load_state_dict(engine.state_dict()["model"])
    return model, torch.optim.AdamW(model.parameters(), foreach=False)


def test_fast_steps_give_every_grad_again_at_c_speed_and_take_it_back_as_torch_shows_it(inline):
    (engine, opt) = _engine()
    ref, ref_opt = _torch_twin(engine)
    exposure = engine._runtime.grads.exposure
    params, ref_params = list(engine.module.parameters()), list(ref.parameters())
    swapped = 0
    held = None
    try:
        for step in range(STEPS):
            spares = exposure._spare  # the dict the fast exposure makes ``exposed`` as it is
            _loss(engine(_x(step))).backward()
            _loss(ref(_x(step))).backward()
            swapped += exposure.exposed is spares and len(spares) == len(params)
            assert [p.grad is None for p in params] == [p.grad is None for p in ref_params] == [False] * len(params)
            assert [p.grad for p in params] == [exposure.exposed[i] for i in range(len(params))]
            assert all(p.grad.shape == p.shape and p.grad.dtype == p.dtype for p in params)
            with pytest.raises(offload.OffloadError, match="overlap_optimizer=False"):
                params[5].grad.norm()  # current: the update already ran
            if held is not None:  # taken back at the last step(): stale, though params[3] has a current grad now
                assert params[3].grad is not held
                with pytest.raises(offload.OffloadError, match="no longer current"):
                    held.norm()
            if step == 2:
                held = params[3].grad
            opt.step(), ref_opt.step()
            assert [p.grad is None for p in params] == [True] * len(params)  # taken back at step()
            opt.zero_grad(), ref_opt.zero_grad()
            assert [p.grad is None for p in params] == [p.grad is None for p in ref_params]
            if step == 2:
                with pytest.raises(offload.OffloadError, match="no longer current"):
                    held.sum()
        fast, _, _, batches = _sent(engine)
        assert fast >= STEPS - 2 and batches == fast  # the hot path ran: fast steps, one batch each
        assert swapped >= STEPS - 4  # every step from the third fast one (held made the next one slow) on
    finally:
        engine.close()


def test_a_grad_dropped_or_replaced_on_a_fast_step_is_named_at_step_and_training_goes_on(inline):
    (engine, opt) = _engine()
    exposure = engine._runtime.grads.exposure
    params = list(engine.module.parameters())
    names = [n for n, _ in engine.module.named_parameters()]
    try:
        for step in range(4):  # planned, verified, fast, fast: the last one's grads given at C speed
            spares = exposure._spare
            _loss(engine(_x(step))).backward()
            if step < 3:
                opt.step(), opt.zero_grad()
        assert exposure.exposed is spares
        params[1].grad = None
        params[6].grad = torch.zeros_like(params[6])
        with pytest.raises(offload.OffloadError, match=f"set to None or replaced \\({names[1]}, {names[6]}\\)"):
            opt.step()
        assert all(p.grad is None for p in params)
        opt.step()  # told once; the engine goes on (the update of that backward stands)
        opt.zero_grad()
        for step in range(4, 7):  # trains on, every grad exposed again
            _loss(engine(_x(step))).backward()
            assert all(p.grad is not None for p in params)
            opt.step(), opt.zero_grad()
    finally:
        engine.close()
