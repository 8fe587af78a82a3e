"""ORT statistics as Lightning metrics, reduced across ranks in one torchmetrics collective.

The callback reduces and logs them on the steps on which Lightning writes its logs (``log_every_n_steps``), at
the end of each training epoch, and at the end of validation and test: between those, a step costs nothing.

Logged names and their cross-rank reduction:

* ``ort/export_seconds``: seconds spent exporting captured graphs to ONNX (or loading them from ``cache_dir``)
  and creating their sessions, summed over the wrapped submodules of a rank, then the **maximum** over ranks
  (the rank everyone waited for).
* ``ort/capture_seconds``: seconds spent capturing graphs with AOTAutograd, reduced the same way. The first
  step's extra cost is about ``ort/capture_seconds + ort/export_seconds``.
* ``ort/cache_hits``: calls that reused a cached graph, **summed** over submodules and ranks.
* ``ort/cache_misses``: graph builds, summed over submodules, then the **maximum** over ranks: with every rank
  seeing the same shapes this is the number of distinct graphs.
* ``ort/fallback_ops``: ops running in PyTorch because ONNX cannot express them, summed over submodules, then
  the **maximum** over ranks. ``0`` means everything runs in ONNX Runtime.
* ``ort/block_graphs``: block graphs built (each exported once for every instance of a repeated block),
  summed over submodules, then the **maximum** over ranks.
* ``ort/block_reuses``: block instances that reused a block graph instead of exporting their own, **summed**
  over submodules and ranks.
* ``ort/onnx_runtime_share``: the share of the work that ONNX Runtime runs (1.0: all), over the submodules
  called so far, weighted by their parameters: each submodule's share of its captured graphs' ops, where the
  ops of graphs that run entirely in PyTorch count as not run and a submodule of which nothing ran in ONNX
  Runtime counts 0 (see :func:`onnx_runtime_share`); then the **minimum** over ranks.
* ``ort/graph_breaks``: graph breaks (Python TorchDynamo could not trace, run in PyTorch between graphs),
  summed over submodules, then the **maximum** over ranks. ``0`` means each network is one graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat
from typing_extensions import override

from lightning_ort.engine.capture.backend import ModuleStatistics
from lightning_ort.module import ORTModule, original_module

EXPORT_SECONDS = "ort/export_seconds"
CAPTURE_SECONDS = "ort/capture_seconds"
FALLBACK_OPS = "ort/fallback_ops"
CACHE_HITS = "ort/cache_hits"
CACHE_MISSES = "ort/cache_misses"
BLOCK_GRAPHS = "ort/block_graphs"
BLOCK_REUSES = "ort/block_reuses"
GRAPH_BREAKS = "ort/graph_breaks"
ONNX_RUNTIME_SHARE = "ort/onnx_runtime_share"


def total_statistics(modules: Mapping[str, ORTModule]) -> ModuleStatistics:
    """This rank's statistics summed over ``modules``."""
    stats = [m.statistics for m in modules.values()]
    return ModuleStatistics(
        **{
            field.name: sum(getattr(s, field.name) or 0 for s in stats)
            for field in dataclasses.fields(ModuleStatistics)
        }
    )


def onnx_runtime_share(modules: Mapping[str, ORTModule]) -> float:
    """The share of the work of the called ``modules`` that ran in ONNX Runtime, weighted by their parameters.

    A module's own share is that of its captured graphs' ops, or 0 where none of them ran in ONNX Runtime (a
    module TorchDynamo captured nothing of runs all in PyTorch); modules never called are left out. 0 before
    any call.

    Example:
        >>> from torch import nn
        >>> dense, unused = ORTModule(nn.Linear(4, 4)), ORTModule(nn.Linear(4, 4))
        >>> _ = dense(torch.randn(2, 4))
        >>> onnx_runtime_share({"dense": dense, "unused": unused})
        1.0
    """
    weighted = total = 0.0
    for module in modules.values():
        if not module.called:
            continue
        stats = module.statistics
        size = float(sum(p.numel() for p in module.parameters()) or 1)
        total += size
        weighted += size * ((stats.onnx_runtime_share or 0.0) if stats.forward_runs else 0.0)
    return weighted / total if total else 0.0


_REDUCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    EXPORT_SECONDS: torch.max,
    CAPTURE_SECONDS: torch.max,
    CACHE_HITS: torch.sum,
    CACHE_MISSES: torch.max,
    FALLBACK_OPS: torch.max,
    BLOCK_GRAPHS: torch.max,
    BLOCK_REUSES: torch.sum,
    GRAPH_BREAKS: torch.max,
    ONNX_RUNTIME_SHARE: torch.min,
}
"""Each logged name and how its per-rank values combine (see the module docstring)."""


