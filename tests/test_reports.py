"""What lightning_ort reports is what happened: a module that ran nothing in ONNX Runtime is reported as PyTorch,
and the advice names the cause."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_ort import CaptureError, FallbackWarning, ORTModule
from lightning_ort.lightning.metrics import ran_in, summary_table
from tests.zoo import MLP


class SparseProduct(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 4))

    def forward(self, sparse: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(sparse, self.weight)


def _sparse_input() -> torch.Tensor:
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(0)).relu().to_sparse()


def test_a_module_that_ran_nothing_in_onnx_runtime_is_reported_as_pytorch() -> None:
    model = ORTModule(SparseProduct())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model(_sparse_input()).sum().backward()
    messages = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    assert messages and all("nothing of it runs in ONNX Runtime" in m for m in messages), messages
    assert all("sparse tensor" in m and "both sides" not in m for m in messages)
    stats = model.statistics
    assert (stats.graphs, stats.forward_runs, stats.cache_hits, stats.cache_misses) == (0, 0, 0, 0)
    assert ran_in(stats) == "PyTorch"
    table = summary_table({"net": model}).splitlines()
    assert "ran in" in table[0] and "PyTorch" in table[2] and "ONNX Runtime" not in table[2]


def test_under_fallback_raise_the_advice_names_the_sparse_input() -> None:
    model = ORTModule(SparseProduct(), fallback="raise")
    with pytest.raises(CaptureError, match=r"sparse tensor reached the model.*to_dense"):
        model(_sparse_input())


def test_a_module_that_ran_in_onnx_runtime_is_reported_so() -> None:
    model = ORTModule(MLP())
    model(torch.randn(2, 16)).sum().backward()
    assert ran_in(model.statistics) == "ONNX Runtime"
    assert "ONNX Runtime" in summary_table({"net": model}).splitlines()[2]


def test_a_graph_break_warns_once_per_model_and_folds_dynamos_own_log(capfd: pytest.CaptureFixture[str]) -> None:
    class ItemBreak(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scale = float(x.abs().max().item())  # a graph break: the value leaves the graph
            return self.linear(x) * scale

    model = ORTModule(ItemBreak())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with warnings.catch_warnings():  # as Lightning's loops do, which resets Python's own deduplication
                warnings.simplefilter("always")
                model(torch.randn(2, 4)).sum().backward()
    breaks = [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(breaks) == 1, [str(w.message) for w in breaks]
    assert "Tensor.item()" in str(breaks[0].message) and "tensor's value" in str(breaks[0].message)
    assert "Graph break" not in capfd.readouterr().err


def test_the_share_of_ops_in_onnx_runtime_counts_the_fallback_ops() -> None:
    from tests.custom_ops import CustomOpMLP

    full = ORTModule(MLP())
    full(torch.randn(2, 16)).sum().backward()
    assert full.statistics.onnx_runtime_share == 1.0 and full.statistics.graph_ops > 0
    partial = ORTModule(CustomOpMLP())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        partial(torch.randn(2, 8)).sum().backward()
    stats = partial.statistics
    assert stats.fallback_ops >= 1
    assert stats.onnx_runtime_share == (stats.graph_ops - stats.fallback_ops) / stats.graph_ops
    assert 0 < stats.onnx_runtime_share < 1
    nothing = ORTModule(SparseProduct())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nothing(_sparse_input())
    assert nothing.statistics.onnx_runtime_share is None
