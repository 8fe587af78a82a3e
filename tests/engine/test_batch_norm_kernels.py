"""Training-mode batch norm (and the ReLU or ReLU6 after it) in lightning_ort's fused ONNX Runtime CPU kernels.

The kernels (``engine/runtime/batch_norm_kernels.cpp``) are built on first use. These tests check that captured
graphs use them, that models train with float64-referenced accuracy through them and update their running
statistics as eager does, that the kernels mask the activations' gradients as PyTorch does and refuse bad shapes
with a message, and that without them (no compiler) graphs keep the standard ONNX ops.
"""

from __future__ import annotations

import copy
import math
import operator
import warnings
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
from torch.nn import functional as F

from lightning_ort import DebugOptions, ORTModule
from lightning_ort.bench.vision import BasicBlock
from lightning_ort.engine.capture import aot
from lightning_ort.engine.fx.batch_norm import fusable_batch_norms, fuse_batch_norms
from lightning_ort.engine.onnx.custom_ops import DOMAIN
from lightning_ort.engine.runtime import cpu_kernels
from tests.helpers import assert_fp64_accuracy, kernel_session


class ConvNet(nn.Module):
    """Conv/BN/ReLU, a BN without ReLU before a residual add, an affine-free BN with an in-place ReLU, a BN with
    ReLU6, one with a hardtanh, and a BN whose output feeds a ReLU and the head (so that ReLU cannot be fused)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.plain = nn.BatchNorm2d(8, affine=False)
        self.six = nn.Sequential(nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8), nn.ReLU6())
        self.tanh = nn.Sequential(nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8), nn.Hardtanh(-1, 2))
        self.shared = nn.BatchNorm2d(8)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = F.relu(self.bn(self.conv(x)) + x)
        x = F.relu(self.plain(x), inplace=True)
        x = self.tanh(self.six(x))
        shared = self.shared(x)
        pooled = torch.cat([F.relu(shared).mean((2, 3)), shared.amax((2, 3))], 1)
        return self.head(pooled)


def _exported_ops(tmp_path: Path, model: nn.Module, *inputs: torch.Tensor) -> dict[str, list[onnx.NodeProto]]:
    debug = DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path)
    wrapped = ORTModule(model, debug, conv_weight_grad="onnx")
    wrapped(*inputs).square().sum().backward()
    graphs = {}
    for graph in ("forward", "backward"):
        graphs[graph] = list(onnx.load(str(tmp_path / f"m_training_{graph}.onnx")).graph.node)
    return graphs


def _clamps(nodes: list[onnx.NodeProto], op_type: str) -> list[tuple[float, float] | None]:
    clamps: list[tuple[float, float] | None] = []
    for node in (n for n in nodes if n.op_type == op_type):
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        clamps.append((attributes["min"], attributes["max"]) if attributes["clamp"] else None)
    return clamps


def test_each_training_batch_norm_is_one_kernel_each_way_with_its_activation(library: Path, tmp_path: Path) -> None:
    graphs = _exported_ops(tmp_path, ConvNet(), torch.randn(4, 3, 8, 8))
    forward, backward = (Counter(n.op_type for n in graphs[g]) for g in ("forward", "backward"))
    assert forward["BatchNormTraining"] == 5 and backward["BatchNormTrainingGrad"] == 5
    assert forward["BatchNormAddTraining"] == 1 and backward["BatchNormAddTrainingGrad"] == 1
    assert forward["BatchNormalization"] == backward["BatchNormalization"] == forward["Clip"] == 0
    assert forward["Relu"] == 1  # the shared BN's
    # The stem's, the affine-free BN's ReLUs, ReLU6 and the hardtanh are fused; the residual BN with its add and
    # ReLU; the shared one feeds two ops.
    relu, six, tanh = (0.0, math.inf), (0.0, 6.0), (-1.0, 2.0)
    expected = [None, relu, relu, six, tanh]
    for graph, op_type in (("forward", "BatchNormTraining"), ("backward", "BatchNormTrainingGrad")):
        assert sorted(_clamps(graphs[graph], op_type), key=str) == sorted(expected, key=str)
    assert _clamps(graphs["forward"], "BatchNormAddTraining") == [relu]
    assert _clamps(graphs["backward"], "BatchNormAddTrainingGrad") == [relu]
    assert all(n.domain == DOMAIN for n in graphs["forward"] if n.op_type.startswith("BatchNorm"))


class InPlaceBlock(nn.Module):
    """torchvision's ResNet block: ``out += identity`` in place, then an ``nn.ReLU(inplace=True)``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn(self.conv(x))
        out += x
        return self.relu(out)


