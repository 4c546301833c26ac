"""Hugging Face ``transformers`` models, unchanged, trained and evaluated through offload.

Each model (tests/support/hf_models.py: GPT-2, BERT MLM, Llama, T5, OPT, ViT, tiny configs, random weights, no
download) trains a few steps twice from identical weights on identical batches: plain PyTorch with
``torch.optim.AdamW(foreach=False)``, and ``offload.wrap`` in fp32 with a budget of 0.8x the parameter bytes,
so buckets must stream, and ``offload.AdamW(fused=False)``. Losses and final weights must be bit for bit the
reference's. Then, under ``torch.no_grad()``, the eval forward (logits) and ``model.generate()`` must give the
reference's answers through the engine, on a forward-only plan: no gradient, no backward refetch.

These models have parameters whose true gradient is zero (the key bias of GPT-2's fused c_attn, BERT, OPT
and ViT: softmax ignores a shift shared by all keys), which is why nothing here compares with a tolerance:
see [Note: exact, or within the kernel's bound] in tests/support/compare.py. The default fused kernel is checked
step by step against its proven bound (``test_hf_fused_kernel_steps_within_its_bound``).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import offload
from tests.support.compare import (
    FusedStepChecker,
    assert_bitwise,
    assert_losses_bitwise,
)
from tests.support.hf_models import CASES, HFCase

pytestmark = pytest.mark.hf

STEPS = 4
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
BUDGET = 0.8  # x the fp32 parameter bytes: with activations and grads in flight, the weights do not fit
GENERATE = dict(max_new_tokens=5, do_sample=False)


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def wrap(model: torch.nn.Module, budget: float = BUDGET, fused: bool | None = False, **fields):
    """The engine and its optimizer; ``fused=False``: torch's AdamW arithmetic, so bit for bit comparable."""
    nbytes = param_bytes(model)
    opt = offload.AdamW(model.parameters(), fused=fused, **ADAMW)
    engine = offload.wrap(model, opt, budget=int(budget * nbytes), bucket_bytes=nbytes // 10,
                          dtype=torch.float32, device="cpu", **fields)
    return engine, opt


