"""Fine-tune a transformers GPT-2 (its config's defaults: dropout 0.1 everywhere) split into 2
pipeline stages in one process, with a validation pass every --eval-every steps: the training
loop every script has, unchanged by the pipeline.

    python examples/finetune_gpt2.py --steps 40 --eval-every 10

Data: byte-level windows (vocab 256) of the Python standard library's source, the last tenth
held out for validation; nothing is downloaded. --weights loads a state dict to fine-tune from
(e.g. one saved with ``torch.save(model.state_dict(), path)``); without it the model starts from
its own initialisation. ``pipe.eval()`` / ``pipe.train()`` switch dropout off and on (the eval
graph is captured once, at the first evaluation, over the same parameters) and
``pipe.evaluate(x, y)`` runs a forward-only pass with the training loss. A metrics line (samples
and tokens per second, FLOP/s, bubble, memory) is logged every --log-every steps.
"""

from __future__ import annotations

import argparse

import torch
from torch.nn import functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from pipeline import Pipeline
from pipeline.app.textdata import TokenBatches, stdlib_corpus


def lm_loss(out: object, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits  # type: ignore[attr-defined]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--weights", default=None, help="a state dict to fine-tune from")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=args.dim,
                        n_layer=args.layers, n_head=4, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    if args.weights is not None:
        model.load_state_dict(torch.load(args.weights, weights_only=True))
    corpus = stdlib_corpus(1_000_000)
    cut = corpus.numel() * 9 // 10
    train = TokenBatches(corpus[:cut], args.batch, args.seq, seed=0)
    held_out = TokenBatches(corpus[cut:], args.batch, args.seq, seed=1)
    validation = [held_out.at(i) for i in range(args.eval_batches)]

    pipe = Pipeline(model, stages=2, schedule=args.schedule, microbatches=4, loss_fn=lm_loss)
    pipe.log_metrics(every=args.log_every, to=print)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    for step in range(1, args.steps + 1):
        x, y = train.at(step)
        optimizer.zero_grad()
        pipe.step(x, y)
        pipe.clip_grad_norm_(1.0)
        optimizer.step()
        if step % args.eval_every == 0 or step == args.steps:
            pipe.eval()  # dropout off: the eval-mode graph (captured at the first call)
            loss = sum(float(pipe.evaluate(vx, vy)) for vx, vy in validation) / len(validation)
            pipe.train()
            print(f"step {step}: validation loss {loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
