"""Model shapes for the benchmarks, built on the meta device (no weights, no downloads, no transformers),
and a trace of one training step recorded the way the engine records it (``offload.trace.Recorder``).

GPT-2 1.5B (GPT-2 XL's shape), BERT-large (with its masked-LM head) and a 6.7B-shaped GPT (GPT-3 6.7B's
width and depth). The modules are plain PyTorch, written for their parameter shapes and call order, which
is all the planners look at.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from offload.trace import Recorder, Trace


@dataclass(frozen=True)
class Shape:
    name: str
    kind: str  # "gpt" or "bert"
    layers: int
    width: int
    heads: int
    vocab: int
    context: int
    ffn: int


SHAPES = {
    "gpt2-1.5b": Shape("gpt2-1.5b", "gpt", layers=48, width=1600, heads=25, vocab=50257, context=1024, ffn=6400),
    "bert-large": Shape("bert-large", "bert", layers=24, width=1024, heads=16, vocab=30522, context=512, ffn=4096),
    "gpt-6.7b": Shape("gpt-6.7b", "gpt", layers=32, width=4096, heads=32, vocab=50257, context=2048, ffn=16384),
}


class Attention(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.heads = s.heads
        self.qkv = nn.Linear(s.width, 3 * s.width)
        self.out = nn.Linear(s.width, s.width)

    def forward(self, x, causal: bool):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.up = nn.Linear(s.width, s.ffn)
        self.down = nn.Linear(s.ffn, s.width)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm (GPT) or post-norm (BERT) transformer layer."""

    def __init__(self, s: Shape):
        super().__init__()
        self.pre_norm = s.kind == "gpt"
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(s.width), Attention(s), nn.LayerNorm(s.width), MLP(s)

    def forward(self, x):
        if self.pre_norm:
            x = x + self.attn(self.ln1(x), causal=True)
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.attn(x, causal=False))
        return self.ln2(x + self.mlp(x))


class GPT(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(s.vocab, s.width), nn.Embedding(s.context, s.width)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.ln_f = nn.LayerNorm(s.width)
        self.head = nn.Linear(s.width, s.vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as in GPT-2

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Bert(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.word, self.pos, self.segment = (nn.Embedding(s.vocab, s.width), nn.Embedding(s.context, s.width),
                                          nn.Embedding(2, s.width))
        self.ln = nn.LayerNorm(s.width)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.transform, self.head_ln = nn.Linear(s.width, s.width), nn.LayerNorm(s.width)
        self.decoder = nn.Linear(s.width, s.vocab)
        self.decoder.weight = self.word.weight  # tied, as in BERT's masked-LM head

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.ln(self.word(ids) + self.pos(positions) + self.segment(torch.zeros_like(ids)))
        for block in self.blocks:
            x = block(x)
        return self.decoder(self.head_ln(F.gelu(self.transform(x))))


def build(name: str) -> nn.Module:
    """The named model on the meta device."""
    s = SHAPES[name]
    with torch.device("meta"):
        return GPT(s) if s.kind == "gpt" else Bert(s)


class _Touches(TorchFunctionMode):
    def __init__(self, index: dict[int, int], recorder: Recorder):
        super().__init__()
        self.index, self.recorder = index, recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in (*args, *kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, torch.Tensor) and id(t) in self.index:
                    self.recorder.touch(self.index[id(t)])
        return func(*args, **kwargs)


def trace_step(model: nn.Module, batch: int = 1, seq: int | None = None) -> tuple[Trace, list[nn.Parameter]]:
    """One forward + backward on the meta device, recorded as the engine records a step: module calls,
    the parameters each touches, backward nodes reading saved parameters, gradient accumulations."""
    params = list(model.parameters())  # tied weights appear once
    index = {id(p): i for i, p in enumerate(params)}
    modules = {m: i for i, m in enumerate(model.modules())}
    rec = Recorder()
    handles = []
    for m in modules:
        handles.append(m.register_forward_pre_hook(lambda mod, args: rec.pre(modules[mod])))
        handles.append(m.register_forward_hook(lambda mod, args, out: rec.post(modules[mod])))
    for p in params:
        handles.append(p.register_post_accumulate_grad_hook(lambda p: rec.grad(index[id(p)], p.numel() * 2)))

    def pack(t):
        base = t._base if t._base is not None else t
        return index.get(id(base)), t

    def unpack(saved):
        p, t = saved
        if p is not None:
            rec.unpack(p, torch._C._current_autograd_node())
        return t

    shape = next(s for s in SHAPES.values() if isinstance(model, GPT if s.kind == "gpt" else Bert))
    ids = torch.zeros(batch, seq or shape.context, dtype=torch.long, device="meta")
    try:
        with _Touches(index, rec), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            loss = model(ids).float().mean()
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    return rec.finish(), params
