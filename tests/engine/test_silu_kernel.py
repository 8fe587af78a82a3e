"""SiLU's gradient in lightning_ort's ``SiluGrad`` CPU kernel.

The kernel (``engine/runtime/activation_kernels.cpp``) computes SiLU's derivative from a vectorized polynomial
form of exp. These tests check it against float64 over the whole float range that matters, that it propagates NaN
and refuses bad input with a message, and that captured CPU graphs take it for ``nn.SiLU``'s and ``F.silu``'s
gradient and train as accurately as eager.
"""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from lightning_ort import DebugOptions, ORTModule
from lightning_ort.engine.fx.silu import SILU_BACKWARD, silu_backward
from lightning_ort.engine.onnx.custom_ops import DOMAIN
from tests.helpers import assert_fp64_accuracy, kernel_session

aten = torch.ops.aten


def _session() -> ort.InferenceSession:
    return kernel_session(helper.make_node("SiluGrad", ["g", "x"], ["dx"], domain=DOMAIN), {"g": None, "x": None})


def test_the_gradient_matches_float64_from_the_far_negative_tail_to_the_far_positive(library: Path) -> None:
    """Within a few float32 ulps of the float64 gradient, also where sigmoid is within an ulp of 1 (1 - s is
    then not a difference) and in the negative tail, where the slope is tiny and negative."""
    generator = torch.Generator().manual_seed(0)
    x = torch.cat([torch.linspace(-40, 40, 200_001), torch.randn(50_000, generator=generator) * 4, torch.zeros(1)])
    g = torch.randn(x.shape, generator=generator)
    (ours,) = _session().run(None, {"g": g.numpy(), "x": x.numpy()})
    expected = aten.silu_backward(g.double(), x.double())
    torch.testing.assert_close(torch.from_numpy(ours).double(), expected, rtol=2e-6, atol=1e-7)
    tail = x < -1.3
    assert (torch.from_numpy(ours)[tail] * g[tail] <= 0).all(), "SiLU falls below x = -1.28, so its slope is negative"


def test_a_nan_input_gives_a_nan_gradient_and_large_ones_their_limits(library: Path) -> None:
    x = np.array([np.nan, 1e4, -1e4, 100.0, -100.0, 0.0], np.float32)
    (ours,) = _session().run(None, {"g": np.ones_like(x), "x": x})
    assert np.isnan(ours[0])
    np.testing.assert_array_equal(ours[1:], [1.0, 0.0, 1.0, 0.0, 0.5])


def test_the_kernel_refuses_operands_of_different_shapes(library: Path) -> None:
    with pytest.raises(Exception, match=r"SiluGrad: dY must have X's shape"):
        _session().run(None, {"g": np.ones((2, 3), np.float32), "x": np.ones((3, 2), np.float32)})


def test_only_float32_gradients_of_one_shape_take_the_kernel() -> None:
    x, g = torch.randn(4, 5), torch.randn(4, 5)
    traced = make_fx(silu_backward)(g, x)
    assert [n.target for n in traced.graph.nodes if n.op == "call_function"] == [SILU_BACKWARD]
    traced = make_fx(silu_backward)(g.double(), x.double())
    assert SILU_BACKWARD not in {n.target for n in traced.graph.nodes}
    torch.testing.assert_close(silu_backward(g.double(), x.double()), aten.silu_backward(g.double(), x.double()))


class SwishConvNet(nn.Module):
    """An EfficientNet-style block: convolutions with ``nn.SiLU``, a squeeze-excitation gate and ``F.silu``."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.SiLU())
        self.gate = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(16, 4, 1), nn.SiLU(), nn.Conv2d(4, 16, 1))
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = nn.functional.silu(h * torch.sigmoid(self.gate(h)))
        return self.head(h.mean(dim=(2, 3)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_swish_net_trains_through_the_kernel_as_accurately_as_eager(library: Path, seed: int) -> None:
    torch.manual_seed(seed)
    eager = SwishConvNet()
    wrapped = ORTModule(copy.deepcopy(eager), fallback="raise")
    assert_fp64_accuracy(eager, wrapped, torch.randn(8, 3, 8, 8) * 2)


def test_the_exported_gradient_is_one_node_per_silu(library: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    debug = DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path)
    wrapped = ORTModule(SwishConvNet(), debug, fallback="raise")
    wrapped(torch.randn(4, 3, 8, 8)).square().sum().backward()
    saved = [path for path in tmp_path.glob("m_training_backward*.onnx") if "optimized" not in path.name]
    ops = Counter(node.op_type for path in saved for node in onnx.load(str(path)).graph.node)
    assert ops["SiluGrad"] == 3
    assert ops["Exp"] == 0, "PyTorch's decomposition computes sigmoid as 1 / (1 + exp(-x))"
