"""The one timeout setting every wait of both executors obeys: ``Pipeline(timeout=...)``,
else the environment variable HYBRIDPIPE_TIMEOUT, else 120 s."""

from __future__ import annotations

import math
import os

ENV_TIMEOUT = "HYBRIDPIPE_TIMEOUT"
DEFAULT_TIMEOUT = 120.0


def resolve_timeout(timeout: float | None) -> float:
    """`timeout` if given, else $HYBRIDPIPE_TIMEOUT, else 120 s; ValueError unless > 0."""
    source = "timeout"
    if timeout is None:
        text = os.environ.get(ENV_TIMEOUT)
        if text is None:
            return DEFAULT_TIMEOUT
        source = f"${ENV_TIMEOUT}"
        try:
            timeout = float(text)
        except ValueError:
            raise ValueError(f"{source}={text!r} is not a number; give seconds, e.g. 120") from None
    if (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float))
        or not timeout > 0 or math.isinf(timeout)
    ):
        raise ValueError(f"{source} must be > 0 seconds (and finite), got {timeout!r}")
    return float(timeout)
