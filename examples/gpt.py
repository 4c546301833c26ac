"""A small GPT in one file, nanoGPT-style.

Token + position embeddings, pre-LayerNorm transformer blocks (causal self-attention and a GELU MLP),
a final LayerNorm and a language-model head whose weight is the token embedding's (weight tying).
Used by examples/train_gpt.py and, at toy sizes, by the tests (tests/support/models.py).
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256  # byte-level: one token per byte value
    block_size: int = 128  # longest sequence the position embedding covers
    n_layer: int = 6  # number of transformer blocks
    n_head: int = 8  # attention heads per block; must divide n_embd
    n_embd: int = 256  # width of the residual stream
    dropout: float = 0.0  # dropout in embeddings, attention and MLP; 0 keeps training deterministic
    bias: bool = True  # biases in the Linear and LayerNorm layers
    init_seed: int = 0  # seed of the weight init: the same config always builds the same weights


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_head must divide n_embd"
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embedding
        self.wpe = nn.Embedding(config.block_size, config.n_embd)  # position embedding
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying (Press & Wolf, 2017): one tensor embeds tokens and scores them. model.parameters()
        # lists it once; model.state_dict() lists it under both names.
        self.lm_head.weight = self.wte.weight
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        # GPT-2's init, drawn from a private generator so the result does not depend on the global RNG.
        g = torch.Generator().manual_seed(self.config.init_seed)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and module is not self.lm_head:  # lm_head: tied
                module.weight.normal_(0.0, 0.02, generator=g)
            if isinstance(module, (nn.Linear, nn.LayerNorm)) and module.bias is not None:
                module.bias.zero_()
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
        # Residual projections are scaled down by the depth so the residual stream does not grow with it.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                p.normal_(0.0, 0.02 / math.sqrt(2 * self.config.n_layer), generator=g)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # the tied weight counts once

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.size()
        assert T <= self.config.block_size, f"sequence of {T} tokens, block_size is {self.config.block_size}"
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
