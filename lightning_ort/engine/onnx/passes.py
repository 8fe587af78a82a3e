"""Passes over exported ONNX graphs: a bounded clean-up, and rewrites that pick faster ONNX Runtime kernels.

* :func:`simplify`: inlining, constant folding and dead-code removal, as ``torch.onnx``'s optimizer does, without
  its pattern rewriter.
* :func:`cast_outputs_to` (every graph, before the rest): outputs the exporter computes in another type than
  PyTorch's graph gives them (a ``bfloat16`` sum, widened to float32) are cast to PyTorch's type.
* :func:`compute_bfloat16_in_float` (CPU graphs): ``bfloat16`` ops (autocast) computed in float32, for which
  ONNX Runtime's CPU provider has kernels; casts to ``bfloat16`` still round.
* :func:`drop_identity_casts`: casts to the type their input already has (autocast's float32 casts of gradients
  the graph now computes in float32) are dropped, their outputs written by the producer.
* :func:`collapse_reshapes`: reshapes that change nothing are dropped and chains of reshapes shortcut.
* :func:`merge_slices`: a ``Slice`` of a ``Slice`` on other axes becomes one ``Slice`` (a strided convolution's
  input subsampled along both image axes), one pass over the data instead of two.
* :func:`subsample_images` (CPU graphs that use lightning_ort's kernels): a ``Slice`` that takes every s-th row
  and column of images runs as lightning_ort's ``Subsample`` kernel instead of ONNX Runtime's element-by-element
  copy.
* :func:`transpose_in_kernel` (CPU graphs that use lightning_ort's kernels): a float32 ``Transpose`` of static
  shape that is not a plain matrix transpose runs as lightning_ort's threaded ``Transpose`` kernel instead of
  ONNX Runtime's single-threaded element-by-element copy.
* :func:`split_gemm_bias` (CPU graphs): a ``Gemm`` with a bias becomes a product and an ``Add`` (ONNX Runtime's
  CPU ``Gemm`` broadcasts the bias into the whole output before the product).
* :func:`fuse_transposed_operands`: ``MatMul(A, Transpose(B))`` with the last two axes of ``B`` swapped
  becomes ``com.microsoft.FusedMatMul(A, B, transB=1)``; a transposed *left* operand becomes ``transA=1`` only
  where ONNX Runtime's CPU kernel for it is faster than transposing explicitly: batched products (attention's
  gradients) and products whose result has more rows than columns (a weight gradient ``grad.T @ input`` with
  more outputs than inputs). With fewer or as many rows the fused kernel is slower, so ONNX Runtime's own
  ``MatmulTransposeFusion``, which fuses every transposed operand, is turned off for our sessions
  (:data:`DISABLED_ORT_OPTIMIZERS`).
* :func:`compute_cuda_bfloat16_gaps_in_float` (CUDA graphs): the ``bfloat16`` nodes of ops the CUDA provider has
  no ``bfloat16`` kernel for computed in float32 between casts.
* :func:`use_nchwc_convolutions` (CPU graphs): a 2-D ``Conv`` whose channel counts are multiples of the CPU's
  NCHWc block runs ONNX Runtime's blocked-layout kernel (``com.microsoft.nchwc.Conv``), its weight reordered
  inside the graph. ONNX Runtime only makes that rewrite itself for weights that are constant initializers,
  and ours are graph inputs that change every step; its plain ``Conv`` multiplies one image at a time.
* :func:`fold_channels_last_transposes` (CPU graphs): a ``Transpose`` to channels-last of an NCHWc
  convolution's output becomes the ``ReorderOutput``'s own ``channels_last`` form, and one from channels-last
  that only NCHWc convolutions read becomes their ``ReorderInput``'s (ConvNeXt's layer norms run channels-last
  between depthwise convolutions): one pass over the tensor instead of two.
* :func:`dequantize_scaled_masks` (CPU graphs): dropout's one-byte keep mask scaled to floats by a ``Cast`` and
  a product becomes one ``DequantizeLinear``.
* :func:`sum_rows_by_product` (CPU graphs): a ``ReduceSum`` over leading axes (bias and normalisation-weight
  gradients) becomes a product with a row of ones.
* :func:`read_pooled_grads_per_plane` (CPU graphs): a global average pool's gradient reaches the batch-norm
  gradient kernel before it one value per plane, instead of expanded over each plane by ``Expand`` and ``Div``.
* :func:`keep_gradients_blocked` (CPU graphs with lightning_ort's kernels, AVX-512): the backward's gradients
  stay in NCHWc blocks between the convolutions that write and read them, through the batch-norm gradients and
  the phase weave, instead of a ``ReorderOutput`` and a ``ReorderInput`` around each.
* :func:`multiply_through_mkl` (CPU sessions, applied when a session is created where
  :mod:`~lightning_ort.engine.runtime.cpu_matmul` chooses MKL, never to the exported graph): products of two float32
  matrices run in lightning_ort's ``BlasMatMul`` kernel.
* :func:`pad_by_concat` (CUDA graphs): a constant ``Pad`` of a type the CUDA provider has no ``Pad`` kernel for
  (integers: Hugging Face's causal-LM loss pads its labels) becomes a ``Concat`` with constant blocks, so that it
  runs on the GPU instead of between two copies to and from the host (:func:`cuda_host_nodes` finds what is left).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import onnxscript.optimizer
from onnx import helper, numpy_helper
from onnx_ir.passes import common as common_passes

from lightning_ort.engine.once import Once
from lightning_ort.engine.onnx.custom_ops import DOMAIN, uses_kernels
from lightning_ort.logs import get_logger


@dataclass(frozen=True)
class OnnxPass:
    """One rewrite of an exported graph, in place: what it does in the log, and the devices whose graphs it pays on.

    Args:
        done: what one rewrite is, for the export's DEBUG log (``"reshapes removed"``).
        rewrite: the pass: takes the model, returns how many rewrites it made.
        devices: the ``torch.device`` types whose graphs it runs on (the CPU provider's, the CUDA provider's).
    """

    done: str
    rewrite: Callable[[onnx.ModelProto], int]
    devices: frozenset[str] = frozenset({"cpu", "cuda"})


def _nchwc_convolutions(model: onnx.ModelProto) -> int:
    return use_nchwc_convolutions(model, nchwc_block_size(), kernels=uses_kernels(model))


def _blocked_gradients(model: onnx.ModelProto) -> int:
    return keep_gradients_blocked(model, nchwc_block_size())


DISABLED_ORT_OPTIMIZERS = ("MatmulTransposeFusion",)
"""ONNX Runtime graph optimizers our sessions turn off (see the module docstring)."""

_MICROSOFT = "com.microsoft"
_NCHWC = "com.microsoft.nchwc"

log = get_logger(__name__)


def simplify(model: ir.Model) -> None:
    """Inline functions, fold constants and drop what nothing reads, in place.

    This is ``torch.onnx.export(optimize=True)``'s pipeline without its pattern rewriter, whose matching cost
    grows with the graph while ONNX Runtime's own graph optimizations, run when the session is built, cover
    what it rewrites (cast, transpose and reshape chains, identities, batch-norm folding).
    """
    ir.passes.Sequential(
        common_passes.InlinePass(),
        ir.passes.PassManager(
            [_FoldConstants(), common_passes.RemoveUnusedNodesPass(), common_passes.RemoveUnusedFunctionsPass()],
            steps=2,
            early_stop=True,
        ),
        common_passes.RemoveUnusedOpsetsPass(),
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common_passes.LiftSubgraphInitializersToMainGraphPass(),
        common_passes.DeduplicateInitializersPass(),
        common_passes.CommonSubexpressionEliminationPass(),
        common_passes.OutputFixPass(),
        common_passes.NameFixPass(),
    )(model)


class _FoldConstants(ir.passes.InPlacePass):
    """onnxscript's constant folding (with node-level shape inference) as a pass."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        result = onnxscript.optimizer.fold_constants_ir(model, onnx_shape_inference=True)
        return ir.passes.PassResult(model, modified=result.modified)


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
    values = _values(graph)
    shapes = {name: shape for name, value in values.items() if (shape := value.static_shape) is not None}
    rewritten = 0
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type == "MatMul" and _in_default_domain(node):
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
    used = _read_names(nodes, graph)
    kept = [n for n in nodes if n.op_type != "Transpose" or any(output in used for output in n.output)]
    _set_nodes(graph, kept)
    if not any(opset.domain == _MICROSOFT for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid(_MICROSOFT, 1))
    return rewritten


def cast_outputs_to(model: onnx.ModelProto, element_types: Sequence[int | None]) -> int:
    """Cast each graph output whose declared ONNX type is not ``element_types[i]`` to it, in place (``None``:
    leave that output as it is).

    ``torch.onnx`` translates some ops on 16-bit floats by widening them and may leave the result wide: a
    ``bfloat16`` model's bias gradient, ``aten.sum`` of a ``bfloat16`` tensor, leaves as a float32 ``ReduceSum``.
    ONNX Runtime would then return float32 memory where PyTorch's graph expects ``bfloat16`` values. The output's
    producer writes a value of its own instead, and a ``Cast`` writes the output in PyTorch's type. Returns the
    number of outputs cast.

    Example:
        >>> x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])
        >>> y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])
        >>> model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]))
        >>> cast_outputs_to(model, [onnx.TensorProto.BFLOAT16]), [n.op_type for n in model.graph.node]
        (1, ['Relu', 'Cast'])
        >>> model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16
        True
    """
    graph = model.graph
    producers = {name: node for node in graph.node for name in node.output}
    casts: list[onnx.NodeProto] = []
    for output, element_type in zip(graph.output, element_types):
        declared = output.type.tensor_type
        producer = producers.get(output.name)
        if element_type is None or declared.elem_type == element_type or producer is None:
            continue
        exported = f"{output.name}_as_exported"
        producer.output[list(producer.output).index(output.name)] = exported
        for node in graph.node:
            node.input[:] = [exported if name == output.name else name for name in node.input]
        wide = onnx.ValueInfoProto()
        wide.CopyFrom(output)
        wide.name = exported
        graph.value_info.append(wide)
        declared.elem_type = element_type
        casts.append(helper.make_node("Cast", [exported], [output.name], f"{output.name}_cast", to=element_type))
    graph.node.extend(casts)
    return len(casts)


def compute_bfloat16_in_float(model: onnx.ModelProto) -> int:
    """Compute the ``bfloat16`` ops of ``model`` in float32, in place; casts to ``bfloat16`` still round.

    ONNX Runtime's CPU provider has ``bfloat16`` kernels for casts and little else, so an autocast graph would
    otherwise leave most of its ops to PyTorch. Here ``bfloat16`` inputs and initializers are widened to
    float32 and every op reads and writes float32. A ``Cast`` to ``bfloat16`` (where autocast lowers a matmul's
    operands, or a tensor is stored) still rounds: its result is widened again for its readers. Between those
    casts, values are not rounded after every op as PyTorch's ``bfloat16`` kernels do: that would double the
    casts, and without it the results lie closer to float64 than eager ``bfloat16``'s. The graph's inputs and
    outputs keep their ``bfloat16`` type, so saved activations stay half the size. Graphs with subgraphs
    (``If``, ``Loop``, ``Scan``) are left as they are. Returns the number of ops moved to float32.

    Example:
        >>> x = helper.make_tensor_value_info("x", onnx.TensorProto.BFLOAT16, [4])
        >>> y = helper.make_tensor_value_info("y", onnx.TensorProto.BFLOAT16, [4])
        >>> model = helper.make_model(helper.make_graph([helper.make_node("Mul", ["x", "x"], ["y"])], "g", [x], [y]))
        >>> compute_bfloat16_in_float(model), [n.op_type for n in model.graph.node]
        (1, ['Cast', 'Mul', 'Cast'])
    """
    graph = model.graph
    values = _values(graph)
    bf16, float32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT
    if all(value.elem_type != bf16 for value in values.values()) or _has_subgraphs(graph):
        return 0
    in_float: dict[str, str] = {}  # a bfloat16 value -> the float32 value its readers read instead
    nodes: list[onnx.NodeProto] = []

    def widen(name: str) -> None:
        in_float[name] = f"{name}_float"
        nodes.append(helper.make_node("Cast", [name], [in_float[name]], f"{in_float[name]}_cast", to=float32))

    for value in graph.input:
        if values[value.name].elem_type == bf16:
            widen(value.name)
    for init in graph.initializer:
        if init.data_type == bf16:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float32), init.name))
    moved = 0
    for node in graph.node:
        reads_bf16 = any(name in in_float for name in node.input)
        node.input[:] = [in_float.get(name, name) for name in node.input]
        writes_bf16 = [i for i, name in enumerate(node.output) if name in values and values[name].elem_type == bf16]
        if node.op_type == "CastLike" and writes_bf16:  # a cast to bfloat16 whose target is now float32
            node = helper.make_node("Cast", node.input[:1], node.output, node.name, to=bf16)
        nodes.append(node)
        if node.op_type == "Cast" and _in_default_domain(node):
            for index in writes_bf16:
                widen(node.output[index])
            continue
        _bfloat16_attributes_to_float(node)
        moved += bool(reads_bf16 or writes_bf16)
        for index in writes_bf16:
            in_float[node.output[index]] = node.output[index] = f"{node.output[index]}_float"
    produced = {name for node in nodes for name in node.output} | {value.name for value in graph.input}
    for output in graph.output:
        if output.name not in produced and output.name in in_float:
            nodes.append(
                helper.make_node("Cast", [in_float[output.name]], [output.name], f"{output.name}_cast", to=bf16)
            )
            produced.add(output.name)
    _keep_value_info(graph, produced)
    graph.value_info.extend(
        helper.make_tensor_value_info(renamed, float32, list(values[name].dims) if name in values else None)
        for name, renamed in in_float.items()
    )
    _set_nodes(graph, nodes)
    return moved


