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


def _strategy_names(text: str) -> set[str]:
    return set(re.findall(r'"(ort(?:_[a-z]+)*)"', text))


def test_the_docs_list_the_registered_strategy_names() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_ort  # noqa: F401

    registered = {name for name in StrategyRegistry if name.startswith("ort")}
    assert registered == {"ort", "ort_ddp", "ort_ddp_spawn", "ort_fsdp"}
    table = (ROOT / "docs" / "lightning.md").read_text().split("## Registered names", 1)[1].split("\n## ", 1)[0]
    assert _strategy_names(table) == registered
    for path in ("docs/getting-started.md", "examples/cli_train.py"):
        (comment,) = [line for line in (ROOT / path).read_text().splitlines() if "registers" in line]
        assert _strategy_names(comment) == registered, path
    lightning_line = next(line for line in (ROOT / "README.md").read_text().splitlines() if "* Lightning:" in line)
    paragraph = (ROOT / "README.md").read_text().split(lightning_line, 1)[1].split("\n\n", 1)[0]
    assert _strategy_names(lightning_line + paragraph) == registered


def test_the_readme_coverage_figures_are_the_coverage_page_figures() -> None:
    coverage = (ROOT / "docs" / "coverage.md").read_text()
    total, full = re.search(r"\*\*(\d+) architectures: (\d+) fully in ONNX Runtime", coverage).groups()  # type: ignore[union-attr]
    hugging_face = re.search(r"adds (\d+) Hugging Face transformers architectures", coverage).group(1)  # type: ignore[union-attr]
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"Coverage: {full} of the {total} architectures of `tests/zoo/`" in readme
    assert f"all {hugging_face} Hugging Face architectures" in readme
