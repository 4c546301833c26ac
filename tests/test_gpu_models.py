"""On a real GPU, what the simulated GPU (tests/support/fake_cuda.py, tests/backend/test_sim_strict.py) shows on the CPU
(issue 21): module buffers on the device (a BatchNorm CNN, HF BERT's position_ids / token_type_ids), a tied
weight with one grad accumulator through the traced fp32 step, a user's own compute stream, and a compute
stream slowed with ``torch.cuda._sleep`` that still trains bit for bit like the CPU backend. Marked `gpu`,
skipped without CUDA. Written against CUDA's and PyTorch's documented semantics; see the README's
Limitations for what has run on a GPU.
"""

import contextlib

import pytest
import torch
from torch import nn

import offload
from offload.errors import StreamError
from tests.support.budgets import with_headroom
from tests.support.loops import ADAMW
from tests.support.models import CASES, Batch, Case, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
on_cuda = pytest.mark.parametrize("device", ["cuda"], indirect=True)  # conftest's fixture: fp32 means fp32


def _wrap(model, opt, device, extra_bytes=0, **kw):
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    return offload.wrap(model, opt, budget=with_headroom(0.6 * nbytes + extra_bytes, device), bucket_bytes=nbytes // 10,
                        device=device, **kw)


def _train_both(make_case, device, steps, inspect=None, extra_bytes=0):
    """The engine and plain PyTorch (torch.optim.AdamW) on ``device``, same batches; the engine's
    offload.AdamW(fused=False) follows torch's arithmetic. Returns (engine state, reference state, engine
    losses, reference losses, engine stats, what ``inspect(engine)`` returned after each step)."""
    ref, case = make_case(), make_case()
    ref.model.to(device)
    ref_opt = torch.optim.AdamW(ref.model.parameters(), foreach=False, **ADAMW)
    opt = offload.AdamW(case.model.parameters(), fused=False, **ADAMW)
    seen, losses, ref_losses = [], [], []
    with _wrap(case.model, opt, device, extra_bytes) as engine:
        for step in range(steps):
            batch = case.make_batch(step).to(device)
            loss = case.loss_fn(run(engine, batch), batch)
            engine.backward(loss)
            opt.step()
            opt.zero_grad()
            ref_loss = ref.loss_fn(run(ref.model, batch), batch)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            losses.append(loss.item())
            ref_losses.append(ref_loss.item())
            if inspect is not None:
                seen.append(inspect(engine))
        state, stats = engine.state_dict()["model"], engine.memory_stats()
    return state, {k: v.cpu() for k, v in ref.model.state_dict().items()}, losses, ref_losses, stats, seen


def _close(state, want, rtol=1e-4, atol=1e-5):
    for key, value in want.items():
        assert state[key].device.type == "cpu", key
        torch.testing.assert_close(state[key], value, rtol=rtol, atol=atol, msg=key)


# -- defect 1: buffers on the device --------------------------------------------------------------------------


@on_cuda
def test_batchnorm_cnn_trains_with_its_buffers_on_the_device(device):
    case_fn = CASES["cnn_batchnorm"]
    buffers_on = lambda engine: {b.device.type for b in engine.module.buffers()}
    state, want, losses, ref_losses, stats, seen = _train_both(case_fn, device, 4, inspect=buffers_on)
    assert all(s == {"cuda"} for s in seen)
    print(f"\nBatchNorm CNN on {torch.cuda.get_device_name()}: losses {losses} vs torch {ref_losses}")
    _close(state, want)


