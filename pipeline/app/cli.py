"""The `hybridpipe` command line: `simulate` (compare schedules on a cost model and draw them),
`profile` (capture, profile and auto-balance a model into stages), `plan` (rank (pp, dp,
schedule, microbatches, chunks) for a world size under a memory cap) and `demo` (the main job).
Each subcommand is one `_add_<name>(subparsers)` function listed in `_COMMANDS`, which declares
its arguments and the function that runs it."""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scheduler import (
    SCHEDULES,
    Schedule,
    Timeline,
    build_schedule,
    rank_costs_to_stages,
    simulate,
)

if TYPE_CHECKING:
    import torch
    from torch import nn


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show defaults (except None, whose meaning the help text gives) and keep the examples'
    line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _costs(text: str) -> float | list[float]:
    """A cost: one number, or comma-separated numbers (one per rank or one per stage)."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            "expected a number or comma-separated numbers (one per rank or one per stage), "
            f"got {text!r}"
        ) from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"costs must be >= 0, got {text!r}")
    return values[0] if len(values) == 1 else values


def _schedule_names(text: str) -> list[str]:
    names = sorted(SCHEDULES) if text == "all" else [n.strip() for n in text.split(",") if n]
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown schedule(s) {unknown or [text]}; choose from {', '.join(sorted(SCHEDULES))}"
            " (comma-separated) or 'all'"
        )
    return names


# ---------------------------------------------------------------------------------- simulate


def _add_simulate(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="simulate schedules on a cost model: step time, bubble, memory, pictures",
        description=(
            "Simulate one training step of pipeline schedules with fixed costs and print\n"
            "step time, bubble fraction and peak activation memory per schedule.\n"
            "With --out, also write each schedule's timeline, memory plot, Chrome trace and\n"
            "action text, and a comparison picture when several schedules are given."
        ),
        epilog=(
            "examples:\n"
            "  hybridpipe simulate --schedule 1f1b --ranks 4 --microbatches 8 --out out/sim\n"
            "  hybridpipe simulate --compare gpipe,1f1b,zb-h1,zb-h2 --forward 1 --backward 1 "
            "--weight 1\n"
            "  hybridpipe simulate --schedule interleaved-1f1b --virtual-stages 2 --comm 0.1"
        ),
        formatter_class=_Formatter,
    )
    parser.add_argument(
        "--schedule", default="1f1b", choices=sorted(SCHEDULES), help="schedule to simulate"
    )
    parser.add_argument(
        "--compare",
        type=_schedule_names,
        default=None,
        metavar="NAMES",
        help="more schedules to simulate alongside --schedule: comma-separated names or 'all'",
    )
    parser.add_argument("--ranks", type=_positive_int, default=4, help="pipeline ranks (devices)")
    parser.add_argument("--microbatches", type=_positive_int, default=8, help="microbatches")
    parser.add_argument(
        "--virtual-stages",
        type=_positive_int,
        default=None,
        metavar="V",
        help="stages per rank for schedules with several chunks (interleaved-1f1b, zbv, "
        "dualpipev); default: each schedule's own",
    )
    parser.add_argument(
        "--forward",
        type=_costs,
        default=1.0,
        metavar="COST",
        help="forward cost of one rank's share of the model (split evenly over its virtual "
        "stages), or comma-separated: one per rank or one per stage",
    )
    parser.add_argument(
        "--backward",
        type=_costs,
        default=1.0,
        metavar="COST",
        help="input-gradient cost, given like --forward (a schedule that does not split "
        "backward pays backward + weight per B)",
    )
    parser.add_argument(
        "--weight",
        type=_costs,
        default=1.0,
        metavar="COST",
        help="weight-gradient cost, given like --forward",
    )
    parser.add_argument(
        "--comm", type=float, default=0.0, metavar="COST", help="latency of a cross-rank transfer"
    )
    parser.add_argument(
        "--out", type=Path, default=None, metavar="DIR", help="write pictures and traces here"
    )
    parser.set_defaults(run=_run_simulate, parser=parser)


@dataclass(frozen=True)
class _Simulated:
    schedule: Schedule
    timeline: Timeline


def _simulate_all(args: argparse.Namespace) -> tuple[list[_Simulated], list[str]]:
    """Build and simulate every requested schedule; also return notes about fallbacks."""
    names = list(dict.fromkeys([args.schedule, *(args.compare or [])]))
    results, notes = [], []
    for name in names:
        try:
            schedule = build_schedule(name, args.ranks, args.microbatches, args.virtual_stages)
        except ValueError:
            # In a comparison, --virtual-stages is meant for the multi-chunk schedules; a
            # schedule that cannot take it runs with its own default (and the table says so).
            if len(names) == 1 or args.virtual_stages is None:
                raise
            schedule = build_schedule(name, args.ranks, args.microbatches)
            notes.append(
                f"note: {name} cannot run {args.virtual_stages} virtual stages per rank; "
                f"simulated with {schedule.virtual_stages}"
            )
        timeline = simulate(
            schedule,
            rank_costs_to_stages(args.forward, schedule, "--forward"),
            rank_costs_to_stages(args.backward, schedule, "--backward"),
            rank_costs_to_stages(args.weight, schedule, "--weight"),
            args.comm,
            # One unit = one microbatch's activations of a rank's whole share of the model.
            activation=[1.0 / schedule.virtual_stages] * schedule.num_stages,
        )
        results.append(_Simulated(schedule, timeline))
    return results, notes


def _simulate_table(results: Sequence[_Simulated]) -> str:
    header = (
        f"{'schedule':<18}{'v':>3}{'stages':>8}{'step time':>11}{'bubble':>9}{'peak mem':>10}"
        f"  peak in-flight per rank"
    )
    rows = [header, "-" * len(header)]
    for r in results:
        rows.append(
            f"{r.schedule.name:<18}{r.schedule.virtual_stages:>3}{r.schedule.num_stages:>8}"
            f"{r.timeline.step_time:>11.4g}{r.timeline.bubble_fraction:>9.1%}"
            f"{max(r.timeline.peak_memory):>10.3g}"
            f"  {' '.join(str(n) for n in r.timeline.peak_inflight)}"
        )
    if len(results) > 1:
        best = min(results, key=lambda r: r.timeline.step_time)
        worst = max(results, key=lambda r: r.timeline.step_time)
        ratio = worst.timeline.step_time / best.timeline.step_time
        rows.append(
            f"fastest: {best.schedule.name}, {ratio:.2f}x faster than the slowest "
            f"({worst.schedule.name})"
        )
    rows.append("peak mem: most activations one rank holds, in microbatches of its model share")
    rows.append("peak in-flight: most (stage, microbatch) activations each rank holds")
    return "\n".join(rows)


def _run_simulate(args: argparse.Namespace) -> int:
    results, notes = _simulate_all(args)
    for note in notes:
        print(note, file=sys.stderr)
    print(
        f"{args.ranks} ranks, {args.microbatches} microbatches; costs per rank: forward "
        f"{args.forward}, backward {args.backward}, weight {args.weight}, comm {args.comm}"
    )
    print(_simulate_table(results))
    if args.out is None:
        print("(add --out DIR to write timelines, memory plots and Chrome traces)")
        return 0
    from viz import plot_comparison, plot_memory, plot_timeline, to_chrome_trace

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for r in results:
        name = r.schedule.name
        written.append(out / f"timeline_{name}.png")
        plot_timeline(r.timeline, written[-1])
        written.append(out / f"memory_{name}.png")
        plot_memory(r.timeline, written[-1])
        written.append(out / f"trace_{name}.json")
        to_chrome_trace(r.timeline, written[-1])
        written.append(out / f"schedule_{name}.txt")
        written[-1].write_text(r.schedule.to_text() + "\n")
    if len(results) > 1:
        written.append(out / "comparison.png")
        plot_comparison([r.timeline for r in results], path=written[-1])
    summary = {
        "ranks": args.ranks,
        "microbatches": args.microbatches,
        "costs": {
            "forward": args.forward,
            "backward": args.backward,
            "weight": args.weight,
            "comm": args.comm,
        },
        "schedules": [
            {
                "name": r.schedule.name,
                "virtual_stages": r.schedule.virtual_stages,
                "step_time": r.timeline.step_time,
                "bubble_fraction": r.timeline.bubble_fraction,
                "peak_inflight": list(r.timeline.peak_inflight),
                "peak_memory": list(r.timeline.peak_memory),
            }
            for r in results
        ],
    }
    written.append(out / "summary.json")
    written[-1].write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {len(written)} files to {out}/ (open trace_*.json in https://ui.perfetto.dev)")
    return 0


# ----------------------------------------------------------------------------------- profile


@dataclass(frozen=True)
class _BuiltinModel:
    factory: str  # attribute of pipeline.app.models
    input_shape: tuple[int, ...]
    integer_input: int | None  # token vocabulary when the model takes integer ids
    summary: str


BUILTIN_MODELS: dict[str, _BuiltinModel] = {
    "gpt": _BuiltinModel("GPT", (8, 64), 256, "GPT-style LM, 4 blocks, byte vocabulary"),
    "mlp": _BuiltinModel("mlp_stack", (8, 256), None, "8 residual MLP blocks + read-out"),
    "skip": _BuiltinModel("SkipNet", (8, 32), None, "MLP chain with one long skip connection"),
    "skewed": _BuiltinModel("skewed_model", (8, 64), None, "cheap blocks + one heavy head"),
}
_DTYPES = ("float32", "float64", "int64")


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated sizes such as 8,3,224,224, got {text!r}"
        ) from None
    if not dims or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"sizes must be >= 1, got {text!r}")
    return dims


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


def _add_profile(subparsers: Any) -> None:
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
            "timm.models.resnet:resnet18),\n"
            f"or a built-in demo model:\n{models}"
        ),
        epilog=(
            "examples:\n"
            "  hybridpipe profile gpt --stages 4 --out out/gpt\n"
            "  hybridpipe profile torchvision:resnet50 --input-shape 8,3,224,224 --stages 4 "
            "--out out/resnet50\n"
            "  hybridpipe profile mypkg.models:build --input-shape 16,512 --balance parameters"
        ),
        formatter_class=_Formatter,
    )
    parser.add_argument("model", metavar="MODEL", help="what to partition (see above)")
    parser.add_argument(
        "--input-shape",
        type=_shape,
        action="append",
        default=None,
        metavar="SIZES",
        help="example input shape, e.g. 8,3,224,224; repeat for several inputs "
        "(default for built-in models: their own)",
    )
    parser.add_argument(
        "--input-dtype",
        choices=_DTYPES,
        default=None,
        help="example input dtype (default: int64 for gpt, else float32)",
    )
    parser.add_argument(
        "--vocab",
        type=_positive_int,
        default=256,
        help="integer inputs (--input-dtype int64) are drawn from [0, VOCAB)",
    )
    parser.add_argument("--stages", type=_positive_int, default=4, help="pipeline stages")
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
    parser.add_argument("--repeats", type=_positive_int, default=3, help="timed runs per node")
    parser.add_argument("--device", default="cpu", help="device to profile on")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and example input")
    parser.add_argument(
        "--out", type=Path, default=None, metavar="DIR", help="write partition.png and plan.json"
    )
    parser.set_defaults(run=_run_profile, parser=parser)


def load_model(spec: str) -> nn.Module:
    """The model named by `spec`: a built-in name, torchvision:NAME or package.module:factory."""
    from torch import nn

    if spec in BUILTIN_MODELS:
        from pipeline.app import models

        return getattr(models, BUILTIN_MODELS[spec].factory)()
    if ":" not in spec:
        raise ValueError(
            f"unknown MODEL {spec!r}: give one of {', '.join(BUILTIN_MODELS)}, "
            "torchvision:NAME or package.module:factory"
        )
    where, name = spec.split(":", 1)
    if where == "torchvision":
        import torchvision

        available = torchvision.models.list_models()
        if name not in available:
            close = difflib.get_close_matches(name, available, n=5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"torchvision has no model {name!r}{hint}")
        model = torchvision.models.get_model(name, weights=None)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ValueError(
                f"cannot import {where!r} for MODEL {spec!r} ({exc}); check the module path "
                "and that it is importable from here (PYTHONPATH)"
            ) from exc
        factory = getattr(module, name, None)
        if not callable(factory):
            raise ValueError(f"{where} has no callable {name!r} for MODEL {spec!r}")
        model = factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"MODEL {spec!r} gave a {type(model).__name__}, not a torch.nn.Module")
    return model


def example_inputs(
    spec: str, shapes: Sequence[tuple[int, ...]] | None, dtype: str | None, vocab: int
) -> tuple[torch.Tensor, ...]:
    """Random example inputs for `spec` (shapes and dtype default to a built-in model's)."""
    import torch

    builtin = BUILTIN_MODELS.get(spec)
    if shapes is None:
        if builtin is None:
            raise ValueError(
                f"--input-shape is required for MODEL {spec!r} (e.g. --input-shape 8,3,224,224)"
            )
        shapes = [builtin.input_shape]
    tokens = builtin.integer_input if builtin is not None else None
    if dtype is None:
        dtype = "int64" if tokens else "float32"
    if tokens and dtype != "int64":
        raise ValueError(
            f"MODEL {spec!r} takes integer token ids, not {dtype}; drop --input-dtype or use int64"
        )
    high = tokens or vocab
    if dtype == "int64":
        return tuple(torch.randint(0, high, shape) for shape in shapes)
    return tuple(torch.randn(shape, dtype=getattr(torch, dtype)) for shape in shapes)


def _model_and_inputs(args: argparse.Namespace) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The MODEL argument's model and example inputs (seeded; float64 when asked)."""
    import torch

    torch.manual_seed(args.seed)
    model = load_model(args.model)
    inputs = example_inputs(args.model, args.input_shape, args.input_dtype, args.vocab)
    if args.input_dtype == "float64":
        model = model.double()
    return model, inputs


def _run_profile(args: argparse.Namespace) -> int:
    from partitioner import capture, partition, profile
    from viz import plot_partition

    model, inputs = _model_and_inputs(args)
    shapes = " ".join("x".join(str(d) for d in x.shape) for x in inputs)
    started = time.perf_counter()
    _progress(f"capturing {args.model} on input {shapes} ...")
    graph = capture(model, inputs)
    _progress(f"captured {graph.number_of_nodes()} nodes in {time.perf_counter() - started:.1f} s")
    if args.balance == "profile":
        started = time.perf_counter()
        _progress(f"profiling on {args.device} ({args.repeats} timed runs per node) ...")
        profile(graph, model, inputs, device=args.device, repeats=args.repeats)
        _progress(f"profiled in {time.perf_counter() - started:.1f} s")
    plan = partition(graph, args.stages, args.balance, bandwidth=args.bandwidth)
    print(plan)
    if args.out is None:
        print("(add --out DIR to write partition.png and plan.json)")
        return 0
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    plot_partition(plan, out / "partition.png", graph=graph, title=f"{args.model}: {shapes}")
    (out / "plan.json").write_text(json.dumps(plan.to_dict(), indent=2) + "\n")
    print(f"wrote {out / 'partition.png'} and {out / 'plan.json'}")
    return 0


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -------------------------------------------------------------------------------------- plan

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


def _add_plan(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="rank (pp, dp, schedule, microbatches, chunks) for N devices under a memory cap",
        description=(
            "Profile MODEL (as `profile` does), then simulate every (pipeline ranks, data-\n"
            "parallel replicas, schedule, microbatches, chunks per rank) for --world-size\n"
            "devices and print them ranked by predicted step time, with bubble and peak\n"
            "memory per rank (parameters x optimizer factor + held activations); candidates\n"
            "over --memory-limit are dropped. Writes the ranked list as JSON (--json).\n"
            "Model: see pipeline.planning.autoplan (microbatch costs scale linearly with samples)."
        ),
        epilog=(
            "examples:\n"
            "  hybridpipe plan gpt --world-size 8 --memory-limit 64MiB\n"
            "  hybridpipe plan mlp --world-size 1024 --memory-limit 2MiB --batch-size 8192"
        ),
        formatter_class=_Formatter,
    )
    parser.add_argument("model", metavar="MODEL", help="what to plan for (see `profile`)")
    parser.add_argument("--world-size", type=_positive_int, required=True, help="devices")
    parser.add_argument(
        "--memory-limit", type=_bytes, default=None, metavar="BYTES",
        help="bytes per device, e.g. 80GiB (default: no cap)",
    )
    parser.add_argument(
        "--batch-size", type=_positive_int, default=None,
        help="samples per training step over all replicas (default: the example input's "
        "batch x world size)",
    )
    parser.add_argument(
        "--input-shape", type=_shape, action="append", default=None, metavar="SIZES",
        help="example input shape (its dim 0 is the profiled microbatch)",
    )
    parser.add_argument("--input-dtype", choices=_DTYPES, default=None, help="example dtype")
    parser.add_argument("--vocab", type=_positive_int, default=256, help="integer input range")
    parser.add_argument(
        "--schedules", type=_schedule_names, default=None, metavar="NAMES",
        help="schedules to try: comma-separated names (default: all)",
    )
    parser.add_argument(
        "--dp-bandwidth", type=float, default=1e10,
        help="bytes/s of the data-parallel gradient all-reduce (ring)",
    )
    parser.add_argument(
        "--latency", type=float, default=0.0, help="seconds per cross-rank transfer"
    )
    parser.add_argument("--top", type=_positive_int, default=20, help="rows to print and keep")
    parser.add_argument("--device", default="cpu", help="device to profile on")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and example input")
    parser.add_argument(
        "--json", type=Path, default=Path("autoplan.json"), metavar="PATH",
        help="where to write the ranked candidates",
    )
    parser.set_defaults(run=_run_plan, parser=parser)


def _run_plan(args: argparse.Namespace) -> int:
    from partitioner import capture, profile
    from pipeline.planning.autoplan import search

    model, inputs = _model_and_inputs(args)
    profiled_batch = int(inputs[0].shape[0])
    _progress(f"capturing and profiling {args.model} on microbatches of {profiled_batch} ...")
    graph = capture(model, inputs)
    profile(graph, model, inputs, device=args.device)
    result = search(
        graph,
        world_size=args.world_size,
        batch_size=args.batch_size or profiled_batch * args.world_size,
        profiled_batch=profiled_batch,
        memory_limit=args.memory_limit,
        schedules=args.schedules,
        latency=args.latency,
        dp_bandwidth=args.dp_bandwidth,
        keep=args.top,
    )
    print(result.table(args.top))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    print(f"wrote {args.json}")
    result.best  # noqa: B018 - raises the explanatory error when nothing fits
    return 0


# -------------------------------------------------------------------------------------- demo


def _add_demo(subparsers: Any) -> None:
    from pipeline.app.demo import DemoConfig

    defaults = DemoConfig()
    parser = subparsers.add_parser(
        "demo",
        help="the main job: profile, balance, simulate and train a small GPT on CPU",
        description=(
            "Build a small GPT-style model, profile and auto-balance it into pipeline stages,\n"
            "compare the schedules in simulation, train it through Pipeline on the Python\n"
            "standard library's source text and write pictures, a Chrome trace and a report."
        ),
        epilog=(
            "examples:\n"
            "  hybridpipe demo --out out\n"
            "  hybridpipe demo --steps 40 --stages 2 --schedule zb-h1 --out out/zb-h1"
        ),
        formatter_class=_Formatter,
    )
    parser.add_argument("--out", default="out", help="folder for the pictures, trace and report")
    parser.add_argument(
        "--steps", type=_positive_int, default=defaults.steps, help="training steps"
    )
    parser.add_argument(
        "--stages",
        type=_positive_int,
        default=defaults.stages,
        help="pipeline ranks (one worker thread each)",
    )
    parser.add_argument(
        "--schedule",
        choices=sorted(SCHEDULES),
        default=defaults.schedule,
        help="schedule to train with",
    )
    parser.add_argument(
        "--microbatches",
        type=_positive_int,
        default=defaults.microbatches,
        help="microbatches per step",
    )
    parser.set_defaults(run=_run_demo, parser=parser)


def _run_demo(args: argparse.Namespace) -> int:
    from pipeline.app.demo import DemoConfig, run_main

    config = DemoConfig(
        steps=args.steps,
        stages=args.stages,
        schedule=args.schedule,
        microbatches=args.microbatches,
    )
    return run_main(args.out, config)


# -------------------------------------------------------------------------------------- main

_COMMANDS: tuple[Callable[[Any], None], ...] = (_add_simulate, _add_profile, _add_plan, _add_demo)


def build_parser() -> argparse.ArgumentParser:
    """The `hybridpipe` parser with every command in `_COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="hybridpipe",
        description="Pipeline-parallel training for PyTorch: simulate schedules, "
        "profile and balance models.",
        formatter_class=_Formatter,
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _COMMANDS:
        add(subparsers)
    subparsers.metavar = "{" + ",".join(subparsers.choices) + "}"  # errors list the commands
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `hybridpipe` with `argv` (default: the process arguments); returns the exit code.

    Bad arguments, and bad values the library rejects, end with usage and the message (exit 2).
    """
    args = build_parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except (ValueError, TypeError) as exc:
        args.parser.error(str(exc))
    return code


if __name__ == "__main__":
    sys.exit(main())
