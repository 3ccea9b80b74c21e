"""`hybridpipe plan MODEL --target NAME`: plan a model for hardware this machine does not
have: a transformer family by size (`gpt:...`, `llama:...`: tensor parallelism and recompute
priced too) or any other MODEL, built on meta, captured and priced unit by unit (pipeline
and data parallelism). With --layout it predicts that one
configuration; without, it searches (tp, pp, dp, microbatch size, microbatches, chunks,
schedule, recompute, ZeRO) under the target's memory and prints the ranked table
(pipeline.planning.scale)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pipeline.app.cli.args import positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The target-planning options of `plan`."""
    group = parser.add_argument_group(
        "planning for a target (MODEL gpt:... or llama:...; docs/planning-at-scale.md)")
    group.add_argument(
        "--target", default=None, metavar="NAME",
        help="price on this device instead of profiling here: a100-sxm4-80gb, "
        "h100-sxm5-80gb, or cpu (this machine, microbenchmarked)")
    group.add_argument("--gpus-per-node", type=positive_int, default=None,
                       help="GPUs per node (default: the target's node, 8)")
    group.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16",
                       help="training precision (bf16/fp16: mixed, fp32 master weights)")
    group.add_argument(
        "--layout", default=None, metavar="SPEC",
        help='predict one configuration, e.g. "tp=8,pp=4,microbatches=28,virtual_stages=3,'
        'schedule=interleaved-1f1b,recompute=full[,zero=zero1,sp=0]" (dp = N / (tp x pp))')


def run(args: argparse.Namespace) -> int:
    """Plan `args.model` on `args.target`; print the table, write --json when given."""
    from pipeline.planning.hardware import LOCAL, target_named
    from pipeline.planning.scale.layout import Job, parse_layout
    from pipeline.planning.scale.predict import predict
    from pipeline.planning.scale.search import search

    if args.batch_size is None:
        raise ValueError("--target needs --batch-size (sequences per step over all replicas)")
    runtime = None
    if args.target == LOCAL:  # the runtime's own cost per action, measured once and cached
        from pipeline.facade.runtime_cost import runtime_cost

        runtime = runtime_cost()
    target = target_named(args.target, args.gpus_per_node, runtime)
    job = Job(_spec(args, target), target, args.world_size, args.batch_size, args.precision)
    if args.layout is not None:
        prediction = predict(job, parse_layout(args.layout))
        print(_one(prediction))
        cap = args.memory_limit or job.target.memory_capacity
        if prediction.max_memory > cap:
            print(f"does not fit: {prediction.max_memory / 2**30:.1f} GiB on the fullest GPU, "
                  f"over {cap / 2**30:.1f} GiB; try zero=zero1, recompute=full, more pp or "
                  "fewer microbatches in flight")
        out: dict[str, Any] = {"target": job.target.name, "world_size": job.world_size,
                               "batch_size": job.batch_size,
                               "candidates": [prediction.to_dict()]}
    else:
        plan = search(job, memory_limit=args.memory_limit, keep=args.top,
                      schedules=args.schedules)
        print(plan.table(args.top))
        out = plan.to_dict()
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


def _spec(args: argparse.Namespace, target: Any) -> Any:
    """A family parsed by size, or any other MODEL built on meta, captured and priced."""
    import torch

    from pipeline.app.cli.model_arg import FAMILY_PREFIXES, example_inputs, load_model
    from pipeline.planning.scale.graph import price_graph
    from pipeline.planning.scale.transformer import parse_spec
    from pipeline.planning.scale.units import DTYPES

    if args.model.startswith(FAMILY_PREFIXES):
        return parse_spec(args.model)
    dtype = DTYPES[args.precision]
    with torch.device("meta"):
        model = load_model(args.model).to(dtype)
    inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in example_inputs(
        args.model, args.input_shape, args.input_dtype, args.vocab))
    return price_graph(args.model, model, inputs, target)


def _one(p: Any) -> str:
    """One prediction as text: the layout, step and its parts, rates, memory by part."""
    mem = p.memory
    gib = 2**30
    return "\n".join([
        f"layout {p.layout.describe()}, dp={p.dp}, microbatch size {p.microbatch_size}",
        f"step {p.step_time:.3f} s (pipeline {p.pipeline_time:.3f} s, bubble {p.bubble:.1%}; "
        f"exposed gradient sync {p.allreduce_time:.3f} s; optimizer {p.optimizer_time:.3f} s)",
        f"{p.tflops_per_gpu:.1f} TFLOP/s per GPU, MFU {p.mfu:.1%}",
        f"memory per GPU {p.max_memory / gib:.1f} GiB at the fullest rank: weights "
        f"{mem.weights / gib:.1f}, gradients {mem.gradients / gib:.1f}, optimizer "
        f"{mem.optimizer / gib:.1f}, activations {mem.activations / gib:.1f}, recompute "
        f"{mem.recompute / gib:.1f}, buffers {mem.buffers / gib:.2f} GiB; per pipeline rank "
        f"{', '.join(f'{x / gib:.1f}' for x in p.peak_memory)}",
    ])
