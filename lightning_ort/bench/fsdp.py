"""Sharded training against replicated: ``python -m lightning_ort.bench fsdp 2``.

Hugging Face ``GPT2LMHeadModel`` (its default configuration but for depth and width; a batch of 4 x 128 tokens
per rank) trains on N processes (gloo on CPU, NCCL on CUDA) in three runtimes, whose steps alternate in the same
processes:
PyTorch DDP, plain FSDP2 (``fully_shard`` per block, then the model) and the ``ort_fsdp`` arrangement (the model
in an :class:`~lightning_ort.ORTModule` with block graphs, sharded by
:func:`~lightning_ort.lightning.strategies.shard_network`). Each rank's parameter and AdamW state bytes show what
sharding saves; the median steps give ``ort_fsdp``'s ratio to plain FSDP.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from lightning_ort.bench.report import Report

FSDP_RUNTIMES = ("ddp", "fsdp", "ort_fsdp")
"""Runtimes whose steps alternate in the ranks' processes."""


@dataclass
class FsdpResult:
    """Per-rank figures of rank 0 (MiB and median ms per runtime), and ONNX Runtime's runs there."""

    ranks: int
    layers: int
    width: int
    parameter_mib: dict[str, float]
    optimizer_mib: dict[str, float]
    step_ms: dict[str, float]
    ort_runs: int


def run_fsdp_study(ranks: int, layers: int, width: int, steps: int, device: torch.device) -> FsdpResult:
    """Train on ``ranks`` spawned processes (see the module docstring); returns rank 0's figures.

    Raises:
        RuntimeError: a rank failed.
    """
    with tempfile.TemporaryDirectory(prefix="lightning_ort_bench_fsdp_") as folder:
        out = Path(folder) / "rank0.json"
        torch.multiprocessing.start_processes(
            _rank,
            args=(ranks, _free_port(), layers, width, steps, device.type, str(out)),
            nprocs=ranks,
            start_method="spawn",
        )
        return FsdpResult(**json.loads(out.read_text()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, ranks: int, port: int, layers: int, width: int, steps: int, device_type: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_ort.bench.depth import gpt2_model
    from lightning_ort.bench.workloads import hugging_face_step
    from lightning_ort.lightning.strategies import shard_network
    from lightning_ort.module import ORTModule

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=ranks)
    mesh = init_device_mesh(device.type, (ranks,))
    try:
        torch.manual_seed(0)
        reference = gpt2_model(layers, width).state_dict()
        models: dict[str, nn.Module] = {}
        for runtime in FSDP_RUNTIMES:
            model = gpt2_model(layers, width)
            model.load_state_dict(reference)
            model.to(device)
            if runtime == "ddp":
                models[runtime] = nn.parallel.DistributedDataParallel(model)
            elif runtime == "fsdp":
                for block in model.get_submodule("transformer.h").children():
                    fully_shard(block, mesh=mesh)
                fully_shard(model, mesh=mesh)
                models[runtime] = model
            else:
                wrapped = ORTModule(model, blocks="auto")
                shard_network(wrapped, mesh)
                models[runtime] = wrapped
        optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4) for name, model in models.items()}
        ids = torch.randint(0, 50257, (4, 128), generator=torch.Generator().manual_seed(rank)).to(device)
        times: dict[str, list[float]] = {name: [] for name in models}
        for step in range(steps + 1):
            for name, model in models.items():
                elapsed = hugging_face_step(model, optimizers[name], {"input_ids": ids, "labels": ids}, device)
                if step > 0:
                    times[name].append(elapsed * 1e3)
        ort = models["ort_fsdp"]
        assert isinstance(ort, ORTModule)
        if rank == 0:
            result = FsdpResult(
                ranks=ranks,
                layers=layers,
                width=width,
                parameter_mib={name: _mib(model.parameters()) for name, model in models.items()},
                optimizer_mib={name: _mib(_optimizer_tensors(optimizer)) for name, optimizer in optimizers.items()},
                step_ms={name: statistics.median(values) for name, values in times.items()},
                ort_runs=ort.statistics.forward_runs + ort.statistics.backward_runs,
            )
            Path(out).write_text(json.dumps(result.__dict__))
    finally:
        dist.destroy_process_group()


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    for state in optimizer.state.values():
        yield from (value for value in state.values() if isinstance(value, torch.Tensor) and value.dim() > 0)


def _mib(tensors: Iterable[Any]) -> float:
    """Bytes this rank holds of ``tensors`` (a sharded tensor's local shard), in MiB."""
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total / 2**20


def format_fsdp_report(result: FsdpResult) -> str:
    """The table ``fsdp`` prints: rank 0's memory and median step per runtime."""
    lines = [
        f"GPT-2 style model (GPT2LMHeadModel, {result.layers} layers of width {result.width}, batch 4 x 128 per "
        f"rank) on {result.ranks} ranks: rank 0's parameters and AdamW state (MiB), median step (ms, alternating)",
        f"{'runtime':>10}{'params MiB':>12}{'AdamW MiB':>11}{'step ms':>9}{'vs fsdp':>9}",
    ]
    for name in FSDP_RUNTIMES:
        lines.append(
            f"{name:>10}{result.parameter_mib[name]:>12.1f}{result.optimizer_mib[name]:>11.1f}"
            f"{result.step_ms[name]:>9.0f}{result.step_ms['fsdp'] / result.step_ms[name]:>8.2f}x"
        )
    share = result.parameter_mib["ort_fsdp"] / result.parameter_mib["ddp"]
    lines.append(
        f"ort_fsdp holds {share:.2f} of DDP's parameter bytes per rank (1/{result.ranks} = {1 / result.ranks:.2f}); "
        f"{result.ort_runs} ONNX Runtime runs on rank 0"
    )
    return "\n".join(lines)


@dataclass
class FsdpReport(Report):
    """The ``fsdp`` study: DDP, plain FSDP and ``ort_fsdp`` on the same ranks."""

    fsdp: FsdpResult | None = None

    @override
    def body(self) -> list[str]:
        return [format_fsdp_report(self.fsdp)] if self.fsdp is not None else []
