"""Choosing the checkpointed blocks by planned step time (offload/planning/checkpoint_choice.py, issue 18).

A synthetic warm-up step of four blocks (each one parameter of N fp32 elements, one bucket each), every
block checkpointed as "auto"'s warm-up does: its forward in the forward pass, a RECOMPUTE event in backward.
Each block saves SAVED bytes for backward when not checkpointed and keeps INPUTS when it is. The budget fits
the fewest-that-fit set (one block) with a little room; checkpointing more frees SAVED - INPUTS per block.
"""

import dataclasses
import functools

import pytest

from offload import BudgetTooSmallError
from offload.planning.activations import ActivationProfile, BlockProfile, activation_bytes, choose_checkpoints
from offload.planning.buckets import ParamSpec
from offload.planning.checkpoint_choice import candidate_sets, choose_by_step_time, step_with_checkpoints
from offload.planning.budget import min_arena_bytes
from offload.planning.schedule import build_plan
from offload.planning.trace import EventKind, Recorder
from tests.support.planning import flat_hw, make_buckets

N = 1000  # elements per block's parameter
SAVED, INPUTS = 40_000, 1_000  # bytes a block saves / keeps when checkpointed
BLOCKS = (10, 20, 30, 40)  # module indices; block k's parameter is k // 10 - 1, its child module k + 1


