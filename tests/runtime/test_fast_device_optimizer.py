"""Fast steps on plans that keep some buckets' optimizer on the device ([Note: device updates on a fast step] in
offload/runtime/fast_path.py): every bucket's weights resident for the whole step, some of them updated on the
device (``Placement.DEVICE_OPTIMIZER``) at their last grad, the rest sent to the host as on any fast step.

Plans with device-optimizer buckets come from a hardware model whose CPU AdamW is slow (``SLOW_CPU``, as in
test_device_optimizer.py) and a budget large enough that nothing streams; every test checks that its plan has
that shape and that fast steps ran (``counters["fast_steps"]``), so none passes by taking the full path. Before
this change such a plan never ran fast: each of these tests fails on that count (``full_path()`` below puts the
old rule back, and is what the tests compare the fast steps with where plain torch is no exact reference).
The cases are those where an update in place during backward could meet a saved weight view that the full
path's saved-tensor hooks would have rebuilt: tied weights (the GPT), a module called twice, a weight read
detached after its bucket's last grad (demoted to the host optimizer: [Note: read after the update]), a
gradient penalty and ``create_graph``, departures, 16-bit compute, loss scaling with a skipped step,
accumulation and clipping, an evaluation and a state-dict round trip between fast steps, chaos and the
simulated GPU."""

import contextlib
import copy
import warnings
from functools import partial

import pytest
import torch
from torch import nn

import offload
import offload.planning.trace
from offload.planning.placement import Placement
from offload.runtime import fast_path
from offload.runtime.device_optim import read_after_update
from offload.testing.chaos import ChaosConfig
from tests.runtime.test_device_optimizer import (ADAMW, CASES, DetachedReuse, _SteadyClock, _train_detached_reuse,
                                                 assert_optimizer_state_bitwise, placements, reference, run, step,
                                                 wrap)
from tests.runtime.test_fast_path import Gated, _gated_x
from tests.support.compare import assert_bitwise, assert_losses_bitwise
from tests.support.fake_cuda import simulated_gpu, with_chaos  # noqa: F401 (a fixture)
from tests.support.loops import lockstep, session_with_eval_and_reload

STEPS = 8
MIXED_RESIDENT = 3.0  # budget / fp32 bytes at which the tiny GPT's plan is device-optimizer and resident buckets
ALL_DEVICE = 4.0  # ... at which every bucket's optimizer is on the device
LOWP_RESIDENT = 3.0  # the same mix (device-optimizer and resident, nothing streamed) in 16 bits


@pytest.fixture(autouse=True)
def _steady_trace_clock(monkeypatch):
    """Plans follow the trace's measured compute times: a steady clock (1 ms a reading) makes every run plan the
    same placements (see test_device_optimizer.py)."""
    monkeypatch.setattr(offload.planning.trace, "time", _SteadyClock())


@contextlib.contextmanager
def full_path():
    """The rule before this change: only plans whose every bucket is Placement.RESIDENT run fast."""
    old = fast_path._WHOLE_STEP
    fast_path._WHOLE_STEP = (Placement.RESIDENT,)
    try:
        yield
    finally:
        fast_path._WHOLE_STEP = old


def counters(engine) -> dict:
    return dict(engine.memory_stats()["counters"])


def assert_resident_with_device_buckets(engine, host_too: bool | None = None) -> None:
    """Nothing streams, some buckets' optimizer is on the device (and, ``host_too``, some on the host)."""
    where = set(placements(engine))
    assert Placement.STREAMED not in where and Placement.DEVICE_OPTIMIZER in where, where
    if host_too is not None:
        assert (Placement.RESIDENT in where) == host_too, where


def lane_entries(engine) -> list[tuple[str, int, int]]:
    """The last step's copies and updates on the lanes: (lane, bucket, bytes), in the order issued."""
    return [(lane, b, n) for lane, b, n, _, _ in engine._runtime.ctx.lane_log.last_step[2]]


# -- fp32: plain torch bit for bit -------------------------------------------------------------------------


