"""Model shapes for planning without weights: GPT-2, GPT-3, BERT and Llama-style transformers, built on
any device (the ``meta`` device for ``offload report`` and the scheduling benchmark: no memory, no
download). The modules have the parameter shapes and the call structure of the originals; details that
hold no parameters and little compute (rotary embeddings, dropout, attention masks) are left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class _Attention(nn.Module):
    def __init__(self, d: int, n_head: int, n_kv_head: int, bias: bool, fused: bool, causal: bool):
        super().__init__()
        self.n_head, self.n_kv_head, self.causal, self.fused = n_head, n_kv_head, causal, fused
        hd = d // n_head
        if fused:
            self.c_attn = nn.Linear(d, 3 * d, bias=bias)
        else:
            self.q_proj = nn.Linear(d, d, bias=bias)
            self.k_proj = nn.Linear(d, n_kv_head * hd, bias=bias)
            self.v_proj = nn.Linear(d, n_kv_head * hd, bias=bias)
        self.o_proj = nn.Linear(d, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hd = C // self.n_head
        if self.fused:
            q, k, v = self.c_attn(x).split(C, dim=2)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)
        k = k.view(B, T, self.n_kv_head, hd).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, hd).transpose(1, 2)
        if self.n_kv_head != self.n_head:  # grouped-query attention
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class _RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _Block(nn.Module):
    def __init__(self, cfg: "Shape"):
        super().__init__()
        llama = cfg.kind == "llama"
        norm = (lambda: _RMSNorm(cfg.d)) if llama else (lambda: nn.LayerNorm(cfg.d))
        self.ln_1, self.ln_2 = norm(), norm()
        self.attn = _Attention(cfg.d, cfg.n_head, cfg.n_kv_head or cfg.n_head, bias=not llama,
                               fused=cfg.kind in ("gpt2", "gpt3"), causal=cfg.kind != "bert")
        self.post_ln = cfg.kind == "bert"
        if llama:
            self.gate_proj = nn.Linear(cfg.d, cfg.ffn, bias=False)
            self.up_proj = nn.Linear(cfg.d, cfg.ffn, bias=False)
            self.down_proj = nn.Linear(cfg.ffn, cfg.d, bias=False)
        else:
            self.fc_in = nn.Linear(cfg.d, cfg.ffn)
            self.fc_out = nn.Linear(cfg.ffn, cfg.d)
        self.llama = llama

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.llama:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.fc_out(F.gelu(self.fc_in(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.post_ln:  # BERT: normalise after each residual add
            x = self.ln_1(x + self.attn(x))
            return self.ln_2(x + self.mlp(x))
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    """A decoder (GPT-2/3, Llama) or an encoder with an MLM head (BERT); returns the mean token loss."""

    def __init__(self, cfg: "Shape"):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d)
        self.wpe = nn.Embedding(cfg.n_ctx, cfg.d) if cfg.kind != "llama" else None
        self.wtt = nn.Embedding(2, cfg.d) if cfg.kind == "bert" else None  # BERT's token types
        self.ln_e = nn.LayerNorm(cfg.d) if cfg.kind == "bert" else None
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        if cfg.kind == "bert":
            self.head_dense, self.ln_f = nn.Linear(cfg.d, cfg.d), nn.LayerNorm(cfg.d)
        else:
            self.head_dense, self.ln_f = None, (_RMSNorm(cfg.d) if cfg.kind == "llama" else nn.LayerNorm(cfg.d))
        self.lm_head = nn.Linear(cfg.d, cfg.vocab, bias=cfg.kind == "bert")
        if cfg.tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        if self.wtt is not None:
            x = self.ln_e(x + self.wtt(torch.zeros_like(idx)))
        for block in self.blocks:
            x = block(x)
        if self.head_dense is not None:
            x = F.gelu(self.head_dense(x))
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), idx.flatten())


@dataclass(frozen=True)
class Shape:
    kind: str  # gpt2, gpt3, bert, llama
    vocab: int
    n_ctx: int
    d: int
    n_layer: int
    n_head: int
    ffn: int
    n_kv_head: int = 0  # 0: as many as query heads
    tied: bool = True

    def build(self, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32) -> Transformer:
        with torch.device(device):
            return Transformer(self).to(dtype)


MODELS: dict[str, Shape] = {
    "gpt2": Shape("gpt2", 50257, 1024, 768, 12, 12, 3072),
    "gpt2-medium": Shape("gpt2", 50257, 1024, 1024, 24, 16, 4096),
    "gpt2-large": Shape("gpt2", 50257, 1024, 1280, 36, 20, 5120),
    "gpt2-xl": Shape("gpt2", 50257, 1024, 1600, 48, 25, 6400),
    "gpt3-6.7b": Shape("gpt3", 50257, 2048, 4096, 32, 32, 16384),
    "bert-base": Shape("bert", 30522, 512, 768, 12, 12, 3072),
    "bert-large": Shape("bert", 30522, 512, 1024, 24, 16, 4096),
    "llama-7b": Shape("llama", 32000, 4096, 4096, 32, 32, 11008, tied=False),
    "llama-13b": Shape("llama", 32000, 4096, 5120, 40, 40, 13824, tied=False),
    "llama-30b": Shape("llama", 32000, 4096, 6656, 60, 52, 17920, tied=False),
    "llama-70b": Shape("llama", 32000, 4096, 8192, 80, 64, 28672, n_kv_head=8, tied=False),
}


def preset_inputs(shape: Shape, batch: int, seq: int, device="meta") -> Callable[[nn.Module], torch.Tensor]:
    """A function running one forward of a preset model on token ids; returns the loss."""
    if seq > shape.n_ctx and shape.kind != "llama":
        raise ValueError(f"sequence length {seq} exceeds this model's {shape.n_ctx} positions")
    idx = torch.zeros(batch, seq, dtype=torch.long, device=device)
    return lambda model: model(idx)
