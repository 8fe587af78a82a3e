"""First-step cost against depth: ``python -m lightning_ort.bench depth 2 12``.

Hugging Face ``GPT2LMHeadModel`` as a user builds it (the default configuration but for the layer count and
width: dropout 0.1, ``use_cache`` on, the loss from ``labels``), a batch of 4 x 128 tokens, at each layer
count. Each runtime's first training step (forward, backward, AdamW) is timed in a fresh process: ORTModule
with block graphs (``blocks="auto"``: the layers share one exported graph), ORTModule with one graph for the
whole model, and ``torch.compile`` (inductor) with an empty cache; the ORTModules' statistics say where
their first step went. A further process per depth alternates steady steps of eager PyTorch and both
ORTModules, so their step-time ratios come from one run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from lightning_ort.bench.report import Report
from lightning_ort.bench.workloads import hugging_face_step, import_transformers
from lightning_ort.engine.torch_internals import calculate_time_spent
from lightning_ort.module import ORTModule

FIRST_STEP_RUNTIMES = ("ort_blocks", "ort", "inductor")
"""Runtimes whose first step is timed, each in a fresh process."""

STEADY_RUNTIMES = ("eager", "ort_blocks", "ort")
"""Runtimes whose steady steps alternate in one process."""

PHASES = ("tracing_seconds", "capture_seconds", "translation_seconds", "session_seconds", "export_seconds")
"""What the ORT probes report of their first step: TorchDynamo's own tracing, and the
:class:`~lightning_ort.ModuleStatistics` times."""


@dataclass
class DepthResult:
    """One layer count: first steps (s) per runtime, median steady steps (ms), ORTModule's build counts.

    ``phases`` holds, per ORT runtime, the :data:`PHASES` of its first step (s).
    """

    layers: int
    first_step_s: dict[str, float]
    step_ms: dict[str, float]
    onnx_exports: dict[str, int]
    phases: dict[str, dict[str, float]]


def gpt2_model(layers: int, width: int) -> nn.Module:
    """``GPT2LMHeadModel`` with ``layers`` layers of ``width`` (heads of 64); the rest of ``GPT2Config``'s defaults.

    Raises:
        ImportError: ``transformers`` is not installed.
    """
    transformers = import_transformers("depth")
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=max(width // 64, 1))
    )


def _batch(device: torch.device, vocab: int = 50257) -> torch.Tensor:
    return torch.randint(0, vocab, (4, 128), generator=torch.Generator().manual_seed(0)).to(device)


class _Trainee:
    """One runtime's model, optimizer and training step on the fixed batch."""

    def __init__(self, runtime: str, model: nn.Module, device: torch.device) -> None:
        self.runtime = runtime
        self.model = model
        if runtime == "ort_blocks":
            self.model = ORTModule(model, blocks="auto")
        elif runtime == "ort":
            self.model = ORTModule(model)
        elif runtime == "inductor":
            self.model = torch.compile(model)  # type: ignore[assignment]
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.ids = _batch(device)
        self.device = device

    def step(self) -> float:
        return hugging_face_step(self.model, self.optimizer, {"input_ids": self.ids, "labels": self.ids}, self.device)

    def first_step(self) -> dict[str, Any]:
        """The first step's time (s) and, for an ORTModule, its exports and :data:`PHASES`."""
        measured: dict[str, Any] = {"first_step_s": self.step(), "onnx_exports": 0, "phases": {}}
        if isinstance(self.model, ORTModule):
            stats = self.model.statistics
            measured["onnx_exports"] = stats.onnx_exports
            measured["phases"] = {phase: getattr(stats, phase) for phase in PHASES if phase != "tracing_seconds"}
            measured["phases"]["tracing_seconds"] = _dynamo_tracing_seconds()
        return measured


def probe(kind: str, layers: int, width: int, steps: int, device: torch.device) -> dict[str, Any]:
    """What one probe process measures; ``kind`` is a runtime of :data:`FIRST_STEP_RUNTIMES` or ``"steady"``."""
    torch.manual_seed(0)
    model = gpt2_model(layers, width).to(device)
    if kind != "steady":
        return _Trainee(kind, model, device).first_step()
    trainees = []
    for runtime in STEADY_RUNTIMES:
        trainee = _Trainee(runtime, gpt2_model(layers, width).to(device), device)
        trainee.model.load_state_dict(model.state_dict())
        trainee.step()
        trainees.append(trainee)
    times: dict[str, list[float]] = {t.runtime: [] for t in trainees}
    for _ in range(steps):
        for trainee in trainees:
            times[trainee.runtime].append(trainee.step() * 1e3)
    return {"step_ms": {runtime: statistics.median(values) for runtime, values in times.items()}}


