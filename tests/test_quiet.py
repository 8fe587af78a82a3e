"""Quiet by default: the graphs ONNX Runtime loads raise none of its warnings, a deployment export prints nothing,
and the advice for a graph break inside torch's own code says what the user can change."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
import torch
from lightning.pytorch.demos import Transformer
from torch import nn

from lightning_ort import DebugOptions, ExportError, FallbackWarning, ORTModule, export_for_deployment
from lightning_ort.engine.runtime.cpu_kernels import register_kernels
from tests.zoo import MLP


def _train(model: nn.Module, *args: torch.Tensor, folder: Path) -> None:
    debug = DebugOptions(save_onnx=True, save_path=str(folder), onnx_prefix=type(model).__name__)
    wrapped = ORTModule(model, debug, blocks="auto")
    for _ in range(2):
        wrapped(*args).float().sum().backward()


def test_the_exported_training_graphs_load_without_an_onnx_runtime_warning(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    _train(MLP(), torch.randn(4, 16), folder=tmp_path)
    demo = Transformer(vocab_size=50, nlayers=2, nhid=32, ninp=32, nhead=2)
    ids = torch.randint(0, 50, (2, 8))
    with pytest.warns(FallbackWarning):
        _train(demo, ids, ids, folder=tmp_path)
    files = [path for path in sorted(tmp_path.glob("*.onnx")) if "optimized" not in path.name]
    assert len(files) >= 4
    capfd.readouterr()
    for path in files:
        options = ort.SessionOptions()
        options.log_severity_level = 1  # warnings and above
        register_kernels(options, onnx.load(str(path)))  # the MLP's GELU gradient is lightning_ort's kernel
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    err = capfd.readouterr().err
    assert "[W:onnxruntime" not in err, err[:2000]


class BranchOnValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if y.sum() > 0:
            return y * 2
        return y


def test_a_deployment_export_prints_nothing_and_a_failed_one_names_the_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    capfd.readouterr()
    export_for_deployment(nn.Linear(4, 2), tmp_path / "m.onnx", (torch.randn(3, 4),))
    assert capfd.readouterr() == ("", "")
    with pytest.raises(ExportError, match=r"data-dependent .*, at .*test_quiet\.py:\d+ \(`if y\.sum\(\) > 0:`\)"):
        export_for_deployment(BranchOnValue(), tmp_path / "b.onnx", (torch.randn(3, 4),))
    assert capfd.readouterr() == ("", ""), "no partial FX graph, no torchvision lines"


def test_a_graph_break_inside_torch_gets_advice_the_user_can_follow() -> None:
    model = ORTModule(Transformer(vocab_size=50, nlayers=1, nhid=32, ninp=32, nhead=2))
    ids = torch.randint(0, 50, (2, 8))
    with pytest.warns(FallbackWarning) as record:
        model(ids, ids)
    (message,) = [str(w.message) for w in record if "graph break" in str(w.message)]
    assert "torch/nn/modules/transformer.py:" in message and "make_causal" in message
    assert "pass is_causal=True" in message and "move that code" not in message
    assert model.statistics.graph_breaks == 1
