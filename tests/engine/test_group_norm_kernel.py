"""Group norm in lightning_ort's ``GroupNormTraining`` and ``GroupNormGrad`` CPU kernels.

The kernels (``engine/runtime/group_norm_kernels.cpp``) compute ``nn.GroupNorm``'s forward with its statistics and
its gradients. These tests check them against float64 on shapes with and without whole vector lanes, from one group
to one group per channel, that they refuse bad input with a message, and that captured CPU graphs take them for
``nn.GroupNorm`` (a diffusion U-Net's block) and train as accurately as eager.
"""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from lightning_ort import DebugOptions, ORTModule
from lightning_ort.engine.fx.group_norm import (
    GROUP_NORM,
    GROUP_NORM_BACKWARD,
    group_norm,
    group_norm_backward,
)
from lightning_ort.engine.onnx.custom_ops import DOMAIN
from tests.helpers import assert_fp64_accuracy, kernel_session

aten = torch.ops.aten

SHAPES = [
    ((4, 32, 16, 16), 8),  # whole lanes
    ((3, 12, 5, 7), 4),  # a tail of positions in every plane
    ((2, 6, 9), 1),  # one group: layer norm over the channels and positions
    ((2, 8, 3, 3), 8),  # one channel per group: instance norm
    ((5, 4), 2),  # no positions beyond the channels
]


