"""The runtimes the benchmark compares, by name, and the training step each one runs.

A runtime is ``eager``, ``inductor`` (``torch.compile``), ``ort`` (:class:`~lightning_ort.ORTModule`), or ``ort``
with ORTModule options (``ort/cuda_memory=shared_arena/attention=torch``, see :data:`ORT_VARIANTS`), so that one
run compares them. :class:`Runner` holds one runtime's copy of a workload's model, its AdamW and its step, for
every study that times steps.
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from lightning_ort.bench.workloads import Workload, synchronize
from lightning_ort.engine.capture.blocks import resolve_blocks
from lightning_ort.module import ORTModule
from lightning_ort.options import (
    ATTENTION_PATHS,
    CONV_WEIGHT_GRADS,
    CPU_MATMUL,
    CUDA_MEMORY,
    AttentionPath,
    ConvWeightGrad,
    CpuMatmul,
    CudaMemory,
    DebugOptions,
    SessionSettings,
)

RUNTIMES = ("eager", "inductor", "ort")
"""The runtimes a run compares by default; eager always runs first, as the reference of the ratios."""
ORT_VARIANTS = {
    "cuda_memory": CUDA_MEMORY,
    "cpu_matmul": CPU_MATMUL,
    "attention": ATTENTION_PATHS,
    "cuda_graph": ("on", "off"),
    "conv_weight_grad": CONV_WEIGHT_GRADS,
    "blocks": ("auto", "repeated", "none"),
}
"""The ORTModule options a runtime name may set: ``ort/cuda_memory=shared_arena/attention=torch``."""


def runtime_name(name: str) -> str:
    """``name`` if it is a runtime: ``eager``, ``inductor``, ``ort``, or ``ort`` with options (:data:`ORT_VARIANTS`).

    Raises:
        argparse.ArgumentTypeError: it is not (as ``--runtime``'s type, argparse reports it).

    Example:
        >>> runtime_name("ort/attention=torch")
        'ort/attention=torch'
    """
    base, *settings = name.split("/")
    if base in RUNTIMES and not settings and base != "ort":
        return name
    options = [setting.partition("=") for setting in settings]
    if base != "ort" or any(key not in ORT_VARIANTS or value not in ORT_VARIANTS[key] for key, _, value in options):
        variants = "; ".join(f"{key}={'|'.join(values)}" for key, values in ORT_VARIANTS.items())
        raise argparse.ArgumentTypeError(
            f"{name!r} is not a runtime: eager, inductor, ort, or ort/OPTION=VALUE... with {variants}"
        )
    return name


def ort_variant(name: str) -> dict[str, str]:
    """The ORTModule options of runtime ``name`` (``{}`` for ``"ort"``).

    Example:
        >>> ort_variant("ort/cuda_memory=shared_arena/attention=torch")
        {'cuda_memory': 'shared_arena', 'attention': 'torch'}
    """
    return {key: value for key, _, value in (setting.partition("=") for setting in name.split("/")[1:])}


def _blocks(model: nn.Module, variant: str) -> str | list[type[nn.Module]] | None:
    """``blocks`` for ORTModule: ``"auto"`` as the strategies pass it (light blocks inlined on CUDA), the classes
    it finds named (``"repeated"``: kept whatever their work), or ``None`` (``"none"``: one graph)."""
    if variant == "repeated":
        return resolve_blocks(model, "auto")
    return "auto" if variant == "auto" else None


PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``--precision``: the autocast dtype (``None``: no autocast)."""


class Runner:
    """One runtime's copy of the model, its optimizer and its step."""

    def __init__(
        self,
        name: str,
        workload: Workload,
        device: torch.device,
        debug_options: DebugOptions | None = None,
        precision: str = "fp32",
    ) -> None:
        model = copy.deepcopy(workload.model)
        self.name = name
        self.model: nn.Module = model
        if name == "inductor":
            self.model = torch.compile(model)  # type: ignore[assignment]
        elif name.split("/")[0] == "ort":
            variant = ort_variant(name)
            memory = cast(CudaMemory, variant.get("cuda_memory", "torch"))
            attention = cast(AttentionPath, variant.get("attention", "auto"))
            weight_grad = cast(ConvWeightGrad, variant.get("conv_weight_grad", "auto"))
            settings = SessionSettings(
                cpu_matmul=cast(CpuMatmul, variant.get("cpu_matmul", "auto")),
                cuda_memory=memory,
                cuda_graph=variant.get("cuda_graph") == "on",
            )
            self.model = ORTModule(
                model,
                debug_options,
                session_settings=settings,
                blocks=_blocks(model, variant.get("blocks", "none")),
                attention=attention,
                conv_weight_grad=weight_grad,
            )
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.autocast_dtype = PRECISIONS[precision]
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.autocast_dtype is torch.float16)
        self.workload = workload
        self.device = device
        self.losses: list[float] = []
        self.times_ms: list[float] = []
        self.first_step_s = 0.0

    def pytorch_fallback(self) -> str:
        """What of an ORTModule's step ran in PyTorch instead (``""``: everything ran in ONNX Runtime)."""
        if not isinstance(self.model, ORTModule):
            return ""
        stats = self.model.statistics
        if stats.eager_signatures:
            return "the whole model ran in PyTorch (ONNX Runtime could not build its graphs; see the warning)"
        if stats.fallback_ops:
            return f"{stats.fallback_ops} op(s) ran in PyTorch between ONNX Runtime partitions"
        return ""

    def step(self) -> float:
        synchronize(self.device)
        start = time.perf_counter()
        dtype = self.autocast_dtype
        with torch.autocast(self.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = self.workload.loss_fn(self.workload.forward(self.model))
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        synchronize(self.device)
        elapsed = time.perf_counter() - start
        self.losses.append(loss.item())
        return elapsed


def warmed_runner(name: str, workload: Workload, device: torch.device, precision: str, warmup: int) -> Runner:
    """Runtime ``name``'s runner on ``workload``, built from seed 0, its first step (timed into ``first_step_s``)
    and ``warmup`` more taken."""
    torch.manual_seed(0)
    runner = Runner(name, workload, device, precision=precision)
    runner.first_step_s = runner.step()
    for _ in range(warmup):
        runner.step()
    return runner


def max_loss_gap(runners: Sequence[Runner]) -> float:
    """The largest distance of an ORTModule runner's loss from the first runner's (eager's), step by step."""
    return max(
        (abs(a - b) for r in runners if r.name.startswith("ort") for a, b in zip(runners[0].losses, r.losses)),
        default=0.0,
    )


def time_in_blocks(runners: Sequence[Runner], steps: int, block: int = 5) -> None:
    """Time ``steps`` steps of each runner into its ``times_ms``, ``block`` steps of one runner after another, so
    that a machine that slows down or speeds up during the run moves every runtime's figures alike."""
    for first in range(0, steps, block):
        for runner in runners:
            runner.times_ms.extend(runner.step() * 1e3 for _ in range(min(block, steps - first)))


CudaMark = tuple[int, int]
"""PyTorch's allocated memory and the device memory held outside PyTorch, when a measurement starts."""


def cuda_memory_mark(device: torch.device) -> CudaMark:
    """Start measuring the peak device memory of what runs next on ``device`` (resets PyTorch's peak)."""
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device), _cuda_memory_outside_torch(device)


