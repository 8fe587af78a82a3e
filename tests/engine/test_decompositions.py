"""Decompositions and capture-time substitutions match the PyTorch ops they replace."""

from __future__ import annotations

import copy
import functools
import math
import unittest.mock
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from lightning_ort import DebugOptions, ORTModule
from lightning_ort.engine.capture import aot
from lightning_ort.engine.fx import decompositions
from lightning_ort.engine.fx.decompositions import (
    adaptive_avg_pool2d_backward,
    adaptive_avg_pool3d,
    adaptive_avg_pool3d_backward,
    adaptive_max_pool2d_backward,
    avg_pool2d_backward,
    avg_pool3d_backward,
    batch_norm_backward,
    batch_norm_functional,
    capture_decompositions,
    convolution_backward,
    hardtanh_backward,
    max_pool2d_with_indices_backward,
    max_pool3d_with_indices_backward,
    pow_tensor_scalar,
    reflection_pad2d_backward,
    replication_pad1d_backward,
    replication_pad2d_backward,
    replication_pad3d_backward,
    threshold_backward,
    trilinear,
    weight_norm_interface_backward,
)
from lightning_ort.engine.fx.replacements import attention, dropout, multi_head_attention
from lightning_ort.options import ConvWeightGrad
from tests.helpers import assert_grads_close

aten = torch.ops.aten


