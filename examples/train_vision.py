"""Train and evaluate a torchvision ResNet-18 (BatchNorm throughout) split into 2 pipeline stages
in one process, on a synthetic image task that needs no download: which quadrant of a noisy
image holds a bright square (4 classes).

    python examples/train_vision.py --steps 40 --eval-every 10

In train mode BatchNorm normalises each microbatch with its own statistics and updates the
running statistics once per microbatch (as any microbatched pipeline does); ``pipe.eval()``
switches to the running statistics (the eval-mode graph is captured once, at the first
evaluation, over the same parameters and buffers), where the pipeline equals the unsplit model
exactly. ``pipe.evaluate(x, y, return_outputs=True)`` gives the validation loss and the logits
for the accuracy; it leaves the gradients and the running statistics as they were.
"""

from __future__ import annotations

import argparse

import torch
from torch.nn import functional as F
from torchvision.models import resnet18

from pipeline import Pipeline


def quadrant_images(n: int, size: int, generator: torch.Generator) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """`n` noisy RGB images with a bright square in one quadrant; the label is the quadrant."""
    labels = torch.randint(0, 4, (n,), generator=generator)
    images = 0.5 * torch.randn(n, 3, size, size, generator=generator)
    half, side = size // 2, size // 4
    for i, label in enumerate(labels.tolist()):
        top, left = (label // 2) * half + side // 2, (label % 2) * half + side // 2
        images[i, :, top : top + side, left : left + side] += 2.0
    return images, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=32, help="image side in pixels")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--schedule", default="1f1b")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = resnet18(num_classes=4)
    train_data = torch.Generator().manual_seed(0)
    val_x, val_y = quadrant_images(64, args.size, torch.Generator().manual_seed(1))
    pipe = Pipeline(model, stages=2, schedule=args.schedule, microbatches=4,
                    loss_fn=F.cross_entropy)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=args.lr, momentum=0.9)
    for step in range(1, args.steps + 1):
        x, y = quadrant_images(args.batch, args.size, train_data)
        optimizer.zero_grad()
        loss = pipe.step(x, y)
        optimizer.step()
        if step % args.eval_every == 0 or step == args.steps:
            pipe.eval()  # running statistics: exact, as the unsplit model's eval()
            val_loss, logits = pipe.evaluate(val_x, val_y, return_outputs=True)
            pipe.train()
            accuracy = (logits.argmax(dim=1) == val_y).float().mean()
            print(f"step {step}: train loss {float(loss):.4f}, validation loss "
                  f"{float(val_loss):.4f}, accuracy {float(accuracy):.1%}", flush=True)


if __name__ == "__main__":
    main()