def _inputs(shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3 + 1
    channels = shape[1]
    return (
        x,
        torch.rand(channels, generator=g) + 0.5,
        torch.randn(channels, generator=g),
        torch.randn(shape, generator=g),
    )


def _sizes(x: torch.Tensor) -> tuple[int, int, int]:
    return x.shape[0], x.shape[1], int(np.prod(x.shape[2:], dtype=np.int64))


@pytest.mark.parametrize(("shape", "groups"), SHAPES)
def test_the_forward_matches_float64(library: Path, shape: tuple[int, ...], groups: int) -> None:
    x, w, b, _ = _inputs(shape)
    node = helper.make_node(
        "GroupNormTraining", ["x", "w", "b"], ["y", "mean", "rstd"], domain=DOMAIN, groups=groups, epsilon=1e-5
    )
    y, mean, rstd = kernel_session(node, {"x": None, "w": None, "b": None}).run(
        None, {"x": x.numpy(), "w": w.numpy(), "b": b.numpy()}
    )
    expected = aten.native_group_norm(x.double(), w.double(), b.double(), *_sizes(x), groups, 1e-5)
    for ours, theirs in zip((y, mean, rstd), expected, strict=True):
        torch.testing.assert_close(torch.from_numpy(ours).double(), theirs, rtol=1e-4, atol=1e-4)
    assert mean.shape == (shape[0], groups)


@pytest.mark.parametrize(("shape", "groups"), SHAPES)
def test_the_gradient_matches_float64(library: Path, shape: tuple[int, ...], groups: int) -> None:
    x, w, b, g = _inputs(shape, seed=1)
    _, mean, rstd = aten.native_group_norm(x.double(), w.double(), b.double(), *_sizes(x), groups, 1e-5)
    node = helper.make_node(
        "GroupNormGrad", ["g", "x", "w", "mean", "rstd"], ["dx", "dw", "db"], domain=DOMAIN, groups=groups
    )
    session = kernel_session(node, {"g": None, "x": None, "w": None, "mean": None, "rstd": None})
    feeds = {"g": g, "x": x, "w": w, "mean": mean.float(), "rstd": rstd.float()}
    ours = session.run(None, {name: value.numpy() for name, value in feeds.items()})
    expected = aten.native_group_norm_backward(
        g.double(), x.double(), mean, rstd, w.double(), *_sizes(x), groups, [True, True, True]
    )
    for got, want in zip(ours, expected, strict=True):
        torch.testing.assert_close(torch.from_numpy(got).double(), want, rtol=1e-4, atol=1e-4)


def test_the_kernels_refuse_channels_that_do_not_split_into_the_groups_and_wrong_statistics(library: Path) -> None:
    node = helper.make_node(
        "GroupNormTraining", ["x", "w", "b"], ["y", "mean", "rstd"], domain=DOMAIN, groups=3, epsilon=1e-5
    )
    session = kernel_session(node, {"x": None, "w": None, "b": None})
    with pytest.raises(
        Exception, match=r"GroupNormTraining: X must be \[N, C, \.\.\.\] with C a multiple of groups \(3\)"
    ):
        session.run(
            None, {"x": np.ones((2, 4, 3), np.float32), "w": np.ones(4, np.float32), "b": np.ones(4, np.float32)}
        )
    node = helper.make_node(
        "GroupNormGrad", ["g", "x", "w", "mean", "rstd"], ["dx", "dw", "db"], domain=DOMAIN, groups=2
    )
    session = kernel_session(node, {"g": None, "x": None, "w": None, "mean": None, "rstd": None})
    x = np.ones((2, 4, 3), np.float32)
    feeds = {
        "g": x,
        "x": x,
        "w": np.ones(4, np.float32),
        "mean": np.ones(3, np.float32),
        "rstd": np.ones(4, np.float32),
    }
    with pytest.raises(
        Exception, match=r"GroupNormGrad: mean must hold one value per image and group, 4 values, not 3"
    ):
        session.run(None, feeds)


def test_only_float32_group_norms_with_a_weight_and_a_bias_take_the_kernels() -> None:
    x, w, b, g = _inputs((2, 4, 3))
    traced = make_fx(lambda x, w, b: group_norm(x, w, b, 2, 4, 3, 2, 1e-5))(x, w, b)
    assert GROUP_NORM in {n.target for n in traced.graph.nodes}
    assert group_norm(x.double(), w.double(), b.double(), 2, 4, 3, 2, 1e-5) is NotImplemented
    assert group_norm(x, None, None, 2, 4, 3, 2, 1e-5) is NotImplemented
    _, mean, rstd = aten.native_group_norm(x, w, b, 2, 4, 3, 2, 1e-5)
    mask = [True, True, True]
    traced = make_fx(lambda g, x, m, r, w: group_norm_backward(g, x, m, r, w, 2, 4, 3, 2, mask))(g, x, mean, rstd, w)
    assert GROUP_NORM_BACKWARD in {n.target for n in traced.graph.nodes}
    traced = make_fx(lambda g, x, m, r: group_norm_backward(g, x, m, r, None, 2, 4, 3, 2, mask))(g, x, mean, rstd)
    assert GROUP_NORM_BACKWARD not in {n.target for n in traced.graph.nodes}


class DiffusionBlock(nn.Module):
    """A diffusion U-Net's residual block: GroupNorm and SiLU before each convolution, a 1x1 skip projection."""

    def __init__(self, channels_in: int = 8, channels_out: int = 16) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(4, channels_in), nn.Conv2d(channels_in, channels_out, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(8, channels_out), nn.Conv2d(channels_out, channels_out, 3, padding=1)
        self.skip = nn.Conv2d(channels_in, channels_out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(nn.functional.silu(self.norm1(x)))
        return self.conv2(nn.functional.silu(self.norm2(h))) + self.skip(x)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_diffusion_block_trains_through_the_kernels_as_accurately_as_eager(library: Path, seed: int) -> None:
    torch.manual_seed(seed)
    eager = DiffusionBlock()
    wrapped = ORTModule(copy.deepcopy(eager), fallback="raise")
    assert_fp64_accuracy(eager, wrapped, torch.randn(4, 8, 8, 8) * 2 + 1)


def test_each_group_norm_is_one_node_each_way(library: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    debug = DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path)
    wrapped = ORTModule(DiffusionBlock(), debug, fallback="raise")
    wrapped(torch.randn(2, 8, 8, 8)).square().sum().backward()

    def ops(pattern: str) -> Counter[str]:
        saved = [path for path in tmp_path.glob(pattern) if "optimized" not in path.name]
        return Counter(node.op_type for path in saved for node in onnx.load(str(path)).graph.node)

    forward, backward = ops("m_training_forward*.onnx"), ops("m_training_backward*.onnx")
    assert forward["GroupNormTraining"] == 2 and forward["InstanceNormalization"] == 0
    assert backward["GroupNormGrad"] == 2 and backward["Sub"] == 0, "the decomposed gradient centres X with Sub"
