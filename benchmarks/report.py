"""Where a benchmark leaves its results: benchmarks/results/<name>.json (the figures) and
<name>.md (the report, which is also printed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(name: str, data: Any, report: str, indent: int = 2) -> None:
    """Write `data` as results/<name>.json and `report` as results/<name>.md; print it."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=indent) + "\n")
    text = report if report.endswith("\n") else report + "\n"
    (RESULTS / f"{name}.md").write_text(text)
    print(text, end="")