@pytest.mark.parametrize("frac, host_too", [(MIXED_RESIDENT, True), (ALL_DEVICE, False)],
                         ids=["device-and-host", "all-device"])
def test_a_resident_plan_with_device_updates_runs_fast_as_torch_and_as_the_full_path(frac, host_too):
    """The GPT (tied embedding and LM head) with every bucket resident, some or all updated on the device: the
    steps after the one that verified the plan run fast, bit for bit plain torch; per step the same copies and
    host updates as the full path's (the same lane log), one device update per device bucket, no grad or weight
    of a device bucket crossing."""
    runs = {}
    for fast in (True, False):
        case = CASES["gpt"]()
        ref, ref_opt = reference(case.model)
        with contextlib.nullcontext() if fast else full_path():
            engine, opt = wrap(case.model, frac=frac)
            rt = engine._runtime
            try:
                losses, ref_losses, per_step, lanes = [], [], [], []
                for i in range(STEPS):
                    before = (counters(engine), list(rt.slots.h2d_by_bucket), rt.grads.device.counters["updates"])
                    losses.append(step(engine, opt, case, i))
                    ref_losses.append(step(ref, ref_opt, case, i))
                    per_step.append((before, (counters(engine), list(rt.slots.h2d_by_bucket),
                                              rt.grads.device.counters["updates"])))
                    lanes.append(lane_entries(engine))
                assert_resident_with_device_buckets(engine, host_too)
                assert_losses_bitwise(losses, ref_losses)
                assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "weights")
                assert_optimizer_state_bitwise(opt.state_dict(), ref_opt.state_dict())
                c = counters(engine)
                assert c["fast_steps"] == (STEPS - 2 if fast else 0), c
                assert c["plan_departures"] == 0 and c["replans"] == 0, c
                plan = rt.executor.train_plan
                device = set(plan.device_optimizer)
                assert not read_after_update(plan)  # every device bucket is updated on the device
                host_grads = sum(plan.buckets[b].grad_nbytes(4) for b in range(len(plan.buckets))
                                 if b not in device and plan.buckets[b].trainable_numel)
                for (c0, h2d0, upd0), (c1, h2d1, upd1) in per_step[2:]:
                    assert c1["d2h_bytes"] - c0["d2h_bytes"] == host_grads
                    assert all(h2d1[b] == h2d0[b] for b in device)
                    assert upd1 - upd0 == len(device)
                stats = engine.memory_stats()
                assert stats["device_peak_bytes"] <= stats["budget_bytes"]
                runs[fast] = lanes, [(c1["d2h_bytes"] - c0["d2h_bytes"], c1["h2d_bytes"] - c0["h2d_bytes"],
                                      upd1 - upd0) for (c0, _, upd0), (c1, _, upd1) in per_step]
            finally:
                engine.close()
    assert runs[True][0][2:] == runs[False][0][2:]  # the same copies and host updates, in the same order
    assert runs[True][1][2:] == runs[False][1][2:]


class Twice(nn.Module):
    """``shared`` is called twice per forward: its weight's grad is the sum of two uses (one accumulator, one
    post-accumulate-grad hook after both), and its first use's backward reads it after its second use's."""

    def __init__(self, width=32):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.shared, self.b = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, 4)

    def forward(self, x):
        h = self.shared(self.a(x).tanh()).tanh()
        h = self.shared(self.b(h).tanh()).tanh()
        return self.out(h)


def _mlp(depth=6, width=32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())],
                         nn.Linear(width, 4))


def _xy(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)


def _plain(forward, opt, i: int, input_grad: bool = False) -> float:
    x, y = _xy(i)
    x.requires_grad_(input_grad)  # (the root call's signature: as a penalty step's, or not)
    loss = (forward(x) - y).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _penalty(forward, opt, i: int) -> float:
    """A gradient penalty: two backward passes, the first with ``create_graph`` (its graph reads the weights
    again in the second)."""
    x, y = _xy(i)
    x.requires_grad_(True)
    loss = (forward(x) - y).square().mean()
    g, = torch.autograd.grad(loss, x, create_graph=True)
    loss = loss + g.square().sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _create_graph(forward, opt, i: int) -> float:
    x, y = _xy(i)
    loss = (forward(x) - y).square().mean()
    with warnings.catch_warnings():  # torch's, for the reference cycle p.grad's graph makes (grads set to None)
        warnings.filterwarnings("ignore", "Using backward\\(\\) with create_graph=True", UserWarning)
        loss.backward(create_graph=True)
    opt.step()
    opt.zero_grad()
    return loss.item()


