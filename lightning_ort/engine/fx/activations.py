"""Activations a model writes out in elementwise ops, folded into the ``torch.nn.functional`` call they equal.

Many models spell an activation out in Python instead of calling ``torch.nn.functional``: Hugging Face's
``gelu_new`` (GPT-2, GPT-J, BLOOM) and ``gelu_fast`` are the tanh GELU in eight elementwise ops, older BERT code
writes the exact GELU with ``torch.erf``, and Swish is often ``x * torch.sigmoid(x)``. Exported as written, each op
is a pass over the activation forward, and AOTAutograd's gradient of the chain is about a dozen more backward, on
CPU and on CUDA alike. :func:`fold_activations` finds such chains in TorchDynamo's graph and calls
``F.gelu(x, approximate="tanh")``, ``F.gelu(x)`` or ``F.silu(x)`` in their place: one ONNX node forward (``Gelu``,
or the ``x * Sigmoid(x)`` that ONNX Runtime fuses), and on CPU one gradient kernel backward
(:mod:`lightning_ort.engine.fx.gelu`, :mod:`lightning_ort.engine.fx.silu`).

A chain is recognized by what it computes, not by how it is written: the elementwise ops of one tensor ``x`` and
Python numbers around a ``tanh``, ``erf`` or ``sigmoid``, whose intermediates nothing else reads, evaluated in
float64 on sample points and compared with the activation to 1e-9. Constants written with fewer digits
(``0.7978845608``) match; other functions (QuickGELU's ``x * sigmoid(1.702 * x)``, a GELU with another
coefficient) do not.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.nn import functional as F


@dataclass(frozen=True)
class WrittenOutActivation:
    """An activation to fold: the ops a chain of it goes through, what it computes, and the call it becomes."""

    through: frozenset[Any]
    """The ``call_function`` targets and ``call_method`` names one of which every such chain holds."""
    reference: Callable[[torch.Tensor], torch.Tensor]
    """The activation, evaluated in float64 on the sample points."""
    replacement: Callable[..., torch.Tensor]
    kwargs: dict[str, Any] = field(default_factory=dict)


ACTIVATIONS: tuple[WrittenOutActivation, ...] = (
    WrittenOutActivation(
        frozenset({torch.tanh, "tanh"}),
        lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))),
        F.gelu,
        {"approximate": "tanh"},
    ),
    WrittenOutActivation(
        frozenset({torch.erf, torch.special.erf, "erf"}),
        lambda x: 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0))),
        F.gelu,
    ),
    WrittenOutActivation(frozenset({torch.sigmoid, "sigmoid"}), lambda x: x * torch.sigmoid(x), F.silu),
)
"""The activations :func:`fold_activations` folds."""

_ELEMENTWISE_FUNCTIONS: frozenset[Any] = frozenset(
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
        torch.neg,
        torch.tanh,
        torch.erf,
        torch.special.erf,
        torch.sigmoid,
    }
)
_ELEMENTWISE_METHODS = frozenset({"mul", "add", "sub", "div", "pow", "neg", "tanh", "erf", "sigmoid"})
_SAMPLES = torch.linspace(-8.0, 8.0, 161, dtype=torch.float64)
"""Where a candidate chain is compared with the activation (float64, so that only the algebra is compared)."""
_FORWARD_STEPS = 4
"""How far past its ``tanh``, ``erf`` or ``sigmoid`` a chain's output may lie (``1 + t``, then ``x / 2`` times it)."""


def fold_activations(gm: torch.fx.GraphModule) -> int:
    """Replace the elementwise chains of TorchDynamo's graph ``gm`` that compute one of :data:`ACTIVATIONS` by its
    ``torch.nn.functional`` call, in place. Returns the chains replaced.

    Example:
        >>> def gelu_new(x):
        ...     return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
        >>> gm = torch.fx.symbolic_trace(lambda x: gelu_new(x) + x * torch.sigmoid(x))
        >>> fold_activations(gm)
        2
        >>> [node.target.__name__ for node in gm.graph.nodes if node.op == "call_function"]
        ['gelu', 'silu', 'add']
    """
    replaced = 0
    erased: set[torch.fx.Node] = set()
    # The chains' ops are all nodes of the graph as it is now: the calls put in their place are never among them.
    order = {node: i for i, node in enumerate(gm.graph.nodes)}.__getitem__
    for node in list(gm.graph.nodes):
        if node in erased:
            continue
        for activation in ACTIVATIONS:
            if _target(node) not in activation.through:
                continue
            chain = _chain(node, activation, order)
            if chain is not None:
                erased |= _replace(gm.graph, chain, activation, order)
                replaced += 1
            break
    if replaced:
        gm.recompile()
    return replaced


