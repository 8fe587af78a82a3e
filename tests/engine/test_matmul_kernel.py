"""Matrix products in lightning_ort's ``BlasMatMul`` CPU kernel, and the choice between it and ONNX Runtime's.

The kernel (``engine/runtime/matmul_kernels.cpp``) is com.microsoft's ``FusedMatMul`` on float32 matrices,
computed by the MKL that PyTorch was built with, its panels (of rows, of columns, or of the sum over K) split over
the session's threads. These tests check it against float64 NumPy for every transposition and for shapes that take
each split, that the rewrite moves only the products it can take, and that a model trained with
``cpu_matmul="mkl"`` runs its products there and matches eager's float64 accuracy.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

from lightning_ort import DebugOptions, ORTModule, SessionSettings
from lightning_ort.engine.onnx.custom_ops import DOMAIN
from lightning_ort.engine.onnx.passes import multiply_through_mkl
from lightning_ort.engine.runtime import cpu_matmul
from tests.helpers import assert_fp64_accuracy, kernel_session

pytestmark = pytest.mark.skipif(not cpu_matmul.mkl_available(), reason="PyTorch without MKL, or no x86-64 CPU")

SHAPES = [
    (256, 128, 512),  # more columns than rows: column panels
    (512, 64, 96),  # row panels
    (96, 1024, 80),  # K above twice M and N: partial sums over K
    (33, 517, 19),  # odd sizes, partial panels and sums
    (7, 5, 3),  # one panel
]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("rows", "depth", "columns"), SHAPES, ids=[str(s) for s in SHAPES])
def test_every_transposition_matches_float64(library: Path, rows: int, depth: int, columns: int, threads: int) -> None:
    rng = np.random.default_rng(rows + depth + columns)
    for trans_a in (0, 1):
        for trans_b in (0, 1):
            a = rng.standard_normal((depth, rows) if trans_a else (rows, depth)).astype(np.float32)
            b = rng.standard_normal((columns, depth) if trans_b else (depth, columns)).astype(np.float32)
            node = helper.make_node(
                "BlasMatMul",
                ["a", "b"],
                ["y"],
                domain=DOMAIN,
                transA=trans_a,
                transB=trans_b,
                alpha=0.5,
                threads=threads,
            )
            (y,) = kernel_session(node, {"a": None, "b": None}).run(None, {"a": a, "b": b})
            expected = 0.5 * (a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b).astype(np.float64)
            assert y.shape == (rows, columns)
            # float32 products summed over K: a few float ulps of the largest magnitude term, times sqrt(K).
            tolerance = 4e-7 * np.sqrt(depth) * np.abs(a).max() * np.abs(b).max()
            np.testing.assert_allclose(
                y, expected, rtol=0, atol=tolerance, err_msg=f"transA={trans_a} transB={trans_b}"
            )


def test_the_kernel_refuses_batched_operands_and_mismatched_depths(library: Path) -> None:
    node = helper.make_node("BlasMatMul", ["a", "b"], ["y"], domain=DOMAIN, threads=2)
    session = kernel_session(node, {"a": None, "b": None})
    with pytest.raises(Exception, match=r"BlasMatMul: A and B must be matrices \(rank 2\), not of ranks 3 and 2"):
        session.run(None, {"a": np.ones((2, 3, 4), np.float32), "b": np.ones((4, 5), np.float32)})
    with pytest.raises(Exception, match=r"BlasMatMul: op\(A\) has 4 columns but op\(B\) has 3 rows"):
        session.run(None, {"a": np.ones((3, 4), np.float32), "b": np.ones((3, 5), np.float32)})


def _product_model(
    nodes: list[onnx.NodeProto], shapes: dict[str, tuple[int | str, ...]], dtype: int
) -> onnx.ModelProto:
    inputs = [helper.make_tensor_value_info(name, dtype, shape) for name, shape in shapes.items()]
    outputs = [helper.make_tensor_value_info(node.output[0], dtype, None) for node in nodes]
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(helper.make_graph(nodes, "g", inputs, outputs), opset_imports=opsets)


def test_the_rewrite_moves_only_large_products_of_two_float32_matrices() -> None:
    float32 = onnx.TensorProto.FLOAT
    shapes: dict[str, tuple[int | str, ...]] = {
        "x": (256, 512),
        "w": (1024, 512),
        "small": (8, 512),
        "batch": (4, 256, 512),
        "tokens": ("n", 512),
    }
    nodes = [
        helper.make_node("FusedMatMul", ["x", "w"], ["linear"], "node_linear", domain="com.microsoft", transB=1),
        helper.make_node("MatMul", ["small", "small_t"], ["gram"], "node_small"),
        helper.make_node("MatMul", ["batch", "x_t"], ["batched"], "node_batched"),
        helper.make_node(
            "FusedMatMul", ["tokens", "w"], ["symbolic"], "node_symbolic", domain="com.microsoft", transB=1
        ),
        helper.make_node(
            "FusedMatMul", ["grad", "x"], ["weight_grad"], "node_grad", domain="com.microsoft", transA=1, alpha=2.0
        ),
    ]
    model = _product_model(nodes, shapes, float32)
    model.graph.input.extend(
        [
            helper.make_tensor_value_info("small_t", float32, (512, 8)),
            helper.make_tensor_value_info("x_t", float32, (512, 256)),
            helper.make_tensor_value_info("grad", float32, (256, 1024)),  # dY of node_linear: dY.T @ x is dW
        ]
    )
    assert multiply_through_mkl(model, threads=2) == 2
    moved = {node.name: node for node in model.graph.node if node.domain == DOMAIN}
    assert set(moved) == {"node_linear", "node_grad"}
    attributes = {attr.name: helper.get_attribute_value(attr) for attr in moved["node_grad"].attribute}
    assert attributes == {"transA": 1, "transB": 0, "alpha": 2.0, "threads": 2}
    assert any(opset.domain == DOMAIN for opset in model.opset_import)
    double = _product_model(nodes[:1], {"x": (256, 512), "w": (1024, 512)}, onnx.TensorProto.DOUBLE)
    assert multiply_through_mkl(double, threads=2) == 0


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(96, 160), torch.nn.GELU(), torch.nn.Linear(160, 64))


@pytest.mark.parametrize("choice", ["mkl", "mlas"])
def test_a_model_trains_as_eager_with_its_products_where_the_setting_puts_them(
    library: Path, tmp_path: Path, choice: str
) -> None:
    eager = _mlp()
    debug = DebugOptions(save_onnx=True, onnx_prefix="model", save_path=str(tmp_path))
    wrapped = ORTModule(copy.deepcopy(eager), debug, session_settings=SessionSettings(cpu_matmul=choice))  # type: ignore[arg-type]
    x = torch.randn(48, 96)
    assert_fp64_accuracy(eager, wrapped, x)
    in_kernel = [
        node.name
        for path in tmp_path.glob("model_*_optimized.onnx")
        for node in onnx.load(path).graph.node
        if node.op_type == "BlasMatMul"
    ]
    # The forward's two layers, and the backward's input and weight gradients (the first layer has no input grad).
    assert len(in_kernel) == (5 if choice == "mkl" else 0)
    exported = [onnx.load(path) for path in tmp_path.glob("model_*.onnx") if "optimized" not in path.name]
    assert exported and not any(node.op_type == "BlasMatMul" for model in exported for node in model.graph.node)


def test_the_measured_choice_is_made_once_per_thread_count(library: Path) -> None:
    first = cpu_matmul.mkl_multiplies_faster(2)
    assert first in (True, False) and cpu_matmul.mkl_multiplies_faster(2) is first
    assert cpu_matmul.mkl_multiplies_faster.cache_info().hits >= 1
    assert cpu_matmul.use_mkl("mlas", 2) is False and cpu_matmul.use_mkl("mkl", 2) is True


def test_an_unknown_choice_names_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match=r"cpu_matmul='fast' is not one of 'auto', 'mlas', 'mkl'"):
        SessionSettings(cpu_matmul="fast")  # type: ignore[arg-type]
