"""Fine-tuning with frozen parameters: what the engine keeps and moves for them.

A frozen parameter (``requires_grad=False``) gets no gradient, no AdamW state and no fp32 master beyond
the copy the device computes with (4 bytes a parameter in fp32, 2 in bf16/fp16), and host memory shows it.
Backward needs a frozen weight only where a gradient flows through it to a trainable parameter below
(its input gradient); below the lowest trainable parameter nothing is needed, so those buckets cross the
bus once a step, for forward, and never for backward. The transfer counters in ``memory_stats()`` show it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from gpt import GPT, GPTConfig

import offload
from offload.planning.buckets import HOST_ALIGN
from offload.planning.schedule import BufferKind
from tests.support.compare import assert_bitwise, assert_losses_bitwise

ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
STEPS = 6
N_LAYER, TRAIN_FROM = 6, 4  # blocks 0..3, wpe and the (tied) wte are frozen; blocks 4, 5 and ln_f train


def frozen_gpt(frozen_above: bool = False) -> GPT:
    """A tiny GPT with its bottom frozen. ``frozen_above``: block 5 is frozen too, above trainable block 4,
    so backward needs its weights for block 4's gradients."""
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=N_LAYER, n_head=4, n_embd=64, bias=False,
                          init_seed=3))
    for name, p in model.named_parameters():
        block = int(name.split(".")[1]) if name.startswith("blocks.") else None
        trainable = (block is not None and block >= TRAIN_FROM) or name.startswith("ln_f")
        if frozen_above and block == N_LAYER - 1:
            trainable = False
        p.requires_grad_(trainable)
    return model


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, 64, (2, 1), generator=g)
    tokens = (start + torch.arange(9)) % 64
    return tokens[:, :-1], tokens[:, 1:]


def param_bytes(model) -> int:
    return sum(p.numel() * 4 for p in model.parameters())


def wrap(model, dtype=torch.float32, budget=0.5):
    """fused=False: torch's AdamW arithmetic, so fp32 runs compare with PyTorch bit for bit (tests/support/compare.py)."""
    nbytes = param_bytes(model)
    opt = offload.AdamW([p for p in model.parameters() if p.requires_grad], fused=False, **ADAMW)
    engine = offload.wrap(model, opt, budget=int(budget * nbytes), bucket_bytes=nbytes // 16, dtype=dtype,
                          device="cpu")
    return engine, opt


def train(forward, opt, steps, start=0):
    losses = []
    for step in range(start, start + steps):
        x, y = batch(step)
        _, loss = forward(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_frozen_bottom_matches_pytorch_and_moves_no_backward_bytes():
    model = frozen_gpt()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], foreach=False, **ADAMW)
    ref_losses = train(ref, ref_opt, STEPS)
    engine, opt = wrap(model)
    rt = engine._runtime
    try:
        losses = train(engine, opt, 2)  # the traced step, then one on the plan
        before = engine.memory_stats()["transfers"]
        losses += train(engine, opt, STEPS - 2, start=2)
        after = engine.memory_stats()["transfers"]
        assert_losses_bitwise(losses, ref_losses)
        assert_bitwise(engine.state_dict()["model"], ref.state_dict())

        # Which parameters does backward read? Exactly those a gradient flows through: nothing below
        # block 4 (wpe, blocks 0..3), but the tied wte (it scores the tokens: lm_head, at the top).
        plan = rt.executor.train_plan
        trace = plan.trace
        read_in_backward = {p for uses in trace.uses[trace.num_forward:] for p in uses}
        names = {rt.ctx.param_index[id(p)]: n for n, p in model.named_parameters()}
        below = {p for p, n in names.items() if n.startswith("wpe") or
                 (n.startswith("blocks.") and int(n.split(".")[1]) < TRAIN_FROM)}
        assert not below & read_in_backward, sorted(names[p] for p in below & read_in_backward)
        assert rt.ctx.param_index[id(model.wte.weight)] in read_in_backward
        assert {p for p, n in names.items() if n.startswith("blocks.4.")} <= read_in_backward

        # Bytes moved per step, per bucket: the runtime moves exactly what the plan says (streamed copies,
        # plus the refresh of resident buckets that were updated), and the plan copies no bucket below for
        # backward: each of their device buffers ends within forward.
        steps = STEPS - 2
        per_step = [(a - b) / steps for a, b in zip(after["h2d_bytes_by_bucket"], before["h2d_bytes_by_bucket"])]
        for b in rt.slots.buckets:
            streamed = [x for x in plan.buffers if x.kind is BufferKind.PARAM and x.bucket == b.index
                        and b.index not in plan.resident]
            refresh = b.nbytes(rt.ctx.itemsize) if b.index in plan.resident and b.trainable_numel else 0
            assert per_step[b.index] == sum(x.size for x in streamed) + refresh, (b.index, per_step)
            if set(b.params) <= below:
                assert all(x.end <= trace.num_forward for x in streamed), (b.index, streamed)
        below_streamed = [b for b in rt.slots.buckets if set(b.params) <= below and b.index not in plan.resident]
        assert below_streamed, "the budget must make some frozen bucket below stream, or this checks nothing"
        # Buckets with trainable parameters that stream are fetched again for backward (the contrast).
        assert any(x.end > trace.num_forward for x in plan.buffers
                   if x.kind is BufferKind.PARAM and x.bucket not in plan.resident)
        trainable_grad_bytes = sum(b.grad_nbytes(rt.ctx.itemsize) for b in rt.slots.buckets)
        assert after["d2h_bytes"] - before["d2h_bytes"] == steps * trainable_grad_bytes
    finally:
        engine.close()