def _residual_net() -> nn.Module:
    """A stem, a block with a projection (the add joins two batch norms), a plain one and an in-place one."""
    stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
    blocks = [BasicBlock(8, 16, 2), BasicBlock(16, 16, 1), InPlaceBlock(16)]
    return nn.Sequential(stem, *blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))


def test_a_residual_blocks_add_and_relu_run_in_its_batch_norms_kernel(library: Path, tmp_path: Path) -> None:
    graphs = _exported_ops(tmp_path, _residual_net(), torch.randn(4, 3, 8, 8))
    forward, backward = (Counter(n.op_type for n in graphs[g]) for g in ("forward", "backward"))
    # Each block's last batch norm takes the add and the ReLU; the projection's batch norm is a plain one (its
    # output is the residual); the stem's and the blocks' first ones take their ReLU.
    assert forward["BatchNormAddTraining"] == backward["BatchNormAddTrainingGrad"] == 3
    assert forward["BatchNormTraining"] == backward["BatchNormTrainingGrad"] == 4
    assert forward["Relu"] == 0
    normalized = {n.output[0] for n in graphs["forward"] if n.op_type.startswith("BatchNorm")}
    assert not [n for n in graphs["forward"] if n.op_type == "Add" and normalized & set(n.input)]
    assert _clamps(graphs["forward"], "BatchNormAddTraining") == [(0.0, math.inf)] * 3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_residual_nets_train_through_the_kernels_as_accurately_as_eager(library: Path, seed: int) -> None:
    torch.manual_seed(seed)
    eager = _residual_net()
    wrapped = ORTModule(copy.deepcopy(eager), fallback="raise")
    x = torch.randn(6, 3, 12, 12) * 2 + 1
    assert_fp64_accuracy(eager, wrapped, x, perturbations=2)


@pytest.mark.parametrize(("seed", "size"), [(0, 8), (1, 8), (2, 8), (0, 24), (1, 24)])
def test_a_conv_net_trains_through_the_kernels_as_accurately_as_eager(library: Path, seed: int, size: int) -> None:
    # 8x8 images take the kernels' column-wise path (few positions per channel), 24x24 their plane-wise one.
    torch.manual_seed(seed)
    eager = ConvNet()
    wrapped = ORTModule(copy.deepcopy(eager), fallback="raise")
    x = torch.randn(6, 3, size, size) * 2 + 1
    assert_fp64_accuracy(eager, wrapped, x, perturbations=2)


