"""Hybrid data x pipeline parallel training of a GPT-style model on CPU, launched by torchrun.

    torchrun --nproc-per-node 4 examples/train_hybrid.py --stages 2

runs 2 pipeline stages x 2 data-parallel replicas (world size 4): ranks 0-1 are replica 0's
pipeline, ranks 2-3 replica 1's; ranks {0, 2} and {1, 3} average their gradients. Each replica
trains on its own batches of byte windows from the Python standard library's source. Rank 0
prints the loss (mean over replicas) and the step time; the script ends with a checkpoint that
any layout can resume from (``--resume``). Several nodes: see pipeline.execution.distributed.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F

from pipeline import Pipeline
from pipeline.app.models import GPT
from pipeline.app.textdata import TokenBatches, stdlib_corpus


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    parser.add_argument("--schedule", default="1f1b", help="schedule name (default 1f1b)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16, help="samples per replica per step")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint", default="hybrid-checkpoint")
    parser.add_argument("--resume", action="store_true", help="start from --checkpoint")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same initial weights in every process
    model = GPT(vocab=256, dim=args.dim, layers=args.layers, heads=4, max_seq=args.seq)
    x0 = torch.zeros(args.batch, args.seq, dtype=torch.long)
    pipe = Pipeline(model, stages=args.stages, schedule=args.schedule,
                    microbatches=args.microbatches, loss_fn=lm_loss, balance="parameters",
                    example_input=x0)
    ctx = pipe.distributed
    if ctx is None:
        raise SystemExit("run this script with torchrun (see its docstring)")
    layout = ctx.layout
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    start = 0
    if args.resume:
        start = pipe.load_checkpoint(args.checkpoint, optimizer=optimizer)["step"]
    data = TokenBatches(stdlib_corpus(), args.batch, args.seq, seed=layout.dp_rank)
    if layout.rank == 0:
        print(f"world {layout.world_size} = data_parallel {layout.data_parallel} x stages "
              f"{layout.stages}; schedule {args.schedule}, {args.microbatches} microbatches",
              flush=True)
    times = []
    for step in range(start, start + args.steps):
        x, y = data.next()
        t0 = time.perf_counter()
        pipe.zero_grad()
        loss = pipe.step(x, y)
        optimizer.step()
        times.append(time.perf_counter() - t0)
        if layout.rank == 0 and (step % 5 == 0 or step == start + args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  step time {1e3 * times[-1]:.1f} ms",
                  flush=True)
    pipe.save_checkpoint(args.checkpoint, optimizer=optimizer, extra={"step": start + args.steps})
    if layout.rank == 0:
        steady = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
        print(f"median step time {1e3 * steady:.1f} ms; checkpoint written to {args.checkpoint}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
