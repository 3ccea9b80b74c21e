"""The guides the `Pipeline` docstring points to exist (a renamed guide fails here, not in a
reader's hands)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from pipeline import Pipeline
from tests.support import ROOT


def test_pipeline_docstring_names_existing_guides() -> None:
    named = set(re.findall(r"docs/[\w-]+\.md", Pipeline.__doc__ or ""))
    assert len(named) >= 8, named
    missing = sorted(path for path in named if not (ROOT / path).is_file())
    assert not missing, f"the Pipeline docstring names guides that do not exist: {missing}"


def _links(path: Path) -> set[str]:
    """The relative file links of a markdown file (no URLs, no anchors)."""
    found = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text())
    return {link for link in found if "://" not in link}


def test_readme_links_every_guide_and_every_link_resolves() -> None:
    readme = ROOT / "README.md"
    links = _links(readme)
    guides = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert "docs/getting-started.md" in guides
    assert not guides - links, f"guides README does not link: {sorted(guides - links)}"
    for page in [readme, *sorted((ROOT / "docs").glob("*.md"))]:
        broken = sorted(link for link in _links(page)
                        if not (page.parent / link).resolve().exists())
        assert not broken, f"{page.name} links to missing files: {broken}"


def test_getting_started_is_short_and_covers_the_first_hour() -> None:
    text = (ROOT / "docs" / "getting-started.md").read_text()
    assert len(text.splitlines()) < 150
    heads = [line for line in text.splitlines() if line.startswith("## ")]
    assert heads == ["## Install", "## The first Pipeline", "## A torchrun run",
                     "## A checkpoint, and a resume", "## What to read next"]
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        compile(block, "getting-started.md", "exec")


@pytest.mark.slow
def test_getting_started_code_runs_as_written(tmp_path: Path, monkeypatch: Any,
                                              capsys: Any) -> None:
    """The first Pipeline and the checkpoint blocks, run twice in one folder: the second run
    resumes at step 20 (the torchrun block is the examples' path, tested there)."""
    blocks = re.findall(r"```python\n(.*?)```",
                        (ROOT / "docs" / "getting-started.md").read_text(), re.S)
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        exec(compile(blocks[0] + blocks[2], "getting-started.md", "exec"), {})
    out = capsys.readouterr().out
    assert "starting afresh" in out and "resumed after step 20 from 'out/ckpt" in out
    assert "samples/s" in out and "bubble" in out


def test_guides_keep_the_current_figures_and_leave_history_to_the_results() -> None:
    """The user guides give the current figure and its command; earlier runs, the runs'
    letters and numbers, and the project's issue numbers live in
    benchmarks/results/history.md."""
    history = ROOT / "benchmarks" / "results" / "history.md"
    assert "| run (load average) |" in history.read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        ours = re.sub(r"(nccl-tests|NCCL) issue \d+", "", text)  # others' issues cited
        assert not re.search(r"\bissue \d+", ours), page.name
        assert not re.search(r"Runs? [a-d] / [a-d]|\bruns? \d+-\d+\b|\| run ", text), page.name
