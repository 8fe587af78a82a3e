"""Accumulating ``index_put`` on CPU: embedding and advanced-indexing gradients with repeated indices.

ONNX Runtime's CPU ``ScatterND`` with ``reduction="add"`` loses sums where two threads add to one row, so these
gradients run as ``ScatterElements`` there (:mod:`lightning_ort.engine.fx.scatter`), save an embedding's weight
gradient, which runs in PyTorch after the backward graph on CPU; each test compares every run with eager, since
the lost sums differ from run to run. On CUDA the embedding test checks the exporter's ``ScatterND``.
"""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path

import onnx
import pytest
import torch
from torch import nn

from lightning_ort import DebugOptions, ORTModule
from lightning_ort.engine.fx.scatter import index_put
from tests.helpers import assert_grads_close


def _backward_ops(tmp_path: Path) -> Counter[str]:
    (graph,) = [path for path in tmp_path.glob("*backward*.onnx") if not path.stem.endswith("_optimized")]
    return Counter(node.op_type for node in onnx.load(graph).graph.node)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_embedding_gradient_of_repeated_tokens_is_eager_s_on_every_run(device: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1000, 256), nn.Linear(256, 8)).to(device)
    ids = torch.randint(0, 16, (32, 64), device=device)  # each of 16 tokens about 128 times: rows threads share
    model(ids).square().mean().backward()
    for run in range(3):
        debug = DebugOptions(save_onnx=True, onnx_prefix="emb", save_path=str(tmp_path / str(run)))
        wrapped = ORTModule(copy.deepcopy(model), debug, fallback="raise")
        wrapped.zero_grad()
        wrapped(ids).square().mean().backward()
        assert_grads_close(wrapped, model, rtol=1e-5, atol=1e-7)
        ops = _backward_ops(tmp_path / str(run))
        if device == "cpu":  # PyTorch's embedding_dense_backward; CUDA keeps the exporter's ScatterND
            assert ops["ScatterElements"] == 0 and ops["ScatterND"] == 0


def test_advanced_index_gradients_with_repeated_indices_are_eager_s() -> None:
    class Pick(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.randn(64, 8, 32))

        def forward(self, rows: torch.Tensor, columns: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
            picked = self.table[rows, columns].tanh().sum(-1)
            return picked.square().sum() + self.table[:, slots].tanh().square().sum()  # and across a gap

    torch.manual_seed(0)
    model = Pick()
    rows, columns = torch.randint(-64, 64, (512, 1)), torch.randint(0, 8, (1, 16))  # broadcast, negative rows
    slots = torch.randint(0, 8, (40,))
    model(rows, columns, slots).backward()
    wrapped = ORTModule(copy.deepcopy(model), fallback="raise")
    for _ in range(3):
        wrapped.zero_grad()
        wrapped(rows, columns, slots).backward()
        assert_grads_close(wrapped, model, rtol=1e-5, atol=1e-3)  # gradients up to ~600, summed over ~16 picks


@pytest.mark.parametrize(
    ("shape", "index_shapes", "values_shape"),
    [
        ((10, 4), [(7,)], (7, 4)),
        ((10, 4), [(7,)], (4,)),  # values broadcast over the picked rows
        ((6, 5, 3), [(4, 1), (1, 2)], (4, 2, 3)),  # two index tensors broadcast together
        ((6, 5), [(9,), (9,)], (9,)),  # every dim indexed: rows of one element
        ((0, 3), [(0,)], (0, 3)),
        ((4, 6, 3), [None, (5,)], (4, 5, 3)),  # a gap: the picked positions stay where the indexed dim was
        ((4, 6, 3, 2), [None, (5,), (1,)], (4, 5, 2)),  # adjacent indexed dims after a gap
        ((4, 6, 3), [(5,), None, (5,)], (5, 6)),  # indexed dims apart: the picked positions first
    ],
)
def test_index_put_adds_as_aten_does(
    shape: tuple[int, ...], index_shapes: list[tuple[int, ...] | None], values_shape: tuple[int, ...]
) -> None:
    generator = torch.Generator().manual_seed(0)
    self = torch.randn(shape, generator=generator, dtype=torch.float64)

    def index(size: int, index_shape: tuple[int, ...] | None) -> torch.Tensor | None:
        if index_shape is None:
            return None
        if size == 0:
            return torch.zeros(index_shape, dtype=torch.long)
        return torch.randint(-size, size, index_shape, generator=generator)

    indices = [index(size, index_shape) for size, index_shape in zip(shape, index_shapes)]
    values = torch.randn(values_shape, generator=generator, dtype=torch.float64)
    expected = torch.ops.aten.index_put(self, indices, values, True)
    torch.testing.assert_close(index_put(self, indices, values, True), expected, rtol=1e-15, atol=1e-15)
    int32 = [None if i is None else i.int() for i in indices]
    torch.testing.assert_close(index_put(self, int32, values, True), expected, rtol=1e-15, atol=1e-15)


def test_index_put_leaves_replacing_puts_and_masks_to_the_exporter() -> None:
    self, values = torch.zeros(4, 3), torch.ones(2, 3)
    ids = torch.tensor([0, 2])
    assert index_put(self, [ids], values, False) is NotImplemented
    assert index_put(self, [torch.tensor([True, False, True, False])], values, True) is NotImplemented
    assert index_put(self, [None], values, True) is NotImplemented
