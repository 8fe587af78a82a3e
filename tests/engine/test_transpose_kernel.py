"""Transposes in lightning_ort's ``Transpose`` CPU kernel.

The kernel (``engine/runtime/transpose_kernels.cpp``) is ONNX's ``Transpose`` for float32 tensors over the
session's threads. These tests check it against NumPy for every permutation of small ranks and for the shapes
transformers and convolutional nets transpose (axes of size 1, odd sizes that leave partial tiles), that it refuses
a permutation that is not one, and that CPU graphs with lightning_ort's kernels take it and train as eager.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

from lightning_ort import DebugOptions, ORTModule
from lightning_ort.engine.onnx.custom_ops import DOMAIN, uses_kernels
from lightning_ort.engine.onnx.passes import KERNEL_MAX_RANK, transpose_in_kernel
from tests.helpers import assert_grads_close, assert_outputs_close, kernel_session

SHAPES = [
    (3, 32, 8, 64, 32),  # a fused projection's query, key and value, split into heads
    (32, 8, 33, 64),  # heads against positions, a partial tile
    (2048, 256),  # a weight gradient's product transposed
    (5, 7, 3),
    (1, 17, 1, 9),  # axes of size 1 dropped
    (4, 1, 6, 1, 5),
    (33, 19),
    (2, 3, 4, 5, 6, 7),
]


def _permutations(rank: int, rng: np.random.Generator) -> list[tuple[int, ...]]:
    every = list(itertools.permutations(range(rank)))
    return every if len(every) <= 24 else [every[i] for i in rng.choice(len(every), 24, replace=False)]


@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_every_permutation_matches_numpy(library: Path, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(len(shape))
    x = rng.standard_normal(shape).astype(np.float32)
    for perm in _permutations(len(shape), rng):
        node = helper.make_node("Transpose", ["x"], ["y"], domain=DOMAIN, perm=list(perm))
        (y,) = kernel_session(node, {"x": None}).run(None, {"x": x})
        np.testing.assert_array_equal(y, np.transpose(x, perm), err_msg=f"perm {perm}")


def test_the_kernel_refuses_a_perm_that_is_not_a_permutation_of_the_axes(library: Path) -> None:
    x = np.ones((2, 3, 4), np.float32)
    for perm in ([0, 1], [0, 1, 1], [0, 1, 3]):
        node = helper.make_node("Transpose", ["x"], ["y"], domain=DOMAIN, perm=perm)
        with pytest.raises(Exception, match=r"Transpose: perm must be a permutation of X's 3 axes"):
            kernel_session(node, {"x": None}).run(None, {"x": x})


def test_the_pass_leaves_transposes_above_the_kernels_rank_to_onnx_runtime() -> None:
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)]  # a graph with our kernels
    for rank, expected in ((KERNEL_MAX_RANK, DOMAIN), (KERNEL_MAX_RANK + 1, "")):
        x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2] * rank)
        perm = [1, 2, 0, *range(3, rank)]
        node = helper.make_node("Transpose", ["x"], ["y"], "node_permute", perm=perm)
        model = helper.make_model(helper.make_graph([node], "g", [x], []), opset_imports=opsets)
        transpose_in_kernel(model)
        assert model.graph.node[0].domain == expected, f"rank {rank}"


def test_a_transformer_with_kernels_transposes_in_them_and_trains_as_eager(library: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    eager = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), torch.nn.GELU())
    debug = DebugOptions(save_onnx=True, onnx_prefix="model", save_path=str(tmp_path))
    wrapped = ORTModule(copy.deepcopy(eager), debug)
    x = torch.randn(4, 9, 32)
    outputs = [model(x) for model in (eager, wrapped)]
    for output in outputs:
        (output * torch.linspace(-1, 1, 32)).sum().backward()
    assert_outputs_close(outputs[1], outputs[0])
    assert_grads_close(wrapped, eager)
    kernels, matrices, others = 0, 0, 0
    for path in tmp_path.glob("model_*.onnx"):
        model = onnx.load(path)
        if "optimized" in path.name or not uses_kernels(model):  # the backward: layer norm's and GELU's gradients
            continue
        for node in model.graph.node:
            if node.op_type == "Transpose" and node.domain == DOMAIN:
                kernels += 1
            elif node.op_type == "Transpose":
                perm = next(list(attr.ints) for attr in node.attribute if attr.name == "perm")
                matrices, others = matrices + (perm == [1, 0]), others + (perm != [1, 0])
    # Matrix transposes (weight gradients' products) stay ONNX Runtime's, on MLAS's vector kernel.
    assert kernels > 0 and matrices > 0 and others == 0
