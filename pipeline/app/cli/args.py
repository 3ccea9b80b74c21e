"""Argument types and help formatting shared by the `hybridpipe` commands (whole numbers,
schedule names, input sizes and dtypes), and progress messages on stderr."""

from __future__ import annotations

import argparse
import sys

from scheduler import SCHEDULES, SYNTH

DTYPES = ("float32", "float64", "int64")


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show defaults (except None, whose meaning the help text gives) and keep the examples'
    line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def schedule_names(text: str) -> list[str]:
    """Comma-separated schedule names ('synth': synthesised from the costs), or 'all' (every
    generator)."""
    names = sorted(SCHEDULES) if text == "all" else [n.strip() for n in text.split(",") if n]
    unknown = [n for n in names if n not in SCHEDULES and n != SYNTH]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown schedule(s) {unknown or [text]}; choose from {', '.join(sorted(SCHEDULES))}"
            f", {SYNTH} (comma-separated) or 'all'"
        )
    return names


def sizes(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated sizes such as 8,3,224,224, got {text!r}"
        ) from None
    if not dims or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"sizes must be >= 1, got {text!r}")
    return dims


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