SMALL = {  # model, step per index (a plan from plain steps, then penalty steps: "plain-then-penalty")
    "module-twice": (Twice, lambda i: _plain),
    "penalty": (_mlp, lambda i: _penalty),
    "plain-then-penalty": (_mlp, lambda i: partial(_plain, input_grad=True) if i < 4 else _penalty),
    "create-graph": (_mlp, lambda i: _create_graph),
}


@pytest.mark.parametrize("name", list(SMALL))
def test_weights_read_again_in_backward_train_as_torch_on_fast_steps(name, monkeypatch):
    """A weight its backward reads more than once (a module called twice, a gradient penalty's second pass, a
    ``create_graph`` backward) is read before its bucket's device update: fast steps give torch's numbers bit
    for bit. (A clock of 10 us a reading: these small models get device-optimizer plans from short compute
    times, as in test_device_optimizer.py's demotion test.)"""
    monkeypatch.setattr(offload.planning.trace, "time", _SteadyClock(1e-5))
    make, step_of = SMALL[name]
    model = make()
    ref, ref_opt = reference(model)
    engine, opt = wrap(model, frac=ALL_DEVICE)
    try:
        losses, ref_losses, fast = [], [], []
        for i in range(STEPS):
            before = counters(engine)["fast_steps"]
            losses.append(step_of(i)(engine, opt, i))
            ref_losses.append(step_of(i)(ref, ref_opt, i))
            fast.append(counters(engine)["fast_steps"] > before)
        assert_resident_with_device_buckets(engine)
        if name == "plain-then-penalty":  # penalty steps run fast on a plan made from steps without one (the
            assert fast[4] and sum(fast) >= 4, fast  # same root call); grads in another order depart, as any do
        else:
            assert fast == [False, False] + [True] * (STEPS - 2), fast
        assert engine.memory_stats()["device_optimizer"]["updates"] > 0
        assert_losses_bitwise(losses, ref_losses)
        assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "weights")
        assert_optimizer_state_bitwise(opt.state_dict(), ref_opt.state_dict())
    finally:
        engine.close()


def test_a_weight_read_after_its_bucket_s_last_grad_is_demoted_on_fast_steps_too(monkeypatch):
    """DetachedReuse reads ``b.weight`` detached after ``b``'s grads are complete: its bucket keeps the host
    optimizer ([Note: read after the update]) on fast steps as on full ones, and the others update on the
    device: torch's numbers bit for bit."""
    monkeypatch.setattr(offload.planning.trace, "time", _SteadyClock(1e-5))
    torch.manual_seed(0)
    model = DetachedReuse()
    ref, ref_opt = reference(model)
    engine, opt = wrap(model, frac=ALL_DEVICE)
    try:
        losses, ref_losses = _train_detached_reuse(engine, opt, ref, ref_opt, STEPS)
        plan = engine._runtime.executor.train_plan
        assert_resident_with_device_buckets(engine)
        demoted = read_after_update(plan)
        assert demoted and set(plan.device_optimizer) - demoted  # both kinds on the fast steps
        assert counters(engine)["fast_steps"] == STEPS - 2
        assert engine._runtime.grads.fast_send.sent > 0  # the demoted bucket went by the fast routine
        assert_losses_bitwise(losses, ref_losses)
        assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "weights")
    finally:
        engine.close()


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "simulated-gpu"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "deferred"])
def test_a_fast_step_with_device_buckets_departs_and_trains_as_torch(overlap, gpu, monkeypatch, simulated_gpu):
    """Gated skips a module now and then (same input shapes: the step runs fast and departs in backward; its
    device buckets whose grads come after the departure are updated on the device from on-demand slots, as the
    arena stays; deferred, at step()); plain torch's numbers bit for bit, on the simulated GPU too (no race)."""
    monkeypatch.setattr(offload.planning.trace, "time", _SteadyClock(1e-5))
    made = simulated_gpu() if gpu else None
    model = Gated()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    engine, opt = wrap(model, frac=ALL_DEVICE, overlap_optimizer=overlap)
    try:
        losses, ref_losses = [], []
        for i, take in enumerate([True, True, True, False, True, True, False, True, True]):
            for forward, o, out in ((engine, opt, losses), (ref, ref_opt, ref_losses)):
                loss = forward(_gated_x(i, take)).square().mean()
                loss.backward()
                o.step()
                o.zero_grad()
                out.append(loss.item())
        assert_resident_with_device_buckets(engine)
        c = counters(engine)
        assert c["fast_steps"] >= 3 and c["plan_departures"] >= 1, c
        assert engine.memory_stats()["device_optimizer"]["updates"] > 0
        if made is not None:
            assert made and made[0]._api.copies > 0  # on the simulated GPU
        assert_losses_bitwise(losses, ref_losses)
        assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "weights")
        assert_optimizer_state_bitwise(opt.state_dict(), ref_opt.state_dict())
    finally:
        engine.close()


