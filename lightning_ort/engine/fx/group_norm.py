"""Group norm in training, forward and gradient, as ONNX Runtime kernels on CPU.

``nn.GroupNorm`` (diffusion U-Nets, detection heads, small-batch vision) has no training kernel in ONNX Runtime's
public build: ``aten.native_group_norm`` exports as ``InstanceNormalization`` on a reshaped input, three means for
the statistics the backward reads and the affine nodes, and PyTorch's decomposition of
``aten.native_group_norm_backward`` as about twenty nodes (sums over positions and over channels and the products
between them), each a pass over the activation. On CPU, where lightning_ort's kernels are built, the capture's
decompositions :func:`group_norm` and :func:`group_norm_backward` record :data:`GROUP_NORM` and
:data:`GROUP_NORM_BACKWARD` instead, which the export translates to ``ai.lightning_ort::GroupNormTraining`` and
``GroupNormGrad`` (``engine/runtime/group_norm_kernels.cpp``): two passes each way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.nn import functional as F

from lightning_ort.engine.fx.precision import computed_in_float32, in_compute_dtype
from lightning_ort.engine.torch_internals import get_decompositions

aten = torch.ops.aten
_DECOMPOSED_BACKWARD = get_decompositions([aten.native_group_norm_backward])[aten.native_group_norm_backward.default]


def _image_sizes(input: torch.Tensor) -> tuple[Any, Any, Any]:
    """``N``, ``C`` and the positions per image of ``[N, C, spatial...]`` ``input``, as ``native_group_norm``
    takes them."""
    positions = 1
    for size in input.shape[2:]:
        positions = positions * size
    return input.shape[0], input.shape[1], positions


@torch.library.custom_op("lightning_ort::group_norm", mutates_args=())
def group_norm_op(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``F.group_norm`` in training with its statistics: ``(output, mean, rstd)``, mean and rstd ``[N, groups]``,
    as ``aten.native_group_norm`` computes them. ONNX Runtime runs it as ``ai.lightning_ort::GroupNormTraining``.

    Example:
        >>> x, w, b = torch.randn(2, 6, 4, 4), torch.rand(6), torch.randn(6)
        >>> out, mean, rstd = group_norm_op(x, w, b, 3, 1e-5)
        >>> torch.allclose(out, F.group_norm(x, 3, w, b), atol=1e-6), tuple(mean.shape)
        (True, (2, 3))
    """
    output, mean, rstd = aten.native_group_norm(
        *in_compute_dtype(input, weight, bias), *_image_sizes(input), groups, eps
    )
    return output.to(input.dtype), mean, rstd


