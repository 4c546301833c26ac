"""[Note: the refresh in one loop] (offload/runtime/slots.py): ``step()``'s pipelined refresh issues each resident
bucket's copy from one loop (``SlotTable.refresh_each``) instead of ``_refresh_one`` and ``copy_in`` per bucket. What
must not change: per bucket one host-to-device copy, in the executor's issue order, after the compute issued before
it (``boundary``) and after its own update (``adam_event``); a bucket whose previous copy is still in flight lands
first; the training steps that follow stay plain torch's, bit for bit (on the CPU backend and the simulated GPU)."""

import pytest
import torch

from offload.errors import InvariantError
from offload.runtime.residency import Residency
from tests.runtime.test_refresh_pipelined import _all_resident_mlp, _forward_backward_beside_torch
from tests.support.fake_cuda import simulated_gpu  # noqa: F401 (a fixture)


def _spy_h2d(rt) -> list:
    """Record every host-to-device copy the backend is asked for: (the bucket whose slot it writes, its waits)."""
    calls, backend = [], rt.ctx.backend
    h2d = backend.h2d
    slots = rt.slots

    def spy(dst, src, waits=()):
        waits = list(waits)
        owner = [b for b, hit in slots._dst.items() if hit[1].data_ptr() == dst.data_ptr()]
        calls.append((owner, waits, slots.boundary, slots.adam_event.get(owner[0]) if owner else None))
        return h2d(dst, src, waits)

    backend.h2d = spy  # refresh_each and copy_in read the backend's h2d at each call
    return calls


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu_backend", "simulated_gpu"])
def test_each_pipelined_refresh_copy_waits_for_compute_and_its_update(simulated_gpu, gpu):
    """Every step from the third on (fast steps: all resident): step() issues one copy per bucket, each waiting
    for the compute issued before it and for that bucket's own update, in the order the executor chose; the
    forwards that read the refreshed slots are torch's, bit for bit (``_forward_backward_beside_torch``)."""
    if gpu:
        simulated_gpu()
    case, ref, ref_opt, opt, engine = _all_resident_mlp()
    rt = engine._runtime
    issued_order = []
    refresh_each = rt.slots.refresh_each

    def order_spy(buckets, *args, **kwargs):
        buckets = list(buckets)
        issued_order.append(buckets)
        return refresh_each(buckets, *args, **kwargs)

    rt.slots.refresh_each = order_spy
    with engine:
        for step in range(6):
            _forward_backward_beside_torch(case, ref, ref_opt, engine, step)
            calls = _spy_h2d(rt) if step >= 2 else None
            issued_order.clear()
            opt.step()
            opt.zero_grad()
            if calls is None:
                continue
            rt.ctx.backend.h2d = type(rt.ctx.backend).h2d.__get__(rt.ctx.backend)  # the spy off
            n = len(rt.slots.buckets)
            assert len(issued_order) == 1 and sorted(issued_order[0]) == list(range(n)), (step, issued_order)
            assert [owner for owner, _, _, _ in calls] == [[b] for b in issued_order[0]], step
            for owner, waits, boundary, update in calls:
                assert update is not None, (step, owner)  # every bucket was updated this step
                assert len(waits) == 2 and waits[0] is boundary and waits[1] is update, (step, owner, waits)
        _forward_backward_beside_torch(case, ref, ref_opt, engine, 6)
        assert rt.ctx.stats["fast_steps"] >= 3


def test_a_bucket_still_in_flight_lands_before_its_next_refresh_copy():
    """``refresh_each`` on a bucket whose previous copy was issued and not landed: it lands it first (``need``,
    which waits for that copy), and only then issues the new one; a bucket that is not on the device is
    refused (an invariant), before any copy."""
    case, ref, ref_opt, opt, engine = _all_resident_mlp()
    rt = engine._runtime
    slots = rt.slots
    with engine:
        for step in range(3):
            _forward_backward_beside_torch(case, ref, ref_opt, engine, step)
            opt.step()
            opt.zero_grad()
        rt.ctx.backend.synchronize()
        b = 1
        slots.copy_in(b, slots.slot[b], [slots.boundary])  # a refresh in flight, its parameters unbound
        assert slots.state[b] is Residency.IN_FLIGHT
        first = slots.h2d_event[b]
        seen = []

        def need(x):
            seen.append((x, slots.state[x], slots.h2d_event[x] is first))
            rt.executor.need(x)

        issued: set[int] = set()
        slots.refresh_each([b], False, need, issued)
        assert seen == [(b, Residency.IN_FLIGHT, True)]  # landed first, the first copy's event
        assert issued == {b} and slots.state[b] is Residency.IN_FLIGHT and slots.h2d_event[b] is not first
        rt.executor.need(b)
        want = slots.hosted().source(b)
        for p, off in zip(slots.buckets[b].params, slots.buckets[b].offsets):
            param = rt.ctx.params[p]
            assert torch.equal(param.detach().reshape(-1), want[off: off + param.numel()])
        slots.release(b)  # not on the device now: refused, nothing issued
        with pytest.raises(InvariantError, match="not on the device"):
            slots.refresh_each([b], False, need, issued)
