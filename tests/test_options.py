"""DebugOptions and LogLevel do what they say."""

from __future__ import annotations

import logging
from pathlib import Path

import onnx
import pytest
import torch

from lightning_ort import DebugOptions, LogLevel, ORTModule
from lightning_ort.options import parse_log_level
from tests.zoo import MLP


def test_save_onnx_writes_checked_models_with_prefix(tmp_path: Path) -> None:
    options = DebugOptions(save_onnx=True, onnx_prefix="mlp", save_path=tmp_path / "onnx")
    wrapped = ORTModule(MLP(), options)
    wrapped(torch.randn(2, 16)).sum().backward()
    with torch.no_grad():
        wrapped.eval()(torch.randn(2, 16))
    names = sorted(p.name for p in (tmp_path / "onnx").glob("*.onnx"))
    assert names == [
        "mlp_inference.onnx",
        "mlp_inference_optimized.onnx",
        "mlp_training_backward.onnx",
        "mlp_training_backward_optimized.onnx",
        "mlp_training_forward.onnx",
        "mlp_training_forward_optimized.onnx",
    ]
    for name in names:
        onnx.checker.check_model(str(tmp_path / "onnx" / name))


def test_log_level_sets_ort_severity_and_the_models_records_without_setting_a_logger_level(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.handler.setLevel(logging.DEBUG)  # the records reach the handler; the logger's level is left alone
    level = logging.getLogger("lightning_ort").level
    verbose = ORTModule(MLP(), DebugOptions(log_level=LogLevel.INFO))
    quiet = ORTModule(MLP(), DebugOptions(log_level="error"))  # built last: it does not win
    verbose(torch.randn(1, 16))
    assert any(r.name.startswith("lightning_ort") and r.levelno == logging.INFO for r in caplog.records)
    _, session = next(verbose._backend.runners())
    assert session._session.get_session_options().log_severity_level == 1
    caplog.clear()
    quiet(torch.randn(1, 16))
    assert not [r for r in caplog.records if r.name.startswith("lightning_ort") and r.levelno < logging.WARNING]
    assert logging.getLogger("lightning_ort").level == level, "log_level sets no logger's level"


def test_unknown_log_level_lists_the_allowed_values() -> None:
    with pytest.raises(ValueError, match="VERBOSE, INFO, WARNING, ERROR, FATAL"):
        parse_log_level("LOUD")
    assert parse_log_level("verbose") is LogLevel.VERBOSE


def test_onnx_file_name_without_prefix(tmp_path: Path) -> None:
    assert DebugOptions(save_path=tmp_path).onnx_file("forward") == tmp_path / "training_forward.onnx"


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("intra_op_num_threads", "four"),
        ("intra_op_num_threads", True),
        ("allow_spinning", "yes"),
        ("release_torch_threads", 1),
        ("optimization_level", 99),
        ("providers", 3),
        ("log_metrics", "no"),
        ("prog_bar", None),
        ("dynamic", "auto"),
        ("save_onnx", "true"),
        ("profile", 1),
        ("save_path", 42),
    ],
)
def test_a_bad_argument_type_is_a_type_error_naming_the_argument(argument: str, value: object) -> None:
    from lightning_ort import ORTCallback

    with pytest.raises(TypeError, match=rf"^{argument}=.* must be "):
        ORTCallback(**{argument: value})
