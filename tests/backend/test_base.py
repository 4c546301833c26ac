"""The shared backend pieces (offload/backend/base.py): a lane runs work in order and refuses work once closed."""

import pytest

from offload.backend.base import Lane
from offload.errors import EngineClosedError


def test_a_closed_lane_refuses_work():
    lane = Lane("offload-test")
    ran = []
    lane.submit(lambda: ran.append(1)).synchronize()
    lane.close()
    assert ran == [1] and not lane.alive
    with pytest.raises(EngineClosedError, match="lane offload-test is closed"):
        lane.submit(lambda: ran.append(2))
    assert ran == [1]


def test_a_host_event_blocks_until_its_lane_sets_it_and_carries_the_failure():
    """``HostEvent`` (a lock held until ``set``): ``synchronize`` waits for work still running on the lane,
    every waiter gets through once it is set, and a failure travels to each of them."""
    import threading

    from offload.backend.base import DONE, HostEvent
    from offload.errors import OffloadError

    assert DONE.query()
    DONE.synchronize()
    gate = threading.Event()
    seen: list[str] = []
    lane = Lane("test-event")
    try:
        ev = lane.submit(lambda: (gate.wait(), seen.append("ran")))
        assert not ev.query()
        waiters = [threading.Thread(target=lambda: (ev.synchronize(), seen.append("waited"))) for _ in range(3)]
        for t in waiters:
            t.start()
        waiters[0].join(0.2)
        assert seen == [] and not ev.query()  # still blocked: the work has not run
        gate.set()
        for t in waiters:
            t.join(10)
        assert seen == ["ran", "waited", "waited", "waited"] and ev.query()
        failed = lane.submit(lambda: 1 / 0, what="the division")
        for _ in range(2):  # raised to every caller, every time
            with pytest.raises(OffloadError, match="the division failed: ZeroDivisionError"):
                failed.synchronize()
        own = HostEvent(what="x")
        own.set()
        own.set()  # a second set() is harmless
        own.synchronize()
    finally:
        gate.set()  # a failed assertion must not leave the lane blocked (close() joins it)
        lane.close()


def test_a_deferred_event_is_done_after_its_lane_item_and_the_device_work_it_issued():
    """Issue 20 ([Note: weights gathered on the device]): a lane item issues device work and puts its event in
    the cell; the Deferred waits for both, carries the item's failure, and is never set by hand."""
    import threading

    from offload.backend.base import Deferred, HostEvent
    from offload.errors import InvariantError, OffloadError

    lane = Lane("deferred-test")
    gate, device = threading.Event(), HostEvent(what="device work")
    cell: list = []
    issued = lane.submit(lambda: (gate.wait(5), cell.append(device)))
    ev = Deferred(issued, cell)
    assert not ev.query()
    gate.set()
    issued.synchronize()
    assert not ev.query()  # issued, the device work not done
    device.set()
    ev.synchronize()
    assert ev.query()
    with pytest.raises(InvariantError):
        ev.set()
    failed = Deferred(lane.submit(lambda: 1 / 0, what="issue"), [])
    with pytest.raises(OffloadError, match="ZeroDivisionError"):
        failed.synchronize()
    assert not failed.query()
    lane.close()


class _DeviceEvent:
    """A device event as a lane sees one (not a HostEvent): counts the calls that would release the GIL."""

    def __init__(self, done: bool) -> None:
        self.done, self.synchronized = done, 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized += 1
        self.done = True


def test_a_lane_item_synchronizes_only_device_events_not_yet_complete():
    """[Note: the cost of a lane item]: a complete device event is not synchronized (on CUDA that would release
    and retake the GIL for nothing); one not complete is, before the item runs; host events always are (their
    failure travels with them)."""
    from offload.backend.base import HostEvent
    from offload.errors import OffloadError

    complete, running = _DeviceEvent(done=True), _DeviceEvent(done=False)
    order: list[str] = []
    lane = Lane("test-waits")
    try:
        lane.submit(lambda: order.append(f"ran after {running.synchronized}"), [complete, running]).synchronize()
        assert order == ["ran after 1"] and complete.synchronized == 0 and running.synchronized == 1
        failed = HostEvent(what="a copy")
        failed.set(RuntimeError("boom"))
        item = lane.submit(lambda: order.append("must not run"), [complete, failed])
        with pytest.raises(OffloadError, match="boom"):
            item.synchronize()
        assert order == ["ran after 1"]
    finally:
        lane.close()


@pytest.mark.intra_op_threads  # [Note: the suite's intra-op threads] in tests/conftest.py
def test_the_lane_thread_runs_items_with_grad_mode_off_entering_no_context_per_item(monkeypatch):
    """[Note: the cost of a lane item]: grad mode is off on the lane's thread for its life; an item does not
    enter ``torch.no_grad()`` (~5 us each). The calling thread's grad mode is its own."""
    import torch

    entered = []
    real = torch.no_grad

    class Counting(real):
        def __enter__(self):
            entered.append(1)
            return super().__enter__()

    seen = []
    lane = Lane("test-grad-mode")
    try:
        lane.submit(lambda: None).synchronize()  # the thread exists before no_grad is counted
        monkeypatch.setattr(torch, "no_grad", Counting)
        for _ in range(5):
            lane.submit(lambda: seen.append(torch.is_grad_enabled()))
        lane.drain()
    finally:
        lane.close()
    assert seen == [False] * 5 and entered == [] and torch.is_grad_enabled()
