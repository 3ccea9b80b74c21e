"""`hybridpipe plan`: rank (pipeline ranks, replicas, schedule, microbatches, chunks) for a
world size under a memory cap, from a profiled model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.app.cli.args import (
    DTYPES,
    Formatter,
    positive_int,
    progress,
    schedule_names,
    sizes,
)
from pipeline.app.cli.model_arg import model_and_inputs
from pipeline.app.cli.plan_target import add_arguments as add_target_arguments

if TYPE_CHECKING:
    from partitioner import Captured

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _bytes(text: str) -> float:
    """A byte count: a number with an optional unit (e.g. 80GiB, 512MiB, 4e9)."""
    number = text.rstrip("BbKkMmGgTtIi")
    unit = text[len(number):].lower()
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"expected bytes such as 80GiB, 512MiB or 4e9, got {text!r}"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a size > 0, got {text!r}")
    return value


def _degrees(text: str) -> tuple[int, ...]:
    """--tensor-parallel: "auto" (empty tuple) or comma-separated positive ints."""
    if text == "auto":
        return ()
    try:
        found = tuple(int(t) for t in text.split(","))
    except ValueError:
        found = (0,)
    if not found or min(found) < 1:
        raise argparse.ArgumentTypeError(
            f"expected auto or tensor-parallel degrees such as 1,2,4, got {text!r}")
    return found


def add(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="rank (pp, dp, schedule, microbatches, chunks) for N devices under a memory cap",
        description=(
            "Profile MODEL (as `profile` does), then simulate every (pipeline ranks, data-\n"
            "parallel replicas, schedule, microbatches, chunks per rank) for --world-size\n"
            "devices and print them ranked by predicted step time, with bubble and peak\n"
            "memory per rank (parameters x optimizer factor + held activations); candidates\n"
            "over --memory-limit are dropped. Writes files only where asked: the ranked list as\n"
            "JSON (--json), the best candidate's pictures (--out).\n"
            "Model: see pipeline.planning.autoplan (microbatch costs scale linearly with\n"
            "samples). 'synth' rows are schedules synthesised for those costs\n"
            "(scheduler.synthesize); the best candidate's schedule is printed when it is one."
        ),
        epilog=(
            "examples:\n"
            "  hybridpipe plan gpt --world-size 8 --memory-limit 3MiB\n"
            "  hybridpipe plan mlp --world-size 1024 --memory-limit 2MiB --batch-size 8192\n"
            "  hybridpipe plan llama:layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,"
            "vocab=128256,seq=4096 \\\n      --target h100-sxm5-80gb --world-size 512 "
            "--batch-size 1024"
        ),
        formatter_class=Formatter,
    )
    parser.add_argument("model", metavar="MODEL", help="what to plan for (see `profile`)")
    parser.add_argument("--world-size", type=positive_int, required=True, help="devices")
    parser.add_argument(
        "--memory-limit", type=_bytes, default=None, metavar="BYTES",
        help="bytes per device, e.g. 80GiB (default: no cap)",
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=None,
        help="samples per training step over all replicas (default: the example input's "
        "batch x world size)",
    )
    parser.add_argument(
        "--input-shape", type=sizes, action="append", default=None, metavar="SIZES",
        help="example input shape (its dim 0 is the profiled microbatch)",
    )
    parser.add_argument("--input-dtype", choices=DTYPES, default=None, help="example dtype")
    parser.add_argument("--vocab", type=positive_int, default=256, help="integer input range")
    parser.add_argument(
        "--schedules", type=schedule_names, default=None, metavar="NAMES",
        help="schedules to try: comma-separated names (default: all)",
    )
    parser.add_argument(
        "--dp-bandwidth", type=float, default=1e10,
        help="bytes/s of the data-parallel gradient all-reduce (ring)",
    )
    parser.add_argument(
        "--latency", type=float, default=0.0, help="seconds per cross-rank transfer"
    )
    parser.add_argument(
        "--tensor-parallel", type=_degrees, default=(1,), metavar="N[,N...]|auto",
        help="tensor-parallel ranks per stage to try (comma-separated, or auto: every divisor "
        "of --world-size inside a node of --gpus-per-node, default all of them); each is "
        "priced at its shard shapes with gloo collectives measured on this host (cached)",
    )
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="with --tensor-parallel: price sequence parallelism")
    parser.add_argument("--top", type=positive_int, default=20, help="rows to print and keep")
    parser.add_argument("--device", default="cpu", help="device to profile on")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and example input")
    parser.add_argument(
        "--json", type=Path, default=None, metavar="PATH",
        help="write the ranked candidates here as JSON (default: nothing is written)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, metavar="DIR",
        help="write the best candidate's schedule text, predicted timeline, memory plot and "
        "Chrome trace here",
    )
    add_target_arguments(parser)
    parser.set_defaults(run=_run_plan, parser=parser)


def _run_plan(args: argparse.Namespace) -> int:
    if args.target is not None:
        from pipeline.app.cli.plan_target import run

        return run(args)
    from partitioner import capture, profile
    from pipeline.planning.autoplan import search

    model, inputs = model_and_inputs(args)
    profiled_batch = int(inputs[0].shape[0])
    progress(f"capturing and profiling {args.model} on microbatches of {profiled_batch} ...")
    captured = capture(model, inputs)
    captured = captured.with_costs(profile(captured, model, inputs, device=args.device))
    widths = _widths(args, captured)
    result = search(
        captured,
        world_size=args.world_size,
        batch_size=args.batch_size or profiled_batch * args.world_size,
        profiled_batch=profiled_batch,
        memory_limit=args.memory_limit,
        schedules=args.schedules,
        latency=args.latency,
        dp_bandwidth=args.dp_bandwidth,
        keep=args.top,
        widths=widths,
    )
    print(result.table(args.top))
    width = next(w for w in widths if w.tp == result.best.tp)
    if width.plan is not None:
        print(f"the best layout's {width.describe()}")
        print(width.plan.describe())
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
        print(f"wrote {args.json}")
    best = result.best  # raises the explanatory error when nothing fits
    if best.built is not None:
        print(f"best schedule ({best.schedule}, pp={best.pp}, m={best.microbatches}), one line "
              f"per rank:\n{best.built.to_text()}")
    if args.out is not None:
        _draw(args, captured, best, profiled_batch, result.batch_size, width)
    return 0


def _widths(args: argparse.Namespace, captured: Captured) -> list[Any]:
    """The tensor-parallel degrees --tensor-parallel asks for, each priced."""
    from pipeline.planning.hardware.group_collectives import local_collectives
    from pipeline.planning.tp_costs import width

    node = args.gpus_per_node or args.world_size
    degrees = args.tensor_parallel or tuple(
        d for d in range(1, args.world_size + 1) if args.world_size % d == 0 and node % d == 0)
    bad = [d for d in degrees if args.world_size % d]
    if bad:
        args.parser.error(f"--tensor-parallel {bad} must divide --world-size {args.world_size}")
    wide = [d for d in degrees if d > 1]
    if wide:
        progress(f"measuring gloo collectives on groups of {wide} processes (cached) ...")
    collectives = local_collectives(wide)
    return [width(captured, d, collectives, sequence_parallel=args.sequence_parallel)
            for d in degrees]


def _draw(args: argparse.Namespace, captured: Captured, best: Any, profiled_batch: int,
          batch_size: int, width: Any) -> None:
    """The best candidate's schedule text, predicted timeline, memory plot and trace."""
    from pipeline.planning.autoplan import predicted
    from viz import plot_memory, plot_timeline, to_chrome_trace

    schedule, timeline = predicted(captured, best, batch_size, profiled_batch,
                                   latency=args.latency, width=width)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    name = schedule.name
    (out / f"schedule_{name}.txt").write_text(schedule.to_text() + "\n")
    # The prediction is in seconds (profiled costs), not cost units: drawn in ms (s, µs).
    plot_timeline(timeline, out / f"timeline_{name}.png", unit="s")
    plot_memory(timeline, out / f"memory_{name}.png", unit="s")
    to_chrome_trace(timeline, out / f"trace_{name}.json")
    print(f"wrote the best candidate's schedule, timeline, memory plot and trace to {out}/")