# -- accumulation, clipping, 16-bit, loss scaling ---------------------------------------------------------


@pytest.mark.parametrize("clip", [None, 0.05], ids=["accumulate", "accumulate-clip"])
def test_accumulation_and_clipping_on_fast_steps_with_device_buckets(clip):
    """overlap_optimizer=False, three backward passes per step (each a fast one), one global norm over both
    tiers, the device buckets updated in step() from their host sums: torch's numbers bit for bit."""
    case = CASES["gpt"]()
    ref, ref_opt = reference(case.model)
    engine, opt = wrap(case.model, frac=MIXED_RESIDENT, overlap_optimizer=False)
    accum, norms = 3, []

    def micro(i):
        def loss(forward, batch=case.make_batch(i)):
            return case.loss_fn(run(forward, batch), batch) / accum
        return loss

    def before_step(i):
        if clip is not None:
            got = engine.clip_grad_norm_(clip)
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip, foreach=False)
            norms.append((float(got), float(want)))

    try:
        lockstep(engine, opt, ref, ref_opt, STEPS, lambda i: [micro(i * accum + j) for j in range(accum)],
                 before_step)
        assert_resident_with_device_buckets(engine, host_too=True)
        assert counters(engine)["fast_steps"] >= (STEPS - 2) * accum
        assert engine._runtime.grads.device.counters["grad_h2d_bytes"] > 0  # device updates from the host sums
        if clip is not None:
            assert all(a == b for a, b in norms) and all(want > clip for _, want in norms), norms
        assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "weights")
        assert_optimizer_state_bitwise(opt.state_dict(), ref_opt.state_dict())
    finally:
        engine.close()


@pytest.mark.parametrize("fused", [False, None], ids=["torch", "fused"])
def test_bfloat16_fast_steps_with_device_buckets_are_the_full_path_bit_for_bit(fused):
    """16-bit weights written in place from the new master on the device, on fast steps: the same numbers as
    the full path (which test_device_optimizer.py and test_training.py compare with torch)."""
    runs = {}
    for fast in (True, False):
        case = CASES["gpt"]()
        with contextlib.nullcontext() if fast else full_path():
            engine, opt = wrap(case.model, frac=LOWP_RESIDENT, dtype=torch.bfloat16, fused=fused)
            try:
                losses = [step(engine, opt, case, i) for i in range(STEPS)]
                assert_resident_with_device_buckets(engine, host_too=True)
                assert counters(engine)["fast_steps"] == (STEPS - 2 if fast else 0)
                runs[fast] = losses, engine.state_dict()
            finally:
                engine.close()
    assert_losses_bitwise(runs[True][0], runs[False][0])
    assert_bitwise(runs[True][1]["model"], runs[False][1]["model"], "bf16 weights")
    assert_optimizer_state_bitwise(runs[True][1]["optimizer"], runs[False][1]["optimizer"])


