"""ATen decompositions applied while capturing, so every op in the graphs has an ONNX translation.

Core ATen decompositions, plus:

* on CPU, training-mode batch norm as reductions for the batch statistics and ONNX ``BatchNormalization`` (inference
  form, given those statistics) for the normalisation, and its backward with that same per-channel affine node
  (ONNX Runtime's training-mode ``BatchNormalization`` is no faster on CPU, and does not give the centred
  input that the backward reuses);
* ``aten.convolution_backward`` (no ONNX translation) as a convolution with the flipped kernel (stride 1) or a
  transposed convolution for the input gradient (a transposed convolution's: the convolution it is the adjoint
  of), an im2col matrix product for the weight gradient and a sum for the bias gradient; on small CPU images,
  products with a 0/1 selection matrix unfold the input and fold the input gradient back; where
  ``conv_weight_grad`` chooses PyTorch's kernel for a layer's weight gradient (:func:`weight_grad_in_torch`),
  that gradient stays one ``convolution_backward`` op, or on CPU with lightning_ort's kernels, for 3x3 layers
  with stride 1 or 2 on large images, the kernel's
  (:data:`~lightning_ort.engine.fx.conv_weight_grad.CONV3X3_WEIGHT_GRAD`);
* ``nn.EmbeddingBag`` (sum/mean) forward and backward as gathers and ``index_add``: the exporter's translation
  of ``_embedding_bag`` does not reproduce the auxiliary outputs its backward needs, and the backward op has
  no translation at all;
* on CPU, ReLU's and ReLU6's gradients (``aten.threshold_backward``, ``aten.hardtanh_backward``) as products
  with a 0/1 mask, not a ``Where``;
* ``avg_pool2d_backward`` (no ONNX translation) as a depthwise transposed convolution where every window has the
  same divisor;
* ``max_pool2d_with_indices_backward`` (no ONNX translation) as a ``scatter_add`` of the output gradient at the
  forward's indices (ONNX ``ScatterElements`` with ``reduction="add"``), so ties and overlapping windows accumulate
  as in ATen;
* ``grid_sampler_2d_backward`` (no ONNX translation; bilinear and nearest) as gathers and a ``scatter_add``
  (:mod:`lightning_ort.engine.fx.grid_sample`);
* ``_weight_norm_interface_backward`` (weight normalisation's gradients) in ATen's analytic form;
* ``_trilinear`` (``nn.Bilinear``) as an ``einsum``;
* ``torch.cdist``'s direct path (``_cdist_forward``, ``_cdist_backward``) as pairwise differences
  (:mod:`lightning_ort.engine.fx.distance`);
* ``addmm`` over an empty inner dimension as ``beta * input`` (ONNX Runtime's ``Gemm`` drops ``beta`` there);
* ``pow`` with the exponents 1, 0.5, -0.5 and -1 as the op ATen's kernel computes them with (ONNX Runtime's CPU
  ``Pow`` calls ``std::pow`` per element; the gradient of ``x ** 2`` is ``2 * x ** 1``);
* ``erfc``, ``special_erfcx`` and ``special_log_ndtr`` in forms that keep their relative precision in the tails
  (the ONNX translations compute ``1 - Erf(x)``, which cancels to 0, and overflow ``exp(x**2)``).

Replacements of ``torch.nn.functional`` calls (attention, dropout) are in
:mod:`lightning_ort.engine.fx.replacements`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from lightning_ort.engine.fx.conv_phases import phase_input_grad
from lightning_ort.engine.fx.conv_weight_grad import CONV3X3_WEIGHT_GRAD, weight_grad_kernel_applies
from lightning_ort.engine.fx.distance import cdist_backward, cdist_forward
from lightning_ort.engine.fx.gelu import gelu_backward
from lightning_ort.engine.fx.grid_sample import grid_sampler_2d_backward
from lightning_ort.engine.fx.group_norm import group_norm, group_norm_backward
from lightning_ort.engine.fx.layer_norm import float64_layer_norm, layer_norm_backward
from lightning_ort.engine.fx.precision import computed_in_float32
from lightning_ort.engine.fx.scatter import index_put
from lightning_ort.engine.fx.silu import silu_backward
from lightning_ort.engine.torch_internals import FUSED_ATTENTION_FORWARD, core_aten_decompositions, get_decompositions
from lightning_ort.options import AttentionPath, ConvWeightGrad

aten = torch.ops.aten


def convolution_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias_sizes: Sequence[int] | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
    output_mask: Sequence[bool],
    weight_grad_path: ConvWeightGrad = "onnx",
    kernels: bool = False,
    weight_kernel: bool = False,
) -> Any:
    """Gradients of an N-d convolution expressed with forward convolutions.

    A transposed convolution's gradients come from the convolution it is the adjoint of
    (:func:`_transposed_convolution_backward`). With ``kernels`` (lightning_ort's CPU kernels are built), the
    input gradient of a stride-2 layer is four stride-1 convolutions woven together by one of them
    (:func:`~lightning_ort.engine.fx.conv_phases.phase_input_grad`) where that applies.

    Where ``weight_grad_path`` leaves a layer's weight gradient to PyTorch's kernel (:func:`weight_grad_in_torch`),
    that gradient is ``aten.convolution_backward`` asking for it alone, which this decomposition then leaves
    whole (``NotImplemented``), to run in PyTorch after the graph that computes ``grad_output``; with
    ``weight_kernel`` (the kernels are built and ONNX Runtime's NCHWc block is the one the 3x3 weight-gradient
    kernel reads), a 3x3 layer with stride 1 or 2 on a large image takes that kernel inside the graph instead
    (:func:`~lightning_ort.engine.fx.conv_weight_grad.weight_grad_kernel_applies`).

    Example:
        >>> x, w = torch.randn(2, 4, 7), torch.randn(6, 2, 3)
        >>> gy = torch.randn(2, 6, 4)
        >>> ours = convolution_backward(gy, x, w, [6], [2], [1], [1], False, [0], 2, [True, True, True])
        >>> ref = aten.convolution_backward(gy, x, w, [6], [2], [1], [1], False, [0], 2, [True, True, True])
        >>> all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ours, ref))
        True
    """
    if transposed:
        return _transposed_convolution_backward(
            grad_output, input, weight, stride, padding, dilation, output_padding, groups, output_mask, weight_grad_path
        )
    torch_weight = output_mask[1] and weight_grad_in_torch(input, weight, padding, groups, weight_grad_path)
    kernel_weight = (
        torch_weight
        and weight_kernel
        and weight_grad_path == "auto"
        and weight_grad_kernel_applies(input, weight, stride, padding, dilation, groups)
    )
    if torch_weight and not kernel_weight and not output_mask[0] and not output_mask[2]:
        return NotImplemented
    spatial = len(stride)
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        grad_input = _input_grad(grad_output, input, weight, stride, padding, dilation, groups, kernels)
    if kernel_weight:
        grad_weight = CONV3X3_WEIGHT_GRAD(input, grad_output, stride[0])
    elif torch_weight:
        only_weight = [False, True, False]
        grad_weight = aten.convolution_backward(
            grad_output, input, weight, None, stride, padding, dilation, False, output_padding, groups, only_weight
        )[1]
    elif output_mask[1]:
        grad_weight = _weight_grad(grad_output, input, weight, stride, padding, dilation, groups)
    if output_mask[2]:
        grad_bias = grad_output.sum(dim=[0, *range(2, 2 + spatial)])
    return grad_input, grad_weight, grad_bias


def _transposed_convolution_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    output_padding: Sequence[int],
    groups: int,
    output_mask: Sequence[bool],
    weight_grad_path: ConvWeightGrad,
) -> Any:
    """Gradients of a transposed convolution (``nn.ConvTranspose2d``: U-Net decoders, GAN generators).

    A transposed convolution with weight ``W`` is the adjoint of the convolution with ``W`` at the same stride,
    padding, dilation and groups. Its input gradient is therefore that convolution of the output gradient, and its
    weight gradient is that convolution's weight gradient with the roles swapped: the output gradient as the
    convolution's input, the transposed convolution's input as its output gradient (left to PyTorch's kernel
    where ``weight_grad_path`` chooses it, as for any convolution). That holds where ``output_padding`` is below
    the stride, so that the convolution of the output gradient has exactly the input's size; other layers keep
    ``aten.convolution_backward`` (``NotImplemented``), which runs in PyTorch.

    Example:
        >>> x, w = torch.randn(2, 4, 5, 5), torch.randn(4, 3, 3, 3)
        >>> gy = torch.randn(2, 6, 10, 10)
        >>> args = ([6], [2, 2], [1, 1], [1, 1], True, [1, 1], 2, [True, True, True])
        >>> ours = convolution_backward(gy, x, w, *args)
        >>> ref = aten.convolution_backward(gy, x, w, *args)
        >>> all(torch.allclose(a, b, atol=1e-4) for a, b in zip(ours, ref))
        True
    """
    if any(extra >= step for extra, step in zip(output_padding, stride, strict=True)):
        return NotImplemented
    spatial = len(stride)
    no_padding = [0] * spatial
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        grad_input = aten.convolution(grad_output, weight, None, stride, padding, dilation, False, no_padding, groups)
    if output_mask[1]:
        adjoint = (input, grad_output, weight, None, stride, padding, dilation, False, no_padding, groups)
        only_weight = [False, True, False]
        grads = convolution_backward(*adjoint, only_weight, weight_grad_path)
        grad_weight = (aten.convolution_backward(*adjoint, only_weight) if grads is NotImplemented else grads)[1]
    if output_mask[2]:
        grad_bias = grad_output.sum(dim=[0, *range(2, 2 + spatial)])
    return grad_input, grad_weight, grad_bias


def weight_grad_in_torch(
    input: torch.Tensor, weight: torch.Tensor, padding: Sequence[int], groups: int, path: ConvWeightGrad
) -> bool:
    """Whether a convolution's weight gradient is left to PyTorch's kernel rather than built in the graph.

    ``"torch"`` and ``"onnx"`` decide for every layer. ``"auto"`` chooses PyTorch's kernel (oneDNN) for dense CPU
    convolutions whose graph form would unfold the input with the one-hot convolution (:func:`_unfold`): a
    kernel larger than 1x1, or a padded one, on images of more than :data:`SELECTION_POSITIONS` positions,
    where writing the columns costs as much as their product and oneDNN's kernel is about twice as fast. The
    selection products of smaller images, 1x1 kernels (a strided slice and one product) and depthwise kernels
    (NCHWc convolutions) are level with oneDNN's or ahead, and stay in the graph. On CUDA every dense
    convolution takes cuDNN's kernel: the step is as fast, and the graph saves no unfolded columns (measured on
    the cnn workload; depthwise layers there are not measured and stay in the graph).

    Example:
        >>> w = torch.randn(8, 4, 3, 3)
        >>> weight_grad_in_torch(torch.randn(2, 4, 16, 16), w, [1, 1], 1, "auto")
        True
        >>> weight_grad_in_torch(torch.randn(2, 4, 4, 4), w, [1, 1], 1, "auto")
        False
    """
    if path != "auto":
        return path == "torch"
    if groups != 1:
        return False
    if input.device.type == "cuda":
        return True
    return input.device.type == "cpu" and _unfold_form(input, weight.shape[2:], padding) == "one_hot"


def _input_grad(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    phases: bool = False,
) -> torch.Tensor:
    """Input gradient: a convolution with the flipped, transposed kernel where the stride is 1, else a transposed one
    (or, with ``phases``, four stride-1 convolutions where :func:`~lightning_ort.engine.fx.conv_phases.phase_input_grad`
    applies).

    ONNX Runtime's CPU ``Conv`` is faster than its ``ConvTranspose`` on 3x3 layers; the two are equal for
    stride 1 when the transposed padding ``dilation * (kernel - 1) - padding`` is not negative. On CPU, dense
    strided layers whose images have at most :data:`SELECTION_POSITIONS` positions take
    :func:`_folded_input_grad`, and so do stride-1 layers on images of at most :data:`FOLDED_STRIDE_ONE_POSITIONS`
    (larger ones run the flipped convolution faster on the NCHWc kernels), but for pointwise (1x1, unpadded)
    ones, whose flipped convolution is already one product per position.
    """
    kernel = weight.shape[2:]
    spatial = len(kernel)
    strided = any(s > 1 for s in stride)
    pointwise = math.prod(kernel) == 1 and not strided and not any(padding)
    if groups == 1 and not pointwise and _selects(input) and folds_input_gradient(input.shape[2:], strided):
        return _folded_input_grad(grad_output, input, weight, stride, padding, dilation)
    full_padding = [d * (k - 1) - p for k, d, p in zip(kernel, dilation, padding)]
    if all(s == 1 for s in stride) and all(p >= 0 for p in full_padding):
        out_channels, in_per_group = weight.shape[0], weight.shape[1]
        flipped = weight.reshape(groups, out_channels // groups, in_per_group, *kernel).transpose(1, 2)
        flipped = _reversed_taps(flipped.reshape(groups * in_per_group, out_channels // groups, *kernel))
        no_adjust = [0] * spatial
        return aten.convolution(grad_output, flipped, None, stride, full_padding, dilation, False, no_adjust, groups)
    woven = phase_input_grad(grad_output, input, weight, stride, padding, dilation, groups) if phases else None
    if woven is not None:
        return woven
    out_size = grad_output.shape[2:]
    adjust = [
        input.shape[2 + i] - ((out_size[i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (kernel[i] - 1) + 1)
        for i in range(spatial)
    ]
    return aten.convolution(grad_output, weight, None, stride, padding, dilation, True, adjust, groups)


def _folded_input_grad(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> torch.Tensor:
    """Input gradient of a dense convolution on small images: the columns ``weight^T @ grad_output`` in one
    product over all images, folded back onto the image (col2im) by a product with the transposed selection
    matrix (:func:`selection_matrix`).

    ONNX Runtime's ``ConvTranspose`` multiplies image by image, reading the whole weight for each image's few
    positions, and its NCHWc ``Conv`` spends most taps of a 3x3 kernel on the padding of a 2x2 image; here the
    weight is read once. The product's columns run image-minor where the gradient has at most
    :data:`POSITIONS_MAJOR` positions per image, so that both reorders are 2-D transposes.
    """
    batch, channels = input.shape[0], input.shape[1]
    out_channels, kernel = weight.shape[0], weight.shape[2:]
    taps, out_positions = math.prod(kernel), math.prod(grad_output.shape[2:])
    kernel_rows = weight.reshape(out_channels, channels * taps).t()
    if out_positions <= POSITIONS_MAJOR:
        grad = grad_output.reshape(batch, out_channels * out_positions).t().reshape(out_channels, -1)
        columns = (kernel_rows @ grad).reshape(channels * taps * out_positions, batch).t()
    else:
        grad = grad_output.reshape(batch, out_channels, out_positions).transpose(0, 1).reshape(out_channels, -1)
        columns = (kernel_rows @ grad).reshape(channels * taps, batch, out_positions).transpose(0, 1)
    selection = selection_matrix(input, kernel, stride, padding, dilation)
    return (columns.reshape(batch * channels, taps * out_positions) @ selection.t()).reshape(input.shape)


def _reversed_taps(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` with its kernel flipped along every spatial axis: its taps in reverse order.

    ``flip`` exports as a ``Slice`` with negative steps, which ONNX Runtime's CPU kernel runs on one thread; on
    CPU the reversal is a product with the exchange matrix instead, which MLAS runs threaded and which is exact
    for finite weights (each tap times 1.0, plus zeros). Not on CUDA, where ``Slice`` is a parallel kernel and a
    TF32 product would round the weights.

    Example:
        >>> w = torch.randn(4, 2, 3, 3)
        >>> torch.equal(_reversed_taps(w), w.flip([2, 3]))
        True
    """
    kernel = weight.shape[2:]
    if weight.device.type != "cpu" or not (computed_in_float32(weight) or weight.dtype == torch.float64):
        return weight.flip(list(range(2, 2 + len(kernel))))
    taps = math.prod(kernel)
    exchange = torch.eye(taps, dtype=weight.dtype, device=weight.device).flip(0)
    return (weight.reshape(-1, taps) @ exchange).reshape(weight.shape)


