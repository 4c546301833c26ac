"""The models the numerics tests train, each a factory returning a `Case`: (model, make_batch, loss_fn).

`make_batch(step)` returns the same `Batch` every time it is asked for a given step, so the reference and
the offloaded run see identical data; `loss_fn(output, batch)` turns the model's output into a scalar.

Every model keeps its activations small next to its parameters (tiny batches) and no single parameter
above ~1/8 of the total, so a device budget well under the parameter bytes is feasible and buckets have
to stream. Dropout is 0 everywhere.

No parameter here has a gradient that is zero in exact arithmetic but rounding noise in floats, such as
a key bias in attention (softmax ignores a shift shared by all keys) or a conv bias right before
BatchNorm (BatchNorm removes it). AdamW divides by the gradient's own scale, so such a parameter
random-walks by ~lr per step on noise, and the last bit of any reduction order would decide the answer.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from gpt import (  # examples/gpt.py (examples/ is on sys.path: pyproject's pytest `pythonpath`)
    GPT,
    GPTConfig,
)
from torch import nn


@dataclass
class Batch:
    args: tuple  # positional arguments of the model's forward
    kwargs: dict = field(default_factory=dict)  # keyword arguments of the model's forward
    target: torch.Tensor | None = None  # what loss_fn compares the output against; never seen by the model

    def to(self, device) -> "Batch":
        """The same batch with every tensor on ``device`` (for the CUDA runs)."""
        def move(x):
            return x.to(device) if isinstance(x, torch.Tensor) else x
        return Batch(tuple(move(a) for a in self.args), {k: move(v) for k, v in self.kwargs.items()}, move(self.target))


class Case(NamedTuple):
    model: nn.Module
    make_batch: Callable[[int], Batch]
    loss_fn: Callable[[object, Batch], torch.Tensor]


def run(model: Callable, batch: Batch):
    """Call a module (or an engine, which forwards to its module) on a batch."""
    return model(*batch.args, **batch.kwargs)


def _gen(step: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(1_000_003 * salt + step)


def _build(seed: int, make: Callable[[], nn.Module]) -> nn.Module:
    """Build with a fixed seed without touching the global RNG, so models do not depend on test order."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


def _regression_batch(step: int, salt: int, batch: int, width: int) -> Batch:
    """Random inputs; targets from a fixed random "teacher" layer, so there is something to learn."""
    teacher = torch.randn(width, width, generator=_gen(0, 1000 + salt)) / math.sqrt(width)
    x = torch.randn(batch, width, generator=_gen(step, salt))
    return Batch((x,), target=torch.tanh(x @ teacher))


def _mse(out: torch.Tensor, batch: Batch) -> torch.Tensor:
    return F.mse_loss(out, batch.target)


def _stack(width: int, depth: int, activation: Callable[[], nn.Module]) -> nn.Sequential:
    model = nn.Sequential(*(m for _ in range(depth) for m in (nn.Linear(width, width), activation())))
    for layer in model[::2]:
        nn.init.normal_(layer.weight, std=1.5 / math.sqrt(width))  # keeps the signal alive through 12 layers
    return model


def mlp() -> Case:
    width, depth, batch = 128, 12, 4
    model = _build(1, lambda: _stack(width, depth, nn.GELU)[:-1])  # no activation after the last Linear
    return Case(model, lambda step: _regression_batch(step, 1, batch, width), _mse)


def gpt() -> Case:
    # bias=False: with biases, c_attn's key bias would be one of the noise-gradient parameters above.
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=128, bias=False)
    model = GPT(config)
    batch, seq = 1, 8

    def make_batch(step):
        # Counting from a random start (next token = this one + 1): learnable, so gradients carry signal.
        start = torch.randint(0, config.vocab_size, (batch, 1), generator=_gen(step, 2))
        tokens = (start + torch.arange(seq + 1)) % config.vocab_size
        return Batch((tokens[:, :-1],), {"targets": tokens[:, 1:]})

    return Case(model, make_batch, lambda out, b: out[1])  # GPT returns (logits, loss)


class EncoderBlock(nn.Module):
    """A pre-LN transformer encoder block: bidirectional attention with a padding mask, then a GELU MLP."""

    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d, bias=False)  # see the module docstring: a key bias gets only noise
        self.v = nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.ff_in = nn.Linear(d, 2 * d)
        self.ff_out = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = self.ln_1(x)
        q, k, v = (lin(h).view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for lin in (self.q, self.k, self.v))
        keep = attention_mask[:, None, None, :].bool()  # (B, 1, 1, T): which keys are real tokens
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.ff_out(F.gelu(self.ff_in(self.ln_2(x))))


