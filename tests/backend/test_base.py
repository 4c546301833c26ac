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
