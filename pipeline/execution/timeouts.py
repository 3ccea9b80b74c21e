"""The timeout settings every wait of both executors obeys: ``Pipeline(timeout=...)``, else
the environment variable HYBRIDPIPE_TIMEOUT, else 120 s; and, with ``compile=``, the compile
allowance ``Pipeline(compile_timeout=...)``, else HYBRIDPIPE_COMPILE_TIMEOUT, else 1800 s,
which bounds instead the waits of a step in which a process may be compiling (a peer
compiling its stage is busy, not stuck: docs/compile.md)."""

from __future__ import annotations

import math
import os

ENV_TIMEOUT = "HYBRIDPIPE_TIMEOUT"
DEFAULT_TIMEOUT = 120.0
ENV_COMPILE_TIMEOUT = "HYBRIDPIPE_COMPILE_TIMEOUT"
DEFAULT_COMPILE_TIMEOUT = 1800.0


def _resolve(value: float | None, name: str, env: str, default: float) -> float:
    source = name
    if value is None:
        text = os.environ.get(env)
        if text is None:
            return default
        source = f"${env}"
        try:
            value = float(text)
        except ValueError:
            raise ValueError(
                f"{source}={text!r} is not a number; give seconds, e.g. {default:g}"
            ) from None
    if (
        isinstance(value, bool) or not isinstance(value, (int, float))
        or not value > 0 or math.isinf(value)
    ):
        raise ValueError(f"{source} must be > 0 seconds (and finite), got {value!r}")
    return float(value)


def resolve_timeout(timeout: float | None) -> float:
    """`timeout` if given, else $HYBRIDPIPE_TIMEOUT, else 120 s; ValueError unless > 0."""
    return _resolve(timeout, "timeout", ENV_TIMEOUT, DEFAULT_TIMEOUT)


def resolve_compile_timeout(compile_timeout: float | None) -> float:
    """`compile_timeout` if given, else $HYBRIDPIPE_COMPILE_TIMEOUT, else 1800 s; ValueError
    unless > 0."""
    return _resolve(compile_timeout, "compile_timeout", ENV_COMPILE_TIMEOUT,
                    DEFAULT_COMPILE_TIMEOUT)
