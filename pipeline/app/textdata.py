"""Demo training data that needs no download: byte-level token windows cut from the Python
standard library's own source files, read from the running interpreter."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch


def stdlib_corpus(max_bytes: int = 2_000_000) -> torch.Tensor:
    """The bytes of the interpreter's standard-library `.py` files (sorted, so the corpus is the
    same on every run), as a uint8 tensor of at most `max_bytes` bytes."""
    if max_bytes < 1024:
        raise ValueError(f"max_bytes={max_bytes} is too small; use at least 1024")
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        root = Path(os.__file__).parent
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        raise RuntimeError(f"no .py files found under {root}; cannot build the demo corpus")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


class TokenBatches:
    """Random (input, target) windows of `seq_len` tokens from a byte corpus; targets are the
    inputs shifted by one. A seeded generator makes the sequence of batches reproducible."""

    def __init__(self, corpus: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0) -> None:
        if corpus.numel() <= seq_len + 1:
            raise ValueError(
                f"corpus has {corpus.numel()} tokens, too few for seq_len={seq_len}; "
                "use a shorter seq_len or a larger corpus"
            )
        self.corpus = corpus.long()
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._draw(self.generator)

    def at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of step `step`, drawn from a generator seeded by (seed, step): the same
        whatever was drawn before, so a resumed run's data position is its step number."""
        return self._draw(torch.Generator().manual_seed(self.seed * 1_000_003 + step))

    def _draw(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(
            0, self.corpus.numel() - self.seq_len - 1, (self.batch_size,), generator=generator
        )
        offsets = torch.arange(self.seq_len + 1)
        windows = self.corpus[starts[:, None] + offsets[None, :]]
        return windows[:, :-1], windows[:, 1:]