class ORTMetrics(Metric):
    """Cross-rank values of the ORT statistics: every rank's values gathered in one collective, then reduced.

    One ``all_gather`` of a row per rank serves all the names, where one torchmetrics aggregation per name
    would cost one collective each. :meth:`reduce` (``compute`` under ``torch.distributed``) is a collective:
    every rank must call it at the same point.

    Example:
        >>> metrics = ORTMetrics()
        >>> values = metrics.reduce(ModuleStatistics(export_seconds=1.5, cache_hits=3, cache_misses=2))
        >>> {name: float(value) for name, value in values.items()}  # doctest: +NORMALIZE_WHITESPACE
        {'ort/export_seconds': 1.5, 'ort/capture_seconds': 0.0, 'ort/cache_hits': 3.0, 'ort/cache_misses': 2.0,
         'ort/fallback_ops': 0.0, 'ort/block_graphs': 0.0, 'ort/block_reuses': 0.0, 'ort/graph_breaks': 0.0,
         'ort/onnx_runtime_share': 0.0}
    """

    full_state_update = False
    rows: list[torch.Tensor]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("rows", default=[], dist_reduce_fx="cat")

    @override
    def update(self, stats: ModuleStatistics, share: float | None = None) -> None:
        """Add this rank's cumulative ``stats`` as a row; ``share`` is its ONNX Runtime share over its networks
        (:func:`onnx_runtime_share`), or that of ``stats`` if ``None``."""
        local = {
            EXPORT_SECONDS: stats.export_seconds,
            CAPTURE_SECONDS: stats.capture_seconds,
            CACHE_HITS: stats.cache_hits or 0,
            CACHE_MISSES: stats.cache_misses or 0,
            FALLBACK_OPS: stats.fallback_ops,
            BLOCK_GRAPHS: stats.block_graphs,
            BLOCK_REUSES: stats.block_reuses,
            GRAPH_BREAKS: stats.graph_breaks or 0,
            ONNX_RUNTIME_SHARE: share if share is not None else stats.onnx_runtime_share or 0.0,
        }
        row = [float(local[name]) for name in _REDUCTIONS]
        self.rows.append(torch.tensor([row], dtype=torch.float64, device=self.device))

    @override
    def compute(self) -> dict[str, torch.Tensor]:
        """Each name's value over the gathered rows (one row per rank)."""
        rows = dim_zero_cat(self.rows)
        return {name: reduce(rows[:, i]).float() for i, (name, reduce) in enumerate(_REDUCTIONS.items())}

    def reduce(self, stats: ModuleStatistics, share: float | None = None) -> dict[str, torch.Tensor]:
        """This rank's cumulative ``stats`` and ``share`` (see :meth:`update`) reduced over all ranks (a collective)."""
        self.reset()
        self.update(stats, share)
        return self.compute()


def summary_table(modules: Mapping[str, ORTModule]) -> str:
    """A small table of what was wrapped: path, class, parameters, where it ran, providers, graphs, build time.

    "ran in" is ``ONNX Runtime``, ``ONNX Runtime + PyTorch`` (ops, graphs or code between graphs in PyTorch),
    ``PyTorch`` for a module of which nothing ran in ONNX Runtime, or ``not called``.
    """
    header = ("module", "class", "params", "ran in", "providers", "graphs", "PyTorch ops", "build s")
    rows = [header]
    for path, module in modules.items():
        stats = module.statistics
        rows.append(
            (
                path,
                type(original_module(module)).__name__,
                f"{sum(p.numel() for p in module.parameters()):,}",
                ran_in(stats) if module.called else "not called",
                ",".join(p.removesuffix("ExecutionProvider") for p in module.providers) or "-",
                str(stats.cached_graphs),
                str(stats.fallback_ops),
                f"{stats.build_seconds:.2f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def ran_in(stats: ModuleStatistics) -> str:
    """Where a module's calls ran: ``"ONNX Runtime"``, ``"ONNX Runtime + PyTorch"`` or ``"PyTorch"``.

    Example:
        >>> ran_in(ModuleStatistics(graphs=0, graph_breaks=2))
        'PyTorch'
        >>> ran_in(ModuleStatistics(graphs=1, forward_runs=3, fallback_ops=1))
        'ONNX Runtime + PyTorch'
    """
    if stats.forward_runs == 0:
        return "PyTorch"
    if stats.fallback_ops or stats.eager_signatures or stats.graph_breaks:
        return "ONNX Runtime + PyTorch"
    return "ONNX Runtime"