@pytest.mark.parametrize(
    ("dims", "kernel", "stride", "padding", "dilation", "groups"),
    [
        (1, 3, 1, 0, 1, 1),
        (1, 3, 2, 1, 1, 2),
        (2, 3, 1, 1, 1, 1),
        (2, 3, 1, 3, 1, 1),
        (2, 3, 1, 2, 2, 2),
        (2, 3, 2, 1, 2, 1),
        (2, 3, 3, 2, 1, 4),
        (2, 3, 1, 1, 1, 8),
        (2, 1, 2, 0, 1, 1),
        (2, 1, 1, 1, 1, 1),
        (3, 3, 2, 1, 1, 2),
        (3, 3, 1, 1, 1, 1),
    ],
)
def test_matches_aten(dims: int, kernel: int, stride: int, padding: int, dilation: int, groups: int) -> None:
    """Covers both input-gradient forms (flipped convolution, transposed convolution) and all im2col forms."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, *([9] * dims), generator=g, dtype=torch.float64)
    w = torch.randn(16, 8 // groups, *([kernel] * dims), generator=g, dtype=torch.float64)
    args = ([stride] * dims, [padding] * dims, [dilation] * dims, False, [0] * dims, groups)
    y = aten.convolution(x, w, None, *args)
    gy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    expected = aten.convolution_backward(gy, x, w, [16], *args, [True, True, True])
    actual = convolution_backward(gy, x, w, [16], *args, [True, True, True])
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("column_bytes", [decompositions.COLUMN_BYTES, 4096])
@pytest.mark.parametrize(("size", "stride"), [(9, 1), (5, 2)])
def test_weight_gradient_in_batch_parts_matches_aten(
    monkeypatch: pytest.MonkeyPatch, column_bytes: int, size: int, stride: int
) -> None:
    """4096 bytes splits the 5 images' columns (8 channels x 9 taps) into parts of 1 or 2 images; 5x5 at stride 2
    has fewer output positions (9) than output channels (16), the folded product."""
    monkeypatch.setattr(decompositions, "COLUMN_BYTES", column_bytes)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, size, size, generator=g, dtype=torch.float64)
    w = torch.randn(16, 8, 3, 3, generator=g, dtype=torch.float64)
    args = ([stride] * 2, [1, 1], [1, 1], False, [0, 0], 1)
    gy = torch.randn(aten.convolution(x, w, None, *args).shape, generator=g, dtype=torch.float64)
    expected = aten.convolution_backward(gy, x, w, None, *args, [False, True, False])[1]
    torch.testing.assert_close(convolution_backward(gy, x, w, None, *args, [False, True, False])[1], expected)


@pytest.mark.parametrize(
    ("size", "kernel", "stride", "padding", "dilation"),
    [
        ((2, 2), 3, 1, 1, 1),
        ((4, 4), 3, 2, 1, 1),
        ((4, 4), 3, 1, 2, 2),
        ((3, 3), 2, 1, 0, 1),
        ((4, 4), 1, 1, 1, 1),
        ((2, 2), 1, 1, 0, 1),  # pointwise: its input gradient stays a flipped (1x1) convolution
        ((1, 1), 3, 1, 1, 1),
        ((16,), 3, 2, 1, 1),
        ((2, 2, 2), 3, 1, 1, 1),
    ],
)
def test_small_images_take_selection_products_and_match_aten(
    size: tuple[int, ...], kernel: int, stride: int, padding: int, dilation: int
) -> None:
    """Images of at most 16 positions are unfolded and folded back by selection-matrix products: both gradients,
    in both weight-gradient orders."""
    assert math.prod(size) <= decompositions.SELECTION_POSITIONS
    g = torch.Generator().manual_seed(0)
    dims = len(size)
    for images, out_channels in ((3, 16), (40, 8)):  # the contraction with and without its result transposed
        x = torch.randn(images, 8, *size, generator=g, dtype=torch.float64)
        w = torch.randn(out_channels, 8, *([kernel] * dims), generator=g, dtype=torch.float64)
        args = ([stride] * dims, [padding] * dims, [dilation] * dims, False, [0] * dims, 1)
        gy = torch.randn(aten.convolution(x, w, None, *args).shape, generator=g, dtype=torch.float64)
        expected = aten.convolution_backward(gy, x, w, [out_channels], *args, [True, True, True])
        actual = convolution_backward(gy, x, w, [out_channels], *args, [True, True, True])
        for a, e in zip(actual, expected, strict=True):
            torch.testing.assert_close(a, e)


def test_selection_products_are_for_cpu_only() -> None:
    # On CUDA a TF32 product would round the values a selection only moves: convolutions stay.
    x, w, gy = torch.empty(2, 8, 2, 2), torch.empty(16, 8, 3, 3), torch.empty(2, 16, 2, 2)
    args = (None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False])
    for device, convolutions in (("cpu", 0), ("meta", 2)):
        tensors = [t.to(device) for t in (gy, x, w)]
        graph = make_fx(lambda *t: convolution_backward(*t, *args))(*tensors).graph
        on_tensors = [n for n in graph.nodes if n.target is aten.convolution.default and n.args[0].op == "placeholder"]
        assert len(on_tensors) == convolutions, device  # (the selection matrices are convolutions of constants)


def test_small_images_take_products_not_convolutions_in_the_exported_graph(tmp_path: Path) -> None:
    torch.manual_seed(0)
    # 4x4 images into a stride-2 layer, 2x2 ones into a stride-1 layer: both gradients of both are products
    eager = torch.nn.Sequential(
        torch.nn.Conv2d(8, 16, 3, stride=2, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(16, 8, 3, padding=1)
    )
    wrapped = ORTModule(copy.deepcopy(eager), DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path))
    x = torch.randn(6, 8, 4, 4)
    wrapped(x).square().sum().backward()
    eager(x).square().sum().backward()
    graph = onnx.load(str(tmp_path / "m_training_backward.onnx")).graph
    assert not [n.name for n in graph.node if n.op_type in ("Conv", "ConvTranspose")], "products only"
    constants = {init.name: onnx.numpy_helper.to_array(init) for init in graph.initializer}
    products = [constants[name] for n in graph.node if "MatMul" in n.op_type for name in n.input if name in constants]
    selections = {s.shape for s in products if s.size > 1 and set(s.ravel().tolist()) == {0.0, 1.0}}
    # unfolding 4x4 -> 2x2 and 2x2 -> 2x2 (positions x taps * outputs), and folding 2x2 back (its transpose)
    assert selections == {(16, 36), (4, 36), (36, 4)}, selections
    # 4 output positions per image: the contractions run image-minor, so every reorder moves the image axis
    # innermost (a 2-D transpose), none moves it in front of the positions
    transposes = [next(a.ints for a in n.attribute if a.name == "perm") for n in graph.node if n.op_type == "Transpose"]
    assert transposes and all(list(perm) == [*range(1, len(perm)), 0] for perm in transposes), transposes
    for theirs, ours in zip(eager.parameters(), wrapped.module.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-4)


def test_large_columns_are_unfolded_in_parts_in_the_exported_graph(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(decompositions, "COLUMN_BYTES", 8 * 16 * 9 * 36 * 4)  # the columns of 8 of the 20 images
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(), torch.nn.Conv2d(16, 8, 3, padding=1))
    debug = DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path)
    wrapped = ORTModule(copy.deepcopy(eager), debug, conv_weight_grad="onnx")
    x = torch.randn(20, 3, 8, 8)
    wrapped(x).square().sum().backward()
    eager(x).square().sum().backward()
    graph = onnx.load(str(tmp_path / "m_training_backward.onnx")).graph
    depthwise = [n for n in graph.node if n.op_type == "Conv" and any(a.name == "group" for a in n.attribute)]
    unfolds = [n for n in depthwise if next(a.i for a in n.attribute if a.name == "group") == 16]
    assert len(unfolds) == 3, [n.name for n in unfolds]  # 7 + 7 + 6 images
    for theirs, ours in zip(eager.parameters(), wrapped.module.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stride", [1, 2])
def test_depthwise_weight_gradient_moves_no_axis(stride: int) -> None:
    # One input channel per group: the input-channel axis is moved by reshapes, which cost nothing, not by
    # permutations, which ONNX Runtime copies.
    x, w = torch.randn(4, 24, 9, 9), torch.randn(24, 1, 3, 3)
    gy = torch.randn(4, 24, (9 - 1) // stride + 1, (9 - 1) // stride + 1)
    mask = [False, True, False]

    def backward(gy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> Any:
        return convolution_backward(gy, x, w, None, [stride] * 2, [1, 1], [1, 1], False, [0, 0], 24, mask)

    ops = {node.target for node in make_fx(backward)(gy, x, w).graph.nodes if node.op == "call_function"}
    assert aten.permute.default not in ops, ops
    expected = aten.convolution_backward(gy, x, w, None, [stride] * 2, [1, 1], [1, 1], False, [0, 0], 24, mask)
    torch.testing.assert_close(backward(gy, x, w)[1], expected[1], rtol=1e-4, atol=1e-5)


def test_respects_output_mask() -> None:
    x, w = torch.randn(2, 4, 6), torch.randn(5, 4, 3)
    gy = torch.randn(2, 5, 4)
    grads = convolution_backward(gy, x, w, None, [1], [0], [1], False, [0], 1, [False, True, False])
    assert grads[0] is None and grads[2] is None and grads[1].shape == w.shape


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "stride", "padding", "dilation", "output_padding", "groups"),
    [
        ((2, 4, 7), (4, 3, 3), [2], [1], [1], [1], 1),
        ((2, 4, 5, 5), (4, 3, 3, 3), [2, 2], [1, 1], [1, 1], [1, 1], 2),
        ((2, 4, 5, 6), (4, 2, 2, 2), [2, 2], [0, 0], [1, 1], [0, 0], 1),
        ((2, 2, 4, 4), (2, 3, 3, 3), [1, 2], [2, 1], [2, 1], [0, 1], 1),
        ((1, 2, 3, 3, 3), (2, 2, 3, 3, 3), [2, 2, 2], [1, 1, 1], [1, 1, 1], [1, 0, 1], 1),
    ],
)
@pytest.mark.parametrize("path", ["onnx", "torch"])
def test_transposed_convolution_gradients_match_aten(
    x_shape: tuple[int, ...],
    w_shape: tuple[int, ...],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    output_padding: list[int],
    groups: int,
    path: ConvWeightGrad,
) -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*x_shape, generator=g), torch.randn(*w_shape, generator=g)
    y = aten.convolution(x, w, None, stride, padding, dilation, True, output_padding, groups)
    gy = torch.randn(y.shape, generator=g)
    args = ([w_shape[1] * groups], stride, padding, dilation, True, output_padding, groups)
    for mask in ([True, True, True], [True, False, False], [False, True, False], [False, False, True]):
        ours = convolution_backward(gy, x, w, *args, mask, weight_grad_path=path)
        expected = aten.convolution_backward(gy, x, w, *args, mask)
        for index, wanted in enumerate(mask):
            if wanted:
                torch.testing.assert_close(ours[index], expected[index], rtol=1e-4, atol=1e-4)
            else:
                assert ours[index] is None


def test_declines_transposed_output_padding_past_the_stride() -> None:
    x, w = torch.randn(2, 2, 5, 5), torch.randn(2, 4, 3, 3)
    y = aten.convolution(x, w, None, [2, 2], [0, 0], [3, 3], True, [2, 2], 1)
    args = ([2, 2], [0, 0], [3, 3], True, [2, 2], 1, [True, True, True])
    assert convolution_backward(torch.randn(y.shape), x, w, None, *args) is NotImplemented


def test_table_covers_ops_without_onnx_translation() -> None:
    for device_type in ("cpu", "cuda"):
        table = capture_decompositions(device_type)
        assert aten.convolution_backward.default in table
        assert aten._native_batch_norm_legit_functional.default in table
    cpu, cuda = capture_decompositions("cpu"), capture_decompositions("cuda")
    assert cpu[aten.threshold_backward.default] is threshold_backward
    assert cuda[aten.threshold_backward.default] is not threshold_backward  # ATen's
    assert cpu[aten._native_batch_norm_legit_functional.default] is batch_norm_functional
    assert cuda[aten._native_batch_norm_legit_functional.default] is not batch_norm_functional
    assert cpu[aten.native_batch_norm_backward.default] is batch_norm_backward
    assert cuda[aten.native_batch_norm_backward.default] is not batch_norm_backward


@pytest.mark.parametrize("shape", [(16, 3), (8, 3, 7), (4, 3, 5, 5), (2, 3, 3, 4, 4)])
@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_training_forward_and_backward_match_aten(shape: tuple[int, ...], affine: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 3 + 2
    w, b = (torch.rand(3, generator=g), torch.randn(3, generator=g)) if affine else (None, None)
    stats = (torch.randn(3, generator=g), torch.rand(3, generator=g))
    ours = batch_norm_functional(x, w, b, *stats, True, 0.1, 1e-5)
    theirs = aten._native_batch_norm_legit_functional(x, w, b, *stats, True, 0.1, 1e-5)
    for a, e in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    grad = torch.randn(shape, generator=g)
    for mask in ([True, True, True], [True, False, False], [False, True, True]):
        args = (grad, x, w, *stats, ours[1], ours[2], True, 1e-5, mask)
        expected = aten.native_batch_norm_backward(*args)
        for wanted, a, e in zip(mask, batch_norm_backward(*args), expected, strict=True):
            assert (a is not None) == wanted
            if wanted:
                torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_batch_norm_outside_float32_training_is_atens() -> None:
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    stats = (torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))
    for training in (True, False):
        ours = batch_norm_functional(x, None, None, *stats, training, 0.1, 1e-5)
        theirs = aten._native_batch_norm_legit_functional(x, None, None, *stats, training, 0.1, 1e-5)
        for a, e in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, e)


def test_batch_norm_trains_through_one_onnx_batch_normalization_per_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(aot, "kernel_library", lambda: None)  # the standard ops, as without a compiler
    torch.manual_seed(0)
    eager = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.LazyLinear(4)
    )
    eager(torch.randn(2, 3, 6, 6))
    debug = DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path)
    wrapped = ORTModule(copy.deepcopy(eager), debug, conv_weight_grad="onnx")  # the whole backward in one graph
    x = torch.randn(16, 3, 6, 6) * 2 + 5
    for model in (eager, wrapped):
        model(x).square().sum().backward()
    forward = [n.op_type for n in onnx.load(str(tmp_path / "m_training_forward.onnx")).graph.node]
    backward = [n.op_type for n in onnx.load(str(tmp_path / "m_training_backward.onnx")).graph.node]
    assert forward.count("BatchNormalization") == 1 and backward.count("BatchNormalization") == 1
    for theirs, ours in zip(eager.parameters(), wrapped.module.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-4)
    for theirs, ours in zip(eager.buffers(), wrapped.module.buffers(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threshold", [0.0, 0.25])
def test_threshold_backward_matches_aten_on_finite_gradients(threshold: float) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 33)
    x[::3] = threshold  # exactly at the threshold: PyTorch gives 0 there
    grad = torch.randn(64, 33)
    torch.testing.assert_close(threshold_backward(grad, x, threshold), aten.threshold_backward(grad, x, threshold))


def test_threshold_backward_differs_from_aten_only_on_non_finite_gradients_it_zeroes() -> None:
    x = torch.tensor([-1.0, -1.0, 1.0, 1.0])
    grad = torch.tensor([float("inf"), float("nan"), float("inf"), float("nan")])
    assert aten.threshold_backward(grad, x, 0.0)[:2].tolist() == [0.0, 0.0]
    assert threshold_backward(grad, x, 0.0).isnan()[:2].all()
    ours, theirs = threshold_backward(grad, x, 0.0)[2:], aten.threshold_backward(grad, x, 0.0)[2:]
    torch.testing.assert_close(ours, theirs, equal_nan=True)


@pytest.mark.parametrize(("low", "high"), [(0.0, 6.0), (-1.0, 1.0), (-0.5, 0.25)])
def test_hardtanh_backward_matches_aten_at_the_bounds_and_on_nan_inputs(low: float, high: float) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 32) * 4
    x[::3], x[1::3, :5], x[2::3, :8] = low, high, float("nan")  # exactly at a bound: PyTorch gives 0 there
    grad = torch.randn(64, 32)
    torch.testing.assert_close(hardtanh_backward(grad, x, low, high), aten.hardtanh_backward(grad, x, low, high))
    assert not hardtanh_backward(grad, x, low, high)[2::3, :8].any(), "a NaN input gives 0, as PyTorch's kernel"


def test_hardtanh_backward_differs_from_aten_only_on_non_finite_gradients_it_zeroes() -> None:
    x = torch.tensor([-1.0, 7.0, 1.0, 1.0])
    grad = torch.tensor([float("inf"), float("nan"), float("inf"), float("nan")])
    assert aten.hardtanh_backward(grad, x, 0.0, 6.0)[:2].tolist() == [0.0, 0.0]
    assert hardtanh_backward(grad, x, 0.0, 6.0).isnan()[:2].all()
    ours, theirs = hardtanh_backward(grad, x, 0.0, 6.0)[2:], aten.hardtanh_backward(grad, x, 0.0, 6.0)[2:]
    torch.testing.assert_close(ours, theirs, equal_nan=True)


@pytest.mark.parametrize(
    ("activation", "scale"),
    [(torch.nn.ReLU, 1.0), (torch.nn.ReLU6, 8.0)],  # ReLU6's inputs below 0, inside and above 6
    ids=["relu", "relu6"],
)
def test_masked_gradients_on_cpu_are_products_not_wheres(
    activation: type[torch.nn.Module], scale: float, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(16, 32), activation(), torch.nn.Linear(32, 4))
    wrapped = ORTModule(copy.deepcopy(eager), DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path))
    x = torch.randn(8, 16) * scale
    wrapped(x).square().sum().backward()
    eager(x).square().sum().backward()
    ops = [node.op_type for node in onnx.load(str(tmp_path / "m_training_backward.onnx")).graph.node]
    assert "Where" not in ops and "Mul" in ops, ops
    for theirs, ours in zip(eager.parameters(), wrapped.module.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("shape", "kernel", "stride", "padding", "dilation", "ceil_mode"),
    [
        ((2, 3, 9, 9), [3, 3], [2, 2], [1, 1], [1, 1], True),
        ((2, 3, 8, 8), [2, 2], [2, 2], [0, 0], [1, 1], False),
        ((1, 2, 11, 7), [3, 2], [1, 2], [1, 0], [2, 1], False),
        ((3, 10, 10), [3, 3], [2, 2], [0, 0], [1, 1], True),
    ],
)
def test_max_pool_backward_matches_aten_with_ties_and_overlapping_windows(
    shape: tuple[int, ...],
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    ceil_mode: bool,
) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).clamp(min=0)  # ReLU's zeros: many windows tie
    y, indices = aten.max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil_mode)
    grad = torch.randn(y.shape, generator=g)
    args = (grad, x, kernel, stride, padding, dilation, ceil_mode, indices)
    torch.testing.assert_close(max_pool2d_with_indices_backward(*args), aten.max_pool2d_with_indices_backward(*args))


def test_max_pool_backward_accumulates_half_precision_in_float32() -> None:
    x = torch.randn(1, 2, 6, 6, dtype=torch.bfloat16)
    y, indices = aten.max_pool2d_with_indices(x, [3, 3], [1, 1], [1, 1], [1, 1], False)
    backward = functools.partial(
        max_pool2d_with_indices_backward, kernel_size=[3, 3], stride=[1, 1], padding=[1, 1], dilation=[1, 1]
    )
    graph = make_fx(lambda g, i: backward(g, x, ceil_mode=False, indices=i))(torch.randn_like(y), indices)
    (scatter,) = [n for n in graph.graph.nodes if n.target == aten.scatter_add.default]
    assert scatter.meta["val"].dtype == torch.float32
    assert graph(torch.randn_like(y), indices).dtype == torch.bfloat16


def test_max_pooling_trains_in_onnx_runtime_with_eager_gradients(tmp_path: Path) -> None:
    torch.manual_seed(0)
    eager = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(3, 2, ceil_mode=True),
        torch.nn.Conv2d(8, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.LazyLinear(4),
    )
    eager(torch.randn(2, 3, 16, 16))
    debug = DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path)
    wrapped = ORTModule(copy.deepcopy(eager), debug, conv_weight_grad="onnx")  # the whole backward in one graph
    x = torch.randn(4, 3, 16, 16)
    for model in (eager, wrapped):
        model(x).square().sum().backward()
    assert wrapped.statistics.fallback_ops == 0 and wrapped.statistics.backward_runs == 1
    backward = [n.op_type for n in onnx.load(str(tmp_path / "m_training_backward.onnx")).graph.node]
    # The ceil-mode pooling's gradient scatters at the forward's indices; the other is lightning_ort's kernel.
    assert backward.count("ScatterElements") == 1 and backward.count("MaxPoolGrad") == 1, backward
    for theirs, ours in zip(eager.parameters(), wrapped.module.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "masks", ["none", "padding", "bool_mask", "float_mask_and_padding", "causal", "causal_padding"]
)
def test_batch_first_self_attention_matches_multihead_attention(masks: str) -> None:
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(3, 6, 16, requires_grad=True)
    padding = torch.arange(6).expand(3, 6) >= torch.tensor([[6], [4], [2]])
    causal = torch.nn.Transformer.generate_square_subsequent_mask(6)
    kwargs: dict[str, object] = {
        "none": {},
        "padding": {"key_padding_mask": padding},
        "bool_mask": {"attn_mask": torch.rand(6, 6) > 0.7},
        "float_mask_and_padding": {"attn_mask": torch.randn(6, 6), "key_padding_mask": padding},
        "causal": {"attn_mask": causal, "is_causal": True},
        "causal_padding": {"attn_mask": causal, "is_causal": True, "key_padding_mask": padding},
    }[masks]
    expected, _ = mha(x, x, x, need_weights=False, **kwargs)
    with unittest.mock.patch.object(torch.nn.functional, "multi_head_attention_forward", multi_head_attention):
        actual, weights = mha(x, x, x, need_weights=False, **kwargs)
    assert weights is None
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    (grads_expected,) = torch.autograd.grad(expected.square().sum(), x)
    (grads_actual,) = torch.autograd.grad(actual.square().sum(), x)
    torch.testing.assert_close(grads_actual, grads_expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask", ["none", "causal", "bool", "bool_with_an_empty_row", "float"])
def test_attention_matches_sdpa_and_its_backward_selects_no_scores(mask: str) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g, requires_grad=True) for _ in range(3))
    keep = torch.rand(2, 1, 5, 5, generator=g) > 0.4
    keep[..., 0] = True
    if mask == "bool_with_an_empty_row":
        keep[0, 0, 2] = False  # the math path's safe softmax gives zeros there, not NaNs
    kwargs = {
        "none": {},
        "causal": {"is_causal": True},
        "bool": {"attn_mask": keep},
        "bool_with_an_empty_row": {"attn_mask": keep},
        "float": {"attn_mask": torch.randn(2, 1, 5, 5, generator=g)},
    }[mask]
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    actual = attention(q, k, v, **kwargs)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    upstream = torch.randn(expected.shape, generator=g)
    grads_expected = torch.autograd.grad(expected, (q, k, v), upstream)
    grads_actual = torch.autograd.grad(actual, (q, k, v), upstream)
    for ours, theirs in zip(grads_actual, grads_expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, upstream: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(attention(q, k, v, **kwargs), (q, k, v), upstream)

    graph = make_fx(step)(q, k, v, upstream).graph
    scores = [2, 3, 5, 5]
    selects = [
        node
        for node in graph.nodes
        if node.target in (aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor)
        and list(node.meta["val"].shape) == scores
    ]
    assert not selects, "a mask is a bias added to the scores, not a selection of them or of their gradient"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("exponent", [1, 1.0, 0.5, -0.5, -1])
def test_cheap_powers_are_atens_bit_for_bit(exponent: float, dtype: torch.dtype) -> None:
    special = [-2.0, -0.0, 0.0, 1e-30, 3.0, math.inf, -math.inf, math.nan]
    x = torch.cat([torch.tensor(special), torch.randn(64, generator=torch.Generator().manual_seed(0))]).to(dtype)
    ours, theirs = pow_tensor_scalar(x, exponent), x**exponent
    assert ours.dtype == theirs.dtype
    assert torch.equal(ours.isnan(), theirs.isnan()) and torch.equal(ours.signbit(), theirs.signbit())
    assert torch.equal(ours.nan_to_num(7.0), theirs.nan_to_num(7.0))


def test_other_powers_and_integer_tensors_stay_pow() -> None:
    assert pow_tensor_scalar(torch.rand(3), 2.5) is NotImplemented
    assert pow_tensor_scalar(torch.rand(3), 2) is NotImplemented
    assert pow_tensor_scalar(torch.arange(3), 1) is NotImplemented


class _Doubled(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x * 2)


@pytest.mark.parametrize("inplace", [False, True])
def test_dropout_trains_like_eager_dropout_through_onnx_runtime(inplace: bool) -> None:
    # The mask is random, so eager's reference is rebuilt from the kept elements: y = 2x * keep / (1 - p) and
    # dx = 2dy * keep / (1 - p), with about 1 - p of the elements kept.
    p = 0.3
    wrapped = ORTModule(_Doubled(torch.nn.Dropout(p, inplace=inplace)))
    x = torch.randn(64, 256, requires_grad=True)
    grad = torch.randn(64, 256)
    y = wrapped(x)
    y.backward(grad)
    keep = (y != 0).float()
    assert 0.65 < float(keep.mean()) < 0.75
    torch.testing.assert_close(y, 2 * x.detach() * keep / (1 - p))
    torch.testing.assert_close(x.grad, 2 * grad * keep / (1 - p))
    graphs = {kind: runner._graph.model.graph for kind, runner in wrapped._backend.runners()}
    ops = {kind: [node.op_type for node in graph.node] for kind, graph in graphs.items()}
    assert ops["forward"].count("Mul") == ops["backward"].count("Mul") == 2, ops
    assert ops["forward"].count("DequantizeLinear") == ops["backward"].count("DequantizeLinear") == 1, ops
    saved = [value.type.tensor_type.elem_type for value in graphs["backward"].input]
    assert saved.count(onnx.TensorProto.UINT8) == 1, "the mask is saved for the backward as one byte per element"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inplace", [False, True])
def test_16_bit_dropout_scales_in_float32_like_eager(dtype: torch.dtype, inplace: bool) -> None:
    x = torch.randn(4096).to(dtype)
    y = dropout(x.clone(), 0.1, inplace=inplace)
    assert y.dtype == dtype
    kept = y != 0
    torch.testing.assert_close(y[kept], (x[kept].float() / 0.9).to(dtype), rtol=0, atol=0)


def test_dropout_outside_training_or_at_the_ends_is_pytorchs() -> None:
    x = torch.randn(8, 8)
    assert dropout(x, 0.5, training=False) is x
    assert torch.equal(dropout(x, 0.0), x)
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))


def test_rrelu_trains_in_onnx_runtime_with_atens_slopes_and_gradient() -> None:
    # ATen's slopes are random, so its reference is rebuilt from them: y = x where x > 0, else x * slope with
    # slope in [lower, upper); dx = dy there, else dy * slope. One seed gives one draw.
    lower, upper = 0.1, 0.3
    wrapped = ORTModule(_Doubled(torch.nn.RReLU(lower, upper)))
    x = torch.randn(64, 256, requires_grad=True)
    grad = torch.randn(64, 256)
    torch.manual_seed(7)
    y = wrapped(x)
    y.backward(grad)
    y = y.detach()
    assert wrapped.statistics.fallback_ops == 0 and wrapped.statistics.backward_runs == 1
    doubled = 2 * x.detach()
    positive = doubled > 0
    torch.testing.assert_close(y[positive], doubled[positive], rtol=0, atol=0)
    slope = y[~positive] / doubled[~positive]
    assert float(slope.min()) >= lower - 1e-6 and float(slope.max()) < upper + 1e-6
    assert abs(float(slope.mean()) - (lower + upper) / 2) < 0.01, "uniform slopes"
    torch.testing.assert_close(x.grad[positive], 2 * grad[positive])
    torch.testing.assert_close(x.grad[~positive], 2 * grad[~positive] * slope)
    torch.manual_seed(7)
    torch.testing.assert_close(wrapped(x), y, rtol=0, atol=0, msg="the slopes follow torch.manual_seed")
    graphs = [runner._graph.model.graph for _, runner in wrapped._backend.runners()]
    ops = {node.op_type for graph in graphs for node in graph.node}
    assert len(graphs) == 2 and not any(op.startswith("Random") for op in ops), ops


def test_rrelu_outside_training_is_atens_leaky_relu_in_onnx_runtime() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.RReLU(0.1, 0.3)).eval()
    wrapped = ORTModule(copy.deepcopy(module)).eval()
    x = torch.randn(16, 8)
    torch.testing.assert_close(wrapped(x), module(x))
    assert wrapped.statistics.fallback_ops == 0


@pytest.mark.parametrize("size", [(7, 6), (8, 11), (9, 9)])
@pytest.mark.parametrize(("kernel", "stride", "padding"), [(2, 2, 0), (3, 2, 1), (3, 1, 1), (2, 3, 1)])
@pytest.mark.parametrize("ceil_mode", [False, True])
@pytest.mark.parametrize("count_include_pad", [False, True])
def test_average_pooling_gradient_matches_aten_for_every_window_rule(
    size: tuple[int, int], kernel: int, stride: int, padding: int, ceil_mode: bool, count_include_pad: bool
) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, *size, generator=g)
    args = ([kernel, kernel], [stride, stride], [padding, padding], ceil_mode, count_include_pad, None)
    grad = torch.randn(aten.avg_pool2d(x, *args).shape, generator=g)
    torch.testing.assert_close(avg_pool2d_backward(grad, x, *args), aten.avg_pool2d_backward(grad, x, *args))


@pytest.mark.parametrize(("size", "pooled"), [((8, 8), (2, 2)), ((8, 11), (3, 4)), ((5, 7), (7, 5)), ((6, 6), (1, 1))])
def test_adaptive_pooling_gradients_match_aten(size: tuple[int, int], pooled: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, *size, generator=g)
    grad = torch.randn(2, 3, *pooled, generator=g)
    expected = aten._adaptive_avg_pool2d_backward(grad, x)
    torch.testing.assert_close(adaptive_avg_pool2d_backward(grad, x), expected)
    _, indices = aten.adaptive_max_pool2d(x, list(pooled))
    expected = aten.adaptive_max_pool2d_backward(grad, x, indices)
    torch.testing.assert_close(adaptive_max_pool2d_backward(grad, x, indices), expected)


@pytest.mark.parametrize(("size", "pooled"), [((5, 8, 7), (2, 3, 4)), ((4, 6, 6), (1, 7, 7)), ((3, 4, 4), (3, 2, 2))])
def test_3d_adaptive_average_pooling_and_its_gradient_match_aten(
    size: tuple[int, int, int], pooled: tuple[int, int, int]
) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, *size, generator=g)
    torch.testing.assert_close(adaptive_avg_pool3d(x, list(pooled)), aten._adaptive_avg_pool3d(x, list(pooled)))
    grad = torch.randn(2, 3, *pooled, generator=g)
    torch.testing.assert_close(adaptive_avg_pool3d_backward(grad, x), aten._adaptive_avg_pool3d_backward(grad, x))


@pytest.mark.parametrize("padding", [[1, 1, 1, 1], [2, 0, 3, 1], [0, 3, 0, 2]])
def test_replication_and_reflection_padding_gradients_match_aten(padding: list[int]) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 4, generator=g)
    grad = torch.randn(2, 3, 5 + padding[2] + padding[3], 4 + padding[0] + padding[1], generator=g)
    torch.testing.assert_close(
        replication_pad2d_backward(grad, x, padding), aten.replication_pad2d_backward(grad, x, padding)
    )
    torch.testing.assert_close(
        reflection_pad2d_backward(grad, x, padding), aten.reflection_pad2d_backward(grad, x, padding)
    )


@pytest.mark.parametrize("padding", [[1, 1, 1, 1, 1, 1], [2, 0, 0, 3, 1, 2], [0, 1]])
def test_1d_and_3d_replication_padding_gradients_match_aten(padding: list[int]) -> None:
    g = torch.Generator().manual_seed(0)
    sizes = (4, 5, 3)[-len(padding) // 2 :]
    x = torch.randn(2, 3, *sizes, generator=g)
    padded = [
        size + padding[2 * (len(sizes) - 1 - i)] + padding[2 * (len(sizes) - 1 - i) + 1] for i, size in enumerate(sizes)
    ]
    grad = torch.randn(2, 3, *padded, generator=g)
    ours, theirs = (replication_pad1d_backward, aten.replication_pad1d_backward)
    if len(sizes) == 3:
        ours, theirs = (replication_pad3d_backward, aten.replication_pad3d_backward)
    torch.testing.assert_close(ours(grad, x, padding), theirs(grad, x, padding))


def test_replicate_padded_convolutions_train_in_onnx_runtime_alone() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv3d(2, 4, 3, padding=1, padding_mode="replicate"),
        torch.nn.ReLU(),
        torch.nn.Flatten(1, 2),
        torch.nn.Conv2d(4 * 4, 3, 3, padding=2, padding_mode="replicate"),
    )
    wrapped = ORTModule(copy.deepcopy(model), fallback="raise")
    x = torch.randn(2, 2, 4, 6, 5)
    wrapped(x).square().mean().backward()
    model(x).square().mean().backward()
    assert_grads_close(wrapped, model, rtol=1e-4, atol=1e-6)
    assert wrapped.statistics.backward_runs == 1 and wrapped.statistics.fallback_ops == 0


@pytest.mark.parametrize(
    ("kernel", "stride", "padding"), [([2, 2, 2], [2, 2, 2], [0, 0, 0]), ([3, 1, 3], [2, 1, 2], [1, 0, 1])]
)
@pytest.mark.parametrize("ceil_mode", [False, True])
@pytest.mark.parametrize("count_include_pad", [False, True])
def test_3d_pooling_gradients_match_aten(
    kernel: list[int], stride: list[int], padding: list[int], ceil_mode: bool, count_include_pad: bool
) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 6, 7, generator=g)
    args = (kernel, stride, padding, ceil_mode, count_include_pad, None)
    grad = torch.randn(aten.avg_pool3d(x, *args).shape, generator=g)
    torch.testing.assert_close(avg_pool3d_backward(grad, x, *args), aten.avg_pool3d_backward(grad, x, *args))
    window = (kernel, stride, padding, [1, 1, 1], ceil_mode)
    pooled, indices = aten.max_pool3d_with_indices(x, *window)
    grad = torch.randn(pooled.shape, generator=g)
    expected = aten.max_pool3d_with_indices_backward(grad, x, *window, indices)
    torch.testing.assert_close(max_pool3d_with_indices_backward(grad, x, *window, indices), expected)


@pytest.mark.parametrize(("shape", "dim"), [((6, 4, 3), 0), ((6, 4, 3), 2), ((5, 7), 1)])
def test_weight_norm_gradients_match_aten(shape: tuple[int, ...], dim: int) -> None:
    torch.manual_seed(0)
    v = torch.randn(shape, dtype=torch.float64)
    g = torch.randn([size if axis == dim % len(shape) else 1 for axis, size in enumerate(shape)], dtype=torch.float64)
    w, norms = aten._weight_norm_interface(v, g, dim)
    grad = torch.randn_like(w)
    ours = weight_norm_interface_backward(grad, v, g, norms, dim)
    theirs = aten._weight_norm_interface_backward(grad, v, g, norms, dim)
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_weight_norm_gradients_of_bfloat16_weights_are_computed_in_float32() -> None:
    torch.manual_seed(0)
    v, g = torch.randn(4, 512, dtype=torch.bfloat16), torch.randn(4, 1, dtype=torch.bfloat16)
    _, norms = aten._weight_norm_interface(v, g, 0)
    grad = torch.randn(4, 512, dtype=torch.bfloat16)
    grad_v, grad_g = weight_norm_interface_backward(grad, v, g, norms, 0)
    exact = weight_norm_interface_backward(grad.double(), v.double(), g.double(), norms.double(), 0)
    assert grad_v.dtype == grad_g.dtype == torch.bfloat16
    torch.testing.assert_close(grad_g, exact[1].to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("shapes", "expands", "sumdim"),
    [
        # nn.Bilinear's forward and the three calls of its gradient
        (((4, 5), (3, 5, 6), (4, 6)), ([1, 3], [0], [1, 2]), [2, 3]),
        (((4, 3), (3, 5, 6), (4, 6)), ([2, 3], [0], [1, 2]), [1, 3]),
        (((4, 5), (4, 3), (4, 6)), ([1, 3], [2, 3], [1, 2]), [0]),
        (((4, 5), (3, 5, 6), (4, 3)), ([1, 3], [0], [2, 3]), [1, 2]),
    ],
)
def test_trilinear_matches_aten(
    shapes: tuple[tuple[int, ...], ...], expands: tuple[list[int], ...], sumdim: list[int]
) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in shapes]
    ours = trilinear(*tensors, *expands, sumdim)
    theirs = aten._trilinear(*tensors, *expands, sumdim)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_trilinear_output_axis_no_input_has_stays_atens() -> None:
    x = torch.randn(4)
    assert trilinear(x, x, x, [1], [1], [1], []) is NotImplemented


def test_bilinear_layer_trains_in_onnx_runtime_alone() -> None:
    torch.manual_seed(0)
    model = torch.nn.Bilinear(5, 6, 3)
    wrapped = ORTModule(copy.deepcopy(model), fallback="raise")
    x1, x2 = torch.randn(4, 5), torch.randn(4, 6)
    torch.testing.assert_close(wrapped(x1, x2), model(x1, x2))
    wrapped(x1, x2).square().mean().backward()
    model(x1, x2).square().mean().backward()
    assert_grads_close(wrapped, model, rtol=1e-5, atol=1e-6)
    assert wrapped.statistics.backward_runs == 1 and wrapped.statistics.fallback_ops == 0
