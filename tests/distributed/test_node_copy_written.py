"""[Note: one host copy per node]: weights written outside a step (``load_state_dict``) on ranks that share the
host copy must all be in before any rank reads it (``DataParallel.copy_written``; tests/MUTATIONS.md, N3)."""

import torch

from tests.distributed.workers import Case, run_ranks


def _ok(results):
    for r in results:
        assert "error" not in r and not r.get("hung") and "exitcode" not in r, r
    return results


def test_a_load_between_steps_is_seen_whole_by_every_rank(tmp_path):
    """Two ranks share the node's copy; after the first step both load the same halved weights, rank 1's writes
    of its shards slowed (20 ms each); then the same no-grad forward on both: the same output, from the
    halved weights (not the ones before the load)."""
    case = Case(world=2, steps=2, extra={"share_host_copy": True, "load_between_steps": True})
    results = _ok(run_ranks(case, tmp_path))
    assert all(r["host_shared_bytes"] > 0 for r in results)
    got0, got1 = (r["after_load"] for r in results)
    assert torch.equal(got0, got1), (got0 - got1).abs().max()
