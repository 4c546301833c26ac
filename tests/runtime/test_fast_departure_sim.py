"""A fast step that departs, on the simulated GPU (tests/MUTATIONS.md, R18): ``leave_keeping_weights`` moves the
grads gathered in plan buffers out while copies may still be in flight. test_fast_path.py's departures run on
the CPU backend only, and its simulated-GPU test never departs."""

import pytest

from tests.runtime.test_fast_path import Gated, _counters, _pair, _train_gated_alike
from tests.support.fake_cuda import simulated_gpu  # noqa: F401 (a fixture)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "deferred"])
def test_a_fast_step_departs_on_the_simulated_gpu(simulated_gpu, overlap):
    """Buckets of several layers, a branch skipped now and then: fast steps depart in backward with grads
    waiting; no race on the simulated GPU, and the losses and weights are plain torch's, bit for bit."""
    made = simulated_gpu()
    engine, opt, ref, ref_opt = _pair(Gated(), bucket_frac=0.3, overlap_optimizer=overlap)
    try:
        _train_gated_alike(engine, opt, ref, ref_opt, [True, True, True, False, True, True, False, True])
        c = _counters(engine)
        assert c["fast_steps"] >= 3 and c["plan_departures"] >= 1, c  # the path under test ran
        assert made and made[0]._api.copies > 0  # on the simulated GPU
    finally:
        engine.close()
