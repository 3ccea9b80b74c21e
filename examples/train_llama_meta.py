"""A Llama-style model (transformers LlamaConfig) built on the meta device, initialised stage by
stage with init_fn, trained in bf16 autocast with parameters, gradients and optimizer state
sharded over the data-parallel replicas (shard="full", FSDP2), under torchrun, with periodic
checkpoints and resume at whatever layout the restart gets.

    torchrun --nproc-per-node 4 examples/train_llama_meta.py --stages 2 --steps 20

runs 2 pipeline stages x 2 replicas. No process ever holds the whole model: each allocates and
initialises only its stage (init_fn="reset_parameters": the model's own _init_weights, seeded
by module name, so the weights do not depend on the layout). Each replica reads its share of
a map-style dataset of byte windows (the Python standard library's source) through
``pipe.replica_sampler``; a `Checkpointer` saves every --save-every steps into --checkpoint
(out/llama-checkpoint) and, when started again, resumes (model, optimizer, RNG, and the
samples the job consumed, at any world size): run it again with a larger --steps to train on;
the metrics lines number the steps on from the resumed one.
--dtype float64 turns autocast off (exact runs for tests). Prints one metrics line every
--log-every steps on global rank 0.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline import Checkpointer, Pipeline
from pipeline.app.textdata import stdlib_corpus


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """(input, target) byte windows of `seq` tokens at a fixed stride through the corpus."""

    def __init__(self, corpus: torch.Tensor, seq: int) -> None:
        self.corpus, self.seq = corpus.long(), seq

    def __len__(self) -> int:
        return (self.corpus.numel() - 1) // self.seq

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.corpus[i * self.seq : (i + 1) * self.seq + 1]
        return window[:-1], window[1:]


def lm_loss(out: object, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits  # type: ignore[attr-defined]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="train until this step")
    parser.add_argument("--batch", type=int, default=4, help="samples per replica per step")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float64"])
    parser.add_argument("--checkpoint", default="out/llama-checkpoint",
                        help="checkpoint directory: resumed from when it exists")
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--log-every", type=int, default=5)
    args = parser.parse_args()

    torch.set_num_threads(1)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    if torch.cuda.is_available():
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=args.dim, intermediate_size=2 * args.dim,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=args.seq, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    exact = args.dtype == "float64"
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    if exact:
        model = model.double()
    data = Windows(stdlib_corpus(400_000), args.seq)
    pipe = Pipeline(
        model, stages=args.stages, loss_fn=lm_loss, init_fn="reset_parameters", shard="full",
        mixed_precision=None if exact else torch.bfloat16,
        example_input=torch.zeros(args.batch, args.seq, dtype=torch.long),
    )
    ctx = pipe.distributed
    if ctx is None:
        raise SystemExit("run this script with torchrun (see its docstring)")
    optimizer = pipe.optimizer(torch.optim.AdamW, lr=args.lr)
    ckpt = Checkpointer(pipe, args.checkpoint, optimizer, every=args.save_every)
    resumed = ckpt.resume()
    step = resumed.step if resumed is not None else 0
    # The data position: the epoch and the samples the job consumed in it (at any layout).
    position = resumed.data if resumed is not None and resumed.data else {"epoch": 0, "start": 0}
    epoch, start = position["epoch"], position["start"]
    replicas = ctx.layout.data_parallel
    sampler = pipe.replica_sampler(data, seed=0, drop_last=True, epoch=epoch, start=start)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True)
    if ctx.layout.rank == 0:
        print(f"world {ctx.layout.world_size} = {replicas} replicas x {ctx.layout.stages} "
              f"stages; {resumed or 'starting afresh'}", flush=True)
        if step >= args.steps:
            print(f"nothing to train: {args.checkpoint} is at step {step} and --steps is "
                  f"{args.steps}; pass --steps {step + args.steps} to train on, or another "
                  "--checkpoint (or remove this one) to start afresh", flush=True)
        pipe.log_metrics(every=args.log_every, to=lambda line: print(line, flush=True))
    while step < args.steps:
        for x, y in loader:
            pipe.zero_grad()
            pipe.step(x, y)
            optimizer.step()
            step, start = step + 1, start + args.batch * replicas
            ckpt.maybe_save(step, data={"epoch": epoch, "start": start})
            if step == args.steps:
                break
        else:  # the epoch is over
            epoch, start = epoch + 1, 0
            sampler.set_epoch(epoch)  # type: ignore[attr-defined]
    if step % args.save_every:
        ckpt.save(step, data={"epoch": epoch, "start": start})
    ckpt.close()
    if ctx.layout.rank == 0:
        print(f"step {step} done; checkpoint in {args.checkpoint}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
