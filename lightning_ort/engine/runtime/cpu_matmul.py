"""Which library multiplies matrices in CPU sessions: ONNX Runtime's MLAS or the MKL that PyTorch was built with.

ONNX Runtime's ``MatMul`` and ``FusedMatMul`` run on MLAS, its own matrix-product library. On some x86 CPUs
(Intel Xeons with AVX-512) MKL's ``sgemm``, which eager PyTorch calls, multiplies the same matrices faster, and
on others MLAS is level or ahead. :func:`mkl_multiplies_faster` times both once per process on products of the
shapes that training graphs hold (a layer's forward, its input gradient and its weight gradient), inside ONNX
Runtime and on the session's threads; where MKL is faster, :func:`multiply_through_mkl` gives each session a copy
of its graph whose matrix products run in lightning_ort's ``BlasMatMul`` kernel (``matmul_kernels.cpp``), which
calls MKL on ONNX Runtime's threads. The choice is made when a session is created, never in the exported or
cached graph, so a graph cache moves between machines unchanged. ``SessionSettings(cpu_matmul="mlas")`` or
``"mkl"`` overrides the measurement.

Only products of two matrices (rank 2, as a ``Linear`` layer's are after export) of at least
:data:`MIN_PRODUCT_SIZE` multiply-adds move: batched products (attention's) and small ones stay on MLAS, whose
per-call cost is lower.
"""

from __future__ import annotations

import functools
import platform
import time

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import helper

from lightning_ort.engine.onnx.custom_ops import DOMAIN
from lightning_ort.engine.runtime.cpu_kernels import kernel_library
from lightning_ort.logs import get_logger
from lightning_ort.options import CpuMatmul

log = get_logger(__name__)


MIN_PRODUCT_SIZE = 1 << 18
"""Products of fewer multiply-adds (``M * K * N``) than this, or of unknown size, stay on MLAS."""

_MICROSOFT = "com.microsoft"
_CALIBRATION = (("B", 1024, 1024, 512), ("", 1024, 512, 1024), ("A", 512, 2048, 1024))
"""The calibration's products, (the transposed operand, M, K, N): a layer's forward (``x @ W.T``), its input
gradient (``dY @ W``) and its weight gradient (``dY.T @ x``, a sum over the batch)."""


def mkl_available() -> bool:
    """Whether PyTorch was built with MKL on x86-64 and lightning_ort's CPU kernels are built.

    Example:
        >>> mkl_available() in (True, False)
        True
    """
    x86 = platform.machine() in ("x86_64", "AMD64")
    return x86 and torch.backends.mkl.is_available() and kernel_library() is not None


def use_mkl(choice: CpuMatmul, threads: int) -> bool:
    """Whether CPU sessions on ``threads`` threads multiply matrices through MKL, as ``choice`` asks.

    Raises:
        RuntimeError: ``choice`` is ``"mkl"`` where MKL or lightning_ort's CPU kernels are not available.
    """
    if choice == "mlas":
        return False
    if choice == "mkl":
        if not mkl_available():
            raise RuntimeError(
                "SessionSettings(cpu_matmul='mkl'): this PyTorch has no MKL on this machine, or lightning_ort's CPU "
                "kernels could not be built; pass cpu_matmul='mlas' (ONNX Runtime's own) or 'auto'."
            )
        return True
    return mkl_available() and mkl_multiplies_faster(threads)


@functools.cache
def mkl_multiplies_faster(threads: int) -> bool:
    """Time the calibration products on MLAS and on MKL, each in an ONNX Runtime session on ``threads`` threads.

    The two sessions run in alternation, eight times each after a warm-up, and the shortest of each one's runs are
    compared (the least disturbed by other work on the machine, which only ever adds time; medians flipped the choice
    in one of four processes on a machine where MKL was 10-20% faster): MKL wins where it is shorter. A machine
    where the two are level may take either, at no cost. Done once per thread count and process.
    """
    model = _calibration_model()
    through_mkl = onnx.ModelProto()
    through_mkl.CopyFrom(model)
    multiply_through_mkl(through_mkl, threads)
    generator = np.random.default_rng(0)
    feeds = {value.name: _random(value, generator) for value in model.graph.input}
    sessions = [_session(candidate, threads) for candidate in (model, through_mkl)]
    times: list[list[float]] = [[], []]
    for repeat in range(9):
        for session, taken in zip(sessions, times, strict=True):
            start = time.perf_counter()
            session.run(None, feeds)
            if repeat:
                taken.append(time.perf_counter() - start)
    mlas, mkl = (min(taken) for taken in times)
    faster = mkl < mlas
    log.info(
        "CPU matrix products on %d threads: MLAS %.2f ms, MKL %.2f ms; %s chosen",
        threads,
        mlas * 1e3,
        mkl * 1e3,
        "MKL" if faster else "MLAS",
    )
    return faster