def drop_identity_casts(model: onnx.ModelProto) -> int:
    """Remove the ``Cast`` nodes whose input already has the type they cast to, in place; returns how many.

    :func:`compute_bfloat16_in_float` leaves them: autocast's cast of a ``bfloat16`` weight gradient to the
    float32 parameter's type reads a value now computed in float32, and would copy it. ONNX Runtime's own cast
    elimination keeps the ones that write a graph output (gradients are); here the producer of the cast's input
    writes that output directly instead, where the input is no graph input, initializer or other output.
    Graphs with subgraphs are left as they are.

    Example:
        >>> x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])
        >>> y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])
        >>> nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Cast", ["r"], ["y"], to=1)]
        >>> graph = helper.make_graph(nodes, "g", [x], [y], value_info=[helper.make_tensor_value_info("r", 1, [4])])
        >>> model = helper.make_model(graph)
        >>> drop_identity_casts(model), [(n.op_type, list(n.output)) for n in model.graph.node]
        (1, [('Relu', ['y'])])
    """
    graph = model.graph
    if _has_subgraphs(graph):
        return 0
    values = _values(graph)
    outputs = {value.name for value in graph.output}
    fixed = outputs | {value.name for value in graph.input} | {init.name for init in graph.initializer}
    produced = {name for node in graph.node for name in node.output}
    alias: dict[str, str] = {}  # every occurrence of a name -> the name that now holds its value

    def resolved(name: str) -> str:
        while name in alias:
            name = alias[name]
        return name

    kept = []
    for node in graph.node:
        known = values.get(node.input[0]) if node.op_type == "Cast" and _in_default_domain(node) else None
        if known is None or known.elem_type != _attributes(node)["to"]:
            kept.append(node)
            continue
        source, target = resolved(node.input[0]), node.output[0]
        if target not in outputs:
            alias[target] = source
        elif source not in fixed and source in produced:
            alias[source] = target
            fixed.add(source)
        else:
            kept.append(node)
    if len(kept) == len(graph.node):
        return 0
    for node in kept:
        node.input[:] = [resolved(name) if name else name for name in node.input]
        node.output[:] = [resolved(name) if name else name for name in node.output]
    dropped = len(graph.node) - len(kept)
    _set_nodes(graph, kept)
    _keep_value_info(graph, {name for node in kept for name in node.output})
    return dropped


CUDA_FLOAT_ONLY_OPS = frozenset(
    {
        "Ceil", "Clip", "ConvTranspose", "Cos", "CumSum", "DepthToSpace", "Einsum", "Elu", "Equal", "Floor",
        "GlobalAveragePool", "GlobalMaxPool", "Greater", "GreaterOrEqual", "InstanceNormalization", "LRN",
        "LeakyRelu", "Less", "LessOrEqual", "Log", "LogSoftmax", "MaxPool", "PRelu", "Pad", "Reciprocal",
        "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin",
        "ReduceProd", "ReduceSumSquare", "Resize", "Round", "Selu", "Sin", "Softplus", "Softsign", "SpaceToDepth",
        "ThresholdedRelu", "TopK",
    }
)  # fmt: skip
"""Standard ops for which ONNX Runtime's CUDA provider has float32 and float16 kernels but no ``bfloat16`` one
(its OperatorKernels table, opset 13 and later)."""


def compute_cuda_bfloat16_gaps_in_float(model: onnx.ModelProto) -> int:
    """Run the ``bfloat16`` nodes of ops in :data:`CUDA_FLOAT_ONLY_OPS` in float32, in place: their ``bfloat16``
    inputs are cast to float32 and their ``bfloat16`` outputs computed in float32 and cast back: rounded once, as
    PyTorch's CUDA kernels, which accumulate in float32, round them. Without this, ONNX Runtime cannot place
    such a node (under autocast, a ``log_softmax`` left in ``bfloat16``) and the op runs in PyTorch. Returns the
    number of nodes moved.

    Example:
        >>> x = helper.make_tensor_value_info("x", onnx.TensorProto.BFLOAT16, [2, 4])
        >>> y = helper.make_tensor_value_info("y", onnx.TensorProto.BFLOAT16, [2, 4])
        >>> model = helper.make_model(helper.make_graph([helper.make_node("LogSoftmax", ["x"], ["y"])], "g", [x], [y]))
        >>> compute_cuda_bfloat16_gaps_in_float(model), [n.op_type for n in model.graph.node]
        (1, ['Cast', 'LogSoftmax', 'Cast'])
    """
    graph = model.graph
    values = _values(graph)
    bf16, float32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT

    def is_bf16(name: str) -> bool:
        return bool(name) and name in values and values[name].elem_type == bf16

    nodes: list[onnx.NodeProto] = []
    widened: list[tuple[str, str]] = []
    moved = 0
    for node in graph.node:
        if node.op_type not in CUDA_FLOAT_ONLY_OPS or not _in_default_domain(node) or not any(map(is_bf16, node.input)):
            nodes.append(node)
            continue
        moved += 1
        for index, name in enumerate(node.input):
            if is_bf16(name):
                cast = f"{node.name or node.output[0]}_in{index}_float"
                nodes.append(helper.make_node("Cast", [name], [cast], f"{cast}_cast", to=float32))
                node.input[index] = cast
                widened.append((cast, name))
        back = []
        for index, name in enumerate(node.output):
            if is_bf16(name):
                computed = f"{name}_float"
                node.output[index] = computed
                back.append(helper.make_node("Cast", [computed], [name], f"{computed}_cast", to=bf16))
                widened.append((computed, name))
        nodes += [node, *back]
    if moved:
        graph.value_info.extend(
            helper.make_tensor_value_info(name, float32, list(values[source].dims)) for name, source in widened
        )
        _set_nodes(graph, nodes)
    return moved


def _bfloat16_attributes_to_float(node: onnx.NodeProto) -> None:
    """Make the ``bfloat16`` element types and tensors of ``node``'s attributes float32 (``ConstantOfShape``'s
    value, a random op's ``dtype``)."""
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.INT and attr.name == "dtype" and attr.i == onnx.TensorProto.BFLOAT16:
            attr.i = onnx.TensorProto.FLOAT
        elif attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == onnx.TensorProto.BFLOAT16:
            attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float32), attr.t.name))


_RESHAPING = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten"})
"""Ops that change a tensor's shape and keep its elements in order."""


def collapse_reshapes(model: onnx.ModelProto) -> int:
    """Drop reshapes that change nothing and shortcut chains of reshapes, in place.

    The export translates every ``view`` of the captured graph, and AOTAutograd's backward views its gradients
    back and forth (``[b*t, c]`` for a product, ``[b, t, c]`` around it), so a transformer's backward graph
    holds many ``Reshape`` nodes, each a kernel launch that ONNX Runtime does not remove. A
    ``Reshape``, ``Squeeze``, ``Unsqueeze`` or ``Flatten`` whose declared input and output shapes are the
    same (static sizes, or the same symbolic size) is dropped unless the graph returns its result. A
    ``Reshape`` to a constant shape that reads a chain of reshaping ops reads the chain's input instead (the
    elements are in the same order); the ops it skipped go when nothing else reads them. Returns the number of
    nodes removed.

    Example:
        >>> x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 4])
        >>> shape_6x4 = numpy_helper.from_array(np.array([6, 4], np.int64), "shape_6x4")
        >>> shape_2x12 = numpy_helper.from_array(np.array([2, 12], np.int64), "shape_2x12")
        >>> nodes = [
        ...     helper.make_node("Reshape", ["x", "shape_6x4"], ["flat"]),
        ...     helper.make_node("Unsqueeze", ["flat", "zero"], ["wide"]),
        ...     helper.make_node("Reshape", ["wide", "shape_2x12"], ["y"]),
        ... ]
        >>> y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
        >>> graph = helper.make_graph(nodes, "g", [x], [y], [shape_6x4, shape_2x12])
        >>> model = helper.make_model(graph)
        >>> collapse_reshapes(model), [(n.op_type, list(n.input)) for n in model.graph.node]
        (2, [('Reshape', ['x', 'shape_2x12'])])
    """
    graph = model.graph
    values = _values(graph)
    constant_shapes = {
        init.name: numpy_helper.to_array(init) for init in graph.initializer if init.data_type == onnx.TensorProto.INT64
    }
    returned = {output.name for output in graph.output}
    producers: dict[str, onnx.NodeProto] = {}
    readers_of: dict[str, str] = {}  # a dropped node's output -> the value its readers read instead
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        node.input[:] = [readers_of.get(name, name) for name in node.input]
        if node.op_type in _RESHAPING and _in_default_domain(node):
            source, result = node.input[0], node.output[0]
            before, after = values.get(source), values.get(result)
            dims = before.dims if before is not None else (None,)
            if result not in returned and None not in dims and after is not None and dims == after.dims:
                readers_of[result] = source
                continue
            if node.op_type == "Reshape" and _independent_of_input_shape(node, constant_shapes):
                while (skipped := producers.get(node.input[0])) is not None and skipped.op_type in _RESHAPING:
                    node.input[0] = skipped.input[0]
        producers.update(dict.fromkeys(node.output, node))
        nodes.append(node)
    removed = len(graph.node) - len(nodes)
    while True:  # drop the reshaping ops nothing reads any more
        read = _read_names(nodes, graph)
        kept = [n for n in nodes if n.op_type not in _RESHAPING or any(output in read for output in n.output)]
        if len(kept) == len(nodes):
            break
        removed += len(nodes) - len(kept)
        nodes = kept
    if removed:
        _replace_nodes(graph, nodes)
    return removed


def merge_slices(model: onnx.ModelProto) -> int:
    """Merge a ``Slice`` of a ``Slice`` on other axes into one ``Slice``, in place.

    The export translates each ``aten.slice`` on its own, so subsampling an image along two axes (a strided 1x1
    convolution's weight gradient reads its input at every other row and column) is two ``Slice`` nodes, each a
    pass over the data; one ``Slice`` over both axes reads the input once. Only slices whose starts, ends, axes
    and steps are constant (initializers), on non-negative axes, merge, and only where the inner slice's result
    is read by the outer one alone. Returns the number of nodes removed.

    Example:
        >>> x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 8, 8])
        >>> constants = [numpy_helper.from_array(np.array([v], np.int64), n) for n, v in
        ...     [("zero", 0), ("end", 7), ("two", 2), ("three", 3)]]
        >>> nodes = [
        ...     helper.make_node("Slice", ["x", "zero", "end", "two", "two"], ["rows"]),
        ...     helper.make_node("Slice", ["rows", "zero", "end", "three", "two"], ["y"]),
        ... ]
        >>> y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
        >>> model = helper.make_model(helper.make_graph(nodes, "g", [x], [y], constants))
        >>> merge_slices(model), [(n.op_type, n.input[0]) for n in model.graph.node]
        (1, [('Slice', 'x')])
    """
    graph = model.graph
    constants = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    readers = Counter(name for node in graph.node for name in node.input)
    returned = {output.name for output in graph.output}
    producers: dict[str, onnx.NodeProto] = {}
    merged: set[int] = set()
    for node in graph.node:
        inner = producers.get(node.input[0]) if node.input else None
        ours, theirs = _slice_parameters(node, constants), _slice_parameters(inner, constants)
        if inner is not None and ours is not None and theirs is not None and readers[node.input[0]] == 1:
            disjoint = not set(ours[2].tolist()) & set(theirs[2].tolist())
            if disjoint and node.input[0] not in returned and (ours[2] >= 0).all() and (theirs[2] >= 0).all():
                names = []
                for role, first, second in zip(("starts", "ends", "axes", "steps"), theirs, ours, strict=True):
                    name = f"{node.name or node.output[0]}_merged_{role}"
                    constants[name] = np.concatenate([first, second])
                    graph.initializer.append(numpy_helper.from_array(constants[name], name))
                    names.append(name)
                node.input[:] = [inner.input[0], *names]
                merged.add(id(inner))
        producers.update(dict.fromkeys(node.output, node))
    if merged:
        _replace_nodes(graph, [node for node in graph.node if id(node) not in merged])
    return len(merged)


