"""Backward passes that read a weight more or less than the pass the plan was made from: the first layer's weight,
read to compute the input's gradient only where the input needs one (a GAN's discriminator, a loop whose input
requires grad on some passes). [Note: reads the plan did not foresee] in offload/runtime/unforeseen_reads.py.
Bit for bit plain torch + ``torch.optim.AdamW``, and the plan holds: all resident no pass departs; streamed, where the
plan did not bring the first layer's bucket for the read (it depends on the compute times the plan was made from),
passes depart until the pass with the read is known to come again and is planned from (at most two), then none."""

import warnings

import pytest
import torch
from torch import nn
from torch.nn.functional import binary_cross_entropy_with_logits as bce

from offload.planning.trace import Event, EventKind, Trace
from offload.runtime.unforeseen_reads import (UnforeseenReads, extra_read_allowed, first_after_unread, last_grads,
                                               reads_more)

from tests.support.compare import assert_bitwise
from tests.support.loops import PLAIN_ADAMW, wrap_on_cpu

WIDTH = 64


def _mlp(seed: int, inputs: int, outputs: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(inputs, WIDTH), nn.Tanh(),
                         *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(3)],
                         nn.Linear(WIDTH, outputs))


def _settled(counters_at: dict, engine, strict: bool) -> None:
    """No departure or re-plan since ``counters_at``, and at most two before: none at all where ``strict`` (all
    resident, the first plan made from a pass without the read: the read is let by)."""
    counters = engine.memory_stats()["counters"]
    most = 0 if strict else 2
    assert counters["plan_departures"] <= most and counters["replans"] <= most, counters
    assert all(counters[k] == counters_at[k] for k in ("plan_departures", "replans")), (counters_at, counters)


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _dcgan_step(g, d, g_opt, d_opt, i: int) -> tuple[float, float]:
    """One step of PyTorch's DCGAN recipe: the discriminator's pass over real and (detached) fake samples, each
    its own backward, then the generator's pass through the discriminator (the discriminator's grads from it
    are dropped by its next ``zero_grad``)."""
    ones, zeros = torch.ones(8, 1), torch.zeros(8, 1)
    d_opt.zero_grad()
    real = bce(d(_randn(1000 + i, 8, 8)), ones)
    real.backward()
    fake = g(_randn(i, 8, 16))
    fake_loss = bce(d(fake.detach()), zeros)
    fake_loss.backward()
    d_opt.step()
    g_opt.zero_grad()
    g_loss = bce(d(fake), ones)
    g_loss.backward()
    g_opt.step()
    return real.item() + fake_loss.item(), g_loss.item()


@pytest.mark.parametrize("budget", [0.9, 10.0], ids=["streamed", "resident"])
def test_a_dcgan_loop_holds_both_plans_bit_for_bit_like_torch(budget):
    """Before, the discriminator departed on every step (its plan, made from a pass whose input needs no grad,
    saw the generator's pass read its first weight) and was planned again: 6 departures, 5 re-plans and an
    OffloadWarning in 6 steps, resident or streamed. The generator's plan held before too."""
    g, d, g_ref, d_ref = _mlp(0, 16, 8), _mlp(1, 8, 1), _mlp(0, 16, 8), _mlp(1, 8, 1)
    g_engine, g_opt = wrap_on_cpu(g, budget, overlap_optimizer=True)
    d_engine, d_opt = wrap_on_cpu(d, budget, overlap_optimizer=False)  # its G-pass grads are dropped: deferred
    g_ref_opt = torch.optim.AdamW(g_ref.parameters(), foreach=False, **PLAIN_ADAMW)
    d_ref_opt = torch.optim.AdamW(d_ref.parameters(), foreach=False, **PLAIN_ADAMW)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "steps that keep departing" warning
        for i in range(8):
            assert _dcgan_step(g, d, g_opt, d_opt, i) == _dcgan_step(g_ref, d_ref, g_ref_opt, d_ref_opt, i), i
            if i == 3:
                at = [dict(e.memory_stats()["counters"]) for e in (g_engine, d_engine)]
    assert_bitwise(g_engine.state_dict()["model"], g_ref.state_dict(), "generator")
    assert_bitwise(d_engine.state_dict()["model"], d_ref.state_dict(), "discriminator")
    for engine, counters_at in zip((g_engine, d_engine), at):
        _settled(counters_at, engine, budget > 1)
        stats = engine.memory_stats()
        assert stats["device_peak_bytes"] <= stats["budget_bytes"]
        assert (stats["plan"]["streamed_buckets"] > 0) == (budget < 1), stats["plan"]
    if budget > 1:  # all resident: the discriminator's passes run the fast path, the extra read included
        assert d_engine.memory_stats()["counters"]["fast_steps"] >= 18
    g_engine.close()
    d_engine.close()


