"""Data parallel over gloo (issue 20): N spawned ranks with per-rank batches against one process.

Each test spawns its ranks (tests/distributed/workers.py), every wait bounded by a timeout. Numerics:
two ranks in fp32 through ``offload.AdamW(fused=False)`` are bit for bit plain PyTorch fed the same summed
grads (two addends sum the same in either order); four ranks are compared with a tolerance (gloo's order
of summation is its own), as is the concatenated batch (one process's grads of the whole batch are summed
in another order than the ranks' per-slice grads).
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

import offload
from offload.tools import cli
from tests.distributed.workers import Case, batch, make_model, reference, run_ranks

# the concatenated batch vs per-rank slices: the same maths, grads summed in another order; Adam (lr 1e-2,
# 3 steps) moves each weight by ~3e-2, and a last-bit difference of a grad moves it by far less than this
CONCAT_ATOL = 1e-5


def _ok(results: list[dict]) -> list[dict]:
    for r in results:
        assert not r.get("hung"), f"rank {r['rank']} hung"
        assert "exitcode" not in r, f"rank {r['rank']} exited ({r['exitcode']}) without a result"
        assert "error" not in r, f"rank {r['rank']}: {r.get('traceback', r['error'])}"
    return results


def _assert_host_bytes(r: dict, world: int, accumulate: bool, shared: bool = True) -> None:
    """[Note: host shards] (fp32): every rank keeps the grad the device-to-host copy lands in (padded to a
    multiple of the ranks), and 1/N of Adam m and v and of the summed grad; with accumulation also the staging
    copy. The whole fp32 copy (the weights themselves) is the node's, shared by its ranks ([Note: one host copy
    per node]: all ranks here run on one host), or, with ``shared=False``, each rank's own in its arena.
    Checked against that count made by hand from the buckets, up to the 64-byte alignment of each region, and
    against the unsharded host state."""
    expected, regions, copy = 0, 0, 0
    for numel, trainable in r["buckets"]:
        c = -(-trainable // world)
        c = -(-c // 16) * 16  # shards start 16-element aligned
        expected += c * world * 4 + c * 4 + 2 * c * 4  # grad, grad shard, m, v
        copy += -(-numel * 4 // 64) * 64
        expected += trainable * 4 if accumulate else 0
        regions += 7
    if shared:
        assert r["host_shared_bytes"] == copy, (r["host_shared_bytes"], copy)
    else:
        assert r["host_shared_bytes"] == 0
        expected += copy
    assert expected <= r["host_bytes"] <= expected + 64 * regions, (world, r["host_bytes"], expected)
    unsharded = sum((20 if accumulate else 16) * numel for numel, _ in r["buckets"])  # master, grad, m, v (+ staging)
    assert r["host_bytes"] < unsharded


def _assert_report_host_bytes(results: list[dict], dtype: str, grad_reduce: str = "host") -> None:
    """``offload report --gpus N --grad-reduce ...`` for the ranks' model, bucket size and grad path (the CPU
    backend's default is the host's), with the ranks' host copy (shared by the node, or each rank's): its
    per-rank host bytes are the arena each rank allocated, and its per-node bytes (one node) their sum and the
    shared copy, once."""
    shared = results[0]["host_shared_bytes"]
    world = len(results)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["report", "--model", "tests.distributed.workers:report_model", "--budget", "64MiB", "--batch",
                       "4", "--seq", "1", "--dtype", dtype, "--bucket-bytes", "4KiB", "--host-ram", "1GiB",
                       "--gpus", str(world), "--grad-reduce", grad_reduce, "--share-host-copy",
                       "yes" if shared else "no", "--json"])
    assert rc == 0
    dp = json.loads(out.getvalue())["data_parallel"]
    assert [r["host_bytes"] for r in results] == [dp["host_bytes_per_rank"]] * world
    assert [r["host_shared_bytes"] for r in results] == [dp["host_shared_bytes_per_node"]] * world
    assert dp["host_bytes_per_node"] == sum(r["host_bytes"] for r in results) + shared


def _assert_copy_checks(r: dict, steps: int) -> None:
    """[Note: the shared copy checked once per backward] (runtime/node_share.py): with the node's shared copy,
    one check per step that updated (at the end of its backward, or in step()), none forced by a read; none
    without it."""
    c = r["counters"]
    assert (c["copy_checks"], c["copy_checks_early"]) == ((steps if r["host_shared_bytes"] else 0), 0), c


def _assert_weights(got: dict, want: dict, atol: float = 0.0) -> None:
    assert got.keys() == want.keys()
    for k in want:
        if atol == 0.0:
            assert torch.equal(got[k], want[k]), f"{k}: max |diff| {(got[k] - want[k]).abs().max():.3g}"
        else:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=atol, msg=k)


def _assert_checkpoint(path, weights: dict, optimizer: dict) -> dict:
    """The file ``Engine.save`` wrote holds these weights and this torch AdamW state, bit for bit."""
    ck = torch.load(path, weights_only=True)
    _assert_weights(ck["model"], weights)
    for i, state in optimizer.items():
        for k, v in state.items():
            assert torch.equal(ck["optimizer"]["state"][i][k].reshape(v.shape), v), (i, k)
    return ck


def _resume_in_one_process(path, case: Case) -> dict:
    """Load a checkpoint written by N ranks into one process (no group) and train on."""
    model = make_model()
    opt = offload.AdamW(model.parameters(), lr=case.lr, weight_decay=0.1, fused=False)
    engine = offload.wrap(model, opt, budget="64MiB", device="cpu", bucket_bytes="4KiB", process_group=False)
    engine.load(path)
    for step in range(case.start_step, case.start_step + case.steps):
        x, y = batch(step, 0)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    weights = engine.state_dict()["model"]
    engine.close()
    return weights


def test_two_ranks_equal_one_process(tmp_path):
    """Two ranks, each on its half of the batch, with chaos delays on every lane (collectives included: still
    bit for bit), then a checkpoint they save resumed in one process; ``offload report --gpus 2`` gives each
    rank's host arena bytes exactly; after close(), destroy_process_group() frees the group's gloo threads
    though the engine is still referenced."""
    case = Case(world=2, save=str(tmp_path / "ck.pt"), chaos=True, extra={"destroy_group": True})
    results = _ok(run_ranks(case, tmp_path))
    assert all(r["chaos_draws"] > 0 for r in results)
    assert all(r["gloo_threads_after_destroy"] == [] for r in results), [r["gloo_threads_after_destroy"]
                                                                          for r in results]
    exact = reference(case, emulate_ranks=True)
    concat = reference(case, emulate_ranks=False)
    for r in results:
        _assert_weights(r["weights"], exact["weights"])  # bit for bit
        _assert_weights(r["after_close"], exact["weights"])  # close() gives every rank the whole fp32 model
        _assert_weights(r["weights"], concat["weights"], CONCAT_ATOL)
        _assert_host_bytes(r, case.world, accumulate=False)
        _assert_copy_checks(r, case.steps)
    _assert_report_host_bytes(results, "fp32")
    # the ranks' shards of masters, m and v, gathered into one file: torch's AdamW state, bit for bit
    ck = _assert_checkpoint(case.save, exact["weights"], exact["optimizer"])
    resume = Case(world=1, start_step=case.steps, steps=1)
    _assert_weights(_resume_in_one_process(case.save, resume), reference(resume, False, start=ck)["weights"])


@pytest.mark.slow
def test_four_ranks_accumulate_and_clip(tmp_path):
    """Deferred updates: two micro-batches summed per rank with no communication, then the sum over ranks, the
    global norm (every rank clips by the same coefficient), the update of each shard."""
    case = Case(world=4, overlap=False, micro=2, clip=0.05)
    results = _ok(run_ranks(case, tmp_path))
    exact = reference(case, emulate_ranks=True)
    concat = reference(case, emulate_ranks=False)
    for r in results:
        # gloo sums four addends in its own order: within a few roundings of the rank-ordered sum
        _assert_weights(r["weights"], exact["weights"], 1e-6)
        _assert_weights(r["weights"], concat["weights"], CONCAT_ATOL)
        torch.testing.assert_close(r["norms"], exact["norms"], rtol=1e-5, atol=0)
        assert r["norms"][0] > case.clip  # the clip really scaled the grads
        _assert_weights(r["weights"], results[0]["weights"])  # every rank holds the same model, bit for bit
        _assert_host_bytes(r, case.world, accumulate=True)


@pytest.mark.slow
def test_float16_overflow_on_one_rank_skips_the_step_on_all(tmp_path):
    """Rank 1's grads overflow in the first step: every rank skips that step and halves its loss scale,
    and the ranks stay bit for bit the same model."""
    case = Case(world=2, dtype=torch.float16, overlap=False, inf_rank=1, steps=2, fused=True)
    results = _ok(run_ranks(case, tmp_path))
    for r in results:
        assert r["optimizer"]["skipped_steps"] == 1, r["optimizer"]
        assert not r["optimizer"]["last_step_skipped"]
        assert r["optimizer"]["loss_scale"] == results[0]["optimizer"]["loss_scale"]
        _assert_weights(r["weights"], results[0]["weights"])
    assert results[0]["weights"]["0.weight"].ne(make_model().state_dict()["0.weight"]).any()  # step 2 updated


def _assert_closed_after_fault(r: dict, local_weights: bool) -> None:
    """close() after the fault stopped every thread the engine started and freed its host arena; it raised
    only to say the module got the rank's 16-bit copy (the fp32 masters could no longer be gathered)."""
    assert {"offload-cpu-adam", "offload-d2h", "offload-h2d"} <= set(r["threads_before_close"]), r  # can fail
    assert r["threads_after_close"] == ["MainThread"], r
    assert r["host_after_close"], r
    if local_weights:
        assert "DistributedError" in r["close_error"] and "threads and memory released" in r["close_error"], r
    else:
        assert "close_error" not in r, r
    for name, (shape, dtype, finite) in r["params_after_close"].items():
        assert dtype == torch.float32 and finite, (name, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("overlap", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_rank_raising_in_backward_makes_every_rank_error(tmp_path, dtype, overlap):
    """Rank 1 raises in its second backward: it reports that error, and tells rank 0 through the check that
    precedes every sum ([Note: a fault named]); rank 0 fails with a DistributedError naming rank 1, at once
    (not after the group's 60 s timeout: the test's own timeout is 50 s), never a hang. Then close() on both
    releases every thread and the host arena (issue 20)."""
    case = Case(world=2, fail_rank=1, timeout_s=60.0, dtype=dtype, overlap=overlap,
                extra={"close_after_error": True})
    results = run_ranks(case, tmp_path, timeout_s=50.0)
    assert not any(r.get("hung") for r in results), results
    assert results[1]["error"] == "RuntimeError: injected fault in backward", results[1]
    # raised by step() (overlap: the lane's reduce-scatter) or the end of rank 0's backward (deferred: the
    # average of the grads), as the DistributedError itself
    assert results[0]["error"].startswith("DistributedError: rank 0 of 2: the backward raised on rank 1 "), results[0]
    for r in results:
        _assert_closed_after_fault(r, local_weights=dtype != torch.float32)


@pytest.mark.slow
def test_checkpoint_saved_by_four_ranks_resumes_on_two_and_on_one(tmp_path):
    """World-size independent checkpoints: 4 ranks save; 2 ranks load it (each keeps its shard of it: the
    state they gather back is the file's, bit for bit) and train on exactly as plain torch resumed from the
    file with the same per-rank grads; one process does the same with the whole batch."""
    path = str(tmp_path / "ck.pt")
    case = Case(world=4, steps=2, save=path)
    _ok(run_ranks(case, tmp_path / "save"))
    exact = reference(case, emulate_ranks=True)
    ck = torch.load(path, weights_only=True)
    _assert_weights(ck["model"], exact["weights"], 1e-6)  # four addends: gloo's order
    on_two = Case(world=2, load=path, start_step=2, steps=1)
    results = _ok(run_ranks(on_two, tmp_path / "load"))
    want = reference(on_two, emulate_ranks=True, start=ck)
    for r in results:
        _assert_weights(r["loaded"]["model"], ck["model"])
        for i, state in ck["optimizer"]["state"].items():
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(r["loaded"]["optimizer"]["state"][i][k], state[k]), (i, k)
        _assert_weights(r["weights"], want["weights"])  # two addends: bit for bit
    on_one = Case(world=1, start_step=2, steps=1)
    _assert_weights(_resume_in_one_process(path, on_one), reference(on_one, False, start=ck)["weights"])


def test_process_group_option():
    """``process_group``: None or False without a group is one process; anything but a group is refused."""
    for value in (True, "gloo", 1):
        with pytest.raises(TypeError, match="process_group must be None"):
            offload.OffloadConfig(budget="1MiB", process_group=value)
    model = make_model()
    engine = offload.wrap(model, offload.AdamW(model.parameters()), budget="64MiB", device="cpu")
    assert engine._runtime.ctx.dp is None  # torch.distributed is not initialised here
    engine.close()


@pytest.mark.slow
def test_bfloat16_overlapped_two_ranks(tmp_path):
    """bf16 compute with the default fused AdamW, updates overlapped with backward: grads reduce-scattered in
    bf16, each rank's fp32 master shard updated, the bf16 shards all-gathered. Every rank ends with the same
    model, bit for bit (fp32 masters gathered from both), near the fp32 reference: bf16 rounding flips the
    sign of Adam's step on a few near-zero grads (up to 2 lr apart, measured 0.02), so the bound is on the mean
    difference per tensor (measured ~1e-4), far below the mean distance each tensor moved (~2e-2)."""
    case = Case(world=2, dtype=torch.bfloat16, fused=True)
    results = _ok(run_ranks(case, tmp_path))
    want = reference(case, emulate_ranks=False)
    init = make_model().state_dict()
    for r in results:
        _assert_weights(r["weights"], results[0]["weights"])
        for k, w in want["weights"].items():
            assert (r["weights"][k] - w).abs().mean() < 1e-3 < (w - init[k]).abs().mean(), k


@pytest.mark.slow
def test_a_rank_hanging_in_backward_makes_the_other_error_within_the_timeout(tmp_path):
    """Rank 1 hangs midway through its second backward (then dies): rank 0 fails with a DistributedError
    once the group's 8 s timeout has passed (and the 5 s roll call after it), not after the hang ends, naming
    rank 1 as the one that did not say it saw the collective fail ([Note: a fault named]: the group's store)."""
    case = Case(world=2, hang_rank=1, timeout_s=8.0, extra={"close_after_error": True})
    results = run_ranks(case, tmp_path, timeout_s=90.0)
    assert "DistributedError" in results[0]["error"] and "rank 0 of 2" in results[0]["error"], results[0]
    assert "Rank 1 did not say it saw this collective fail" in results[0]["error"], results[0]
    _assert_closed_after_fault(results[0], local_weights=False)
    assert results[1].get("exitcode") == 3  # it hung, then exited without a result


@pytest.mark.parametrize("overlap", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_rank_dying_in_backward_is_named_by_the_other(tmp_path, overlap):
    """Rank 1 exits midway through its second backward: rank 0's next collective fails at once (gloo: the
    connection reset, naming an address only), well before the group's 60 s timeout (the test's is 50 s), and
    its DistributedError names rank 1 (it did not say it saw the collective fail: [Note: a fault named])."""
    case = Case(world=2, hang_rank=1, timeout_s=60.0, overlap=overlap,
                extra={"die": True, "close_after_error": True, "roll_call_s": 2.0})
    results = run_ranks(case, tmp_path, timeout_s=50.0)
    assert not any(r.get("hung") for r in results), results
    assert results[0]["error"].startswith("DistributedError: rank 0 of 2: "), results[0]
    assert "Rank 1 did not say it saw this collective fail within 2 s" in results[0]["error"], results[0]
    _assert_closed_after_fault(results[0], local_weights=False)
    assert results[1].get("exitcode") == 3


@pytest.mark.slow
def test_ranks_whose_grads_reach_other_buckets_fail_loudly(tmp_path):
    """Rank 1's second backward stops above the lower layers (a branch one rank takes): the ranks would sum
    different buckets' grads; they raise instead (never a silent mix, never a hang)."""
    case = Case(world=2, branch_rank=1, timeout_s=10.0)
    results = run_ranks(case, tmp_path, timeout_s=90.0)
    assert not any(r.get("hung") for r in results), results
    for r in results:
        assert "DistributedError" in r.get("error", ""), r


def test_device_optimizer_is_refused_under_data_parallel(monkeypatch):
    """A device-optimizer bucket is updated from this rank's own grads (no reduce-scatter on that path), so the
    combination is refused when a group is in use, and allowed without one."""
    from offload.runtime import context
    from offload.errors import DistributedError
    from offload.runtime.distributed import DataParallel

    cpu = torch.device("cpu")
    config = offload.OffloadConfig(budget="64MiB", device="cpu", device_optimizer=True)
    assert context._data_parallel(config, lane=None, device=cpu) is None  # no group: nothing to refuse
    monkeypatch.setattr(DataParallel, "resolve", classmethod(lambda cls, group, lane, device, share: object()))
    with pytest.raises(offload.OffloadError, match="device_optimizer=True is not supported with data parallel"):
        context._data_parallel(config, lane=None, device=cpu)
    assert context._data_parallel(offload.OffloadConfig(budget="64MiB", device="cpu"), lane=None,
                                  device=cpu) is not None


def test_torch_clip_grad_norm_on_p_grad_sees_the_average_over_ranks(tmp_path):
    """DDP's contract: after backward, ``p.grad`` is the average over the ranks. So plain
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` returns the same total norm on every rank (bit
    for bit: every rank holds the same averaged grads), equal to one process's on the concatenated batch
    (within 1e-5 relative: the same maths, grads summed in another order), and the clipped training matches
    plain torch (two micro-batches accumulated: the average is taken after each backward, and stays one)."""
    case = Case(world=2, overlap=False, micro=2, clip=0.05, extra={"torch_clip": True})
    results = _ok(run_ranks(case, tmp_path))
    exact = reference(case, emulate_ranks=True)
    concat = reference(case, emulate_ranks=False)
    assert exact["norms"][0] > case.clip  # the clip really scales the grads
    for r in results:
        assert r["norms"] == results[0]["norms"]  # the same on every rank
        assert r["grad_norms"] == results[0]["grad_norms"]  # p.grad.norm() too
        torch.testing.assert_close(r["norms"], concat["norms"], rtol=1e-5, atol=0)
        torch.testing.assert_close(r["norms"], exact["norms"], rtol=1e-6, atol=0)
        _assert_weights(r["weights"], results[0]["weights"])
        _assert_weights(r["weights"], exact["weights"], 1e-6)
        _assert_weights(r["weights"], concat["weights"], CONCAT_ATOL)
        _assert_copy_checks(r, case.steps)  # deferred: one in each step()


@pytest.mark.parametrize("others_sleep_s", [0.0, pytest.param(6.0, marks=pytest.mark.slow)])
def test_model_state_dict_on_rank_0_alone_fails_fast_and_names_the_way(tmp_path, others_sleep_s):
    """``if rank == 0: model.state_dict()`` with a 16-bit dtype (the fp32 masters are spread over the ranks):
    rank 0 raises at once if rank 1 already waits in its next collective, else once the join window (3 s here;
    the group's timeout is 60 s, the test's 50 s) has passed (rank 1 sleeping 6 s first), saying the call is
    collective and naming engine.save; rank 1, training on, fails at its next collective naming rank 0, never
    a hang. Both still close cleanly."""
    case = Case(world=2, dtype=torch.bfloat16, fused=True, timeout_s=60.0,
                extra={"rank0_state_dict": True, "join_window_s": 3.0, "close_after_error": True,
                       "others_sleep_s": others_sleep_s})
    results = run_ranks(case, tmp_path, timeout_s=50.0)
    assert not any(r.get("hung") for r in results), results
    r0, r1 = results
    assert r0["error"].startswith("DistributedError: rank 0 of 2: reading the fp32 weights"), r0
    assert "engine.save(path) on every rank" in r0["error"], r0
    # rank 1 may already wait in its next step's first collective (rank 0's read pairs with it at once), or
    # not yet (rank 0 waits out the window): either way far below the group's timeout
    assert r0["state_dict_s"] < 20.0, r0["state_dict_s"]
    if others_sleep_s:
        assert "did not join within 3 s" in r0["error"] and r0["state_dict_s"] >= 3.0, r0
    assert r1["error"].startswith("DistributedError: rank 1 of 2: rank 0 called a collective read of the "
                                  "weights alone"), r1
    for r in results:
        _assert_closed_after_fault(r, local_weights=True)


def test_model_state_dict_on_every_rank_is_the_fp32_model(tmp_path):
    """The supported form: every rank calls model.state_dict() (16-bit dtype: a collective read) and gets
    the whole fp32 model, the same on every rank as engine.state_dict()'s. ``offload report --gpus 2`` gives
    each rank's host arena bytes exactly (bf16: the fp32 master sharded)."""
    case = Case(world=2, dtype=torch.bfloat16, fused=True, steps=2, extra={"every_rank_state_dict": True})
    results = _ok(run_ranks(case, tmp_path))
    for r in results:
        _assert_weights(r["model_state_dict"], r["weights"])
        _assert_weights(r["model_state_dict"], results[0]["model_state_dict"])
    _assert_report_host_bytes(results, "bf16")


def _issued_inside_no_sync(step: int, micro: int) -> list[str]:
    """The collectives a micro-batch inside no_sync issues: none, but the very first forward (inside no_sync in
    these tests) makes the node's shared copy of the weights, once ([Note: one host copy per node]): its setup
    collectives (the host names, the files' names, the mappings, the check after the first writes)."""
    return ["_all_gather"] * 4 if (step, micro) == (0, 0) else []


def _micro_grads(step: int, micro: int, rank: int, case: Case) -> list[torch.Tensor]:
    """Plain torch's grads of one rank's micro-batch (the loss divided by the micro-batches, as the ranks do)."""
    model = make_model()
    x, y = (t[rank * (t.shape[0] // case.world): (rank + 1) * (t.shape[0] // case.world)] for t in batch(step, micro))
    (torch.nn.functional.mse_loss(model(x), y) / case.micro).backward()
    return [p.grad for p in model.parameters()]


def test_no_sync_accumulates_locally_and_reduces_the_sum_once(tmp_path):
    """DDP's no_sync ([Note: no_sync]): three micro-batches per step, the first two inside ``model.no_sync()``
    (rank 0) / ``engine.no_sync()`` (rank 1). Inside it no collective runs at all (every process-group call of
    the spawned ranks is counted), ``p.grad`` is the rank's own grad, and torch's ``clip_grad_norm_`` and
    ``p.grad.norm()`` raise rather than return a local norm (and scale nothing); the first forward (inside
    no_sync) makes the node's shared copy of the weights, once. The last backward averages
    the sum once; torch's clip on it then gives the global norm, and two ranks in fp32 are bit for bit plain
    torch adding each rank's micro-batches first, then the ranks (the order no_sync gives: without it the
    average is taken per micro-batch, test_torch_clip_grad_norm_on_p_grad_sees_the_average_over_ranks, within
    1e-6); one process on the concatenated batch within CONCAT_ATOL."""
    case = Case(world=2, overlap=False, micro=3, clip=0.05, steps=2, extra={"torch_clip": True, "no_sync": True})
    results = _ok(run_ranks(case, tmp_path))
    exact = reference(case, emulate_ranks=True)
    concat = reference(case, emulate_ranks=False)
    assert exact["norms"][0] > case.clip  # the clip really scales the grads
    for r in results:
        calls = r["collectives"]
        assert len(calls) == case.steps * case.micro
        for step, micro, local, issued in calls:
            assert local == (micro < case.micro - 1)
            if local:
                assert issued == _issued_inside_no_sync(step, micro), (step, micro, issued)
            else:
                assert "all_reduce" in issued, (step, micro, issued)  # the average of the whole sum, once
        for got, want in zip(r["local_grads"], _micro_grads(0, 0, r["rank"], case)):
            assert torch.equal(got, want)  # p.grad inside no_sync: this rank's own sum
        assert "inside engine.no_sync()" in r["clip_in_no_sync_error"], r
        assert "inside engine.no_sync()" in r["norm_in_no_sync_error"], r
        for got, want in zip(r["local_grads_after_clip"], r["local_grads"]):
            assert torch.equal(got, want)  # the refused clip scaled nothing
        assert r["norms"] == exact["norms"]  # the global norm, bit for bit
        _assert_weights(r["weights"], exact["weights"])  # bit for bit
        _assert_weights(r["weights"], concat["weights"], CONCAT_ATOL)


def test_no_sync_without_a_group_and_with_overlapped_updates():
    """One process: ``engine.no_sync()`` and the ``model.no_sync()`` the engine adds change nothing (the
    training is bit for bit the same as without), and close() takes ``model.no_sync`` away again."""
    def train(use: bool) -> dict:
        model = make_model()
        opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=False)
        engine = offload.wrap(model, opt, budget="64MiB", device="cpu", overlap_optimizer=False)
        assert callable(model.no_sync)
        for micro in range(2):
            x, y = batch(0, micro)
            with model.no_sync() if use and micro == 0 else engine.no_sync():
                engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        weights = engine.state_dict()["model"]
        engine.close()
        assert not hasattr(model, "no_sync")
        return weights

    _assert_weights(train(True), train(False))


def test_a_departure_on_one_rank_makes_every_rank_replan(tmp_path):
    """[Note: re-plans agreed]: rank 1's second step calls one more module (a data-dependent branch on that
    rank only), so it departs from its plan, and its third step, back on the old path, departs from the new
    one. Rank 0 never departs, yet re-plans at the same two steps (the flag all-gathered in step()): both
    ranks end with the same re-plan count and the same weights, bit for bit."""
    case = Case(world=2, steps=4, extra={"replan_rank": 1})
    results = _ok(run_ranks(case, tmp_path))
    r0, r1 = (r["counters"] for r in results)
    assert r1["plan_departures"] >= 1 and r0["plan_departures"] == 0, (r0, r1)
    assert r0["replans"] == r1["replans"] >= 1, (r0, r1)
    _assert_weights(results[0]["weights"], results[1]["weights"])
    for r in results:  # overlap_optimizer=True: no_sync() cannot hold the overlapped reduce-scatters back
        assert "overlap_optimizer=True" in r["no_sync_error"], r


@pytest.mark.slow
def test_a_plan_re_timed_on_every_rank_trains_like_one_process(tmp_path):
    """[Note: timing compute] under data parallel: each rank times its first planned step and, any difference
    counting (``RETIME_BEYOND`` 0), plans again; the re-plans are agreed, and the weights are still plain
    PyTorch's on the summed grads, bit for bit."""
    case = Case(world=2, steps=4, extra={"calibrate": 0.0})
    results = _ok(run_ranks(case, tmp_path))
    exact = reference(case, emulate_ranks=True)
    for r in results:
        c = r["counters"]
        assert c["timed_steps"] == 1 and c["compute_replans"] == 1 and c["replans"] == 1, c
        _assert_weights(r["weights"], exact["weights"])


@pytest.mark.slow
def test_step_after_backward_passes_all_inside_no_sync_reduces_the_local_sums(tmp_path):
    """Every backward inside no_sync (even the last): no backward communicates, and step() reduce-scatters each
    rank's local sum, so the update is still the average over the ranks: bit for bit plain torch (two ranks,
    fp32, each rank's micro-batches added first)."""
    case = Case(world=2, overlap=False, micro=2, steps=2, extra={"no_sync": "all"})
    results = _ok(run_ranks(case, tmp_path))
    exact = reference(case, emulate_ranks=True)
    for r in results:
        assert all(local and issued == _issued_inside_no_sync(step, micro)
                   for step, micro, local, issued in r["collectives"]), r["collectives"]
        _assert_weights(r["weights"], exact["weights"])


@pytest.mark.slow
@pytest.mark.parametrize("no_sync", [False, True])
def test_four_ranks_torch_clip_grad_norm_on_the_averaged_p_grad(tmp_path, no_sync):
    """Four ranks, two micro-batches, ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` on ``p.grad``
    (the average over the ranks; with ``no_sync`` the first micro-batch stays local). Every rank gets the same
    total norm and the same p.grad norms, bit for bit (they read the same averaged values), and holds the same
    model; gloo sums four addends in its own order, so against plain torch with the rank-ordered sum the norms
    are within 1e-6 relative and the weights within 1e-6, and the concatenated batch within CONCAT_ATOL."""
    case = Case(world=4, overlap=False, micro=2, clip=0.05,
                extra={"torch_clip": True} | ({"no_sync": True} if no_sync else {}))
    results = _ok(run_ranks(case, tmp_path, timeout_s=240.0))
    exact = reference(case, emulate_ranks=True)
    concat = reference(case, emulate_ranks=False)
    assert exact["norms"][0] > case.clip  # the clip really scales the grads
    for r in results:
        assert r["norms"] == results[0]["norms"]
        assert r["grad_norms"] == results[0]["grad_norms"]
        torch.testing.assert_close(r["norms"], exact["norms"], rtol=1e-6, atol=0)
        torch.testing.assert_close(r["norms"], concat["norms"], rtol=1e-5, atol=0)
        _assert_weights(r["weights"], results[0]["weights"])
        _assert_weights(r["weights"], exact["weights"], 1e-6)
        _assert_weights(r["weights"], concat["weights"], CONCAT_ATOL)
        if no_sync:
            assert all(issued == _issued_inside_no_sync(step, micro)
                       for step, micro, local, issued in r["collectives"] if local), r["collectives"]


@pytest.mark.parametrize("shared", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_forward_between_backward_and_step_sees_every_ranks_update(tmp_path, shared):
    """Overlapped updates, rank 1's AdamW of every shard 50 ms late: a no-grad forward after backward and
    before step(), on the same input on both ranks, waits for every rank's update of each bucket it fetches
    (the node's shared copy: the CPU lane's check that all ranks wrote it, [Note: one host copy per node]; per
    rank copies: the all-gather), so both ranks compute the same output; and the training is the reference's."""
    case = Case(world=2, steps=3, extra={"eval_before_step": True, "slow_update_rank": 1,
                                         "share_host_copy": shared})
    results = _ok(run_ranks(case, tmp_path))
    exact = reference(case, emulate_ranks=True)
    for got, want in zip(results[0]["eval_before_step"], results[1]["eval_before_step"]):
        assert torch.equal(got, want), (got - want).abs().max()
    for r in results:
        _assert_weights(r["weights"], exact["weights"])
        assert (r["host_shared_bytes"] > 0) == shared
        _assert_copy_checks(r, case.steps)  # at each backward's end: the forward before step() waited for it


@pytest.mark.slow  # ~10-22 s on 2 cores (three spawned runs)
def test_ranks_that_cannot_share_a_host_copy_keep_their_own_and_say_why(tmp_path):
    """[Note: one host copy per node]: rank 0 finds no room for the shared copy (a /dev/shm too small, faked):
    every rank warns, keeps its own copy (the arena that holds it) and trains as before; with
    ``share_host_copy=True`` every rank raises instead, saying why."""
    case = Case(world=2, steps=2, extra={"no_shm_room": True, "record_warnings": True})
    results = _ok(run_ranks(case, tmp_path / "auto"))
    exact = reference(case, emulate_ranks=True)
    for r in results:
        assert r["host_shared_bytes"] == 0
        _assert_host_bytes(r, case.world, accumulate=False, shared=False)
        _assert_weights(r["weights"], exact["weights"])
        said = [w for w in r["warnings"] if "keeps its own host copy" in w]
        assert len(said) == 1 and ("no room (a test)" in said[0] if r["rank"] == 0 else "rank 0" in said[0]), said
    case = Case(world=2, steps=1, extra={"no_shm_room": True, "share_host_copy": True})
    for r in run_ranks(case, tmp_path / "must"):
        assert "share_host_copy=True" in r.get("error", ""), r


def test_a_check_during_a_lanes_roll_call_raises_the_error_naming_the_rank():
    """A collective failing on the CPU lane sets ``failed`` before its roll call (up to ``ROLL_CALL_S``) names
    the rank; the main thread's ``check_usable`` in that window waits for that error instead of raising the
    bare ``failed`` (seen once: test_a_rank_dying_in_backward_is_named_by_the_other lacked "Rank 1")."""
    import threading
    import time

    from offload.errors import DistributedError
    from offload.runtime.distributed import DataParallel

    class SlowRollCall:
        def silent(self):
            time.sleep(0.3)
            return "Rank 1 did not say it saw this collective fail within 2 s"

    dp = DataParallel.__new__(DataParallel)
    dp.rank, dp.world, dp.roll_call, dp.failed, dp.error = 0, 2, SlowRollCall(), None, None
    dp.naming = threading.Event()
    dp.naming.set()

    def broken():
        raise RuntimeError("Connection reset by peer")

    lane = threading.Thread(target=lambda: pytest.raises(DistributedError, dp.call, "reduce-scatter", broken))
    lane.start()
    while dp.failed is None:
        time.sleep(0.001)
    with pytest.raises(DistributedError, match="Rank 1 did not say"):
        dp.check_usable()
    lane.join()