def subsample_images(model: onnx.ModelProto) -> int:
    """A ``Slice`` that takes every s-th row and t-th column of float32 images, from the first, becomes
    lightning_ort's ``Subsample`` kernel (``engine/runtime/conv_kernels.cpp``); in place. Only in graphs that
    already use lightning_ort's kernels (their sessions load the library anyway).

    A strided 1x1 convolution's weight gradient reads its input at every other row and column (one ``Slice`` on
    both image axes, :func:`merge_slices`). ONNX Runtime's CPU ``Slice`` copies such a selection element by
    element; the kernel copies it with vector shuffles, the same values (see the performance page). Only
    ``[N, C, H, W]`` inputs of static image size whose slice starts at 0 on both axes and keeps every selected row
    and column to the end are rewritten. Returns the number of slices rewritten.

    Example:
        >>> x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 8, 8])
        >>> constants = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
        ...     [("starts", [0, 0]), ("ends", [7, 7]), ("axes", [2, 3]), ("steps", [2, 2])]]
        >>> node = helper.make_node("Slice", ["x", "starts", "ends", "axes", "steps"], ["y"], "node_slice")
        >>> opsets = [helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)]  # a graph with our kernels
        >>> model = helper.make_model(helper.make_graph([node], "g", [x], [], constants), opset_imports=opsets)
        >>> subsample_images(model), [(n.op_type, n.name) for n in model.graph.node]
        (1, [('Subsample', 'node_slice')])
    """
    if not uses_kernels(model):
        return 0
    graph = model.graph
    constants = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    values = _values(graph)
    rewritten = 0
    for index, node in enumerate(graph.node):
        steps = _image_subsample_steps(node, constants, values)
        if steps is None:
            continue
        subsample = helper.make_node(
            "Subsample",
            [node.input[0]],
            list(node.output),
            node.name,
            domain=DOMAIN,
            row_step=steps[0],
            col_step=steps[1],
        )
        graph.node[index].CopyFrom(subsample)
        rewritten += 1
    return rewritten


KERNEL_MAX_RANK = 8
"""The highest rank a tensor read by lightning_ort's kernels may have (``Tensor`` in ``ort_custom_ops.h``)."""

KERNEL_NCHWC_BLOCK = 16
"""The NCHWc channel block in which lightning_ort's 3x3 weight-gradient kernel reads the output gradient (ONNX
Runtime's on AVX-512)."""


def transpose_in_kernel(model: onnx.ModelProto) -> int:
    """A float32 ``Transpose`` of static shape, of rank at most :data:`KERNEL_MAX_RANK`, becomes lightning_ort's
    ``Transpose`` kernel (``engine/runtime/transpose_kernels.cpp``), which spreads the copy over the session's
    threads; in place. Only in graphs that already use lightning_ort's kernels (their sessions load the library
    anyway), and not for a plain matrix transpose (axes of size 1 dropped and axes that stay adjacent merged, two
    axes swapped), which ONNX Runtime's ``Transpose`` runs on MLAS's vector kernel, faster in a training step (see
    the performance page). Returns the number of transposes rewritten.

    Example:
        >>> x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 4])
        >>> node = helper.make_node("Transpose", ["x"], ["y"], "node_permute", perm=[0, 2, 1])
        >>> opsets = [helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)]  # a graph with our kernels
        >>> model = helper.make_model(helper.make_graph([node], "g", [x], []), opset_imports=opsets)
        >>> transpose_in_kernel(model), [(n.domain, n.op_type) for n in model.graph.node]
        (1, [('ai.lightning_ort', 'Transpose')])
    """
    if not uses_kernels(model):
        return 0
    graph = model.graph
    values = _values(graph)
    rewritten = 0
    for index, node in enumerate(graph.node):
        if node.op_type != "Transpose" or not _in_default_domain(node):
            continue
        data = values.get(node.input[0])
        dims = data.static_shape if data is not None and data.elem_type == onnx.TensorProto.FLOAT else None
        if dims is None or len(dims) > KERNEL_MAX_RANK:
            continue
        perm = list(_attributes(node).get("perm", reversed(range(len(dims)))))
        if len(perm) != len(dims) or _moved_axes(dims, perm) < 3:
            continue
        kernel = helper.make_node("Transpose", list(node.input), list(node.output), node.name, domain=DOMAIN, perm=perm)
        graph.node[index].CopyFrom(kernel)
        rewritten += 1
    return rewritten


def _moved_axes(dims: Sequence[int], perm: Sequence[int]) -> int:
    """How many axes a transpose of ``dims`` by ``perm`` permutes once axes of size 1 are dropped and axes that stay
    adjacent are merged: 0 or 1 for a copy, 2 for a matrix transpose.

    Example:
        >>> _moved_axes([2048, 256], [1, 0]), _moved_axes([4, 1, 8, 16], [0, 2, 1, 3])
        (2, 1)
        >>> _moved_axes([2, 3, 4], [1, 0, 2])
        3
    """
    order = {axis: rank for rank, axis in enumerate(axis for axis in range(len(dims)) if dims[axis] != 1)}
    kept = [order[axis] for axis in perm if axis in order]
    return sum(1 for index, axis in enumerate(kept) if index == 0 or axis != kept[index - 1] + 1)


