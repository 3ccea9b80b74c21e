"""The priced units of a transformer family at one (tp, microbatch size): the embedding, ONE
block (every block is the same, so its costs are replicated by layer count instead of
capturing 100+ layers) and the head with its loss, each built on meta at its shard shapes
and priced op by op (`pricing.price`), plus the block at tp=1 (sequence parallelism shards
its activations: Korthikanti et al.'s TP+SP row is the unsharded block's divided by tp)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.planning.hardware.targets import Target
from pipeline.planning.scale.graph import GraphSpec
from pipeline.planning.scale.pricing import UnitPrice, price
from pipeline.planning.scale.transformer import Embedding, Head, TransformerSpec, block

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Units:
    """Priced units for one microbatch of `microbatch_size` sequences at `tp`. For a
    captured graph (`GraphSpec`), `chain` holds all its units in order (and embed, head are
    its first and last, block and block_unsharded its first)."""

    embed: UnitPrice
    block: UnitPrice
    head: UnitPrice
    block_unsharded: UnitPrice
    tp: int
    microbatch_size: int
    chain: tuple[UnitPrice, ...] = ()


def _priced(spec: TransformerSpec, target: Target, precision: str, tp: int, mbs: int
            ) -> Units:
    dtype = DTYPES[precision]
    s, h = spec.seq, spec.hidden
    with torch.device("meta"):
        ids = torch.zeros(mbs, s, dtype=torch.long)
        x = torch.empty(mbs, s, h, dtype=dtype, requires_grad=True)
        embed = Embedding(spec, tp).to(dtype)
        head = Head(spec, tp).to(dtype)
        blocks = {t: block(spec, t).to(dtype) for t in {1, tp}}
    return Units(
        embed=price(embed, (ids,), target, s),
        block=price(blocks[tp], (x,), target, s, h),
        head=price(head, (x, ids), target, s),
        block_unsharded=price(blocks[1], (x,), target, s),
        tp=tp, microbatch_size=mbs,
    )


_CACHE: dict[tuple[TransformerSpec, str, str, int, int], Units] = {}



def priced_units(spec: TransformerSpec | GraphSpec, target: Target, precision: str, tp: int,
                 mbs: int) -> Units:
    """The family's units priced on `target` (cached per spec, target name, precision, tp
    and microbatch size: op prices do not depend on the network); a captured graph's
    units scaled to the microbatch."""
    if precision not in DTYPES:
        raise ValueError(f"precision {precision!r}: use one of {sorted(DTYPES)}")
    spec.check_tp(tp)
    if isinstance(spec, GraphSpec):
        chain = spec.scaled(mbs)
        return Units(chain[0], chain[0], chain[-1], chain[0], 1, mbs, chain)
    key = (spec, target.name, precision, tp, mbs)
    if key not in _CACHE:
        _CACHE[key] = _priced(spec, target, precision, tp, mbs)
    return _CACHE[key]
