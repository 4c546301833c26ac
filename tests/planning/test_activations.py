"""The activation planner (offload/planning/activations.py): estimates by hand, and the greedy choice."""

import pytest

from offload.planning.activations import (
    ActivationProfile,
    BlockProfile,
    activation_bytes,
    checkpoint_hint,
    choose_checkpoints,
    recompute_seconds,
)

MB = 1 << 20


def profile(checkpointed=(), forward_end=None, peak=None) -> ActivationProfile:
    # Three blocks called in order 0, 1, 2 (module indices 10, 20, 30), each with a 1 MiB input.
    blocks = (BlockProfile(10, "b.0", saved=4 * MB, inputs=MB, forward_s=0.1, order=0),
              BlockProfile(20, "b.1", saved=6 * MB, inputs=MB, forward_s=0.2, order=5),
              BlockProfile(30, "b.2", saved=5 * MB, inputs=MB, forward_s=0.3, order=9))
    if forward_end is None:  # nothing checkpointed: every block's saved bytes + 2 MiB outside the blocks
        forward_end = 15 * MB + 2 * MB
    return ActivationProfile(blocks, frozenset(checkpointed), forward_end, peak if peak is not None else forward_end)


def test_measured_choice_is_the_measurement():
    p = profile(peak=17 * MB + 123)
    assert activation_bytes(p, []) == 17 * MB + 123


def test_estimate_by_hand():
    p = profile()
    # Checkpoint b.1: the forward ends holding 17 - 6 + 1 = 12 MiB. Backward frees b.2's 5 MiB, then
    # recomputes b.1 (6 MiB): 12 - 5 + 6 = 13 MiB.
    assert activation_bytes(p, [20]) == 13 * MB
    # Checkpoint b.2 as well: forward ends at 12 - 5 + 1 = 8 MiB; b.2 recomputes first: 8 + 5 = 13 MiB;
    # then b.1 with b.2's input let go of: 8 - 1 + 6 = 13 MiB.
    assert activation_bytes(p, [20, 30]) == 13 * MB
    # All three: 17 - 15 + 3 = 5 MiB held; recomputes: 5 + 5, 5 - 1 + 6, 5 - 2 + 4 -> 10 MiB.
    assert activation_bytes(p, [10, 20, 30]) == 10 * MB
    # From a measurement with everything checkpointed back to none checkpointed: the 17 MiB again.
    all_ckpt = profile(checkpointed=[10, 20, 30], forward_end=5 * MB, peak=10 * MB)
    assert activation_bytes(all_ckpt, []) == 20 * MB  # inputs not subtracted: the estimate errs high
    with pytest.raises(ValueError, match="not measured"):
        activation_bytes(p, [99])


def test_greedy_picks_the_largest_saving_first_and_stops():
    p = profile()
    assert choose_checkpoints(p, 17 * MB).modules == ()
    choice = choose_checkpoints(p, 13 * MB)
    assert choice.modules == (20,) and choice.names == ("b.1",) and choice.fits
    assert choice.recompute_s == pytest.approx(0.2)
    assert choose_checkpoints(p, 10 * MB).modules == (10, 20, 30)
    impossible = choose_checkpoints(p, 9 * MB)
    assert not impossible.fits and impossible.modules == (10, 20, 30)
    assert recompute_seconds(p, [10, 30]) == pytest.approx(0.4)


def test_hints():
    p = profile()
    assert 'activation_checkpointing="auto" fits: checkpointing 1 of 3 blocks' in checkpoint_hint(p, 13 * MB, "off")
    assert "even with all 3 blocks checkpointed they need about 10.00 MiB" in checkpoint_hint(p, 9 * MB, "auto")
    assert "1.00 MiB more would fit" in checkpoint_hint(p, 9 * MB, "auto")
    assert "checkpoints as many" in checkpoint_hint(p, 9 * MB, "modules")
    assert checkpoint_hint(None, 9 * MB, "auto") == ""


def test_base_blocks_are_kept():
    p = profile()
    # b.0 kept: 17 - 3 = 14 MiB held at the end of forward, too much for 13; b.1 added: peak 10 MiB.
    choice = choose_checkpoints(p, 13 * MB, base=[10])
    assert choice.modules == (10, 20) and choice.activation_bytes == 10 * MB


def test_checkpointed_step_model_by_hand():
    """[Note: the recompute model]: blocks 20 (parameter 0) and 30 (parameter 1, and 2 in its child 31) of
    a recorded step with nothing checkpointed. Checkpointing block 30 adds its forward seconds (its events
    from its pre-hook to its post-hook: 0.5 + 0.25 + 0.125) to the first backward event reading one of its
    parameters (parameter 2's), which then needs both; the activation peak is the estimate's; the other
    events are untouched."""
    from offload.planning.activations import checkpointed_step
    from offload.planning.trace import EventKind, Recorder

    rec = Recorder()
    rec.pre(0)
    rec.pre(20)
    rec.touch(0)
    rec.post(20)
    rec.pre(30)
    rec.touch(1)
    rec.pre(31)
    rec.touch(2)
    rec.post(31)
    rec.post(30)
    rec.post(0)
    for p in (2, 1, 0):
        rec.unpack(p, object())
        rec.grad(p, 16)
    trace = rec.finish()
    compute = [0.0] * len(trace.events)
    block = next(i for i, ev in enumerate(trace.events) if ev.kind is EventKind.PRE and ev.key == 30)
    assert trace.ends[block] - block == 3
    for j, s in zip(range(block, trace.ends[block] + 1), (0.5, 0.25, 0.125, 1.0)):  # (its post-hook's: not its)
        compute[j] = s
    first = next(j for j in range(trace.num_forward, len(trace.events)) if 2 in trace.uses[j])
    p = profile()
    same, same_compute = checkpointed_step(trace, compute, p, [])
    assert same is trace and same_compute == tuple(compute)
    got, seconds = checkpointed_step(trace, compute, p, [30])
    assert got.activation_peak_bytes == activation_bytes(p, [30])
    assert seconds[first] == pytest.approx(compute[first] + 0.875)
    assert sum(seconds) == pytest.approx(sum(compute) + 0.875)
    assert set(got.uses[first]) == {1, 2}
    assert [u for j, u in enumerate(got.uses) if j != first] == [u for j, u in enumerate(trace.uses) if j != first]
