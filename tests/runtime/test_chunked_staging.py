"""[Note: chunked grad staging] (issue 18, offload/planning/buckets.py): grads of a bucket larger than one ring
piece cross to the host in pieces, each read by its own piece of the bucket's update (or of its fold into the
fp32 sum) on the CPU lane, so the ring holds ``GRAD_RING_SLOTS`` pieces, not the largest buckets. The pieces
change no number: every test trains with pieces far smaller than the tiny models' buckets and compares with
the same training in whole buckets (and, in fp32 through torch's arithmetic, with plain PyTorch), bit for bit.
"""


import pytest
import torch

import offload.host.state
import offload.planning.buckets
from offload.planning.buckets import GRAD_RING_SLOTS, HOST_ALIGN
from offload.backend.base import Lane
from offload.testing.chaos import ChaosConfig
from tests.support.fake_cuda import simulated_gpu  # noqa: F401 (a fixture)
from tests.support.loops import torch_losses, train_streamed
from tests.support.models import CASES

PIECE = 4 * HOST_ALIGN  # bytes: 64 fp32 or 128 bf16 grads, far below the test GPT's buckets


def _pieces_of(monkeypatch, nbytes: int) -> None:
    """Ring pieces of ``nbytes`` whatever the model's size ([Note: ring pieces scale with the model]: the floor
    and the cap both)."""
    monkeypatch.setattr(offload.host.state, "GRAD_RING_CHUNK_BYTES", nbytes)
    monkeypatch.setattr(offload.planning.buckets, "GRAD_RING_CHUNK_MAX_BYTES", nbytes)


def _pieces(engine) -> dict:
    host = engine._runtime.slots.hosted()
    return {"ring_bytes": host.layout.ring_bytes, "chunk": host.chunk,
            "largest": max(b.trainable_numel for b in host.buckets)}


def assert_same(got, want) -> None:
    assert got[0] == want[0], "losses differ"
    assert got[1].keys() == want[1].keys()
    for name, value in want[1].items():
        assert torch.equal(got[1][name], value), name


FEATURES = {
    "fp32-torch": dict(fused=False),
    "fp32-fused": dict(),
    "bf16": dict(dtype=torch.bfloat16),
    "bf16-accumulate-clip": dict(dtype=torch.bfloat16, accumulate=2, clip=0.05),
    "fp16": dict(dtype=torch.float16),
    "fp32-accumulate": dict(accumulate=2),
}


@pytest.mark.parametrize("features", FEATURES.values(), ids=FEATURES.keys())
def test_pieces_train_as_whole_buckets_bit_for_bit(monkeypatch, features):
    want = train_streamed(CASES["gpt"](), 3, inspect=_pieces, **features)
    _pieces_of(monkeypatch, PIECE)
    got = train_streamed(CASES["gpt"](), 3, inspect=_pieces, **features)
    assert_same(got, want)
    ring = got[3]
    # the ring holds GRAD_RING_SLOTS pieces, each far smaller than the largest bucket (which no longer fits it)
    assert ring["ring_bytes"] == GRAD_RING_SLOTS * PIECE < ring["largest"] * 2
    assert ring["ring_bytes"] < want[3]["ring_bytes"] and ring["chunk"] * 8 < ring["largest"]


def test_the_engine_sizes_its_pieces_by_the_model(monkeypatch):
    """[Note: ring pieces scale with the model]: the engine's pieces are 1/GRAD_RING_CHUNK_SHARE of the model's
    trainable grads where that is above the floor (here the share is 16 and the floor one PIECE, so that the test
    GPT's pieces are sized by the share), and train as whole buckets, bit for bit."""
    want = train_streamed(CASES["gpt"](), 3, inspect=_pieces, dtype=torch.bfloat16)
    monkeypatch.setattr(offload.host.state, "GRAD_RING_CHUNK_BYTES", PIECE)  # the floor
    monkeypatch.setattr(offload.planning.buckets, "GRAD_RING_CHUNK_SHARE", 16)
    got = train_streamed(CASES["gpt"](), 3, inspect=lambda e: _pieces(e) | {
        "grad_bytes": sum(b.trainable_numel for b in e._runtime.slots.hosted().buckets) * 2}, dtype=torch.bfloat16)
    assert_same(got, want)
    ring = got[3]
    share = ring["grad_bytes"] // 16 // HOST_ALIGN * HOST_ALIGN // 2
    assert ring["chunk"] == share and PIECE // 2 < share < ring["largest"]


