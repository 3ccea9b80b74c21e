"""The mixed-precision tests' models, batch, loss and reference: a pre-norm residual stack and
an MLP on float features, and the unsplit model run microbatch by microbatch under autocast that
a Pipeline must equal (bitwise, fp32 parameters; loss scaling as torch.amp.GradScaler does)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline import Pipeline

M = 4  # microbatches


class ResBlock(nn.Module):
    """A pre-norm residual block: the residual stream stays fp32 under autocast."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(F.gelu(self.norm(x)))


def res_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(ResBlock(16), ResBlock(16), ResBlock(16), ResBlock(16),
                         nn.Linear(16, 8))


def mlp_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))


def float_batch(step: int = 0, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(100 + step)
    return torch.randn(rows, 16), torch.randn(rows, 8)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def reference(
    model: nn.Module, x: Any, y: torch.Tensor, dtype: torch.dtype | None, *, scale: float = 1.0,
    loss_fn: Any = mse, microbatches: int = M,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The unsplit model microbatch by microbatch under autocast(dtype), fp32 parameters, the
    loss on the fp32 output; backward from loss * scale, grads divided by the scale."""
    ref = copy.deepcopy(model)
    ref.zero_grad()
    n = len(y)
    xs = (x.tensor_split(microbatches) if isinstance(x, torch.Tensor) else
          [{k: v.tensor_split(microbatches)[i] for k, v in x.items()}
           for i in range(microbatches)])
    total = torch.zeros(())
    for xm, ym in zip(xs, y.tensor_split(microbatches), strict=True):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = ref(**xm) if isinstance(xm, dict) else ref(xm)
        out = getattr(out, "logits", out)
        loss = loss_fn(out.float(), ym) * (len(ym) / n)
        (loss * scale).backward()
        total += loss.detach()
    return total, {k: p.grad / scale for k, p in ref.named_parameters() if p.grad is not None}


def assert_equal_run(
    pipe: Pipeline, model: nn.Module, loss: torch.Tensor, want: tuple[Any, dict[str, Any]],
    fp32: dict[str, torch.Tensor], label: str, tied: frozenset[str] = frozenset(),
) -> None:
    """Loss and every grad bitwise equal to `want` (a tied parameter to one fp32 rounding),
    and some grad different from the fp32 run's."""
    want_loss, want_grads = want
    torch.testing.assert_close(loss, want_loss, atol=0, rtol=0, msg=f"{label}: loss")
    got = dict(model.named_parameters())
    assert sorted(want_grads) == sorted(k for k, p in got.items() if p.grad is not None), label
    for k, g in want_grads.items():
        tol = 2e-6 if k in tied else 0.0
        torch.testing.assert_close(got[k].grad, g, atol=tol * g.abs().max().item(), rtol=tol,
                                   msg=f"{label}: grad of {k}")
    differs = max((got[k].grad - g).abs().max().item() for k, g in fp32.items())
    assert differs > 0, f"{label}: the grads equal the fp32 run's (autocast was dropped)"


def inject_overflow(module: nn.Module) -> Any:
    """Make the gradients reaching `module`'s outputs inf during the next backward."""

    def hook(_m: nn.Module, _i: Any, out: tuple[torch.Tensor, ...]) -> None:
        for t in out:
            if t.requires_grad:
                t.register_hook(lambda g: torch.full_like(g, float("inf")))

    return module.register_forward_hook(hook)
