"""Index, window and view ops inside a model: after a layer with parameters, before a loss, gradients as eager's.

An op applied to a model's input and the same op applied to a layer's output take different paths through
AOTAutograd. A view of an intermediate that the graph returns comes back in the backward as a tangent, laid
out as the traced output was; for windows that overlap in memory (``unfold`` with a step below its size,
``as_strided``) a strided copy of that gradient would keep one of the values that share an element. Each
pattern here runs after a ``Linear`` and is placed where the boundary matters: as the graph's output, consumed
inside the graph, across a graph break, and next to an op that runs in PyTorch between ONNX Runtime partitions.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_ort import ORTModule
from tests.custom_ops import softsign
from tests.helpers import assert_grads_close, assert_outputs_close, weighted_loss

Pattern = Callable[[torch.Tensor], torch.Tensor]

REPEATED = torch.tensor([0, 3, 3, 7, 0, 23, 12, 12])
ROWS = torch.arange(4)[:, None]

PATTERNS: dict[str, Pattern] = {
    "unfold_overlapping": lambda h: h.unfold(1, 6, 4),
    "unfold_overlapping_by_half": lambda h: h.unfold(1, 4, 2),
    "unfold_disjoint": lambda h: h.unfold(1, 6, 6),
    "as_strided_overlapping": lambda h: h.as_strided((4, 5, 6), (24, 4, 1)),
    "as_strided_stride_zero": lambda h: h.as_strided((4, 3, 24), (24, 0, 1)),
    "expand": lambda h: h[:, None].expand(4, 3, 24),
    "index_select_repeated": lambda h: h.index_select(1, REPEATED),
    "gather_repeated": lambda h: h.gather(1, REPEATED.expand(4, -1)),
    "embedding_repeated": lambda h: F.embedding(REPEATED, h.t()),
    "advanced_index_repeated": lambda h: h[:, REPEATED],
    "scatter_add": lambda h: torch.zeros(4, 8).scatter_add(1, REPEATED.expand(4, -1) % 8, h[:, :8]),
    "index_add": lambda h: torch.zeros(4, 8).index_add(1, REPEATED % 8, h[:, :8]),
    "index_put_accumulate": lambda h: torch.zeros(4, 8).index_put((ROWS, REPEATED % 8), h[:, :8], True),
    "F_unfold": lambda h: F.unfold(h.view(4, 1, 4, 6), (2, 3), stride=1),
    "F_fold": lambda h: F.fold(h.view(4, 6, 4), (3, 4), (2, 3), stride=1),
    "avg_pool1d_overlapping": lambda h: F.avg_pool1d(h[:, None], 6, 4),
    "max_pool1d_overlapping": lambda h: F.max_pool1d(h[:, None], 6, 4),
    "diagonal": lambda h: h.view(4, 4, 6).diagonal(dim1=1, dim2=2),
    "roll": lambda h: h.roll(5, 1),
    "repeat_interleave": lambda h: h.repeat_interleave(3, dim=1),
    "pixel_shuffle": lambda h: F.pixel_shuffle(h.view(1, 4, 4, 6), 2),
    "cumsum": lambda h: h.cumsum(1),
    "expand_and_sum": lambda h: h[:, None].expand(4, 3, 24).sum(1),
    "narrow_and_cat": lambda h: torch.cat([h.narrow(1, 0, 10), h.narrow(1, 6, 10)], 1),
    "transpose": lambda h: h.t(),
    "strided_slice": lambda h: h[:, ::3],
}
"""Ops on a ``(4, 24)`` layer output; several read or write the same element more than once."""

OVERLAPPING = ["unfold_overlapping", "unfold_overlapping_by_half", "as_strided_overlapping", "expand", "diagonal"]


def _graph_break(t: torch.Tensor) -> torch.Tensor:
    torch._dynamo.graph_break()
    return t * 3


PLACEMENTS: dict[str, Callable[[Pattern, torch.Tensor], torch.Tensor]] = {
    "returned": lambda op, h: op(h),
    "consumed": lambda op, h: op(h).tanh() * 2,
    "before_graph_break": lambda op, h: _graph_break(op(h)),
    "after_pytorch_op": lambda op, h: op(softsign(h)),
}


class LayerThenOp(nn.Module):
    """A ``Linear`` whose output goes through ``op`` placed by ``placement``."""

    def __init__(self, op: Pattern, placement: Callable[[Pattern, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 24)
        self._op = op
        self._placement = placement

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._placement(self._op, self.linear(x))


class ArgmaxFeaturesUnfold(nn.Module):
    """onnxruntime-training's ``argmax`` + ``unfold`` gradient check: one-hot argmax features, a Linear, windows."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = F.one_hot(x.argmax(1), 16).float() + x
        return self.linear(features).unfold(1, 6, 4)


def _check(model: nn.Module) -> ORTModule:
    torch.manual_seed(0)
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        actual = wrapped(x.clone())
        weighted_loss(actual).backward()
    expected = eager(x.clone())
    weighted_loss(expected).backward()
    assert_outputs_close(actual, expected)
    assert_grads_close(wrapped, eager)
    assert wrapped.statistics.forward_runs >= 1 and wrapped.statistics.backward_runs >= 1
    return wrapped


@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize("placement", ["returned", "consumed"])
def test_op_after_a_layer_has_eager_gradients(name: str, placement: str) -> None:
    torch.manual_seed(0)
    _check(LayerThenOp(PATTERNS[name], PLACEMENTS[placement]))


@pytest.mark.parametrize("name", OVERLAPPING)
@pytest.mark.parametrize("placement", ["before_graph_break", "after_pytorch_op"])
def test_overlapping_view_at_a_pytorch_boundary_has_eager_gradients(name: str, placement: str) -> None:
    torch.manual_seed(0)
    wrapped = _check(LayerThenOp(PATTERNS[name], PLACEMENTS[placement]))
    stats = wrapped.statistics
    assert stats.graph_breaks >= 1 if placement == "before_graph_break" else stats.fallback_ops >= 1


def test_argmax_features_then_overlapping_unfold_has_eager_gradients() -> None:
    torch.manual_seed(0)
    _check(ArgmaxFeaturesUnfold())
