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


def _run_example(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--fast"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow
def test_lightning_quickstart_runs_ort_ddp_on_two_cpu_processes(tmp_path: Path) -> None:
    result = _run_example("lightning_quickstart.py", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "'ort/cache_hits': 18.0" in result.stdout  # 2 ranks x 3 wrapped modules x 3 reuses


@pytest.mark.slow
def test_existing_project_callback_example(tmp_path: Path) -> None:
    result = _run_example("existing_project_callback.py", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    ran = re.search(r"encoder ran in ONNX Runtime: (\d+) forward and (\d+) backward runs, its 2 layers", result.stdout)
    assert ran is not None, result.stdout[-2000:]
    assert int(ran[1]) > 4 and int(ran[2]) >= 4 * 2, "4 training steps through the 2 layers' block graph"
