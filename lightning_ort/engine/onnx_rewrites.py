"""Rewrites of exported ONNX graphs that pick faster ONNX Runtime kernels.

* :func:`fuse_transposed_right_operands`: ``MatMul(A, Transpose(B))`` with the last two axes of ``B`` swapped
  becomes ``com.microsoft.FusedMatMul(A, B, transB=1)``, and ONNX Runtime's own ``MatmulTransposeFusion`` is
  turned off for our sessions (:data:`DISABLED_ORT_OPTIMIZERS`). That optimizer also fuses a transposed *left*
  operand (``transA``), the shape of every weight gradient ``grad.T @ input``, and ONNX Runtime's CPU kernel
  for it is slower than transposing explicitly and multiplying (mlp benchmark step 54.9 -> 47.9 ms), while
  fusing the right operand is faster (cnn step 314 -> 300 ms). Doing the right-operand fusion here and
  leaving the left transposes explicit gets both.
"""

from __future__ import annotations

import onnx
from onnx import helper

DISABLED_ORT_OPTIMIZERS = ("MatmulTransposeFusion",)
"""ONNX Runtime graph optimizers our sessions turn off (see the module docstring)."""

_MICROSOFT = "com.microsoft"


def fuse_transposed_right_operands(model: onnx.ModelProto) -> int:
    """Turn ``MatMul(A, Transpose(B))`` (last two axes swapped) into ``FusedMatMul(A, B, transB=1)`` in place.

    Returns the number of MatMul nodes rewritten.

    Example:
        >>> transpose = helper.make_node("Transpose", ["b"], ["bt"], perm=[0, 2, 1])
        >>> matmul = helper.make_node("MatMul", ["a", "bt"], ["y"])
        >>> model = helper.make_model(helper.make_graph([transpose, matmul], "g", [], []))
        >>> fuse_transposed_right_operands(model), [n.op_type for n in model.graph.node]
        (1, ['FusedMatMul'])
    """
    graph = model.graph
    producers = {output: node for node in graph.node for output in node.output}
    rewritten = 0
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        source = producers.get(node.input[1]) if node.op_type == "MatMul" and node.domain == "" else None
        if source is not None and source.op_type == "Transpose" and _swaps_last_two_axes(source):
            node = helper.make_node(
                "FusedMatMul",
                [node.input[0], source.input[0]],
                list(node.output),
                node.name,
                domain=_MICROSOFT,
                transB=1,
            )
            rewritten += 1
        nodes.append(node)
    if not rewritten:
        return 0
    used = {name for node in nodes for name in node.input} | {output.name for output in graph.output}
    kept = [n for n in nodes if n.op_type != "Transpose" or any(output in used for output in n.output)]
    del graph.node[:]
    graph.node.extend(kept)
    if not any(opset.domain == _MICROSOFT for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid(_MICROSOFT, 1))
    return rewritten


def _swaps_last_two_axes(transpose: onnx.NodeProto) -> bool:
    perm = next((list(attr.ints) for attr in transpose.attribute if attr.name == "perm"), None)
    if perm is None or len(perm) < 2:
        return False
    rank = len(perm)
    return perm == [*range(rank - 2), rank - 1, rank - 2]