def _image_subsample_steps(
    node: onnx.NodeProto, constants: dict[str, np.ndarray], values: dict[str, _Value]
) -> tuple[int, int] | None:
    """The row and column steps of a ``Slice`` that :func:`subsample_images` rewrites, else ``None``."""
    parameters = _slice_parameters(node, constants)
    data = values.get(node.input[0]) if parameters is not None else None
    if parameters is None or data is None or data.elem_type != onnx.TensorProto.FLOAT or len(data.dims) != 4:
        return None
    starts, ends, axes, steps = parameters
    sizes = {axis: size for axis, size in ((2, data.dims[2]), (3, data.dims[3])) if isinstance(size, int)}
    if sorted(int(axis) % 4 for axis in axes) != [2, 3] or len(sizes) != 2:
        return None
    slices = {int(a) % 4: (int(b), int(e), int(t)) for a, b, e, t in zip(axes, starts, ends, steps, strict=True)}
    for axis, (start, end, step) in slices.items():
        size = sizes[axis]
        if start != 0 or end <= 0 or step < 1 or -(-min(end, size) // step) != -(-size // step):
            return None
    return slices[2][2], slices[3][2]


def _slice_parameters(
    node: onnx.NodeProto | None, constants: dict[str, np.ndarray]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """A standard ``Slice``'s constant starts, ends, axes and steps (ones where absent), or ``None``."""
    if node is None or node.op_type != "Slice" or not _in_default_domain(node) or len(node.input) < 4:
        return None
    values = [constants.get(name) for name in node.input[1:5]]
    if any(v is None or v.dtype != np.int64 or v.ndim != 1 for v in values):
        return None
    arrays = [v for v in values if v is not None]
    steps = arrays[3] if len(arrays) == 4 else np.ones_like(arrays[0])
    return arrays[0], arrays[1], arrays[2], steps


def _independent_of_input_shape(reshape: onnx.NodeProto, constant_shapes: dict[str, np.ndarray]) -> bool:
    """Whether ``reshape``'s result shape is a constant that does not copy sizes of its input (no ``0``
    entry unless ``allowzero``)."""
    target = constant_shapes.get(reshape.input[1]) if len(reshape.input) > 1 else None
    allowzero = next((attr.i for attr in reshape.attribute if attr.name == "allowzero"), 0)
    return target is not None and (bool(allowzero) or not (target == 0).any())


def split_gemm_bias(model: onnx.ModelProto) -> int:
    """Turn ``Gemm(A, B, bias)`` (a Linear layer with bias) into ``MatMul(A, B)`` and ``Add(bias)``, in place.

    ONNX Runtime's CPU ``Gemm`` first broadcasts the bias into its whole output and then accumulates the
    product onto it; a separate ``Add`` is cheaper. Run
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
    values = _values(model.graph)
    rewritten = 0
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        if node.op_type != "Gemm" or len(node.input) != 3:
            nodes.append(node)
            continue
        attributes = _attributes(node)
        bias = values.get(node.input[2])
        if (
            bias is None
            or len(bias.dims) != 1
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
        _set_nodes(model.graph, nodes)
    return rewritten


def dequantize_scaled_masks(model: onnx.ModelProto) -> int:
    """Turn ``Mul(Cast(mask), scale)``, a ``uint8`` mask scaled to float32 by a scalar constant, into one
    ``DequantizeLinear(mask, scale)``, in place.

    Dropout's saved one-byte keep mask is scaled this way in the forward and in the backward graph
    (:func:`lightning_ort.engine.fx.replacements.dropout`). ONNX Runtime's CPU ``DequantizeLinear`` is vectorised
    and faster than its ``Cast`` from ``uint8`` and the product (``python -m lightning_ort.bench --profile DIR``
    shows both per op type). Only a ``Cast`` whose one
    reader is the product is folded. Returns the number of products rewritten.

    Example:
        >>> cast = helper.make_node("Cast", ["m"], ["f"], to=onnx.TensorProto.FLOAT)
        >>> mul = helper.make_node("Mul", ["f", "s"], ["y"], "node_mul")
        >>> mask = helper.make_tensor_value_info("m", onnx.TensorProto.UINT8, [8])
        >>> scale = helper.make_tensor("s", onnx.TensorProto.FLOAT, [], [1.25])
        >>> model = helper.make_model(helper.make_graph([cast, mul], "g", [mask], [], [scale]))
        >>> dequantize_scaled_masks(model), [n.op_type for n in model.graph.node]
        (1, ['DequantizeLinear'])
    """
    graph = model.graph
    values = _values(graph)
    producers = {output: node for node in graph.node for output in node.output}
    readers = Counter(name for node in graph.node for name in node.input)
    readers.update(output.name for output in graph.output)
    dequantized: dict[str, onnx.NodeProto] = {}  # a product's output -> the node that replaces the product
    folded_casts: set[str] = set()
    for node in graph.node:
        if node.op_type != "Mul" or node.domain != "":
            continue
        for cast_output, scale in (node.input, node.input[::-1]):
            cast = producers.get(cast_output)
            if cast is None or cast.op_type != "Cast" or readers[cast_output] != 1:
                continue
            to = next((attr.i for attr in cast.attribute if attr.name == "to"), None)
            mask, factor = values.get(cast.input[0]), values.get(scale)
            if (
                to == onnx.TensorProto.FLOAT
                and mask is not None
                and mask.elem_type == onnx.TensorProto.UINT8
                and factor == _Value(onnx.TensorProto.FLOAT, ())
            ):
                dequantized[node.output[0]] = helper.make_node(
                    "DequantizeLinear", [cast.input[0], scale], list(node.output), node.name
                )
                folded_casts.add(cast_output)
                break
    if dequantized:
        nodes = [dequantized.get(node.output[0], node) for node in graph.node if node.output[0] not in folded_casts]
        _set_nodes(graph, nodes)
    return len(dequantized)


def sum_rows_by_product(model: onnx.ModelProto) -> int:
    """Turn ``ReduceSum`` over the leading axes of a static-shape float32 tensor into ``ones @ rows``, in place.

    The gradients of biases and of normalisation weights sum the output gradient over every row (``[2048, 1024]``
    -> ``[1024]``); ONNX Runtime's CPU ``ReduceSum`` over the leading axis is about twice as slow as a
    ``MatMul`` of a row of ones by the rows. The data is reshaped to ``[rows, columns]`` (no copy), multiplied, and
    reshaped to the reduction's output. Returns the number of nodes rewritten.

    Example:
        >>> x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [32, 64, 256])
        >>> axes = numpy_helper.from_array(np.array([0, 1], np.int64), "axes")
        >>> node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], "node_sum", keepdims=0)
        >>> model = helper.make_model(helper.make_graph([node], "g", [x], [], [axes]))
        >>> sum_rows_by_product(model), [n.op_type for n in model.graph.node]
        (1, ['Reshape', 'MatMul', 'Reshape'])
    """
    graph = model.graph
    values = _values(graph)
    integers = {init.name: init for init in graph.initializer if init.data_type == onnx.TensorProto.INT64}
    rewritten = 0
    nodes: list[onnx.NodeProto] = []
    initializers: dict[str, onnx.TensorProto] = {}
    for node in graph.node:
        split = _leading_reduction(node, values, integers)
        if split is None:
            nodes.append(node)
            continue
        shape, leading = split
        rows, columns = math.prod(shape[:leading]), math.prod(shape[leading:])
        keepdims = next((attr.i for attr in node.attribute if attr.name == "keepdims"), 1)
        output_shape = [1] * leading * keepdims + shape[leading:]
        prefix = node.name or node.output[0]
        ones, matrix_shape, result_shape = (
            f"lightning_ort_ones_1x{rows}",
            f"{prefix}_rows_shape",
            f"{prefix}_sums_shape",
        )
        initializers[ones] = numpy_helper.from_array(np.ones((1, rows), np.float32), ones)
        matrix, sums = f"{prefix}_rows", f"{prefix}_sums"
        if shape == [rows, columns]:  # already a matrix
            matrix = node.input[0]
        else:
            initializers[matrix_shape] = numpy_helper.from_array(np.array([rows, columns], np.int64), matrix_shape)
            nodes.append(helper.make_node("Reshape", [node.input[0], matrix_shape], [matrix], matrix))
        if output_shape == [1, columns]:  # the product's own shape
            nodes.append(helper.make_node("MatMul", [ones, matrix], list(node.output), node.name))
        else:
            initializers[result_shape] = numpy_helper.from_array(np.array(output_shape, np.int64), result_shape)
            nodes.append(helper.make_node("MatMul", [ones, matrix], [sums], node.name))
            nodes.append(helper.make_node("Reshape", [sums, result_shape], list(node.output), f"{prefix}_reshape"))
        rewritten += 1
    if rewritten:
        _set_nodes(graph, nodes)
        used = _read_names(nodes, graph)
        kept = [init for init in graph.initializer if init.name in used]  # the reductions' axes are not
        del graph.initializer[:]
        graph.initializer.extend([*kept, *initializers.values()])
    return rewritten


def _leading_reduction(
    node: onnx.NodeProto, values: dict[str, _Value], integers: dict[str, onnx.TensorProto]
) -> tuple[list[int], int] | None:
    """``(input shape, number of leading axes summed)`` if :func:`sum_rows_by_product` rewrites ``node``."""
    if node.op_type != "ReduceSum" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
        return None
    data, axes = values.get(node.input[0]), integers.get(node.input[1])
    if data is None or axes is None or data.elem_type != onnx.TensorProto.FLOAT or data.static_shape is None:
        return None
    shape = data.static_shape
    summed = sorted(int(axis) % len(shape) for axis in numpy_helper.to_array(axes).reshape(-1)) if shape else []
    if not summed or summed != list(range(len(summed))) or len(summed) == len(shape):
        return None
    return shape, len(summed)


def weave_projection_grads(model: onnx.ModelProto) -> int:
    """Add a strided 1x1 projection's input gradient inside the phase weave of the 3x3 convolution beside it;
    in place. Returns the number of sums rewritten.

    A downsampling residual block reads its input with a stride-2 3x3 convolution and a stride-2 1x1 projection,
    so the input's gradient is the sum of their input gradients: an ``Interleave2x2`` of four phase convolutions
    (:mod:`lightning_ort.engine.fx.conv_phases`) and a ``ConvTranspose`` of the projection's output gradient,
    which is zero but at the even rows' even columns. There it is the 1x1 convolution of that gradient with the
    transposed kernel, so the sum becomes ``Interleave2x2Add``, which adds that convolution's result while it
    weaves the even-even phase: the transposed convolution (over the whole image) and the sum's pass go.

    Example:
        >>> phases = [f"p{i}" for i in range(4)]
        >>> weave = helper.make_node("Interleave2x2", phases, ["dx"], domain=DOMAIN, height=8, width=8)
        >>> conv_t = helper.make_node("ConvTranspose", ["dy", "w"], ["ds"], strides=[2, 2], output_padding=[1, 1])
        >>> add = helper.make_node("Add", ["dx", "ds"], ["grad"], "node_add")
        >>> inputs = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [2, 16, 4, 4]) for n in phases]
        >>> inputs.append(helper.make_tensor_value_info("dy", onnx.TensorProto.FLOAT, [2, 32, 4, 4]))
        >>> inputs.append(helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [32, 16, 1, 1]))
        >>> out = helper.make_tensor_value_info("grad", onnx.TensorProto.FLOAT, None)
        >>> model = helper.make_model(helper.make_graph([weave, conv_t, add], "g", inputs, [out]))
        >>> weave_projection_grads(model), [n.op_type for n in model.graph.node]
        (1, ['Transpose', 'Conv', 'Interleave2x2Add'])
    """
    graph = model.graph
    producers = {output: node for node in graph.node for output in node.output}
    reads = _read_counts(list(graph.node), graph)
    values = _values(graph)
    rewrites: dict[int, list[onnx.NodeProto]] = {}
    removed: set[int] = set()
    for node in graph.node:
        if node.op_type != "Add" or not _in_default_domain(node) or len(node.input) != 2:
            continue
        pair = [producers.get(name) for name in node.input]
        weave = next((p for p in pair if p is not None and p.op_type == "Interleave2x2" and p.domain == DOMAIN), None)
        transposed = next((p for p in pair if p is not None and p.op_type == "ConvTranspose"), None)
        if weave is None or transposed is None or any(reads[p.output[0]] != 1 for p in (weave, transposed)):
            continue
        size = _attributes(weave)
        projection = _strided_projection(transposed, values, size["height"], size["width"])
        if projection is None:
            continue
        prefix = node.name or node.output[0]
        kernel, grad = f"{prefix}_projection_kernel", f"{prefix}_projection_grad"
        out_channels, in_channels = projection
        rewrites[id(node)] = [
            helper.make_node("Transpose", [transposed.input[1]], [kernel], kernel, perm=[1, 0, 2, 3]),
            helper.make_node("Conv", [transposed.input[0], kernel], [grad], f"{prefix}_projection"),
            helper.make_node(
                "Interleave2x2Add", [*weave.input, grad], list(node.output), prefix, domain=DOMAIN, **size
            ),
        ]
        graph.value_info.append(
            helper.make_tensor_value_info(kernel, onnx.TensorProto.FLOAT, [in_channels, out_channels, 1, 1])
        )
        batch, _, *image = values[transposed.input[0]].dims
        graph.value_info.append(
            helper.make_tensor_value_info(grad, onnx.TensorProto.FLOAT, [batch, in_channels, *image])
        )
        removed.update({id(weave), id(transposed)})
    if rewrites:
        nodes: list[onnx.NodeProto] = []
        for node in graph.node:
            if id(node) not in removed:
                nodes += rewrites.get(id(node), [node])
        _set_nodes(graph, nodes)
    return len(rewrites)


def _strided_projection(
    node: onnx.NodeProto, values: dict[str, _Value], height: int, width: int
) -> tuple[int, int] | None:
    """``(out_channels, in_channels)`` of the forward 1x1 stride-2 convolution whose input gradient the float32
    ``ConvTranspose`` ``node`` is, onto a ``height`` x ``width`` image, else ``None``."""
    if not _in_default_domain(node) or len(node.input) != 2:
        return None
    attributes = _attributes(node)
    if attributes.get("strides") != [2, 2] or attributes.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        return None
    if any(attributes.get(name, default) != default for name, default in _PLAIN_TRANSPOSED.items()):
        return None
    grad, weight = values.get(node.input[0]), values.get(node.input[1])
    if grad is None or weight is None or weight.static_shape is None or weight.elem_type != onnx.TensorProto.FLOAT:
        return None
    if len(grad.dims) != 4 or list(grad.dims[2:]) != [(height + 1) // 2, (width + 1) // 2]:
        return None
    out_channels, in_channels, *kernel = weight.static_shape
    return (out_channels, in_channels) if kernel == [1, 1] else None


_PLAIN_TRANSPOSED: dict[str, Any] = {"group": 1, "dilations": [1, 1], "pads": [0, 0, 0, 0], "output_shape": None}
"""The attributes of a ``ConvTranspose`` that :func:`_strided_projection` requires, at these values or absent."""


def use_nchwc_convolutions(model: onnx.ModelProto, block: int, kernels: bool = False) -> int:
    """Run 2-D convolutions on ONNX Runtime's NCHWc kernels, their weights reordered in the graph; in place.

    A float32 ``Conv`` with a 4-d input and static channel counts that are multiples of ``block``
    (:func:`nchwc_block_size`), either dense (``group=1``) or depthwise (``group`` = input channels = output
    channels), becomes ``ReorderInput`` -> ``com.microsoft.nchwc.Conv`` -> ``ReorderOutput``, its weight turned
    into the kernel's blocked layout in the graph (the weights are graph inputs, updated every step). On batches
    of images that is faster than plain ``Conv`` (which multiplies one image at a time, and runs a depthwise
    convolution as one small product per channel), reorders included. The rest (other grouped convolutions, a
    first layer's 3 input channels) stays as it is. Returns the number of nodes rewritten.

    In a graph that already uses lightning_ort's kernels (``kernels``: its session loads their library), a dense
    weight is blocked by one ``ai.lightning_ort::BlockWeight`` node, one pass over it; the input gradient's
    flipped kernel by one too (its ``flip`` form). Elsewhere the weights are reordered by ``ReorderInput`` nodes,
    MLAS's threaded channel blocking. A dense weight takes two: the first blocks the input channels
    (``[O, I, kh, kw]`` to ``[O, I/B, kh, kw, Bi]``), the second, on that viewed as
    ``[O/B, Bo, I/B * kh * kw * Bi, 1]``, blocks the output channels innermost (``OIHWBiBo``). ONNX Runtime's
    ``Transpose`` does the same reorder in one node single-threaded, several times slower (see the performance
    page). A depthwise weight ``[C, 1, kh, kw]``, viewed as ``[1, C, kh * kw, 1]``, takes one
    (``OIHWBo``). The depthwise convolutions of the backward (a depthwise weight gradient is one, whose kernel is
    the output gradient) take the same path. The input gradient's kernel, the forward weight transposed and its
    taps reversed (:func:`_flipped_kernel`), is blocked from the forward weight directly, without the transpose
    and the reversal (:func:`_flipped_nchwc`). The kernels of a stride-2 input gradient's phase convolutions,
    each a selection of one weight's taps (:func:`_tap_selection`), are tiles of that weight blocked once
    (:func:`_selected_taps`). lightning_ort's ``ConvWeightGrad3x3`` reads its output gradient blocked: the copy
    that the input gradient's convolution reads (:func:`_blocked_weight_grad`); it needs ``block`` to be
    :data:`KERNEL_NCHWC_BLOCK`, which capture checks before it records the kernel.

    Example:
        >>> x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 16, 8, 8])
        >>> w = helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [32, 16, 3, 3])
        >>> conv = helper.make_node("Conv", ["x", "w"], ["y"], "node_conv", pads=[1, 1, 1, 1])
        >>> model = helper.make_model(helper.make_graph([conv], "g", [x, w], []))
        >>> use_nchwc_convolutions(model, 16), [n.op_type for n in model.graph.node]
        (1, ['ReorderInput', 'Reshape', 'ReorderInput', 'Reshape', 'ReorderInput', 'Conv', 'ReorderOutput'])
    """
    if block <= 1 and not any(_is_weight_grad_kernel(node) for node in model.graph.node):
        return 0
    values = _values(model.graph)
    producers = {output: node for node in model.graph.node for output in node.output}
    initializers_by_name = {init.name: init for init in model.graph.initializer}
    rewritten = 0
    nodes: list[onnx.NodeProto] = []
    initializers: list[onnx.TensorProto] = []
    replaced: list[onnx.NodeProto] = []
    blocked_sources: set[str] = set()
    for node in model.graph.node:
        if _is_weight_grad_kernel(node):
            nodes += _blocked_weight_grad(node, block)
            rewritten += 1
            continue
        weight_shape = _nchwc_weight_shape(node, values, block)
        if weight_shape is None:
            nodes.append(node)
            continue
        out_channels, in_channels = weight_shape[:2]
        prefix = f"{node.name or node.output[0]}_nchwc"
        folded = _folded_pad(node, producers, initializers_by_name)
        if folded is not None:
            node, pad = folded
            replaced.append(pad)
        if in_channels == 1 and out_channels > 1:
            nodes += _depthwise_nchwc(node, weight_shape, prefix, initializers)
            rewritten += 1
            continue
        flipped = _flipped_kernel(node.input[1], weight_shape, producers, initializers_by_name, values)
        if flipped is not None:
            source, chain = flipped
            if kernels:
                nodes += [_block_weight(source, f"{prefix}_weight", block, flip=True)]
                nodes += _blocked_conv(node, f"{prefix}_weight", prefix, weight_shape)
            else:
                nodes += _flipped_nchwc(node, source, weight_shape, block, prefix, initializers)
            replaced += chain
            rewritten += 1
            continue
        selection = _tap_selection(node.input[1], weight_shape, producers, initializers_by_name, values)
        if selection is not None:
            source, source_shape, taps, chain = selection
            if source not in blocked_sources:
                blocked_sources.add(source)
                nodes += _dense_blocked(source, source_shape, block, f"{source}_nchwc", initializers, kernels)
            nodes += _selected_taps(node, source, source_shape, taps, weight_shape, block, prefix, initializers)
            replaced += chain
            rewritten += 1
            continue
        nodes += _dense_blocked(node.input[1], weight_shape, block, prefix, initializers, kernels)
        nodes += _blocked_conv(node, f"{prefix}_weight", prefix, weight_shape)
        rewritten += 1
    if rewritten:
        _set_nodes(model.graph, _shared_reorders(_without_unread(nodes, replaced, model.graph)))
        model.graph.initializer.extend(initializers)
        if not any(opset.domain == _NCHWC for opset in model.opset_import):
            model.opset_import.append(helper.make_opsetid(_NCHWC, 1))
    return rewritten


def fold_channels_last_transposes(model: onnx.ModelProto) -> int:
    """Fold channels-last ``Transpose`` nodes into the NCHWc reorders next to them, in place.

    ``Transpose(perm=[0, 2, 3, 1])`` of a ``ReorderOutput`` that nothing else reads becomes that
    ``ReorderOutput`` with ``channels_last=1``; ``Transpose(perm=[0, 3, 1, 2])`` that only ``ReorderInput``
    nodes read is dropped and they take its input with ``channels_last=1``. Returns the number of transposes
    folded.

    Example:
        >>> nodes = [
        ...     helper.make_node("ReorderOutput", ["b"], ["y"], domain=_NCHWC, channels=16),
        ...     helper.make_node("Transpose", ["y"], ["z"], perm=[0, 2, 3, 1]),
        ... ]
        >>> model = helper.make_model(helper.make_graph(nodes, "g", [], []))
        >>> fold_channels_last_transposes(model), [(n.op_type, list(n.output)) for n in model.graph.node]
        (1, [('ReorderOutput', ['z'])])
    """
    graph = model.graph
    reads = _read_counts(list(graph.node), graph)
    producers = {output: node for node in graph.node for output in node.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    dropped: set[int] = set()
    for node in graph.node:
        if node.op_type != "Transpose" or not _in_default_domain(node):
            continue
        perm = _attributes(node).get("perm")
        source = producers.get(node.input[0])
        if perm == [0, 2, 3, 1] and _is_nchwc(source, "ReorderOutput") and reads[node.input[0]] == 1:
            assert source is not None
            if _attributes(source).get("channels_last", 0):
                continue
            source.output[0] = node.output[0]
            source.attribute.append(helper.make_attribute("channels_last", 1))
            dropped.add(id(node))
        elif perm == [0, 3, 1, 2]:
            reorders = readers.get(node.output[0], [])
            if not reorders or reads[node.output[0]] != len(reorders):
                continue
            if not all(_is_nchwc(r, "ReorderInput") and not _attributes(r).get("channels_last", 0) for r in reorders):
                continue
            for reorder in reorders:
                reorder.input[0] = node.input[0]
                reorder.attribute.append(helper.make_attribute("channels_last", 1))
            dropped.add(id(node))
    if dropped:
        _replace_nodes(graph, [node for node in graph.node if id(node) not in dropped])
    return len(dropped)


def read_pooled_grads_per_plane(model: onnx.ModelProto) -> int:
    """Let lightning_ort's batch-norm gradient kernels read a global average pool's gradient one value per plane,
    in place.

    The gradient of a global average pool over ``[N, C, H, W]`` is the pooled gradient ``g`` (``[N, C, 1, 1]``)
    expanded over each plane and divided by the plane's size, ``Div(Expand(g, shape), size)``: two passes that
    write the whole activation (ONNX Runtime's CPU ``Expand`` is slow on it too) for a batch-norm gradient to read
    once. Where that gradient is their only reader, the division moves onto ``g`` and the kernel reads it as it
    is, one value per plane (``engine/runtime/batch_norm_kernels.cpp``): the same values. Returns the number of
    expands removed.

    Example:
        >>> g = helper.make_tensor_value_info("g", onnx.TensorProto.FLOAT, [2, 16, 1, 1])
        >>> x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 16, 4, 4])
        >>> constants = [numpy_helper.from_array(np.array([2, 16, 4, 4]), "shape"),
        ...              numpy_helper.from_array(np.array(16.0, np.float32), "size")]
        >>> nodes = [
        ...     helper.make_node("Expand", ["g", "shape"], ["e"]),
        ...     helper.make_node("Div", ["e", "size"], ["dy"]),
        ...     helper.make_node("BatchNormTrainingGrad", ["dy", "x", "w", "b", "m", "s"], ["dx", "dw", "db"],
        ...                      domain=DOMAIN),
        ... ]
        >>> model = helper.make_model(helper.make_graph(nodes, "g", [g, x], [], constants))
        >>> read_pooled_grads_per_plane(model), [(n.op_type, list(n.input)[:2]) for n in model.graph.node]
        (1, [('Div', ['g', 'size']), ('BatchNormTrainingGrad', ['dy', 'x'])])
    """
    graph = model.graph
    nodes = list(graph.node)
    producers = {output: node for node in nodes for output in node.output}
    reads = _read_counts(nodes, graph)
    values = _values(graph)
    divisors = {init.name for init in graph.initializer if math.prod(init.dims) == 1}
    dropped: set[int] = set()
    resized: dict[str, _Value] = {}
    for node in nodes:
        if node.domain != DOMAIN or node.op_type not in ("BatchNormTrainingGrad", "BatchNormAddTrainingGrad"):
            continue
        div = producers.get(node.input[0])
        if div is None or div.op_type != "Div" or not _in_default_domain(div) or div.input[1] not in divisors:
            continue
        expand = producers.get(div.input[0])
        if expand is None or expand.op_type != "Expand" or not _in_default_domain(expand):
            continue
        if reads[div.output[0]] != 1 or reads[expand.output[0]] != 1:
            continue
        pooled, x = values.get(expand.input[0]), values.get(node.input[1])
        if pooled is None or x is None or len(x.dims) < 3 or len(pooled.dims) != len(x.dims):
            continue
        if None in x.dims[:2] or pooled.dims[:2] != x.dims[:2] or any(d != 1 for d in pooled.dims[2:]):
            continue
        div.input[0] = expand.input[0]
        dropped.add(id(expand))
        resized[div.output[0]] = pooled
    if dropped:
        _replace_nodes(graph, [node for node in nodes if id(node) not in dropped])
        _keep_value_info(graph, {value.name for value in graph.value_info} - set(resized))
        graph.value_info.extend(
            helper.make_tensor_value_info(name, value.elem_type, list(value.dims)) for name, value in resized.items()
        )
    return len(dropped)


_BLOCKED_GRADIENTS = {"BatchNormTrainingGrad": (0,), "BatchNormAddTrainingGrad": (0, 3)}
"""lightning_ort's batch-norm gradient kernels that read dY and write these outputs in NCHWc blocks (``block``)."""

