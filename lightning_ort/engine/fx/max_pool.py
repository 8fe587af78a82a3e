"""2-D max pooling whose forward pools values only and whose backward finds each window's maximum again, on CPU.

ATen's ``max_pool2d_with_indices`` exports as ONNX Runtime's ``MaxPool`` with its ``Indices`` output, which runs
on a generic loop far slower than the values-only kernel (MLAS's; see the performance page), plus a second
pooling of the whole input that turns ONNX's indices into PyTorch's. :func:`replace_max_pools` points TorchDynamo's
``F.max_pool2d`` calls (float32 or ``bfloat16``, CPU, 4-d, no ``ceil_mode``, no indices returned) at
:func:`max_pool2d`: an autograd function over two PyTorch ops, :data:`MAX_POOL2D` (``MaxPool`` without indices) and
:data:`MAX_POOL2D_BACKWARD`, which runs as lightning_ort's ``ai.lightning_ort::MaxPoolGrad`` kernel
(``engine/runtime/max_pool_kernels.cpp``): it finds each window's maximum in the saved input as PyTorch's CPU
kernel does (the first largest value, or the last NaN) and adds the gradient there.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.nn import functional as F

from lightning_ort.engine.fx.precision import computed_in_float32

aten = torch.ops.aten


@torch.library.custom_op("lightning_ort::max_pool2d", mutates_args=())
def max_pool2d_op(
    input: torch.Tensor, kernel_size: list[int], stride: list[int], padding: list[int], dilation: list[int]
) -> torch.Tensor:
    """``F.max_pool2d(input, kernel_size, stride, padding, dilation)``: the values alone, as one ONNX ``MaxPool``.

    Example:
        >>> x = torch.randn(2, 3, 8, 8)
        >>> torch.equal(max_pool2d_op(x, [3, 3], [2, 2], [1, 1], [1, 1]), F.max_pool2d(x, 3, 2, 1))
        True
    """
    return aten.max_pool2d_with_indices(input, kernel_size, stride, padding, dilation, False)[0]


@max_pool2d_op.register_fake
def _max_pool2d_fake(
    input: torch.Tensor, kernel_size: list[int], stride: list[int], padding: list[int], dilation: list[int]
) -> torch.Tensor:
    return aten.max_pool2d_with_indices(input, kernel_size, stride, padding, dilation, False)[0]


@torch.library.custom_op("lightning_ort::max_pool2d_backward", mutates_args=())
def max_pool2d_backward_op(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
) -> torch.Tensor:
    """The gradient of :func:`max_pool2d_op` with respect to ``input``, each window's maximum found again in it.

    ONNX Runtime runs it as ``ai.lightning_ort::MaxPoolGrad``.

    Example:
        >>> x, g = torch.randn(2, 3, 8, 8, requires_grad=True), torch.randn(2, 3, 4, 4)
        >>> F.max_pool2d(x, 3, 2, 1).backward(g)
        >>> torch.equal(max_pool2d_backward_op(g, x.detach(), [3, 3], [2, 2], [1, 1], [1, 1]), x.grad)
        True
    """
    _, indices = aten.max_pool2d_with_indices(input, kernel_size, stride, padding, dilation, False)
    return aten.max_pool2d_with_indices_backward(
        grad_output, input, kernel_size, stride, padding, dilation, False, indices
    )


@max_pool2d_backward_op.register_fake
def _max_pool2d_backward_fake(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
) -> torch.Tensor:
    return torch.empty_like(input)


MAX_POOL2D = torch.ops.lightning_ort.max_pool2d.default
"""The forward op :func:`max_pool2d` records in captured graphs."""

MAX_POOL2D_BACKWARD = torch.ops.lightning_ort.max_pool2d_backward.default
"""The backward op :func:`max_pool2d` records in captured graphs."""


Window = tuple[list[int], list[int], list[int], list[int]]
"""A pooling window as the ops take it: kernel size, stride, padding and dilation, each a pair."""


class _MaxPool2d(torch.autograd.Function):
    """:data:`MAX_POOL2D` forward, :data:`MAX_POOL2D_BACKWARD` backward (which reads the saved input)."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, window: Window) -> Any:
        ctx.window = window
        ctx.save_for_backward(input)
        return MAX_POOL2D(input, *window)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        (input,) = ctx.saved_tensors
        return MAX_POOL2D_BACKWARD(grad_output, input, *ctx.window), None


