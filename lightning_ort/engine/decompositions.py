"""ATen decompositions applied while capturing, so every op in the graphs has an ONNX translation.

Core ATen decompositions, plus:

* training-mode batch norm as plain reductions: ONNX Runtime's inference build only has
  ``BatchNormalization`` with running statistics;
* ``aten.convolution_backward`` (no ONNX translation) as a transposed convolution for the input gradient,
  a convolution for the weight gradient and a sum for the bias gradient;
* ``nn.EmbeddingBag`` (sum/mean) forward and backward as gathers and ``index_add``: the exporter's translation
  of ``_embedding_bag`` does not reproduce the auxiliary outputs its backward needs, and the backward op has
  no translation at all.

SDPA's fused backward ops are avoided at capture time instead (see :mod:`lightning_ort.engine.capture`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._decomp import core_aten_decompositions, get_decompositions

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
) -> Any:
    """Gradients of a (non-transposed) N-d convolution expressed with forward convolutions.

    Example:
        >>> x, w = torch.randn(2, 4, 7), torch.randn(6, 2, 3)
        >>> gy = torch.randn(2, 6, 4)
        >>> ours = convolution_backward(gy, x, w, [6], [2], [1], [1], False, [0], 2, [True, True, True])
        >>> ref = aten.convolution_backward(gy, x, w, [6], [2], [1], [1], False, [0], 2, [True, True, True])
        >>> all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ours, ref))
        True
    """
    if transposed:
        return NotImplemented
    spatial = len(stride)
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        kernel = weight.shape[2:]
        out_size = grad_output.shape[2:]
        adjust = [
            input.shape[2 + i] - ((out_size[i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (kernel[i] - 1) + 1)
            for i in range(spatial)
        ]
        grad_input = aten.convolution(grad_output, weight, None, stride, padding, dilation, True, adjust, groups)
    if output_mask[1]:
        grad_weight = _weight_grad(grad_output, input, weight, stride, padding, dilation, groups)
    if output_mask[2]:
        grad_bias = grad_output.sum(dim=[0, *range(2, 2 + spatial)])
    return grad_input, grad_weight, grad_bias


def _weight_grad(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> torch.Tensor:
    # Correlate input channels with output-gradient channels over the batch: a convolution whose stride is
    # the forward dilation and whose dilation is the forward stride.
    batch = input.shape[0]
    out_channels, in_per_group = weight.shape[0], weight.shape[1]
    out_per_group = out_channels // groups
    spatial_in, spatial_out = input.shape[2:], grad_output.shape[2:]
    kernel = weight.shape[2:]
    if groups == 1:
        grad = aten.convolution(
            input.transpose(0, 1),
            grad_output.transpose(0, 1),
            None,
            dilation,
            padding,
            stride,
            False,
            [0] * len(stride),
            1,
        ).transpose(0, 1)
    else:
        x = input.reshape(batch, groups, in_per_group, *spatial_in).movedim(2, 0)
        x = x.reshape(in_per_group, batch * groups, *spatial_in)
        gy = grad_output.reshape(batch * groups * out_per_group, 1, *spatial_out)
        grad = aten.convolution(x, gy, None, dilation, padding, stride, False, [0] * len(stride), batch * groups)
        full_kernel = grad.shape[2:]
        grad = grad.reshape(in_per_group, batch, groups, out_per_group, *full_kernel).sum(1)
        grad = grad.movedim(0, 2).reshape(out_channels, in_per_group, *full_kernel)
    for dim, size in enumerate(kernel):
        grad = grad.narrow(2 + dim, 0, size)
    return grad


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


def capture_decompositions() -> dict[Any, Callable[..., Any]]:
    """The decomposition table passed to AOTAutograd.

    ``select_backward`` stays whole so that :mod:`lightning_ort.engine.rewrites` can turn sums of them into
    one ``stack``; the ONNX exporter decomposes any that remain.
    """
    core = core_aten_decompositions()
    core.pop(aten.select_backward.default, None)
    return {
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
        aten.convolution_backward.default: convolution_backward,
        aten._embedding_bag.default: embedding_bag,
        aten._embedding_bag_backward.default: embedding_bag_backward,
    }
