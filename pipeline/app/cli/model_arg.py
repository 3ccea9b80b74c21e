"""The MODEL argument of `profile` and `plan`: a built-in demo model, a transformer family by
size, a Hugging Face config by name (hf:MODEL_TYPE[,key=value,...]), torchvision:NAME or
package.module:factory, and random example inputs for it."""

from __future__ import annotations

import argparse
import difflib
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class _BuiltinModel:
    factory: str  # attribute of pipeline.app.models
    input_shape: tuple[int, ...]
    integer_input: int | None  # token vocabulary when the model takes integer ids
    summary: str


BUILTIN_MODELS: dict[str, _BuiltinModel] = {
    "gpt": _BuiltinModel("GPT", (8, 64), 256, "GPT-style LM, 4 blocks, byte vocabulary"),
    "mlp": _BuiltinModel("mlp_stack", (8, 256), None, "8 residual MLP blocks + read-out"),
    "skip": _BuiltinModel("SkipNet", (8, 32), None, "MLP chain with one long skip connection"),
    "skewed": _BuiltinModel("skewed_model", (8, 64), None, "cheap blocks + one heavy head"),
}


FAMILY_PREFIXES = ("gpt:", "llama:")
"""Transformer families by size (pipeline.planning.scale.transformer.parse_spec)."""

HF_PREFIX = "hf:"
HF_SEQ = 128
"""Tokens per example of an hf: MODEL unless its `seq=` says otherwise."""


def _value(text: str) -> int | float | bool | str:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def hf_config(spec: str) -> tuple[Any, int]:
    """(transformers config, tokens per example) of `hf:MODEL_TYPE[,key=value,...]`: the
    library's default config of that model type (e.g. gpt2, llama, mistral) with the given
    fields replaced (`seq=` sets the example length, default HF_SEQ)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    name, *fields = spec[len(HF_PREFIX):].split(",")
    if name not in CONFIG_MAPPING:
        close = difflib.get_close_matches(name, list(CONFIG_MAPPING.keys()), n=5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"MODEL {spec!r}: transformers has no model type {name!r}{hint}")
    overrides: dict[str, object] = {}
    for field in fields:
        key, sep, text = field.partition("=")
        if not sep or not key:
            raise ValueError(f"MODEL {spec!r}: {field!r} is not key=value "
                             "(e.g. hf:gpt2,n_layer=4,n_embd=256,seq=128)")
        overrides[key.strip()] = _value(text.strip())
    seq = overrides.pop("seq", HF_SEQ)
    if not isinstance(seq, int) or seq < 1:
        raise ValueError(f"MODEL {spec!r}: seq={seq!r}; give a positive number of tokens")
    config = AutoConfig.for_model(name, **overrides)
    return config, seq


def load_model(spec: str) -> nn.Module:
    """The model named by `spec`: a built-in name, gpt:... or llama:... (a transformer family
    by size), torchvision:NAME or package.module:factory."""
    from torch import nn

    if spec in BUILTIN_MODELS:
        from pipeline.app import models

        return getattr(models, BUILTIN_MODELS[spec].factory)()
    if spec.startswith(FAMILY_PREFIXES):
        from pipeline.planning.scale.transformer import TransformerLM, parse_spec

        return TransformerLM(parse_spec(spec))
    if spec.startswith(HF_PREFIX):
        from transformers import AutoModelForCausalLM

        config, _ = hf_config(spec)
        return AutoModelForCausalLM.from_config(config)
    if ":" not in spec:
        raise ValueError(
            f"unknown MODEL {spec!r}: give one of {', '.join(BUILTIN_MODELS)}, "
            "torchvision:NAME or package.module:factory"
        )
    where, name = spec.split(":", 1)
    if where == "torchvision":
        import torchvision

        available = torchvision.models.list_models()
        if name not in available:
            close = difflib.get_close_matches(name, available, n=5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"torchvision has no model {name!r}{hint}")
        model = torchvision.models.get_model(name, weights=None)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ValueError(
                f"cannot import {where!r} for MODEL {spec!r} ({exc}); check the module path "
                "and that it is importable from here (PYTHONPATH)"
            ) from exc
        factory = getattr(module, name, None)
        if not callable(factory):
            raise ValueError(f"{where} has no callable {name!r} for MODEL {spec!r}")
        model = factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"MODEL {spec!r} gave a {type(model).__name__}, not a torch.nn.Module")
    return model


def example_inputs(
    spec: str, shapes: Sequence[tuple[int, ...]] | None, dtype: str | None, vocab: int
) -> tuple[torch.Tensor, ...]:
    """Random example inputs for `spec` (shapes and dtype default to a built-in model's)."""
    import torch

    builtin = BUILTIN_MODELS.get(spec)
    if spec.startswith(FAMILY_PREFIXES):
        from pipeline.planning.scale.transformer import parse_spec

        family = parse_spec(spec)
        builtin = _BuiltinModel("", (8, family.seq), family.vocab, spec)
    elif spec.startswith(HF_PREFIX):
        config, seq = hf_config(spec)
        builtin = _BuiltinModel("", (8, seq), int(config.vocab_size), spec)
    if shapes is None:
        if builtin is None:
            raise ValueError(
                f"--input-shape is required for MODEL {spec!r} (e.g. --input-shape 8,3,224,224)"
            )
        shapes = [builtin.input_shape]
    tokens = builtin.integer_input if builtin is not None else None
    if dtype is None:
        dtype = "int64" if tokens else "float32"
    if tokens and dtype != "int64":
        raise ValueError(
            f"MODEL {spec!r} takes integer token ids, not {dtype}; drop --input-dtype or use int64"
        )
    high = tokens or vocab
    if dtype == "int64":
        return tuple(torch.randint(0, high, shape) for shape in shapes)
    return tuple(torch.randn(shape, dtype=getattr(torch, dtype)) for shape in shapes)


def model_and_inputs(args: argparse.Namespace) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The MODEL argument's model and example inputs (seeded; float64 when asked)."""
    import torch

    torch.manual_seed(args.seed)
    model = load_model(args.model)
    inputs = example_inputs(args.model, args.input_shape, args.input_dtype, args.vocab)
    if args.input_dtype == "float64":
        model = model.double()
    return model, inputs
