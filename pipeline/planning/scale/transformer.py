"""Transformer families by size, the MODEL forms `gpt:...` and `llama:...`: a parsed
`TransformerSpec`, and its three kinds of unit as plain modules (`Embedding`, `GPTBlock` /
`LlamaBlock`, `Head`) at any tensor-parallel degree (each rank's shard: heads, MLP width and
vocabulary divided by tp, as Megatron's column/row-parallel pairs cut them), and the whole
model `TransformerLM` of those units.

- gpt (GPT-3 style): learned positions, LayerNorm, GELU MLP of `ffn` (4 x hidden by
  default), dropout (0.1 by default, as Megatron's GPT), biases, head tied to the embedding;
- llama: rotary positions, RMSNorm, SwiGLU MLP of `ffn`, grouped-query attention with
  `kv_heads`, no biases, untied head, no dropout;
- attention "flash": one fused kernel, no s x s scores held (SDPA's fused kernels);
  "math": the scores, softmax and dropout materialised and held (Megatron before fusion).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

FAMILIES = ("gpt", "llama")
ATTENTIONS = ("flash", "math")


@dataclass(frozen=True)
class TransformerSpec:
    """A decoder-only transformer by size; `kv_heads` and `ffn` default to `heads` and
    4 x hidden (gpt) or Llama's 2/3 x 4 x hidden rounded up to 256 (llama)."""

    family: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    kv_heads: int = 0
    ffn: int = 0
    attention: str = "flash"
    dropout: float = -1.0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown family {self.family!r}; use one of {FAMILIES}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention={self.attention!r}: use one of {ATTENTIONS}")
        for name in ("layers", "hidden", "heads", "vocab", "seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"{self.family}: {name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden={self.hidden} is not a multiple of heads={self.heads}; pick heads "
                "that divide hidden"
            )
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.ffn == 0:
            ffn = 4 * self.hidden if self.family == "gpt" else (
                256 * math.ceil(8 * self.hidden / 3 / 256))
            object.__setattr__(self, "ffn", ffn)
        if self.dropout < 0:
            object.__setattr__(self, "dropout", 0.1 if self.family == "gpt" else 0.0)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def check_tp(self, tp: int) -> None:
        """Raise unless heads, MLP width and vocabulary split evenly over `tp` ranks."""
        bad = [f"{n}={v}" for n, v in (("heads", self.heads), ("ffn", self.ffn),
                                        ("vocab", self.vocab)) if v % tp]
        if bad:
            raise ValueError(f"tp={tp} does not divide {', '.join(bad)}; choose a tp that does")

    def parameters(self) -> int:
        """The model's parameter count (tied embedding counted once)."""
        h, d = self.hidden, self.head_dim
        if self.family == "gpt":
            block = 4 * h * h + 4 * h + 2 * h * self.ffn + self.ffn + h + 4 * h
            return self.layers * block + (self.vocab + self.seq) * h + 2 * h
        attn = h * h + 2 * h * self.kv_heads * d + h * h
        block = attn + 3 * h * self.ffn + 2 * h
        return self.layers * block + 2 * self.vocab * h + h


def parse_spec(text: str) -> TransformerSpec:
    """`gpt:layers=L,hidden=H,heads=A,vocab=V,seq=S[,attention=flash|math,ffn=,dropout=]`
    or `llama:layers=,hidden=,heads=,kv_heads=,ffn=,vocab=,seq=[,attention=]`."""
    family, _, rest = text.partition(":")
    if family not in FAMILIES:
        raise ValueError(f"{text!r} is not a family spec; start it with one of "
                         f"{', '.join(f + ':' for f in FAMILIES)}")
    known = {f.name: f.type for f in fields(TransformerSpec) if f.name != "family"}
    values: dict[str, object] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in known:
            raise ValueError(f"{text!r}: bad item {item!r}; give key=value with keys "
                             f"{', '.join(known)}")
        try:
            values[key] = value if key == "attention" else (
                float(value) if key == "dropout" else int(value))
        except ValueError:
            raise ValueError(f"{text!r}: {key}={value!r} is not a number") from None
    missing = [k for k in ("layers", "hidden", "heads", "vocab", "seq") if k not in values]
    if missing:
        raise ValueError(f"{text!r} lacks {', '.join(missing)} (e.g. gpt:layers=24,"
                         "hidden=2048,heads=16,vocab=51200,seq=2048)")
    return TransformerSpec(family, **values)  # type: ignore[arg-type]


def _dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()


class Embedding(nn.Module):
    """Token embedding (this rank's 1/tp of the vocabulary), plus learned positions and
    dropout for gpt."""

    def __init__(self, spec: TransformerSpec, tp: int = 1) -> None:
        super().__init__()
        self.tokens = nn.Embedding(spec.vocab // tp, spec.hidden)
        self.positions = nn.Embedding(spec.seq, spec.hidden) if spec.family == "gpt" else None
        self.drop = _dropout(spec.dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids)
        if self.positions is not None:
            x = x + self.positions.weight[: ids.shape[1]]
        return self.drop(x)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, math_mode: bool,
               bias: torch.Tensor | None, p: float, training: bool) -> torch.Tensor:
    """Causal attention over (batch, heads, seq, head_dim); k and v may have fewer heads."""
    if math_mode:
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        if bias is not None:
            scores = scores + bias
        probs = F.dropout(torch.softmax(scores, dim=-1), p, training)
        return probs @ v
    return F.scaled_dot_product_attention(q, k, v, dropout_p=p if training else 0.0,
                                          is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class _Attention(nn.Module):
    causal: torch.Tensor | None

    def __init__(self, spec: TransformerSpec, tp: int) -> None:
        super().__init__()
        h, d = spec.hidden, spec.head_dim
        self.heads, self.kv = spec.heads // tp, max(1, spec.kv_heads // tp)
        self.head_dim, self.p = d, spec.dropout
        bias = spec.family == "gpt"
        self.qkv = nn.Linear(h, (self.heads + 2 * self.kv) * d, bias=bias)
        self.out = nn.Linear(self.heads * d, h, bias=bias)
        self.math = spec.attention == "math"
        self.register_buffer(
            "causal", torch.full((spec.seq, spec.seq), float("-inf")).triu(1)
            if self.math else None, persistent=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
                ) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.heads + 2 * self.kv, self.head_dim).transpose(1, 2)
        q, k, v = qkv.split([self.heads, self.kv, self.kv], dim=1)
        if rope is not None:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        bias = None if self.causal is None else self.causal[:s, :s].to(x.dtype)
        y = _attention(q, k, v, self.math, bias, self.p, self.training)
        return self.out(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class GPTBlock(nn.Module):
    """Pre-norm GPT block: LayerNorm, attention, dropout, residual; LayerNorm, GELU MLP,
    dropout, residual (this rank's shard at tp)."""

    def __init__(self, spec: TransformerSpec, tp: int = 1) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(spec.hidden), nn.LayerNorm(spec.hidden)
        self.attn = _Attention(spec, tp)
        self.fc1 = nn.Linear(spec.hidden, spec.ffn // tp)
        self.fc2 = nn.Linear(spec.ffn // tp, spec.hidden)
        self.drop1, self.drop2 = _dropout(spec.dropout), _dropout(spec.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop1(self.attn(self.ln1(x), None))
        return x + self.drop2(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class LlamaBlock(nn.Module):
    """Pre-norm Llama block: RMSNorm, rotary grouped-query attention, residual; RMSNorm,
    SwiGLU MLP, residual (this rank's shard at tp)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, spec: TransformerSpec, tp: int = 1) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(spec.hidden), nn.RMSNorm(spec.hidden)
        self.attn = _Attention(spec, tp)
        self.gate = nn.Linear(spec.hidden, spec.ffn // tp, bias=False)
        self.up = nn.Linear(spec.hidden, spec.ffn // tp, bias=False)
        self.down = nn.Linear(spec.ffn // tp, spec.hidden, bias=False)
        d = spec.head_dim
        angles = torch.outer(torch.arange(spec.seq).float(),
                             10000.0 ** (-torch.arange(0, d, 2).float() / d)).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        rope = (self.cos[:s].to(x.dtype), self.sin[:s].to(x.dtype))
        x = x + self.attn(self.norm1(x), rope)
        y = self.norm2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Head(nn.Module):
    """Final norm and the vocabulary projection (this rank's 1/tp of it); with `targets`,
    the mean cross-entropy loss (computed in fp32) instead of the logits."""

    def __init__(self, spec: TransformerSpec, tp: int = 1) -> None:
        super().__init__()
        gpt = spec.family == "gpt"
        self.norm = nn.LayerNorm(spec.hidden) if gpt else nn.RMSNorm(spec.hidden)
        self.proj = nn.Linear(spec.hidden, spec.vocab // tp, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.proj(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def block(spec: TransformerSpec, tp: int = 1) -> nn.Module:
    """One transformer block of the family, this rank's shard at `tp`."""
    spec.check_tp(tp)
    return GPTBlock(spec, tp) if spec.family == "gpt" else LlamaBlock(spec, tp)


class TransformerLM(nn.Module):
    """The whole model (tp=1) as its units in order: embedding, `layers` blocks, head
    producing logits. The gpt head's weight is the embedding's (tied)."""

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed = Embedding(spec)
        self.blocks = nn.Sequential(*(block(spec) for _ in range(spec.layers)))
        self.head = Head(spec)
        if spec.family == "gpt":
            self.head.proj.weight = self.embed.tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


def with_attention(spec: TransformerSpec, attention: str) -> TransformerSpec:
    """`spec` with another attention implementation."""
    return replace(spec, attention=attention)
