"""Channels-last operands for the weight gradients that PyTorch computes beside the backward graph.

On CPU, ``conv_weight_grad="auto"`` leaves the weight gradient of a dense convolution on large images to oneDNN:
an ``aten.convolution_backward`` asking for that gradient alone, which runs in PyTorch after the ONNX Runtime
partition that computes its output gradient (see
:func:`~lightning_ort.engine.fx.decompositions.weight_grad_in_torch`). Given NCHW operands, oneDNN first copies
both into its blocked layout; given channels-last (NHWC) ones it reads them as they are, and the gradient takes
about two thirds of the time. ONNX Runtime already holds both operands in its own blocked layout (NCHWc, for the
forward convolution and for the input gradient's), from which one ``ReorderOutput`` writes channels-last (see
:func:`~lightning_ort.engine.onnx.passes.fold_channels_last_transposes`).

:func:`channels_last_weight_grad_operands` therefore rewrites the partitioned graphs so that each such gradient
reads channels-last tensors through permuted views, which cost nothing in PyTorch:

* the layer's input, where the forward graph saves it, is saved as a channels-last copy (instead of the NCHW
  tensor, or beside it where the backward graph reads that too);
* the output gradient, and an input that the backward graph computes itself, leave the backward graph's ONNX
  Runtime partition as channels-last copies.

The gradient is then made row-major again, the weight's own layout (a weight-sized copy).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx

from lightning_ort.engine.torch_internals import detect_fake_mode

aten = torch.ops.aten

TO_CHANNELS_LAST = [0, 2, 3, 1]
"""The permutation that makes an NCHW tensor's dimensions NHWC."""
FROM_CHANNELS_LAST = [0, 3, 1, 2]
"""The permutation that views an NHWC tensor as NCHW (with channels-last strides)."""


