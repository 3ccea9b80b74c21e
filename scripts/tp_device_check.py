"""Tensor parallelism on real devices: two SGD steps of a tiny Hugging Face GPT-2 at tp=2
(pp=1 with 2 processes, pp=2 x tp=2 with 4) against the unsplit model on the same device, in
float32 (loss and every gradient within 1e-4) and under bf16 autocast (loss within 1e-2 of the
unsplit model under the same autocast, every gradient within 10% of its largest value there:
tp rounds each row-parallel partial product to bf16 before summing; and the run is really bf16:
the loss over 1e-4 off the fp32 model's, the last stage's logits bf16). Prints the figures and
exits non-zero on a mismatch.

Run (one process per GPU, NCCL, cuda:LOCAL_RANK):
    torchrun --nproc-per-node 2 scripts/tp_device_check.py
and the same on gloo/CPU: ``torchrun --nproc-per-node 2 scripts/tp_device_check.py --device cpu``.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pipeline import Pipeline  # noqa: E402
from tests.support.models import lm_loss  # noqa: E402
from tests.support.real_models import VOCAB, gpt2  # noqa: E402

ROWS, SEQ, LR = 4, 8, 0.1


def _build(device: torch.device, init: float | None) -> nn.Module:
    """The tiny GPT-2, seeded; `init` redraws its matrices with that std (so bf16 shows)."""
    torch.manual_seed(0)
    model = gpt2()
    if init is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, init)
    return model.to(device)


def _batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(900 + step)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    return ids.to(device), torch.randint(0, VOCAB, (ROWS, SEQ), generator=g).to(device)


def _reference(ref: nn.Module, x: torch.Tensor, y: torch.Tensor, microbatches: int,
               autocast: AbstractContextManager[Any] | None) -> float:
    """The unsplit model microbatch by microbatch (sum of loss_m * n_m / n), with backward."""
    total = 0.0
    for xm, ym in zip(x.tensor_split(microbatches), y.tensor_split(microbatches), strict=True):
        with autocast or nullcontext():
            logits = ref(input_ids=xm).logits
        loss = lm_loss(logits.float(), ym) * len(ym) / len(y)
        loss.backward()
        total += float(loss.detach())
    return total


def _whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _run(device: torch.device, pp: int, bf16: bool) -> list[str]:
    """Two SGD steps of the tp=2 pipeline and of the unsplit model; the mismatches found."""
    label = f"pp={pp} x tp=2 {'bf16 autocast' if bf16 else 'fp32'} on {device.type}"
    init = 0.3 if bf16 else None
    ref, fp32, model = (_build(device, init) for _ in range(3))
    microbatches = 2 * pp
    pipe = Pipeline(model, stages=pp, microbatches=microbatches, loss_fn=lm_loss,
                    balance="parameters", tensor_parallel=2,
                    mixed_precision=torch.bfloat16 if bf16 else None,
                    example_input={"input_ids": _batch(0, device)[0]})
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else None
    opts = [torch.optim.SGD(m, lr=LR) for m in (pipe.parameters(), ref.parameters(),
                                                  fp32.parameters())]
    want = dict(ref.named_parameters(remove_duplicate=False))
    failures = []
    for step in range(2):
        x, y = _batch(step, device)
        for m in (ref, fp32):
            m.zero_grad()
        pipe.zero_grad()
        expected = _reference(ref, x, y, microbatches, autocast)
        full = _reference(fp32, x, y, microbatches, None)
        loss = float(pipe.step({"input_ids": x}, y))
        gap, off = abs(loss - expected), abs(loss - full)
        worst, worst_rel = 0.0, 0.0
        for k, p in pipe.named_parameters():
            if p.grad is None:
                failures.append(f"{label}: {k} has no gradient")
                continue
            wanted = want[k].grad
            assert wanted is not None, f"{label}: the unsplit model's {k} has no gradient"
            diff = float((_whole(p.grad).float() - wanted).abs().max())
            scale = float(wanted.abs().max()) or 1.0
            worst, worst_rel = max(worst, diff), max(worst_rel, diff / scale)
        print(f"rank {dist.get_rank()} {label} step {step}: loss {loss:.6f}, unsplit "
              f"{expected:.6f} (off {gap:.1e}), fp32 unsplit {full:.6f} (off {off:.1e}); "
              f"largest gradient difference {worst:.1e} ({worst_rel:.1%} of that gradient's "
              f"largest value)", flush=True)
        if bf16:
            if not (gap < 1e-2 and off > 1e-4):
                failures.append(f"{label} step {step}: loss off autocast {gap:.1e}, off fp32 "
                                f"{off:.1e} (want < 1e-2 and > 1e-4)")
            if worst_rel > 0.1:
                failures.append(f"{label} step {step}: gradient {worst_rel:.1%} off (max 10%)")
        elif gap > 1e-4 or worst > 1e-4:
            failures.append(f"{label} step {step}: loss off {gap:.1e}, gradient off "
                            f"{worst:.1e} (max 1e-4)")
        for opt in opts:
            opt.step()
    _, out = pipe.evaluate({"input_ids": x}, y, return_outputs=True)
    if out is not None:  # the last stage's processes
        want_dtype = torch.bfloat16 if bf16 else torch.float32
        print(f"rank {dist.get_rank()} {label}: logits {out.logits.dtype}", flush=True)
        if out.logits.dtype != want_dtype:
            failures.append(f"{label}: logits {out.logits.dtype}, want {want_dtype}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 for the 1e-4 check
        torch.backends.cudnn.allow_tf32 = False
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    world = dist.get_world_size()
    if world not in (2, 4):
        raise SystemExit(f"run with 2 or 4 processes (tp=2, pp=world/2), not {world}")
    failures = _run(device, world // 2, bf16=False) + _run(device, world // 2, bf16=True)
    for line in failures:
        print(f"rank {dist.get_rank()} MISMATCH {line}", flush=True)
    flag = torch.tensor([float(bool(failures))], device=device)
    dist.all_reduce(flag)
    dist.destroy_process_group()
    if flag.item() > 0:
        return 1
    print(f"rank {int(os.environ.get('RANK', '0'))}: tp device check passed", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