def test_float16_overflow_on_a_fast_step_skips_the_device_update_too():
    """float16 (deferred updates, loss scaling): a fast step whose grads overflow is skipped in both tiers
    (weights and device state untouched) and the scale halves; every number as the full path's."""
    runs = {}
    for fast in (True, False):
        case = CASES["gpt"]()
        with contextlib.nullcontext() if fast else full_path():
            engine, opt = wrap(case.model, frac=LOWP_RESIDENT, dtype=torch.float16,
                               loss_scale=offload.LossScaleConfig(init_scale=1024.0, growth_interval=1000))
            losses = []
            try:
                for i in range(STEPS):
                    batch = case.make_batch(i)
                    before_fast = counters(engine)["fast_steps"]
                    loss = case.loss_fn(run(engine, batch), batch)
                    if i == 4:
                        assert counters(engine)["fast_steps"] == before_fast + fast  # the step overflowing
                        before = engine.state_dict()
                        engine.backward(loss * float("inf"))
                    else:
                        engine.backward(loss)
                    opt.step()
                    opt.zero_grad()
                    if i == 4:
                        assert engine.memory_stats()["optimizer"]["last_step_skipped"]
                        after = engine.state_dict()
                        assert_bitwise(after["model"], before["model"], "skipped step: weights")
                        assert_optimizer_state_bitwise(after["optimizer"], before["optimizer"])
                    losses.append(loss.item())
                assert_resident_with_device_buckets(engine, host_too=True)
                stats = engine.memory_stats()
                assert stats["optimizer"]["skipped_steps"] == 1 and stats["optimizer"]["loss_scale"] == 512.0
                assert stats["device_optimizer"]["updates"] > 0
                assert counters(engine)["fast_steps"] == (STEPS - 2 if fast else 0)
                runs[fast] = losses, engine.state_dict()
            finally:
                engine.close()
    assert_losses_bitwise(runs[True][0], runs[False][0])
    assert_bitwise(runs[True][1]["model"], runs[False][1]["model"], "fp16 weights")
    assert_optimizer_state_bitwise(runs[True][1]["optimizer"], runs[False][1]["optimizer"])


# -- where the update runs ----------------------------------------------------------------------------------


def test_device_updates_run_at_their_last_grad_even_where_buckets_would_go_after_backward(monkeypatch):
    """[Note: sent after backward]: with the CPU backend's inline lanes a fast step's buckets go at the end of
    backward where the grads held at once fit. Not with device-optimizer buckets ([Note: device updates on a
    fast step]): their updates run during backward, at each bucket's last grad, as on the full path."""
    monkeypatch.setenv("OFFLOAD_CPU_COPIES", "inline")
    for device_optimizer in (False, True):
        case = CASES["gpt"]()
        engine, opt = wrap(case.model, frac=8.0, device_optimizer=device_optimizer)
        rt = engine._runtime
        fast, device = rt.fast, rt.grads.device
        at = []
        update = device.update

        def spy(*args, **kwargs):
            at.append(fast._pos)  # the grads of the plan's order that came so far
            return update(*args, **kwargs)
        device.update = spy
        try:
            for i in range(4):
                at.clear()
                step(engine, opt, case, i)
            assert counters(engine)["fast_steps"] == 2
            allowed = fast.allows(rt.executor.train_plan)
            if not device_optimizer:  # the budget lets a host-only plan send its buckets after backward
                assert allowed.at_end and not at
                continue
            assert_resident_with_device_buckets(engine)
            assert not allowed.at_end and allowed.closes is not None
            assert len(at) == len(rt.executor.train_plan.device_optimizer) > 1
            assert at == sorted(at) and at[0] < len(allowed.grad_keys)  # during backward, bucket by bucket
        finally:
            engine.close()


