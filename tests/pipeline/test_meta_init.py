"""`pipeline.meta_init()`: parameters on meta, buffers real (accelerate's
``init_empty_weights(include_buffers=False)``), so a from-scratch meta build with buffers
computed in ``__init__`` trains with ``init_fn="reset_parameters"`` and nothing else."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import pipeline
from pipeline import Pipeline
from tests.support.models import lm_loss

DIM, SEQ, VOCAB = 16, 8, 32


class RotaryAttention(nn.Module):
    """Attention with a rotary-like table and a causal mask computed in __init__ (buffers no
    init function recomputes)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        inv = 1.0 / (10000 ** (torch.arange(0, DIM, 2, dtype=torch.float64) / DIM))
        angles = torch.outer(torch.arange(SEQ, dtype=torch.float64), inv)
        self.register_buffer("cos", angles.cos().repeat(1, 2), persistent=False)
        self.register_buffer("mask", torch.full((SEQ, SEQ), -math.inf).triu(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        s = x.size(1)
        scores = (q * self.cos[:s]) @ k.transpose(1, 2) / math.sqrt(DIM) + self.mask[:s, :s]
        return x + self.out(scores.softmax(-1) @ v)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, dtype=torch.float64)
        self.blocks = nn.ModuleList(RotaryAttention().double() for _ in range(4))
        self.head = nn.Linear(DIM, VOCAB, dtype=torch.float64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_meta_init_builds_parameters_on_meta_and_buffers_real() -> None:
    with pipeline.meta_init():
        model = Model()
        with pytest.raises(RuntimeError, match="do not nest"):
            with pipeline.meta_init():
                pass
    assert all(p.is_meta and isinstance(p, nn.Parameter) for p in model.parameters())
    real = Model()
    for (name, buf), (_, want) in zip(model.named_buffers(), real.named_buffers(), strict=True):
        assert not buf.is_meta and torch.equal(buf, want), name
    assert not nn.Linear(2, 2).weight.is_meta  # the patch is gone after the block


def test_meta_init_model_trains_exactly_at_two_stages() -> None:
    torch.manual_seed(0)
    with pipeline.meta_init():
        model = Model()
    pipe = Pipeline(model, stages=2, microbatches=2, loss_fn=lm_loss, init_fn="reset_parameters")
    x = torch.randint(0, VOCAB, (4, SEQ))
    y = torch.randint(0, VOCAB, (4, SEQ))
    loss = pipe.step(x, y)
    assert all(not t.is_meta for t in (*model.parameters(), *model.buffers()))
    reference = Model()  # the unsplit model with the weights the pipeline materialised
    reference.load_state_dict(pipe.state_dict())
    want = lm_loss(reference(x), y)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=0, atol=1e-10)
    grads = dict(pipe.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=0, atol=1e-10, msg=name)
