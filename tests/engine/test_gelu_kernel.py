"""GELU's gradient in lightning_ort's ``GeluGrad`` CPU kernel.

The kernel (``engine/runtime/activation_kernels.cpp``) computes the exact GELU's derivative and its tanh
approximation's from vectorized polynomial forms of erfc and exp. These tests check it against float64 over the
whole float range that matters (within PyTorch's own float32 error), that it propagates NaN and refuses bad input
with a message, and that captured CPU graphs take it for ``nn.GELU``'s gradient and train as accurately as eager.
"""

from __future__ import annotations

import copy
import math
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
from lightning_ort.engine.fx.gelu import GELU_BACKWARD, gelu_backward
from lightning_ort.engine.onnx.custom_ops import DOMAIN
from tests.helpers import assert_fp64_accuracy, kernel_session

aten = torch.ops.aten


def _session(approximate: int) -> ort.InferenceSession:
    node = helper.make_node("GeluGrad", ["g", "x"], ["dx"], domain=DOMAIN, approximate=approximate)
    return kernel_session(node, {"g": None, "x": None})


@pytest.mark.parametrize(("approximate", "name"), [(0, "none"), (1, "tanh")])
def test_the_gradient_matches_float64_from_the_far_negative_tail_to_the_far_positive(
    library: Path, approximate: int, name: str
) -> None:
    """Within 4e-7 absolute, about PyTorch's own float32 kernel's error (the performance page compares them), so
    also deep in the negative tail, where Phi(x) is tiny and 1 - erf would lose it."""
    generator = torch.Generator().manual_seed(0)
    x = torch.cat([torch.linspace(-20, 20, 200_001), torch.randn(50_000, generator=generator) * 3, torch.zeros(1)])
    g = torch.randn(x.shape, generator=generator)
    (ours,) = _session(approximate).run(None, {"g": g.numpy(), "x": x.numpy()})
    expected = aten.gelu_backward(g.double(), x.double(), approximate=name)
    torch.testing.assert_close(torch.from_numpy(ours).double(), expected, rtol=1e-6, atol=4e-7)
    tail = x < -5
    assert (torch.from_numpy(ours)[tail] * g[tail] <= 0).all(), "GELU falls below -0.17, so its slope is negative"


def test_a_nan_input_gives_a_nan_gradient_and_large_ones_their_limits(library: Path) -> None:
    x = np.array([np.nan, 1e4, -1e4, 90.0, -90.0], np.float32)
    for approximate in (0, 1):
        (ours,) = _session(approximate).run(None, {"g": np.ones_like(x), "x": x})
        assert np.isnan(ours[0])
        np.testing.assert_array_equal(ours[1:], [1.0, 0.0, 1.0, 0.0])


def test_the_kernel_refuses_operands_of_different_shapes_and_unknown_approximations(library: Path) -> None:
    with pytest.raises(Exception, match=r"GeluGrad: dY must have X's shape"):
        _session(0).run(None, {"g": np.ones((2, 3), np.float32), "x": np.ones((3, 2), np.float32)})
    with pytest.raises(Exception, match=r"GeluGrad: approximate must be 0 \(exact\) or 1 \(tanh\), not 2"):
        _session(2)


def test_only_float32_gradients_take_the_kernel() -> None:
    x, g = torch.randn(4, 5), torch.randn(4, 5)
    traced = make_fx(lambda g, x: gelu_backward(g, x))(g, x)
    assert [n.target for n in traced.graph.nodes if n.op == "call_function"] == [GELU_BACKWARD]
    traced = make_fx(lambda g, x: gelu_backward(g, x))(g.double(), x.double())
    assert GELU_BACKWARD not in {n.target for n in traced.graph.nodes}
    torch.testing.assert_close(gelu_backward(g.double(), x.double()), aten.gelu_backward(g.double(), x.double()))


class GeluMLP(nn.Module):
    """Linear layers with the exact GELU, its tanh form and ``F.gelu`` between them."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(24, 64)
        self.mid = nn.Linear(64, 64)
        self.down = nn.Linear(64, 5)
        self.exact, self.tanh = nn.GELU(), nn.GELU(approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.tanh(self.mid(self.exact(self.up(x))))))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_gelu_net_trains_through_the_kernel_as_accurately_as_eager(library: Path, seed: int) -> None:
    torch.manual_seed(seed)
    eager = GeluMLP()
    wrapped = ORTModule(copy.deepcopy(eager), fallback="raise")
    assert_fp64_accuracy(eager, wrapped, torch.randn(32, 24) * 2)


def test_the_exported_gradient_is_one_node_per_gelu(library: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    debug = DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path)
    wrapped = ORTModule(GeluMLP(), debug, fallback="raise")
    wrapped(torch.randn(8, 24)).square().sum().backward()
    nodes = onnx.load(str(tmp_path / "m_training_backward.onnx")).graph.node
    ops = Counter(node.op_type for node in nodes)
    assert ops["GeluGrad"] == 3
    assert ops["Erf"] == ops["Exp"] == ops["Tanh"] == 0
    approximations = [helper.get_attribute_value(n.attribute[0]) for n in nodes if n.op_type == "GeluGrad"]
    assert sorted(approximations) == [0, 0, 1]
    assert math.isfinite(float(wrapped.module.up.weight.grad.abs().sum()))
