"""GELU's gradient in lightning_ort's ``GeluGrad`` CPU kernel.

The kernel (``engine/runtime/activation_kernels.cpp``) computes the exact GELU's derivative and its tanh
approximation's from vectorized polynomial forms of erfc and exp. These tests check it against float64 over the
whole float range that matters (within PyTorch's own float32 error), that it propagates NaN and refuses bad input
with a message, and that captured CPU graphs take it for ``nn.GELU``'s gradient and train as accurately as eager.
The tanh GELU that Hugging Face models write out in elementwise ops is folded into ``F.gelu`` first.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Callable
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
from lightning_ort.engine.fx.gelu import GELU_BACKWARD, fold_tanh_gelus, gelu_backward, gelus
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


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``gelu_new`` (GPT-2, GPT-J, BLOOM), as ``transformers.activations.NewGELUActivation``."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``gelu_fast``: the same function, grouped otherwise, with a 10-digit constant."""
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


@pytest.mark.parametrize(
    "gelu", [_gelu_new, _gelu_fast, lambda x: (torch.tanh(0.7978845608 * (x + 0.044715 * x**3)) + 1) * x * 0.5]
)
def test_a_tanh_gelu_written_out_in_elementwise_ops_becomes_one_gelu(
    gelu: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    gm = torch.fx.symbolic_trace(lambda x, y: gelu(x) * y)
    assert fold_tanh_gelus(gm) == 1
    calls = [node.target for node in gm.graph.nodes if node.op == "call_function"]
    assert gelus(gm) == 1 and len(calls) == 2, calls
    x, y = torch.randn(64, 32) * 3, torch.randn(64, 32)
    torch.testing.assert_close(gm(x, y), gelu(x) * y, rtol=1e-6, atol=1e-6)


def test_chains_that_are_not_the_tanh_gelu_or_share_their_intermediates_stay() -> None:
    def other_constant(x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.05 * torch.pow(x, 3.0))))

    def shared(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inner = x + 0.044715 * torch.pow(x, 3.0)
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * inner)), inner

    def two_tensors(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return 0.5 * y * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3.0))))

    for function in (other_constant, shared, two_tensors, lambda x: torch.tanh(x) * x):
        gm = torch.fx.symbolic_trace(function)
        before = [node.target for node in gm.graph.nodes]
        assert fold_tanh_gelus(gm) == 0 and [node.target for node in gm.graph.nodes] == before


class NewGeluMLP(nn.Module):
    """Linear layers with Hugging Face's ``gelu_new`` written out, as GPT-2's MLP has it."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(24, 64)
        self.down = nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(_gelu_new(self.up(x)))


@pytest.mark.parametrize("seed", [0, 1])
def test_a_written_out_tanh_gelu_trains_as_one_gelu_and_one_gradient_kernel(
    library: Path, tmp_path: Path, seed: int
) -> None:
    torch.manual_seed(seed)
    eager = NewGeluMLP()
    assert_fp64_accuracy(eager, ORTModule(copy.deepcopy(eager), fallback="raise"), torch.randn(32, 24) * 2)
    debug = DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path)
    wrapped = ORTModule(copy.deepcopy(eager), debug, fallback="raise")
    wrapped(torch.randn(8, 24)).square().sum().backward()
    forward, backward = (
        Counter(node.op_type for node in onnx.load(str(tmp_path / f"m_training_{kind}.onnx")).graph.node)
        for kind in ("forward", "backward")
    )
    assert forward["Gelu"] == 1 and forward["Tanh"] == forward["Pow"] == 0, forward
    assert backward["GeluGrad"] == 1 and backward["Tanh"] == backward["Pow"] == 0, backward
