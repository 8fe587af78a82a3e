"""A 3x3 convolution's weight gradient on large images, in lightning_ort's CPU kernel.

On images of more than :data:`~lightning_ort.engine.fx.decompositions.SELECTION_POSITIONS` positions the weight
gradient's graph forms unfold the input nine times over, slower than PyTorch's kernel (oneDNN), which
``conv_weight_grad="auto"`` then runs after the backward graph. For dense 3x3 layers with stride 1 or 2 and
padding 1, :data:`CONV3X3_WEIGHT_GRAD` computes the gradient inside the graph instead, faster than oneDNN's:
lightning_ort's ``ai.lightning_ort::ConvWeightGrad3x3`` kernel (``engine/runtime/conv_kernels.cpp``) reads the
layer's input as it is and its output's gradient in the NCHWc layout of ONNX Runtime's convolutions (the blocked
copy the input gradient's convolution reads already) and sums each tap's outer products in registers, without
unfolding or transposing. The performance page has the measurements behind
:func:`weight_grad_kernel_applies`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx
from torch.nn import functional as F

aten = torch.ops.aten


@torch.library.custom_op("lightning_ort::conv3x3_weight_grad", mutates_args=())
def conv3x3_weight_grad_op(input: torch.Tensor, grad_output: torch.Tensor, stride: int) -> torch.Tensor:
    """The weight gradient ``[O, C, 3, 3]`` of a 3x3 convolution with padding 1 and ``stride`` (both dims) of
    ``input`` (``[N, C, H, W]``), whose output's gradient is ``grad_output`` (``[N, O, H', W']``). ONNX Runtime
    runs it as ``ai.lightning_ort::ConvWeightGrad3x3``.

    Example:
        >>> x, w = torch.randn(2, 16, 5, 5), torch.randn(32, 16, 3, 3)
        >>> gy = torch.randn(2, 32, 3, 3)
        >>> ref = aten.convolution_backward(gy, x, w, None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1,
        ...                                 [False, True, False])[1]
        >>> torch.allclose(conv3x3_weight_grad_op(x, gy, 2), ref)
        True
    """
    weight = input.new_empty(grad_output.shape[1], input.shape[1], 3, 3)
    only_weight = [False, True, False]
    return aten.convolution_backward(
        grad_output, input, weight, None, [stride] * 2, [1, 1], [1, 1], False, [0, 0], 1, only_weight
    )[1]


@conv3x3_weight_grad_op.register_fake
def _conv3x3_weight_grad_fake(input: torch.Tensor, grad_output: torch.Tensor, stride: int) -> torch.Tensor:
    return input.new_empty(grad_output.shape[1], input.shape[1], 3, 3)


CONV3X3_WEIGHT_GRAD = torch.ops.lightning_ort.conv3x3_weight_grad.default
"""The op the convolution's decomposition records where :func:`weight_grad_kernel_applies`."""


def weight_grad_kernel_applies(
    input: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> bool:
    """Whether the kernel can compute this convolution's weight gradient: a dense float32 3x3 convolution on the
    CPU with stride 1 or 2 (both dims), padding 1 and no dilation, static sizes, input channels a multiple of 8
    and output channels of 32 (its register tile), on a CPU with AVX-512 (where ONNX Runtime's NCHWc block, in
    which it reads the output gradient, is 16 channels). The convolution's decomposition asks only for layers
    whose weight gradient would otherwise go to PyTorch's kernel (images of more than
    :data:`~lightning_ort.engine.fx.decompositions.SELECTION_POSITIONS` positions).

    Example:
        >>> w = torch.randn(32, 16, 3, 3)
        >>> applies = weight_grad_kernel_applies(torch.randn(2, 16, 32, 32), w, [2, 2], [1, 1], [1, 1], 1)
        >>> applies == (torch.backends.cpu.get_cpu_capability() == "AVX512")
        True
        >>> weight_grad_kernel_applies(torch.randn(2, 4, 32, 32), torch.randn(32, 4, 3, 3), [1, 1], [1, 1], [1, 1], 1)
        False
    """
    if input.device.type != "cpu" or input.dtype != torch.float32 or input.dim() != 4 or groups != 1:
        return False
    shape = (*input.shape, *weight.shape)
    if not all(isinstance(size, int) for size in shape):
        return False
    if list(weight.shape[2:]) != [3, 3] or list(stride) not in ([1, 1], [2, 2]):
        return False
    if any(list(v) != [1, 1] for v in (padding, dilation)):
        return False
    if input.shape[1] % 8 or weight.shape[0] % 32:
        return False
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def kernel_weight_grads(gm: torch.fx.GraphModule) -> int:
    """How many 2-D convolutions of TorchDynamo's graph ``gm`` have a weight gradient the kernel computes, by
    their recorded example values.

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x, w: torch.conv2d(x, w, None, 1, 1))
        >>> kernel_weight_grads(gm)  # a trace without example values counts nothing
        0
    """
    count = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in (torch.conv2d, F.conv2d) or len(node.args) < 2:
            continue
        input, weight = (_example(arg) for arg in node.args[:2])
        if input is None or weight is None:
            continue
        stride, padding, dilation, groups = (
            node.kwargs.get(name, node.args[index] if len(node.args) > index else default)
            for index, name, default in ((3, "stride", 1), (4, "padding", 0), (5, "dilation", 1), (6, "groups", 1))
        )
        if any(isinstance(value, str) for value in (stride, padding, dilation)):
            continue  # padding="same" or "valid": not the kernel's padding of 1
        pairs = [list(v) if isinstance(v, (list, tuple)) else [v, v] for v in (stride, padding, dilation)]
        strides, paddings, dilations = pairs
        count += weight_grad_kernel_applies(input, weight, strides, paddings, dilations, groups)
    return count


def _example(arg: object) -> torch.Tensor | None:
    value = arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None
