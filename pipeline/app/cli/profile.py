"""`hybridpipe profile`: capture, profile and auto-balance a model into pipeline stages;
print the plan and write its partition plot and JSON."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pipeline.app.cli.args import DTYPES, Formatter, positive_int, progress, sizes
from pipeline.app.cli.model_arg import BUILTIN_MODELS, model_and_inputs


def _balance(text: str) -> str | list[int]:
    if text in ("profile", "parameters", "uniform"):
        return text
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid balance {text!r}: choose from profile, parameters, uniform, or give "
            "comma-separated node counts per stage (e.g. 3,4,4,3)"
        ) from None
    return sizes


def add(subparsers: Any) -> None:
    models = "\n".join(f"  {name:<8} {m.summary}" for name, m in BUILTIN_MODELS.items())
    parser = subparsers.add_parser(
        "profile",
        help="capture, profile and auto-balance a model into pipeline stages",
        description=(
            "Capture MODEL as a graph (torch.export, else torch.fx), time every node on an\n"
            "example input, split it into balanced stages, print the Plan, and write the\n"
            "partition plot (partition.png) and the plan (plan.json) to --out.\n\n"
            "MODEL is torchvision:NAME (e.g. torchvision:resnet50, random weights),\n"
            "package.module:factory (called without arguments, returns an nn.Module, e.g.\n"
            "timm.models.resnet:resnet18), gpt:.../llama:... (a transformer by size),\n"
            "hf:MODEL_TYPE[,key=value,...,seq=S] (a Hugging Face causal LM from the\n"
            "library's default config of that type, e.g. hf:gpt2,n_layer=4,seq=64),\n"
            f"or a built-in demo model:\n{models}"
        ),
        epilog=(
            "examples:\n"
            "  hybridpipe profile gpt --stages 4 --out out/gpt\n"
            "  hybridpipe profile torchvision:resnet50 --input-shape 8,3,224,224 --stages 4 "
            "--out out/resnet50\n"
            "  hybridpipe profile mypkg.models:build --input-shape 16,512 --balance parameters"
        ),
        formatter_class=Formatter,
    )
    parser.add_argument("model", metavar="MODEL", help="what to partition (see above)")
    parser.add_argument(
        "--input-shape",
        type=sizes,
        action="append",
        default=None,
        metavar="SIZES",
        help="example input shape, e.g. 8,3,224,224; repeat for several inputs "
        "(default for built-in models: their own)",
    )
    parser.add_argument(
        "--input-dtype",
        choices=DTYPES,
        default=None,
        help="example input dtype (default: int64 for gpt, else float32)",
    )
    parser.add_argument(
        "--vocab",
        type=positive_int,
        default=256,
        help="integer inputs (--input-dtype int64) are drawn from [0, VOCAB)",
    )
    parser.add_argument("--stages", type=positive_int, default=4, help="pipeline stages")
    parser.add_argument(
        "--balance",
        type=_balance,
        default="profile",
        metavar="{profile,parameters,uniform,N0,N1,...}",
        help="balance by profiled time, parameter bytes, node count, or explicit node counts",
    )
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=None,
        help="bytes/s between stages, to charge transfers (default: transfers are free)",
    )
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per node")
    parser.add_argument("--device", default="cpu", help="device to profile on")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and example input")
    parser.add_argument(
        "--tensor-parallel", type=positive_int, default=1, metavar="N",
        help="show the tensor-parallel plan derived for N ranks per stage (what each "
        "parameter's split is, what stays whole) and each stage's share of it",
    )
    parser.add_argument(
        "--out", type=Path, default=None, metavar="DIR", help="write partition.png and plan.json"
    )
    parser.set_defaults(run=_run_profile, parser=parser)


def _run_profile(args: argparse.Namespace) -> int:
    from partitioner import capture, partition, profile
    from viz import plot_partition

    model, inputs = model_and_inputs(args)
    shapes = " ".join("x".join(str(d) for d in x.shape) for x in inputs)
    started = time.perf_counter()
    progress(f"capturing {args.model} on input {shapes} ...")
    captured = capture(model, inputs)
    progress(f"captured {len(captured)} nodes in {time.perf_counter() - started:.1f} s")
    if args.balance == "profile":
        started = time.perf_counter()
        progress(f"profiling on {args.device} ({args.repeats} timed runs per node) ...")
        captured = captured.with_costs(
            profile(captured, model, inputs, device=args.device, repeats=args.repeats))
        progress(f"profiled in {time.perf_counter() - started:.1f} s")
    plan = partition(captured, args.stages, args.balance, bandwidth=args.bandwidth)
    print(plan)
    notes, tp = None, None
    if args.tensor_parallel > 1:
        from partitioner.tp_plan import derive_tp_plan
        from partitioner.tp_work import stage_lines

        tp = derive_tp_plan(captured.graph_module, args.tensor_parallel)
        notes = stage_lines(captured, tp, plan.stages)
        print(tp.describe())
        print("\n".join(f"  stage {k}: {line}" for k, line in enumerate(notes)))
    if args.out is None:
        print("(add --out DIR to write partition.png and plan.json)")
        return 0
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    plot_partition(
        plan, out / "partition.png", graph=captured.graph, title=f"{args.model}: {shapes}",
        stage_notes=notes,
    )
    written = plan.to_dict()
    if tp is not None:
        written["tensor_parallel"] = {
            "degree": tp.degree, "stages": notes,
            "params": {p.name: {"style": p.style, "dim": p.dim, "why": p.why, "bytes": p.bytes,
                                "chunks": p.chunks} for p in tp.params.values()}}
    (out / "plan.json").write_text(json.dumps(written, indent=2) + "\n")
    print(f"wrote {out / 'partition.png'} and {out / 'plan.json'}")
    return 0
