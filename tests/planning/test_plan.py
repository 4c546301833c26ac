"""The plan model (offload/planning/plan.py): validate_plan raises InvariantError (never a bare assert, which
``python -O`` strips) naming what is wrong with a plan."""

import dataclasses

import pytest

from offload.errors import InvariantError
from offload.planning.layout import frozen_maker
from offload.planning.plan import BufferKind, validate_plan
from offload.planning.schedule import build_plan
from tests.support.planning import chain_trace


def _plan():
    trace, buckets = chain_trace(6, 1000)
    return build_plan(trace, buckets, itemsize=4, budget_bytes=4 * 4096, fixed_bytes=0)


def test_a_valid_plan_passes():
    validate_plan(_plan())


def test_a_plan_over_its_budget_is_an_invariant_error():
    plan = _plan()
    with pytest.raises(InvariantError, match="exceeds the budget"):
        validate_plan(dataclasses.replace(plan, budget_bytes=plan.peak_bytes - 1))


def test_a_buffer_past_the_arena_is_an_invariant_error():
    plan = _plan()
    bad = dataclasses.replace(plan.buffers[0], offset=plan.arena_bytes)
    with pytest.raises(InvariantError, match="buffer 0 outside arena"):
        validate_plan(dataclasses.replace(plan, buffers=(bad,) + plan.buffers[1:]))


def test_a_missing_bucket_is_an_invariant_error():
    plan = _plan()
    k = next(k for k, x in enumerate(plan.buffers) if x.kind is BufferKind.PARAM)  # made for a need of its bucket
    other = dataclasses.replace(plan.buffers[k], bucket=(plan.buffers[k].bucket + 1) % len(plan.buckets))
    with pytest.raises(InvariantError, match="which is not on the device"):
        validate_plan(dataclasses.replace(plan, buffers=plan.buffers[:k] + (other,) + plan.buffers[k + 1:]))


def test_the_fast_constructor_refuses_a_class_that_needs_its_init():
    @dataclasses.dataclass(frozen=True)
    class Checked:
        x: int

        def __post_init__(self):
            pass

    with pytest.raises(InvariantError, match="__post_init__"):
        frozen_maker(Checked)