def is_weight_grad_request(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a non-transposed ``aten.convolution_backward`` asking for the weight gradient alone,
    the form :func:`~lightning_ort.engine.fx.decompositions.convolution_backward` leaves to PyTorch's kernel.

    Example:
        >>> graph = torch.fx.Graph()
        >>> x, gy, w = graph.placeholder("x"), graph.placeholder("gy"), graph.placeholder("w")
        >>> args = (gy, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, False])
        >>> is_weight_grad_request(graph.call_function(aten.convolution_backward.default, args))
        True
    """
    return (
        node.op == "call_function"
        and node.target is aten.convolution_backward.default
        and not node.args[7]
        and list(node.args[10]) == [False, True, False]  # type: ignore[arg-type]
    )


def is_channels_last_view(node: torch.fx.Node) -> bool:
    """Whether ``node`` is one of the views :func:`channels_last_weight_grad_operands` gives a weight gradient:
    a ``permute`` from channels-last that only weight-gradient requests read (they run in PyTorch with it)."""
    return (
        node.op == "call_function"
        and node.target is aten.permute.default
        and list(node.args[1]) == FROM_CHANNELS_LAST  # type: ignore[arg-type]
        and bool(node.users)
        and all(is_weight_grad_request(user) for user in node.users)
    )


def channels_last_weight_grad_operands(
    forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, saved_from: int
) -> int:
    """Give every float32 2-D weight-gradient request of ``backward`` channels-last operands, in place.

    ``saved_from`` is the index of the forward graph's first saved tensor (its outputs before it are the
    user's). Saved tensors that are added go before the others, in both graphs' order (AOTAutograd counts the
    forward graph's outputs after partitioning); an NCHW one no longer read is dropped from both. Returns the
    number of operands rewritten.
    """
    outputs = list(forward.graph.output_node().args[0])  # type: ignore[arg-type]
    saved = {node.name: node for node in outputs[saved_from:] if isinstance(node, torch.fx.Node)}
    placeholders = [node for node in backward.graph.nodes if node.op == "placeholder"]
    first_saved = next(
        (p for p in placeholders if p.name in saved and isinstance(p.meta.get("val"), torch.Tensor)), None
    )
    first_computation = next(node for node in backward.graph.nodes if node.op != "placeholder")
    views: dict[torch.fx.Node, torch.fx.Node] = {}
    added: list[torch.fx.Node] = []
    rewritten = 0
    for request in [node for node in backward.graph.nodes if is_weight_grad_request(node)]:
        grad_output, input = request.args[0], request.args[1]
        if not (_float32_image(grad_output) and _float32_image(input)):
            continue
        assert isinstance(grad_output, torch.fx.Node) and isinstance(input, torch.fx.Node)
        for operand in (grad_output, input):
            if operand not in views:
                if operand.op == "placeholder" and operand.name in saved and first_saved is not None:
                    copy = _channels_last_copy(forward.graph, saved[operand.name])
                    added.append(copy)
                    with backward.graph.inserting_before(first_saved):
                        source = backward.graph.placeholder(_unused_name(backward.graph, copy.name))
                    source.meta["val"] = copy.meta["val"]
                    views[operand] = _view_from_channels_last(backward.graph, source, first_computation)
                else:
                    views[operand] = _view_from_channels_last(
                        backward.graph, _channels_last_copy(backward.graph, operand), request
                    )
            rewritten += 1
        request.args = (views[grad_output], views[input], *request.args[2:])
        _row_major_weight_grad(backward.graph, request)
    if not rewritten:
        return 0
    unread = {p.name for p in placeholders if p.name in saved and not p.users}
    for placeholder in placeholders:
        if placeholder.name in unread:
            backward.graph.erase_node(placeholder)
    kept = [node for node in outputs[saved_from:] if not (isinstance(node, torch.fx.Node) and node.name in unread)]
    forward.graph.output_node().args = ((*outputs[:saved_from], *added, *kept),)
    forward.graph.eliminate_dead_code()
    forward.recompile()
    backward.recompile()
    return rewritten


def _unused_name(graph: torch.fx.Graph, name: str) -> str:
    """``name``, or ``name`` with a suffix that no node of ``graph`` has: a placeholder's name is its target,
    which FX would not rename along with it."""
    taken = {node.name for node in graph.nodes}
    suffixes = (f"_{index}" for index in range(len(taken) + 1))
    return name if name not in taken else next(name + s for s in suffixes if name + s not in taken)


def _float32_image(value: object) -> bool:
    """Whether ``value`` is a node computing a float32 batch of images (4-d) on CPU."""
    if not isinstance(value, torch.fx.Node):
        return False
    tensor = value.meta.get("val")
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.dim() == 4
        and tensor.dtype == torch.float32
        and tensor.device.type == "cpu"
    )


def _channels_last_copy(graph: torch.fx.Graph, value: torch.fx.Node) -> torch.fx.Node:
    """A row-major NHWC copy of the NCHW ``value``, computed right after it (after the inputs, for an input)."""
    if value.op == "placeholder":
        with graph.inserting_before(next(node for node in graph.nodes if node.op != "placeholder")):
            permuted = graph.call_function(aten.permute.default, (value, TO_CHANNELS_LAST))
    else:
        with graph.inserting_after(value):
            permuted = graph.call_function(aten.permute.default, (value, TO_CHANNELS_LAST))
    with graph.inserting_after(permuted):
        copy = graph.call_function(aten.clone.default, (permuted,), {"memory_format": torch.contiguous_format})
    with _fake_mode(value):
        permuted.meta["val"] = value.meta["val"].permute(TO_CHANNELS_LAST)
        copy.meta["val"] = permuted.meta["val"].contiguous()
    return copy


def _view_from_channels_last(graph: torch.fx.Graph, source: torch.fx.Node, before: torch.fx.Node) -> torch.fx.Node:
    """``source`` (NHWC) viewed as NCHW, inserted before ``before``."""
    with graph.inserting_before(before):
        view = graph.call_function(aten.permute.default, (source, FROM_CHANNELS_LAST))
    with _fake_mode(source):
        view.meta["val"] = source.meta["val"].permute(FROM_CHANNELS_LAST)
    return view


def _row_major_weight_grad(graph: torch.fx.Graph, request: torch.fx.Node) -> None:
    """Copy the channels-last gradient ``request`` returns to the weight's row-major layout for its readers."""
    with _fake_mode(request):
        for item in list(request.users):
            with graph.inserting_after(item):
                copy = graph.call_function(aten.clone.default, (item,), {"memory_format": torch.contiguous_format})
            for user in [user for user in item.users if user is not copy]:
                user.replace_input_with(item, copy)
            value = item.meta.get("val")
            if isinstance(value, torch.Tensor):
                copy.meta["val"] = value.contiguous()


def _fake_mode(node: torch.fx.Node) -> Any:
    """The fake-tensor mode of ``node``'s recorded value, to compute new values' metadata in."""
    mode = detect_fake_mode([node.meta.get("val")])
    return mode if mode is not None else contextlib.nullcontext()