def hf_bert() -> Case:
    """A tiny HF BertForMaskedLM from a config (no download): its embeddings hold position_ids and
    token_type_ids buffers, and the MLM decoder is tied to the word embeddings."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.BertForMaskedLM(config).float()

    def make_batch(step):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(2, 128, (2, 12), generator=g)
        labels = torch.where(torch.rand(2, 12, generator=g) < 0.3, ids, torch.full_like(ids, -100))
        labels[:, 0] = ids[:, 0]
        return Batch((), {"input_ids": ids, "labels": labels})  # no token_type_ids: the buffer is read

    return Case(model, make_batch, lambda out, b: out.loss)


@pytest.mark.hf
@on_cuda
def test_hf_bert_trains_with_its_buffers_on_the_device(device):
    names = lambda engine: {n: b.device.type for n, b in engine.module.named_buffers()}
    state, want, losses, ref_losses, stats, seen = _train_both(hf_bert, device, 3, inspect=names, extra_bytes=2 << 20)
    print(f"\nHF BERT on {torch.cuda.get_device_name()}: buffers {sorted(seen[0])}; losses {losses} vs torch "
          f"{ref_losses}")
    assert seen[0] and all(set(s.values()) == {"cuda"} for s in seen), seen
    for key in want:
        if "key.bias" in key:  # softmax ignores a key bias: its grad is rounding noise (issue 21, part 1)
            continue
        torch.testing.assert_close(state[key], want[key], rtol=1e-4, atol=1e-5, msg=key)


# -- defect 2: a tied weight, fp32 ---------------------------------------------------------------------------


@on_cuda
def test_tied_gpt_fp32_departs_nowhere(device):
    """GPT's tied embedding / LM head in fp32: while tracing, no device change of the weight between its two
    uses (which would give it a second grad accumulator), so the planned steps follow the plan."""
    state, want, losses, ref_losses, stats, _ = _train_both(CASES["gpt"], device, 4)
    print(f"\ntied GPT fp32 on {torch.cuda.get_device_name()}: counters {stats['counters']}")
    # the one re-plan allowed: at the first planned step, for its timing ([Note: timing compute]) or its measured
    # transients ([Note: transients])
    counters = stats["counters"]
    assert counters["plan_departures"] == 0
    assert counters["replans"] == counters["compute_replans"] + counters["transient_replans"] <= 1
    _close(state, want)


# -- defect 7: the user's own stream -------------------------------------------------------------------------


def _mlp_run(device, steps, stream=None):
    case = CASES["mlp"]()
    opt = offload.AdamW(case.model.parameters(), fused=False, **ADAMW)
    engine = _wrap(case.model, opt, device)
    with engine:
        for step in range(steps):
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                batch = case.make_batch(step).to(device)  # made on the stream that uses it
                loss = case.loss_fn(run(engine, batch), batch)
                engine.backward(loss)
            opt.step()  # outside the user's stream
            opt.zero_grad()
        state = engine.state_dict()["model"]
        if stream is not None:
            with pytest.raises(StreamError):
                engine(case.make_batch(0).to(device).args[0])  # another stream than the first forward's
    return state


@on_cuda
def test_a_user_stream_trains_like_the_default_stream(device):
    want = _mlp_run(device, 5)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # the user's stream runs behind: a missing wait would show
    got = _mlp_run(device, 5, stream)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


# -- a slow compute stream -------------------------------------------------------------------------------------


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cycles):
        ctx.cycles = cycles
        if x.is_cuda:
            torch.cuda._sleep(cycles)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if grad.is_cuda:
            torch.cuda._sleep(ctx.cycles)
        return grad, None


class SlowLayer(nn.Module):
    def __init__(self, width: int, cycles: int, g: torch.Generator):
        super().__init__()
        self.w = nn.Parameter(1 + 0.01 * torch.randn(width, generator=g))
        self.b = nn.Parameter(0.01 * torch.randn(width, generator=g))
        self.cycles = cycles

    def forward(self, x):
        return _Sleep.apply(x * self.w + self.b, self.cycles)


class SlowElementwise(nn.Module):
    """Elementwise layers only (x * w + b, no reduction but the loss), each padded with a GPU sleep each way:
    every op is correctly rounded IEEE arithmetic on both devices, so CUDA and the CPU backend agree bit for
    bit, and with compute far behind the host any missing wait shows as different numbers."""

    def __init__(self, width=1 << 16, depth=8, cycles=2_000_000):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers = nn.ModuleList(SlowLayer(width, cycles, g) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _slow_run(device, steps=4):
    model = SlowElementwise()
    opt = offload.AdamW(model.parameters(), **ADAMW)  # the default (fused) kernel: the same on the host
    with _wrap(model, opt, device, extra_bytes=3 << 20) as engine:  # + the saved activations (2 MiB)
        for step in range(steps):
            x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(step)).to(device)
            y = engine(x)
            engine.backward((y * y).sum())  # d/dy: 2y, exactly; no reduction in any gradient
            opt.step()
            opt.zero_grad()
        stats = engine.memory_stats()
        state = engine.state_dict()["model"]
    return state, stats


@on_cuda
def test_a_slow_compute_stream_trains_bit_for_bit_like_the_cpu_backend(device):
    want, _ = _slow_run("cpu")
    got, stats = _slow_run(device)
    assert stats["plan"]["streamed_buckets"] > 0 and stats["counters"]["plan_departures"] == 0
    for key, value in want.items():
        assert torch.equal(got[key], value), key
