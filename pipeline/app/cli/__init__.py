"""The `hybridpipe` command line: `simulate` (compare schedules on a cost model and draw them),
`profile` (capture, profile and auto-balance a model into stages), `plan` (rank (pp, dp,
schedule, microbatches, chunks) for a world size under a memory cap) and `demo` (the main job).
Each command is a module here whose `add(subparsers)`, listed in `_COMMANDS`, declares its
arguments and the function that runs it; `args` holds the shared argument types and
`model_arg` the MODEL argument of `profile` and `plan`."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from pipeline.app.cli import demo, plan, profile, simulate
from pipeline.app.cli.args import Formatter

_COMMANDS: tuple[Callable[[Any], None], ...] = (simulate.add, profile.add, plan.add, demo.add)


def build_parser() -> argparse.ArgumentParser:
    """The `hybridpipe` parser with every command in `_COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="hybridpipe",
        description="Pipeline-parallel training for PyTorch: simulate schedules, "
        "profile and balance models.",
        formatter_class=Formatter,
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
