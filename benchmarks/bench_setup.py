"""Wall time from a fault during distributed setup to its detection on every surviving rank.

Runs the spawned-gloo cases of tests/pipeline/execution/distributed/test_agreement.py (each
asserts what its message names) and collects the times they print: a settings mismatch (found
at the sync point, while the Pipeline is built), a later step whose ranks disagree, and a rank
that dies before building, raises while capturing, is killed while profiling or hangs while
building (timeout 5 s in the tests). Writes benchmarks/results/setup_agreement.md and .json.

    python benchmarks/bench_setup.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from report import write_results

ROOT = Path(__file__).resolve().parents[1]
AGREEMENT = "tests/pipeline/execution/distributed/test_agreement.py"
LINE = re.compile(r"^(?P<case>[^:\n]+): (?:detected|found) after (?P<times>.+)$", re.M)


def main() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", AGREEMENT],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )
    if run.returncode != 0:
        sys.exit(f"{AGREEMENT} failed:\n{run.stdout[-4000:]}")
    rows = [(m["case"].strip(" ."), m["times"].strip()) for m in LINE.finditer(run.stdout)]
    lines = [
        "# Distributed setup: time from the fault to its detection",
        "",
        "`python benchmarks/bench_setup.py` (spawned gloo processes on CPU; failure cases with",
        "timeout 5 s; a mismatch is found while the Pipeline is built, so its time includes the",
        "construction).",
        "",
        "| case | detected after |",
        "|---|---|",
        *(f"| {case} | {times} |" for case, times in rows),
        "",
    ]
    write_results("setup_agreement", dict(rows), "\n".join(lines))


if __name__ == "__main__":
    main()
