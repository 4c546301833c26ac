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