def empty_cuda_mark(device: torch.device) -> CudaMark | None:
    """On CUDA, empty PyTorch's cache and start measuring the peak of what runs next (:func:`cuda_memory_mark`);
    ``None`` elsewhere, where one process cannot tell its runtimes' memory apart."""
    synchronize(device)
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return cuda_memory_mark(device)


def peak_mib(device: torch.device, mark: CudaMark | None) -> float | None:
    """MiB of peak device memory since ``mark`` (:func:`cuda_peak_growth`); ``None`` without a mark."""
    return cuda_peak_growth(device, mark) / 2**20 if mark is not None else None


def cuda_peak_growth(device: torch.device, mark: CudaMark) -> int:
    """Bytes of peak device memory since ``mark``: PyTorch's peak allocated memory above what was allocated then,
    plus the growth of the memory held outside PyTorch's allocator (ONNX Runtime's CUDA arenas keep their peak
    size, so their growth is their peak)."""
    allocated, outside = mark
    grown_outside = max(_cuda_memory_outside_torch(device) - outside, 0)
    return torch.cuda.max_memory_allocated(device) - allocated + grown_outside


def _cuda_memory_outside_torch(device: torch.device) -> int:
    """Device memory in use that PyTorch's caching allocator does not hold: ONNX Runtime's CUDA arenas,
    cuBLAS/cuDNN workspaces and loaded kernels."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)