@pytest.mark.slow  # ~65 s on 2 cores: the default run keeps the pieces' non-chaos tests
def test_pieces_under_chaos_bit_for_bit(monkeypatch):
    """Every lane delayed at random: a piece's copy must wait for the reader of the ring bytes it reuses
    (the update of an earlier piece, of this bucket or another)."""
    want = train_streamed(CASES["gpt"](), 4, dtype=torch.bfloat16)
    _pieces_of(monkeypatch, PIECE)
    got = train_streamed(CASES["gpt"](), 4, dtype=torch.bfloat16, chaos=ChaosConfig(seed=0, max_delay_ms=2))
    assert_same(got, want)


@pytest.mark.slow  # ~12-28 s on 2 cores; the fused and accumulate variants above run by default
def test_pieces_are_plain_pytorch_bit_for_bit(monkeypatch):
    """fp32 through offload.AdamW(fused=False): torch.optim.AdamW's numbers, one piece at a time."""
    _pieces_of(monkeypatch, PIECE)
    case = CASES["gpt"]()
    want, ref = torch_losses(case, 4)
    got = train_streamed(case, 4, fused=False)
    assert got[0] == want
    for name, value in ref.state_dict().items():
        assert torch.equal(got[1][name], value), name


def test_only_a_buckets_first_piece_waits_for_its_h2d(monkeypatch):
    """[Note: one H2D wait per bucket's update] (runtime/grads.py): the update of a bucket's first piece waits
    for its grads' copy and the bucket's H2D; each later piece's, for its grads' copy only (the lane runs them
    after the first). The numbers are the whole buckets' (test_pieces_train_as_whole_buckets_bit_for_bit)."""
    issued: list[tuple[str, int]] = []
    issue = Lane.issue

    def spy(self, fn, waits=(), what=""):
        waits = tuple(waits)
        if what.startswith("AdamW of bucket"):
            issued.append((what, len(waits)))
        return issue(self, fn, waits, what)

    monkeypatch.setattr(Lane, "issue", spy)
    _pieces_of(monkeypatch, PIECE)
    train_streamed(CASES["gpt"](), 3, dtype=torch.bfloat16)
    groups: list[list[int]] = []  # the waits of each bucket's consecutive pieces
    for i, (what, n) in enumerate(issued):
        if i == 0 or issued[i - 1][0] != what:
            groups.append([])
        groups[-1].append(n)
    pieced = [g for g in groups if len(g) > 1 and g[0] == 2]
    assert len(pieced) >= 4, groups  # buckets of many pieces, whose first piece waited for the H2D too
    assert all(g[1:] == [1] * (len(g) - 1) for g in groups), groups


def test_pieces_on_the_simulated_gpu_bit_for_bit(monkeypatch, simulated_gpu):  # noqa: F811 (the fixture)
    """The CUDA backend's ordering with pieces ([Note: the cost of a lane item] in backend/base.py: the lane
    synchronizes only device events not yet complete, a bucket's later pieces do not wait for its H2D): no race
    on the simulated GPU, and the CPU backend's whole-bucket numbers."""
    want = train_streamed(CASES["gpt"](), 3, dtype=torch.bfloat16)
    _pieces_of(monkeypatch, PIECE)
    made = simulated_gpu()
    got = train_streamed(CASES["gpt"](), 3, dtype=torch.bfloat16, inspect=_pieces)
    assert_same(got, want)
    assert got[3]["chunk"] * 8 < got[3]["largest"] and made[0]._api.copies > 0
