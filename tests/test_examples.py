"""The README's demo and the examples run end to end (in their fast mode) in fresh processes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_transformer_demo_trains_and_prints_statistics() -> None:
    result = subprocess.run(
        [sys.executable, "examples/train_transformer.py", "--fast"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert losses[-1] < losses[0]
    assert "cache hits 7, misses 2, graphs 2, ORT runs: forward 9, backward 8" in result.stdout


@pytest.mark.slow
def test_bench_reports_ratios(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["--steps", "2", "--warmup", "1", "--seq", "16", "--width", "32", "--vocab", "50", "--json", str(out)]
    result = subprocess.run(
        [sys.executable, "-m", "lightning_ort.bench", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert "speedup" in result.stdout
    assert '"train_speedup"' in out.read_text()