@dataclass(frozen=True)
class _Chain:
    x: torch.fx.Node
    output: torch.fx.Node
    inner: frozenset[torch.fx.Node]


def _replace(
    graph: torch.fx.Graph, chain: _Chain, activation: WrittenOutActivation, order: Callable[[torch.fx.Node], int]
) -> set[torch.fx.Node]:
    """Call ``activation``'s replacement in place of ``chain``; returns the nodes erased (``order`` sorts nodes in
    the graph's order)."""
    with graph.inserting_before(chain.output):
        call = graph.call_function(activation.replacement, (chain.x,), dict(activation.kwargs))
    call.meta = dict(chain.output.meta)
    chain.output.replace_all_uses_with(call)
    erased = set()
    for dead in sorted(chain.inner | {chain.output}, key=order, reverse=True):
        if not dead.users:
            graph.erase_node(dead)
            erased.add(dead)
    return erased


def _target(node: torch.fx.Node) -> Any:
    return node.target if node.op in ("call_function", "call_method") else None


def _is_elementwise(node: torch.fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _ELEMENTWISE_FUNCTIONS
    return node.op == "call_method" and node.target in _ELEMENTWISE_METHODS


def _node_args(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The nodes among ``node``'s arguments, or ``None`` if any other argument is not a Python number."""
    nodes = []
    for arg in (*node.args, *node.kwargs.values()):
        if isinstance(arg, torch.fx.Node):
            nodes.append(arg)
        elif isinstance(arg, bool) or not isinstance(arg, (int, float)):
            return None
    return nodes


def _cone(output: torch.fx.Node) -> tuple[torch.fx.Node, set[torch.fx.Node]] | None:
    """The one tensor that the elementwise ops above ``output`` read, and those ops (``output`` included)."""
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


def _chain(
    through: torch.fx.Node, activation: WrittenOutActivation, order: Callable[[torch.fx.Node], int]
) -> _Chain | None:
    """The longest chain through ``through`` that computes ``activation`` of one tensor, or ``None``."""
    found = None
    node = through
    for step in range(_FORWARD_STEPS + 1):
        if step:
            if len(node.users) != 1:
                break
            (node,) = node.users
        if not _is_elementwise(node):
            break
        cone = _cone(node)
        if cone is None:
            continue
        x, ops = cone
        if not _floating(x):
            break
        inner = ops - {node}
        if any(user not in ops for op in inner for user in op.users):
            continue
        if _computes(ops, x, node, activation.reference, order):
            found = _Chain(x, node, frozenset(inner))
    return found


def _floating(x: torch.fx.Node) -> bool:
    """Whether ``x`` is a floating-point tensor, as far as its recorded example value tells (``F.gelu`` and
    ``F.silu`` take no integers, which a written-out chain promotes)."""
    example = x.meta.get("example_value", x.meta.get("val"))
    return not isinstance(example, torch.Tensor) or example.is_floating_point()


def _computes(
    ops: set[torch.fx.Node],
    x: torch.fx.Node,
    output: torch.fx.Node,
    reference: Callable[[torch.Tensor], torch.Tensor],
    order: Callable[[torch.fx.Node], int],
) -> bool:
    """Whether ``ops`` (elementwise, reading only ``x`` and numbers) compute ``reference`` of ``x`` at ``output``."""
    values: dict[torch.fx.Node, Any] = {x: _SAMPLES}

    def value(arg: Any) -> Any:
        return values[arg] if isinstance(arg, torch.fx.Node) else arg

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
    return bool(torch.allclose(result, reference(_SAMPLES), rtol=1e-9, atol=1e-9))
