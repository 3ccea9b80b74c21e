"""The guides the `Pipeline` docstring points to exist (a renamed guide fails here, not in a
reader's hands)."""

from __future__ import annotations

import re

from pipeline import Pipeline
from tests.support import ROOT


def test_pipeline_docstring_names_existing_guides() -> None:
    named = set(re.findall(r"docs/[\w-]+\.md", Pipeline.__doc__ or ""))
    assert len(named) >= 8, named
    missing = sorted(path for path in named if not (ROOT / path).is_file())
    assert not missing, f"the Pipeline docstring names guides that do not exist: {missing}"
