"""Which library multiplies matrices in CPU sessions: ONNX Runtime's MLAS or the MKL that PyTorch was built with.

ONNX Runtime's ``MatMul`` and ``FusedMatMul`` run on MLAS, its own matrix-product library. On some x86 CPUs
(Intel Xeons with AVX-512) MKL's ``sgemm``, which eager PyTorch calls, multiplies the same matrices faster, and
on others MLAS is level or ahead. :func:`mkl_multiplies_faster` times both once per process on products of the
shapes that training graphs hold (a layer's forward, its input gradient and its weight gradient), inside ONNX
Runtime and on the session's threads. Where MKL is faster, each session gets a copy of its graph in which
:func:`~lightning_ort.engine.onnx.passes.multiply_through_mkl` has moved the products of two matrices to
lightning_ort's ``BlasMatMul`` kernel (``matmul_kernels.cpp``), which calls MKL on ONNX Runtime's threads. The
choice is made when a session is created, never in the exported or cached graph, so a graph cache moves between
machines unchanged. ``SessionSettings(cpu_matmul="mlas")`` or ``"mkl"`` overrides the measurement.
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

from lightning_ort.engine.onnx.passes import multiply_through_mkl
from lightning_ort.engine.runtime.cpu_kernels import kernel_library, register_kernels
from lightning_ort.logs import get_logger
from lightning_ort.options import CpuMatmul

log = get_logger(__name__)


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
    compared (the least disturbed by other work on the machine, which only ever adds time; the performance page has
    how often medians chose otherwise): MKL wins where it is shorter. A machine
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
                domain="com.microsoft",
                transA=int(transposed == "A"),
                transB=int(transposed == "B"),
            )
        )
    graph = helper.make_graph(nodes, "matmul_calibration", inputs, outputs)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    register_kernels(options, model)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _random(value: onnx.ValueInfoProto, generator: np.random.Generator) -> np.ndarray:
    shape = [dim.dim_value for dim in value.type.tensor_type.shape.dim]
    return generator.standard_normal(shape, dtype=np.float32)
