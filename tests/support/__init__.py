"""Helpers the tests share, by job: `distributed` (the multi-process launcher and worker
helpers), `models` (tiny GPT, token batches, lm_loss), `real_models` (small configs of Hugging
Face and timm models), `precision` (mixed-precision models and reference), `disk` (a full disk),
`graphs` (graphs with fixed costs), `capture_memo` (capture once per model). Test files import
from here, never from each other."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (subprocesses run from it)
