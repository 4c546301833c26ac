"""Builders the planner tests share (tests/planning/): random traces and machines for hypothesis, a chain
of layers, a flat-link hardware model and lane programs small enough to work out by hand, and a plan that
fits whatever budget was drawn."""

from hypothesis import strategies as st

from offload import BudgetTooSmallError
from offload.planning.buckets import ParamSpec, make_buckets
from offload.planning.hw import HardwareModel, latency_curve
from offload.planning.schedule import build_plan
from offload.planning.simulate import Program
from offload.planning.trace import Recorder


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


@st.composite
def machines(draw):
    """A random link and CPU, and random compute seconds for each event of a trace."""
    bw = draw(st.floats(1e5, 1e8))
    curve = latency_curve(bw, draw(st.floats(0, 1e-3)))
    d2h = latency_curve(draw(st.floats(1e5, 1e8)), draw(st.floats(0, 1e-3)))
    return HardwareModel("random", curve, d2h, duplex_factor=draw(st.floats(0.3, 1.0)),
                         adam_params_per_s=draw(st.floats(1e4, 1e8)), host_bytes_per_s=1e9,
                         device_flops_per_s=1e12, device_bytes_per_s=1e11)


def draw_compute(draw, trace):
    """Random compute seconds for each event of ``trace`` (``draw``: hypothesis's ``st.data().draw``)."""
    return [draw(st.floats(0, 1e-3)) for _ in trace.events]


def chain_trace(n_layers, numel):
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


def flat_hw(bw=1000.0, duplex=1.0, adam=100.0, device_adam=0.0):
    """A link as fast for every size (a copy of n bytes takes n / bw seconds), a CPU AdamW of ``adam``
    params/s, a device AdamW of ``device_adam`` params/s (0: the model derives it)."""
    curve = ((1, bw), (10**9, bw))
    return HardwareModel("test", curve, curve, duplex_factor=duplex, adam_params_per_s=adam, host_bytes_per_s=1e9,
                         device_flops_per_s=1e12, device_bytes_per_s=1e11, device_adam_params_per_s=device_adam)


def lane_program(**kw):
    """A three-event lane program of 1 s events and no copies, with ``kw``'s fields instead."""
    base = dict(compute_s=(1.0, 1.0, 1.0), h2d_event=(), h2d_bucket=(), h2d_bytes=(), waits=((), (), ()),
                d2h_event=(), d2h_bucket=(), d2h_bytes=(), adam_numel=())
    base.update(kw)
    return Program(**base)


def plan_that_fits(trace, buckets, budget, hw, compute, **options):
    """``build_plan`` (fp32, nothing fixed) within ``budget``, or within the least budget it names where
    ``budget`` is too small."""
    try:
        return build_plan(trace, buckets, itemsize=4, budget_bytes=budget, fixed_bytes=0, hw=hw, compute_s=compute,
                          **options)
    except BudgetTooSmallError as e:
        return build_plan(trace, buckets, itemsize=4, budget_bytes=e.min_budget_bytes, fixed_bytes=0, hw=hw,
                          compute_s=compute, **options)


def drawn_program(case, hw, data):
    """The lane program of a plan for a drawn ``case`` (``traces()``): compute times and a budget drawn from
    ``data``, the plan made to fit (``plan_that_fits``)."""
    from offload.planning.schedule import program_of
    trace, buckets = case
    compute = draw_compute(data.draw, trace)
    plan = plan_that_fits(trace, buckets, data.draw(st.integers(0, 60000)), hw, compute)
    return program_of(plan, compute)