_BLOCKED_WEAVES = ("Interleave2x2", "Interleave2x2Add")

_BLOCKED_GRADIENT_CACHE_BYTES = 1 << 20
"""The most data a batch-norm gradient's block of channels may span for :func:`keep_gradients_blocked` to give it
the NCHWc layout: an L2 cache. Past it, the blocked kernel, which reads the saved X (and Y) in NCHW 16 planes at a
time and transposes them in registers, costs more than the reorders it saves; blocks as such are not the cost (a
two-pass loop over data already blocked ran as fast as over planes). Measured in docs/performance.md, "Gradients
in NCHWc blocks" and "Saved tensors in NCHWc blocks: measured, not adopted"."""


def keep_gradients_blocked(model: onnx.ModelProto, block: int) -> int:
    """Keep the backward's gradients in NCHWc blocks between the convolutions that produce and read them; in place.

    After :func:`use_nchwc_convolutions`, each input-gradient convolution of a conv/batch-norm net writes its
    result in ``block``-channel NCHWc blocks, a ``ReorderOutput`` turns it plain for the batch-norm gradient, and
    a ``ReorderInput`` blocks that gradient's result again for the next convolution (and lightning_ort's 3x3
    weight-gradient kernel): two passes over each activation-sized gradient that carry nothing. Here lightning_ort's
    kernels between them take the blocked layout instead (their ``block`` attribute): the batch-norm gradients
    (dY, dX and a residual's dZ; X and Y stay plain, as the forward saved them) and the phase weave of a stride-2
    convolution's input gradient, and so does a standard ``Add`` of two blocked gradients (a residual's sum, the
    same elementwise in either layout). A value a switched node writes gets one ``ReorderOutput`` for the readers
    that need it plain (PyTorch, a weight gradient's product); ``ReorderInput`` nodes of a value now blocked are
    dropped, and ``ReorderOutput`` nodes left unread. A node switches where that drops more reorders than it adds.
    The kernels read 16-channel blocks on AVX-512 CPUs (:data:`KERNEL_NCHWC_BLOCK`); other blocks change
    nothing. Returns the number of nodes switched.

    Example:
        >>> shape = [2, 32, 8, 8]
        >>> x, dy = (helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, shape) for n in ("x", "dy"))
        >>> nodes = [
        ...     helper.make_node("ReorderInput", ["dy"], ["dy_b"], domain=_NCHWC),
        ...     helper.make_node("Conv", ["dy_b", "w"], ["dg_b"], domain=_NCHWC),
        ...     helper.make_node("ReorderOutput", ["dg_b"], ["dg"], domain=_NCHWC, channels=32),
        ...     helper.make_node("BatchNormTrainingGrad", ["dg", "x", "s", "b", "m", "i"], ["dx", "ds", "db"],
        ...                      domain=DOMAIN),
        ...     helper.make_node("ReorderInput", ["dx"], ["dx_b"], domain=_NCHWC),
        ...     helper.make_node("Conv", ["dx_b", "w2"], ["out_b"], domain=_NCHWC),
        ... ]
        >>> graph = helper.make_graph(nodes, "g", [x, dy], [], value_info=[
        ...     helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, shape) for n in ("dg", "dx")])
        >>> model = helper.make_model(graph, opset_imports=[helper.make_opsetid(DOMAIN, 1)])
        >>> keep_gradients_blocked(model, 16), [n.op_type for n in model.graph.node]
        (1, ['ReorderInput', 'Conv', 'BatchNormTrainingGrad', 'Conv'])
    """
    if block != KERNEL_NCHWC_BLOCK or not uses_kernels(model) or _has_subgraphs(model.graph):
        return 0
    graph = model.graph
    nodes = list(graph.node)
    values = _values(graph)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    graph_outputs = {output.name for output in graph.output}
    twins = {
        node.output[0]: node.input[0]
        for node in nodes
        if _is_blocked_reorder(node, "ReorderOutput") and _block_channels(values.get(node.output[0]), block) is not None
    }
    taken = {name for node in nodes for name in node.output} | {value.name for value in graph.input}
    rewritten: list[onnx.NodeProto] = []
    reorders: list[onnx.NodeProto] = []
    switched = 0
    for node in nodes:
        layout = _blocked_layout(node, values, block)
        if layout is None or not _switch_pays(node, layout, twins, readers, graph_outputs):
            rewritten.append(node)
            continue
        for index in layout.inputs:
            node.input[index] = twins[node.input[index]]
        if node.domain == DOMAIN:
            node.attribute.append(helper.make_attribute("block", block))
        rewritten.append(node)
        for index in layout.outputs:
            plain = node.output[index]
            blocked = _fresh_name(f"{plain}_nchwc", taken)
            node.output[index] = blocked
            twins[plain] = blocked
            reorder = helper.make_node(
                "ReorderOutput",
                [blocked],
                [plain],
                f"{blocked}_reorder_output",
                domain=_NCHWC,
                channels=layout.channels,
            )
            rewritten.append(reorder)
            reorders.append(reorder)
        switched += 1
    if not switched:
        return 0
    renamed: dict[str, str] = {}
    kept: list[onnx.NodeProto] = []
    for node in rewritten:
        for index, name in enumerate(node.input):
            node.input[index] = renamed.get(name, name)
        if _is_blocked_reorder(node, "ReorderInput") and node.input[0] in twins and node.output[0] not in graph_outputs:
            renamed[node.output[0]] = twins[node.input[0]]
            continue
        kept.append(node)
    reorders += [node for node in kept if _is_nchwc(node, "ReorderOutput")]
    _replace_nodes(graph, _without_unread(kept, reorders, graph))
    return switched


def _block_channels(value: _Value | None, block: int) -> int | None:
    """The channels ``C`` of ``value`` if it is a float32 ``[N, C, H, W]`` with ``C`` static and a multiple of
    ``block`` (the same shape plain and in NCHWc blocks), else ``None``."""
    if value is None or value.elem_type != onnx.TensorProto.FLOAT or len(value.dims) != 4:
        return None
    channels = value.dims[1]
    return channels if isinstance(channels, int) and channels > 0 and channels % block == 0 else None