def _pass(model, opt, i: int, input_grad: bool, step: bool) -> float:
    x = _randn(i, 8, 8).requires_grad_(input_grad)
    loss = model(x).pow(2).mean()
    loss.backward()
    if step:
        opt.step()
        opt.zero_grad()
    return loss.item()


@pytest.mark.parametrize("overlap", [False, True], ids=["deferred", "overlap"])
@pytest.mark.parametrize("budget", [0.9, 10.0], ids=["streamed", "resident"])
@pytest.mark.parametrize("first_plan", ["without", "with"])
def test_passes_with_and_without_the_input_grad_settle_on_one_plan(budget, overlap, first_plan):
    """Two passes a step, one whose input requires grad (its backward reads the first weight once more) and one
    whose does not; deferred, both accumulate into one ``step()``, overlapped each is its own step. The first plan
    is made from the pass ``without`` the read (the other pass's read is let by where its bucket is on the device)
    or ``with`` it (the other pass departs once: its record is planned from unless the plan's pass comes again)."""
    model, ref = _mlp(2, 8, 1), _mlp(2, 8, 1)
    engine, opt = wrap_on_cpu(model, budget, overlap_optimizer=overlap)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **PLAIN_ADAMW)
    # the first plan comes from the first step's last pass: overlapped, the first pass
    planned_pass_reads = first_plan == "with"
    order = (planned_pass_reads, not planned_pass_reads) if overlap else (not planned_pass_reads, planned_pass_reads)
    for i in range(8):
        if i == 4:
            counters_at = dict(engine.memory_stats()["counters"])
        for k, input_grad in enumerate(order):
            step = overlap or k == 1
            assert _pass(model, opt, 2 * i + k, input_grad, step) == _pass(ref, ref_opt, 2 * i + k, input_grad, step)
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), f"first planned {first_plan} the read")
    _settled(counters_at, engine, budget > 1 and not planned_pass_reads)
    engine.close()


def _events(*pairs: tuple[str, int]) -> tuple[Event, ...]:
    kinds = {"U": EventKind.UNPACK, "G": EventKind.GRAD, "P": EventKind.PRE}
    return tuple(Event(kinds[k], key) for k, key in pairs)


def test_an_extra_read_is_let_by_only_before_its_buckets_update_can_begin():
    """Overlapped and device-optimizer updates run once a bucket's grads are complete: a read after its last
    planned grad may read the new weights where torch reads the old, so the step must depart there."""
    events = _events(("U", 2), ("G", 3), ("G", 2), ("U", 0), ("G", 1), ("G", 0))
    bucket_of = [0, 0, 1, 1]
    last = last_grads(events, bucket_of, 3)
    assert last == (5, 2, -1)
    assert extra_read_allowed(3, 0, True, last)  # bucket 0's grads still to come
    assert extra_read_allowed(2, 1, True, last)  # bucket 1's last grad is the next event
    assert not extra_read_allowed(3, 1, True, last)  # bucket 1 complete: its update may have begun
    assert not extra_read_allowed(3, 0, False, last)  # not on the device: the plan did not bring it
    assert extra_read_allowed(5, 2, True, last)  # no grads planned (frozen): never updated in backward


def test_planned_reads_that_do_not_come_are_passed_over_only_up_to_the_event_that_came():
    events = _events(("U", 2), ("U", 4), ("G", 3), ("G", 2), ("U", 0), ("G", 1))
    assert first_after_unread(events, 0, EventKind.GRAD, 3) == 2  # both reads passed over
    assert first_after_unread(events, 1, EventKind.GRAD, 3) == 2
    assert first_after_unread(events, 0, EventKind.UNPACK, 4) == 1
    assert first_after_unread(events, 0, EventKind.GRAD, 2) is None  # not the next event after the reads
    assert first_after_unread(events, 2, EventKind.GRAD, 2) is None  # only reads are passed over
    assert first_after_unread(events, 4, EventKind.GRAD, 1) == 5
    assert first_after_unread(events, 5, EventKind.GRAD, 0) is None  # past the end


def _trace(events: tuple[Event, ...], num_forward: int = 2, activations: int = 100) -> Trace:
    n = len(events)
    return Trace(events=events, num_forward=num_forward, uses=((),) * n, ends=tuple(range(1, n + 1)), touched=(),
                 activation_peak_bytes=activations, max_grad_bytes=10, seconds=(0.0,) * n)