# -- between steps: evaluation, a state-dict round trip; chaos and the simulated GPU --------------------------


def _session(chaos=None, overlap=True):
    """Fast steps (or, deferred, two micro-batches and a clip per step) with an evaluation forward and a
    state-dict round trip in between: losses, eval outputs, final state, counters."""
    case = CASES["gpt"]()
    with with_chaos(chaos):
        engine, opt = wrap(case.model, frac=MIXED_RESIDENT, **({} if overlap else {"overlap_optimizer": False}))
    try:
        losses, outs = session_with_eval_and_reload(engine, opt, case, 7, overlap)
        assert_resident_with_device_buckets(engine, host_too=True)
        return losses, outs, engine.state_dict(), counters(engine)
    finally:
        engine.close()


def _assert_same_session(got, want) -> None:
    assert_losses_bitwise(got[0], want[0])
    assert len(got[1]) == len(want[1]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert_bitwise(got[2]["model"], want[2]["model"], "weights")
    assert_optimizer_state_bitwise(got[2]["optimizer"], want[2]["optimizer"])


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "accumulate-clip"])
def test_eval_and_a_state_round_trip_between_fast_steps_are_the_full_path(overlap):
    with full_path():
        want = _session(overlap=overlap)
    got = _session(overlap=overlap)
    assert got[3]["fast_steps"] >= 3 * (1 if overlap else 2) and want[3]["fast_steps"] == 0, got[3]
    _assert_same_session(got, want)


def test_chaos_keeps_fast_steps_with_device_buckets_bit_identical():
    want = _session()
    got = _session(chaos=ChaosConfig(seed=3))
    assert got[3]["fast_steps"] >= 3, got[3]
    _assert_same_session(got, want)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "accumulate-clip"])
def test_simulated_gpu_fast_steps_with_device_buckets_are_the_cpu_backend_s(simulated_gpu, overlap):
    """The device updates of fast steps (and the host sums' way back, deferred) under the CUDA backend's
    ordering rules on a GPU simulated as late as CUDA allows: no race, the CPU backend's numbers exactly."""
    want = _session(overlap=overlap)
    made = simulated_gpu()
    got = _session(overlap=overlap)
    assert got[3]["fast_steps"] >= 3, got[3]
    _assert_same_session(got, want)
    assert made[0]._api.copies > 0 and made[0]._api.pending() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fast_steps_with_device_buckets_are_the_full_path_bit_for_bit():
    """On a GPU: the device updates of fast steps run on the compute stream at each bucket's last grad, with the
    full path's waits; the same plan trained both ways gives the same numbers bit for bit (not run on a GPU yet:
    this task had none)."""
    from tests.runtime.test_device_optimizer import SLOW_CPU, param_bytes
    from tests.support.budgets import with_headroom

    runs = {}
    for fast in (True, False):
        case = CASES["gpt"]()
        with contextlib.nullcontext() if fast else full_path():
            opt = offload.AdamW(case.model.parameters(), fused=False, **ADAMW)
            nbytes = param_bytes(case.model)
            engine = offload.wrap(case.model, opt, budget=with_headroom(LOWP_RESIDENT * nbytes, "cuda"),
                                  dtype=torch.bfloat16, device="cuda", hw=SLOW_CPU, device_optimizer=True,
                                  bucket_bytes=nbytes // 10)
            try:
                losses = [step(engine, opt, case, i, "cuda") for i in range(STEPS)]
                assert_resident_with_device_buckets(engine)
                assert counters(engine)["fast_steps"] == (STEPS - 2 if fast else 0)
                runs[fast] = losses, engine.state_dict(), placements(engine)
            finally:
                engine.close()
    assert runs[True][2] == runs[False][2]  # the same plan both ways (else the comparison is of two plans)
    assert_losses_bitwise(runs[True][0], runs[False][0])
    assert_bitwise(runs[True][1]["model"], runs[False][1]["model"], "bf16 weights")
    assert_optimizer_state_bitwise(runs[True][1]["optimizer"], runs[False][1]["optimizer"])
