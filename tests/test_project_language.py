"""The package, its docs, tests and examples speak of what the code does, not of how it was developed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("lightning_ort", "docs", "tests", "examples")
FILES = ("README.md", "CHANGELOG.md", "pyproject.toml", "noxfile.py")
DEVELOPMENT_HISTORY = re.compile(
    r"\bsessions? \d|\bthe issue\b|\bissue #?\d|\bround \d",
    re.IGNORECASE,
)
"""Words of a development log: numbered work sessions, rounds and issues."""


def _project_texts() -> list[Path]:
    paths = [ROOT / name for name in FILES]
    for folder in FOLDERS:
        paths += [p for p in (ROOT / folder).rglob("*") if p.suffix in {".py", ".md", ".yaml", ".toml", ".rst"}]
    return [p for p in paths if p.is_file() and "_build" not in p.parts and p != Path(__file__).resolve()]


def test_the_pattern_catches_development_history() -> None:
    for phrase in ("as measured in session 12", "the issue's targets", "round 3 of tuning", "Issue #24"):
        assert DEVELOPMENT_HISTORY.search(phrase), phrase
    for phrase in ("one InferenceSession per graph", "a session's providers", "issue a warning"):
        assert not DEVELOPMENT_HISTORY.search(phrase), phrase


@pytest.mark.parametrize("path", _project_texts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_development_history(path: Path) -> None:
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if DEVELOPMENT_HISTORY.search(line)
    ]
    assert not hits, "development history belongs in commit messages:\n" + "\n".join(hits)