def max_pool2d(
    input: torch.Tensor, kernel_size: list[int], stride: list[int], padding: list[int], dilation: list[int]
) -> torch.Tensor:
    """``F.max_pool2d(input, kernel_size, stride, padding, dilation)`` as the two ops above (each argument a
    pair).

    Example:
        >>> x = torch.randn(1, 2, 6, 6)
        >>> torch.equal(max_pool2d(x, [2, 2], [2, 2], [0, 0], [1, 1]), F.max_pool2d(x, 2))
        True
    """
    return _MaxPool2d.apply(input, (kernel_size, stride, padding, dilation))


_MAX_POOL2D_SIGNATURE = inspect.signature(F.max_pool2d_with_indices)  # F.max_pool2d's, whichever it dispatches to


def _pair(value: Any) -> list[int] | None:
    """``value`` as a pair of ints (an int, or a sequence of one or two), or ``None``."""
    values = [value] if isinstance(value, int) else list(value) if isinstance(value, Sequence) else None
    if values is None or not 1 <= len(values) <= 2 or any(type(v) is not int for v in values):
        return None
    return values * 2 if len(values) == 1 else values


def _window(node: torch.fx.Node) -> tuple[torch.fx.Node, Window] | None:
    """The input and window of the ``F.max_pool2d`` call at ``node`` where the ops compute it: a 4-d CPU input
    computed in float32 (float32, ``bfloat16``), constant sizes, no ``ceil_mode`` and no indices returned."""
    if node.op != "call_function" or node.target is not F.max_pool2d:
        return None
    try:
        bound = _MAX_POOL2D_SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    arguments = bound.arguments
    if arguments["ceil_mode"] is not False or arguments["return_indices"] is not False:
        return None
    input = arguments["input"]
    value = input.meta.get("example_value") if isinstance(input, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() != 4 or not computed_in_float32(value):
        return None
    if value.device.type != "cpu":
        return None
    stride = arguments["stride"] if arguments["stride"] not in (None, []) else arguments["kernel_size"]
    kernel, strides, padding, dilation = (
        _pair(v) for v in (arguments["kernel_size"], stride, arguments["padding"], arguments["dilation"])
    )
    if kernel is None or strides is None or padding is None or dilation is None:
        return None
    return input, (kernel, strides, padding, dilation)


def replaceable_max_pools(gm: torch.fx.GraphModule) -> int:
    """How many ``F.max_pool2d`` calls of TorchDynamo's graph ``gm`` :func:`replace_max_pools` would replace."""
    return sum(_window(node) is not None for node in gm.graph.nodes)


def replace_max_pools(gm: torch.fx.GraphModule) -> int:
    """Point ``gm``'s ``F.max_pool2d`` calls (float32 or ``bfloat16``, on CPU, 4-d, no ``ceil_mode``, values only) at
    :func:`max_pool2d`; returns the calls replaced.

    Example:
        >>> graph = torch.fx.Graph()
        >>> x = graph.placeholder("x")
        >>> x.meta["example_value"] = torch.empty(2, 3, 8, 8)
        >>> _ = graph.output(graph.call_function(F.max_pool2d, (x, 3, 2, 1)))
        >>> gm = torch.fx.GraphModule(torch.nn.Module(), graph)
        >>> replace_max_pools(gm), [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"]
        (1, ['max_pool2d'])
    """
    replaced = 0
    for node in list(gm.graph.nodes):
        found = _window(node)
        if found is None:
            continue
        input, window = found
        with gm.graph.inserting_after(node):
            pooled = gm.graph.call_function(max_pool2d, (input, *window))
        pooled.meta = dict(node.meta)
        node.replace_all_uses_with(pooled)
        gm.graph.erase_node(node)
        replaced += 1
    if replaced:
        gm.recompile()
    return replaced