@dataclass(frozen=True)
class _BlockedLayout:
    """The inputs and outputs of a node that :func:`keep_gradients_blocked` can keep in NCHWc blocks, by
    position, and their channel count."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    channels: int


def _blocked_layout(node: onnx.NodeProto, values: dict[str, _Value], block: int) -> _BlockedLayout | None:
    """Which of ``node``'s values :func:`keep_gradients_blocked` could keep in NCHWc blocks, or ``None`` where
    it cannot take that layout."""
    if node.domain == DOMAIN and node.op_type in _BLOCKED_GRADIENTS:
        x, grad = values.get(node.input[1]), values.get(node.input[0])
        if x is None or grad is None or x.static_shape is None or _block_channels(x, block) is None:
            return None
        per_plane = list(grad.dims) == [*x.dims[:2], 1, 1]
        if not per_plane and grad.dims != x.dims:
            return None
        batch, channels, height, width = x.static_shape
        planes = len(node.input) - 4 - int(per_plane)  # dY, X and Y: the arrays both passes read
        if batch * height * width * block * 4 * planes > _BLOCKED_GRADIENT_CACHE_BYTES:
            return None
        return _BlockedLayout(() if per_plane else (0,), _BLOCKED_GRADIENTS[node.op_type], channels)
    output = values.get(node.output[0])
    out_channels = _block_channels(output, block)
    if output is None or out_channels is None:
        return None
    if node.domain == DOMAIN and node.op_type in _BLOCKED_WEAVES:
        if any(_block_channels(values.get(name), block) is None for name in node.input):
            return None
        return _BlockedLayout(tuple(range(len(node.input))), (0,), out_channels)
    if node.op_type == "Add" and _in_default_domain(node) and len(node.input) == 2:
        if any(name not in values or values[name].dims != output.dims for name in node.input):
            return None
        return _BlockedLayout((0, 1), (0,), out_channels)
    return None


def _switch_pays(
    node: onnx.NodeProto,
    layout: _BlockedLayout,
    twins: dict[str, str],
    readers: dict[str, list[onnx.NodeProto]],
    graph_outputs: set[str],
) -> bool:
    """Whether ``node`` should read and write NCHWc blocks: each of its layout inputs has a blocked copy, and
    the reorders it drops (its inputs' ``ReorderOutput``, its outputs' ``ReorderInput``) outnumber those it adds
    (a ``ReorderOutput`` for each output read plain, but by nodes that may take blocks themselves)."""
    if any(node.input[index] not in twins for index in layout.inputs):
        return False
    dropped, added = len(layout.inputs), 0
    for index in layout.outputs:
        name = node.output[index]
        kinds = [_reader_kind(reader, name) for reader in readers.get(name, [])]
        dropped += kinds.count("reorder")
        if "plain" in kinds or name in graph_outputs:
            added += 1
    return dropped > added


def _reader_kind(reader: onnx.NodeProto, name: str) -> str:
    """How ``reader`` reads ``name`` for :func:`_switch_pays`: through a ``ReorderInput`` (``"reorder"``), as a
    node that may take NCHWc blocks (``"blocks"``), or plain."""
    if _is_blocked_reorder(reader, "ReorderInput"):
        return "reorder"
    if reader.domain == DOMAIN and reader.op_type in _BLOCKED_GRADIENTS:
        return "blocks" if reader.input[0] == name else "plain"
    if (reader.domain == DOMAIN and reader.op_type in _BLOCKED_WEAVES) or (
        reader.op_type == "Add" and _in_default_domain(reader)
    ):
        return "blocks"
    return "plain"


def _is_blocked_reorder(node: onnx.NodeProto, op_type: str) -> bool:
    """Whether ``node`` is an NCHWc ``op_type`` reorder between NCHW and NCHWc, not its channels-last form."""
    return _is_nchwc(node, op_type) and not _attributes(node).get("channels_last", 0)


def _fresh_name(name: str, taken: set[str]) -> str:
    """``name``, or ``name`` with the first free numeric suffix, added to ``taken``."""
    fresh, suffix = name, 1
    while fresh in taken:
        fresh, suffix = f"{name}_{suffix}", suffix + 1
    taken.add(fresh)
    return fresh


def _is_nchwc(node: onnx.NodeProto | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain == _NCHWC


def _block_weight(weight: str, blocked: str, block: int, flip: bool) -> onnx.NodeProto:
    """``BlockWeight`` of ``weight`` into ``blocked``: its ``OIHWBiBo`` layout, or with ``flip`` that of its
    input-gradient kernel (transposed, taps reversed), in one pass (``engine/runtime/conv_kernels.cpp``)."""
    return helper.make_node("BlockWeight", [weight], [blocked], blocked, domain=DOMAIN, block=block, flip=int(flip))


def _dense_blocked(
    weight: str,
    weight_shape: list[int],
    block: int,
    prefix: str,
    initializers: list[onnx.TensorProto],
    kernels: bool,
) -> list[onnx.NodeProto]:
    """The nodes that block the dense weight ``weight`` ``[O, I, kh, kw]`` into ``{prefix}_weight``, its
    ``OIHWBiBo`` layout: one ``BlockWeight`` with ``kernels``, else ``ReorderInput`` blocks the input channels
    and a second on a ``[O/B, Bo, rest, 1]`` view the output channels innermost."""
    if kernels:
        return [_block_weight(weight, f"{prefix}_weight", block, flip=False)]
    out_channels, in_channels, *kernel = weight_shape
    split_shape, blocked_shape = f"{prefix}_split_shape", f"{prefix}_weight_shape"
    inputs_blocked, split_weight, ordered_weight = f"{prefix}_in_blocked", f"{prefix}_split", f"{prefix}_ordered"
    blocked = f"{prefix}_weight"
    split = [out_channels // block, block, in_channels * math.prod(kernel), 1]
    initializers += [
        numpy_helper.from_array(np.array(split, np.int64), split_shape),
        numpy_helper.from_array(np.array(weight_shape, np.int64), blocked_shape),
    ]
    return [
        helper.make_node("ReorderInput", [weight], [inputs_blocked], inputs_blocked, domain=_NCHWC),
        helper.make_node("Reshape", [inputs_blocked, split_shape], [split_weight], split_weight),
        helper.make_node("ReorderInput", [split_weight], [ordered_weight], ordered_weight, domain=_NCHWC),
        helper.make_node("Reshape", [ordered_weight, blocked_shape], [blocked], blocked),
    ]


def _tap_selection(
    weight: str,
    weight_shape: list[int],
    producers: dict[str, onnx.NodeProto],
    initializers: dict[str, onnx.TensorProto],
    values: dict[str, _Value],
) -> tuple[str, list[int], list[int], list[onnx.NodeProto]] | None:
    """``(source, its shape, the taps selected in kernel order, the nodes that select them)`` if ``weight`` is a
    selection of another weight's kernel rows and columns by constant indices (a ``Gather`` on axis 2, then one
    on axis 3), as the phase convolutions of a stride-2 input gradient take their kernels, else ``None``."""
    by_column = producers.get(weight)
    by_row = by_column and producers.get(by_column.input[0])
    chain = [node for node in (by_column, by_row) if node is not None]
    if len(chain) != 2 or any(node.op_type != "Gather" or not _in_default_domain(node) for node in chain):
        return None
    source = values.get(chain[1].input[0])
    if source is None or source.static_shape is None or len(source.static_shape) != 4:
        return None
    out_channels, in_channels, height, width = source.static_shape
    if [out_channels, in_channels] != weight_shape[:2]:
        return None
    picked = []
    for node, axis, size in ((chain[1], 2, height), (chain[0], 3, width)):
        attributes = _attributes(node)
        indices = initializers.get(node.input[1])
        if attributes.get("axis", 0) != axis or indices is None or len(indices.dims) != 1:
            return None
        positions = [int(i) for i in numpy_helper.to_array(indices)]
        if not positions or not all(-size <= i < size for i in positions):
            return None
        picked.append([i % size for i in positions])
    rows, columns = picked
    return chain[1].input[0], source.static_shape, [row * width + column for row in rows for column in columns], chain


def _selected_taps(
    node: onnx.NodeProto,
    source: str,
    source_shape: list[int],
    taps: list[int],
    weight_shape: list[int],
    block: int,
    prefix: str,
    initializers: list[onnx.TensorProto],
) -> list[onnx.NodeProto]:
    """``node`` on NCHWc kernels with its kernel, the ``taps`` of ``source``, gathered as ``B x B`` tiles of
    ``source``'s blocked layout (``{source}_nchwc_weight``, :func:`_dense_blocked`)."""
    out_blocks, in_blocks = source_shape[0] // block, source_shape[1] // block
    source_taps = math.prod(source_shape[2:])
    order = [(pair * source_taps + tap) for pair in range(out_blocks * in_blocks) for tap in taps]
    tiles, selected, weight = f"{prefix}_tiles", f"{prefix}_selected", f"{prefix}_weight"
    shapes = {
        f"{prefix}_tiles_shape": [out_blocks * in_blocks * source_taps, block * block],
        f"{prefix}_weight_shape": weight_shape,
    }
    initializers += [numpy_helper.from_array(np.array(shape, np.int64), name) for name, shape in shapes.items()]
    initializers.append(numpy_helper.from_array(np.array(order, np.int64), f"{prefix}_tile_order"))
    return [
        helper.make_node("Reshape", [f"{source}_nchwc_weight", f"{prefix}_tiles_shape"], [tiles], tiles),
        helper.make_node("Gather", [tiles, f"{prefix}_tile_order"], [selected], selected, axis=0),
        helper.make_node("Reshape", [selected, f"{prefix}_weight_shape"], [weight], weight),
        *_blocked_conv(node, weight, prefix, weight_shape),
    ]


def _flipped_kernel(
    weight: str,
    weight_shape: list[int],
    producers: dict[str, onnx.NodeProto],
    initializers: dict[str, onnx.TensorProto],
    values: dict[str, _Value],
) -> tuple[str, list[onnx.NodeProto]] | None:
    """The forward weight ``W`` ``[O, I, kh, kw]`` whose transposed, tap-reversed kernel ``weight`` is, with the
    nodes that compute it, if ``weight`` is the input-gradient kernel of a dense convolution as the
    decomposition exports it (``Reshape`` to ``[1, O, I, kh, kw]``, ``Transpose`` of ``O`` and ``I``,
    ``Reshape`` to ``[-1, taps]`` (possibly through other shapes), ``MatMul`` with the exchange matrix,
    ``Reshape`` to ``[I, O, kh, kw]``).
    """
    chain: list[onnx.NodeProto] = []

    def producer(name: str, op_type: str) -> onnx.NodeProto | None:
        node = producers.get(name)
        if node is None or node.op_type != op_type or not _in_default_domain(node):
            return None
        chain.append(node)
        return node

    kernel_view = producer(weight, "Reshape")
    matmul = kernel_view and producer(kernel_view.input[0], "MatMul")
    if matmul is None:
        return None
    name = matmul.input[0]
    while (view := producer(name, "Reshape")) is not None:
        name = view.input[0]
    transpose = producer(name, "Transpose")
    grouped = transpose and producer(transpose.input[0], "Reshape")
    if transpose is None or grouped is None:
        return None
    name = grouped.input[0]
    source = values.get(name)
    flipped_out, flipped_in, *kernel = weight_shape
    if source is None or source.static_shape != [flipped_in, flipped_out, *kernel]:
        return None
    taps = math.prod(kernel)
    exchange = initializers.get(matmul.input[1])
    if exchange is None or list(exchange.dims) != [taps, taps]:
        return None
    if not np.array_equal(numpy_helper.to_array(exchange), np.eye(taps, dtype=np.float32)[::-1]):
        return None
    perm = next((list(attr.ints) for attr in transpose.attribute if attr.name == "perm"), None)
    transposed = values.get(transpose.input[0])
    if perm != [0, 2, 1, 3, 4] or transposed is None or transposed.static_shape != [1, *source.static_shape]:
        return None
    return name, chain


def _flipped_nchwc(
    node: onnx.NodeProto,
    source: str,
    weight_shape: list[int],
    block: int,
    prefix: str,
    initializers: list[onnx.TensorProto],
) -> list[onnx.NodeProto]:
    """The nodes that run ``node`` (whose kernel is ``source`` ``[O, I, kh, kw]`` transposed and tap-reversed)
    on NCHWc kernels: two ``ReorderInput`` block ``source``'s output then input channels into
    ``[O/B, I/B, taps, Bo, Bi]``, and one ``Gather`` of its ``B x B`` tiles swaps the block axes and reverses the
    taps, giving ``[I/B, O/B, taps reversed, Bo, Bi]``: the ``OIHWBiBo`` layout of the flipped kernel.
    """
    in_channels, out_channels, *kernel = weight_shape  # the forward convolution's I and O: the kernel is [I, O, ...]
    taps = math.prod(kernel)
    in_blocks, out_blocks = in_channels // block, out_channels // block
    tiles = np.arange(out_blocks * in_blocks * taps).reshape(out_blocks, in_blocks, taps)
    order = tiles.transpose(1, 0, 2)[:, :, ::-1].reshape(-1)
    names = [f"{prefix}_{name}" for name in ("view", "by_out", "outer", "blocked", "tiles", "flipped", "weight")]
    view, by_out, outer, blocked, tiles_name, flipped, weight = names
    shapes = {
        f"{prefix}_view_shape": [1, out_channels, in_channels * taps, 1],
        f"{prefix}_outer_shape": [out_blocks, in_channels, taps * block, 1],
        f"{prefix}_tiles_shape": [out_blocks * in_blocks * taps, block * block],
        f"{prefix}_weight_shape": weight_shape,
    }
    initializers += [numpy_helper.from_array(np.array(shape, np.int64), name) for name, shape in shapes.items()]
    initializers.append(numpy_helper.from_array(order.astype(np.int64), f"{prefix}_tile_order"))
    return [
        helper.make_node("Reshape", [source, f"{prefix}_view_shape"], [view], view),
        helper.make_node("ReorderInput", [view], [by_out], by_out, domain=_NCHWC),
        helper.make_node("Reshape", [by_out, f"{prefix}_outer_shape"], [outer], outer),
        helper.make_node("ReorderInput", [outer], [blocked], blocked, domain=_NCHWC),
        helper.make_node("Reshape", [blocked, f"{prefix}_tiles_shape"], [tiles_name], tiles_name),
        helper.make_node("Gather", [tiles_name, f"{prefix}_tile_order"], [flipped], flipped, axis=0),
        helper.make_node("Reshape", [flipped, f"{prefix}_weight_shape"], [weight], weight),
        *_blocked_conv(node, weight, prefix, weight_shape),
    ]