def train(forward, opt, case: HFCase, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        loss = forward(**case.make_batch(step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def eval_batch(case: HFCase) -> dict:
    """A batch no training step sees (labels kept: T5 makes its decoder inputs from them)."""
    return case.make_batch(10_000)


def logits(forward, module: torch.nn.Module, batch: dict) -> torch.Tensor:
    module.eval()
    with torch.no_grad():
        out = forward(**batch).logits
    module.train()
    return out


@pytest.fixture(scope="module")
def references() -> dict:
    """Plain PyTorch on every case, once: losses, eval logits and generated ids after STEPS steps."""
    return {}


def reference(name: str, cache: dict):
    if name not in cache:
        case = CASES[name]()
        model = copy.deepcopy(case.model)
        opt = torch.optim.AdamW(model.parameters(), foreach=False, **ADAMW)
        losses = train(model, opt, case, STEPS)
        out = logits(model, model, eval_batch(case))
        generated = None
        if case.prompt is not None:
            model.eval()
            generated = model.generate(**case.prompt, **GENERATE)
            model.train()
        cache[name] = (losses, model.state_dict(), out, generated)
    return cache[name]


@pytest.mark.parametrize("name", list(CASES))
def test_hf_model_trains_and_evaluates_like_pytorch(name: str, references):
    losses_ref, final_ref, logits_ref, generated_ref = reference(name, references)
    case = CASES[name]()
    engine, opt = wrap(case.model)
    try:
        losses = train(engine, opt, case, STEPS)
        assert_losses_bitwise(losses, losses_ref)
        assert_bitwise(engine.state_dict()["model"], final_ref, name)
        stats = engine.memory_stats()
        assert stats["plan"]["streamed_buckets"] > 0, stats["plan"]  # the budget forces streaming
        assert stats["device_peak_bytes"] <= stats["budget_bytes"]

        before = dict(stats["counters"])
        # The same weights, the same ops: the same logits, to the bit.
        assert torch.equal(logits(engine, case.model, eval_batch(case)), logits_ref)
        case.model.eval()
        with torch.inference_mode():  # the engine's own buffers must not become inference tensors
            assert torch.equal(engine(**eval_batch(case)).logits, logits_ref)
        case.model.train()
        if case.prompt is not None:
            case.model.eval()
            generated = case.model.generate(**case.prompt, **GENERATE)  # the module itself: hooks do the rest
            assert torch.equal(generated, generated_ref), (generated, generated_ref)
            # Each no-grad path seen (prefill, decode; an encoder-decoder's encoder call) has its
            # forward-only plan now: a second generate() follows them, fetching nothing on demand.
            again = engine.memory_stats()["counters"]
            assert torch.equal(case.model.generate(**case.prompt, **GENERATE), generated_ref)
            case.model.train()
            now = engine.memory_stats()["counters"]
            assert now["plan_departures"] == again["plan_departures"]
            assert now["on_demand_fetches"] == again["on_demand_fetches"]
        after = engine.memory_stats()["counters"]
        assert after["backwards"] == before["backwards"]  # forward-only: no backward ran
        assert after["d2h_bytes"] == before["d2h_bytes"]  # no gradient left the device
        assert all(p.grad is None for p in case.model.parameters())

        # Training goes on after evaluation, on the same training plan.
        train(engine, opt, case, 1)
        assert engine.memory_stats()["plan"]["replans"] == stats["plan"]["replans"]
    finally:
        engine.close()


@pytest.mark.parametrize("name", list(CASES))
def test_hf_fused_kernel_steps_within_its_bound(name: str):
    """The default (fused C++) AdamW in the engine: at every step, from the engine's own weights and AdamW
    state, plain PyTorch + torch.optim.AdamW takes the same step; m and v must be bit for bit, the masters
    within the kernel's proven bound per element (tests/support/compare.py), key biases and all."""
    if not offload.host.cpu_adam.KERNEL_AVAILABLE:
        pytest.skip("the C++ kernel is not built")
    case = CASES[name]()
    checker = FusedStepChecker(case.model, ADAMW)
    engine, opt = wrap(case.model, fused=None)
    assert opt.fused
    try:
        for step in range(STEPS):
            batch = case.make_batch(step)
            checker.before_step(engine)
            engine(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
            checker.after_step(engine, lambda model, batch=batch: model(**batch).loss, f"step {step}")
        assert checker.checked == STEPS * sum(p.numel() for p in case.model.parameters())
        assert checker.differing > 0  # the kernel ran: its IEEE sqrt differs from torch's somewhere
    finally:
        engine.close()


def test_off_plan_step_evicts_cached_buckets_as_activations_grow():
    """Regression: after "auto" checkpointing picks its blocks, the next step runs off plan with buckets
    fetched on demand and cached; they used to be evicted only when another bucket was fetched, so saved
    activations growing in between took the device peak over the budget (examples/train_gpt.py --model
    hf-gpt2 ended 27 KiB over its 13.8 MiB budget)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=256, n_layer=6, n_head=8,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).float().train()
    nbytes = param_bytes(model)
    opt = offload.AdamW(model.parameters(), lr=2e-3)
    engine = offload.wrap(model, opt, budget=int(0.75 * nbytes), bucket_bytes=nbytes // 12, dtype=torch.float32,
                          device="cpu", activation_checkpointing="auto")
    g = torch.Generator().manual_seed(0)
    try:
        for step in range(3):
            ids = torch.randint(0, 256, (2, 32), generator=g)
            engine(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            stats = engine.memory_stats()
            assert stats["device_peak_bytes"] <= stats["budget_bytes"], (step, stats["device_peak_bytes"])
        ckpt = stats["activation_checkpointing"]
        assert 0 < len(ckpt["checkpointed"]) < ckpt["blocks"]  # the case this guards: a partial choice, then off plan
    finally:
        engine.close()


def test_activation_checkpointing_enable_reentrant_trains_like_pytorch():
    """transformers' own ``model.activation_checkpointing_enable()`` (``gradient_checkpointing_enable``) with
    ``use_reentrant=True`` runs ``torch.utils.checkpoint`` inside the model; the engine follows its recompute
    ([Note: a user's reentrant checkpoint]): losses and weights bit for bit plain PyTorch with the same
    checkpointing (before: silently wrong)."""
    case = CASES["gpt2"]()
    ref = copy.deepcopy(case.model)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    for m in (case.model, ref):
        m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
        m.train()
    engine, opt = wrap(case.model)
    assert_losses_bitwise(train(case.model, opt, case, STEPS), train(ref, ref_opt, case, STEPS))
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "reentrant checkpointing")
    assert engine.memory_stats()["counters"]["plan_departures"] == 0
    engine.close()


def test_activation_checkpointing_enable_non_reentrant_raises_naming_the_engines_checkpointing():
    """With ``use_reentrant=False`` the recompute is refused at the first backward, naming the engine's
    ``activation_checkpointing`` (before: torch's CheckpointError). Without it, the same model goes on training
    as plain PyTorch, bit for bit."""
    case = CASES["gpt2"]()
    ref = copy.deepcopy(case.model)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAMW)
    case.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    case.model.train()
    engine, opt = wrap(case.model, overlap_optimizer=False)
    with pytest.raises(offload.OffloadError, match=r"ran inside a backward.*use_reentrant=False.*"
                                                   r"activation_checkpointing="):
        case.model(**case.make_batch(0)).loss.backward()
    with pytest.warns(offload.OffloadWarning, match="backward"):  # the fault, noticed at the next call
        opt.zero_grad()
    case.model.activation_checkpointing_disable()
    losses = train(case.model, opt, case, 2)
    assert_losses_bitwise(losses, train(ref, ref_opt, case, 2))
    assert_bitwise(engine.state_dict()["model"], ref.state_dict(), "after the refused step")
    engine.close()
