"""2-D max pooling on CPU: the forward pools values only, the backward is lightning_ort's ``MaxPoolGrad`` kernel.

These tests check that captured graphs take that form (no ``MaxPool`` with indices, no scatter), that the kernel
routes each gradient to the position PyTorch's CPU kernel picks (the first largest value of a window, the last
NaN) bit for bit, that models with max pooling train as eager does, and which calls are left to the standard
export.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper
from torch import nn
from torch.nn import functional as F

from lightning_ort import DebugOptions, ORTModule
from lightning_ort.bench.vision import BasicBlock
from lightning_ort.engine.fx.max_pool import replace_max_pools, replaceable_max_pools
from lightning_ort.engine.onnx.custom_ops import DOMAIN
from tests.helpers import assert_grads_close, kernel_session

aten = torch.ops.aten


def _grad_session(window: dict[str, int], x_shape: list[int], grad_shape: list[int]) -> ort.InferenceSession:
    node = helper.make_node("MaxPoolGrad", ["g", "x"], ["dx"], domain=DOMAIN, **window)
    return kernel_session(node, {"g": grad_shape, "x": x_shape})


@pytest.mark.parametrize(
    ("kernel", "stride", "padding", "dilation", "size"),
    [
        ((3, 3), (2, 2), (1, 1), (1, 1), (13, 16)),  # ResNet's stem pooling, odd and even sizes
        ((2, 2), (2, 2), (0, 0), (1, 1), (8, 9)),  # VGG's
        ((3, 2), (1, 2), (1, 0), (2, 1), (11, 10)),  # dilated, overlapping rows
        ((5, 5), (3, 3), (2, 2), (1, 1), (17, 17)),
        ((3, 3), (1, 1), (1, 1), (1, 1), (6, 7)),  # every window overlaps its neighbours
    ],
)
@pytest.mark.parametrize("values", ["distinct", "ties", "nan"])
def test_the_gradient_goes_where_pytorchs_kernel_sends_it_bit_for_bit(
    library: Path, kernel: Any, stride: Any, padding: Any, dilation: Any, size: Any, values: str
) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, *size, generator=generator)
    if values == "ties":
        x = x.round()  # many equal maxima: the first one in the window takes the gradient
    if values == "nan":
        x[0, 0, 1, 1] = x[1, 2, 2, 3] = x[1, 2, 3, 3] = float("nan")
    window = [list(kernel), list(stride), list(padding), list(dilation)]
    y, indices = aten.max_pool2d_with_indices(x, *window, False)
    grad = torch.randn(y.shape, generator=generator)
    expected = aten.max_pool2d_with_indices_backward(grad, x, *window, False, indices)
    attributes = {
        f"{part}_{axis}": value
        for part, pair in zip(("kernel", "stride", "pad", "dilation"), window, strict=True)
        for axis, value in zip("hw", pair, strict=True)
    }
    session = _grad_session(attributes, list(x.shape), list(grad.shape))
    (actual,) = session.run(None, {"g": grad.numpy(), "x": x.numpy()})
    np.testing.assert_array_equal(actual, expected.numpy())


def test_a_window_larger_than_the_padding_allows_is_refused(library: Path) -> None:
    window = dict(kernel_h=2, kernel_w=2, stride_h=1, stride_w=1, pad_h=2, pad_w=0, dilation_h=1, dilation_w=1)
    with pytest.raises(Exception, match="MaxPoolGrad: padding must be at most half the dilated kernel"):
        _grad_session(window, [1, 1, 4, 4], [1, 1, 7, 3])


def test_a_gradient_with_more_positions_than_the_windows_is_refused(library: Path) -> None:
    window = dict(kernel_h=2, kernel_w=2, stride_h=2, stride_w=2, pad_h=0, pad_w=0, dilation_h=1, dilation_w=1)
    session = _grad_session(window, [1, 1, 4, 4], [1, 1, 3, 2])
    with pytest.raises(Exception, match="MaxPoolGrad: dY has more positions than X's windows"):
        session.run(None, {"g": np.ones((1, 1, 3, 2), np.float32), "x": np.ones((1, 1, 4, 4), np.float32)})


class Pooled(nn.Module):
    """A ResNet stem's max pooling, a VGG-style 2x2 one, and a functional call with keywords."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(self.conv(self.stem(x)), kernel_size=2)
        return self.head(F.max_pool2d(x, x.shape[-1]).flatten(1))


def test_max_pooling_runs_values_only_forward_and_in_the_kernel_backward(library: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    eager = Pooled()
    debug = DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path)
    wrapped = ORTModule(copy.deepcopy(eager), debug, fallback="raise", conv_weight_grad="onnx")
    x = torch.randn(4, 3, 16, 16)
    expected, actual = eager(x), wrapped(x)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    actual.backward(grad)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert_grads_close(wrapped, eager)
    forward = onnx.load(str(tmp_path / "m_training_forward.onnx")).graph.node
    backward = onnx.load(str(tmp_path / "m_training_backward.onnx")).graph.node
    pools = [n for n in forward if n.op_type == "MaxPool"]
    assert len(pools) == 3 and all(len(n.output) == 1 for n in pools), "values only"
    assert [n.op_type for n in backward].count("MaxPoolGrad") == 3
    assert not [n for n in backward if n.op_type in ("ScatterElements", "ScatterND")]


def _pooling_graph(**call: Any) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["example_value"] = torch.empty(call.pop("shape", (2, 3, 8, 8)), dtype=call.pop("dtype", torch.float32))
    graph.output(graph.call_function(F.max_pool2d, (x, 2), call))
    return torch.fx.GraphModule(nn.Module(), graph)


@pytest.mark.parametrize(
    "call",
    [{"ceil_mode": True}, {"return_indices": True}, {"dtype": torch.float64}, {"shape": (3, 8, 8)}],
    ids=["ceil-mode", "indices-returned", "float64", "unbatched"],
)
def test_other_max_pooling_keeps_the_standard_export(call: dict[str, Any]) -> None:
    gm = _pooling_graph(**call)
    assert replaceable_max_pools(gm) == 0 and replace_max_pools(gm) == 0
    assert any(n.target is F.max_pool2d for n in gm.graph.nodes)


def test_the_kernels_follow_dynamic_shapes(library: Path) -> None:
    # One graph for three batch and image sizes: the max-pooling and batch-norm kernels read their shapes at run
    # time, the residual block's add and ReLU included.
    torch.manual_seed(0)
    eager = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
        BasicBlock(16, 16, 1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 4),
    )
    wrapped = ORTModule(copy.deepcopy(eager), dynamic=True, fallback="raise")
    for shape in [(4, 3, 16, 16), (6, 3, 20, 20), (3, 3, 12, 12)]:
        x = torch.randn(shape)
        expected, actual = eager(x), wrapped(x)
        expected.sum().backward()
        actual.sum().backward()
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        assert_grads_close(wrapped, eager)
    stats = wrapped.statistics
    assert stats.graphs == 1 and stats.backward_runs == 3