def _without_unread(
    nodes: list[onnx.NodeProto], candidates: list[onnx.NodeProto], graph: onnx.GraphProto
) -> list[onnx.NodeProto]:
    """``nodes`` less those of ``candidates`` whose outputs nothing reads any more.

    ``candidates`` come consumer first (as :func:`_flipped_kernel` walks a chain back from its end), so one pass
    that forgets each removed node's reads takes a whole chain whose last node went unread.
    """
    reads = _read_counts(nodes, graph)
    removed: set[int] = set()
    for node in candidates:
        if id(node) not in removed and not any(reads[output] > 0 for output in node.output):
            removed.add(id(node))
            reads.subtract(node.input)
    return [node for node in nodes if id(node) not in removed]


def _folded_pad(
    node: onnx.NodeProto, producers: dict[str, onnx.NodeProto], initializers: dict[str, onnx.TensorProto]
) -> tuple[onnx.NodeProto, onnx.NodeProto] | None:
    """``(a copy of node reading the padded tensor itself with the padding in its own pads, the Pad)`` where
    ``node``'s input is a constant zero padding of the image axes, else ``None``.

    ONNX Runtime's ``PadFusion`` does the same for a standard ``Conv``, but runs after this pass has turned the
    convolution into an NCHWc one; the padded copy would cost a pass over the tensor (the phase convolutions of a
    stride-2 input gradient read their output gradient padded at the end).
    """
    pad = producers.get(node.input[0])
    if pad is None or pad.op_type != "Pad" or pad.domain not in ("", "ai.onnx") or not 2 <= len(pad.input) <= 3:
        return None
    attributes = _attributes(pad)
    if attributes.get("mode", b"constant") not in (b"constant", "constant") or pad.input[1] not in initializers:
        return None
    if len(pad.input) == 3 and pad.input[2]:
        value = initializers.get(pad.input[2])
        constant = None if value is None else numpy_helper.to_array(value)
        if constant is None or constant.size != 1 or constant.item() != 0:
            return None
    pads = [int(p) for p in numpy_helper.to_array(initializers[pad.input[1]]).reshape(-1)]
    if len(pads) != 8 or any(pads[axis] for axis in (0, 1, 4, 5)) or any(p < 0 for p in pads):
        return None
    conv_attributes = _attributes(node)
    own = list(conv_attributes.get("pads", [0, 0, 0, 0]))
    folded = onnx.NodeProto()
    folded.CopyFrom(node)
    folded.input[0] = pad.input[0]
    del folded.attribute[:]
    for attr in node.attribute:
        if attr.name != "pads":
            folded.attribute.append(attr)
    total = [own[0] + pads[2], own[1] + pads[3], own[2] + pads[6], own[3] + pads[7]]
    folded.attribute.append(helper.make_attribute("pads", total))
    return folded, pad


def _is_weight_grad_kernel(node: onnx.NodeProto) -> bool:
    return node.op_type == "ConvWeightGrad3x3" and node.domain == DOMAIN


def _blocked_weight_grad(node: onnx.NodeProto, block: int) -> list[onnx.NodeProto]:
    """lightning_ort's ``ConvWeightGrad3x3`` reading its output gradient's NCHWc copy, by a ``ReorderInput`` that the
    input gradient's convolution shares (:func:`_shared_reorders`)."""
    if block != KERNEL_NCHWC_BLOCK:
        raise RuntimeError(
            f"{node.name or node.op_type}: lightning_ort's 3x3 weight-gradient kernel reads "
            f"{KERNEL_NCHWC_BLOCK}-channel NCHWc blocks, but ONNX Runtime blocks {block} channels on this CPU. "
            "Please report this; conv_weight_grad='torch' avoids the kernel."
        )
    grad_output = node.input[1]
    blocked = f"{grad_output}_nchwc"
    node.input[1] = blocked
    return [helper.make_node("ReorderInput", [grad_output], [blocked], blocked, domain=_NCHWC), node]


