"""The first scheduler, on random traces: every plan it returns is valid, and its budget errors are true."""

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from offload import BudgetTooSmallError
from offload.buckets import ParamSpec, make_buckets
from offload.schedule import BufferKind, build_plan, validate_plan
from offload.trace import EventKind, Recorder


@st.composite
def traces(draw):
    """A random model step: nested module calls touching parameters, then a backward that reads them in
    reverse (one node per call, sometimes reading two buckets' worth) and accumulates each grad once."""
    n_params = draw(st.integers(1, 24))
    specs = [ParamSpec(draw(st.integers(1, 400)), draw(st.sampled_from([0, 0, 1, None])))
             for _ in range(n_params)]
    rec = Recorder()
    calls = []  # (module, params touched) in forward order

    def call(module, depth):
        rec.pre(module)
        touched = draw(st.lists(st.integers(0, n_params - 1), max_size=3))
        for p in touched:
            rec.touch(p)
        calls.append(touched)
        if depth < 2:
            for child in range(draw(st.integers(0, 3))):
                call(module * 4 + child + 1, depth + 1)
        rec.post(module)

    call(0, 0)
    rec.activation_peak = draw(st.integers(0, 5000))
    seen_grad = set()
    first_call = {}
    for c, touched in enumerate(calls):
        for p in touched:
            first_call.setdefault(p, c)
    for c in reversed(range(len(calls))):
        node = object()
        for p in calls[c]:
            rec.unpack(p, node)
        for p in calls[c]:
            if first_call[p] == c and specs[p].group is not None and p not in seen_grad and draw(st.booleans()):
                seen_grad.add(p)
                rec.grad(p, specs[p].numel * 4)
    trace = rec.finish()
    order = list(dict.fromkeys(list(trace.touched) + list(range(n_params))))
    buckets = make_buckets(specs, order, draw(st.integers(64, 4000)), itemsize=4)
    return trace, buckets


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), st.integers(0, 60000), st.integers(0, 3000))
def test_plans_are_valid_and_errors_are_true(case, budget, fixed):
    trace, buckets = case
    try:
        plan = build_plan(trace, buckets, itemsize=4, budget_bytes=budget, fixed_bytes=fixed)
    except BudgetTooSmallError as e:
        assert e.min_budget_bytes > budget
        # the minimum it names is enough
        plan = build_plan(trace, buckets, itemsize=4, budget_bytes=e.min_budget_bytes, fixed_bytes=fixed)
    validate_plan(plan)
    assert plan.peak_bytes <= plan.budget_bytes
    assert plan.lower_bound_bytes <= plan.arena_bytes
    # actions refer to buffers that start/end at that event
    for i, act in enumerate(plan.actions):
        assert all(plan.buffers[k].start == i and plan.buffers[k].kind is BufferKind.PARAM for k in act.prefetch)
        assert all(plan.buffers[k].end == i for k in act.release)
    # a bucket never has two param buffers live at once
    per_bucket = {}
    for x in plan.buffers:
        if x.kind is BufferKind.PARAM:
            per_bucket.setdefault(x.bucket, []).append((x.start, x.end))
    for spans in per_bucket.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def _chain_trace(n_layers, numel):
    """A plain stack of layers, one parameter each: forward 0..n-1, backward n-1..0."""
    rec = Recorder()
    rec.pre(100)
    for i in range(n_layers):
        rec.pre(i)
        rec.touch(i)
        rec.post(i)
    rec.post(100)
    for i in reversed(range(n_layers)):
        rec.unpack(i, object())
        rec.grad(i, numel * 4)
    trace = rec.finish()
    buckets = make_buckets([ParamSpec(numel, 0)] * n_layers, list(range(n_layers)), numel * 4, 4)
    return trace, buckets


def test_big_budget_keeps_everything_resident():
    trace, buckets = _chain_trace(8, 1000)
    plan = build_plan(trace, buckets, itemsize=4, budget_bytes=10**7, fixed_bytes=0)
    validate_plan(plan)
    assert plan.summary()["streamed_buckets"] == 0
    assert plan.summary()["fetches_per_step"] == 0


def test_tight_budget_streams_with_lookahead():
    trace, buckets = _chain_trace(8, 1000)
    b = 4096  # one bucket of 1000 fp32 rounded to the 256-byte arena alignment
    # two param slots (current + prefetched) + one grad slot + the largest grad autograd materialises
    plan = build_plan(trace, buckets, itemsize=4, budget_bytes=4 * b, fixed_bytes=0)
    validate_plan(plan)
    s = plan.summary()
    assert s["streamed_buckets"] >= 6
    assert plan.arena_bytes <= 3 * b
    # every streamed layer is fetched once for forward and once for backward
    assert s["fetches_per_step"] >= 2 * s["streamed_buckets"] - 2
    # lookahead: every streamed copy but the very first is issued before the event that first needs it
    assert plan.strategy.startswith("lookahead")
    bucket_needs = {}
    for i, uses in enumerate(trace.uses):
        for p in uses:
            bucket_needs.setdefault(p, []).append(i)  # one parameter per bucket here
    early = []
    for x in plan.buffers:
        if x.kind is BufferKind.PARAM and x.bucket not in plan.resident:
            first = min(i for i in bucket_needs[x.bucket] if x.start <= i < x.end)
            early.append(first > x.start)
    assert early.count(False) <= 1 and len(early) >= 12


def test_too_small_names_the_minimum():
    trace, buckets = _chain_trace(4, 1000)
    with pytest.raises(BudgetTooSmallError) as e:
        build_plan(trace, buckets, itemsize=4, budget_bytes=1000, fixed_bytes=0)
    assert e.value.min_budget_bytes > 1000
    assert "Try budget>=" in str(e.value)
    build_plan(trace, buckets, itemsize=4, budget_bytes=e.value.min_budget_bytes, fixed_bytes=0)


def test_grad_events_define_grad_slots():
    trace, buckets = _chain_trace(4, 100)
    plan = build_plan(trace, buckets, itemsize=4, budget_bytes=10**6, fixed_bytes=0)
    grads = [x for x in plan.buffers if x.kind is BufferKind.GRAD]
    assert sorted(x.bucket for x in grads) == [0, 1, 2, 3]
    for x in grads:
        ev = trace.events[x.start]
        assert ev.kind == EventKind.GRAD and ev.key == x.bucket
        assert x.end == x.start + 1  # the slot is free once its one grad has been taken