def test_the_record_to_plan_from_is_the_one_that_reads_more_only_once_both_kinds_of_pass_come():
    """A plan made from the pass that reads more serves both kinds of pass; but one made from a one-off pass may be
    poor for the passes after it (test_off_plan_late_read.py), so a record stands for its kind (``wider``) only once
    its pass departed at a read of a bucket not on the device a second time, or came again right after a pass that
    read less."""
    forward = (("P", 0), ("P", 1))
    wide = _trace(_events(*forward, ("U", 2), ("G", 2), ("U", 0), ("G", 0)))
    narrow = _trace(_events(*forward, ("U", 2), ("G", 2), ("G", 0)))
    other = _trace(_events(*forward, ("G", 2), ("U", 2), ("G", 0)))
    assert reads_more(wide, narrow)
    assert not reads_more(narrow, wide) and not reads_more(wide, wide)
    assert not reads_more(wide, other)  # not the same pass less some reads
    assert not reads_more(_trace(wide.events, activations=50), narrow)  # a plan from it would be too small

    reads = UnforeseenReads(slots=None)  # type: ignore[arg-type]
    assert reads.plan_from(narrow) is narrow  # nothing departed: its own record
    reads._read_more = True  # as ``at`` sets it where a read of a bucket not on the device departs
    first = _trace(wide.events)
    assert reads.plan_from(first) is first and reads.wider is None  # once: a one-off, perhaps
    assert reads.plan_from(narrow) is narrow
    reads._read_more = True  # its kind departed again
    assert reads.plan_from(wide) is wide and reads.wider is wide
    assert reads.plan_from(narrow) is wide  # the pass with the read serves both
    assert reads.plan_from(narrow) is wide
    again = _trace(wide.events)
    assert reads.plan_from(again) is again and reads.wider is wide  # the same kind: kept (the plan's record)
    assert reads.plan_from(other) is other and reads.wider is None  # another loop: forgotten
    assert reads.plan_from(narrow) is narrow

    one_off = UnforeseenReads(slots=None)  # type: ignore[arg-type]
    one_off._read_less = wide  # a pass read less than its plan (made from ``wide``): it departed
    assert one_off.plan_from(narrow) is narrow and one_off.wider is None  # planned from, as before
    assert one_off.plan_from(narrow) is narrow and one_off.wider is None  # ``wide``'s pass did not come again
    both = UnforeseenReads(slots=None)  # type: ignore[arg-type]
    both._read_less = wide
    assert both.plan_from(narrow) is narrow
    assert both.plan_from(again) is again and both.wider is again  # it came again right after: both kinds come
    assert both.plan_from(narrow) is again


def test_the_pass_before_a_read_more_departure_coming_again_settles_on_the_wider_record_at_once():
    """A plan made from the pass without the read (``narrow``); the pass with it departs at a read of a bucket not
    on the device (a streamed plan) and is planned from; the pass without it then departs where the reads it lacks
    did not come. It is the pass the read-more pass departed from, come again after it: both kinds come, so the plan
    is made from the wider record there and the next passes of either kind follow it. Before (session 26's flake of
    test_passes_with_and_without_the_input_grad_settle_on_one_plan[without-streamed-overlap]) it was planned from its
    own record, and the pass with the read departed a third time: three departures in three steps, and the
    departing-steps warning."""
    forward = (("P", 0), ("P", 1))
    wide = _trace(_events(*forward, ("U", 2), ("G", 2), ("U", 0), ("G", 0)))
    narrow = _trace(_events(*forward, ("U", 2), ("G", 2), ("G", 0)))
    reads = UnforeseenReads(slots=None)  # type: ignore[arg-type]
    assert reads.plan_from(narrow) is narrow
    reads._read_more, reads._more_from = True, narrow  # ``at``: the read departed from the plan made from narrow
    assert reads.plan_from(wide) is wide and reads.wider is None
    reads._read_less = wide  # ``at``: the pass without the read departed from the plan made from wide
    assert reads.plan_from(_trace(narrow.events)) is wide and reads.wider is wide
    assert reads.plan_from(_trace(wide.events)) is not None and reads.wider is wide  # on plan: the same record kept
    assert reads.plan_from(_trace(narrow.events)) is wide

    other = UnforeseenReads(slots=None)  # type: ignore[arg-type]
    assert other.plan_from(narrow) is narrow
    other._read_more, other._more_from = True, narrow
    assert other.plan_from(wide) is wide
    elsewhere = _trace(_events(*forward, ("G", 2), ("U", 2), ("G", 0)))
    other._read_less = wide
    assert other.plan_from(elsewhere) is elsewhere and other.wider is None  # not the pass it departed from
