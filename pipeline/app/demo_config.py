"""The demo's sizes (`DemoConfig`), apart from the demo itself so that the `hybridpipe demo`
command shows its defaults in ``--help`` without importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DemoConfig:
    """Sizes of the demo run; the defaults take a couple of minutes on 2 CPU cores."""

    steps: int = 400
    stages: int = 2
    schedule: str = "1f1b"
    microbatches: int = 4
    batch_size: int = 16
    seq_len: int = 64
    dim: int = 160
    layers: int = 6
    heads: int = 4
    lr: float = 5e-3
    seed: int = 0
