"""Layer norm's gradient as one ONNX Runtime kernel on CPU.

ONNX Runtime's public build has no layer-norm gradient, so the exported ``aten.native_layer_norm_backward`` is
PyTorch's decomposition: the centred and scaled input, two row sums, two column sums and the products between
them, about a dozen nodes, each a pass over the activation. On CPU, where lightning_ort's kernels are built,
:func:`layer_norm_backward` (the decomposition the capture uses for ``aten.native_layer_norm_backward``) records
:data:`LAYER_NORM_BACKWARD` instead, which the export translates to ``ai.lightning_ort::LayerNormGrad``
(``engine/runtime/layer_norm_kernels.cpp``): two passes over each row while it is in cache.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.fx
from torch.nn import functional as F

from lightning_ort.engine.fx.precision import computed_in_float32
from lightning_ort.engine.torch_internals import get_decompositions

aten = torch.ops.aten
_DECOMPOSED = get_decompositions([aten.native_layer_norm_backward])[aten.native_layer_norm_backward.default]
_DECOMPOSED_FORWARD = get_decompositions([aten.native_layer_norm])[aten.native_layer_norm.default]


@torch.library.custom_op("lightning_ort::layer_norm_backward", mutates_args=())
def layer_norm_backward_op(
    grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of a layer norm over ``input``'s last ``weight.dim()`` dimensions:
    ``(grad_input, grad_weight, grad_bias)``, from the forward's per-row ``mean`` and ``invstd``, as
    ``aten.native_layer_norm_backward`` computes them. ONNX Runtime runs it as ``ai.lightning_ort::LayerNormGrad``.

    Example:
        >>> x, w, b, g = torch.randn(4, 6), torch.rand(6), torch.randn(6), torch.randn(4, 6)
        >>> _, mean, invstd = aten.native_layer_norm(x, [6], w, b, 1e-5)
        >>> ours = layer_norm_backward_op(g, x, w, mean, invstd)
        >>> theirs = aten.native_layer_norm_backward(g, x, [6], mean, invstd, w, b, [True, True, True])
        >>> all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ours, theirs))
        True
    """
    grad_input, grad_weight, _ = aten.native_layer_norm_backward(
        grad_output, input, list(weight.shape), mean, invstd, weight, None, [True, True, False]
    )
    grad_bias = grad_output.sum(tuple(range(grad_output.dim() - weight.dim())), dtype=weight.dtype)
    return grad_input, grad_weight, grad_bias


@layer_norm_backward_op.register_fake
def _layer_norm_backward_fake(
    grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(input), torch.empty_like(weight), torch.empty_like(weight)


LAYER_NORM_BACKWARD = torch.ops.lightning_ort.layer_norm_backward.default
"""The op :func:`layer_norm_backward` records in captured graphs."""


def float64_layer_norm(
    input: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | object:
    """A float64 layer norm as reductions and elementwise ops (PyTorch's decomposition); ``NotImplemented`` for
    other dtypes, which stay one ``aten.native_layer_norm``.

    ONNX's ``LayerNormalization`` keeps the mean and inverse standard deviation it returns for the backward in
    its ``stash_type``, float32 as ``torch.onnx`` writes it, and ONNX Runtime has no kernel with a float64
    stash: a float64 model's layer-norm gradients would be float32-accurate (1e-8 relative) only.

    Example:
        >>> x, w, b = torch.randn(3, 5, dtype=torch.float64), torch.rand(5).double(), torch.randn(5).double()
        >>> ours = float64_layer_norm(x, [5], w, b, 1e-5)
        >>> all(torch.allclose(a, e) for a, e in zip(ours, aten.native_layer_norm(x, [5], w, b, 1e-5)))
        True
        >>> float64_layer_norm(x.float(), [5], w.float(), b.float(), 1e-5) is NotImplemented
        True
    """
    if input.dtype != torch.float64:
        return NotImplemented
    return _DECOMPOSED_FORWARD(input, normalized_shape, weight, bias, eps)


def layer_norm_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    normalized_shape: Sequence[int],
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    output_mask: Sequence[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``aten.native_layer_norm_backward`` for a CPU graph with lightning_ort's kernels: :data:`LAYER_NORM_BACKWARD`
    for operands computed in float32 (float32, ``bfloat16`` with a float32 or ``bfloat16`` weight) with a weight,
    PyTorch's own decomposition otherwise.

    Example:
        >>> x, w, b, g = torch.randn(3, 8), torch.rand(8), torch.randn(8), torch.randn(3, 8)
        >>> _, mean, rstd = aten.native_layer_norm(x, [8], w, b, 1e-5)
        >>> ours = layer_norm_backward(g, x, [8], mean, rstd, w, b, [True, True, True])
        >>> theirs = aten.native_layer_norm_backward(g, x, [8], mean, rstd, w, b, [True, True, True])
        >>> all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ours, theirs))
        True
    """
    if (
        weight is not None
        and list(weight.shape) == list(normalized_shape)
        and grad_output.dtype == input.dtype
        and computed_in_float32(input, weight)
        and grad_output.shape == input.shape
        and math.prod(normalized_shape) > 0
    ):
        grad_input, grad_weight, grad_bias = LAYER_NORM_BACKWARD(grad_output, input, weight, mean, rstd)
        return (
            grad_input if output_mask[0] else None,
            grad_weight if output_mask[1] else None,
            grad_bias if output_mask[2] and bias is not None else None,
        )
    return _DECOMPOSED(grad_output, input, normalized_shape, mean, rstd, weight, bias, output_mask)


def layer_norms(gm: torch.fx.GraphModule) -> int:
    """How many layer norms TorchDynamo's graph ``gm`` calls (whose gradient :func:`layer_norm_backward` may
    compute).

    Example:
        >>> layer_norms(torch.fx.symbolic_trace(lambda x, w: F.layer_norm(x, [4], w) + x))
        1
    """
    calls = (F.layer_norm, torch.layer_norm, aten.layer_norm.default, aten.native_layer_norm.default)
    return sum(node.op == "call_function" and node.target in calls for node in gm.graph.nodes)
