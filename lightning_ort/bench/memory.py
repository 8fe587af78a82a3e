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

import copy
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from typing_extensions import override

from lightning_ort.bench.report import Report
from lightning_ort.bench.workloads import Workload, synchronize
from lightning_ort.module import ORTModule
from lightning_ort.options import CUDA_MEMORY, AttentionPath, CudaMemory, SessionSettings

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
    autocast: torch.dtype | None,
    attention: AttentionPath = "onnx",
) -> list[MemoryRun]:
    """Eager, then ORTModule under each route of ``routes`` (the shared arena last) with ``attention``, on
    ``workload``."""
    ordered = sorted(dict.fromkeys(routes), key=lambda route: route == "shared_arena")
    suffix = "" if attention == "onnx" else f"/attention={attention}"
    runs = [_train("eager", workload, device, steps, autocast, None, attention)]
    runs += [
        _train(f"ort/cuda_memory={route}{suffix}", workload, device, steps, autocast, route, attention)
        for route in ordered
    ]
    return runs


def _train(
    name: str,
    workload: Workload,
    device: torch.device,
    steps: int,
    autocast: torch.dtype | None,
    route: CudaMemory | None,
    attention: AttentionPath,
) -> MemoryRun:
    cuda = device.type == "cuda"
    synchronize(device)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        allocated, outside = torch.cuda.memory_allocated(device), _outside_torch(device)
    torch.manual_seed(0)
    model = copy.deepcopy(workload.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    settings = SessionSettings(cuda_memory=route) if route is not None else None
    module = model if settings is None else ORTModule(model, session_settings=settings, attention=attention)
    scaler = torch.amp.GradScaler(device.type, enabled=autocast is torch.float16)
    times_s: list[float] = []
    losses: list[float] = []
    for _ in range(1 + WARMUP + steps):
        synchronize(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = workload.loss_fn(workload.forward(module))
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        synchronize(device)
        times_s.append(time.perf_counter() - start)
        losses.append(loss.item())
    peak = None
    if cuda:
        grown = torch.cuda.max_memory_allocated(device) - allocated + max(_outside_torch(device) - outside, 0)
        peak = grown / 2**20
    fallback = ""
    if isinstance(module, ORTModule):
        stats = module.statistics
        if stats.eager_signatures or stats.fallback_ops:
            fallback = f"{stats.eager_signatures} signature(s) in PyTorch, {stats.fallback_ops} op(s) in PyTorch"
    return MemoryRun(
        name, statistics.median(times_s[1 + WARMUP :]) * 1e3, times_s[0], peak, losses, pytorch_fallback=fallback
    )


def _outside_torch(device: torch.device) -> int:
    """Device memory in use that PyTorch's caching allocator does not hold."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def format_memory_report(runs: Sequence[MemoryRun], workload: str) -> str:
    """The table ``memory`` prints: per runtime, the step against eager's and the peak against eager's."""
    eager = runs[0]
    width = max(20, *(len(run.runtime) + 2 for run in runs))
    lines = [
        f"CUDA memory routes on {workload}: one process, one runtime after another (routes: {', '.join(CUDA_MEMORY)})",
        f"{'runtime':<{width}}{'step ms':>9}{'vs eager':>10}{'first step s':>14}{'peak MiB':>10}{'x eager':>9}",
    ]
    for run in runs:
        peak = f"{run.peak_mib:>10.0f}" if run.peak_mib is not None else f"{'-':>10}"
        ratio = f"{run.peak_mib / eager.peak_mib:>8.2f}x" if run.peak_mib and eager.peak_mib else f"{'-':>9}"
        lines.append(
            f"{run.runtime:<{width}}{run.step_ms:>9.2f}{eager.step_ms / run.step_ms:>9.2f}x{run.first_step_s:>14.2f}"
            f"{peak}{ratio}"
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
