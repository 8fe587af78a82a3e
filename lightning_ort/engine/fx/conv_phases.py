"""The input gradient of a stride-2 convolution as four stride-1 convolutions, one per output phase, on CPU.

The input gradient of a convolution with stride 2 is a transposed convolution, which ONNX Runtime's CPU kernel
computes by scattering columns onto the image, well behind its NCHWc ``Conv`` for the same products (see the
performance page). Split by the parity of the gradient's row and column, each of its four phases is an ordinary
stride-1 convolution of the output gradient with the kernel taps that reach that phase: for a 3x3 kernel with
padding 1, one tap for the even rows and columns, 1x2 and 2x1 for the mixed ones, 2x2 for the odd ones, nine in
all, as many products as the forward. :func:`phase_input_grad` builds those four convolutions from ATen ops, which
run on ONNX Runtime's NCHWc kernels (sharing one blocked copy of the output gradient), and :data:`INTERLEAVE_2X2`
weaves their results into the image: lightning_ort's ``ai.lightning_ort::Interleave2x2`` kernel
(``engine/runtime/conv_kernels.cpp``), a single pass over the gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.nn import functional as F

from lightning_ort.engine.fx.precision import computed_in_float32

aten = torch.ops.aten


@torch.library.custom_op("lightning_ort::interleave_2x2", mutates_args=())
def interleave_2x2_op(
    even_even: torch.Tensor,
    even_odd: torch.Tensor,
    odd_even: torch.Tensor,
    odd_odd: torch.Tensor,
    height: int,
    width: int,
) -> torch.Tensor:
    """The ``[N, C, height, width]`` image whose rows and columns of parity (a, b) are the top-left part of the
    (a, b) phase: ``out[..., 2u + a, 2v + b] = phase_ab[..., u, v]``.

    Each phase ``[N, C, rows, cols]`` covers at least its share of the image (``rows >= (height - a + 1) // 2``,
    ``cols >= (width - b + 1) // 2``); whatever lies beyond is not read. ONNX Runtime runs it as
    ``ai.lightning_ort::Interleave2x2``.

    Example:
        >>> image = torch.arange(2 * 3 * 6 * 5.0).reshape(2, 3, 6, 5)
        >>> phases = [image[..., a::2, b::2] for a in (0, 1) for b in (0, 1)]
        >>> torch.equal(interleave_2x2_op(*phases, 6, 5), image)
        True
    """
    batch, channels = even_even.shape[:2]
    out = even_even.new_empty(batch, channels, height, width)
    for index, phase in enumerate((even_even, even_odd, odd_even, odd_odd)):
        row, column = divmod(index, 2)
        rows, cols = (height - row + 1) // 2, (width - column + 1) // 2
        out[..., row::2, column::2] = phase[..., :rows, :cols]
    return out


@interleave_2x2_op.register_fake
def _interleave_2x2_fake(
    even_even: torch.Tensor,
    even_odd: torch.Tensor,
    odd_even: torch.Tensor,
    odd_odd: torch.Tensor,
    height: int,
    width: int,
) -> torch.Tensor:
    return even_even.new_empty(even_even.shape[0], even_even.shape[1], height, width)


def _interleave_2x2_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.shapes = [phase.shape for phase in inputs[:4]]


def _interleave_2x2_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    """Each phase's gradient: its rows and columns of ``grad``, zero where the phase reaches past the image."""
    grads = []
    for index, shape in enumerate(ctx.shapes):
        row, column = divmod(index, 2)
        part = grad[..., row::2, column::2]
        grads.append(F.pad(part, (0, shape[3] - part.shape[3], 0, shape[2] - part.shape[2])))
    return (*grads, None, None)


interleave_2x2_op.register_autograd(_interleave_2x2_backward, setup_context=_interleave_2x2_setup)

INTERLEAVE_2X2 = torch.ops.lightning_ort.interleave_2x2.default
"""The op :func:`phase_input_grad` records in captured graphs."""


def _phase_taps(kernel: int, padding: int) -> list[list[int]] | None:
    """Per phase (even, odd) along one axis, the kernel taps that reach it in the order a stride-1 convolution of
    the output gradient reads them; ``None`` where a phase has no tap or needs the gradient padded in front.

    Input position ``2u + r`` receives output position ``u + d`` through tap ``r + padding - 2d``; the taps of
    phase ``r`` are those of ``d = 0, 1, ...`` that fall inside the kernel.

    Example:
        >>> _phase_taps(3, 1), _phase_taps(2, 0), _phase_taps(1, 0)
        ([[1], [2, 0]], [[0], [1]], None)
    """
    phases = []
    for phase in (0, 1):
        first = phase + padding  # the tap of d = 0
        if first >= kernel or first + 2 < kernel:  # no tap at d = 0, or one at d = -1
            return None
        phases.append(list(range(first, -1, -2)))
    return phases


def phase_input_grad(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> torch.Tensor | None:
    """The input gradient of a dense or depthwise 2-D stride-2 convolution as four stride-1 convolutions and
    :data:`INTERLEAVE_2X2`, or ``None`` where that form does not apply.

    It applies to CPU convolutions computed in float32 (float32, ``bfloat16``) with stride 2x2, no dilation, one
    group or one per channel (depthwise, one output channel each), static image sizes and kernels whose every
    phase has taps that start at the first output position (3x3 with padding 1, 2x2 with none, and the like); the
    rest take the transposed convolution. A depthwise layer's phases are depthwise convolutions with its own
    kernel's taps.

    Example:
        >>> x, w = torch.randn(2, 4, 8, 6), torch.randn(5, 4, 3, 3)
        >>> gy = torch.randn(2, 5, 4, 3)
        >>> ours = phase_input_grad(gy, x, w, [2, 2], [1, 1], [1, 1], 1)
        >>> ref = aten.convolution_backward(gy, x, w, None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1,
        ...                                 [True, False, False])[0]
        >>> torch.allclose(ours, ref, atol=1e-5)
        True
    """
    depthwise = groups > 1 and groups == input.shape[1] == weight.shape[0] and weight.shape[1] == 1
    if list(stride) != [2, 2] or list(dilation) != [1, 1] or (groups != 1 and not depthwise) or input.dim() != 4:
        return None
    if input.device.type != "cpu" or not computed_in_float32(input, weight, grad_output):
        return None
    height, width = input.shape[2], input.shape[3]
    out_height, out_width = grad_output.shape[2], grad_output.shape[3]
    if not all(isinstance(size, int) for size in (height, width, out_height, out_width)):
        return None
    taps_h, taps_w = _phase_taps(weight.shape[2], padding[0]), _phase_taps(weight.shape[3], padding[1])
    if taps_h is None or taps_w is None:
        return None
    end_h = max(0, *((height - row + 1) // 2 - out_height + len(taps) - 1 for row, taps in enumerate(taps_h)))
    end_w = max(0, *((width - col + 1) // 2 - out_width + len(taps) - 1 for col, taps in enumerate(taps_w)))
    padded = aten.constant_pad_nd(grad_output, [0, end_w, 0, end_h], 0.0) if end_h or end_w else grad_output
    source = weight if depthwise else weight.transpose(0, 1)
    phases = []
    for rows in taps_h:
        by_row = aten.index_select(source, 2, _taps(rows, weight.device))
        for cols in taps_w:
            kernel = aten.index_select(by_row, 3, _taps(cols, weight.device))
            phases.append(aten.convolution(padded, kernel, None, [1, 1], [0, 0], [1, 1], False, [0, 0], groups))
    return INTERLEAVE_2X2(*phases, height, width)


def _taps(taps: list[int], device: torch.device) -> torch.Tensor:
    """``taps`` (every other tap, descending, as :func:`_phase_taps` gives them) as an index tensor, built by
    ``arange`` so that the traced graph stays functional."""
    return torch.arange(taps[0], taps[-1] - 1, -2, device=device)


def strided_convolutions(gm: torch.fx.GraphModule) -> int:
    """How many 2-D convolutions of TorchDynamo's graph ``gm`` have a stride of 2 (whose input gradient
    :func:`phase_input_grad` may compute).

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x, w: torch.conv2d(torch.conv2d(x, w, None, 2), w, None, 1))
        >>> strided_convolutions(gm)
        1
    """
    count = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in (torch.conv2d, F.conv2d):
            continue
        stride = node.kwargs.get("stride", node.args[3] if len(node.args) > 3 else 1)
        count += stride in (2, (2, 2), [2, 2])
    return count