def test_frozen_above_trainable_is_refetched_for_backward():
    """A frozen block above a trainable one: its weights compute the input gradient, so backward reads
    them; training still matches PyTorch."""
    model = frozen_gpt(frozen_above=True)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], foreach=False, **ADAMW)
    ref_losses = train(ref, ref_opt, 3)
    engine, opt = wrap(model)
    rt = engine._runtime
    try:
        assert_losses_bitwise(train(engine, opt, 3), ref_losses)
        assert_bitwise(engine.state_dict()["model"], ref.state_dict())
        trace = rt.executor.train_plan.trace
        read_in_backward = {p for uses in trace.uses[trace.num_forward:] for p in uses}
        top = {rt.ctx.param_index[id(p)] for n, p in model.named_parameters() if n.startswith(f"blocks.{N_LAYER - 1}.")}
        matrices = {rt.ctx.param_index[id(p)] for n, p in model.named_parameters()
                    if n.startswith(f"blocks.{N_LAYER - 1}.") and p.dim() == 2}
        assert matrices <= read_in_backward <= set(range(len(rt.ctx.params)))
        assert top & read_in_backward
    finally:
        engine.close()


def _expected_host_bytes(engine, frozen_bytes: int, trainable_bytes: int) -> tuple[int, int]:
    rt = engine._runtime
    trainable = sum(b.trainable_numel for b in rt.slots.buckets)
    frozen = sum(b.numel - b.trainable_numel for b in rt.slots.buckets)
    # grads: the staging ring only ([Note: grad staging ring]): room for the largest buckets in the device dtype
    ring_bytes = rt.slots.hosted().layout.ring_bytes
    exact = trainable * trainable_bytes + frozen * frozen_bytes + ring_bytes
    # master, 16-bit copy, grad, m, v: each padded to HOST_ALIGN at most; the ring too (and its pieces)
    regions = 5 * len(rt.slots.buckets) + 4
    return exact, exact + regions * HOST_ALIGN


@pytest.mark.parametrize("dtype, trainable_bytes, frozen_bytes", [
    (torch.float32, 12, 4),  # fp32 master (also what the device gets), m, v; frozen: the master only
    (torch.bfloat16, 14, 2),  # fp32 master, m, v + the 16-bit copy; frozen: the 16-bit copy only
])
def test_host_memory_of_frozen_parameters(dtype, trainable_bytes, frozen_bytes):
    model = frozen_gpt()
    n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    n_total = sum(p.numel() for p in model.parameters())
    assert n_frozen > n_total // 2
    wpe = model.wpe.weight.detach().clone()
    engine, opt = wrap(model, dtype=dtype, budget=0.8)
    try:
        train(engine, opt, 2)
        host = engine.memory_stats()["host_pinned_bytes"]
        low, high = _expected_host_bytes(engine, frozen_bytes, trainable_bytes)
        assert low <= host <= high, (host, low, high)
        # An all-trainable model would need trainable_bytes for every parameter (the grad ring aside).
        assert host < 0.75 * trainable_bytes * n_total
        # Frozen parameters have no optimizer state.
        frozen = [p for p in model.parameters() if not p.requires_grad]
        assert not any(p in opt.state for p in frozen)
        # And their values read back (state_dict, close) as what the device computes with.
        state = engine.state_dict()["model"]
        assert torch.equal(state["wpe.weight"], wpe.to(dtype).float())
    finally:
        engine.close()


def test_frozen_bf16_weights_survive_save_and_load(tmp_path):
    """A frozen parameter kept only in 16 bits saves as its fp32 widening and loads back bit for bit."""
    model = frozen_gpt()
    original = model.wpe.weight.detach().clone()
    engine, opt = wrap(model, dtype=torch.bfloat16, budget=0.8)
    try:
        train(engine, opt, 2)
        engine.save(tmp_path / "ckpt.pt")
        saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]["wpe.weight"]
        assert saved.dtype == torch.float32
        assert torch.equal(saved, original.to(torch.bfloat16).float())
        engine.load(tmp_path / "ckpt.pt")
        assert torch.equal(engine.state_dict()["model"]["wpe.weight"], saved)
    finally:
        engine.close()
    assert torch.equal(model.wpe.weight.detach(), original.to(torch.bfloat16).float())
