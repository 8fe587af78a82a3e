"""Where a training step's time goes: ``python -m lightning_ort.bench breakdown``.

For each runtime (eager first), after warm-up: the median wall time of a step, then, from ``torch.profiler`` over
a few more steps, the time the device spent in kernels per step (ONNX Runtime's kernels run in this process
and are counted too), the kernel launches and the host's waits for the device (stream, device and event
synchronisations) and copies per step, the host operations that took the most time and, on CUDA, the kernels
that took the most device time (PyTorch's and ONNX Runtime's alike, by kernel name). A step whose device time is
well under its wall time leaves the GPU idle: the host is launching, or waiting where it need not; a runtime
whose device time exceeds eager's runs slower kernels, or more of them, and its kernel list says which.

Every step of the study synchronises the device twice (to time it) and reads the loss once (``.item()``):
eager's row shows that baseline.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile
from typing_extensions import override

from lightning_ort.bench.report import Report, numerics
from lightning_ort.bench.runtimes import warmed_runner
from lightning_ort.bench.workloads import Workload

PROFILED_STEPS = 2
"""Steps recorded by the profiler per runtime (after the timed ones); its counts are per step."""
TOP = 8
"""Host operations, and device kernels, listed per runtime unless ``--top`` says otherwise."""
KERNEL_NAME_CHARS = 100
"""A kernel's name is cut to this many characters (template arguments make them long)."""
NAMESPACES = (
    ("onnxruntime::contrib::cuda::", "ort::"),
    ("onnxruntime::cuda::", "ort::"),
    ("onnxruntime::", "ort::"),
    ("at::native::", "at::"),
    ("(anonymous namespace)::", ""),
    ("at_cuda_detail::", ""),
)
"""Namespaces shortened in kernel names (``ort::`` for ONNX Runtime's, ``at::`` for PyTorch's), so that the
template arguments that tell kernels apart (an elementwise kernel's ``OP_Mul``) fit in the listing."""

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
"""The host calls that launch device work."""
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
"""The host calls that wait for the device."""
COPIES = ("cudaMemcpy", "cudaMemcpyAsync")
"""The host calls that copy between host and device memory (or within the device)."""


@dataclass
class StepBreakdown:
    """One runtime's step: wall time, device-kernel time (``None`` on CPU), and per step the launches, waits
    and copies by host call, the host operations that took the most time and the device kernels that did (each
    as name, calls per step, ms per step; no kernels on CPU)."""

    runtime: str
    wall_ms: float
    device_ms: float | None
    launches: int
    waits: dict[str, int] = field(default_factory=dict)
    copies: dict[str, int] = field(default_factory=dict)
    top_host: list[tuple[str, float, float]] = field(default_factory=list)
    top_device: list[tuple[str, float, float]] = field(default_factory=list)