def _weight_grad(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> torch.Tensor:
    if groups == 1:
        return _unfolded_weight_grad(grad_output, input, weight, stride, padding, dilation)
    # Grouped (depthwise): correlate input channels with output-gradient channels over the batch, a
    # convolution whose stride is the forward dilation and whose dilation is the forward stride. With one input
    # channel per group (depthwise) the moves of the input-channel axis are reshapes, not transposes.
    batch = input.shape[0]
    out_channels, in_per_group = weight.shape[0], weight.shape[1]
    out_per_group = out_channels // groups
    spatial_in, spatial_out = input.shape[2:], grad_output.shape[2:]
    kernel = weight.shape[2:]
    x = input.reshape(batch, groups, in_per_group, *spatial_in)
    x = x.reshape(1, batch * groups, *spatial_in) if in_per_group == 1 else x.movedim(2, 0)
    x = x.reshape(in_per_group, batch * groups, *spatial_in)
    gy = grad_output.reshape(batch * groups * out_per_group, 1, *spatial_out)
    grad = aten.convolution(x, gy, None, dilation, padding, stride, False, [0] * len(stride), batch * groups)
    full_kernel = grad.shape[2:]
    grad = grad.reshape(in_per_group, batch, groups, out_per_group, *full_kernel).sum(1)
    grad = grad if in_per_group == 1 else grad.movedim(0, 2)
    grad = grad.reshape(out_channels, in_per_group, *full_kernel)
    for dim, size in enumerate(kernel):
        if not (isinstance(full_kernel[dim], int) and full_kernel[dim] == size):
            grad = grad.narrow(2 + dim, 0, size)
    return grad


def _unfolded_weight_grad(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> torch.Tensor:
    """Weight gradient as a matrix product with the unfolded input (im2col), a part of the batch at a time.

    The columns ``[batch, in_channels * kernel, out_positions]`` are built by :func:`_unfold`. They are
    ``kernel`` times the input (9x for 3x3), so where they would exceed :data:`COLUMN_BYTES` the batch is
    unfolded in parts and their products summed.
    """
    batch, channels = input.shape[0], input.shape[1]
    out_channels, kernel, out = weight.shape[0], weight.shape[2:], grad_output.shape[2:]
    taps = math.prod(kernel)
    unfold = functools.partial(_unfold, kernel=kernel, out=out, stride=stride, padding=padding, dilation=dilation)
    part_size = batch
    if taps > 1 and isinstance(batch, int):
        column_bytes = batch * channels * taps * math.prod(out) * input.element_size()
        if isinstance(column_bytes, int) and column_bytes > COLUMN_BYTES:
            part_size = math.ceil(batch / math.ceil(column_bytes / COLUMN_BYTES))
    if part_size == batch:
        grad_weight = _columns_times_grad(unfold(input), grad_output)
    else:
        grad_weight = _columns_times_grad(unfold(input[:part_size]), grad_output[:part_size])
        for first in range(part_size, batch, part_size):
            part = slice(first, first + part_size)
            grad_weight = grad_weight + _columns_times_grad(unfold(input[part]), grad_output[part])
    return grad_weight.reshape(out_channels, channels, *kernel)


POSITIONS_MAJOR = 8
"""Most positions per image for which a small-image product's contraction (images and positions) runs
position-major: ONNX Runtime's ``Transpose`` of ``[images, rows, positions]`` to ``[rows, positions, images]`` is
a 2-D transpose (MLAS's), faster than the one to ``[rows, images, positions]`` on so few positions and slower
on 16 (see the performance page)."""

COLUMN_BYTES = 64 * 2**20
"""Largest unfolded input (im2col columns) one weight gradient materialises at once, in bytes."""


def _unfold(
    images: torch.Tensor,
    kernel: Sequence[int],
    out: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> torch.Tensor:
    """The columns ``[images, channels * taps, out_positions]`` of a convolution's input (im2col).

    A 1x1 kernel without padding needs only a strided slice. Otherwise the columns are one depthwise convolution
    of the input with one-hot kernels (one output channel per input channel and kernel offset), which applies
    the forward padding, stride and dilation in one node; ONNX Runtime runs it faster than stacked slices of the
    padded input. On CPU images of at most :data:`SELECTION_POSITIONS` positions, where that convolution's
    per-channel cost dominates, the columns are instead one product of the images with a constant 0/1
    selection matrix (:func:`selection_matrix`); exact for finite inputs (each value times 1.0, plus zeros).
    """
    batch, channels = images.shape[0], images.shape[1]
    taps = math.prod(kernel)
    no_adjust = [0] * len(kernel)
    form = _unfold_form(images, kernel, padding)
    if form == "slice":
        columns = images[(slice(None), slice(None), *(slice(0, s * (o - 1) + 1, s) for s, o in zip(stride, out)))]
    elif form == "selection":
        selection = selection_matrix(images, kernel, stride, padding, dilation)
        columns = images.reshape(batch * channels, -1) @ selection
    else:
        one_hot = torch.eye(taps, dtype=images.dtype, device=images.device).reshape(taps, 1, *kernel)
        one_hot = one_hot.repeat(channels, *([1] * (1 + len(kernel))))
        columns = aten.convolution(images, one_hot, None, stride, padding, dilation, False, no_adjust, channels)
    return columns.reshape(batch, channels * taps, math.prod(out))


def _unfold_form(
    images: torch.Tensor, kernel: Sequence[int], padding: Sequence[int]
) -> Literal["slice", "selection", "one_hot"]:
    """How :func:`_unfold` takes the columns of ``images``: a strided slice (1x1 kernel, no padding), a product with
    the selection matrix (:func:`_selects`), or the one-hot depthwise convolution."""
    if math.prod(kernel) == 1 and not any(padding):
        return "slice"
    return "selection" if _selects(images) else "one_hot"


SELECTION_POSITIONS = 16
"""Largest image (in positions, 4x4 in 2-D) whose columns are taken (:func:`_unfold`) and folded back
(:func:`_folded_input_grad`) by a product with a selection matrix."""

FOLDED_STRIDE_ONE_POSITIONS = 4
"""Largest image (2x2 in 2-D) whose stride-1 input gradient is folded back by the selection matrix rather than
computed by the flipped convolution, which wastes most of a 3x3 kernel's taps on a 2x2 image's padding."""


def folds_input_gradient(size: Sequence[int], strided: bool) -> bool:
    """Whether a dense convolution's input gradient on CPU images of ``size`` is folded back by the selection
    matrix (:func:`_folded_input_grad`) rather than computed by a (flipped or transposed) convolution.

    Example:
        >>> folds_input_gradient([4, 4], strided=True), folds_input_gradient([4, 4], strided=False)
        (True, False)
    """
    positions = math.prod(size)
    return positions <= SELECTION_POSITIONS and (strided or positions <= FOLDED_STRIDE_ONE_POSITIONS)


def _selects(images: torch.Tensor) -> bool:
    """Whether a convolution's columns of ``images`` go through a selection-matrix product: CPU images computed
    in float32 (float32, ``bfloat16``) or float64, of at most :data:`SELECTION_POSITIONS` static positions. Not on
    CUDA, where a TF32 product would round the values it only moves."""
    positions = math.prod(images.shape[2:])
    return (
        images.device.type == "cpu"
        and (computed_in_float32(images) or images.dtype == torch.float64)
        and isinstance(positions, int)
        and positions <= SELECTION_POSITIONS
    )


def selection_matrix(
    images: torch.Tensor,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> torch.Tensor:
    """The 0/1 matrix ``[positions, taps * out_positions]`` that maps an image to its columns.

    Entry ``(q, (t, p))`` is 1 where input position ``q`` is kernel offset ``t`` of output position ``p``: the
    one-hot convolution of :func:`_unfold` applied to every unit image, a constant of the shapes alone.

    Example:
        >>> x = torch.randn(2, 3, 4, 4)
        >>> s = selection_matrix(x, [3, 3], [1, 1], [1, 1], [1, 1])
        >>> cols = (x.reshape(6, 16) @ s).reshape(2, 27, 16)
        >>> torch.equal(cols, torch.nn.functional.unfold(x, 3, padding=1))
        True
    """
    size = images.shape[2:]
    positions, taps = math.prod(size), math.prod(kernel)
    units = torch.eye(positions, dtype=images.dtype, device=images.device).reshape(positions, 1, *size)
    one_hot = torch.eye(taps, dtype=images.dtype, device=images.device).reshape(taps, 1, *kernel)
    selected = aten.convolution(units, one_hot, None, stride, padding, dilation, False, [0] * len(kernel), 1)
    return selected.reshape(positions, -1)


def _columns_times_grad(columns: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """``sum over images of grad_output @ columns^T``: the weight gradient ``[out_channels, channels * taps]``.

    Image by image, the product is taken as ``columns @ grad_output^T``, which transposes the smaller operand
    (the output gradient, not the kernel-times-larger columns), and its sum transposed. Where an image has fewer
    output positions than the layer has output channels (deep, low-resolution layers), the per-image products
    would be larger than the columns, so images and positions become one contraction instead, whose transposed
    copy of the columns is smaller; that product is taken in the order whose result needs no transposing where
    the contraction is no longer than the output channels (the ``[rows, out_channels]`` transpose would cost
    more than the packing of the larger operand). With at most :data:`POSITIONS_MAJOR` positions per image, the
    contraction runs position-major, image-minor: moving the image axis innermost is one 2-D transpose, where
    moving it to the front copies blocks of a few floats each.
    """
    batch, rows, positions = columns.shape
    out_channels = grad_output.shape[1]
    grad = grad_output.reshape(batch, out_channels, positions)
    if positions < out_channels:
        order = (1, 2, 0) if positions <= POSITIONS_MAJOR else (1, 0, 2)
        columns_rows = columns.permute(order).reshape(rows, -1)
        grad_rows = grad.permute(order).reshape(out_channels, -1)
        if batch * positions <= out_channels:
            return grad_rows @ columns_rows.t()
        return (columns_rows @ grad_rows.t()).t()
    return (columns @ grad.transpose(1, 2)).sum(0).t()


def batch_norm_functional(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    training: bool,
    momentum: float,
    eps: float,
) -> Any:
    """Training-mode batch norm whose normalisation is one ONNX ``BatchNormalization`` with the batch statistics.

    ATen's decomposition (``var_mean``, then ``(x - mean) * rstd * weight + bias``) exports as two means, two
    centred copies and four elementwise nodes, each writing a tensor of the input's size; here the statistics
    take one centred copy and its square, and the normalisation is ONNX Runtime's fused inference kernel given
    the batch's mean and biased variance (``x * (weight * rstd) + (bias - mean * weight * rstd)``, the form
    PyTorch's CPU kernel computes). float32 only: other dtypes, and evaluation mode, keep ATen's decomposition.

    Example:
        >>> x, w, b = torch.randn(8, 3, 5, 5), torch.rand(3), torch.randn(3)
        >>> ours = batch_norm_functional(x, w, b, torch.zeros(3), torch.ones(3), True, 0.1, 1e-5)
        >>> theirs = aten._native_batch_norm_legit_functional(x, w, b, torch.zeros(3), torch.ones(3), True, 0.1, 1e-5)
        >>> all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ours, theirs))
        True
    """
    parameters = [t for t in (weight, bias, running_mean, running_var) if t is not None]
    if not training or any(t.dtype != torch.float32 for t in (input, *parameters)):
        return _ATEN_BATCH_NORM_FUNCTIONAL(input, weight, bias, running_mean, running_var, training, momentum, eps)
    dims, per_channel, count = channel_layout(input)
    mean = input.mean(dims)
    centred = input - mean.reshape(per_channel)
    var = (centred * centred).mean(dims)
    output = aten._native_batch_norm_legit_no_training.default(input, weight, bias, mean, var, momentum, eps)[0]
    new_running_mean = momentum * mean + (1 - momentum) * running_mean
    new_running_var = var * (momentum * count / max(count - 1, 1)) + (1 - momentum) * running_var
    return output, mean, torch.rsqrt(var + eps), new_running_mean, new_running_var


def batch_norm_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    save_mean: torch.Tensor | None,
    save_invstd: torch.Tensor | None,
    train: bool,
    eps: float,
    output_mask: Sequence[bool],
) -> Any:
    """Training-mode batch norm's gradients with one full-size node fewer than ATen's decomposition.

    ``grad_input = (g - mean(g) - (x - mean) * k) * a`` (``a = weight * rstd``, ``k = sum(g * (x - mean)) *
    rstd^2 / count``) is written as ``g * a`` less the per-channel affine map of ``x - mean`` that ONNX
    ``BatchNormalization`` computes in one pass (a difference, so the per-channel terms need no negation).
    Like PyTorch's kernels it works on the centred input, which the forward graph already computed for the
    variance (and which is saved in place of the input).

    Example:
        >>> g, x, w = torch.randn(8, 3, 5, 5), torch.randn(8, 3, 5, 5), torch.rand(3)
        >>> mean, rstd = x.mean((0, 2, 3)), x.var((0, 2, 3), correction=0).add(1e-5).rsqrt()
        >>> args = (g, x, w, None, None, mean, rstd, True, 1e-5, [True, True, True])
        >>> ours, theirs = batch_norm_backward(*args), aten.native_batch_norm_backward(*args)
        >>> all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ours, theirs))
        True
    """
    tensors = [t for t in (grad_output, input, weight, save_mean, save_invstd) if t is not None]
    if not train or save_mean is None or save_invstd is None or any(t.dtype != torch.float32 for t in tensors):
        return _ATEN_BATCH_NORM_BACKWARD(
            grad_output, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask
        )
    dims, per_channel, count = channel_layout(input)
    centred = input - save_mean.reshape(per_channel)
    grad_sum = grad_output.sum(dims)
    dot = (grad_output * centred).sum(dims)
    grad_input = None
    if output_mask[0]:
        scale = save_invstd if weight is None else save_invstd * weight
        projection = dot * save_invstd * save_invstd / count * scale
        zeros, ones = torch.zeros_like(grad_sum), torch.ones_like(grad_sum)
        affine = aten._native_batch_norm_legit_no_training.default(
            centred, projection, grad_sum / count * scale, zeros, ones, 0.0, 0.0
        )[0]
        grad_input = grad_output * scale.reshape(per_channel) - affine
    grad_weight = dot * save_invstd if output_mask[1] else None
    grad_bias = grad_sum if output_mask[2] else None
    return grad_input, grad_weight, grad_bias


def channel_layout(input: torch.Tensor) -> tuple[list[int], list[int], Any]:
    """Batch norm's reduction dims (all but channels), the shape a per-channel vector broadcasts with, and the
    number of values each channel's statistics cover."""
    dims = [0, *range(2, input.dim())]
    return dims, [1, input.shape[1], *([1] * (input.dim() - 2))], input.numel() // input.shape[1]


_ATEN_BATCH_NORM_BACKWARD = get_decompositions([aten.native_batch_norm_backward])[
    aten.native_batch_norm_backward.default
]
_ATEN_BATCH_NORM_FUNCTIONAL = get_decompositions([aten._native_batch_norm_legit_functional])[
    aten._native_batch_norm_legit_functional.default
]


def threshold_backward(grad_output: torch.Tensor, self: torch.Tensor, threshold: float) -> torch.Tensor:
    """ReLU's (and ``F.threshold``'s) gradient: ``grad_output`` times the 0/1 mask ``self > threshold``.

    ATen's decomposition is ``where(self <= threshold, 0, grad_output)``; ONNX Runtime's CPU ``Where`` is
    several times slower than a ``Cast`` and a ``Mul``.
    The one difference: an infinite or NaN gradient where the input was at or below the threshold gives NaN
    here and 0 in PyTorch (and a negative gradient there gives ``-0.0``, not ``0.0``).

    Example:
        >>> threshold_backward(torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0.5, 0.0, -1.0]), 0.0)
        tensor([1., -0., 0.])
    """
    return grad_output * (self > threshold).to(grad_output.dtype)


def hardtanh_backward(grad_output: torch.Tensor, self: torch.Tensor, min_val: float, max_val: float) -> torch.Tensor:
    """ReLU6's (and ``F.hardtanh``'s) gradient: ``grad_output`` times the 0/1 mask of ``self`` inside the bounds.

    ATen's decomposition is ``where((self <= min_val) | (self >= max_val), 0, grad_output)``; ONNX Runtime's CPU
    ``Where`` costs about twice the two comparisons, ``And``, ``Cast`` and ``Mul`` together. A NaN input gives 0,
    as PyTorch's vectorized CPU kernel does (ATen's decomposition, and that kernel on a tensor's last few
    elements, pass the gradient there). The one other difference is :func:`threshold_backward`'s: an infinite or
    NaN gradient where the input is outside the bounds gives NaN here and 0 in PyTorch.

    Example:
        >>> x = torch.tensor([-1.0, 0.0, 3.0, 6.0, 7.0, float("nan")])
        >>> hardtanh_backward(torch.ones(6), x, 0.0, 6.0)
        tensor([0., 0., 1., 0., 0., 0.])
    """
    inside = (self > min_val) & (self < max_val)
    return grad_output * inside.to(grad_output.dtype)


def avg_pool2d_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
) -> torch.Tensor:
    """Average pooling's input gradient as a depthwise transposed convolution with a constant kernel
    (:func:`_average_pooling_backward` on two axes).

    Example:
        >>> x = torch.randn(2, 3, 8, 8)
        >>> g = torch.randn(2, 3, 4, 4)
        >>> ours = avg_pool2d_backward(g, x, [2, 2], [2, 2], [0, 0], False, True, None)
        >>> torch.allclose(ours, aten.avg_pool2d_backward(g, x, [2, 2], [2, 2], [0, 0], False, True, None))
        True
        >>> g = torch.randn(2, 3, 5, 5)
        >>> ours = avg_pool2d_backward(g, x, [3, 3], [2, 2], [1, 1], True, False, None)
        >>> torch.allclose(ours, aten.avg_pool2d_backward(g, x, [3, 3], [2, 2], [1, 1], True, False, None))
        True
    """
    window = _pooling_window(kernel_size, stride, padding, axes=2)
    return _average_pooling_backward(grad_output, input, *window, ceil_mode, count_include_pad, divisor_override)


def avg_pool3d_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
) -> torch.Tensor:
    """3-d average pooling's input gradient (``nn.AvgPool3d``; ``nn.LocalResponseNorm`` pools over channels
    with it), as :func:`avg_pool2d_backward` on three axes.

    Example:
        >>> x = torch.randn(2, 3, 5, 6, 7)
        >>> g = torch.randn(2, 3, 3, 4, 4)
        >>> ours = avg_pool3d_backward(g, x, [2, 2, 2], [2, 2, 2], [1, 1, 1], False, False, None)
        >>> torch.allclose(ours, aten.avg_pool3d_backward(g, x, [2, 2, 2], [2, 2, 2], [1, 1, 1], False, False, None))
        True
    """
    window = _pooling_window(kernel_size, stride, padding, axes=3)
    return _average_pooling_backward(grad_output, input, *window, ceil_mode, count_include_pad, divisor_override)


def _pooling_window(
    kernel_size: Sequence[int], stride: Sequence[int], padding: Sequence[int], axes: int
) -> tuple[list[int], list[int], list[int]]:
    """A pooling's kernel, stride and padding per axis, from ATen's forms (one value for all axes; an empty
    stride for the kernel's)."""
    kernel = list(kernel_size) if len(kernel_size) == axes else [kernel_size[0]] * axes
    steps = list(stride) if len(stride) == axes else list(kernel) if not stride else [stride[0]] * axes
    pads = list(padding) if len(padding) == axes else [padding[0]] * axes
    return kernel, steps, pads


def _average_pooling_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    kernel: list[int],
    steps: list[int],
    pads: list[int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
) -> torch.Tensor:
    """Average pooling's input gradient on ``len(kernel)`` axes, batched input only.

    Each output gradient is spread evenly over its window: a transposed convolution of the gradient with a kernel
    of ``1 / divisor``, one group per channel, where every window has the same divisor (no padding, or padding
    counted, and no ceil-mode windows past the border). Elsewhere (``count_include_pad=False`` with padding, as
    in Inception; ``ceil_mode``, as in ResNet-D's downsampling) the gradient is first divided by each window's
    own divisor, the product of its counts along each axis (:func:`_window_counts`), then spread with a kernel of
    ones, and the spread cropped to the input where a ceil-mode window reaches past it. Pools whose sizes are
    still symbolic keep ATen's op (no ONNX translation: it runs in PyTorch).
    """
    axes = len(kernel)
    sizes = [*input.shape[2:], *grad_output.shape[2:]]
    if input.dim() != axes + 2 or not all(isinstance(size, int) for size in sizes):
        return NotImplemented
    channels, extents, windows = input.shape[1], list(input.shape[2:]), list(grad_output.shape[2:])
    uniform = not ceil_mode and (count_include_pad or not any(pads))
    if divisor_override or uniform:
        divisor = divisor_override or math.prod(kernel)
        scaled = grad_output
        weight = torch.full((channels, 1, *kernel), 1.0 / divisor, dtype=grad_output.dtype, device=grad_output.device)
    else:
        divisors = torch.ones(windows, dtype=torch.int64)
        for axis in range(axes):
            counts = _window_counts(
                extents[axis], windows[axis], kernel[axis], steps[axis], pads[axis], count_include_pad
            )
            divisors = divisors * counts.reshape([-1] + [1] * (axes - 1 - axis))
        scaled = grad_output / divisors.to(grad_output)
        weight = torch.ones((channels, 1, *kernel), dtype=grad_output.dtype, device=grad_output.device)
    spread = [(windows[i] - 1) * steps[i] - 2 * pads[i] + kernel[i] for i in range(axes)]
    adjust = [min(max(extents[i] - spread[i], 0), steps[i] - 1) for i in range(axes)]
    grad_input = aten.convolution(scaled, weight, None, steps, pads, [1] * axes, True, adjust, channels)
    missing = [max(extents[i] - spread[i] - adjust[i], 0) for i in range(axes)]  # positions no window reads
    if any(missing):
        grad_input = torch.nn.functional.pad(grad_input, [edge for m in reversed(missing) for edge in (0, m)])
    for axis in range(axes):
        grad_input = grad_input.narrow(2 + axis, 0, extents[axis])
    return grad_input


def _window_counts(
    size: int, windows: int, kernel: int, stride: int, padding: int, count_padding: bool
) -> torch.Tensor:
    """Each pooling window's extent along one axis (int64, ``[windows]``, on the CPU: moved with the gradient
    it divides): the positions it covers inside the input, or with ``count_padding`` inside the padded input,
    as ATen's average pooling divides by them (a ceil-mode window past the padded border is clipped to it)."""
    start = torch.arange(windows) * stride - padding
    end = torch.clamp(start + kernel, max=size + padding)
    if count_padding:
        return end - start
    return torch.clamp(end, max=size) - torch.clamp(start, min=0)


def adaptive_avg_pool2d_backward(grad_output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """Adaptive average pooling's input gradient (``nn.AdaptiveAvgPool2d((7, 7))``, as VGG and AlexNet pool
    before their classifiers): ``A_h^T @ grad @ A_w`` for each plane.

    Adaptive pooling averages output row ``i`` over input rows ``floor(i * H / h)`` to ``ceil((i + 1) * H / h)``,
    windows of varying length that may overlap; along each axis that is a constant ``[h, H]`` averaging matrix
    ``A_h`` (:func:`_adaptive_windows`), and the pooling is ``A_h @ x @ A_w^T``. Images whose sizes are still
    symbolic keep ATen's op (no ONNX translation: it runs in PyTorch).

    Example:
        >>> x, g = torch.randn(2, 3, 8, 11), torch.randn(2, 3, 3, 4)
        >>> torch.allclose(adaptive_avg_pool2d_backward(g, x), aten._adaptive_avg_pool2d_backward(g, x), atol=1e-6)
        True
    """
    if input.dim() not in (3, 4):
        return NotImplemented
    maps = _adaptive_maps(input.shape[-2:], grad_output.shape[-2:])
    return NotImplemented if maps is None else _axis_products(grad_output, maps)


def adaptive_avg_pool3d(input: torch.Tensor, output_size: Sequence[int]) -> torch.Tensor:
    """3-d adaptive average pooling to a grid (``nn.AdaptiveAvgPool3d((1, 7, 7))`` in video nets; a 1x1x1 grid is
    a mean before it gets here): the averaging matrices of :func:`adaptive_avg_pool2d_backward` along depth,
    height and width, applied by :func:`_axis_products` with each transposed.

    Example:
        >>> x = torch.randn(2, 3, 5, 8, 7)
        >>> torch.allclose(adaptive_avg_pool3d(x, [2, 3, 4]), aten._adaptive_avg_pool3d(x, [2, 3, 4]), atol=1e-6)
        True
    """
    maps = _adaptive_maps(input.shape[-3:], output_size)
    return NotImplemented if maps is None else _axis_products(input, [matrix.t() for matrix in maps])


def adaptive_avg_pool3d_backward(grad_output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """The input gradient of :func:`adaptive_avg_pool3d`: the gradient contracted with each averaging matrix.

    Example:
        >>> x, g = torch.randn(2, 3, 5, 8, 7), torch.randn(2, 3, 2, 3, 4)
        >>> ours = adaptive_avg_pool3d_backward(g, x)
        >>> torch.allclose(ours, aten._adaptive_avg_pool3d_backward(g, x), atol=1e-6)
        True
    """
    maps = _adaptive_maps(input.shape[-3:], grad_output.shape[-3:])
    return NotImplemented if maps is None else _axis_products(grad_output, maps)


def _adaptive_maps(sizes: Sequence[Any], pooled: Sequence[Any]) -> list[torch.Tensor] | None:
    """The ``[pooled, size]`` averaging matrix of each axis (:func:`_adaptive_windows`), ``None`` where a size is
    symbolic."""
    if len(sizes) != len(pooled) or not all(isinstance(size, int) for size in (*sizes, *pooled)):
        return None
    return [_adaptive_windows(size, windows) for size, windows in zip(sizes, pooled, strict=True)]


def _axis_products(tensor: torch.Tensor, maps: Sequence[torch.Tensor]) -> torch.Tensor:
    """``tensor``'s last ``len(maps)`` axes contracted with ``maps`` (outermost axis first, each ``[a, b]``
    taking an axis of size ``a`` to size ``b``): the input gradient of mapping each axis by a constant ``[a,
    b]`` matrix ``M`` (``M @ x`` along it), or, given the transposes, that map itself. A left product over the
    axis with the ones after it flattened, and a right product for the last axis, so that no axis moves.
    ``maps`` are float32 on the CPU, moved to ``tensor``'s dtype and device."""
    for offset, matrix in enumerate(maps[:-1]):
        axis = tensor.dim() - len(maps) + offset
        lead, inner = tensor.shape[:axis], tensor.shape[axis + 1 :]
        flat = tensor.reshape(*lead, tensor.shape[axis], math.prod(inner))
        tensor = torch.matmul(matrix.t().to(tensor), flat).reshape(*lead, matrix.shape[1], *inner)
    return torch.matmul(tensor, maps[-1].to(tensor))


def _adaptive_windows(size: int, windows: int) -> torch.Tensor:
    """``[windows, size]`` float32: row ``i`` holds ``1 / length`` over adaptive pooling's window ``i``."""
    index = torch.arange(windows)
    start = torch.div(index * size, windows, rounding_mode="floor")
    end = torch.div((index + 1) * size + windows - 1, windows, rounding_mode="floor")
    position = torch.arange(size)
    inside = (position[None, :] >= start[:, None]) & (position[None, :] < end[:, None])
    return inside.float() / (end - start)[:, None].float()


def adaptive_max_pool2d_backward(grad_output: torch.Tensor, input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Adaptive max pooling's input gradient: each output gradient added at the position its window selected,
    the forward's per-plane ``indices``, as for :func:`max_pool2d_with_indices_backward`.

    Example:
        >>> x = torch.randn(2, 3, 7, 9)
        >>> y, idx = aten.adaptive_max_pool2d(x, [3, 4])
        >>> g = torch.randn_like(y)
        >>> torch.equal(adaptive_max_pool2d_backward(g, x, idx), aten.adaptive_max_pool2d_backward(g, x, idx))
        True
    """
    return _scatter_to_indices(grad_output, input, indices)


def replication_pad1d_backward(grad_output: torch.Tensor, input: torch.Tensor, padding: Sequence[int]) -> torch.Tensor:
    """``nn.ReplicationPad1d``'s input gradient (``nn.Conv1d(padding_mode="replicate")``), as
    :func:`replication_pad2d_backward` along one axis.

    Example:
        >>> x, g = torch.randn(2, 3, 5), torch.randn(2, 3, 9)
        >>> torch.allclose(replication_pad1d_backward(g, x, [3, 1]), aten.replication_pad1d_backward(g, x, [3, 1]))
        True
    """
    return _copied_positions_backward(grad_output, input, padding, reflect=False)


def replication_pad2d_backward(grad_output: torch.Tensor, input: torch.Tensor, padding: Sequence[int]) -> torch.Tensor:
    """``nn.ReplicationPad2d``'s input gradient: ``R_h^T @ grad @ R_w`` for each plane, ``R`` the one-hot
    ``[padded, size]`` matrix of the row (column) each padded position copies (the nearest border one).

    Example:
        >>> x = torch.randn(2, 3, 5, 4)
        >>> g = torch.randn(2, 3, 8, 9)
        >>> ours = replication_pad2d_backward(g, x, [2, 3, 1, 2])
        >>> torch.allclose(ours, aten.replication_pad2d_backward(g, x, [2, 3, 1, 2]), atol=1e-6)
        True
    """
    return _copied_positions_backward(grad_output, input, padding, reflect=False)


def replication_pad3d_backward(grad_output: torch.Tensor, input: torch.Tensor, padding: Sequence[int]) -> torch.Tensor:
    """``nn.ReplicationPad3d``'s input gradient (``nn.Conv3d(padding_mode="replicate")``, volumetric
    segmentation nets), as :func:`replication_pad2d_backward` with a third one-hot matrix along depth.

    Example:
        >>> x, g = torch.randn(2, 3, 4, 5, 3), torch.randn(2, 3, 6, 8, 4)
        >>> ours = replication_pad3d_backward(g, x, [1, 0, 2, 1, 1, 1])
        >>> torch.allclose(ours, aten.replication_pad3d_backward(g, x, [1, 0, 2, 1, 1, 1]), atol=1e-6)
        True
    """
    return _copied_positions_backward(grad_output, input, padding, reflect=False)


def reflection_pad2d_backward(grad_output: torch.Tensor, input: torch.Tensor, padding: Sequence[int]) -> torch.Tensor:
    """``nn.ReflectionPad2d``'s input gradient (style transfer, GAN generators), as
    :func:`replication_pad2d_backward` with each padded position copying its mirror image across the border.

    Example:
        >>> x = torch.randn(2, 3, 5, 4)
        >>> g = torch.randn(2, 3, 8, 9)
        >>> ours = reflection_pad2d_backward(g, x, [2, 3, 1, 2])
        >>> torch.allclose(ours, aten.reflection_pad2d_backward(g, x, [2, 3, 1, 2]), atol=1e-6)
        True
    """
    return _copied_positions_backward(grad_output, input, padding, reflect=True)


def _copied_positions_backward(
    grad_output: torch.Tensor, input: torch.Tensor, padding: Sequence[int], reflect: bool
) -> torch.Tensor:
    """The input gradient of a pad that copies input positions along the last ``len(padding) / 2`` axes
    (``padding``: before and after the last axis, then the one before it...): :func:`_axis_products` with
    matrices one-hot by the copied position (:func:`_copied_positions`)."""
    axes = len(padding) // 2
    sizes = [*input.shape[-axes:], *grad_output.shape[-axes:]]
    if axes not in (1, 2, 3) or len(padding) % 2 or not all(isinstance(size, int) for size in sizes):
        return NotImplemented
    maps = [
        _copied_positions(input.shape[axis], grad_output.shape[axis], padding[2 * (-1 - axis)], reflect)
        for axis in range(-axes, 0)
    ]
    return _axis_products(grad_output, maps)


def _copied_positions(size: int, padded: int, before: int, reflect: bool) -> torch.Tensor:
    """``[padded, size]`` float32, one-hot: the input position padded position ``o`` copies, ``o - before``
    clamped to the input (replication) or mirrored across its first and last positions (reflection)."""
    offset = torch.arange(padded) - before
    mirrored = (size - 1) - torch.abs((size - 1) - torch.abs(offset))
    source = mirrored if reflect else torch.clamp(offset, 0, size - 1)
    return (torch.arange(size)[None, :] == source[:, None]).float()


def max_pool3d_with_indices_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
    indices: torch.Tensor,
) -> torch.Tensor:
    """3-d max pooling's input gradient (``nn.MaxPool3d``, video and volumetric nets): each output gradient
    added at the position its window selected, the forward's flat per-volume ``indices``.

    Example:
        >>> x = torch.randn(2, 3, 5, 6, 7)
        >>> y, idx = aten.max_pool3d_with_indices(x, [2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1], True)
        >>> g = torch.randn_like(y)
        >>> window = ([2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1], True)
        >>> ours = max_pool3d_with_indices_backward(g, x, *window, idx)
        >>> torch.equal(ours, aten.max_pool3d_with_indices_backward(g, x, *window, idx))
        True
    """
    return _scatter_to_indices(grad_output, input, indices, axes=3)


def max_pool2d_with_indices_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
    indices: torch.Tensor,
) -> torch.Tensor:
    """Max pooling's input gradient: each output gradient added at the input position its window selected.

    ``indices`` are the forward's per-channel flat positions (``h * width + w``), so the gradient is a
    ``scatter_add`` over each channel's flattened plane. Positions chosen by several overlapping windows receive
    the sum, as in ATen's kernel. Half-precision gradients accumulate in float32.

    Example:
        >>> x = torch.randn(2, 3, 9, 9)
        >>> y, idx = aten.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1], [1, 1], True)
        >>> g = torch.randn_like(y)
        >>> ours = max_pool2d_with_indices_backward(g, x, [3, 3], [2, 2], [1, 1], [1, 1], True, idx)
        >>> torch.allclose(ours, aten.max_pool2d_with_indices_backward(g, x, [3, 3], [2, 2], [1, 1], [1, 1], True, idx))
        True
    """
    return _scatter_to_indices(grad_output, input, indices)


def _scatter_to_indices(
    grad_output: torch.Tensor, input: torch.Tensor, indices: torch.Tensor, axes: int = 2
) -> torch.Tensor:
    """``grad_output`` added, per image plane (volume, for three ``axes``), at the flat positions ``indices`` of
    ``input``'s planes (in float32 for half-precision gradients)."""
    planes, extents = input.shape[:-axes], input.shape[-axes:]
    accumulate = torch.promote_types(grad_output.dtype, torch.float32)
    grad = grad_output.reshape(-1, math.prod(grad_output.shape[-axes:])).to(accumulate)
    positions = indices.reshape(grad.shape)
    zeros = grad.new_zeros((grad.shape[0], math.prod(extents)))
    return zeros.scatter_add(1, positions, grad).to(grad_output.dtype).reshape(*planes, *extents)


def addmm(
    input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta: float = 1, alpha: float = 1
) -> torch.Tensor:
    """``beta * input`` for a product over an empty inner dimension (``mat1`` with 0 columns).

    ONNX Runtime's CPU ``Gemm`` returns ``input`` unscaled when the inner dimension is 0, ignoring ``beta``.
    Other shapes keep ATen's ``addmm`` (``Gemm`` in ONNX).

    Example:
        >>> bias = torch.ones(2, 3)
        >>> addmm(bias, torch.empty(2, 0), torch.empty(0, 3), beta=0.5)
        tensor([[0.5000, 0.5000, 0.5000],
                [0.5000, 0.5000, 0.5000]])
    """
    inner = mat1.shape[1]
    if not isinstance(inner, int) or inner != 0:
        return NotImplemented
    shape = (mat1.shape[0], mat2.shape[1])
    if beta == 0:  # ATen ignores input then, NaNs included
        return input.new_zeros(shape)
    return (input * beta).expand(shape).clone()


def safe_softmax(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Softmax that gives zeros, not NaNs, on rows that are entirely ``-inf`` (SDPA's masked rows).

    Same result as ATen's decomposition, which compares every element with ``-inf`` and reduces the
    comparison with ``all``; a row is entirely ``-inf`` exactly when its maximum is ``-inf``, which is one
    reduction instead of four full-size nodes.

    Example:
        >>> x = torch.tensor([[1.0, float("-inf")], [float("-inf"), float("-inf")]])
        >>> safe_softmax(x, -1)
        tensor([[1., 0.],
                [0., 0.]])
    """
    out = torch.softmax(x, dim=dim, dtype=dtype)
    fully_masked = x.amax(dim=dim, keepdim=True) == float("-inf")
    return torch.where(fully_masked, torch.zeros((), dtype=out.dtype, device=out.device), out)


def embedding_bag(
    weight: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    scale_grad_by_freq: bool = False,
    mode: int = 0,
    sparse: bool = False,
    per_sample_weights: torch.Tensor | None = None,
    include_last_offset: bool = False,
    padding_idx: int = -1,
) -> Any:
    """``aten._embedding_bag`` for 1-D indices with offsets, modes sum (0) and mean (1), no per-sample weights.

    Returns ``(output, offset2bag, bag_size, max_indices)`` as ATen does; :func:`embedding_bag_backward`
    consumes ``offset2bag`` and ``bag_size``.

    Example:
        >>> w, idx, off = torch.randn(10, 3), torch.tensor([1, 2, 4, 5, 4]), torch.tensor([0, 2, 2])
        >>> torch.allclose(embedding_bag(w, idx, off, mode=1)[0], aten._embedding_bag(w, idx, off, mode=1)[0])
        True
    """
    if mode not in (0, 1) or per_sample_weights is not None or indices.dim() != 1:
        return NotImplemented
    bags = offsets.shape[0] - (1 if include_last_offset else 0)
    count = indices.shape[0]
    starts = torch.zeros(count + 1, dtype=offsets.dtype, device=offsets.device)
    starts = starts.index_add(0, offsets[1:bags], torch.ones_like(offsets[1:bags]))
    offset2bag = starts[:count].cumsum(0)
    keep = (indices != padding_idx) if padding_idx >= 0 else torch.ones_like(indices, dtype=torch.bool)
    rows = weight[indices] * keep.unsqueeze(1).to(weight.dtype)
    output = torch.zeros(bags, weight.shape[1], dtype=weight.dtype, device=weight.device).index_add(0, offset2bag, rows)
    bag_size = torch.zeros(bags, dtype=indices.dtype, device=indices.device).index_add(0, offset2bag, keep.long())
    if mode == 1:
        output = output / bag_size.clamp(min=1).unsqueeze(1).to(weight.dtype)
    return output, offset2bag, bag_size, torch.zeros_like(bag_size)


def embedding_bag_backward(
    grad: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    offset2bag: torch.Tensor,
    bag_size: torch.Tensor,
    maximum_indices: torch.Tensor,
    num_weights: int,
    scale_grad_by_freq: bool,
    mode: int,
    sparse: bool,
    per_sample_weights: torch.Tensor | None,
    padding_idx: int = -1,
) -> Any:
    """Weight gradient of :func:`embedding_bag`: each bag's gradient scattered back to its rows."""
    if mode not in (0, 1) or per_sample_weights is not None or scale_grad_by_freq or sparse:
        return NotImplemented
    rows = grad[offset2bag]
    if mode == 1:
        rows = rows / bag_size.clamp(min=1)[offset2bag].unsqueeze(1).to(grad.dtype)
    if padding_idx >= 0:
        rows = rows * (indices != padding_idx).unsqueeze(1).to(grad.dtype)
    return torch.zeros(num_weights, grad.shape[1], dtype=grad.dtype, device=grad.device).index_add(0, indices, rows)


def trilinear(
    i1: torch.Tensor,
    i2: torch.Tensor,
    i3: torch.Tensor,
    expand1: Sequence[int],
    expand2: Sequence[int],
    expand3: Sequence[int],
    sumdim: Sequence[int],
    unroll_dim: int = 1,
) -> torch.Tensor:
    """``aten._trilinear`` (``nn.Bilinear``'s forward and its gradients; no ONNX translation) as one ``einsum``:
    each input unsqueezed at its ``expand`` axes, the three multiplied, summed over ``sumdim`` and those axes
    dropped. ``unroll_dim`` only picks ATen's loop order. An output axis that every input was unsqueezed at
    (which ATen gives size 0) keeps ATen's op.

    Example:
        >>> x1, w, x2 = torch.randn(4, 5), torch.randn(3, 5, 6), torch.randn(4, 6)
        >>> args = ([1, 3], [0], [1, 2], [2, 3])
        >>> torch.allclose(trilinear(x1, w, x2, *args), aten._trilinear(x1, w, x2, *args), atol=1e-5)
        True
    """
    rank = i1.dim() + len(expand1)
    letters = "abcdefghijklmnopqrstuvwxyz"[:rank]
    expands = (set(expand1), set(expand2), set(expand3))
    inputs = ["".join(letters[axis] for axis in range(rank) if axis not in expand) for expand in expands]
    kept = [axis for axis in range(rank) if axis not in sumdim]
    if any(all(axis in expand for expand in expands) for axis in kept):
        return NotImplemented
    return torch.einsum(f"{','.join(inputs)}->{''.join(letters[axis] for axis in kept)}", i1, i2, i3)


def weight_norm_interface_backward(
    grad_w: torch.Tensor, saved_v: torch.Tensor, saved_g: torch.Tensor, saved_norms: torch.Tensor, dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight normalisation's gradients (``nn.utils.parametrizations.weight_norm``, as in HiFi-GAN, MelGAN and
    WaveNet vocoders): ATen's analytic form (``_weight_norm_differentiable_backward``), with ``s`` the sums of
    ``grad_w * v`` over all axes but ``dim``: ``grad_v = g / |v| * (grad_w - v * s / |v|^2)``, ``grad_g = s /
    |v|``. 16-bit tensors are computed in float32, as ATen's kernel accumulates.

    Example:
        >>> v, g = torch.randn(4, 3, 5), torch.randn(4, 1, 1)
        >>> w, norms = aten._weight_norm_interface(v, g, 0)
        >>> grad = torch.randn_like(w)
        >>> ours = weight_norm_interface_backward(grad, v, g, norms, 0)
        >>> theirs = aten._weight_norm_interface_backward(grad, v, g, norms, 0)
        >>> all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ours, theirs))
        True
    """
    compute = torch.promote_types(saved_v.dtype, torch.float32)
    grad, v, g, norms = (t.to(compute) for t in (grad_w, saved_v, saved_g, saved_norms))
    axes = [axis for axis in range(v.dim()) if axis != dim % v.dim()]
    sums = (grad * v).sum(dim=axes, keepdim=True)
    grad_v = g / norms * (grad - v * (sums / (norms * norms)))
    return grad_v.to(saved_v.dtype), (sums / norms).reshape(saved_g.shape).to(saved_g.dtype)


def copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``aten.copy``: ``src`` broadcast to ``self``'s shape, in ``self``'s dtype.

    The ONNX exporter translates ``aten.copy`` as ``src`` itself, without the broadcast, so a scalar written into
    a slice (``ids[:, 0] = start_token``, as Hugging Face's ``shift_tokens_right`` does) came out 0-d.

    Example:
        >>> copy(torch.zeros(3, dtype=torch.long), torch.tensor(2.0)).tolist()
        [2, 2, 2]
    """
    return src.to(dtype=self.dtype, device=self.device).expand(self.shape).clone()


def pow_tensor_scalar(input: torch.Tensor, exponent: float) -> Any:
    """``input ** exponent`` for the exponents ATen's kernel computes with a cheaper op: ``1`` (a copy), ``0.5``
    (``sqrt``), ``-0.5`` (``rsqrt``) and ``-1`` (``reciprocal``), as it does; other exponents and integer
    tensors stay ``pow`` (``NotImplemented``).

    ONNX Runtime's CPU ``Pow`` computes ``std::pow`` per element except for the exponents 2 and 3, about ten
    times the cost of a product. ``pow(x, 1)`` is what the gradient of ``x ** 2`` computes (ATen's ``pow``
    gradient is ``exponent * x ** (exponent - 1)``): a full-size ``Pow`` per RMSNorm in the backward graph of
    Llama-style models, whose norms square their input.

    Example:
        >>> x = torch.rand(5) + 0.5
        >>> [torch.equal(pow_tensor_scalar(x, e), x**e) for e in (1, 0.5, -0.5, -1)]
        [True, True, True, True]
        >>> pow_tensor_scalar(x, 2.5)
        NotImplemented
    """
    if not input.is_floating_point() or isinstance(exponent, bool):
        return NotImplemented
    cheaper = _CHEAPER_POWERS.get(float(exponent)) if isinstance(exponent, (int, float)) else None
    return NotImplemented if cheaper is None else cheaper(input)


_CHEAPER_POWERS: dict[float, Callable[[torch.Tensor], torch.Tensor]] = {
    1.0: aten.clone.default,
    0.5: aten.sqrt.default,
    -0.5: aten.rsqrt.default,
    -1.0: aten.reciprocal.default,
}
"""The exponents :func:`pow_tensor_scalar` replaces, with the ATen op that computes each power."""


_ERFC_POLYNOMIAL = (
    -1.26551223,
    1.00002368,
    0.37409196,
    0.09678418,
    -0.18628806,
    0.27886807,
    -1.13520398,
    1.48851587,
    -0.82215223,
    0.17087277,
)
"""Chebyshev fit of ``erfc`` (Numerical Recipes' ``erfcc``): fractional error below 1.2e-7 for every ``x``."""


def _erfcx_of_magnitude(x: torch.Tensor) -> torch.Tensor:
    """``erfcx(|x|) = exp(x**2) * erfc(|x|)``, with no overflow or cancellation at any ``|x|``."""
    t = 1.0 / (1.0 + 0.5 * x.abs())
    polynomial = torch.full_like(t, _ERFC_POLYNOMIAL[-1])
    for coefficient in reversed(_ERFC_POLYNOMIAL[:-1]):
        polynomial = polynomial * t + coefficient
    return t * torch.exp(polynomial)


def erfc(x: torch.Tensor) -> torch.Tensor:
    """``aten.erfc`` to full relative precision in the tail.

    The ONNX translation computes ``1 - Erf(x)``, which cancels to 0 from ``x`` near 4 in float32, where the
    true value (and eager's) is still around 1e-8 and above; ``log`` of it (``log_ndtr``) then went to ``-inf``.

    Example:
        >>> round(erfc(torch.tensor(6.0)).item() / torch.erfc(torch.tensor(6.0)).item(), 5)
        1.0
    """
    tail = _erfcx_of_magnitude(x) * torch.exp(-x * x)
    return torch.where(x >= 0, tail, 2.0 - tail)


def erfcx(x: torch.Tensor) -> torch.Tensor:
    """``aten.special_erfcx``: ``exp(x**2) * erfc(x)`` without its overflow (the ONNX translation's form).

    Example:
        >>> round(erfcx(torch.tensor(30.0)).item(), 4)
        0.0188
    """
    magnitude = _erfcx_of_magnitude(x)
    return torch.where(x >= 0, magnitude, 2.0 * torch.exp(x * x) - magnitude)


def log_ndtr(x: torch.Tensor) -> torch.Tensor:
    """``aten.special_log_ndtr``: ``log`` of the normal CDF, finite far into the lower tail.

    ``ndtr(x) = erfc(z) / 2`` with ``z = -x / sqrt(2)``; for ``x < 0`` the log is taken term by term,
    ``log(1/2) + log(erfcx(z)) - z**2``, instead of the log of an underflowed product.

    Example:
        >>> round(log_ndtr(torch.tensor(-30.0)).item(), 2)
        -454.32
    """
    z = x * -math.sqrt(0.5)
    lower = math.log(0.5) + torch.log(_erfcx_of_magnitude(z)) - z * z
    upper = torch.log1p(-0.5 * erfc(-z))
    return torch.where(x < 0, lower, upper)


@functools.cache
def capture_decompositions(
    device_type: str,
    attention_path: AttentionPath = "onnx",
    conv_weight_grad: ConvWeightGrad = "auto",
    cpu_kernels: bool = False,
    conv_weight_kernel: bool = False,
) -> dict[Any, Callable[..., Any]]:
    """The decomposition table passed to AOTAutograd for graphs on ``device_type`` (``"cpu"``, ``"cuda"``).

    With ``cpu_kernels`` (lightning_ort's CPU kernels are built and checked), stride-2 convolutions' input
    gradients take :func:`~lightning_ort.engine.fx.conv_phases.phase_input_grad`, with ``conv_weight_kernel`` (the
    NCHWc block is the kernel's too) large 3x3 layers' weight gradients
    :data:`~lightning_ort.engine.fx.conv_weight_grad.CONV3X3_WEIGHT_GRAD`, and on CPU GELU's, SiLU's and
    layer norm's gradients and group norm their kernels (:func:`~lightning_ort.engine.fx.gelu.gelu_backward`,
    :func:`~lightning_ort.engine.fx.silu.silu_backward`,
    :func:`~lightning_ort.engine.fx.layer_norm.layer_norm_backward`,
    :mod:`~lightning_ort.engine.fx.group_norm`).

    A float64 layer norm is decomposed (:func:`~lightning_ort.engine.fx.layer_norm.float64_layer_norm`), so that
    its saved statistics stay float64.

    With ``attention_path="torch"`` SDPA's fused forward stays whole, as its backward does: a decomposed forward
    does not give the backward kernel the softmax statistics it expects.

    ``select_backward`` and ``slice_backward`` stay whole so that :mod:`lightning_ort.engine.fx.passes` can turn
    sums of them into one ``stack`` or ``cat`` (and a lone slice's gradient into a ``pad``); the ONNX exporter
    decomposes any that remain. :func:`threshold_backward` and
    :func:`hardtanh_backward` replace ATen's exact ``Where`` on CPU only, where it pays: CUDA's ``Where`` kernel
    is not slower than a ``Mul``. The batch norm forms (:func:`batch_norm_functional`, :func:`batch_norm_backward`)
    are CPU only too: they pay on CPU, and ONNX Runtime's cuDNN ``BatchNormalization`` raises an epsilon below
    1e-5 to 1e-5. So is :func:`~lightning_ort.engine.fx.scatter.index_put`, which keeps accumulating puts off
    the CPU ``ScatterND`` kernel that loses sums between threads. On CPU ``embedding_dense_backward`` stays whole,
    to run in PyTorch after the backward graph (see
    :func:`~lightning_ort.engine.capture.partition.weight_gradient_nodes`).
    """
    core = core_aten_decompositions()
    core.pop(aten.select_backward.default, None)
    core.pop(aten.slice_backward.default, None)
    if attention_path == "torch":
        for op in FUSED_ATTENTION_FORWARD:
            core.pop(op, None)
    table = {
        **core,
        **get_decompositions(
            [
                aten._native_batch_norm_legit_functional,
                aten._native_batch_norm_legit,
                aten.native_batch_norm,
                aten.native_dropout,
            ]
        ),
        aten._safe_softmax.default: safe_softmax,
        aten.addmm.default: addmm,
        aten.avg_pool2d_backward.default: avg_pool2d_backward,
        aten.avg_pool3d_backward.default: avg_pool3d_backward,
        aten.max_pool3d_with_indices_backward.default: max_pool3d_with_indices_backward,
        aten._adaptive_avg_pool2d_backward.default: adaptive_avg_pool2d_backward,
        aten.adaptive_max_pool2d_backward.default: adaptive_max_pool2d_backward,
        aten._adaptive_avg_pool3d.default: adaptive_avg_pool3d,
        aten._adaptive_avg_pool3d_backward.default: adaptive_avg_pool3d_backward,
        aten.replication_pad1d_backward.default: replication_pad1d_backward,
        aten.replication_pad2d_backward.default: replication_pad2d_backward,
        aten.replication_pad3d_backward.default: replication_pad3d_backward,
        aten.reflection_pad2d_backward.default: reflection_pad2d_backward,
        aten.max_pool2d_with_indices_backward.default: max_pool2d_with_indices_backward,
        aten.grid_sampler_2d_backward.default: grid_sampler_2d_backward,
        aten._weight_norm_interface_backward.default: weight_norm_interface_backward,
        aten._trilinear.default: trilinear,
        aten._cdist_forward.default: cdist_forward,
        aten._cdist_backward.default: cdist_backward,
        aten.copy.default: copy,
        aten.pow.Tensor_Scalar: pow_tensor_scalar,
        aten.erfc.default: erfc,
        aten.special_erfcx.default: erfcx,
        aten.special_log_ndtr.default: log_ndtr,
        aten.convolution_backward.default: functools.partial(
            convolution_backward,
            weight_grad_path=conv_weight_grad,
            kernels=cpu_kernels,
            weight_kernel=cpu_kernels and conv_weight_kernel,
        ),
        aten._embedding_bag.default: embedding_bag,
        aten._embedding_bag_backward.default: embedding_bag_backward,
        aten.native_layer_norm.default: float64_layer_norm,
        **(_CPU_ONLY if device_type == "cpu" else {}),
        **(_CPU_KERNELS if device_type == "cpu" and cpu_kernels else {}),
    }
    if device_type == "cpu":
        table.pop(aten.embedding_dense_backward.default, None)
    return table


_CPU_KERNELS: dict[Any, Callable[..., Any]] = {
    aten.gelu_backward.default: gelu_backward,
    aten.silu_backward.default: silu_backward,
    aten.native_group_norm.default: group_norm,
    aten.native_group_norm_backward.default: group_norm_backward,
    aten.native_layer_norm_backward.default: layer_norm_backward,
}
"""The decompositions into lightning_ort's CPU kernels, for CPU graphs where the kernels are built."""

_CPU_ONLY: dict[Any, Callable[..., Any]] = {
    aten.index_put.default: index_put,
    aten._unsafe_index_put.default: index_put,
    aten.threshold_backward.default: threshold_backward,
    aten.hardtanh_backward.default: hardtanh_backward,
    aten._native_batch_norm_legit_functional.default: batch_norm_functional,
    aten.native_batch_norm_backward.default: batch_norm_backward,
}
