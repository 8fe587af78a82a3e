"""Rewrites of exported ONNX graphs that pick faster ONNX Runtime kernels.

* :func:`split_gemm_bias` (CPU graphs): a ``Gemm`` with a bias becomes a product and an ``Add`` (ONNX Runtime's
  CPU ``Gemm`` broadcasts the bias into the whole output before the product).
* :func:`fuse_transposed_operands`: ``MatMul(A, Transpose(B))`` with the last two axes of ``B`` swapped
  becomes ``com.microsoft.FusedMatMul(A, B, transB=1)``; a transposed *left* operand becomes ``transA=1`` only
  where ONNX Runtime's CPU kernel for it measured faster than transposing explicitly: batched products
  (attention's gradients: 0.39 vs 1.08 ms for 256 products of 64x64 by 64x32) and products whose result has
  more rows than columns (a weight gradient ``grad.T @ input`` with more outputs than inputs: 3.3 vs 4.8 ms for
  1024x2048 by 2048x256). With fewer or as many rows, the fused kernel was slower (7.1 vs 6.2 ms for
  2048x256 by 256x2048; mlp benchmark step 54.9 -> 47.9 ms with those left explicit). ONNX Runtime's own
  ``MatmulTransposeFusion``, which fuses every transposed operand, is turned off for our sessions
  (:data:`DISABLED_ORT_OPTIMIZERS`). Measured on this project's 2-core CPU with spinning worker threads.
"""

from __future__ import annotations

import onnx
from onnx import helper

DISABLED_ORT_OPTIMIZERS = ("MatmulTransposeFusion",)
"""ONNX Runtime graph optimizers our sessions turn off (see the module docstring)."""

_MICROSOFT = "com.microsoft"


def fuse_transposed_operands(model: onnx.ModelProto) -> int:
    """Fold ``Transpose`` nodes (last two axes swapped) into the ``MatMul`` reading them, in place.

    Right operands always; left operands of batched products and of products with more rows than columns
    (static shapes only). Returns the number of MatMul nodes rewritten.

    Example:
        >>> transpose = helper.make_node("Transpose", ["b"], ["bt"], perm=[0, 2, 1])
        >>> matmul = helper.make_node("MatMul", ["a", "bt"], ["y"])
        >>> model = helper.make_model(helper.make_graph([transpose, matmul], "g", [], []))
        >>> fuse_transposed_operands(model), [n.op_type for n in model.graph.node]
        (1, ['FusedMatMul'])
    """
    graph = model.graph
    producers = {output: node for node in graph.node for output in node.output}
    shapes = _static_shapes(graph)
    rewritten = 0
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type == "MatMul" and node.domain == "":
            left, right = (_swapping_transpose(producers.get(name)) for name in node.input[:2])
            if not _left_fusion_pays(shapes.get(node.input[0]), shapes.get(node.input[1])):
                left = None
            if left is not None or right is not None:
                node = helper.make_node(
                    "FusedMatMul",
                    [
                        left.input[0] if left is not None else node.input[0],
                        right.input[0] if right is not None else node.input[1],
                    ],
                    list(node.output),
                    node.name,
                    domain=_MICROSOFT,
                    transA=int(left is not None),
                    transB=int(right is not None),
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


def split_gemm_bias(model: onnx.ModelProto) -> int:
    """Turn ``Gemm(A, B, bias)`` (a Linear layer with bias) into ``MatMul(A, B)`` and ``Add(bias)``, in place.

    ONNX Runtime's CPU ``Gemm`` first broadcasts the bias into its whole output and then accumulates the
    product onto it; a separate ``Add`` is cheaper (2048x256 by 256x1024 with bias: 3.9 ms as one ``Gemm``,
    3.6 ms as product and ``Add``; transformer benchmark step about 10 ms shorter, mlp 3-10 ms). Run
    before :func:`fuse_transposed_operands`, which folds the weight's transpose into a ``FusedMatMul`` that
    ONNX Runtime does not fuse back into a ``Gemm``. Only plain ``Gemm`` nodes are rewritten: ``alpha`` and
    ``beta`` 1, no ``transA``, a 1-d bias. Returns the number of nodes rewritten.

    Example:
        >>> gemm = helper.make_node("Gemm", ["a", "w", "b"], ["y"], "node_addmm")
        >>> bias = helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [4])
        >>> model = helper.make_model(helper.make_graph([gemm], "g", [bias], []))
        >>> split_gemm_bias(model), [n.op_type for n in model.graph.node]
        (1, ['MatMul', 'Add'])
    """
    ranks = _ranks(model.graph)
    rewritten = 0
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        attributes = {attr.name: helper.get_attribute_value(attr) for attr in node.attribute}
        if (
            node.op_type != "Gemm"
            or len(node.input) != 3
            or ranks.get(node.input[2]) != 1
            or attributes.get("alpha", 1.0) != 1.0
            or attributes.get("beta", 1.0) != 1.0
            or attributes.get("transA", 0)
        ):
            nodes.append(node)
            continue
        left, right, bias = node.input
        if attributes.get("transB", 0):
            right, weight = f"{node.output[0]}_weight_t", right
            nodes.append(helper.make_node("Transpose", [weight], [right], f"{node.name}_weight_t", perm=[1, 0]))
        product = f"{node.output[0]}_product"
        nodes.append(helper.make_node("MatMul", [left, right], [product], node.name))
        nodes.append(helper.make_node("Add", [product, bias], list(node.output), f"{node.name}_bias"))
        rewritten += 1
    if rewritten:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return rewritten


def _left_fusion_pays(left: list[int] | None, right: list[int] | None) -> bool:
    """Whether ``transA`` beats an explicit transpose for ``left @ right`` (``left`` as the product reads it)."""
    if left is None or right is None or len(left) < 2 or len(right) < 2:
        return False
    return len(left) > 2 or left[-2] > right[-1]


def _ranks(graph: onnx.GraphProto) -> dict[str, int]:
    ranks = {init.name: len(init.dims) for init in graph.initializer}
    for value in [*graph.value_info, *graph.input, *graph.output]:
        if value.type.tensor_type.HasField("shape"):
            ranks[value.name] = len(value.type.tensor_type.shape.dim)
    return ranks


def _static_shapes(graph: onnx.GraphProto) -> dict[str, list[int]]:
    shapes: dict[str, list[int]] = {}
    for value in [*graph.value_info, *graph.input, *graph.output]:
        dims = value.type.tensor_type.shape.dim
        if value.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            shapes[value.name] = [d.dim_value for d in dims]
    return shapes


def _swapping_transpose(node: onnx.NodeProto | None) -> onnx.NodeProto | None:
    if node is None or node.op_type != "Transpose":
        return None
    perm = next((list(attr.ints) for attr in node.attribute if attr.name == "perm"), None)
    if perm is None or len(perm) < 2:
        return None
    rank = len(perm)
    return node if perm == [*range(rank - 2), rank - 1, rank - 2] else None
