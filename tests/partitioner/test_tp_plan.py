"""The tensor-parallel plan derived from a captured graph (one process, no process group):
Megatron pairs, attention by whole heads with grouped-query kv heads sharded or replicated,
a fused qkv replicated with its reason, a vocab-parallel token embedding and a column-parallel
LM head, replicated norms reported with their bytes, heads / vocab tp does not divide, and
plans given by module path globs."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from partitioner import capture
from partitioner.tp_plan import derive_tp_plan, given_tp_plan

VOCAB, DIM, SEQ = 32, 16, 6


class Attention(nn.Module):
    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, DIM // heads
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.k = nn.Linear(DIM, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(DIM, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.kv_heads != self.heads)
        return self.o(y.transpose(1, 2).reshape(b, t, DIM))


class Block(nn.Module):
    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention(heads, kv_heads)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Tiny(nn.Module):
    def __init__(self, heads: int = 4, kv_heads: int = 2, vocab: int = VOCAB) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block(heads, kv_heads) for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _plan(model: nn.Module, tp: int = 2):  # type: ignore[no-untyped-def]
    captured = capture(model, (torch.randint(0, 8, (2, SEQ)),), method="export")
    return derive_tp_plan(captured.graph_module, tp), captured


def test_megatron_pairs_heads_embedding_and_head() -> None:
    plan, _ = _plan(Tiny(heads=4, kv_heads=2))
    for i in range(2):
        a = f"blocks.{i}.attn"
        for proj in ("q", "k", "v"):  # column-parallel: nn.Linear's weight is (out, in)
            assert (plan.style(f"{a}.{proj}.weight"), plan.dim(f"{a}.{proj}.weight")) == \
                ("colwise", 0), plan
        assert (plan.style(f"{a}.o.weight"), plan.dim(f"{a}.o.weight")) == ("rowwise", 1)
        assert plan.dim(f"blocks.{i}.up.weight") == 0 and plan.dim(f"blocks.{i}.up.bias") == 0
        assert plan.dim(f"blocks.{i}.down.weight") == 1
        assert plan.style(f"blocks.{i}.down.bias") == "replicate"  # added once, after the sum
        assert plan.style(f"blocks.{i}.norm1.weight") == "replicate"
    assert (plan.style("tok.weight"), plan.dim("tok.weight")) == ("vocab", 0)
    assert plan.style("pos.weight") == "replicate"  # its indices are not an input
    assert (plan.style("head.weight"), plan.dim("head.weight")) == ("colwise", 0)
    # What stays replicated is reported with what it costs.
    kept = {p.name for p in plan.replicated}
    assert "norm.weight" in kept and "blocks.0.down.bias" in kept
    assert str(sum(p.bytes for p in plan.replicated)) in plan.describe()
    assert plan.bytes_per_rank() < sum(p.bytes for p in plan.params.values()) * 0.6


def test_grouped_query_and_heads_not_divisible() -> None:
    plan, _ = _plan(Tiny(heads=4, kv_heads=1))  # 1 kv head, tp=2: k, v replicated, q split
    assert plan.style("blocks.0.attn.q.weight") == "colwise"
    assert plan.style("blocks.0.attn.o.weight") == "rowwise"
    for proj in ("k", "v"):
        placed = plan.params[f"blocks.0.attn.{proj}.weight"]
        assert placed.dim is None and "kv heads not divisible" in placed.why, placed
    from pipeline.execution.tensor_parallel import _warn_undivided

    with pytest.warns(UserWarning, match=r"replicates 4 parameter\(s\) it does not divide"):
        _warn_undivided(plan)  # what the pass says when it applies this plan
    plan, _ = _plan(Tiny(heads=2, kv_heads=2), tp=4)  # 2 heads over 4 ranks: all replicated
    for proj in ("q", "k", "v", "o"):
        placed = plan.params[f"blocks.0.attn.{proj}.weight"]
        assert placed.dim is None and "heads not divisible" in placed.why, placed
    assert plan.style("blocks.0.up.weight") == "colwise"  # the MLP still splits (64 / 4)


def test_vocabulary_not_divisible_replicates_the_embedding_and_head() -> None:
    plan, _ = _plan(Tiny(vocab=33))
    for name in ("tok.weight", "head.weight"):
        placed = plan.params[name]
        assert placed.dim is None and "not divisible by 2" in placed.why, placed


def test_fused_qkv_split_per_chunk() -> None:
    """A fused q/k/v projection split into 3 equal chunks: each rank holds its heads of every
    chunk (strided), the output projection row-parallel; 3 heads over 2 ranks replicate."""
    from pipeline.app.models import GPT

    torch.manual_seed(0)
    captured = capture(GPT(vocab=VOCAB, dim=16, layers=2, heads=2, max_seq=8).double(),
                       (torch.randint(0, 8, (2, SEQ)),), method="export")
    plan = derive_tp_plan(captured.graph_module, 2)
    fused = [p for p in plan.params.values() if ".qkv." in p.name]
    assert len(fused) == 4 and all(p.dim == 0 and p.chunks == 3 for p in fused), plan
    assert all(p.style == "rowwise" for p in plan.params.values() if ".proj.weight" in p.name)
    assert "each of 3 fused chunks" in plan.describe()
    torch.manual_seed(0)
    captured = capture(GPT(vocab=VOCAB, dim=18, layers=1, heads=3, max_seq=8).double(),
                       (torch.randint(0, 8, (2, SEQ)),), method="export")
    plan = derive_tp_plan(captured.graph_module, 2)
    qkv = next(p for p in plan.params.values() if p.name.endswith("qkv.weight"))
    assert qkv.dim is None and "3 attention heads not divisible" in qkv.why, plan


def test_given_plan_by_module_globs() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel

    _, captured = _plan(Tiny())
    plan = given_tp_plan(captured.graph_module, 2, {
        "blocks.*.up": "colwise", "blocks.*.down": "rowwise", "blocks.*.attn.q": ColwiseParallel(),
        "nothing.*": "colwise",
    })
    assert plan.source == "given"
    assert plan.dim("blocks.1.up.weight") == 0 and plan.dim("blocks.1.up.bias") == 0
    assert plan.dim("blocks.1.down.weight") == 1 and plan.dim("blocks.1.down.bias") is None
    assert plan.dim("blocks.0.attn.q.weight") == 0
    assert plan.dim("blocks.0.attn.k.weight") is None  # no rule: replicated
    assert any("nothing.*" in note for note in plan.notes)
    with pytest.raises(ValueError, match="tp_plan\\['x'\\] is 'sideways'"):
        given_tp_plan(captured.graph_module, 2, {"x": "sideways"})
    with pytest.raises(ValueError, match="tensor_parallel must be an int >= 1"):
        derive_tp_plan(captured.graph_module, 0)


@pytest.mark.slow  # a Hugging Face Llama's capture: a few seconds
def test_hugging_face_base_model_tp_plan() -> None:
    """A Hugging Face model's own ``base_model_tp_plan`` as given rules: the same Megatron
    layout the derivation finds (q, k, v, gate, up colwise; o, down rowwise)."""
    from partitioner.tp_plan import hf_tp_plan
    from tests.support.real_models import llama

    torch.manual_seed(0)
    model = llama().double()
    rules = hf_tp_plan(model)
    assert rules is not None and "*layers.*.self_attn.q_proj" in rules, rules
    captured = capture(model, (), {"input_ids": torch.randint(0, 8, (2, SEQ))})
    given = given_tp_plan(captured.graph_module, 2, rules)
    derived = derive_tp_plan(captured.graph_module, 2)
    for proj, style in (("self_attn.q_proj", "colwise"), ("self_attn.o_proj", "rowwise"),
                        ("mlp.gate_proj", "colwise"), ("mlp.down_proj", "rowwise")):
        name = f"model.layers.1.{proj}.weight"
        assert given.style(name) == style and given.dim(name) == derived.dim(name), (
            given.params[name], derived.params[name])
    assert hf_tp_plan(nn.Linear(2, 2)) is None
