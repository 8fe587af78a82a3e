"""Layer norm's gradient in lightning_ort's ``LayerNormGrad`` CPU kernel.

The kernel (``engine/runtime/layer_norm_kernels.cpp``) computes the input, weight and bias gradients of a layer
norm over the last dimensions in two passes per row. These tests check it against PyTorch's float64 gradient for
row sizes on and off its 16-float lanes, that it refuses bad shapes with a message, and that captured CPU graphs
take it for ``nn.LayerNorm``'s gradient (also ConvNeXt's channels-last one) and train as accurately as eager.
"""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from lightning_ort import DebugOptions, ORTModule
from lightning_ort.bench.vision import ConvNeXt
from lightning_ort.engine.fx.layer_norm import LAYER_NORM_BACKWARD, layer_norm_backward
from lightning_ort.engine.onnx.custom_ops import DOMAIN
from tests.helpers import assert_fp64_accuracy, kernel_session

aten = torch.ops.aten


def _session() -> ort.InferenceSession:
    node = helper.make_node("LayerNormGrad", ["g", "x", "w", "m", "s"], ["dx", "dw", "db"], domain=DOMAIN)
    return kernel_session(node, dict.fromkeys(node.input))


@pytest.mark.parametrize("shape", [(3, 5, 7), (200, 48), (2, 9, 256), (1, 33), (70, 3, 4)], ids=str)
def test_the_gradients_match_float64(library: Path, shape: tuple[int, ...]) -> None:
    """Rows shorter and longer than the 16 lanes, with and without a tail, many rows and one; the last two
    dimensions normalized for the last shape."""
    generator = torch.Generator().manual_seed(len(shape))
    normalized = list(shape[-2:]) if len(shape) == 3 and shape[0] == 70 else [shape[-1]]
    x = torch.randn(shape, generator=generator) * 3 + 1
    g = torch.randn(shape, generator=generator)
    w, b = torch.rand(normalized, generator=generator) + 0.5, torch.randn(normalized, generator=generator)
    _, mean, rstd = aten.native_layer_norm(x, normalized, w, b, 1e-5)
    feeds = {"g": g, "x": x, "w": w, "m": mean, "s": rstd}
    ours = _session().run(None, {name: value.numpy() for name, value in feeds.items()})
    x64, w64, b64 = (t.double() for t in (x, w, b))
    _, mean64, rstd64 = aten.native_layer_norm(x64, normalized, w64, b64, 1e-5)
    expected = aten.native_layer_norm_backward(g.double(), x64, normalized, mean64, rstd64, w64, b64, [True] * 3)
    for name, got, reference in zip(("dX", "dscale", "dB"), ours, expected, strict=True):
        scale = reference.abs().max().item()
        torch.testing.assert_close(torch.from_numpy(got).double(), reference, rtol=1e-5, atol=2e-6 * scale, msg=name)


def test_the_kernel_refuses_statistics_or_a_scale_of_the_wrong_size(library: Path) -> None:
    x = np.ones((4, 6), np.float32)
    feeds = {"g": x, "x": x, "w": np.ones(6, np.float32), "m": np.zeros(4, np.float32), "s": np.ones(4, np.float32)}
    with pytest.raises(Exception, match=r"LayerNormGrad: mean and invstd must hold one value per row, 4"):
        _session().run(None, {**feeds, "m": np.zeros(3, np.float32)})
    with pytest.raises(Exception, match=r"LayerNormGrad: scale must hold X's normalized size, not 5 of 24 values"):
        _session().run(None, {**feeds, "w": np.ones(5, np.float32)})


def test_layer_norms_without_a_weight_or_in_float64_keep_pytorchs_decomposition() -> None:
    x, g, w, b = torch.randn(4, 6), torch.randn(4, 6), torch.rand(6), torch.randn(6)
    _, mean, rstd = aten.native_layer_norm(x, [6], w, b, 1e-5)

    def ops(*tensors: torch.Tensor) -> set[object]:
        def backward(g: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, *w: torch.Tensor) -> Any:
            return layer_norm_backward(g, x, [6], mean, rstd, w[0] if w else None, None, [True, bool(w), False])

        return {node.target for node in make_fx(backward)(*tensors).graph.nodes}

    assert LAYER_NORM_BACKWARD in ops(g, x, mean, rstd, w)
    assert LAYER_NORM_BACKWARD not in ops(g, x, mean, rstd)
    assert LAYER_NORM_BACKWARD not in ops(*(t.double() for t in (g, x, mean, rstd, w)))


class PreNorm(nn.Module):
    """Two pre-norm residual MLP blocks, one layer norm without a bias, and a final norm over two dimensions."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList([nn.LayerNorm(32), nn.LayerNorm(32, bias=False)])
        self.mlps = nn.ModuleList([nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)) for _ in range(2)])
        self.final = nn.LayerNorm([6, 32])
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, mlp in zip(self.norms, self.mlps, strict=True):
            x = x + mlp(norm(x))
        return self.head(self.final(x))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_pre_norm_net_trains_through_the_kernel_as_accurately_as_eager(library: Path, seed: int) -> None:
    torch.manual_seed(seed)
    eager = PreNorm()
    assert_fp64_accuracy(eager, ORTModule(copy.deepcopy(eager), fallback="raise"), torch.randn(5, 6, 32))


def test_convnexts_channels_last_layer_norms_train_through_the_kernel(library: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    eager = ConvNeXt(widths=(16, 32), depths=(1, 1), classes=5)
    debug = DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path)
    assert_fp64_accuracy(eager, ORTModule(copy.deepcopy(eager), debug, fallback="raise"), torch.randn(4, 3, 32, 32))
    backward = [path for path in tmp_path.glob("m_training_backward*.onnx") if "optimized" not in path.name]
    ops = Counter(node.op_type for path in backward for node in onnx.load(str(path)).graph.node)
    norms = sum(isinstance(m, nn.LayerNorm) for m in eager.modules())  # the blocks' and ChannelNorm
    assert ops["LayerNormGrad"] == norms > 0