def test_running_statistics_follow_eager_over_steps(library: Path) -> None:
    torch.manual_seed(0)
    eager = ConvNet()
    wrapped = ORTModule(copy.deepcopy(eager), fallback="raise")
    for step in range(3):
        x = torch.randn(5, 3, 8, 8) * (step + 1) + step
        eager(x).sum().backward()
        wrapped(x).sum().backward()
    for (name, theirs), ours in zip(eager.named_buffers(), wrapped.module.buffers(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    ("layer", "shape"), [(nn.BatchNorm1d(6), (7, 6, 11)), (nn.BatchNorm3d(6, momentum=0.3), (3, 6, 4, 3, 5))]
)
def test_one_and_three_dimensional_batch_norms_match_eager(
    library: Path, layer: nn.Module, shape: tuple[int, ...]
) -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(layer, nn.ReLU())
    wrapped = ORTModule(copy.deepcopy(eager), fallback="raise")
    x = torch.randn(shape, requires_grad=True)
    x_ours = x.detach().clone().requires_grad_()
    grad = torch.randn(shape)
    eager(x).backward(grad)
    wrapped(x_ours).backward(grad)
    torch.testing.assert_close(x_ours.grad, x.grad, rtol=1e-4, atol=1e-5)
    for theirs, ours in zip(eager.parameters(), wrapped.module.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-4)
    for theirs, ours in zip(eager.buffers(), wrapped.module.buffers(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def _grad_node(clamp: tuple[float, float] | None) -> onnx.NodeProto:
    low, high = clamp if clamp is not None else (0.0, math.inf)
    inputs, outputs = ["g", "x", "w", "b", "m", "s"], ["dx", "dw", "db"]
    attributes = {"clamp": int(clamp is not None), "min": low, "max": high}
    return helper.make_node("BatchNormTrainingGrad", inputs, outputs, domain=DOMAIN, **attributes)


@pytest.mark.parametrize("clamp", [(0.0, math.inf), (0.0, 0.5)], ids=["relu", "hardtanh"])
def test_the_gradient_is_zero_where_the_activation_was_flat_even_for_infinite_gradients(
    library: Path, clamp: tuple[float, float]
) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 5, 7)).astype(np.float32)
    mean, invstd = x.mean((0, 2, 3)), 1 / np.sqrt(x.var((0, 2, 3)) + 1e-5)
    w, b = np.ones(3, np.float32), np.zeros(3, np.float32)
    normalized = (x - mean.reshape(1, 3, 1, 1)) * invstd.reshape(1, 3, 1, 1)
    off = (normalized <= clamp[0]) | (normalized >= clamp[1])  # where the activation is flat
    assert 0 < off.mean() < 1
    g = rng.standard_normal(x.shape).astype(np.float32)
    g_poisoned = np.where(off, np.float32(np.inf), g)
    shapes = {"g": x.shape, "x": x.shape, "w": (3,), "b": (3,), "m": (3,), "s": (3,)}
    session = kernel_session(_grad_node(clamp), shapes)
    feeds = {"x": x, "w": w, "b": b, "m": mean.astype(np.float32), "s": invstd.astype(np.float32)}
    clean = session.run(None, {"g": np.where(off, 0, g).astype(np.float32), **feeds})
    poisoned = session.run(None, {"g": g_poisoned, **feeds})
    for a, e in zip(poisoned, clean, strict=True):
        np.testing.assert_array_equal(a, e)
    assert np.isfinite(poisoned[0]).all()


def test_after_a_residual_add_the_gradient_is_masked_by_the_output_and_passed_to_the_residual(library: Path) -> None:
    rng = np.random.default_rng(0)
    x, z = rng.standard_normal((2, 4, 3, 5, 7)).astype(np.float32)
    mean, invstd = x.mean((0, 2, 3)), 1 / np.sqrt(x.var((0, 2, 3)) + 1e-5)
    w, b = rng.random(3).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    inputs = {"x": x, "w": w, "b": b, "rm": np.zeros(3, np.float32), "rv": np.ones(3, np.float32), "z": z}
    forward = helper.make_node(
        "BatchNormAddTraining",
        list(inputs),
        ["y", "mean", "invstd", "new_rm", "new_rv"],
        domain=DOMAIN,
        epsilon=1e-5,
        momentum=0.1,
        clamp=1,
        min=0.0,
        max=math.inf,
    )
    y, *_ = kernel_session(forward, {n: v.shape for n, v in inputs.items()}).run(None, inputs)
    normalized = F.batch_norm(torch.from_numpy(x), None, None, torch.from_numpy(w), torch.from_numpy(b), True)
    expected = torch.relu(normalized + torch.from_numpy(z))
    torch.testing.assert_close(torch.from_numpy(y), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(y, np.maximum(y, 0))
    off = y <= 0
    assert 0 < off.mean() < 1
    g = rng.standard_normal(x.shape).astype(np.float32)
    backward = helper.make_node(
        "BatchNormAddTrainingGrad",
        ["g", "x", "w", "b", "m", "s", "y"],
        ["dx", "dw", "db", "dz"],
        domain=DOMAIN,
        clamp=1,
        min=0.0,
        max=math.inf,
    )
    feeds = {"x": x, "w": w, "b": b, "m": mean.astype(np.float32), "s": invstd.astype(np.float32), "y": y}
    session = kernel_session(backward, {"g": x.shape, **{n: v.shape for n, v in feeds.items()}})
    clean = session.run(None, {"g": np.where(off, 0, g).astype(np.float32), **feeds})
    poisoned = session.run(None, {"g": np.where(off, np.float32(np.inf), g), **feeds})
    for a, e in zip(poisoned, clean, strict=True):
        np.testing.assert_array_equal(a, e)
    np.testing.assert_array_equal(clean[3], np.where(off, 0, g))
    # dX, dscale and dbias are the plain gradient's of the masked dY.
    plain_shapes = {"g": x.shape, "x": x.shape, "w": (3,), "b": (3,), "m": (3,), "s": (3,)}
    plain = kernel_session(_grad_node(None), plain_shapes)
    unclamped = plain.run(None, {"g": clean[3], **{n: v for n, v in feeds.items() if n != "y"}})
    for a, e in zip(clean[:3], unclamped, strict=True):
        np.testing.assert_array_equal(a, e)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("size", [(1, 17), (7, 7), (8, 8), (9, 9), (5, 13), (24, 24)], ids=str)
def test_the_gradient_matches_float64_at_image_sizes_around_its_plane_and_row_paths(
    library: Path, residual: bool, size: tuple[int, int]
) -> None:
    """Images below 64 positions run the gradient over rows of channels, larger ones plane by plane in float lanes
    with a scalar tail: each way matches PyTorch's float64 gradient of relu(bn(x) [+ z])."""
    generator = torch.Generator().manual_seed(sum(size))
    shape = (3, 5, *size)
    x, z, g = (torch.randn(shape, generator=generator) for _ in range(3))
    w, b = torch.rand(5, generator=generator) + 0.5, torch.randn(5, generator=generator)
    feeds = {"x": x, "w": w, "b": b, "rm": torch.zeros(5), "rv": torch.ones(5)} | ({"z": z} if residual else {})
    op = "BatchNormAddTraining" if residual else "BatchNormTraining"
    attributes = {"clamp": 1, "min": 0.0, "max": math.inf}
    forward = helper.make_node(
        op, list(feeds), ["y", "m", "s", "new_rm", "new_rv"], domain=DOMAIN, epsilon=1e-5, momentum=0.1, **attributes
    )
    arrays = {name: value.numpy() for name, value in feeds.items()}
    y, mean, invstd, *_ = kernel_session(forward, {n: v.shape for n, v in arrays.items()}).run(None, arrays)
    saved = {"g": g.numpy(), "x": arrays["x"], "w": arrays["w"], "b": arrays["b"], "m": mean, "s": invstd}
    if residual:
        saved["y"] = y
    outputs = ["dx", "dw", "db", "dz"] if residual else ["dx", "dw", "db"]
    backward = helper.make_node(f"{op}Grad", list(saved), outputs, domain=DOMAIN, **attributes)
    ours = kernel_session(backward, {n: v.shape for n, v in saved.items()}).run(None, saved)
    leaves = [t.double().requires_grad_() for t in (x, w, b, z)]
    x64, w64, b64, z64 = leaves
    normalized = F.batch_norm(x64, None, None, w64, b64, training=True, eps=1e-5)
    torch.relu(normalized + z64 if residual else normalized).backward(g.double())
    for name, got, leaf in zip(outputs, ours, leaves, strict=False):
        assert leaf.grad is not None
        torch.testing.assert_close(torch.from_numpy(got).double(), leaf.grad, rtol=1e-4, atol=2e-5, msg=name)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("size", [(2, 2), (5, 5), (8, 8), (24, 24)], ids=str)
def test_a_gradient_of_one_value_per_plane_gives_what_its_expanded_form_gives(
    library: Path, residual: bool, size: tuple[int, int]
) -> None:
    """A global average pool's gradient, [N, C, 1, 1], is read per plane (rows and planes paths) with the same
    results, bit for bit, as the gradient expanded over each plane."""
    rng = np.random.default_rng(sum(size))
    shape = (3, 5, *size)
    x = rng.standard_normal(shape).astype(np.float32)
    pooled = rng.standard_normal((3, 5, 1, 1)).astype(np.float32) / np.float32(size[0] * size[1])
    feeds = {
        "x": x,
        "w": (rng.random(5) + 0.5).astype(np.float32),
        "b": rng.standard_normal(5).astype(np.float32),
        "m": x.mean((0, 2, 3)).astype(np.float32),
        "s": (1 / np.sqrt(x.var((0, 2, 3)) + 1e-5)).astype(np.float32),
    }
    if residual:
        feeds["y"] = np.maximum(rng.standard_normal(shape), 0).astype(np.float32)
    op = "BatchNormAddTrainingGrad" if residual else "BatchNormTrainingGrad"
    outputs = ["dx", "dw", "db", "dz"] if residual else ["dx", "dw", "db"]
    node = helper.make_node(op, ["g", *feeds], outputs, domain=DOMAIN, clamp=1, min=0.0, max=math.inf)
    session = kernel_session(node, {"g": None, **{name: value.shape for name, value in feeds.items()}})
    per_plane = session.run(None, {"g": pooled, **feeds})
    expanded = session.run(None, {"g": np.ascontiguousarray(np.broadcast_to(pooled, shape)), **feeds})
    for name, ours, theirs in zip(outputs, per_plane, expanded, strict=True):
        np.testing.assert_array_equal(ours, theirs, err_msg=name)


def _to_blocks(t: np.ndarray) -> np.ndarray:
    """``t`` ([N, C, H, W], C a multiple of 16) in ONNX Runtime's NCHWc layout with 16-channel blocks."""
    n, c, h, w = t.shape
    return np.ascontiguousarray(t.reshape(n, c // 16, 16, h, w).transpose(0, 1, 3, 4, 2)).reshape(t.shape)


BLOCKS = torch.backends.cpu.get_cpu_capability() == "AVX512"


@pytest.mark.skipif(not BLOCKS, reason="the gradient's NCHWc form runs on AVX-512 CPUs")
@pytest.mark.parametrize("clamp", [None, (0.0, math.inf), (-0.5, 0.5)], ids=["none", "relu", "hardtanh"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize(
    ("channels", "size", "per_plane"),
    [(16, (7, 7), False), (32, (8, 8), False), (48, (1, 1), False), (16, (3, 5), False), (32, (5, 5), True)],
    ids=["tail", "whole-tiles", "one-position", "odd-tile", "per-plane"],
)
def test_the_gradient_in_nchwc_blocks_is_the_plain_gradient_reordered(
    library: Path,
    clamp: tuple[float, float] | None,
    residual: bool,
    channels: int,
    size: tuple[int, int],
    per_plane: bool,
) -> None:
    """With ``block=16`` the kernel reads dY and writes dX and dZ in 16-channel NCHWc blocks, X and Y plain: the
    masked gradient dZ bit for bit the plain kernel's, dX, dscale and dbias up to the order of the float sums."""
    rng = np.random.default_rng(channels + size[0])
    shape = (3, channels, *size)
    x = rng.standard_normal(shape).astype(np.float32)
    g = rng.standard_normal((3, channels, 1, 1) if per_plane else shape).astype(np.float32)
    feeds = {
        "x": x,
        "w": (rng.random(channels) + 0.5).astype(np.float32),
        "b": rng.standard_normal(channels).astype(np.float32),
        "m": x.mean((0, 2, 3)).astype(np.float32),
        "s": (1 / np.sqrt(x.var((0, 2, 3)) + 1e-5)).astype(np.float32),
    }
    if residual:
        feeds["y"] = np.clip(rng.standard_normal(shape), *(clamp or (-np.inf, np.inf))).astype(np.float32)
    low, high = clamp if clamp is not None else (0.0, math.inf)
    attributes = {"clamp": int(clamp is not None), "min": low, "max": high}
    op = "BatchNormAddTrainingGrad" if residual else "BatchNormTrainingGrad"
    outputs = ["dx", "dw", "db", "dz"] if residual else ["dx", "dw", "db"]
    shapes = {"g": None, **{name: value.shape for name, value in feeds.items()}}
    plain_node = helper.make_node(op, ["g", *feeds], outputs, domain=DOMAIN, **attributes)
    blocked_node = helper.make_node(op, ["g", *feeds], outputs, domain=DOMAIN, block=16, **attributes)
    plain = kernel_session(plain_node, shapes).run(None, {"g": g, **feeds})
    blocked = kernel_session(blocked_node, shapes).run(None, {"g": g if per_plane else _to_blocks(g), **feeds})
    np.testing.assert_allclose(blocked[0], _to_blocks(plain[0]), rtol=1e-4, atol=1e-5, err_msg="dx")
    np.testing.assert_allclose(blocked[1], plain[1], rtol=1e-5, atol=1e-5, err_msg="dscale")
    np.testing.assert_allclose(blocked[2], plain[2], rtol=1e-5, atol=1e-5, err_msg="dbias")
    if residual:
        np.testing.assert_array_equal(blocked[3], _to_blocks(plain[3]), err_msg="dz")


@pytest.mark.skipif(not BLOCKS, reason="the gradient's NCHWc form runs on AVX-512 CPUs")
def test_the_gradient_in_nchwc_blocks_refuses_channels_that_are_not_whole_blocks(library: Path) -> None:
    node = helper.make_node(
        "BatchNormTrainingGrad",
        ["g", "x", "w", "b", "m", "s"],
        ["dx", "dw", "db"],
        domain=DOMAIN,
        clamp=0,
        min=0.0,
        max=math.inf,
        block=16,
    )
    shapes = {"g": (2, 24, 4, 4), "x": (2, 24, 4, 4), "w": (24,), "b": (24,), "m": (24,), "s": (24,)}
    feeds = {name: np.ones(shape, np.float32) for name, shape in shapes.items()}
    with pytest.raises(Exception, match="block=16 needs block 16, C a multiple of 16 and an AVX-512 CPU; C is 24"):
        kernel_session(node, shapes).run(None, feeds)


def test_a_gradient_of_neither_shape_is_refused_with_both_shapes_named(library: Path) -> None:
    shapes = {"g": (2, 3, 2, 1), "x": (2, 3, 4, 4), "w": (3,), "b": (3,), "m": (3,), "s": (3,)}
    session = kernel_session(_grad_node(None), shapes)
    feeds = {name: np.ones(shape, np.float32) for name, shape in shapes.items()}
    with pytest.raises(Exception, match=r"dY must have X's shape, or \[N, C, 1, ...\] for one value per image plane"):
        session.run(None, feeds)


def test_a_global_pools_gradient_reaches_the_batch_norm_gradient_one_value_per_plane(
    library: Path, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )
    debug = DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path)
    wrapped = ORTModule(copy.deepcopy(eager), debug, fallback="raise")
    x = torch.randn(4, 3, 6, 6)
    wrapped(x).square().sum().backward()
    eager(x).square().sum().backward()
    # The 3x3 weight gradient on 6x6 images runs in PyTorch, after the backward graph's first part.
    backward = onnx.load(str(tmp_path / "m_training_backward_part0.onnx")).graph
    assert "Expand" not in {node.op_type for node in backward.node}
    (grad,) = [node for node in backward.node if node.op_type == "BatchNormTrainingGrad"]
    producers = {output: node for node in backward.node for output in node.output}
    assert producers[grad.input[0]].op_type == "Div"
    for (name, ours), theirs in zip(wrapped.module.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_kernel_given_mismatched_shapes_fails_with_a_message_naming_the_input(library: Path) -> None:
    shapes = {"g": (2, 3, 4), "x": (2, 3, 4), "w": (4,), "b": (3,), "m": (3,), "s": (3,)}
    session = kernel_session(_grad_node(None), shapes)
    feeds = {name: np.ones(shape, np.float32) for name, shape in shapes.items()}
    with pytest.raises(Exception, match=r"BatchNormTrainingGrad: scale must have shape \[C\] = \[3\]"):
        session.run(None, feeds)


def _graph_with_batch_norm(
    *,
    training: bool = True,
    momentum: Any = 0.1,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    consumers: int = 1,
) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["example_value"] = torch.empty(2, 3, 4, 4, dtype=dtype, device=device)
    normed = graph.call_function(F.batch_norm, (x, None, None, None, None, training, momentum, 1e-5))
    relus = [graph.call_function(F.relu, (normed,)) for _ in range(consumers)]
    graph.output(tuple(relus))
    return torch.fx.GraphModule(nn.Module(), graph)


@pytest.mark.parametrize(
    "changes",
    [{"training": False}, {"momentum": None}, {"dtype": torch.float64}, {"device": "meta"}],
    ids=["evaluation", "cumulative-average", "float64", "not-cpu"],
)
def test_batch_norms_the_kernels_do_not_compute_are_left_alone(changes: dict[str, Any]) -> None:
    gm = _graph_with_batch_norm(**changes)
    assert fusable_batch_norms(gm) == 0 and fuse_batch_norms(gm) == 0
    assert any(n.target is F.batch_norm for n in gm.graph.nodes)


def _graph_with_residual_add(add: str, residual_shape: tuple[int, ...] = (2, 3, 4, 4), readers: int = 1) -> Any:
    graph = torch.fx.Graph()
    x, z = graph.placeholder("x"), graph.placeholder("z")
    x.meta["example_value"] = torch.empty(2, 3, 4, 4)
    z.meta["example_value"] = torch.empty(residual_shape)
    normed = graph.call_function(F.batch_norm, (x, None, None, None, None, True, 0.1, 1e-5))
    normed.meta["example_value"] = torch.empty(2, 3, 4, 4)
    calls = {
        "bn + z": (operator.add, (normed, z)),
        "z + bn": (operator.add, (z, normed)),
        "torch.add(bn, z)": (torch.add, (normed, z)),
        "bn += z": (operator.iadd, (normed, z)),
        "z += bn": (operator.iadd, (z, normed)),
    }
    target, args = calls[add]
    added = graph.call_function(target, args)
    relus = [graph.call_function(F.relu, (added,)) for _ in range(readers)]
    graph.output(tuple(relus))
    return torch.fx.GraphModule(nn.Module(), graph)


@pytest.mark.parametrize("add", ["bn + z", "z + bn", "torch.add(bn, z)", "bn += z"])
def test_a_residual_add_and_the_relu_after_it_are_fused(add: str) -> None:
    gm = _graph_with_residual_add(add)
    assert fuse_batch_norms(gm) == 1
    (fused,) = (n for n in gm.graph.nodes if n.op == "call_function")
    assert fused.kwargs["residual"].name == "z" and fused.kwargs["clamp"] == (0.0, math.inf)


@pytest.mark.parametrize(
    ("add", "residual_shape", "readers"),
    [("z += bn", (2, 3, 4, 4), 1), ("bn + z", (1, 3, 1, 1), 1), ("bn + z", (2, 3, 4, 4), 2)],
    ids=["updates-the-residual-in-place", "broadcast", "sum-read-twice"],
)
def test_other_adds_after_a_batch_norm_stay(add: str, residual_shape: tuple[int, ...], readers: int) -> None:
    gm = _graph_with_residual_add(add, residual_shape, readers)
    assert fuse_batch_norms(gm) == 1
    fused = [n for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__ == "batch_norm_training"]
    assert fused[0].kwargs["residual"] is None and fused[0].kwargs["clamp"] is None
    assert sum(n.target is F.relu for n in gm.graph.nodes) == readers


def test_a_relu_is_fused_only_where_it_is_the_batch_norms_only_consumer() -> None:
    gm = _graph_with_batch_norm(consumers=2)
    assert fuse_batch_norms(gm) == 1
    fused = [n for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__ == "batch_norm_training"]
    assert len(fused) == 1 and fused[0].kwargs["clamp"] is None
    assert sum(n.target is F.relu for n in gm.graph.nodes) == 2


def test_without_a_compiler_batch_norms_keep_the_standard_onnx_ops(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from torch.utils import cpp_extension

    def no_compiler(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("c++: command not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    cpu_kernels.kernel_library.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"could not be built or did not run right \(c\+\+: command not found\)"):
            assert cpu_kernels.kernel_library() is None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graphs = _exported_ops(tmp_path, ConvNet(), torch.randn(4, 3, 8, 8))
        assert not any(n.domain == DOMAIN for nodes in graphs.values() for n in nodes)
        assert sum(n.op_type == "BatchNormalization" for n in graphs["forward"]) == 6
        uses_them = helper.make_model(
            helper.make_graph([], "g", [], []), opset_imports=[helper.make_opsetid(DOMAIN, 1)]
        )
        with pytest.raises(RuntimeError, match="could not be built here; clear the graph cache"):
            cpu_kernels.register_kernels(ort.SessionOptions(), uses_them)
    finally:
        cpu_kernels.kernel_library.cache_clear()


def test_a_library_onnx_runtime_cannot_load_is_reported_and_not_used(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from torch.utils import cpp_extension

    broken = tmp_path / "broken.so"
    broken.write_bytes(b"not a shared library")
    monkeypatch.setattr(cpp_extension, "load", lambda *args, **kwargs: str(broken))
    cpu_kernels.kernel_library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="could not be built or did not run right"):
            assert cpu_kernels.kernel_library() is None
    finally:
        cpu_kernels.kernel_library.cache_clear()


def test_the_kernels_are_not_built_for_graphs_without_batch_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(aot, "kernel_library", lambda: calls.append(1))
    model = ORTModule(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    model(torch.randn(2, 4)).sum().backward()
    assert calls == []
