"""The simulated GPU's own rules (tests/support/fake_cuda.py), one by one, and backends broken on purpose that it must
catch. What it shows of the runtime and the CUDA defects of issue 21 is in test_sim_strict.py."""

import pytest
import torch

import offload
from offload.backend import DONE, CUDABackend
from tests.support.fake_cuda import FakeCuda, SimulatedRace, simulated_gpu  # noqa: F401 (a fixture)
from tests.support.loops import train_streamed
from tests.support.models import CASES


def _backend(sim=None):
    sim = sim or FakeCuda()
    return CUDABackend(sim.device, api=sim), sim


# -- the simulation's rules ---------------------------------------------------------------------------------


def test_a_copy_not_ordered_after_the_compute_that_wrote_its_source_is_a_race():
    """Compute may run behind the host: a D2H must wait for an event recorded after the compute it reads."""
    backend, sim = _backend()
    with sim:
        slot = backend.empty(16).view(torch.float32)
        slot.copy_(torch.arange(4.0))  # compute writes the slot
        host = torch.zeros(4)
        event = backend.d2h(host, slot, [backend.record()])  # ordered: fine
        event.synchronize()
        assert torch.equal(host, torch.arange(4.0))
        slot.add_(1)
        with pytest.raises(SimulatedRace, match="D2H.*not ordered after.*add"):
            backend.d2h(host, slot, [DONE])  # what a record() that does not capture compute gives


def test_a_copy_into_memory_compute_still_reads_is_a_race():
    backend, sim = _backend()
    with sim:
        slot = backend.empty(16).view(torch.float32)
        backend.wait(backend.h2d(slot, torch.ones(4)))
        out = slot * 2  # compute reads the slot
        with pytest.raises(SimulatedRace, match="H2D.*write.*not ordered after.*mul"):
            backend.h2d(slot, torch.zeros(4))  # no event from compute: it may overwrite before the read
        done = backend.record()
        backend.h2d(slot, torch.zeros(4), [done])  # after the read: fine
    assert torch.equal(out, torch.full((4,), 2.0))


def test_compute_reading_a_copy_it_did_not_wait_for_is_a_race():
    backend, sim = _backend()
    with sim:
        slot = backend.empty(16).view(torch.float32)
        backend.h2d(slot, torch.ones(4))
        with pytest.raises(SimulatedRace, match="compute.*read.*not ordered after the copy H2D"):
            slot.sum()


def test_a_compute_event_is_not_complete_until_the_host_waits_for_it():
    backend, sim = _backend()
    with sim:
        backend.empty(16).fill_(1)
        event = backend.record()
        assert not event.query()
        event.synchronize()
        assert event.query()


def test_freeing_device_memory_before_its_copy_is_known_done_is_a_race():
    backend, sim = _backend()
    with sim:
        slot = backend.empty(16).view(torch.float32)
        slot.fill_(3.0)
        host = torch.zeros(4)
        backend.d2h(host, slot, [backend.record()])
        del slot  # the allocator gets it back while the copy may still read it
        assert any("freed before" in r for r in sim.races)
        backend.synchronize()  # the copy runs on freed memory: another race
        assert any("ran on device memory that was freed" in r for r in sim.races)
        sim.races.clear()
        slot = backend.empty(16).view(torch.float32)
        slot.fill_(3.0)
        event = backend.d2h(host, slot, [backend.record()])
        event.synchronize()
        del slot  # known complete: fine
        assert sim.races == []


def test_a_host_writer_that_does_not_wait_for_the_h2d_reading_its_source_is_caught():
    backend, sim = _backend()
    src = torch.ones(4)
    with sim:
        slot = backend.empty(16).view(torch.float32)
        event = backend.h2d(slot, src)
        src.fill_(5.0)  # e.g. AdamW rewriting the low-precision copy before the H2D ran
        backend.wait(event)
        assert torch.equal(slot, torch.ones(4))  # read when enqueued: the earliest a GPU could
    assert any("host source" in r for r in sim.races)


def test_a_host_reader_that_does_not_wait_for_the_d2h_reads_nan():
    backend, sim = _backend()
    with sim:
        slot = backend.empty(16).view(torch.float32)
        slot.fill_(2.0)
        host = torch.zeros(4)
        event = backend.d2h(host, slot, [backend.record()])
        assert torch.isnan(host).all()  # in flux until the event: a reader that does not wait gets NaN
        event.synchronize()
        assert torch.equal(host, torch.full((4,), 2.0))


def test_a_device_change_drops_a_live_grad_accumulator_as_on_cuda():
    """A weight used twice with its .data moved to the host and back between the uses gets two accumulators
    (two post-accumulate-grad hooks), as PyTorch's set_data does on CUDA; a move between device tensors does
    not."""
    backend, sim = _backend()
    host = torch.randn(3)
    for between, hooks in (("host", 2), ("device", 1)):
        w = torch.nn.Parameter(host.clone())
        fired = []
        w.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
        first = backend.empty(12).view(torch.float32).copy_(host)
        second = backend.empty(12).view(torch.float32).copy_(host)
        backend.bind(w, first)
        a = (w * 2).sum()
        backend.bind(w, host.clone() if between == "host" else second)
        backend.bind(w, second)
        b = (w * 3).sum()
        (a + b).backward()
        assert len(fired) == hooks, between


# -- backends broken on purpose ---------------------------------------------------------------------------


class RecordIsDone(CUDABackend):
    """record() does not capture compute (a completed event)."""

    def record(self):
        return DONE


class NoDeviceWaitsOnCopies(CUDABackend):
    """A copy waits only for host events: compute and other copies are not waited for."""

    def _copy(self, stream, dst, src, waits):
        from offload.backend import HostEvent
        return super()._copy(stream, dst, src, [w for w in waits if isinstance(w, HostEvent)])


class NoComputeWait(CUDABackend):
    """Compute does not wait for copies."""

    def wait(self, event):
        from offload.backend import HostEvent
        if isinstance(event, HostEvent):
            event.synchronize()


@pytest.mark.parametrize("broken", [RecordIsDone, NoDeviceWaitsOnCopies, NoComputeWait])
def test_the_simulation_catches_a_backend_that_gets_ordering_wrong(simulated_gpu, broken):
    made = simulated_gpu(broken)
    with pytest.raises((SimulatedRace, offload.OffloadError)):
        train_streamed(CASES["mlp"](), 3)
    assert made[0]._api.races
    made[0]._api.races.clear()  # seen: the fixture would fail the test on them


def test_fresh_device_memory_may_still_be_in_use_by_its_stream():
    """The caching allocator hands out a block that queued work of its stream may still use: another stream
    writes it only after waiting for that stream (what CUDABackend.empty() makes the H2D stream do)."""
    backend, sim = _backend()
    with sim:
        side = sim.new_stream()
        fresh = sim.empty(16).view(torch.float32)
        with pytest.raises(SimulatedRace, match="allocation"):
            sim.copy(side, fresh, torch.ones(4))
        fresh = backend.empty(16).view(torch.float32)
        backend.wait(backend.h2d(fresh, torch.ones(4)))  # empty() orders the H2D stream after compute: fine
