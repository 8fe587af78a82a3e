"""SiLU's gradient as one ONNX Runtime kernel on CPU.

ONNX Runtime's public build has no SiLU (swish) gradient, so the exported ``aten.silu_backward`` is PyTorch's
decomposition: a ``Sigmoid`` and five products and sums around it, each a full pass over the activation (ONNX
Runtime already fuses the forward, ``x * sigmoid(x)``, into its ``QuickGelu`` kernel). On CPU, where
lightning_ort's kernels are built, :func:`silu_backward` (the decomposition the capture uses for
``aten.silu_backward``) records :data:`SILU_BACKWARD` instead, which the export translates to
``ai.lightning_ort::SiluGrad`` (``engine/runtime/activation_kernels.cpp``): one pass. SiLU is the activation of
EfficientNet, MobileNetV3's later blocks (as hard-swish's smooth form), diffusion U-Nets and Llama's MLPs.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.nn import functional as F

from lightning_ort.engine.fx.precision import computed_in_float32
from lightning_ort.engine.torch_internals import get_decompositions

aten = torch.ops.aten
_DECOMPOSED = get_decompositions([aten.silu_backward])[aten.silu_backward.default]


@torch.library.custom_op("lightning_ort::silu_backward", mutates_args=())
def silu_backward_op(grad_output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """``grad_output`` times the derivative of ``F.silu(input)``, as ``aten.silu_backward`` computes it. ONNX
    Runtime runs it as ``ai.lightning_ort::SiluGrad``.

    Example:
        >>> x, g = torch.randn(4, 6), torch.randn(4, 6)
        >>> torch.equal(silu_backward_op(g, x), aten.silu_backward(g, x))
        True
    """
    return aten.silu_backward(grad_output, input)


@silu_backward_op.register_fake
def _silu_backward_fake(grad_output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(input)


SILU_BACKWARD = torch.ops.lightning_ort.silu_backward.default
"""The op :func:`silu_backward` records in captured graphs."""


def silu_backward(grad_output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """``aten.silu_backward`` for a CPU graph with lightning_ort's kernels: :data:`SILU_BACKWARD` for operands of
    one shape and one dtype computed in float32 (float32, ``bfloat16``), PyTorch's own decomposition otherwise.

    Example:
        >>> x, g = torch.randn(3, 5), torch.randn(3, 5)
        >>> torch.allclose(silu_backward(g, x), aten.silu_backward(g, x), atol=1e-6)
        True
    """
    if grad_output.dtype == input.dtype and computed_in_float32(input) and grad_output.shape == input.shape:
        return SILU_BACKWARD(grad_output, input)
    return _DECOMPOSED(grad_output, input)


def silus(gm: torch.fx.GraphModule) -> int:
    """How many SiLUs TorchDynamo's graph ``gm`` calls (whose gradient :func:`silu_backward` may compute).

    Example:
        >>> silus(torch.fx.symbolic_trace(lambda x: F.silu(F.silu(x)) + x))
        2
    """
    calls = (F.silu, aten.silu.default)
    return sum(node.op == "call_function" and node.target in calls for node in gm.graph.nodes)
