"""``torch.cdist``'s direct path decomposed (:mod:`lightning_ort.engine.fx.distance`): ATen's values, and a
prototype head that trains in ONNX Runtime alone."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from lightning_ort import ORTModule
from lightning_ort.engine.fx.distance import PAIRWISE_ELEMENTS, cdist_backward, cdist_forward
from tests.helpers import assert_grads_close

aten = torch.ops.aten

NORMS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, math.inf]


@pytest.mark.parametrize("p", NORMS)
def test_distances_and_gradients_match_aten(p: float) -> None:
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(2, 6, 4, generator=g, dtype=torch.float64)
    x2 = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    x2[0, 0] = x1[0, 0]  # a zero distance
    x2[1, 1, :2] = x1[1, 2, :2]  # equal coordinates at a non-zero distance
    dist = aten._cdist_forward(x1, x2, p, None)
    torch.testing.assert_close(cdist_forward(x1, x2, p), dist, rtol=1e-12, atol=1e-12)
    grad = torch.randn(dist.shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(
        cdist_backward(grad, x1, x2, p, dist), aten._cdist_backward(grad, x1, x2, p, dist), rtol=1e-10, atol=1e-12
    )


def test_pairwise_differences_past_the_limit_keep_atens_ops() -> None:
    side = math.isqrt(PAIRWISE_ELEMENTS // 4) + 1
    x1, x2 = torch.zeros(side, 4), torch.zeros(side, 4)
    assert cdist_forward(x1, x2, 1.0) is NotImplemented
    dist = torch.zeros(side, side)
    assert cdist_backward(dist, x1, x2, 1.0, dist) is NotImplemented


class PrototypeHead(nn.Module):
    """A prototypical-network classifier: embeddings scored by their negative distance to learned prototypes."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.embed = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 8))
        self.prototypes = nn.Parameter(torch.randn(5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -torch.cdist(self.embed(x), self.prototypes, p=self.p)


@pytest.mark.parametrize("p", [1.0, 2.0])
def test_prototype_head_trains_in_onnx_runtime_as_eager(p: float) -> None:
    torch.manual_seed(0)
    model = PrototypeHead(p)
    x, labels = torch.randn(10, 12), torch.randint(0, 5, (10,))
    wrapped = ORTModule(copy.deepcopy(model), fallback="raise")
    loss = nn.functional.cross_entropy(wrapped(x), labels)
    expected = nn.functional.cross_entropy(model(x), labels)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    loss.backward()
    expected.backward()
    assert_grads_close(wrapped, model, rtol=1e-4, atol=1e-6)
    assert wrapped.statistics.backward_runs == 1 and wrapped.statistics.fallback_ops == 0
