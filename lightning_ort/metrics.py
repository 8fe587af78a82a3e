"""ORT statistics as Lightning metrics, reduced across ranks with torchmetrics aggregations.

Logged names and their cross-rank reduction:

* ``ort/export_time_s``: seconds spent exporting captured graphs to ONNX (or loading them from ``cache_dir``)
  and creating their sessions, summed over the wrapped submodules of a rank, then the **maximum** over ranks
  (the rank everyone waited for).
* ``ort/capture_time_s``: seconds spent capturing graphs with AOTAutograd, reduced the same way. The first
  step's extra cost is about ``ort/capture_time_s + ort/export_time_s``.
* ``ort/cache_hits``: calls that reused a cached graph, **summed** over submodules and ranks.
* ``ort/cache_misses``: graph builds, summed over submodules, then the **maximum** over ranks: with every rank
  seeing the same shapes this is the number of distinct graphs.
* ``ort/fallback_ops``: ops running in PyTorch because ONNX cannot express them, summed over submodules, then
  the **maximum** over ranks. ``0`` means everything runs in ONNX Runtime.
* ``ort/block_graphs``: block graphs built (each exported once for every instance of a repeated block),
  summed over submodules, then the **maximum** over ranks.
* ``ort/block_reuses``: block instances that reused a block graph instead of exporting their own, **summed**
  over submodules and ranks.
* ``ort/onnx_runtime_share``: the share of the captured graphs' ops that ONNX Runtime runs (1.0: all; the ops
  of graphs that run entirely in PyTorch count as not run; 0 while no graph was captured), over all
  submodules, then the **minimum** over ranks. Shown in the progress bar with ``prog_bar=True``.
* ``ort/graph_breaks``: graph breaks (Python TorchDynamo could not trace, run in PyTorch between graphs),
  summed over submodules, then the **maximum** over ranks. ``0`` means each network is one graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torchmetrics import MaxMetric, Metric, MinMetric, SumMetric

from lightning_ort.engine.backend import CacheStatistics
from lightning_ort.module import ORTModule, original_module

EXPORT_TIME = "ort/export_time_s"
CAPTURE_TIME = "ort/capture_time_s"
FALLBACK_OPS = "ort/fallback_ops"
CACHE_HITS = "ort/cache_hits"
CACHE_MISSES = "ort/cache_misses"
BLOCK_GRAPHS = "ort/block_graphs"
BLOCK_REUSES = "ort/block_reuses"
GRAPH_BREAKS = "ort/graph_breaks"
ONNX_RUNTIME_SHARE = "ort/onnx_runtime_share"


def total_statistics(modules: Mapping[str, ORTModule]) -> CacheStatistics:
    """This rank's statistics summed over ``modules``."""
    stats = [m.statistics for m in modules.values()]
    return CacheStatistics(
        **{field.name: sum(getattr(s, field.name) or 0 for s in stats) for field in dataclasses.fields(CacheStatistics)}
    )


class ORTMetrics:
    """Cross-rank values of the ORT statistics, computed with torchmetrics aggregations.

    :meth:`compute` is a collective under ``torch.distributed``: every rank must call it at the same point.

    Example:
        >>> metrics = ORTMetrics()
        >>> values = metrics.compute(CacheStatistics(export_seconds=1.5, cache_hits=3, cache_misses=2))
        >>> {name: float(value) for name, value in values.items()}  # doctest: +NORMALIZE_WHITESPACE
        {'ort/export_time_s': 1.5, 'ort/capture_time_s': 0.0, 'ort/cache_hits': 3.0, 'ort/cache_misses': 2.0,
         'ort/fallback_ops': 0.0, 'ort/block_graphs': 0.0, 'ort/block_reuses': 0.0, 'ort/graph_breaks': 0.0,
         'ort/onnx_runtime_share': 0.0}
    """

    def __init__(self) -> None:
        self._metrics: dict[str, Metric] = {
            EXPORT_TIME: MaxMetric(),
            CAPTURE_TIME: MaxMetric(),
            CACHE_HITS: SumMetric(),
            CACHE_MISSES: MaxMetric(),
            FALLBACK_OPS: MaxMetric(),
            BLOCK_GRAPHS: MaxMetric(),
            BLOCK_REUSES: SumMetric(),
            GRAPH_BREAKS: MaxMetric(),
            ONNX_RUNTIME_SHARE: MinMetric(),
        }

    def compute(self, stats: CacheStatistics, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """Reduce this rank's cumulative ``stats`` over all ranks (a collective)."""
        local = {
            EXPORT_TIME: float(stats.export_seconds),
            CAPTURE_TIME: float(stats.capture_seconds),
            CACHE_HITS: float(stats.cache_hits or 0),
            CACHE_MISSES: float(stats.cache_misses or 0),
            FALLBACK_OPS: float(stats.fallback_ops),
            BLOCK_GRAPHS: float(stats.block_graphs),
            BLOCK_REUSES: float(stats.block_reuses),
            GRAPH_BREAKS: float(stats.graph_breaks or 0),
            ONNX_RUNTIME_SHARE: float(stats.onnx_runtime_share or 0.0),  # 0 while nothing ran in ONNX Runtime
        }
        values = {}
        for name, metric in self._metrics.items():
            if device is not None:
                metric.to(device)
            metric.reset()
            metric.update(torch.tensor(local[name], dtype=torch.float64, device=device))
            values[name] = metric.compute().detach().float()
        return values


def summary_table(modules: Mapping[str, ORTModule]) -> str:
    """A small table of what was wrapped: path, class, parameters, where it ran, providers, graphs, build time.

    "ran in" is ``ONNX Runtime``, ``ONNX Runtime + PyTorch`` (ops, graphs or code between graphs in PyTorch), or
    ``PyTorch`` for a module of which nothing ran in ONNX Runtime.
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
                ran_in(stats),
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


def ran_in(stats: CacheStatistics) -> str:
    """Where a module's calls ran: ``"ONNX Runtime"``, ``"ONNX Runtime + PyTorch"`` or ``"PyTorch"``.

    Example:
        >>> ran_in(CacheStatistics(graphs=0, graph_breaks=2))
        'PyTorch'
        >>> ran_in(CacheStatistics(graphs=1, forward_runs=3, fallback_ops=1))
        'ONNX Runtime + PyTorch'
    """
    if stats.forward_runs == 0:
        return "PyTorch"
    if stats.fallback_ops or stats.eager_signatures or stats.graph_breaks:
        return "ONNX Runtime + PyTorch"
    return "ONNX Runtime"
