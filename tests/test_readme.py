"""The README's two set-up commands stay in step with CI."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setup_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section)


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one() -> None:
    commands = _setup_commands()
    assert len(commands) == 2
    demo, tests = commands
    assert "examples/train_transformer.py" in demo
    assert "pytest" in tests
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_declared_torch_range_is_the_tested_one() -> None:
    import tomllib

    from lightning_ort.engine.torch_internals import TORCH_FLOOR

    requirement = next(
        dep
        for dep in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        if dep.startswith("torch")
    )
    assert requirement == f"torch>={TORCH_FLOOR},<3"
    noxfile = (ROOT / "noxfile.py").read_text()
    assert f'TORCH_RANGE = ("{TORCH_FLOOR}.0", "2.13.0")' in noxfile
    assert f"compat(torch='{TORCH_FLOOR}.0')" in (ROOT / ".ci" / "run").read_text()
    assert f"({TORCH_FLOOR} to 2.13: CI tests both ends)" in (ROOT / "README.md").read_text()
