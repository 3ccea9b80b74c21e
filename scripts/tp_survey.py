"""Tensor parallelism on many architectures: each model, built from a tiny config (no download)
in float64, trains 2 SGD steps as ``Pipeline(model, stages=pp, tensor_parallel=2)`` on gloo
processes launched as torchrun does (pp=1 on 2 processes, pp=2 on 4) and is compared with the
unsplit model (loss, every gradient, the weights after each step).

    python scripts/tp_survey.py [NAME[:PP] ...]      # default: every model at pp=1 and pp=2

Prints one line per case (pass / FAIL with the first error line) and what the plan split."""

from __future__ import annotations

import json
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

VOCAB = 64
SEQ = 8
ROWS = 4
ATOL = 1e-9


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def class_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits, target)


def tokens(rows: int, g: torch.Generator) -> tuple[Any, torch.Tensor]:
    return ({"input_ids": torch.randint(0, VOCAB, (rows, SEQ), generator=g)},
            torch.randint(0, VOCAB - 1, (rows, SEQ), generator=g))


def tokens_masked(rows: int, g: torch.Generator) -> tuple[Any, torch.Tensor]:
    x, y = tokens(rows, g)
    mask = torch.ones(rows, SEQ, dtype=torch.long)
    mask[0, SEQ // 2:] = 0
    x["attention_mask"] = mask
    return x, y


def seq2seq(rows: int, g: torch.Generator) -> tuple[Any, torch.Tensor]:
    x, y = tokens(rows, g)
    x["decoder_input_ids"] = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    return x, y


def classes(rows: int, g: torch.Generator) -> tuple[Any, torch.Tensor]:
    x, _ = tokens(rows, g)
    return x, torch.randint(0, 4, (rows,), generator=g)


def images(rows: int, g: torch.Generator) -> tuple[Any, torch.Tensor]:
    return (torch.randn(rows, 3, 32, 32, generator=g, dtype=torch.float64),
            torch.randint(0, 6, (rows,), generator=g))


def vectors(rows: int, g: torch.Generator) -> tuple[Any, torch.Tensor]:
    return (torch.randn(rows, 24, generator=g, dtype=torch.float64),
            torch.randint(0, 6, (rows,), generator=g))


# -- the models -------------------------------------------------------------------------------

COMMON = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
DEC = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           max_position_embeddings=32, **COMMON)


def hf(config_name: str, model_name: str, **kw: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        config = getattr(transformers, config_name)(**kw)
        model = getattr(transformers, model_name)(config)
        if hasattr(model, "set_experts_implementation"):  # grouped_mm has no float64
            model.set_experts_implementation("eager")
        return model
    return build


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(24, 64), nn.GELU(), nn.Linear(64, 24), nn.ReLU(),
                         nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 6))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.c1(x))
        x = F.relu(self.c2(x))
        x = x.mean(dim=(2, 3))
        return self.fc2(F.relu(self.fc1(x)))


