"""Tiny configurations of the model families people bring (Hugging Face GPT-2, Llama, BERT,
ALBERT (one layer called several times), T5,
Mistral, GPT-NeoX, OPT; timm ViT, ConvNeXt, Swin and ResNet; the GPT `tok(idx) + pos[:T]`
idiom), each with a batch maker and a loss, shared by the local and distributed real-model
tests. Built from configs: no downloads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from tests.support.models import lm_loss

VOCAB = 48


@dataclass
class Spec:
    """A model factory, a batch maker `batch(rows, seq) -> (inputs, targets)` and a loss."""

    build: Callable[[], nn.Module]
    batch: Callable[[int, int], tuple[Any, torch.Tensor]]
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]


def class_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target)


def _tokens(rows: int, seq: int, mask: bool) -> tuple[Any, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, seq))
    target = torch.randint(0, VOCAB, (rows, seq))
    if not mask:
        return {"input_ids": ids}, target
    attention = torch.ones(rows, seq, dtype=torch.long)
    attention[0, seq // 2 :] = 0  # one padded row, so the mask matters
    return {"input_ids": ids, "attention_mask": attention}, target


def _images(rows: int, _: int) -> tuple[Any, torch.Tensor]:
    return torch.randn(rows, 3, 32, 32, dtype=torch.float64), torch.randint(0, 5, (rows,))


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=3, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    return model


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    return LlamaForCausalLM(config)


def bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0,
    )
    return BertForMaskedLM(config)


def albert(layers: int = 6) -> nn.Module:
    """One encoder layer called `layers` times (shared weights): one unit per call, so the
    calls spread over the stages and the layer's weights live on several of them."""
    from transformers import AlbertConfig, AlbertForMaskedLM

    config = AlbertConfig(
        vocab_size=VOCAB, embedding_size=8, hidden_size=16, num_hidden_layers=layers,
        num_attention_heads=2, intermediate_size=32, max_position_embeddings=32,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
    )
    return AlbertForMaskedLM(config)


def t5() -> nn.Module:
    """Encoder-decoder, one embedding tied to the encoder's, the decoder's and the LM head, and
    the default config (use_cache on, in a copy the decoder stack holds of its own)."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
        num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )
    model = T5ForConditionalGeneration(config)
    assert model.decoder.config.use_cache and model.lm_head.weight is model.shared.weight
    return model


def _seq2seq(rows: int, seq: int) -> tuple[Any, torch.Tensor]:
    inputs, target = _tokens(rows, seq, mask=True)
    inputs["decoder_input_ids"] = torch.randint(0, VOCAB, (rows, seq))
    return inputs, target


def mistral() -> nn.Module:
    """Grouped-query attention and a sliding window shorter than the sequence."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        sliding_window=4, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    return MistralForCausalLM(config)


def gpt_neox() -> nn.Module:
    """Parallel attention and MLP residual, rotary embedding on part of each head."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, max_position_embeddings=32, rotary_pct=0.5,
        hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
    )
    return GPTNeoXForCausalLM(config)


def opt() -> nn.Module:
    """Learned positions offset by 2 and computed from the attention mask."""
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(
        vocab_size=VOCAB, hidden_size=16, ffn_dim=32, num_hidden_layers=3,
        num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=16,
        dropout=0.0, attention_dropout=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )
    return OPTForCausalLM(config)


def swin() -> nn.Module:
    """Shifted windows with relative position bias tables (stochastic depth off: its default
    draws random numbers)."""
    import timm

    return timm.create_model(
        "swin_tiny_patch4_window7_224", pretrained=False, img_size=56, window_size=7,
        embed_dim=16, depths=(1, 1), num_heads=(2, 2), num_classes=5, drop_path_rate=0.0,
    )


def _images56(rows: int, _: int) -> tuple[Any, torch.Tensor]:
    return torch.randn(rows, 3, 56, 56, dtype=torch.float64), torch.randint(0, 5, (rows,))


def resnet() -> nn.Module:
    """BatchNorm in training mode: batch statistics, running statistics updated per call."""
    import timm

    return timm.create_model("resnet10t", pretrained=False, num_classes=5)


def vit() -> nn.Module:
    import timm

    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=16,
        depth=3, num_heads=2, num_classes=5,
    )


def convnext() -> nn.Module:
    import timm

    return timm.create_model(
        "convnext_atto", pretrained=False, depths=(1, 1, 2, 1), dims=(8, 16, 24, 32),
        num_classes=5,
    )


class PosGPT(nn.Module):
    """The everyday GPT idiom: a learned position table sliced by the sequence length."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16, layers: int = 3, max_seq: int = 32):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(max_seq, dim) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 2, 32, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


SPECS: dict[str, Spec] = {
    "gpt2": Spec(gpt2, lambda r, s: _tokens(r, s, mask=True), lm_loss),
    "llama": Spec(llama, lambda r, s: _tokens(r, s, mask=False), lm_loss),
    "bert": Spec(bert, lambda r, s: _tokens(r, s, mask=True), lm_loss),
    "albert": Spec(albert, lambda r, s: _tokens(r, s, mask=True), lm_loss),
    "t5": Spec(t5, _seq2seq, lm_loss),
    "mistral": Spec(mistral, lambda r, s: _tokens(r, s, mask=True), lm_loss),
    "gpt_neox": Spec(gpt_neox, lambda r, s: _tokens(r, s, mask=True), lm_loss),
    "opt": Spec(opt, lambda r, s: _tokens(r, s, mask=True), lm_loss),
    "swin": Spec(swin, _images56, class_loss),
    "vit": Spec(vit, _images, class_loss),
    "convnext": Spec(convnext, _images, class_loss),
    "pos_gpt": Spec(PosGPT, lambda r, s: (_tokens(r, s, mask=False)[0]["input_ids"],
                                          torch.randint(0, VOCAB, (r, s))), lm_loss),
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return SPECS[name].build().double()


def check_step(pipe: Any, model: nn.Module, ref: nn.Module, x: Any, y: Any,
               atol: float = 1e-9) -> None:
    """One `pipe.step(x, y)` against the unsplit `ref` (same weights): the loss and every
    parameter's gradient, to `atol`."""
    loss_fn = pipe.loss_fn
    assert loss_fn is not None
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    expected = loss_fn(ref(**x) if isinstance(x, dict) else ref(x), y)
    expected.backward()
    loss = pipe.step(x, y)
    torch.testing.assert_close(loss, expected.detach(), atol=atol, rtol=0)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(p.grad, ref_params[name].grad, atol=atol, rtol=0, msg=name)
