"""`hybridpipe simulate`: compare schedules on a cost model (step time, bubble, memory) and
draw their timelines, memory plots and Chrome traces; 'synth' is a schedule synthesised for
the given costs under --memory-limit (scheduler.synthesize)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.app.cli.args import Formatter, positive_int, schedule_names
from scheduler import (
    SCHEDULES,
    SYNTH,
    Schedule,
    Timeline,
    build_schedule,
    rank_costs_to_stages,
    simulate,
    synthesize,
)


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


def add(subparsers: Any) -> None:
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
            "  hybridpipe simulate --schedule interleaved-1f1b --virtual-stages 2 --comm 0.1\n"
            "  hybridpipe simulate --schedule synth --compare zb-h1,zb-h2 --forward 2,1,1,3 "
            "--backward 3,2,2,5 --weight 1 --memory-limit 4 --out out/synth"
        ),
        formatter_class=Formatter,
    )
    parser.add_argument(
        "--schedule", default="1f1b", choices=[*sorted(SCHEDULES), SYNTH],
        help="schedule to simulate ('synth': searched for these costs, see --memory-limit)",
    )
    parser.add_argument(
        "--compare",
        type=schedule_names,
        default=None,
        metavar="NAMES",
        help="more schedules to simulate alongside --schedule: comma-separated names or 'all'",
    )
    parser.add_argument("--ranks", type=positive_int, default=4, help="pipeline ranks (devices)")
    parser.add_argument("--microbatches", type=positive_int, default=8, help="microbatches")
    parser.add_argument(
        "--virtual-stages",
        type=positive_int,
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
        "--memory-limit", type=positive_int, default=None, metavar="N",
        help="for 'synth': the most (stage, microbatch) activations a rank may hold (default: "
        "ranks x virtual stages, what 1F1B and ZB-H1 hold on rank 0)",
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
            schedule = (
                _synthesized(args) if name == SYNTH
                else build_schedule(name, args.ranks, args.microbatches, args.virtual_stages)
            )
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
            activation_unit="microbatch",
        )
        results.append(_Simulated(schedule, timeline))
    return results, notes


def _synthesized(args: argparse.Namespace) -> Schedule:
    """The schedule synthesised for the command's costs (per-stage or per-rank with one
    stage per rank: a rank's costs are split over its stages once the placement is chosen,
    which the synthesis searches)."""
    v = args.virtual_stages or 1
    n = args.ranks * v

    def per_stage(cost: float | list[float], what: str) -> float | list[float]:
        if isinstance(cost, float):
            return cost / v
        if len(cost) != n:
            raise ValueError(
                f"{what} has {len(cost)} values; 'synth' with {v} virtual stages per rank "
                f"needs one number or one per stage ({n})"
            )
        return cost

    limit = args.memory_limit if args.memory_limit is not None else args.ranks * v
    return synthesize(
        args.ranks, args.microbatches, per_stage(args.forward, "--forward"),
        per_stage(args.backward, "--backward"), per_stage(args.weight, "--weight"),
        args.comm, memory_limit=limit, virtual_stages=v,
    )


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
