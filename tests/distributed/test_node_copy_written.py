"""[Note: one host copy per node]: what ranks that share the host copy read of it must be every rank's writes,
whole: weights written outside a step (``load_state_dict``; ``DataParallel.copy_written``; tests/MUTATIONS.md, N3),
and a bucket read late inside a backward (a step off its plan holds its updates until that backward ended, so
the read is torch's, from before the update, on every rank; N6 in tests/MUTATIONS.md)."""

import torch

from tests.distributed.workers import Case, reference, run_ranks


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


def test_a_bucket_read_inside_the_backward_that_updated_it_is_every_ranks_update(tmp_path):
    """In the last step every rank's forward also reads the middle layer's weight detached, after the first layer (a
    read its plan did not foresee: the step departs in forward and finishes on demand). The budget streams, so
    backward fetches that bucket again for that read, after the bucket's grads were complete. Torch's backward
    reads the weight from before the step's update, and so must every rank: a departed step holds every update
    to the end of its backward ([Note: a departed step's updates wait] in runtime/device_optim.py), so no rank
    has written its shard of the node's shared copy by then. Rank 1's updates lag 50 ms. What each rank reads is
    plain torch's read bit for bit (two ranks, fp32), every layer trains as torch's, and no read forced the check
    of the shared copy inside that backward (there is nothing written to check: ``copy_checks_early`` 0).

    (Before, the departed step's updates were not held: each rank read the weight after that step's update, and
    the check before the read (N6) only made every rank read the same updated weights; a bucket copied in inside
    the backward that updated it is now refused, loudly: tests/runtime/test_off_plan_late_read.py.)"""
    case = Case(world=2, steps=3, extra={"share_host_copy": True, "late_read_step": 2, "budget": "20KiB",
                                         "slow_update_rank": 1})
    results = _ok(run_ranks(case, tmp_path))
    ref = reference(case, emulate_ranks=True)
    want = ref["weights"]
    before = reference(Case(world=2, steps=2), emulate_ranks=True)["weights"]["2.weight"]  # before step 2's update
    for r in results:
        assert r["host_shared_bytes"] > 0
        (read,) = r["late_reads"]
        torch_read = ref["late_reads"][r["rank"]]
        assert torch.equal(read, torch_read), (r["rank"], (read - torch_read).abs().max())
        assert torch.equal(read, before) and not torch.equal(read, want["2.weight"]), r["rank"]
        for k in want:
            assert torch.equal(r["weights"][k], want[k]), (r["rank"], k)
        c = r["counters"]  # the case is exercised: the step departed; nothing was written before the read
        assert c["plan_departures"] == 1 and c["copy_checks_early"] == 0, c
