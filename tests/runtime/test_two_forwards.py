"""Two training forwards before one backward (``loss = f(a) + f(b)``: siamese and contrastive models, chosen and
rejected pairs): [Note: one forward per fast step] in offload/runtime/step_passes.py. Bit for bit plain torch +
``torch.optim.AdamW``, and the plan holds: no step departs from it and none is planned again."""

import warnings

import pytest
import torch
from torch import nn

import offload

from tests.support.compare import assert_bitwise
from tests.support.loops import PLAIN_ADAMW, wrap_on_cpu
from tests.support.warnings_filters import DEPARTING

WIDTH = 128


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(6)], nn.Linear(WIDTH, 1))


def _x(step: int) -> torch.Tensor:
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step))


def _step(model, opt, step: int, forwards: int) -> float:
    loss = sum(model(_x(100 * k + step)).pow(2).mean() for k in range(forwards))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


@pytest.mark.parametrize("overlap", [False, True], ids=["deferred", "overlap"])
@pytest.mark.parametrize("budget", [0.7, 4.0], ids=["streamed", "resident"])
def test_two_forwards_a_step_stay_on_their_plan_bit_for_bit_like_torch(budget, overlap):
    """Before, all resident: the plan ran fast, departed in backward (a fast step's backward interleaves the two
    graphs otherwise than the full step it was planned from), was planned again: 4 departures and re-plans in 8
    steps. Streamed plans never ran fast and held."""
    model, ref = _net(), _net()
    engine, opt = wrap_on_cpu(model, budget, overlap_optimizer=overlap)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **PLAIN_ADAMW)
    for step in range(8):
        assert _step(model, opt, step, 2) == _step(ref, ref_opt, step, 2), step
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "two forwards a step")
    stats = engine.memory_stats()
    counters = stats["counters"]
    assert (counters["plan_departures"], counters["replans"]) == (0, 0), counters
    assert stats["device_peak_bytes"] <= stats["budget_bytes"]
    assert (stats["plan"]["streamed_buckets"] > 0) == (budget == 0.7)
    engine.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["deferred", "overlap"])
def test_a_loop_that_turns_to_two_forwards_settles_on_the_full_path(overlap):
    """One forward a step (fast steps), then two: the first such step departs (its plan was verified by
    one-forward steps; a fast step is not planned from), the next, full, departs too and is planned from; the
    rest hold that plan on the full path: two departures in all, never more."""
    model, ref = _net(), _net()
    engine, opt = wrap_on_cpu(model, 4.0, overlap_optimizer=overlap)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **PLAIN_ADAMW)
    for step in range(5):
        assert _step(model, opt, step, 1) == _step(ref, ref_opt, step, 1), step
    fast = engine.memory_stats()["counters"]["fast_steps"]
    assert fast >= 2  # the fast path ran: what this test leaves
    for step in range(5, 12):
        assert _step(model, opt, step, 2) == _step(ref, ref_opt, step, 2), step
        if step == 6:
            settled = dict(engine.memory_stats()["counters"])
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "one forward, then two")
    counters = engine.memory_stats()["counters"]
    assert counters["plan_departures"] <= 2 and counters["replans"] <= 2, counters
    assert all(counters[k] == settled[k] for k in ("plan_departures", "replans", "fast_steps")), (settled, counters)
    engine.close()


class _EncoderHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x))


@pytest.mark.filterwarnings(DEPARTING)  # each step departs: the next test is about its warning
@pytest.mark.parametrize("overlap", [False, True], ids=["deferred", "overlap"])
@pytest.mark.parametrize("budget", [1.0, 4.0], ids=["streamed", "resident"])
def test_the_root_and_a_submodule_called_directly_in_one_step_train_like_torch(budget, overlap):
    """``loss = f(model(a)) + g(model.enc(b))``: the direct call runs off plan, on demand. Before, all resident,
    the next forward laid the plan's arena out over buckets still held on demand, without letting their slots
    go: the slot index broke (a KeyError inside the next forward), and ``close()`` raised the same, so the
    trained weights could not be had back. Now each such step departs and trains bit for bit like torch."""
    model, ref = _EncoderHead(), _EncoderHead()
    engine, opt = wrap_on_cpu(model, budget, overlap_optimizer=overlap)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **PLAIN_ADAMW)
    for step in range(5):
        losses = []
        for m, o in ((model, opt), (ref, ref_opt)):
            loss = m(_x(step)).pow(2).mean() + 0.1 * m.enc(_x(100 + step)).pow(2).mean()
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1], step
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "root and a submodule called directly")
    stats = engine.memory_stats()
    assert stats["device_peak_bytes"] <= stats["budget_bytes"]
    engine.close()
    assert_bitwise(dict(model.state_dict()), ref.state_dict(), "after close()")


def test_steps_that_keep_departing_warn_once_naming_where():
    """[Note: steps that keep departing] (offload/runtime/departures.py): off plan every step, training is right
    but slow, and nothing else would say so: one warning, at the user's ``opt.step()``, naming the call where the
    latest step left its plan."""
    model = _EncoderHead()
    engine, opt = wrap_on_cpu(model, 4.0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(8):
            loss = model(_x(step)).pow(2).mean() + 0.1 * model.enc(_x(100 + step)).pow(2).mean()
            loss.backward()
            opt.step()  # the warning points here
            opt.zero_grad()
    ours = [w for w in seen if issubclass(w.category, offload.OffloadWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    message = str(ours[0].message)
    assert "of the last 4 steps departed from their plan" in message and "'enc'" in message, message
    assert ours[0].filename == __file__, ours[0].filename
    engine.close()


@pytest.mark.parametrize("forwards", [1, 2])
def test_steps_that_hold_their_plan_do_not_warn(forwards):
    """One forward a step, or two after the loop settled (one departure, then the plan holds; two before session
    25, when a backward read the plan lacked departed too: [Note: reads the plan did not foresee]): no warning."""
    model = _net()
    engine, opt = wrap_on_cpu(model, 4.0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(10):
            _step(model, opt, step, 1 if step < 3 else forwards)
    assert not [w for w in seen if issubclass(w.category, offload.OffloadWarning)], [str(w.message) for w in seen]
    assert engine.memory_stats()["counters"]["plan_departures"] == (0 if forwards == 1 else 1)
    engine.close()
