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