@group_norm_op.register_fake
def _group_norm_fake(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    statistics = input.new_empty((input.shape[0], groups), dtype=torch.promote_types(input.dtype, torch.float32))
    return torch.empty_like(input), statistics, torch.empty_like(statistics)


@torch.library.custom_op("lightning_ort::group_norm_backward", mutates_args=())
def group_norm_backward_op(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    groups: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of a group norm: ``(grad_input, grad_weight, grad_bias)``, from the forward's per-(image,
    group) ``mean`` and ``rstd``, as ``aten.native_group_norm_backward`` computes them. ONNX Runtime runs it as
    ``ai.lightning_ort::GroupNormGrad``.

    Example:
        >>> x, w, b, g = torch.randn(2, 6, 4, 4), torch.rand(6), torch.randn(6), torch.randn(2, 6, 4, 4)
        >>> _, mean, rstd = group_norm_op(x, w, b, 3, 1e-5)
        >>> ours = group_norm_backward_op(g, x, w, mean, rstd, 3)
        >>> theirs = aten.native_group_norm_backward(g, x, mean, rstd, w, 2, 6, 16, 3, [True, True, True])
        >>> all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ours, theirs))
        True
    """
    sizes = _image_sizes(input)
    grad, x, scale = in_compute_dtype(grad_output, input, weight)
    grad_input, grad_weight, grad_bias = aten.native_group_norm_backward(
        grad, x, mean, rstd, scale, *sizes, groups, [True] * 3
    )
    return grad_input.to(input.dtype), grad_weight.to(weight.dtype), grad_bias.to(weight.dtype)


@group_norm_backward_op.register_fake
def _group_norm_backward_fake(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    groups: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(input), torch.empty_like(weight), torch.empty_like(weight)


GROUP_NORM = torch.ops.lightning_ort.group_norm.default
"""The op :func:`group_norm` records in captured graphs."""

GROUP_NORM_BACKWARD = torch.ops.lightning_ort.group_norm_backward.default
"""The op :func:`group_norm_backward` records in captured graphs."""


def _takes_kernels(input: torch.Tensor, *parameters: torch.Tensor | None) -> bool:
    """Whether a group norm over ``input`` with these (optional) parameters runs on the kernels: computed in
    float32 throughout (float32, or ``bfloat16`` under autocast), a weight and a bias, images of at least one
    position. ``bfloat16`` inputs are normalized in float32 and have float32 statistics."""
    return (
        input.dim() >= 2
        and all(p is not None and p.dim() == 1 for p in parameters)
        and computed_in_float32(input, *(p for p in parameters if p is not None))
    )


def group_norm(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    batch: Any,
    channels: Any,
    positions: Any,
    groups: int,
    eps: float,
) -> Any:
    """``aten.native_group_norm`` for a CPU graph with lightning_ort's kernels: :data:`GROUP_NORM` for a group norm
    with a weight and a bias, computed in float32; otherwise ``NotImplemented`` (the op stays, and its ONNX
    translation runs).

    Example:
        >>> x, w, b = torch.randn(2, 4, 3), torch.rand(4), torch.randn(4)
        >>> ours = group_norm(x, w, b, 2, 4, 3, 2, 1e-5)
        >>> theirs = aten.native_group_norm(x, w, b, 2, 4, 3, 2, 1e-5)
        >>> all(torch.allclose(a, e, atol=1e-6) for a, e in zip(ours, theirs))
        True
    """
    if not _takes_kernels(input, weight, bias):
        return NotImplemented
    assert weight is not None and bias is not None
    return GROUP_NORM(input, weight, bias, groups, eps)


def group_norm_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    batch: Any,
    channels: Any,
    positions: Any,
    groups: int,
    output_mask: Sequence[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``aten.native_group_norm_backward`` for a CPU graph with lightning_ort's kernels: :data:`GROUP_NORM_BACKWARD`
    for operands computed in float32 with a weight, PyTorch's own decomposition otherwise.

    Example:
        >>> x, w, b, g = torch.randn(2, 4, 3), torch.rand(4), torch.randn(4), torch.randn(2, 4, 3)
        >>> _, mean, rstd = aten.native_group_norm(x, w, b, 2, 4, 3, 2, 1e-5)
        >>> ours = group_norm_backward(g, x, mean, rstd, w, 2, 4, 3, 2, [True, True, True])
        >>> theirs = aten.native_group_norm_backward(g, x, mean, rstd, w, 2, 4, 3, 2, [True, True, True])
        >>> all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ours, theirs))
        True
    """
    if _takes_kernels(input, weight) and grad_output.dtype == input.dtype and grad_output.shape == input.shape:
        assert weight is not None
        grad_input, grad_weight, grad_bias = GROUP_NORM_BACKWARD(grad_output, input, weight, mean, rstd, groups)
        return (
            grad_input if output_mask[0] else None,
            grad_weight if output_mask[1] else None,
            grad_bias if output_mask[2] else None,
        )
    return _DECOMPOSED_BACKWARD(grad_output, input, mean, rstd, weight, batch, channels, positions, groups, output_mask)


def group_norms(gm: torch.fx.GraphModule) -> int:
    """How many group norms TorchDynamo's graph ``gm`` calls (which :func:`group_norm` may compute).

    Example:
        >>> group_norms(torch.fx.symbolic_trace(lambda x, w, b: F.group_norm(x, 2, w, b) + x))
        1
    """
    calls = (F.group_norm, torch.group_norm, aten.group_norm.default, aten.native_group_norm.default)
    return sum(node.op == "call_function" and node.target in calls for node in gm.graph.nodes)