def multiply_through_mkl(model: onnx.ModelProto, threads: int) -> int:
    """Move ``model``'s products of two float32 matrices to the ``BlasMatMul`` kernel, in place.

    ``MatMul`` and ``FusedMatMul`` (with its ``transA``, ``transB`` and ``alpha``) whose operands are declared
    float32 matrices of at least :data:`MIN_PRODUCT_SIZE` multiply-adds are rewritten. Returns their number.

    Example:
        >>> a = helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [256, 128])
        >>> b = helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [512, 128])
        >>> node = helper.make_node("FusedMatMul", ["a", "b"], ["y"], domain="com.microsoft", transB=1)
        >>> model = helper.make_model(helper.make_graph([node], "g", [a, b], []))
        >>> multiply_through_mkl(model, threads=2), model.graph.node[0].op_type
        (1, 'BlasMatMul')
    """
    shapes = _matrix_shapes(model.graph)
    rewritten = 0
    for position, node in enumerate(model.graph.node):
        attributes = {attribute.name: helper.get_attribute_value(attribute) for attribute in node.attribute}
        if not _is_product(node, attributes):
            continue
        left, right = (shapes.get(name) for name in node.input[:2])
        if left is None or right is None:
            continue
        rows, depth = (left[1], left[0]) if attributes.get("transA", 0) else left
        columns = right[0] if attributes.get("transB", 0) else right[1]
        if rows * depth * columns < MIN_PRODUCT_SIZE:
            continue
        model.graph.node[position].CopyFrom(
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


def _is_product(node: onnx.NodeProto, attributes: dict[str, object]) -> bool:
    if node.op_type == "MatMul" and node.domain in ("", "ai.onnx"):
        return True
    batch_transposes = attributes.get("transBatchA", 0) or attributes.get("transBatchB", 0)
    return node.op_type == "FusedMatMul" and node.domain == _MICROSOFT and not batch_transposes


def _matrix_shapes(graph: onnx.GraphProto) -> dict[str, tuple[int, int]]:
    """The static shape of every value ``graph`` declares a float32 matrix."""
    shapes = {
        init.name: (init.dims[0], init.dims[1])
        for init in graph.initializer
        if init.data_type == onnx.TensorProto.FLOAT and len(init.dims) == 2
    }
    for value in [*graph.input, *graph.value_info, *graph.output]:
        tensor = value.type.tensor_type
        if tensor.elem_type != onnx.TensorProto.FLOAT or not tensor.HasField("shape"):
            continue
        dims = tensor.shape.dim
        if len(dims) == 2 and all(dim.HasField("dim_value") for dim in dims):
            shapes[value.name] = (dims[0].dim_value, dims[1].dim_value)
    return shapes


def _calibration_model() -> onnx.ModelProto:
    """One graph of the :data:`_CALIBRATION` products, as ``FusedMatMul`` nodes, each with its own inputs."""
    inputs, nodes, outputs = [], [], []
    for index, (transposed, rows, depth, columns) in enumerate(_CALIBRATION):
        left = [depth, rows] if transposed == "A" else [rows, depth]
        right = [columns, depth] if transposed == "B" else [depth, columns]
        names = (f"a{index}", f"b{index}", f"y{index}")
        inputs += [
            helper.make_tensor_value_info(names[0], onnx.TensorProto.FLOAT, left),
            helper.make_tensor_value_info(names[1], onnx.TensorProto.FLOAT, right),
        ]
        outputs.append(helper.make_tensor_value_info(names[2], onnx.TensorProto.FLOAT, [rows, columns]))
        nodes.append(
            helper.make_node(
                "FusedMatMul",
                list(names[:2]),
                [names[2]],
                domain=_MICROSOFT,
                transA=int(transposed == "A"),
                transB=int(transposed == "B"),
            )
        )
    graph = helper.make_graph(nodes, "matmul_calibration", inputs, outputs)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(_MICROSOFT, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    library = kernel_library()
    if library is not None:
        options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _random(value: onnx.ValueInfoProto, generator: np.random.Generator) -> np.ndarray:
    shape = [dim.dim_value for dim in value.type.tensor_type.shape.dim]
    return generator.standard_normal(shape, dtype=np.float32)
