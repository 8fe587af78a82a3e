"""ORT statistics as Lightning metrics, reduced across ranks with torchmetrics aggregations.

Logged names and their cross-rank reduction:

* ``ort/export_time_s``: seconds spent building graphs (tracing, ONNX export, session creation), summed over
  the wrapped submodules of a rank, then the **maximum** over ranks (the rank everyone waited for).
* ``ort/cache_hits``: calls that reused a cached graph, **summed** over submodules and ranks.
* ``ort/cache_misses``: graph builds, summed over submodules, then the **maximum** over ranks: with every rank
  seeing the same shapes this is the number of distinct graphs.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torchmetrics import MaxMetric, Metric, SumMetric

from lightning_ort.engine.cache import CacheStatistics
from lightning_ort.module import ORTModule

EXPORT_TIME = "ort/export_time_s"
CACHE_HITS = "ort/cache_hits"
CACHE_MISSES = "ort/cache_misses"


def total_statistics(modules: Mapping[str, ORTModule]) -> CacheStatistics:
    """This rank's statistics summed over ``modules``."""
    stats = [m.statistics for m in modules.values()]
    return CacheStatistics(
        export_seconds=sum(s.export_seconds for s in stats),
        cache_hits=sum(s.cache_hits for s in stats),
        cache_misses=sum(s.cache_misses for s in stats),
        cached_graphs=sum(s.cached_graphs for s in stats),
        forward_runs=sum(s.forward_runs for s in stats),
        backward_runs=sum(s.backward_runs for s in stats),
    )


class ORTMetrics:
    """Cross-rank values of the ORT statistics, computed with torchmetrics aggregations.

    :meth:`compute` is a collective under ``torch.distributed``: every rank must call it at the same point.

    Example:
        >>> metrics = ORTMetrics()
        >>> values = metrics.compute(CacheStatistics(export_seconds=1.5, cache_hits=3, cache_misses=2))
        >>> {name: float(value) for name, value in values.items()}
        {'ort/export_time_s': 1.5, 'ort/cache_hits': 3.0, 'ort/cache_misses': 2.0}
    """

    def __init__(self) -> None:
        self._metrics: dict[str, Metric] = {
            EXPORT_TIME: MaxMetric(),
            CACHE_HITS: SumMetric(),
            CACHE_MISSES: MaxMetric(),
        }

    def compute(self, stats: CacheStatistics, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """Reduce this rank's cumulative ``stats`` over all ranks (a collective)."""
        local = {
            EXPORT_TIME: float(stats.export_seconds),
            CACHE_HITS: float(stats.cache_hits),
            CACHE_MISSES: float(stats.cache_misses),
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
    """A small table of what was wrapped: path, class, parameters, providers, graphs and build time."""
    header = ("module", "class", "params", "providers", "graphs", "export s")
    rows = [header]
    for path, module in modules.items():
        stats = module.statistics
        rows.append(
            (
                path,
                type(module.module).__name__,
                f"{sum(p.numel() for p in module.parameters()):,}",
                ",".join(p.removesuffix("ExecutionProvider") for p in module.providers) or "-",
                str(stats.cached_graphs),
                f"{stats.export_seconds:.2f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