def warmup_trace(forward_s: float, backward_s: float = 0.01, checkpointed=BLOCKS):
    """The step as "auto"'s warm-up records it (every block checkpointed, or those of ``checkpointed``), with
    ``forward_s`` seconds of forward per block (on its child's event) and each RECOMPUTE event taking that
    again plus ``backward_s``."""
    rec = Recorder()
    rec.pre(0)
    for m in BLOCKS:
        rec.pre(m)
        rec.pre(m + 1)
        rec.touch(m // 10 - 1)
        rec.post(m + 1)
        rec.post(m)
    rec.post(0)
    for m in reversed(BLOCKS):
        if m not in checkpointed:
            rec.unpack(m // 10 - 1, object())
            rec.grad(m // 10 - 1, N * 4)
            continue
        k = rec.recompute_begin(m)
        rec.pre(m + 1)
        rec.touch(m // 10 - 1)
        rec.post(m + 1)
        rec.recompute_end()
        rec.grad(m // 10 - 1, N * 4)
        rec.region_done(k)
    trace = rec.finish()
    seconds = [0.001] * len(trace.events)
    for i, ev in enumerate(trace.events):
        if ev.kind is EventKind.PRE and ev.key % 10 == 1 and i < trace.num_forward:
            seconds[i] = forward_s
        if ev.kind is EventKind.RECOMPUTE:
            seconds[i] = forward_s + backward_s
    trace = dataclasses.replace(trace, seconds=tuple(seconds), overhead=())
    buckets = make_buckets([ParamSpec(N, 0)] * len(BLOCKS), list(range(len(BLOCKS))), N * 4, 4)
    return trace, buckets


def warmup_profile(forward_s: float) -> ActivationProfile:
    blocks = tuple(BlockProfile(m, f"blocks.{i}", SAVED, INPUTS, forward_s, order=1 + 5 * i)
                   for i, m in enumerate(BLOCKS))
    held = len(BLOCKS) * INPUTS
    return ActivationProfile(blocks, frozenset(BLOCKS), held, held + SAVED)


def choose(forward_s: float, budget: int, device_optimizer: bool = True, **kw):
    trace, buckets = warmup_trace(forward_s)
    profile = warmup_profile(forward_s)
    build = functools.partial(build_plan, buckets=buckets, itemsize=4, budget_bytes=budget, fixed_bytes=0,
                              hw=flat_hw(bw=1e6, adam=1e4), device_optimizer=device_optimizer)
    capacity = budget - trace.max_grad_bytes - min_arena_bytes(trace, buckets, 4)  # as the runtime sizes it
    fewest = choose_checkpoints(profile, capacity)
    return fewest, choose_by_step_time(trace, profile, fewest, build, **kw), build


def test_candidates_are_the_fewest_then_more_largest_saving_first():
    blocks = (BlockProfile(1, "a", 5, 1, 0.1), BlockProfile(2, "b", 9, 1, 0.1), BlockProfile(3, "c", 1, 1, 0.1),
              BlockProfile(4, "d", 7, 1, 0.1), BlockProfile(5, "e", 3, 1, 0.1))
    p = ActivationProfile(blocks, frozenset(), 0, 0)
    # b saves most, then d, a, e; c saves nothing and is never added
    assert candidate_sets(p, (4,)) == ((4,), (2, 4), (1, 2, 4), (1, 2, 4, 5))
    assert candidate_sets(p, (), limit=3) == ((), (2, 4), (1, 2, 4, 5))
    assert candidate_sets(p, (), limit=1) == ((),)
    assert candidate_sets(p, (1, 2, 4, 5)) == ((1, 2, 4, 5),)
    with pytest.raises(ValueError):
        candidate_sets(p, (), limit=0)


def test_step_model_by_hand():
    """[Note: the candidate step model]: from the warm-up (all four checkpointed; a block's forward is its
    events from its pre-hook to its post-hook: 0.001 + 0.5 + 0.001 s; each RECOMPUTE event 0.5 + 0.01 s),
    un-checkpointing a block takes its 0.502 s off its RECOMPUTE event and keeps that event's needs; the
    activation peak is the estimate's."""
    trace, _ = warmup_trace(0.5)
    profile = warmup_profile(0.5)
    recomputes = {ev.key: i for i, ev in enumerate(trace.events) if ev.kind is EventKind.RECOMPUTE}
    same, recompute = step_with_checkpoints(trace, profile, BLOCKS)
    assert same.seconds == pytest.approx(trace.seconds) and recompute == pytest.approx(4 * 0.502)
    model, recompute = step_with_checkpoints(trace, profile, (10, 30))
    assert recompute == pytest.approx(2 * 0.502)
    assert sum(model.seconds) == pytest.approx(sum(trace.seconds) - 2 * 0.502)
    for m, i in recomputes.items():
        assert model.seconds[i] == pytest.approx(0.51 if m in (10, 30) else 0.008)
    assert model.uses == trace.uses and model.overhead == ()
    assert model.activation_peak_bytes == activation_bytes(profile, (10, 30))
    with pytest.raises(ValueError, match="not measured"):
        step_with_checkpoints(trace, profile, (99,))


def test_a_block_not_checkpointed_when_measured_is_recomputed_where_backward_first_reads_it():
    """Measured with only block 40 checkpointed, block 10 chosen too: its forward seconds land on the first
    backward event that reads its parameter (0), which then needs it."""
    trace, _ = warmup_trace(0.5, checkpointed=(40,))
    profile = dataclasses.replace(warmup_profile(0.5), checkpointed=frozenset({40}))
    model, recompute = step_with_checkpoints(trace, profile, (10, 40))
    first = next(j for j in range(trace.num_forward, len(trace.events)) if 0 in trace.uses[j])
    assert recompute == pytest.approx(2 * 0.502)
    assert model.seconds[first] == pytest.approx(trace.seconds[first] + 0.502)
    assert 0 in model.uses[first]


def test_checkpointing_more_wins_while_the_cpu_adamw_is_the_wall():
    """With device optimizer state and a CPU AdamW of 10^4 params/s (the wall), the bytes a third checkpointed
    block frees hold another bucket's optimizer state on the device: faster than the fewest that fit (two
    blocks), for 1 ms of recompute."""
    fewest, timed, build = choose(0.001, 130_000)
    assert fewest.modules == (10, 20)
    assert timed.fewest == (10, 20) and timed.candidates[0].step_s is not None
    chosen = timed.candidates[timed.chosen]
    assert timed.choice.modules == chosen.modules == (10, 20, 30) and timed.choice.fits
    assert chosen.step_s < timed.candidates[0].step_s * (1 - 0.01)
    assert timed.step_s == min(c.step_s for c in timed.candidates)
    # the fourth block frees nothing more (it is recomputed first) and costs its recompute: not chosen
    assert timed.candidates[-1].modules == BLOCKS and timed.candidates[-1].step_s > chosen.step_s
    trace, _ = warmup_trace(0.001)
    plan = build(step_with_checkpoints(trace, warmup_profile(0.001), chosen.modules)[0])
    assert plan.device_optimizer and plan.simulated.step_s == chosen.step_s


def test_checkpointing_more_loses_when_recompute_costs_more_than_it_frees():
    """The same budget with 0.1 s of forward per block: recomputing costs more than the device optimizer
    state the freed bytes buy."""
    fewest, timed, _ = choose(0.1, 160_000)
    assert fewest.modules == (10,) and timed.choice is fewest and timed.chosen == 0
    assert all(c.step_s > timed.candidates[0].step_s for c in timed.candidates[1:])


def test_without_device_optimizer_freed_bytes_buy_nothing_here_so_fewer_blocks_win_ties():
    """Without device optimizer state the CPU AdamW is the wall whatever stays resident: the candidates tie
    (or lose by their recompute), and ties go to fewer blocks."""
    fewest, timed, _ = choose(0.001, 200_000, device_optimizer=False)
    assert fewest.modules == () and timed.choice is fewest
    steps = [c.step_s for c in timed.candidates]
    assert steps[1] == pytest.approx(steps[0])  # a tie ...
    assert timed.chosen == 0  # ... goes to fewer


def test_fewest_kept_when_the_model_plans_nothing_for_it():
    """The model errs high: if it gives the fewest set no plan, that set is kept (its real step is planned
    from its own trace) rather than trading it for a set the same model says fits."""
    trace, buckets = warmup_trace(0.001)
    profile = warmup_profile(0.001)
    real = functools.partial(build_plan, buckets=buckets, itemsize=4, budget_bytes=130_000, fixed_bytes=0,
                             hw=flat_hw(bw=1e6, adam=1e4), device_optimizer=True)
    fewest = choose_checkpoints(profile, 90_000)  # two blocks, 84,000 bytes

    def build(t):
        if t.activation_peak_bytes > 50_000:
            raise BudgetTooSmallError("model", min_budget_bytes=1, budget_bytes=0, breakdown={})
        return real(t)
    timed = choose_by_step_time(trace, profile, fewest, build)
    assert timed.candidates[0].step_s is None and any(c.step_s is not None for c in timed.candidates[1:])
    assert timed.choice is fewest
