"""`hybridpipe demo`: the main job (profile, balance, simulate and train a small GPT on CPU),
its arguments mapped onto `DemoConfig`."""

from __future__ import annotations

import argparse
from typing import Any

from pipeline.app.cli.args import Formatter, positive_int
from scheduler import SCHEDULES


def add(subparsers: Any) -> None:
    from pipeline.app.demo_config import DemoConfig

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
        formatter_class=Formatter,
    )
    parser.add_argument("--out", default="out", help="folder for the pictures, trace and report")
    parser.add_argument(
        "--steps", type=positive_int, default=defaults.steps, help="training steps"
    )
    parser.add_argument(
        "--stages",
        type=positive_int,
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
        type=positive_int,
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
