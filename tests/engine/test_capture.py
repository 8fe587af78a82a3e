"""The capture step (``engine/capture/aot.py``): AOTAutograd tracing and the forward/backward partition."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import onnx
import torch

from lightning_ort import DebugOptions, ORTModule


class _Repeats(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * torch.sin(x) + torch.cos(x) * torch.cos(x)


def test_repeated_subexpressions_are_computed_once(tmp_path: Path) -> None:
    # functorch's own CSE pass is off during partitioning; the ONNX translation removes the duplicates.
    wrapped = ORTModule(_Repeats(), DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path))
    x = torch.randn(4, 8, requires_grad=True)
    y = wrapped(x)
    y.sum().backward()
    ops = [node.op_type for node in onnx.load(str(tmp_path / "m_training_forward.onnx")).graph.node]
    assert ops.count("Sin") == 1 and ops.count("Cos") == 1, ops
    reference = x.detach().clone().requires_grad_(True)
    expected = torch.sin(reference) ** 2 + torch.cos(reference) ** 2
    expected.sum().backward()
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, reference.grad, rtol=1e-5, atol=1e-6)


def test_capture_does_not_import_inductors_pattern_matcher() -> None:
    # functorch's CSE pass would import it: 20-30 MiB resident and ~0.5 s of a process's first capture.
    code = (
        "import sys, torch\n"
        "from lightning_ort import ORTModule\n"
        "net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8), torch.nn.Dropout())\n"
        "ORTModule(net)(torch.randn(4, 8, requires_grad=True)).sum().backward()\n"
        "print('torch._inductor.pattern_matcher' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "False"