def run_depth_study(layer_counts: Sequence[int], width: int, steps: int, device: torch.device) -> list[DepthResult]:
    """Run the probes of every layer count (see the module docstring), one fresh process each."""
    results = []
    for layers in layer_counts:
        first: dict[str, float] = {}
        exports: dict[str, int] = {}
        phases: dict[str, dict[str, float]] = {}
        for runtime in FIRST_STEP_RUNTIMES:
            measured = _run_probe(runtime, layers, width, steps, device)
            first[runtime] = measured["first_step_s"]
            exports[runtime] = measured["onnx_exports"]
            if measured["phases"]:
                phases[runtime] = measured["phases"]
        steady = _run_probe("steady", layers, width, steps, device)
        results.append(DepthResult(layers, first, steady["step_ms"], exports, phases))
    return results


def _run_probe(kind: str, layers: int, width: int, steps: int, device: torch.device) -> dict[str, Any]:
    command = [sys.executable, "-m", "lightning_ort.bench.probe", "depth", kind, "--device", str(device)]
    command += ["--layers", str(layers), "--width", str(width), "--steps", str(steps)]
    with tempfile.TemporaryDirectory(prefix="lightning_ort_bench_inductor_") as cache:
        environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        result = subprocess.run(command, capture_output=True, text=True, check=False, env=environment)
    if result.returncode != 0:
        raise RuntimeError(f"the {kind} probe at {layers} layers failed:\n{result.stderr[-3000:]}")
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def format_depth_report(results: Sequence[DepthResult], width: int) -> str:
    """The table ``depth`` prints: first steps and steady steps per layer count."""
    lines = [
        f"GPT2LMHeadModel (default configuration, width {width}, batch 4 x 128, loss from labels): first training "
        "step in fresh processes (s), steady step (median ms, alternating in one process)",
        f"{'layers':>6}{'ORT blocks':>12}{'ORT whole':>11}{'inductor':>10}{'exports':>10}"
        f"{'eager ms':>10}{'blocks ms':>11}{'whole ms':>10}{'blocks/whole':>14}",
    ]
    for r in results:
        exports = f"{r.onnx_exports['ort_blocks']}/{r.onnx_exports['ort']}"
        lines.append(
            f"{r.layers:>6}{r.first_step_s['ort_blocks']:>12.1f}{r.first_step_s['ort']:>11.1f}"
            f"{r.first_step_s['inductor']:>10.1f}{exports:>10}{r.step_ms['eager']:>10.0f}"
            f"{r.step_ms['ort_blocks']:>11.0f}{r.step_ms['ort']:>10.0f}"
            f"{r.step_ms['ort_blocks'] / r.step_ms['ort']:>13.2f}x"
        )
    if len(results) > 1:
        shallow, deep = results[0], results[-1]
        blocks = deep.first_step_s["ort_blocks"] / shallow.first_step_s["ort_blocks"]
        whole = deep.first_step_s["ort"] / shallow.first_step_s["ort"]
        lines.append(
            f"first step at {deep.layers} layers against {shallow.layers}: ORT blocks {blocks:.2f}x, ORT whole-model "
            f"graph {whole:.2f}x (exports: with block graphs / whole model)"
        )
    return "\n".join(lines)


def _dynamo_tracing_seconds() -> float:
    """This process's time in TorchDynamo's frame compiles, less the backend's (ours) within them."""
    spent = calculate_time_spent()
    return spent.get("entire_frame_compile", 0.0) - spent.get("backend_compile", 0.0)


def format_phase_report(results: Sequence[DepthResult]) -> str:
    """Where each ORT first step went: TorchDynamo, AOTAutograd, FX-to-ONNX translation, sessions, the rest.

    The rest is mostly the first runs themselves (ONNX Runtime allocating its buffers, AdamW creating its
    state), plus the export's other work (partitioning, disk cache lookups).
    """
    lines = [
        "where the ORT first step went (s): TorchDynamo tracing, AOTAutograd capture, translation to ONNX, "
        "ONNX Runtime session creation, and the rest (the first runs)",
        f"{'layers':>6}  {'graphs':<12}{'first step':>11}{'dynamo':>8}{'capture':>9}{'translate':>11}"
        f"{'sessions':>10}{'rest':>7}",
    ]
    for r in results:
        for runtime, label in (("ort", "one graph"), ("ort_blocks", "block graphs")):
            phases = r.phases.get(runtime)
            if phases is None:
                continue
            first = r.first_step_s[runtime]
            rest = first - phases["tracing_seconds"] - phases["capture_seconds"] - phases["export_seconds"]
            lines.append(
                f"{r.layers:>6}  {label:<12}{first:>11.1f}{phases['tracing_seconds']:>8.1f}"
                f"{phases['capture_seconds']:>9.1f}"
                f"{phases['translation_seconds']:>11.1f}{phases['session_seconds']:>10.1f}{rest:>7.1f}"
            )
    return "\n".join(lines)


@dataclass
class DepthReport(Report):
    """The ``depth`` study: the first step at each layer count, for GPT-2 style models of ``width``."""

    depth: list[DepthResult] = field(default_factory=list)
    width: int = 0

    @override
    def body(self) -> list[str]:
        return [format_depth_report(self.depth, self.width), format_phase_report(self.depth)]
