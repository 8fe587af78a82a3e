"""GELU's gradient as one ONNX Runtime kernel on CPU.

ONNX Runtime's public build has no GELU gradient, so the exported ``aten.gelu_backward`` is PyTorch's
decomposition: ``Erf``, ``Exp`` and about eight products and sums around them, each a full pass over the
activation. On CPU, where lightning_ort's kernels are built, :func:`gelu_backward` (the decomposition the capture
uses for ``aten.gelu_backward``) records :data:`GELU_BACKWARD` instead, which the export translates to
``ai.lightning_ort::GeluGrad`` (``engine/runtime/activation_kernels.cpp``): one pass, for the exact GELU and its
tanh approximation.

Many models write the tanh approximation out in Python (Hugging Face's ``gelu_new``, used by GPT-2, GPT-J and
BLOOM; its ``gelu_fast``): eight elementwise ops forward and about a dozen backward, each a pass over the
activation, on CPU and on CUDA alike. :func:`fold_tanh_gelus` finds such chains in TorchDynamo's graph and calls
``F.gelu(x, approximate="tanh")`` instead: one ONNX ``Gelu`` forward, and on CPU one ``GeluGrad`` backward.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

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


_ELEMENTWISE_FUNCTIONS: frozenset[Callable[..., object]] = frozenset(
    {
        operator.mul,
        operator.add,
        operator.sub,
        operator.truediv,
        operator.pow,
        operator.neg,
        torch.mul,
        torch.add,
        torch.sub,
        torch.div,
        torch.pow,
        torch.tanh,
    }
)
_ELEMENTWISE_METHODS = frozenset({"mul", "add", "sub", "div", "pow", "tanh", "neg"})
_SAMPLES = torch.linspace(-8.0, 8.0, 161, dtype=torch.float64)
"""Where a candidate chain is compared with the tanh GELU (float64, so that only the algebra is compared)."""
_FORWARD_STEPS = 4
"""How far past a ``tanh`` the chain's output may lie (``1 + t``, then the product with ``x / 2``)."""


def fold_tanh_gelus(gm: torch.fx.GraphModule) -> int:
    """Replace elementwise chains of TorchDynamo's graph ``gm`` that compute the tanh approximation of GELU,
    ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))``, by ``F.gelu(x, approximate="tanh")``, in
    place. Returns the chains replaced.

    A chain is a ``tanh`` with the products, sums and powers of one tensor ``x`` and Python numbers around it,
    whatever their order or grouping (``gelu_new``'s and ``gelu_fast``'s both), whose intermediates nothing
    else reads. It is replaced when it equals the tanh GELU on sample points in float64 (to 1e-9), so constants
    written with fewer digits (``0.7978845608``) match and other functions do not.

    Example:
        >>> def gelu_new(x):
        ...     return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
        >>> gm = torch.fx.symbolic_trace(lambda x: gelu_new(x) + 1)
        >>> fold_tanh_gelus(gm), gelus(gm)
        (1, 1)
    """
    replaced = 0
    for node in list(gm.graph.nodes):
        if node.graph is not gm.graph or not _is_tanh(node):
            continue
        chain = _tanh_gelu_chain(node)
        if chain is None:
            continue
        x, output, cone = chain
        with gm.graph.inserting_before(output):
            gelu = gm.graph.call_function(F.gelu, (x,), {"approximate": "tanh"})
        gelu.meta = dict(output.meta)
        output.replace_all_uses_with(gelu)
        for dead in sorted(cone | {output}, key=_position(gm.graph), reverse=True):
            if not dead.users:
                gm.graph.erase_node(dead)
        replaced += 1
    if replaced:
        gm.recompile()
    return replaced


def _is_tanh(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target is torch.tanh) or (
        node.op == "call_method" and node.target == "tanh"
    )


def _is_elementwise(node: torch.fx.Node) -> bool:
    if node.op == "call_function" and node.target in _ELEMENTWISE_FUNCTIONS:
        return True
    return node.op == "call_method" and node.target in _ELEMENTWISE_METHODS


def _node_args(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The nodes among ``node``'s arguments, or ``None`` if any other argument is not a Python number."""
    nodes = []
    for arg in (*node.args, *node.kwargs.values()):
        if isinstance(arg, torch.fx.Node):
            nodes.append(arg)
        elif not isinstance(arg, (int, float)) or isinstance(arg, bool):
            return None
    return nodes


def _cone(output: torch.fx.Node) -> tuple[torch.fx.Node, set[torch.fx.Node]] | None:
    """The one tensor ``x`` that the elementwise ops above ``output`` read, and those ops (``output`` included)."""
    cone: set[torch.fx.Node] = set()
    leaves: set[torch.fx.Node] = set()
    stack = [output]
    while stack:
        node = stack.pop()
        if node in cone or node in leaves:
            continue
        args = _node_args(node) if _is_elementwise(node) else None
        if args is None:
            leaves.add(node)
            continue
        cone.add(node)
        stack.extend(args)
    if len(leaves) != 1 or output not in cone:
        return None
    (x,) = leaves
    return x, cone


def _tanh_gelu_chain(tanh: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, set[torch.fx.Node]] | None:
    """``(x, output, ops)`` for the tanh GELU chain through ``tanh``, or ``None``."""
    found = None
    node = tanh
    for _ in range(_FORWARD_STEPS):
        if len(node.users) != 1:
            break
        (node,) = node.users
        if not _is_elementwise(node):
            break
        cone = _cone(node)
        if cone is None:
            continue
        x, ops = cone
        inner = ops - {node}
        if any(user not in ops for op in inner for user in op.users):
            continue
        if _computes_tanh_gelu(ops, x, node):
            found = (x, node, inner)
    return found


def _computes_tanh_gelu(ops: set[torch.fx.Node], x: torch.fx.Node, output: torch.fx.Node) -> bool:
    """Whether ``ops`` (elementwise, reading only ``x``) compute the tanh GELU of ``x`` at ``output``."""
    values: dict[torch.fx.Node, object] = {x: _SAMPLES}

    def value(arg: object) -> object:
        return values[arg] if isinstance(arg, torch.fx.Node) else arg

    order = _position(output.graph)
    try:
        for node in sorted(ops, key=order):
            args = [value(arg) for arg in node.args]
            kwargs = {key: value(arg) for key, arg in node.kwargs.items()}
            if node.op == "call_method":
                values[node] = getattr(args[0], str(node.target))(*args[1:], **kwargs)
            else:
                values[node] = node.target(*args, **kwargs)  # type: ignore[operator]
    except (TypeError, RuntimeError, ZeroDivisionError):
        return False
    result = values[output]
    if not isinstance(result, torch.Tensor) or result.shape != _SAMPLES.shape:
        return False
    expected = 0.5 * _SAMPLES * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (_SAMPLES + 0.044715 * _SAMPLES**3)))
    return bool(torch.allclose(result, expected, rtol=1e-9, atol=1e-9))


def _position(graph: torch.fx.Graph) -> Callable[[torch.fx.Node], int]:
    """A sort key giving each node of ``graph`` its place in the graph's order."""
    index = {node: i for i, node in enumerate(graph.nodes)}
    return index.__getitem__
