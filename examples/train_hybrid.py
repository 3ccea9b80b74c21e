"""Hybrid data x pipeline parallel training of a GPT-style model on CPU, launched by torchrun,
that survives restarts: it resumes from its checkpoint directory at whatever world size it
gets, with the same global batch.

    torchrun --nproc-per-node 4 examples/train_hybrid.py --stages 2

runs 2 pipeline stages x 2 data-parallel replicas (world size 4): ranks 0-1 are replica 0's
pipeline, ranks 2-3 replica 1's; ranks {0, 2} and {1, 3} average their gradients. Every step
draws one global batch of byte windows from the Python standard library's source (by step
number) and each replica trains on its share; a replica runs global batch / data_parallel /
--microbatch-size microbatches, so fewer replicas run more microbatches of the same size and
the losses do not depend on the layout. A `pipeline.Checkpointer` saves every --save-every
steps into --checkpoint (out/hybrid-checkpoint; keeping --keep versions, asynchronously with
--async-save) and, at start, resumes from its live version if there is one (at any layout):
run the command again with a larger --steps to train on. Under
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:2 --max-restarts 3 ...`` a run that
loses a machine restarts on the survivors and carries on
(tests/pipeline/elastic/test_elastic_fault.py).
``--stages auto`` lets the auto-planner choose (stages, data_parallel) for the world. Several
nodes: see docs/distributed.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F

from pipeline import Checkpointer, Pipeline
from pipeline.app.models import GPT
from pipeline.app.textdata import TokenBatches, stdlib_corpus
from pipeline.elastic import replica_share


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _log(path: str, record: dict[str, object]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def main() -> None:
    started = time.time()  # the process's start (after its imports), for --losses
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default="2", help="pipeline stages, or 'auto' (default 2)")
    parser.add_argument("--schedule", default="1f1b", help="schedule name (default 1f1b)")
    parser.add_argument("--steps", type=int, default=30, help="train until this step")
    parser.add_argument("--global-batch", type=int, default=32, help="samples per step, all "
                        "replicas together")
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--checkpoint", default="out/hybrid-checkpoint",
                        help="checkpoint directory: resumed from when it exists")
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--keep", type=int, default=2, help="checkpoint versions kept")
    parser.add_argument("--async-save", action="store_true", help="save in the background")
    parser.add_argument("--memory-limit", type=float, default=None, help="bytes per process "
                        "(for --stages auto)")
    parser.add_argument("--losses", default=None, help="rank 0 appends a JSON line per step "
                        "(and one at the start)")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep after "
                        "each step (to watch a run)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    # Every collective (the checkpoints' included) fails after a minute rather than hanging.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)  # the same initial weights in every process
    dtype = getattr(torch, args.dtype)
    model = GPT(vocab=256, dim=args.dim, layers=args.layers, heads=4, max_seq=args.seq).to(dtype)
    data = TokenBatches(stdlib_corpus(), args.global_batch, args.seq, seed=0)
    x0, _ = data.at(0)
    if args.stages == "auto":
        pipe = Pipeline(model, stages="auto", schedule=args.schedule, loss_fn=lm_loss,
                        memory_limit=args.memory_limit, example_input=x0)
    else:
        stages = int(args.stages)
        dp = dist.get_world_size() // stages
        pipe = Pipeline(model, stages=stages, schedule=args.schedule,
                        microbatches=max(1, args.global_batch // dp // args.microbatch_size),
                        loss_fn=lm_loss, balance="parameters",
                        example_input=replica_share(x0, dp, dist.get_rank() // stages))
    ctx = pipe.distributed
    if ctx is None:
        raise SystemExit("run this script with torchrun (see its docstring)")
    layout = ctx.layout
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    ckpt = Checkpointer(pipe, args.checkpoint, optimizer, every=args.save_every, keep=args.keep,
                        async_save=args.async_save)
    resumed = ckpt.resume()
    start = resumed.step if resumed is not None else 0
    if layout.rank == 0:
        print(f"world {layout.world_size} = data_parallel {layout.data_parallel} x stages "
              f"{layout.stages}; schedule {pipe.schedule.name}, {pipe.microbatches} "
              f"microbatches per replica; {resumed or 'starting afresh'}", flush=True)
        if start >= args.steps:
            print(f"nothing to train: {args.checkpoint} is at step {start} and --steps is "
                  f"{args.steps}; pass --steps {start + args.steps} to train on, or another "
                  "--checkpoint (or remove this one) to start afresh", flush=True)
        if args.losses:
            _log(args.losses, {"event": "start", "time": time.time(), "started": started,
                               "resumed": None if resumed is None else resumed.step})
    times = []
    for step in range(start, args.steps):
        x, y = data.at(step)
        t0 = time.perf_counter()
        pipe.zero_grad()
        loss = pipe.step(replica_share(x, layout.data_parallel, layout.dp_rank),
                         replica_share(y, layout.data_parallel, layout.dp_rank))
        optimizer.step()
        ckpt.maybe_save(step + 1)
        times.append(time.perf_counter() - t0)
        if layout.rank == 0:
            if args.losses:
                _log(args.losses, {"step": step, "loss": loss.item(), "time": time.time(),
                                   "stages": layout.stages, "data_parallel": layout.data_parallel})
            if step % 5 == 0 or step == args.steps - 1:
                print(f"step {step:4d}  loss {loss.item():.4f}  step time "
                      f"{1e3 * times[-1]:.1f} ms", flush=True)
        time.sleep(args.step_delay)
    if args.steps % args.save_every and start < args.steps:
        ckpt.save(args.steps)
    ckpt.close()
    if layout.rank == 0 and times:
        steady = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
        print(f"median step time {1e3 * steady:.1f} ms; checkpoint in {args.checkpoint}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