class OddMLP(nn.Module):
    """Widths tp=2 does not divide (hidden 33): replicated, with a warning."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(24, 33)
        self.down = nn.Linear(33, 24)
        self.head = nn.Linear(24, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.down(F.gelu(self.up(x))))


def timm_model(name: str, **kw: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, **kw)
    return build


def mixer() -> nn.Module:
    from timm.models.mlp_mixer import MlpMixer

    return MlpMixer(num_classes=6, img_size=32, patch_size=8, num_blocks=2, embed_dim=32)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[..., Any], Callable[..., Any]]] = {
    "gpt2": (hf("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_positions=32, n_embd=32,
                n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                bos_token_id=0, eos_token_id=0), tokens, lm_loss),
    "llama": (hf("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, **DEC),
              tokens, lm_loss),
    "mistral": (hf("MistralConfig", "MistralForCausalLM", num_key_value_heads=2,
                   sliding_window=4, **DEC), tokens_masked, lm_loss),
    "qwen2": (hf("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, **DEC),
              tokens, lm_loss),
    "qwen3": (hf("Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=2, head_dim=8, **DEC),
              tokens, lm_loss),
    "phi": (hf("PhiConfig", "PhiForCausalLM", partial_rotary_factor=0.5, resid_pdrop=0.0,
               embd_pdrop=0.0, attention_dropout=0.0, **DEC), tokens, lm_loss),
    "phi3": (hf("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=2, resid_pdrop=0.0,
                embd_pdrop=0.0, attention_dropout=0.0, **DEC), tokens, lm_loss),
    "gemma": (hf("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=2, head_dim=8, **DEC),
              tokens, lm_loss),
    "gemma2": (hf("Gemma2Config", "Gemma2ForCausalLM", num_key_value_heads=2, head_dim=8,
                  sliding_window=4, **DEC), tokens, lm_loss),
    "gpt_neox": (hf("GPTNeoXConfig", "GPTNeoXForCausalLM", rotary_pct=0.5, hidden_dropout=0.0,
                    attention_dropout=0.0, **DEC), tokens_masked, lm_loss),
    "opt": (hf("OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=32, ffn_dim=64,
               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32,
               word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, pad_token_id=0,
               bos_token_id=0, eos_token_id=0), tokens_masked, lm_loss),
    "falcon": (hf("FalconConfig", "FalconForCausalLM", vocab_size=VOCAB, hidden_size=32,
                  num_hidden_layers=2, num_attention_heads=4, hidden_dropout=0.0,
                  attention_dropout=0.0, bos_token_id=0, eos_token_id=0), tokens, lm_loss),
    "falcon_new": (hf("FalconConfig", "FalconForCausalLM", vocab_size=VOCAB, hidden_size=32,
                      num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                      new_decoder_architecture=True, hidden_dropout=0.0,
                      attention_dropout=0.0, bos_token_id=0, eos_token_id=0), tokens, lm_loss),
    "gptj": (hf("GPTJConfig", "GPTJForCausalLM", vocab_size=VOCAB, n_positions=32, n_embd=32,
                n_layer=2, n_head=4, rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0, bos_token_id=0, eos_token_id=0), tokens, lm_loss),
    "bloom": (hf("BloomConfig", "BloomForCausalLM", vocab_size=VOCAB, hidden_size=32,
                 n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0,
                 bos_token_id=0, eos_token_id=0, pad_token_id=0), tokens_masked, lm_loss),
    "codegen": (hf("CodeGenConfig", "CodeGenForCausalLM", vocab_size=VOCAB, n_positions=32,
                   n_ctx=32, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, resid_pdrop=0.0,
                   embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
                tokens, lm_loss),
    "gpt_bigcode": (hf("GPTBigCodeConfig", "GPTBigCodeForCausalLM", vocab_size=VOCAB,
                       n_positions=32, n_embd=32, n_layer=2, n_head=4, multi_query=True,
                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                       eos_token_id=0), tokens, lm_loss),
    "bert_mlm": (hf("BertConfig", "BertForMaskedLM", vocab_size=VOCAB, hidden_size=32,
                    num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                    max_position_embeddings=32, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, pad_token_id=0), tokens_masked, lm_loss),
    "roberta_cls": (hf("RobertaConfig", "RobertaForSequenceClassification", vocab_size=VOCAB,
                       hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, max_position_embeddings=40, num_labels=4,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       pad_token_id=1), classes, class_loss),
    "t5": (hf("T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB, d_model=32, d_kv=8,
              d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
              decoder_start_token_id=0, pad_token_id=0), seq2seq, lm_loss),
    "mixtral": (hf("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2,
                   num_local_experts=4, num_experts_per_tok=2, **DEC), tokens, lm_loss),
    "qwen2_moe": (hf("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_key_value_heads=2,
                     num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     shared_expert_intermediate_size=64, **DEC), tokens, lm_loss),
    "vit": (timm_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2,
                       num_heads=4, num_classes=6), images, class_loss),
    "mixer": (mixer, images, class_loss),
    "mlp": (mlp, vectors, class_loss),
    "convnet": (ConvNet, images, class_loss),
    "odd_mlp": (OddMLP, vectors, class_loss),
    "llama_kv1": (hf("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=1, **DEC),
                  tokens, lm_loss),
    "llama_heads3": (hf("LlamaConfig", "LlamaForCausalLM", **{**DEC, "hidden_size": 24,
                        "num_attention_heads": 3, "num_key_value_heads": 3, "vocab_size": 63}),
                     tokens, lm_loss),
}


# -- one case, on every process ---------------------------------------------------------------


def _whole(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _slice(x: Any, lo: int, hi: int) -> Any:
    if isinstance(x, dict):
        return {k: v[lo:hi] for k, v in x.items()}
    return x[lo:hi]


def _call(model: nn.Module, x: Any) -> Any:
    return model(**x) if isinstance(x, dict) else model(x)


def check(name: str, pp: int) -> dict[str, Any]:
    """Two SGD steps at pp x tp=2 (x dp for the rest of the world) against the unsplit model."""
    import warnings

    import torch.distributed as dist

    from pipeline import Pipeline

    build, batch, loss_fn = MODELS[name]
    torch.manual_seed(0)
    ref = build().double()
    torch.manual_seed(0)
    model = build().double()
    dp = dist.get_world_size() // (2 * pp)
    m = 2 * pp
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = Pipeline(model, stages=pp, schedule="1f1b", microbatches=m, loss_fn=loss_fn,
                        balance="parameters", tensor_parallel=2,
                        example_input=batch(ROWS, g)[0])
    ctx = pipe.distributed
    assert ctx is not None
    d = ctx.layout.dp_rank
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = dict(ref.named_parameters(remove_duplicate=False))
    for step in range(2):
        x, y = batch(ROWS * dp, torch.Generator().manual_seed(100 + step))
        ref.zero_grad()
        per = ROWS // m
        chunks = [(i * per, (i + 1) * per) for i in range(dp * m)]
        expected = sum(loss_fn(_call(ref, _slice(x, lo, hi)), y[lo:hi]) for lo, hi in chunks)
        expected = expected / len(chunks)
        expected.backward()
        pipe.zero_grad()
        loss = pipe.step(_slice(x, d * ROWS, (d + 1) * ROWS), y[d * ROWS:(d + 1) * ROWS])
        torch.testing.assert_close(loss.double(), expected.detach(), atol=ATOL, rtol=0,
                                   msg=f"loss of step {step}")
        for k, p in pipe.named_parameters():
            if want[k].grad is None:
                assert p.grad is None or not _whole(p.grad).any(), f"{k}: grad, none expected"
                continue
            assert p.grad is not None, f"{k} has no grad (step {step})"
            torch.testing.assert_close(_whole(p.grad), want[k].grad, atol=ATOL, rtol=0,
                                       msg=f"grad of {k}, step {step}")
        opt.step()
        ref_opt.step()
    plan = pipe.tp_plan
    assert plan is not None
    warned = [str(w.message)[:160] for w in caught if "tensor_parallel" in str(w.message)]
    return {"sharded": len(plan.sharded), "replicated": len(plan.replicated),
            "bytes_per_rank": plan.bytes_per_rank(), "bytes": sum(
                p.bytes for p in plan.params.values()), "warnings": warned,
            "notes": list(plan.notes)}


def worker(case: str, out: Path) -> None:
    import torch.distributed as dist

    name, pp = case.rsplit(":", 1)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        result: dict[str, Any] = {"ok": True, **check(name, int(pp))}
    except BaseException as e:  # noqa: BLE001 - recorded for the survey
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:1500],
                  "trace": traceback.format_exc()[-4000:]}
    (out / f"result{dist.get_rank()}.json").write_text(json.dumps(result))
    print(json.dumps(result)[:3000], flush=True)


def main(cases: list[str]) -> None:
    from tests.support.distributed import HF_MODULES, launch

    chosen: list[str] = []
    for c in cases or list(MODELS):
        chosen.extend([c] if ":" in c else [f"{c}:1", f"{c}:2"])
    summary = {}
    for case in chosen:
        pp = int(case.rsplit(":", 1)[1])
        out = Path(tempfile.mkdtemp(prefix="tp-survey-"))
        try:
            ended = launch(case, 2 * pp, out, script=__file__, deadline=240.0, timeout=60.0,
                           preload=HF_MODULES)
            results = [json.loads(p.read_text()) for p in sorted(out.glob("result*.json"))]
            bad = [r for r in results if not r["ok"]]
            if len(results) < len(ended):
                line = "FAIL: a rank wrote no result: " + ended[-1].output[-600:]
            elif bad:
                line = "FAIL: " + bad[0]["error"].splitlines()[0][:300]
            else:
                r = results[0]
                line = (f"pass  sharded {r['sharded']} replicated {r['replicated']} "
                        f"bytes/rank {r['bytes_per_rank']}/{r['bytes']} "
                        f"warn {len(r['warnings'])} notes {r['notes']}")
        except AssertionError as e:
            line = f"FAIL (hang/launch): {str(e)[:300]}"
        summary[case] = line
        print(f"{case:16s} {line}  [{out}]", flush=True)
    (Path(tempfile.gettempdir()) / "tp_survey.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 3 and ":" in sys.argv[1] and Path(sys.argv[2]).is_dir():
        worker(sys.argv[1], Path(sys.argv[2]))
    else:
        main(sys.argv[1:])
