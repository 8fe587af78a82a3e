"""Graph outputs that depend on no input: split from the graph, so that the session computes them once.

ONNX Runtime folds the nodes behind such an output into an initializer when it loads the graph, and copies an
initializer that is a graph output into the output buffer at every run with a synchronous copy: on CUDA, a
``cudaStreamSynchronize`` per run, which a CUDA graph capture cannot hold ("operation not permitted when stream
is capturing"). A causal mask that the forward graph saves for the backward graph is such an output.
:func:`split_constant_outputs` takes them out of the graph the session runs and puts them in a graph of their
own, without inputs, which the session runs once (see :class:`~lightning_ort.engine.runtime.session.GraphSession`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import onnx
from onnx import helper

RANDOM_OPS = frozenset(
    {"Bernoulli", "Dropout", "Multinomial", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike"}
)
"""Ops whose outputs change from run to run without any input: never constant."""


@dataclass
class ConstantSplit:
    """A graph without its input-independent outputs (``graph``), the graph that computes those (``constants``,
    without inputs), and their positions among the original outputs, ascending."""

    graph: onnx.ModelProto
    constants: onnx.ModelProto
    positions: list[int]


def constant_output_positions(model: onnx.ModelProto) -> list[int]:
    """Positions of ``model``'s outputs that depend on none of its inputs: initializers, ``Constant`` nodes and
    what is computed from them alone (random ops and nodes with subgraphs count as input-dependent).

    Example:
        >>> x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])
        >>> y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])
        >>> mask = helper.make_tensor_value_info("mask", onnx.TensorProto.BOOL, [2])
        >>> nodes = [
        ...     helper.make_node("Relu", ["x"], ["y"]),
        ...     helper.make_node("Constant", [], ["ones"], value_ints=[1, 1]),
        ...     helper.make_node("Cast", ["ones"], ["mask"], to=onnx.TensorProto.BOOL),
        ... ]
        >>> constant_output_positions(helper.make_model(helper.make_graph(nodes, "g", [x], [y, mask])))
        [1]
    """
    graph = model.graph
    dependent = {value.name for value in graph.input}
    for node in graph.node:
        reads_input = any(name in dependent for name in node.input if name)
        if reads_input or node.op_type in RANDOM_OPS or _has_subgraph(node):
            dependent.update(node.output)
    return [position for position, output in enumerate(graph.output) if output.name not in dependent]


def split_constant_outputs(model: onnx.ModelProto) -> ConstantSplit | None:
    """``model`` split into the graph of its input-dependent outputs and the graph of the others (see
    :func:`constant_output_positions`); ``None`` where every output depends on an input, or none does (a graph
    that computes nothing from its inputs is left whole). ``model`` is not modified."""
    positions = constant_output_positions(model)
    if not positions or len(positions) == len(model.graph.output):
        return None
    outputs = list(model.graph.output)
    constant = set(positions)
    kept = [output for position, output in enumerate(outputs) if position not in constant]
    return ConstantSplit(
        _subgraph(model, kept, model.graph.input, "graph"),
        _subgraph(model, [outputs[position] for position in positions], [], "constants"),
        positions,
    )


def _subgraph(
    model: onnx.ModelProto,
    outputs: Sequence[onnx.ValueInfoProto],
    inputs: Sequence[onnx.ValueInfoProto],
    suffix: str,
) -> onnx.ModelProto:
    """A model with ``model``'s opsets computing ``outputs`` from ``inputs``: the nodes and initializers they
    need, in their order."""
    needed = {output.name for output in outputs}
    nodes: list[onnx.NodeProto] = []
    for node in reversed(model.graph.node):
        if any(name in needed for name in node.output):
            nodes.append(node)
            needed.update(name for name in node.input if name)
            needed.update(_outer_names(node))
    nodes.reverse()
    graph = helper.make_graph(
        nodes,
        f"{model.graph.name}_{suffix}",
        list(inputs),
        list(outputs),
        [tensor for tensor in model.graph.initializer if tensor.name in needed],
    )
    kept_values = {name for node in nodes for name in node.output}
    graph.value_info.extend(value for value in model.graph.value_info if value.name in kept_values)
    split = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    split.functions.extend(model.functions)
    return split


def _has_subgraph(node: onnx.NodeProto) -> bool:
    return any(attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for attr in node.attribute)


def _outer_names(node: onnx.NodeProto) -> set[str]:
    """Names that ``node``'s subgraphs read (values of the graph around them among them)."""
    names: set[str] = set()
    for attr in node.attribute:
        for graph in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            for inner in graph.node:
                names.update(name for name in inner.input if name)
                names.update(_outer_names(inner))
    return names
