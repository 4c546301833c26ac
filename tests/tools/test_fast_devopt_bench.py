"""benchmarks/fast_devopt.py in its smoke mode: both engines measured and recorded, the old rule's engine on the
full path and the other on fast steps, the same device updates in both (not the figures)."""

from __future__ import annotations

import json

import fast_devopt  # benchmarks/ is on sys.path (pyproject's pytest `pythonpath`)
import pytest

import offload.planning.trace
from offload.runtime import fast_path
from tests.runtime.test_device_optimizer import _SteadyClock


def test_fast_devopt_smoke(tmp_path, monkeypatch):
    # Both engines plan from their traced compute times; under load those differed enough to give them other
    # placements (seen once). A steady clock (10 us a reading, as test_device_optimizer.py's demotion test)
    # plans both alike, with device-optimizer buckets.
    monkeypatch.setattr(offload.planning.trace, "time", _SteadyClock(1e-5))
    path = tmp_path / "fast-devopt.json"
    kept = fast_path._WHOLE_STEP
    assert fast_devopt.main(["--smoke", "--models", "mlp", "--budgets", "8", "--json", str(path)]) == 0
    assert fast_path._WHOLE_STEP == kept  # the old rule was put back
    data = json.loads(path.read_text())
    assert data["smoke"] and len(data["machine"]["load_average"]) == 3
    (case,) = data["cases"]
    assert case["placement"] == case["placement_full"]
    assert "streamed" not in case["placement"] and case["placement"].get("device-optimizer", 0) > 0, case
    timed = case["blocks"] * case["steps_per_block"]
    full, fast = case["full_counters_timed"], case["fast_counters_timed"]
    assert full["fast_steps"] == 0 and fast["fast_steps"] == timed, case
    assert full["device_updates"] == fast["device_updates"] > 0
    assert full["plan_departures"] == fast["plan_departures"] == 0
    assert case["fast_over_full"] == pytest.approx(case["fast_ms"] / case["full_ms"], rel=1e-3)
