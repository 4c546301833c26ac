"""The baseline policies on a real model shape traced on the meta device, and the meta trace itself."""

import pytest
import torch

from offload.planning.buckets import make_buckets
from offload.planning.hw import PRESETS
from offload.tools.baselines import POLICIES, Case
from offload.tools.metatrace import trace_meta
from offload.tools.presets import MODELS, Shape, preset_inputs


@pytest.fixture(scope="module")
def small():
    shape = Shape("gpt2", 512, 64, 128, 4, 4, 512)
    mt = trace_meta(shape.build(dtype=torch.bfloat16), preset_inputs(shape, 2, 64), PRESETS["pcie4"])
    buckets = make_buckets(list(mt.specs), list(mt.order), 64 << 10, 2)
    return mt, buckets


def test_meta_trace_matches_the_model(small):
    mt, buckets = small
    assert mt.trace.complete and mt.trace.activation_peak_bytes > 0
    assert mt.flops > 6 * mt.numel * 2 * 64 * 0.9  # ~6 FLOPs per parameter per token
    assert len(mt.compute_s(PRESETS["pcie5"])) == len(mt.trace.events)
    assert sum(mt.compute_s(PRESETS["pcie5"])) < sum(mt.compute_s(PRESETS["pcie3"]))


def test_gpt2_xl_has_its_parameter_count():
    n = sum(p.numel() for p in MODELS["gpt2-xl"].build().parameters())
    assert abs(n - 1.558e9) / 1.558e9 < 0.01


def test_policies_run_and_keep_their_promises(small):
    mt, buckets = small
    params = sum(b.nbytes(2) for b in buckets)
    extra = mt.trace.activation_peak_bytes + mt.trace.max_grad_bytes
    case = Case(mt.trace, buckets, 2, PRESETS["pcie4"], mt.compute_s(PRESETS["pcie4"]), extra + params // 4)
    results = {name: policy(case) for name, policy in POLICIES.items()}
    assert results["zero-offload"].peak_bytes >= params + extra  # everything on the device: does not fit
    assert not results["zero-offload"].fits
    assert results["greedy"].fits and results["greedy"].peak_bytes <= case.budget_bytes
    for r in results.values():
        assert r.sim.step_s >= r.sim.compute_s
        assert r.sim.h2d_bytes > 0
    # streaming everything with double buffering is one of the plans the greedy scheduler considers
    if results["double-buffer"].fits:
        assert results["greedy"].step_s <= results["double-buffer"].step_s * (1 + 1e-9)
    # Gemini evicts to stay inside the budget (its chunks hold their own grads)
    assert results["gemini-cpu"].peak_bytes <= case.budget_bytes + max(b.nbytes(2) for b in buckets)
