"""The CUDA memory routes side by side: ``python -m lightning_ort.bench memory --device cuda --workload gpt2``.

One process trains the workload with eager PyTorch, then with ORTModule under each
``SessionSettings(cuda_memory=...)`` route asked for (all three by default), one runtime after another, and
reports each one's median step, its first step and its peak device memory: PyTorch's peak allocated memory
since the runtime was built, plus the growth of the device memory held outside PyTorch's allocator (ONNX
Runtime's arenas keep their peak size). The shared arena stays registered for the rest of the process, so it
is measured last. One process rather than the ``run`` study's fresh process per runtime for the peaks, where
every ORTModule exports its graphs once more. On CPU the routes do not apply (they are CUDA settings) and no
peak is reported.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from typing_extensions import override

from lightning_ort.bench.report import Report, peak_cells
from lightning_ort.bench.runtimes import empty_cuda_mark, peak_mib, warmed_runner
from lightning_ort.bench.workloads import Workload
from lightning_ort.options import CUDA_MEMORY, AttentionPath, CudaMemory

WARMUP = 2
"""Untimed steps after the first."""


@dataclass
class MemoryRun:
    """One runtime (``"eager"`` or ``"ort/cuda_memory=ROUTE"``): median and first step, peak device memory
    (``None`` on CPU), and what of ORTModule's step ran in PyTorch (``""``: nothing)."""

    runtime: str
    step_ms: float
    first_step_s: float
    peak_mib: float | None
    losses: list[float]
    pytorch_fallback: str = ""


def run_memory_study(
    workload: Workload,
    routes: Sequence[CudaMemory],
    device: torch.device,
    steps: int,
    precision: str = "fp32",
    attention: AttentionPath = "auto",
) -> list[MemoryRun]:
    """Eager, then ORTModule under each route of ``routes`` (the shared arena last) with ``attention``, on
    ``workload`` under ``precision`` (as ``run --precision``)."""
    ordered = sorted(dict.fromkeys(routes), key=lambda route: route == "shared_arena")
    suffix = "" if attention == "auto" else f"/attention={attention}"
    names = ["eager", *(f"ort/cuda_memory={route}{suffix}" for route in ordered)]
    return [_train(name, workload, device, steps, precision) for name in names]


def _train(name: str, workload: Workload, device: torch.device, steps: int, precision: str) -> MemoryRun:
    mark = empty_cuda_mark(device)
    runner = warmed_runner(name, workload, device, precision, WARMUP)
    times_s = [runner.step() for _ in range(steps)]
    return MemoryRun(
        name,
        statistics.median(times_s) * 1e3,
        runner.first_step_s,
        peak_mib(device, mark),
        runner.losses,
        runner.pytorch_fallback(),
    )


def format_memory_report(runs: Sequence[MemoryRun], workload: str) -> str:
    """The table ``memory`` prints: per runtime, the step against eager's and the peak against eager's."""
    eager = runs[0]
    width = max(20, *(len(run.runtime) + 2 for run in runs))
    lines = [
        f"CUDA memory routes on {workload}: one process, one runtime after another (routes: {', '.join(CUDA_MEMORY)})",
        f"{'runtime':<{width}}{'step ms':>9}{'vs eager':>10}{'first step s':>14}{'peak MiB':>10}{'x eager':>9}",
    ]
    for run in runs:
        lines.append(
            f"{run.runtime:<{width}}{run.step_ms:>9.2f}{eager.step_ms / run.step_ms:>9.2f}x{run.first_step_s:>14.2f}"
            f"{peak_cells(run.peak_mib, eager.peak_mib)}"
        )
        if run.pytorch_fallback:
            lines.append(f"{'':<{width}}  ^ not all ONNX Runtime: {run.pytorch_fallback}")
    return "\n".join(lines)


@dataclass
class MemoryReport(Report):
    """The ``memory`` study: eager and each CUDA memory route on ``workload``, under ``precision``."""

    memory: list[MemoryRun] = field(default_factory=list)
    workload: str = ""
    precision: str = "fp32"

    @override
    def conditions(self) -> list[str]:
        return [self.precision, *super().conditions()]

    @override
    def body(self) -> list[str]:
        return [format_memory_report(self.memory, self.workload)]
