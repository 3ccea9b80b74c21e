"""Small reference models used by the demo, the CLI, tests and benchmarks: a GPT-style language
model, a residual MLP stack, a model with a long skip connection and a skewed (heavy-head) model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (scaled dot product, fused q/k/v projection)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads != 0:
            raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads})")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class TransformerBlock(nn.Module):
    """Pre-norm transformer layer: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-style language model: token + position embedding, N transformer blocks, final norm
    and an LM head. Input: token ids (batch, seq); output: logits (batch, seq, vocab)."""

    def __init__(
        self, vocab: int = 256, dim: int = 64, layers: int = 4, heads: int = 4, max_seq: int = 64
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, max_seq, dim))
        nn.init.normal_(self.pos, std=0.02)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[:, : idx.size(1)]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class ResidualMLP(nn.Module):
    """x + W2 gelu(W1 ln(x)): the MLP half of a transformer layer."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def mlp_stack(blocks: int = 8, dim: int = 256, hidden: int | None = None) -> nn.Sequential:
    """An MLP-transformer stack: `blocks` residual MLP blocks, then a linear read-out."""
    hidden = 4 * dim if hidden is None else hidden
    return nn.Sequential(*(ResidualMLP(dim, hidden) for _ in range(blocks)), nn.Linear(dim, dim))


class SkipNet(nn.Module):
    """A chain of blocks with one long skip connection: the stem's output is added back just
    before the head, so at 3+ stages it crosses two or more stage boundaries."""

    def __init__(self, dim: int = 32, blocks: int = 6, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Linear(dim, dim)
        self.blocks = nn.Sequential(*(ResidualMLP(dim, 2 * dim) for _ in range(blocks)))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.tanh(self.stem(x))
        return self.head(self.blocks(s) + s)


def skewed_model(dim: int = 64, cheap_blocks: int = 12, head_hidden: int = 2048) -> nn.Sequential:
    """Cheap blocks followed by one heavy head: splitting by layer or parameter count
    leaves the head's stage the bottleneck."""
    head = nn.Sequential(nn.Linear(dim, head_hidden), nn.GELU(), nn.Linear(head_hidden, dim))
    return nn.Sequential(*(ResidualMLP(dim, dim) for _ in range(cheap_blocks)), head)
