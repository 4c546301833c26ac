"""[Note: the refresh pipelined] (offload/runtime/executor.py), what each copy waits for, seen at the backend: on a
fast step (all resident) ``step()`` asks the backend for one host-to-device copy per bucket, each after the compute
issued before it (``SlotTable.boundary``: the slot it writes is read by that compute) and after its own bucket's
update (``adam_event``: the host bytes it reads are that update's output), and the forwards that read the refreshed
slots are plain torch's, bit for bit. On the CPU backend as on the simulated GPU. Session 25 (issue 17, the hot path)
pins this before and after any change to how the refresh is issued (tests/MUTATIONS.md: R14, R20 break it)."""

import pytest

from tests.runtime.test_refresh_pipelined import _all_resident_mlp, _forward_backward_beside_torch
from tests.support.fake_cuda import simulated_gpu  # noqa: F401 (a fixture)


def _spy_h2d(rt) -> list:
    """Record every host-to-device copy asked of the backend: (the buckets whose slot view it writes, its waits, the
    slot table's boundary and that bucket's update event when it was asked)."""
    calls, backend, slots = [], rt.ctx.backend, rt.slots
    h2d = backend.h2d

    def spy(dst, src, waits=()):
        waits = list(waits)
        owner = [b for b, hit in slots._dst.items() if hit[1].data_ptr() == dst.data_ptr()]
        calls.append((owner, waits, slots.boundary, slots.adam_event.get(owner[0]) if len(owner) == 1 else None))
        return h2d(dst, src, waits)

    backend.h2d = spy  # the slot table reads the backend's h2d at each copy
    return calls


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu_backend", "simulated_gpu"])
def test_each_refresh_copy_waits_for_compute_and_its_own_update(simulated_gpu, gpu):
    if gpu:
        simulated_gpu()
    case, ref, ref_opt, opt, engine = _all_resident_mlp()
    rt = engine._runtime
    with engine:
        for step in range(6):
            _forward_backward_beside_torch(case, ref, ref_opt, engine, step)
            calls = _spy_h2d(rt) if step >= 2 else None  # from the third step on: a plan, fast steps
            opt.step()
            opt.zero_grad()
            if calls is None:
                continue
            del rt.ctx.backend.h2d  # the spy off
            n = len(rt.slots.buckets)
            assert sorted(b for owner, _, _, _ in calls for b in owner) == list(range(n)), (step, calls)
            for owner, waits, boundary, update in calls:
                assert len(owner) == 1 and update is not None, (step, owner)  # one bucket, updated this step
                assert len(waits) == 2 and waits[0] is boundary and waits[1] is update, (step, owner, waits)
        _forward_backward_beside_torch(case, ref, ref_opt, engine, 6)  # the last refresh, read
        assert rt.ctx.stats["fast_steps"] >= 3
