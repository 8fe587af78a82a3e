"""GELU's gradient as one ONNX Runtime kernel on CPU.

ONNX Runtime's public build has no GELU gradient, so the exported ``aten.gelu_backward`` is PyTorch's
decomposition: ``Erf``, ``Exp`` and about eight products and sums around them, each a full pass over the
activation. On CPU, where lightning_ort's kernels are built, :func:`gelu_backward` (the decomposition the capture
uses for ``aten.gelu_backward``) records :data:`GELU_BACKWARD` instead, which the export translates to
``ai.lightning_ort::GeluGrad`` (``engine/runtime/activation_kernels.cpp``): one pass, for the exact GELU and its
tanh approximation.

A GELU that a model writes out in elementwise ops (Hugging Face's ``gelu_new``) reaches this kernel through
:func:`lightning_ort.engine.fx.activations.fold_activations`, which calls ``F.gelu`` in its place.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.nn import functional as F

from lightning_ort.engine.fx.precision import computed_in_float32
from lightning_ort.engine.torch_internals import get_decompositions

aten = torch.ops.aten
_DECOMPOSED = get_decompositions([aten.gelu_backward])[aten.gelu_backward.default]

APPROXIMATIONS = ("none", "tanh")
"""The ``approximate`` arguments of ``F.gelu``, in the order of ``GeluGrad``'s ``approximate`` attribute."""


@torch.library.custom_op("lightning_ort::gelu_backward", mutates_args=())
def gelu_backward_op(grad_output: torch.Tensor, input: torch.Tensor, approximate: str) -> torch.Tensor:
    """``grad_output`` times the derivative of ``F.gelu(input, approximate=approximate)``, as
    ``aten.gelu_backward`` computes it. ONNX Runtime runs it as ``ai.lightning_ort::GeluGrad``.

    Example:
        >>> x, g = torch.randn(4, 6), torch.randn(4, 6)
        >>> torch.equal(gelu_backward_op(g, x, "tanh"), aten.gelu_backward(g, x, approximate="tanh"))
        True
    """
    return aten.gelu_backward(grad_output, input, approximate=approximate)


@gelu_backward_op.register_fake
def _gelu_backward_fake(grad_output: torch.Tensor, input: torch.Tensor, approximate: str) -> torch.Tensor:
    return torch.empty_like(input)


GELU_BACKWARD = torch.ops.lightning_ort.gelu_backward.default
"""The op :func:`gelu_backward` records in captured graphs."""


def gelu_backward(grad_output: torch.Tensor, input: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``aten.gelu_backward`` for a CPU graph with lightning_ort's kernels: :data:`GELU_BACKWARD` for operands of
    one shape and one dtype computed in float32 (float32, ``bfloat16``), PyTorch's own decomposition otherwise.

    Example:
        >>> x, g = torch.randn(3, 5), torch.randn(3, 5)
        >>> torch.allclose(gelu_backward(g, x), aten.gelu_backward(g, x), atol=1e-6)
        True
    """
    if (
        grad_output.dtype == input.dtype
        and computed_in_float32(input)
        and grad_output.shape == input.shape
        and approximate in APPROXIMATIONS
    ):
        return GELU_BACKWARD(grad_output, input, approximate)
    return _DECOMPOSED(grad_output, input, approximate=approximate)


def gelus(gm: torch.fx.GraphModule) -> int:
    """How many GELUs TorchDynamo's graph ``gm`` calls (whose gradient :func:`gelu_backward` may compute).

    Example:
        >>> gelus(torch.fx.symbolic_trace(lambda x: F.gelu(F.gelu(x), approximate="tanh") + x))
        2
    """
    calls = (F.gelu, aten.gelu.default)
    return sum(
        (node.op == "call_function" and node.target in calls) or (node.op == "call_method" and node.target == "gelu")
        for node in gm.graph.nodes
    )