class TinyBert(nn.Module):
    """BERT-like masked language model: token + position embeddings, encoder blocks, an MLM head."""

    def __init__(self, vocab: int = 128, max_len: int = 16, d: int = 192, n_layer: int = 2, n_head: int = 4):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(EncoderBlock(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head_dense = nn.Linear(d, d)
        self.head_ln = nn.LayerNorm(d)
        self.decoder = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x, attention_mask)
        h = self.head_ln(F.gelu(self.head_dense(self.ln_f(x))))
        return self.decoder(h)


def bert() -> Case:
    vocab, batch, seq, mask_id = 128, 2, 8, 1
    model = _build(3, lambda: TinyBert(vocab=vocab, max_len=16))

    def make_batch(step):
        g = _gen(step, 3)
        start = torch.randint(0, vocab - 2, (batch, 1), generator=g)
        ids = 2 + (start + torch.arange(seq)) % (vocab - 2)  # counting: a masked token follows from its neighbours
        attention_mask = torch.ones(batch, seq, dtype=torch.long)
        attention_mask[1, seq - 2 :] = 0  # the second sequence ends in two padding tokens
        masked = (torch.rand(batch, seq, generator=g) < 0.3) & attention_mask.bool()
        masked[:, 0] = True  # at least one prediction per sequence
        labels = torch.where(masked, ids, torch.full_like(ids, -100))  # -100: no loss at this position
        inputs = torch.where(masked, torch.full_like(ids, mask_id), ids)
        return Batch((inputs,), {"attention_mask": attention_mask}, target=labels)

    return Case(model, make_batch, lambda out, b: F.cross_entropy(out.flatten(0, 1), b.target.flatten()))


class SmallCNN(nn.Module):
    """Conv + BatchNorm + tanh stack on 4x4 maps: the BatchNorm running statistics are buffers that must
    end up right, and eval mode must use them. Convs before BatchNorm have no bias (BatchNorm removes it).
    Tanh, not ReLU: with a batch of two, ReLU's kinks make this net chaotic, and a last-bit difference in
    any kernel grows to 10^4x the tolerance within 50 steps."""

    def __init__(self, channels: int = 96, depth: int = 10, classes: int = 10):
        super().__init__()
        layers = [nn.Conv2d(3, channels, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(channels), nn.Tanh()]
        for _ in range(depth - 1):
            layers += [nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.Tanh()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def cnn_batchnorm() -> Case:
    model = _build(4, SmallCNN)
    teacher = torch.randn(10, 3 * 8 * 8, generator=_gen(0, 40))  # the labels a fixed linear classifier gives

    def make_batch(step):
        images = torch.randn(2, 3, 8, 8, generator=_gen(step, 4)) * 2 + 0.5  # not centred: BatchNorm has work
        return Batch((images,), target=(images.flatten(1) @ teacher.T).argmax(1))

    return Case(model, make_batch, lambda out, b: F.cross_entropy(out, b.target))


def frozen_layers() -> Case:
    """Fine-tuning-style freezing: frozen layers at the bottom (their grads are never needed), in the middle
    and at the top above trainable ones (the input gradient flows through their weights), and one layer
    with a frozen weight but a trainable bias."""
    width, depth, batch = 128, 12, 4
    trainable = [False, False, True, False, True, "bias", True, False, True, True, False, False]
    model = _build(5, lambda: _stack(width, depth, nn.Tanh))
    linears = [m for m in model if isinstance(m, nn.Linear)]
    for linear, mode in zip(linears, trainable, strict=True):
        linear.weight.requires_grad_(mode is True)
        linear.bias.requires_grad_(mode in (True, "bias"))
    return Case(model, lambda step: _regression_batch(step, 5, batch, width), _mse)


class ReusedModule(nn.Module):
    """One Linear called twice per forward, far apart: its bucket is needed again after others ran, and
    its gradient is the sum of both uses."""

    def __init__(self, width: int = 128, depth: int = 10):
        super().__init__()
        self.shared = nn.Linear(width, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        for layer in (self.shared, *self.layers):
            nn.init.normal_(layer.weight, std=1.5 / math.sqrt(width))  # keeps the signal alive through depth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = len(self.layers) // 2
        x = torch.tanh(self.shared(x))
        for layer in self.layers[:half]:
            x = torch.tanh(layer(x))
        x = torch.tanh(self.shared(x))
        for layer in self.layers[half:]:
            x = torch.tanh(layer(x))
        return x


def reused_module() -> Case:
    model = _build(6, ReusedModule)
    return Case(model, lambda step: _regression_batch(step, 6, 4, 128), _mse)


class LowDensity(nn.Module):
    """Terrible arithmetic density (as in torchao's CPU-offload tests): each weight element is used for
    two multiply-adds per step, so moving the bytes dominates and a copy that is not waited for shows up
    as wrong numbers. Each layer is Linear(32, 4096) followed by a fixed reduction back to 32 features;
    eight of them rather than one Linear(32, 131072), because a parameter never straddles two buckets and a
    single 16 MiB weight would leave no budget below the parameter bytes to stream in."""

    def __init__(self, features: int = 32, wide: int = 4096, depth: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(features, wide) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(x).view(x.shape[0], x.shape[1], -1)  # (B, features, wide / features)
            x = x + torch.tanh(h.sum(-1) / math.sqrt(h.shape[-1]))
        return x


def low_density() -> Case:
    model = _build(7, LowDensity)
    return Case(model, lambda step: _regression_batch(step, 7, 2, 32), _mse)


CASES: dict[str, Callable[[], Case]] = {
    "mlp": mlp,
    "gpt": gpt,
    "bert": bert,
    "cnn_batchnorm": cnn_batchnorm,
    "frozen_layers": frozen_layers,
    "reused_module": reused_module,
    "low_density": low_density,
}


def tanh_mlp(depth: int = 12, width: int = 32) -> nn.Sequential:
    """``depth`` x (Linear(width, width), Tanh), seeded 0: the small model the runtime's path tests train."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)
