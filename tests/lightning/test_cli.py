"""Lightning CLI runs in subprocesses: YAML strategy config, --trainer.strategy=ort_ddp, callbacks+=ORTCallback
(with its profiler switched on from the command line)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import onnx
import onnxruntime
import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = ROOT / "examples" / "cli_train.py"
CONFIG = ROOT / "examples" / "cli_config.yaml"

pytestmark = pytest.mark.slow

FAST = ["--trainer.devices=1", "--trainer.max_steps=2", "--trainer.limit_val_batches=1", "--trainer.logger=false"]


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CLI), "fit", *args],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_yaml_strategy_config_trains_and_saves_prefixed_onnx(tmp_path: Path) -> None:
    result = _cli(tmp_path, "--config", str(CONFIG), *FAST)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = sorted(p.name for p in (tmp_path / "onnx_models").glob("*.onnx"))
    # The encoder's two layers share one block graph per pass.
    assert "lit_lm_encoder_training_forward_block0.onnx" in saved
    assert "lit_lm_encoder_training_backward_block0_optimized.onnx" in saved
    assert all(name.startswith("lit_lm_encoder_") for name in saved)
    onnx.checker.check_model(str(tmp_path / "onnx_models" / "lit_lm_encoder_training_backward_block0.onnx"))
    assert "[V:onnxruntime" in result.stderr, "log_level VERBOSE reaches ONNX Runtime's session logger"
    session = onnxruntime.InferenceSession(
        str(tmp_path / "deploy" / "encoder.onnx"), providers=["CPUExecutionProvider"]
    )
    assert [i.name for i in session.get_inputs()] == ["src", "mask"], "export_onnx from the YAML wrote the encoder"


def test_bad_log_level_fails_at_parse_time_naming_allowed_values(tmp_path: Path) -> None:
    result = _cli(tmp_path, "--config", str(CONFIG), "--trainer.strategy.init_args.log_level=LOUD")
    assert result.returncode != 0
    assert "VERBOSE,INFO,WARNING,ERROR,FATAL" in result.stderr
    assert "LOUD" in result.stderr


def test_strategy_by_registered_name(tmp_path: Path) -> None:
    result = _cli(tmp_path, "--trainer.strategy=ort_ddp", "--trainer.accelerator=cpu", *FAST)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TransformerEncoder" in result.stdout + result.stderr  # the rank-zero summary table


def test_callback_added_on_the_command_line(tmp_path: Path) -> None:
    result = _cli(
        tmp_path,
        "--trainer.callbacks+=lightning_ort.ORTCallback",
        "--trainer.callbacks.modules=[encoder]",
        "--trainer.callbacks.profile=true",
        "--trainer.callbacks.save_path=profiles",
        "--trainer.accelerator=cpu",
        "--trainer.enable_progress_bar=false",
        *FAST,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "encoder  TransformerEncoder" in result.stdout + result.stderr
    assert "ONNX Runtime profile of `encoder` (fit" in result.stdout + result.stderr
    stems = {p.name.split("_profile_")[0] for p in (tmp_path / "profiles").glob("*.json")}
    # The sanity check ran first (inference); the encoder's layers share one block graph per pass.
    assert stems == {"encoder_inference_block0", "encoder_forward_block0", "encoder_backward_block0"}


def test_ort_fsdp_by_class_path_with_activation_checkpointing(tmp_path: Path) -> None:
    result = _cli(
        tmp_path,
        "--trainer.strategy=lightning_ort.ORTFSDPStrategy",
        "--trainer.strategy.activation_checkpointing=true",
        "--trainer.strategy.export_onnx=deploy/lm.onnx",
        "--trainer.accelerator=cpu",
        "--trainer.enable_checkpointing=false",
        *FAST,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "`encoder` sharded over 1 ranks as 2 block(s) of TransformerEncoderLayer" in output
    assert "exported `encoder` for deployment to deploy/lm.encoder.onnx" in output
    assert sorted(p.name for p in (tmp_path / "deploy").iterdir()) == [
        "lm.embed.onnx",
        "lm.encoder.onnx",
        "lm.head.onnx",
    ]
