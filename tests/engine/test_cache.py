"""The graph cache: hits on repeated signatures, misses (builds) on new ones, statistics."""

from __future__ import annotations

import torch
from torch import nn

from lightning_ort import ORTModule
from tests.zoo import MLP


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, double: bool = False) -> torch.Tensor:
        y = self.lin(x)
        return y * 2 if double else y


def test_repeated_calls_hit_and_do_not_export_again() -> None:
    wrapped = ORTModule(MLP())
    x = torch.randn(4, 16)
    wrapped(x).sum().backward()
    first = wrapped.statistics
    assert (first.cache_hits, first.cache_misses, first.cached_graphs) == (0, 1, 1)
    assert first.export_seconds > 0
    assert 0 < first.translation_seconds + first.session_seconds <= first.export_seconds
    assert first.translation_seconds > 0 and first.session_seconds > 0
    for _ in range(3):
        wrapped(torch.randn(4, 16)).sum().backward()
    later = wrapped.statistics
    assert (later.cache_hits, later.cache_misses, later.cached_graphs) == (3, 1, 1)
    assert later.build_seconds == first.build_seconds
    assert (later.forward_runs, later.backward_runs) == (4, 4)


def test_new_shape_dtype_or_constant_adds_a_miss() -> None:
    wrapped = ORTModule(Gated())
    x = torch.randn(2, 4)
    wrapped(x)
    wrapped(torch.randn(5, 4))
    assert wrapped.statistics.cache_misses == 2
    doubled = wrapped(x, double=True)
    torch.testing.assert_close(doubled, wrapped.module(x) * 2)
    wrapped(x, double=True)
    wrapped(x)
    stats = wrapped.statistics
    assert (stats.cache_misses, stats.cache_hits, stats.cached_graphs) == (3, 2, 3)


def test_requires_grad_change_builds_a_new_graph() -> None:
    wrapped = ORTModule(Gated())
    wrapped(torch.randn(2, 4))
    x = torch.randn(2, 4, requires_grad=True)
    wrapped(x).sum().backward()
    assert x.grad is not None
    assert wrapped.statistics.cache_misses == 2


def test_clear_cache_rebuilds_and_keeps_counting() -> None:
    wrapped = ORTModule(Gated())
    x = torch.randn(2, 4)
    wrapped(x)
    wrapped.clear_cache()
    wrapped(x)
    stats = wrapped.statistics
    assert (stats.cache_misses, stats.cached_graphs, stats.forward_runs) == (2, 1, 2)
