"""Data parallel over gloo (issue 20): N spawned ranks with per-rank batches against one process.

Each test spawns its ranks (tests/distributed/workers.py), every wait bounded by a timeout. Numerics:
two ranks in fp32 through ``offload.AdamW(fused=False)`` are bit for bit plain PyTorch fed the same summed
grads (two addends sum the same in either order); four ranks are compared with a tolerance (gloo's order
of summation is its own), as is the concatenated batch (one process's grads of the whole batch are summed
in another order than the ranks' per-slice grads).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.workers import Case, run_ranks, reference

# the concatenated batch vs per-rank slices: the same maths, grads summed in another order; Adam (lr 1e-2,
# 3 steps) moves each weight by ~3e-2, and a last-bit difference of a grad moves it by far less than this
CONCAT_ATOL = 1e-5


def _ok(results: list[dict]) -> list[dict]:
    for r in results:
        assert not r.get("hung"), f"rank {r['rank']} hung"
        assert "error" not in r, f"rank {r['rank']}: {r.get('traceback', r['error'])}"
    return results


def _assert_weights(got: dict, want: dict, atol: float = 0.0) -> None:
    assert got.keys() == want.keys()
    for k in want:
        if atol == 0.0:
            assert torch.equal(got[k], want[k]), f"{k}: max |diff| {(got[k] - want[k]).abs().max():.3g}"
        else:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=atol, msg=k)


def test_two_ranks_equal_one_process(tmp_path):
    case = Case(world=2)
    results = _ok(run_ranks(case, tmp_path))
    exact = reference(case, emulate_ranks=True)
    concat = reference(case, emulate_ranks=False)
    for r in results:
        _assert_weights(r["weights"], exact["weights"])  # bit for bit
        _assert_weights(r["after_close"], exact["weights"])  # close() gives every rank the whole fp32 model
        _assert_weights(r["weights"], concat["weights"], CONCAT_ATOL)