def _shared_reorders(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` with one ``ReorderInput`` per tensor: convolutions that read the same input (a strided block's
    3x3 convolution and its 1x1 projection) share its blocked copy instead of each reordering it.

    Example:
        >>> reorder = [helper.make_node("ReorderInput", ["x"], [f"b{i}"], domain=_NCHWC) for i in range(2)]
        >>> convs = [helper.make_node("Conv", [f"b{i}", "w"], [f"y{i}"], domain=_NCHWC) for i in range(2)]
        >>> [list(node.input) for node in _shared_reorders([reorder[0], convs[0], reorder[1], convs[1]])]
        [['x'], ['b0', 'w'], ['b0', 'w']]
    """
    first: dict[tuple[str, bytes], str] = {}
    renamed: dict[str, str] = {}
    kept: list[onnx.NodeProto] = []
    for node in nodes:
        for index, name in enumerate(node.input):
            if name in renamed:
                node.input[index] = renamed[name]
        if node.op_type == "ReorderInput" and node.domain == _NCHWC:
            attributes = b"".join(attribute.SerializeToString() for attribute in node.attribute)
            key = (node.input[0], attributes)
            if key in first:
                renamed[node.output[0]] = first[key]
                continue
            first[key] = node.output[0]
        kept.append(node)
    return kept


def _depthwise_nchwc(
    node: onnx.NodeProto, weight_shape: list[int], prefix: str, initializers: list[onnx.TensorProto]
) -> list[onnx.NodeProto]:
    """The nodes that run depthwise ``node`` on NCHWc kernels: its ``[C, 1, kh, kw]`` weight blocked as
    ``[C/B, kh, kw, B]`` by one ``ReorderInput`` on its ``[1, C, kh * kw, 1]`` view."""
    channels, _, *kernel = weight_shape
    view_shape, kernel_shape = f"{prefix}_view_shape", f"{prefix}_weight_shape"
    view, blocked, weight = f"{prefix}_view", f"{prefix}_blocked", f"{prefix}_weight"
    initializers += [
        numpy_helper.from_array(np.array([1, channels, math.prod(kernel), 1], np.int64), view_shape),
        numpy_helper.from_array(np.array(weight_shape, np.int64), kernel_shape),
    ]
    return [
        helper.make_node("Reshape", [node.input[1], view_shape], [view], view),
        helper.make_node("ReorderInput", [view], [blocked], blocked, domain=_NCHWC),
        helper.make_node("Reshape", [blocked, kernel_shape], [weight], weight),
        *_blocked_conv(node, weight, prefix, weight_shape),
    ]


def _blocked_conv(node: onnx.NodeProto, weight: str, prefix: str, weight_shape: list[int]) -> list[onnx.NodeProto]:
    """``node`` as an NCHWc ``Conv`` with the blocked ``weight``, between the reorders of its input and output."""
    blocked_input, blocked_output = f"{prefix}_input", f"{prefix}_output"
    conv = helper.make_node(
        "Conv", [blocked_input, weight, *node.input[2:]], [blocked_output], node.name, domain=_NCHWC
    )
    conv.attribute.extend(node.attribute)
    if not any(attribute.name == "kernel_shape" for attribute in node.attribute):
        conv.attribute.append(helper.make_attribute("kernel_shape", weight_shape[2:]))
    return [
        helper.make_node("ReorderInput", [node.input[0]], [blocked_input], blocked_input, domain=_NCHWC),
        conv,
        helper.make_node(
            "ReorderOutput",
            [blocked_output],
            list(node.output),
            f"{prefix}_reorder_output",
            domain=_NCHWC,
            channels=weight_shape[0],
        ),
    ]


def _nchwc_weight_shape(node: onnx.NodeProto, values: dict[str, _Value], block: int) -> list[int] | None:
    """The weight's static shape if ``node`` is a ``Conv`` :func:`use_nchwc_convolutions` rewrites, else ``None``."""
    if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
        return None
    attributes = _attributes(node)
    if attributes.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        return None
    data, weight = values.get(node.input[0]), values.get(node.input[1])
    if data is None or weight is None or weight.static_shape is None:
        return None
    if data.elem_type != onnx.TensorProto.FLOAT or len(data.dims) != 4 or len(weight.dims) != 4:
        return None
    out_channels, in_per_group = weight.static_shape[:2]
    group = attributes.get("group", 1)
    depthwise = group == out_channels == data.dims[1] and in_per_group == 1 and group > 1
    if group != 1 and not depthwise:
        return None
    if data.dims[1] != (out_channels if depthwise else in_per_group) or data.dims[1] % block or out_channels % block:
        return None
    return weight.static_shape


_OIHW_BI_BO = [0, 2, 4, 5, 3, 1]
"""From ``[O/B, Bo, I/B, Bi, kh, kw]`` to the ``[O/B, I/B, kh, kw, Bi, Bo]`` layout of MLAS's NCHWc filters."""


@Once
def nchwc_block_size() -> int:
    """The channel block of ONNX Runtime's NCHWc kernels on this CPU (16 with AVX-512, 8 with AVX2), 0 if none.

    Not exposed by ONNX Runtime: found once per process by letting it optimize a one-convolution model with a
    constant weight and matching the reordered weight against each candidate block size.
    """
    weight = np.arange(32 * 32 * 9, dtype=np.float32).reshape(32, 32, 3, 3)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])],
        "nchwc_probe",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 32, 4, 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    try:
        with tempfile.TemporaryDirectory() as directory:
            options = ort.SessionOptions()
            options.log_severity_level = 3
            options.optimized_model_filepath = os.path.join(directory, "optimized.onnx")
            ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
            optimized = onnx.load(options.optimized_model_filepath)
    except Exception as err:  # no writable temporary directory, or a build without the NCHWc transformer
        log.debug("no NCHWc convolutions: probing ONNX Runtime failed: %s", err)
        return 0
    if not any(node.domain == _NCHWC and node.op_type == "Conv" for node in optimized.graph.node):
        return 0
    reordered = [numpy_helper.to_array(init).reshape(-1) for init in optimized.graph.initializer]
    for block in (16, 8, 4):
        expected = weight.reshape(32 // block, block, 32 // block, block, 3, 3).transpose(_OIHW_BI_BO).reshape(-1)
        if any(array.shape == expected.shape and np.array_equal(array, expected) for array in reordered):
            return block
    return 0


def _left_fusion_pays(left: list[int] | None, right: list[int] | None) -> bool:
    """Whether ``transA`` beats an explicit transpose for ``left @ right`` (``left`` as the product reads it)."""
    if left is None or right is None or len(left) < 2 or len(right) < 2:
        return False
    return len(left) > 2 or left[-2] > right[-1]


@dataclass(frozen=True)
class _Value:
    """What the graph declares about one tensor: element type and dimensions (a name: a symbolic size; ``None``:
    unknown)."""

    elem_type: int
    dims: tuple[int | str | None, ...]

    @property
    def static_shape(self) -> list[int] | None:
        sizes = [d for d in self.dims if isinstance(d, int)]
        return sizes if len(sizes) == len(self.dims) else None


CUDA_PAD_TYPES = frozenset(
    {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BOOL}
)
"""The element types ONNX Runtime's CUDA provider has a ``Pad`` kernel for (its OperatorKernels table)."""


MIN_PRODUCT_SIZE = 1 << 18
"""Products of fewer multiply-adds (``M * K * N``) than this, or of unknown size, stay on ONNX Runtime's MLAS."""


def multiply_through_mkl(model: onnx.ModelProto, threads: int) -> int:
    """Move ``model``'s products of two float32 matrices to the ``BlasMatMul`` kernel (MKL), in place.

    ``MatMul`` and ``FusedMatMul`` (with its ``transA``, ``transB`` and ``alpha``) whose operands are declared
    float32 matrices of static shape and at least :data:`MIN_PRODUCT_SIZE` multiply-adds are rewritten; the
    kernel cuts each product into ``threads`` panels. Batched products (attention's) stay on MLAS. Returns the
    number of products rewritten.

    Example:
        >>> a = helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [256, 128])
        >>> b = helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [512, 128])
        >>> node = helper.make_node("FusedMatMul", ["a", "b"], ["y"], domain="com.microsoft", transB=1)
        >>> model = helper.make_model(helper.make_graph([node], "g", [a, b], []))
        >>> multiply_through_mkl(model, threads=2), model.graph.node[0].op_type
        (1, 'BlasMatMul')
    """
    values = _values(model.graph)
    matrices = {
        name: shape
        for name, value in values.items()
        if value.elem_type == onnx.TensorProto.FLOAT and (shape := value.static_shape) is not None and len(shape) == 2
    }
    rewritten = 0
    for node in model.graph.node:
        attributes = _attributes(node)
        plain = node.op_type == "MatMul" and _in_default_domain(node)
        fused = node.op_type == "FusedMatMul" and node.domain == _MICROSOFT
        if not (plain or (fused and not attributes.get("transBatchA", 0) and not attributes.get("transBatchB", 0))):
            continue
        left, right = (matrices.get(name) for name in node.input[:2])
        if left is None or right is None:
            continue
        rows, depth = (left[1], left[0]) if attributes.get("transA", 0) else left
        columns = right[0] if attributes.get("transB", 0) else right[1]
        if rows * depth * columns < MIN_PRODUCT_SIZE:
            continue
        node.CopyFrom(
            helper.make_node(
                "BlasMatMul",
                list(node.input),
                list(node.output),
                node.name,
                domain=DOMAIN,
                transA=int(attributes.get("transA", 0)),
                transB=int(attributes.get("transB", 0)),
                alpha=float(attributes.get("alpha", 1.0)),
                threads=threads,
            )
        )
        rewritten += 1
    if rewritten and not any(opset.domain == DOMAIN for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return rewritten


def pad_by_concat(model: onnx.ModelProto) -> int:
    """Turn a constant-mode ``Pad`` of a static-shape tensor of a type without a CUDA ``Pad`` kernel into a
    ``Concat`` of the tensor with constant blocks (``Expand`` of the pad value), one per padded axis, in place.

    The CUDA provider places a node it has no kernel for on the CPU, between a copy to the host and a copy back
    (ONNX Runtime's "Memcpy nodes are added to the graph"), which costs two synchronising copies per run and
    keeps the graph from being captured as a CUDA graph. Only non-negative constant pads with a constant (or
    absent) value are rewritten. Returns the number of ``Pad`` nodes rewritten.

    Example:
        >>> pads = numpy_helper.from_array(np.array([0, 0, 0, 1], np.int64), "pads")
        >>> value = numpy_helper.from_array(np.array(-100, np.int64), "value")
        >>> pad = helper.make_node("Pad", ["labels", "pads", "value"], ["padded"], "pad")
        >>> labels = helper.make_tensor_value_info("labels", onnx.TensorProto.INT64, [2, 3])
        >>> padded = helper.make_tensor_value_info("padded", onnx.TensorProto.INT64, [2, 4])
        >>> model = helper.make_model(helper.make_graph([pad], "g", [labels], [padded], [pads, value]))
        >>> pad_by_concat(model), [n.op_type for n in model.graph.node]
        (1, ['Expand', 'Concat'])
    """
    graph = model.graph
    values = _values(graph)
    initializers = {init.name: init for init in graph.initializer}
    nodes: list[onnx.NodeProto] = []
    rewritten = 0
    for node in graph.node:
        blocks = _pad_blocks(node, values, initializers)
        if blocks is None:
            nodes.append(node)
            continue
        elem_type, dims, fill, widths = blocks
        fill_name = f"{node.name}_fill"
        graph.initializer.append(
            numpy_helper.from_array(np.array(fill, helper.tensor_dtype_to_np_dtype(elem_type)), fill_name)
        )
        padded = [axis for axis, width in enumerate(widths) if any(width)]
        current = node.input[0]
        for axis in padded:
            parts = [current]
            for side, width in zip(("before", "after"), widths[axis]):
                if width:
                    block = f"{node.name}_{side}_{axis}"
                    shape = np.array([*dims[:axis], width, *dims[axis + 1 :]], np.int64)
                    graph.initializer.append(numpy_helper.from_array(shape, f"{block}_shape"))
                    nodes.append(helper.make_node("Expand", [fill_name, f"{block}_shape"], [block], block))
                    parts.insert(0 if side == "before" else len(parts), block)
            dims[axis] += sum(widths[axis])
            output = node.output[0] if axis == padded[-1] else f"{node.name}_axis_{axis}"
            nodes.append(helper.make_node("Concat", parts, [output], f"{node.name}_concat_{axis}", axis=axis))
            current = output
        rewritten += 1
    if rewritten:
        _set_nodes(graph, nodes)
    return rewritten


def cuda_host_nodes(model: onnx.ModelProto) -> list[str]:
    """The nodes of ``model`` that ONNX Runtime's CUDA provider would run on the host: shape computations
    (``Shape``, ``Size``), which a static-shape graph should not hold, and ``Pad`` on a type it has no kernel
    for. Each is named ``"OpType node_name"``; an empty list is a graph that can run wholly on the GPU.

    Example:
        >>> shape = helper.make_node("Shape", ["x"], ["s"], "node_shape")
        >>> cuda_host_nodes(helper.make_model(helper.make_graph([shape], "g", [], [])))
        ['Shape node_shape']
    """
    values = _values(model.graph)
    return [
        f"{node.op_type} {node.name}"
        for node in model.graph.node
        if _in_default_domain(node) and (node.op_type in ("Shape", "Size") or _pads_on_host(node, values))
    ]


def _pads_on_host(node: onnx.NodeProto, values: dict[str, _Value]) -> bool:
    """Whether ``node`` is a ``Pad`` of a type the CUDA provider has no ``Pad`` kernel for."""
    data = values.get(node.input[0]) if node.op_type == "Pad" and node.input else None
    return data is not None and data.elem_type not in CUDA_PAD_TYPES


def _pad_blocks(
    node: onnx.NodeProto, values: dict[str, _Value], initializers: dict[str, onnx.TensorProto]
) -> tuple[int, list[int], Any, list[tuple[int, int]]] | None:
    """For a ``Pad`` that :func:`pad_by_concat` rewrites: its element type, its input's dims, its fill value and
    the (before, after) widths per axis; ``None`` for any other node, and for a pad that adds nothing."""
    if not _in_default_domain(node) or not _pads_on_host(node, values):
        return None
    mode = next((attr.s for attr in node.attribute if attr.name == "mode"), b"constant")
    data = values[node.input[0]]
    dims = [size for size in data.dims if isinstance(size, int) and size > 0]
    if mode != b"constant" or len(dims) != len(data.dims) or len(node.input) < 2:
        return None

    def constant(index: int) -> np.ndarray | None:
        tensor = initializers.get(node.input[index])
        return numpy_helper.to_array(tensor) if tensor is not None else None

    pads = constant(1)
    fill = constant(2) if len(node.input) > 2 and node.input[2] else np.zeros(())
    axes = constant(3) if len(node.input) > 3 and node.input[3] else np.arange(len(dims))
    if pads is None or fill is None or axes is None or fill.size != 1 or (pads < 0).any() or not pads.any():
        return None
    widths = [(0, 0)] * len(dims)
    for position, axis in enumerate(int(a) % len(dims) for a in axes.reshape(-1)):
        widths[axis] = (int(pads[position]), int(pads[position + len(axes.reshape(-1))]))
    return data.elem_type, dims, fill.reshape(()).item(), widths


def drop_unused_initializers(model: onnx.ModelProto) -> int:
    """Drop the initializers no node reads (the rewrites above leave shape constants behind), in place.

    ONNX Runtime drops them too, with a warning per initializer each time it loads the graph. Reads inside
    subgraphs count.

    Example:
        >>> graph = helper.make_graph(
        ...     [helper.make_node("Identity", ["x"], ["y"])],
        ...     "g",
        ...     [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        ...     [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
        ...     [numpy_helper.from_array(np.zeros(1, np.int64), "unused")],
        ... )
        >>> model = helper.make_model(graph)
        >>> drop_unused_initializers(model), len(model.graph.initializer)
        (1, 0)
    """
    graph = model.graph
    read = _read_names(list(graph.node), graph) | _subgraph_reads(graph)
    kept = [init for init in graph.initializer if init.name in read]
    dropped = len(graph.initializer) - len(kept)
    if dropped:
        del graph.initializer[:]
        graph.initializer.extend(kept)
    return dropped


def _has_subgraphs(graph: onnx.GraphProto) -> bool:
    """Whether a node of ``graph`` holds a subgraph (``If``, ``Loop``, ``Scan``), whose names a rewrite that
    renames values would have to follow."""
    return any(
        attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for attr in n.attribute
    )


def _subgraph_reads(graph: onnx.GraphProto) -> set[str]:
    """Names the subgraphs of ``graph``'s nodes (``If``, ``Loop``, ``Scan`` bodies) read, at any depth."""
    names: set[str] = set()
    for node in graph.node:
        for attribute in node.attribute:
            for body in [*attribute.graphs, *([attribute.g] if attribute.HasField("g") else [])]:
                names |= _read_names(list(body.node), body) | _subgraph_reads(body)
    return names


def _set_nodes(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
    """Make ``nodes`` the nodes of ``graph``, in their order: how every rewrite here ends."""
    del graph.node[:]
    graph.node.extend(nodes)


def _replace_nodes(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
    """:func:`_set_nodes`, dropping the ``value_info`` of values that ``nodes`` no longer define."""
    defined = {name for node in nodes for name in node.output}
    _keep_value_info(graph, defined | {value.name for value in graph.input} | {i.name for i in graph.initializer})
    _set_nodes(graph, nodes)


def _attributes(node: onnx.NodeProto) -> dict[str, Any]:
    """``node``'s attributes by name, as Python values."""
    return {attr.name: helper.get_attribute_value(attr) for attr in node.attribute}


def _read_counts(nodes: list[onnx.NodeProto], graph: onnx.GraphProto) -> Counter[str]:
    """How many times each value is read: by ``nodes`` (an input listed twice counts twice), as an output of
    ``graph``, and inside its subgraphs."""
    reads = Counter(name for node in nodes for name in node.input)
    reads.update(output.name for output in graph.output)
    reads.update(_subgraph_reads(graph))
    return reads


def _in_default_domain(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is a standard ONNX op (its domain is empty or ``ai.onnx``), not a contrib op."""
    return node.domain in ("", "ai.onnx")


def _read_names(nodes: list[onnx.NodeProto], graph: onnx.GraphProto) -> set[str]:
    """Names that ``nodes`` read or that ``graph`` outputs: what must stay defined after a rewrite."""
    return {name for node in nodes for name in node.input} | {output.name for output in graph.output}


def _values(graph: onnx.GraphProto) -> dict[str, _Value]:
    """Declared type and shape of every initializer, input, output and ``value_info`` entry of ``graph``."""
    values = {init.name: _Value(init.data_type, tuple(init.dims)) for init in graph.initializer}
    for value in [*graph.value_info, *graph.input, *graph.output]:
        tensor = value.type.tensor_type
        if tensor.HasField("shape"):
            dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim)
            values[value.name] = _Value(tensor.elem_type, dims)
    return values


def _keep_value_info(graph: onnx.GraphProto, defined: set[str]) -> None:
    """Drop ``graph``'s ``value_info`` entries for values a rewrite no longer defines."""
    kept = [value for value in graph.value_info if value.name in defined]
    del graph.value_info[:]
    graph.value_info.extend(kept)


def _swapping_transpose(node: onnx.NodeProto | None) -> onnx.NodeProto | None:
    if node is None or node.op_type != "Transpose":
        return None
    perm = next((list(attr.ints) for attr in node.attribute if attr.name == "perm"), None)
    if perm is None or len(perm) < 2:
        return None
    rank = len(perm)
    return node if perm == [*range(rank - 2), rank - 1, rank - 2] else None


_CPU = frozenset({"cpu"})
_CUDA = frozenset({"cuda"})

PASSES = (
    OnnxPass("bfloat16 ops computed in float32", compute_bfloat16_in_float, _CPU),
    OnnxPass("casts to the type they read dropped", drop_identity_casts),
    OnnxPass("biases split from Gemm", split_gemm_bias, _CPU),
    OnnxPass("transposed matmul operands fused", fuse_transposed_operands),
    OnnxPass("strided projections' input gradients added in the phase weave", weave_projection_grads, _CPU),
    OnnxPass("convolutions on NCHWc kernels", _nchwc_convolutions, _CPU),
    OnnxPass("channels-last transposes folded into NCHWc reorders", fold_channels_last_transposes, _CPU),
    OnnxPass("masks scaled by DequantizeLinear", dequantize_scaled_masks, _CPU),
    OnnxPass("row sums as products", sum_rows_by_product, _CPU),
    OnnxPass("pooled gradients read per plane by batch-norm gradients", read_pooled_grads_per_plane, _CPU),
    OnnxPass("gradients kept in NCHWc blocks between convolutions", _blocked_gradients, _CPU),
    OnnxPass("integer pads as concatenations", pad_by_concat, _CUDA),
    OnnxPass("bfloat16 ops without a CUDA kernel computed in float32", compute_cuda_bfloat16_gaps_in_float, _CUDA),
    OnnxPass("reshapes removed", collapse_reshapes),
    OnnxPass("slices of slices merged", merge_slices),
    OnnxPass("image subsamples in lightning_ort's kernel", subsample_images, _CPU),
    OnnxPass("transposes in lightning_ort's kernel", transpose_in_kernel, _CPU),
    OnnxPass("unused initializers dropped", drop_unused_initializers),
)
"""The rewrites of every exported graph, in order: reshapes are collapsed after the passes that add some, and
initializers dropped last, after the passes that leave constants unread. Their effect on speed is measured by
``python -m lightning_ort.bench`` (nodes run per step, and per op type with ``--profile DIR``)."""
