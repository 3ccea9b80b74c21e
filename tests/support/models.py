"""The small models, batches and losses many tests share: a tiny float64 GPT (vocabulary 32,
dim 16, 4 layers), seeded token batches, and the language-model loss (on a tensor or on a
Hugging Face output's logits)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipeline.app.models import GPT

VOCAB, SEQ = 32, 6


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def make_model(seed: int = 0, dim: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    return GPT(vocab=VOCAB, dim=dim, layers=4, heads=2, max_seq=8).double()


def token_batch(step: int, rows: int = 8, *, seq: int = SEQ, vocab: int = VOCAB,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of step `step`: random tokens from generator seed `seed + step`."""
    g = torch.Generator().manual_seed(seed + step)
    x = torch.randint(0, vocab, (rows, seq), generator=g)
    return x, torch.randint(0, vocab, (rows, seq), generator=g)


def global_batch(step: int, rows: int, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of step `step` over all replicas (replica d takes its slice of `rows`)."""
    return token_batch(step, rows, seq=seq, seed=1000)


class BNNet(nn.Module):
    """BatchNorm and dropout between linear layers, with residuals (not an nn.Sequential, so
    torch.export captures it and bakes the train/eval mode into its ops)."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(dropout), nn.Linear(8, 8))
            for _ in range(3)
        )
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def bn_model(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return BNNet(dropout).double()


def bn_batch(seed: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 inputs for `bn_model` and class targets, drawn by `seed`."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (rows,), generator=g))


def microbatched_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, m: int,
                      backward: bool) -> torch.Tensor:
    """The unsplit model on a pipeline's `m` microbatches: the sum of loss_m * n_m / n (with
    each microbatch's backward when asked), as `Pipeline.step` computes it."""
    total = torch.zeros((), dtype=torch.float64)
    for xm, ym in zip(x.tensor_split(m), y.tensor_split(m), strict=True):
        loss = F.cross_entropy(model(xm), ym) * len(xm) / len(x)
        if backward:
            loss.backward()
        total += loss.detach()
    return total