def break_down(
    workload: Workload,
    runtimes: Sequence[str],
    device: torch.device,
    steps: int,
    warmup: int,
    precision: str,
    top: int = TOP,
) -> list[StepBreakdown]:
    """Each of ``runtimes`` on ``workload``, one after another: ``steps`` timed steps, then the profiled ones;
    the ``top`` host operations and device kernels by time are kept.

    Example:
        >>> from lightning_ort.bench.workloads import WORKLOADS
        >>> (run,) = break_down(WORKLOADS["mlp"](torch.device("cpu")), ["eager"], torch.device("cpu"), 1, 0, "fp32")
        >>> run.runtime, run.device_ms, run.wall_ms > 0
        ('eager', None, True)
    """
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    results = []
    for name in runtimes:
        runner = warmed_runner(name, workload, device, precision, warmup)
        wall_ms = statistics.median(runner.step() * 1e3 for _ in range(steps))
        with profile(activities=activities) as profiler:
            for _ in range(PROFILED_STEPS):
                runner.step()
        events = profiler.key_averages()
        host = [event for event in events if event.device_type == torch.autograd.DeviceType.CPU]
        calls = {event.key: event.count for event in host}
        per_step = {key: round(count / PROFILED_STEPS) for key, count in calls.items()}
        kernels = [event for event in events if event.device_type == torch.autograd.DeviceType.CUDA]
        device_ms = None
        if device.type == "cuda":
            device_ms = sum(event.self_device_time_total for event in kernels) / 1e3 / PROFILED_STEPS
        top_host = sorted(host, key=lambda event: -event.self_cpu_time_total)[:top]
        top_kernels = sorted(kernels, key=lambda event: -event.self_device_time_total)[:top]
        results.append(
            StepBreakdown(
                name,
                wall_ms,
                device_ms,
                sum(per_step.get(key, 0) for key in LAUNCHES),
                {key: per_step[key] for key in WAITS if per_step.get(key)},
                {key: per_step[key] for key in COPIES if per_step.get(key)},
                [(e.key, e.count / PROFILED_STEPS, e.self_cpu_time_total / 1e3 / PROFILED_STEPS) for e in top_host],
                [
                    (e.key, e.count / PROFILED_STEPS, e.self_device_time_total / 1e3 / PROFILED_STEPS)
                    for e in top_kernels
                ],
            )
        )
        del runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def format_breakdown(runs: Sequence[StepBreakdown]) -> list[str]:
    """The study's table and, per runtime, its top host operations and device kernels.

    Example:
        >>> run = StepBreakdown("ort", 10.0, 8.0, 12, top_device=[("void ampere_sgemm_128x64_nn", 4, 3.5)])
        >>> format_breakdown([run])[-1].split()
        ['ampere_sgemm_128x64_nn', '4', 'calls', '3.50', 'ms']
    """
    lines = [f"{'runtime':<28}{'wall ms':>9}{'device ms':>11}{'busy':>7}{'launches':>10}  waits / copies per step"]
    for run in runs:
        if run.device_ms is not None:
            device = f"{run.device_ms:>11.2f}{run.device_ms / run.wall_ms:>7.0%}"
        else:
            device = f"{'-':>11}{'-':>7}"
        waits = ", ".join(f"{key} {count}" for key, count in {**run.waits, **run.copies}.items()) or "-"
        lines.append(f"{run.runtime:<28}{run.wall_ms:>9.2f}{device}{run.launches:>10}  {waits}")
    for run in runs:
        lines += ["", f"{run.runtime}: host time per step"]
        lines += [f"  {name[:60]:<60}{calls:>8.0f} calls{ms:>9.2f} ms" for name, calls, ms in run.top_host]
        if run.top_device:
            lines += ["", f"{run.runtime}: device time per step"]
            lines += [
                f"  {_kernel_name(name):<{KERNEL_NAME_CHARS}}{calls:>8.0f} calls{ms:>9.2f} ms"
                for name, calls, ms in run.top_device
            ]
    return lines


def _kernel_name(name: str) -> str:
    """A kernel's name without its return type and parameter list, with :data:`NAMESPACES` shortened, cut to
    :data:`KERNEL_NAME_CHARS` characters.

    Example:
        >>> _kernel_name("void onnxruntime::cuda::_BinaryElementWiseSimple<true, false, float, "
        ...              "onnxruntime::cuda::OP_Mul<float, float, float>, 256, 4>(float const*, float*, int)")
        'ort::_BinaryElementWiseSimple<true, false, float, ort::OP_Mul<float, float, float>, 256, 4>'
        >>> _kernel_name("Memcpy DtoD (Device -> Device)")
        'Memcpy DtoD (Device -> Device)'
    """
    name = name.removeprefix("void ")
    for long, short in NAMESPACES:
        name = name.replace(long, short)
    depth = 0
    for i, char in enumerate(name):
        depth += (char == "<") - (char == ">")
        if char == "(" and depth == 0 and i > 0 and name[i - 1] != " ":
            name = name[:i]
            break
    return name[:KERNEL_NAME_CHARS]


@dataclass
class BreakdownReport(Report):
    """The ``breakdown`` study: each runtime's step on ``workload`` under ``precision``."""

    runs: list[StepBreakdown] = field(default_factory=list)
    workload: str = ""
    precision: str = "fp32"
    memory_format: str = "contiguous"

    @override
    def conditions(self) -> list[str]:
        return [
            self.workload,
            *numerics(self.precision, self.memory_format),
            *super().conditions(),
            f"counts from torch.profiler over {PROFILED_STEPS} more steps",
        ]

    @override
    def body(self) -> list[str]:
        return format_breakdown(self.runs)
