"""Benchmark: training steps of eager PyTorch, ``torch.compile`` (inductor) and ORTModule, in one process.

``python -m lightning_ort.bench`` runs each reference workload (``transformer``, ``mlp``, ``cnn``) or your own
(``--module pkg.mod:factory``) with the three runtimes in alternation, blocks of steps at a time, and prints
the median steady-state step (forward, backward, AdamW), its ratio to eager (``> 1`` is faster than eager),
the first step's cost (ORT: capture, export and session creation; inductor: compilation, with an empty
inductor cache unless ``--warm-inductor-cache``: ORT's first step is a cold export too), the peak memory
(measured in a fresh process per runtime) and the step's distance to the matrix-product floor of this
machine, measured in the same run. It then times ``Trainer(strategy="ort")`` against a plain loop over an
ORTModule of the first workload. ``--precision bf16`` or ``fp16`` runs every runtime's forward and loss under
``torch.autocast`` (fp16 with a ``GradScaler``), and the Lightning timing with ``bf16-mixed`` or ``16-mixed``.
``--profile DIR`` also trains each workload's ORTModule with ONNX Runtime's profiler on, keeps the profiles
(Chrome-trace JSON) in ``DIR`` and prints where a step's time goes: kernel time and nodes run per op type,
ONNX Runtime's time outside kernels, and the rest of the step (PyTorch: loss, autograd, AdamW).

That is the ``run`` sub-command, the default. The workloads and the ``--module`` factory contract are in
:mod:`lightning_ort.bench.workloads`; the ``depth``, ``shapes``, ``fsdp``, ``memory`` and ``table`` studies
(``python -m lightning_ort.bench depth 2 12``) in :mod:`lightning_ort.bench.depth`,
:mod:`lightning_ort.bench.shapes`, :mod:`lightning_ort.bench.fsdp`, :mod:`lightning_ort.bench.memory` and
:mod:`lightning_ort.bench.table` (the GPU table in one command), and the ``conv`` study of the convolution
backward's forms in :mod:`lightning_ort.bench.conv`; the measurements they take in fresh processes
in :mod:`lightning_ort.bench.probe`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from torch.utils.flop_counter import FlopCounterMode
from typing_extensions import override

from lightning_ort.bench.breakdown import TOP, BreakdownReport, break_down
from lightning_ort.bench.conv import LAYERS, ConvReport, run_conv_study
from lightning_ort.bench.depth import DepthReport, run_depth_study
from lightning_ort.bench.fsdp import FsdpReport, run_fsdp_study
from lightning_ort.bench.heap import HEAP_SETTINGS, apply_heap_setting
from lightning_ort.bench.memory import MemoryReport, run_memory_study
from lightning_ort.bench.report import LightningResult, Report, numerics
from lightning_ort.bench.runtimes import (
    ORT_VARIANTS,
    PRECISIONS,
    RUNTIMES,
    Runner,
    cuda_memory_mark,
    cuda_peak_growth,
    max_loss_gap,
    runtime_name,
    time_in_blocks,
    warmed_runner,
)
from lightning_ort.bench.shapes import ShapesReport, run_shapes_study
from lightning_ort.bench.table import (
    TABLE_ROWS,
    TABLE_RUNTIMES,
    TableReport,
    print_row,
    run_table,
    table_row,
    table_workload,
)
from lightning_ort.bench.workloads import DEFAULT_WORKLOADS, WORKLOADS, Workload, load_factory, synchronize
from lightning_ort.engine.runtime.profiling import KernelProfile
from lightning_ort.module import ORTModule
from lightning_ort.options import (
    ATTENTION_PATHS,
    CUDA_MEMORY,
    DebugOptions,
)

LIGHTNING_PRECISIONS = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


@dataclass
class RuntimeResult:
    """One runtime on one workload. Times in milliseconds, memory in MiB."""

    step_ms: float
    speedup_vs_eager: float
    first_step_s: float
    floor_ratio: float
    peak_memory_mib: float
    step_ms_all: list[float] = field(repr=False)
    pytorch_fallback: str = ""


@dataclass
class WorkloadResult:
    """All runtimes on one workload, with the matrix-product floor of the step."""

    workload: str
    matmul_gflop: float
    floor_ms: float
    runtimes: dict[str, RuntimeResult]
    max_abs_loss_diff_ort: float


@dataclass
class ProfileResult:
    """ORTModule's steps on one workload with ONNX Runtime's profiler on; ``profile`` holds totals over ``steps``
    and ``step_ms`` is their mean (a mean, as the profile's run time per step is)."""

    workload: str
    steps: int
    step_ms: float
    profile: KernelProfile

    @property
    def outside_ort_ms(self) -> float:
        """Per step, the time outside ONNX Runtime's runs: the loss, autograd, AdamW and binding the tensors."""
        return max(self.step_ms - self.profile.run_ms / self.steps, 0.0)


@dataclass
class BenchReport(Report):
    """The ``run`` study: every runtime on every workload; ``inductor_cache`` says whether inductor's first step
    started from an empty cache (``"cold"``, the default) or from the one it found (``"warm"``)."""

    workloads: list[WorkloadResult] = field(default_factory=list)
    lightning: LightningResult | None = None
    inductor_cache: str = "cold"
    precision: str = "fp32"
    memory_format: str = "contiguous"
    profiles: list[ProfileResult] = field(default_factory=list)

    @override
    def conditions(self) -> list[str]:
        return [
            *numerics(self.precision, self.memory_format),
            *super().conditions(),
            f"inductor's first step with a {self.inductor_cache} cache",
        ]

    @override
    def body(self) -> list[str]:
        return _run_tables(self)


def peak_memory_mib(
    workload_spec: str,
    runtimes: Sequence[str],
    device: torch.device,
    precision: str = "fp32",
    memory_format: str = "contiguous",
) -> dict[str, float]:
    """Peak memory of each runtime's setup and two training steps, each measured in a fresh process.

    On CPU: the process's peak resident memory minus its resident memory once the workload is built (so
    it counts the model copy, optimizer state, compiled graphs, ONNX Runtime's arenas and the steps'
    activations). On CUDA: PyTorch's peak allocated memory plus the growth of the device memory held outside
    PyTorch's allocator (ONNX Runtime's CUDA arena keeps its peak size, so its growth is its peak).
    A separate process per runtime, because freed memory is not reliably returned to the system. On CPU the
    processes run at the same time (each reads only its own resident memory); on CUDA one after another,
    since they would share the device's memory.
    """
    command = [sys.executable, "-m", "lightning_ort.bench.probe", "memory", workload_spec]
    command += ["--device", str(device), "--precision", precision, "--memory-format", memory_format]

    def probe(runtime: str) -> float:
        result = subprocess.run([*command, "--runtime", runtime], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"memory probe for {runtime} on {workload_spec} failed:\n{result.stderr[-2000:]}")
        return float(json.loads(result.stdout.strip().splitlines()[-1])["peak_mib"])

    with ThreadPoolExecutor(max_workers=1 if device.type == "cuda" else len(runtimes)) as pool:
        return dict(zip(runtimes, pool.map(probe, runtimes)))


def memory_probe(workload: Workload, runtime: str, device: torch.device, precision: str) -> float:
    """Peak memory, in MiB, of ``runtime``'s setup and two training steps of ``workload`` in this process."""
    if device.type == "cuda":
        mark = cuda_memory_mark(device)
    else:
        with open("/proc/self/statm") as statm:
            baseline = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    runner = Runner(runtime, workload, device, precision=precision)
    runner.step()
    runner.step()
    if device.type == "cuda":
        return cuda_peak_growth(device, mark) / 2**20
    # VmHWM, not getrusage's ru_maxrss: the latter keeps the parent's high-water mark across fork and exec.
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    return (peak - baseline) / 2**20


def matmul_gflops(device: torch.device, size: int = 2048, repeats: int = 10) -> float:
    """This machine's fp32 matrix-product rate (GFLOP/s): the fastest of ``repeats`` timed ``torch.mm`` calls.

    The fastest, not the mean: one product disturbed by another process would otherwise lower the floor.
    """
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    torch.mm(a, b)
    fastest = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        fastest = min(fastest, time.perf_counter() - start)
    return 2 * size**3 / fastest / 1e9


def step_matmul_flops(workload: Workload) -> int:
    """FLOPs of the matrix products (matmuls, convolutions, attention) in one forward and backward.

    Convolutions' backward ops are counted by :func:`convolution_backward_flops`: ``FlopCounterMode``'s own
    formula ignores ``groups`` for the weight gradient, which counts a depthwise layer's as a dense one's.
    """
    model = copy.deepcopy(workload.model)
    mapping = {torch.ops.aten.convolution_backward: convolution_backward_flops}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        workload.loss_fn(workload.forward(model)).backward()
    return int(counter.get_total_flops())


def convolution_backward_flops(
    grad_out_shape: Sequence[int],
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    bias: object,
    stride: object,
    padding: object,
    dilation: object,
    transposed: bool,
    output_padding: object,
    groups: int,
    output_mask: Sequence[bool],
    **kwargs: object,
) -> int:
    """FLOPs of ``aten.convolution_backward`` (a ``FlopCounterMode`` formula, on shapes): each gradient asked
    for, the input's and the weight's, is as many multiply-adds as the forward, whose weight ``[O, I / groups,
    taps...]`` meets every position of the larger image (the output of a convolution, the input of a transposed
    one) once per image.

    Example:
        >>> convolution_backward_flops([16, 96, 32, 32], [16, 96, 32, 32], [96, 1, 3, 3], None, [1, 1], [1, 1],
        ...                            [1, 1], False, [0, 0], 96, [True, True, False])
        56623104
    """
    positions = math.prod((x_shape if transposed else grad_out_shape)[2:])
    forward = 2 * grad_out_shape[0] * positions * math.prod(w_shape)
    return forward * (int(output_mask[0]) + int(output_mask[1]))


def run_workload(
    workload: Workload,
    device: torch.device,
    steps: int,
    warmup: int,
    gflops: float,
    block: int = 5,
    precision: str = "fp32",
    runtimes: Sequence[str] = RUNTIMES,
) -> WorkloadResult:
    """Time ``runtimes`` (eager first) on ``workload``: warm-up, then ``steps`` timed steps in alternating blocks."""
    runners = [warmed_runner(name, workload, device, precision, warmup) for name in runtimes]
    time_in_blocks(runners, steps, block)
    flops = step_matmul_flops(workload)
    floor_ms = flops / (gflops * 1e9) * 1e3
    eager_ms = statistics.median(runners[0].times_ms)
    peaks = peak_memory_mib(workload.name, runtimes, device, precision, workload.memory_format)
    results = {
        r.name: RuntimeResult(
            step_ms=statistics.median(r.times_ms),
            speedup_vs_eager=eager_ms / statistics.median(r.times_ms),
            first_step_s=r.first_step_s,
            floor_ratio=statistics.median(r.times_ms) / floor_ms,
            peak_memory_mib=peaks[r.name],
            step_ms_all=r.times_ms,
            pytorch_fallback=r.pytorch_fallback(),
        )
        for r in runners
    }
    return WorkloadResult(workload.name, flops / 1e9, floor_ms, results, max_loss_gap(runners))


def profile_workload(
    workload: Workload, device: torch.device, steps: int, warmup: int, directory: Path, precision: str = "fp32"
) -> ProfileResult:
    """Train an ORTModule of ``workload`` with ONNX Runtime's profiler on; profiles go to ``directory``.

    The first step and ``warmup`` more are left out of the sums (each graph runs once per step).
    """
    torch.manual_seed(0)
    debug = DebugOptions(profile=True, save_path=directory, onnx_prefix=re.sub(r"[^\w.-]", "_", workload.name))
    runner = Runner("ort", workload, device, debug, precision)
    for _ in range(1 + warmup):
        runner.step()
    times_ms = [runner.step() * 1e3 for _ in range(steps)]
    profile = cast(ORTModule, runner.model).end_profiling(skip_runs=1 + warmup)
    return ProfileResult(workload.name, steps, statistics.fmean(times_ms), profile)


def run_lightning(
    workload: Workload, device: torch.device, steps: int, warmup: int, precision: str = "fp32"
) -> LightningResult:
    """Median step of ``Trainer(strategy="ort")``, of a plain loop over an ORTModule of the same model, and of a
    ``Trainer`` with Lightning's default strategy over that ORTModule wrapped by hand (:class:`LightningResult`)."""
    import lightning.pytorch as pl

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.times_ms: list[float] = []
            self._start = 0.0

        def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, idx: int) -> None:
            synchronize(device)
            self._start = time.perf_counter()

        def on_train_batch_end(
            self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, idx: int
        ) -> None:
            synchronize(device)
            self.times_ms.append((time.perf_counter() - self._start) * 1e3)

    class BenchModule(pl.LightningModule):
        def __init__(self, wrapped: bool) -> None:
            super().__init__()
            net = copy.deepcopy(workload.model)
            self.net = ORTModule(net, blocks="auto") if wrapped else net

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return workload.loss_fn(workload.forward(self.net))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> list[int]:
            return list(range(steps + warmup + 1))

    # The strategy wraps with block graphs by default (ORTConfig(blocks="auto")), ORTModule with one graph: the
    # plain loop takes the strategy's, so that the two differ by Lightning alone.
    plain = Runner("ort/blocks=auto", workload, device, precision=precision)
    for _ in range(warmup + 1):
        plain.step()
    # The plain loop's steps are timed before and after the Trainer's, so that a machine that slows down or
    # speeds up during the run moves both figures alike.
    plain_ms = [plain.step() * 1e3 for _ in range(steps)]
    medians = []
    for strategy in ("ort", "auto"):
        timer = StepTimer()
        trainer = pl.Trainer(
            strategy=strategy,
            accelerator="gpu" if device.type == "cuda" else "cpu",
            devices=1,
            precision=LIGHTNING_PRECISIONS[precision],  # type: ignore[arg-type]
            max_steps=steps + warmup + 1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[timer],
        )
        trainer.fit(BenchModule(wrapped=strategy != "ort"))
        medians.append(statistics.median(timer.times_ms[warmup + 1 :]))
    plain_ms += [plain.step() * 1e3 for _ in range(steps)]
    trainer_ms, lightning_ms = medians
    plain_median = statistics.median(plain_ms)
    return LightningResult(workload.name, plain_median, trainer_ms, trainer_ms / plain_median - 1.0, lightning_ms)


def _run_tables(report: BenchReport) -> list[str]:
    """The ``run`` study's tables: per workload and runtime, then the Lightning timing and the profiles."""
    lines: list[str] = []
    width = max([12, *(len(result.workload) + 2 for result in report.workloads)])
    named = max([10, *(len(name) + 2 for result in report.workloads for name in result.runtimes)])
    lines.append(
        f"{'workload':<{width}}{'runtime':<{named}}{'step ms':>9}{'vs eager':>10}{'floor ms':>10}{'x floor':>9}"
        f"{'first step s':>14}{'peak MiB':>10}"
    )
    for result in report.workloads:
        for name, r in result.runtimes.items():
            lines.append(
                f"{result.workload:<{width}}{name:<{named}}{_ms(r.step_ms):>9}{r.speedup_vs_eager:>9.2f}x"
                f"{_ms(result.floor_ms):>10} {_ratio(r.floor_ratio):>8}"
                f"{r.first_step_s:>14.2f}{r.peak_memory_mib:>10.0f}"
            )
            if r.pytorch_fallback:
                lines.append(f"{'':<{width}}  ^ not all ONNX Runtime: {r.pytorch_fallback}")
        lines.append(
            f"{'':<{width}}({result.matmul_gflop:.1f} GFLOP of matrix products per step; "
            f"max |loss eager - loss ORT| {result.max_abs_loss_diff_ort:.1e})"
        )
    if report.lightning is not None:
        lines += ["", report.lightning.line()]
    for profiled in report.profiles:
        profile = profiled.profile
        lines += [
            "",
            f"ORT profile of {profiled.workload}, per step (mean step {profiled.step_ms:.1f} ms with profiling: "
            f"ONNX Runtime runs {profile.run_ms / profiled.steps:.1f} ms, outside them {profiled.outside_ort_ms:.1f} "
            "ms for the loss, autograd, AdamW and binding):",
            profile.format_table(per=profiled.steps),
        ]
    if report.profiles:
        folders = sorted({str(f.parent) for r in report.profiles for f in r.profile.files})
        lines.append(f"profiles (chrome://tracing, Perfetto): {', '.join(folders)}")
    return lines


def _ms(value: float) -> str:
    """Milliseconds with three decimals below 1 ms, two below 10 ms (small models, GPUs), else one; in
    scientific notation below a microsecond (the matrix-product floor of a tiny model).

    Example:
        >>> [_ms(v) for v in (123.45, 4.567, 0.0643, 0.00031)]
        ['123.5', '4.57', '0.064', '3.1e-04']
    """
    if value < 1e-3:
        return f"{value:.1e}"
    return f"{value:.3f}" if value < 1 else f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _ratio(value: float) -> str:
    """A ratio with two decimals, or none from 100 on (a tiny model's distance to its floor).

    Example:
        >>> _ratio(1.2345), _ratio(31061.4)
        ('1.23x', '31061x')
    """
    return f"{value:.2f}x" if value < 100 else f"{value:.0f}x"


@contextlib.contextmanager
def inductor_cache(cold: bool) -> Iterator[str]:
    """Point inductor at an empty, temporary cache folder (``cold``) or leave its cache as it is; yields the folder.

    A warm cache (left by earlier compiles of the same graphs, e.g. a previous run) turns inductor's first step
    from a compilation into a cache load, which is not what the first-step column compares ORT's export with.
    ``TORCHINDUCTOR_CACHE_DIR`` is restored afterwards; the memory probes' processes inherit it.

    Example:
        >>> with inductor_cache(cold=True) as folder:
        ...     os.environ["TORCHINDUCTOR_CACHE_DIR"] == folder and not os.listdir(folder)
        True
    """
    if not cold:
        yield os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
        return
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    folder = tempfile.mkdtemp(prefix="lightning_ort_bench_inductor_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    try:
        yield folder
    finally:
        if previous is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
        shutil.rmtree(folder, ignore_errors=True)


STUDIES = ("run", "depth", "shapes", "fsdp", "memory", "table", "conv", "breakdown")
"""The sub-commands; ``run`` (the workloads) is the default."""


def main(argv: Sequence[str] | None = None) -> Report:
    """Command-line entry point; returns the report it printed (the study's own report type).

    ``python -m lightning_ort.bench [run] ...`` times the workloads; ``depth LAYERS...``, ``shapes LENGTH...``,
    ``fsdp RANKS``, ``memory [ROUTE...]``, ``table``, ``conv`` and ``breakdown`` run the studies. Without a
    sub-command the arguments are ``run``'s.
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    if not arguments or (arguments[0] not in STUDIES and arguments[0] not in ("-h", "--help")):
        arguments = ["run", *arguments]
    parser = _parser()
    args = parser.parse_args(arguments)
    if args.steps < 1 or getattr(args, "warmup", 0) < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    args.heap_state = apply_heap_setting(args.heap)
    device = torch.device(args.device)
    if args.study == "shapes":
        runs = run_shapes_study(args.lengths, args.layers, args.width, args.steps)
        return _emit(ShapesReport(**_machine(args, device), shapes=runs, layers=args.layers, width=args.width), args)
    if args.study == "depth":
        depth = run_depth_study(args.layers, args.width, args.steps, device)
        return _emit(DepthReport(**_machine(args, device), depth=depth, width=args.width), args)
    if args.study == "fsdp":
        fsdp = run_fsdp_study(args.ranks, args.layers, args.width, args.steps, device)
        return _emit(FsdpReport(**_machine(args, device), fsdp=fsdp), args)
    if args.study == "conv":
        if device.type != "cpu":
            parser.error("conv: the study times ONNX Runtime's CPU kernels; run it with --device cpu")
        layers = [layer for layer in LAYERS if not args.workload or layer.workload in args.workload]
        return _emit(ConvReport(**_machine(args, device), conv=run_conv_study(layers, args.steps)), args)
    if args.study == "memory":
        (workload,) = build_workloads(
            [] if args.module else [args.workload], [args.module] if args.module else [], device
        )
        routes = args.routes or list(CUDA_MEMORY)
        if unknown := [route for route in routes if route not in CUDA_MEMORY]:
            parser.error(f"memory: {', '.join(unknown)} is not a route; the routes are {', '.join(CUDA_MEMORY)}")
        memory = run_memory_study(workload, routes, device, args.steps, args.precision, args.attention)
        machine = _machine(args, device)
        return _emit(MemoryReport(**machine, memory=memory, workload=workload.name, precision=args.precision), args)
    if args.study == "breakdown":
        (workload,) = build_workloads([args.workload], [], device, args.memory_format)
        runtimes = _with_eager(args.runtime or ["ort"])
        steps = break_down(workload, runtimes, device, args.steps, args.warmup, args.precision, args.top)
        machine = _machine(args, device)
        breakdown = BreakdownReport(
            **machine, runs=steps, workload=workload.name, precision=args.precision, memory_format=args.memory_format
        )
        return _emit(breakdown, args)
    if args.study == "table":
        default = TABLE_RUNTIMES if device.type == "cuda" else RUNTIMES
        runtimes = _with_eager(args.runtime or default)
        return _emit(run_table_study(args, runtimes, device), args)
    runtimes = _with_eager(args.runtime or RUNTIMES)
    workloads = build_workloads(args.workload, args.module, device, args.memory_format)
    machine = _machine(args, device)
    with inductor_cache(cold=not args.warm_inductor_cache):
        results = [
            run_workload(
                w,
                device,
                args.steps,
                args.warmup,
                machine["matmul_gflops"],
                precision=args.precision,
                runtimes=runtimes,
            )
            for w in workloads
        ]
    lightning = None
    if not args.no_lightning:
        lightning = run_lightning(workloads[0], device, args.steps, args.warmup, args.precision)
    profiles = []
    if args.profile is not None:
        profiles = [
            profile_workload(w, device, args.steps, args.warmup, args.profile, args.precision) for w in workloads
        ]
    report = BenchReport(
        **machine,
        workloads=results,
        lightning=lightning,
        inductor_cache="cold" if not args.warm_inductor_cache else "warm",
        precision=args.precision,
        memory_format=args.memory_format,
        profiles=profiles,
    )
    return _emit(report, args)


def _with_eager(runtimes: Sequence[str]) -> list[str]:
    """``runtimes`` once each, after eager, which every study compares with.

    Example:
        >>> _with_eager(["ort", "eager", "inductor", "ort"])
        ['eager', 'ort', 'inductor']
    """
    return ["eager", *dict.fromkeys(name for name in runtimes if name != "eager")]


def run_table_study(args: argparse.Namespace, runtimes: Sequence[str], device: torch.device) -> TableReport:
    """The ``table`` sub-command: its rows, then the Lightning timing on the first row's workload."""
    start = time.perf_counter()
    machine = _machine(args, device)
    rows = run_table(args.row or TABLE_ROWS, runtimes, device, args.steps, args.warmup, args.tiny, print_row)
    report = TableReport(**machine, rows=rows, tiny=args.tiny)
    if not args.no_lightning:
        name, precision = table_row((args.row or TABLE_ROWS)[0])
        report.lightning = run_lightning(
            table_workload(name, device, args.tiny), device, args.steps, args.warmup, precision
        )
    report.seconds = time.perf_counter() - start
    return report


def build_workloads(
    names: Sequence[str] | None, modules: Sequence[str], device: torch.device, memory_format: str = "contiguous"
) -> list[Workload]:
    """The workloads asked for by name and by ``--module`` spec (the reference set if neither), on ``device``;
    with ``memory_format="channels_last"`` their models and 4-D inputs in that format (:func:`channels_last`)."""
    factories = [WORKLOADS[name] for name in names or ([] if modules else DEFAULT_WORKLOADS)]
    factories += [load_factory(spec) for spec in modules]
    workloads = [factory(device) for factory in factories]
    for workload in workloads:
        workload.model.to(device)
    return [channels_last(w) for w in workloads] if memory_format == "channels_last" else workloads


def channels_last(workload: Workload) -> Workload:
    """``workload`` with its model and its 4-D inputs in channels-last memory format, as PyTorch's CPU
    performance guide advises for convolutional nets (``model.to(memory_format=torch.channels_last)``).

    Example:
        >>> w = channels_last(WORKLOADS["cnn"](torch.device("cpu")))
        >>> w.inputs[0].is_contiguous(memory_format=torch.channels_last), w.model[0].weight.stride()
        (True, (27, 1, 9, 3))
    """

    def converted(value: torch.Tensor) -> torch.Tensor:
        return value.contiguous(memory_format=torch.channels_last) if value.dim() == 4 else value

    cast(Any, workload.model).to(memory_format=torch.channels_last)  # torch's stubs omit memory_format
    return dataclasses.replace(
        workload,
        inputs=tuple(converted(value) for value in workload.inputs),
        kwargs={key: converted(value) for key, value in workload.kwargs.items()},
        memory_format="channels_last",
    )


def _add_memory_format(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--memory-format",
        choices=("contiguous", "channels_last"),
        default="contiguous",
        help="channels_last: the models and their 4-D inputs in channels-last memory format, for every runtime "
        "(default contiguous)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_ort.bench", description=__doc__)
    studies = parser.add_subparsers(
        dest="study", required=True, metavar="{run,depth,shapes,fsdp,memory,table,conv,breakdown}"
    )
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    shared.add_argument("--steps", type=int, default=20, help="timed steps per runtime (default 20)")
    shared.add_argument("--json", type=Path, help="also write the figures as JSON to this file")
    shared.add_argument(
        "--heap",
        choices=HEAP_SETTINGS,
        default="keep",
        help="keep: glibc's malloc keeps freed memory for reuse in this process, so that page faults on fresh "
        "memory do not move the figures with what ran before; default: glibc as it comes (default keep)",
    )
    sized = argparse.ArgumentParser(add_help=False)  # the studies' GPT-2 style models
    sized.add_argument("--width", type=int, default=768, help="the model's width (default 768)")
    layered = argparse.ArgumentParser(add_help=False)
    layered.add_argument("--layers", type=int, default=4, help="the model's layer count (default 4)")

    timed = argparse.ArgumentParser(add_help=False)  # the studies that time runtimes against eager
    variants = ", ".join(f"{key}={'|'.join(values)}" for key, values in ORT_VARIANTS.items())
    timed.add_argument(
        "--runtime",
        type=runtime_name,
        action="append",
        help=f"repeatable; default: {', '.join(RUNTIMES)}. eager always runs. ort/OPTION=VALUE...: ORTModule "
        f"with these options, to compare them in one run: {variants} (ort/attention=torch/cuda_memory=shared_arena)",
    )
    timed.add_argument("--warmup", type=int, default=3, help="untimed steps after the first (default 3)")
    timed.add_argument("--no-lightning", action="store_true", help="skip the Trainer(strategy='ort') timing")

    run = studies.add_parser(
        "run",
        parents=[shared, timed],
        help="time training steps of the workloads: eager, inductor, ORTModule (default)",
    )
    run.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        action="append",
        help=f"repeatable; default: {', '.join(DEFAULT_WORKLOADS)}",
    )
    run.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        default="fp32",
        help="fp32, or torch.autocast to bf16 or fp16 (fp16 with a GradScaler) (default fp32)",
    )
    run.add_argument("--module", action="append", default=[], help="your own workload: package.module:factory")
    _add_memory_format(run)
    run.add_argument(
        "--warm-inductor-cache",
        action="store_true",
        help="let inductor use its existing on-disk cache (default: an empty one, so its first step compiles)",
    )
    run.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="also profile ORTModule's steps with ONNX Runtime's profiler: keep the profiles in DIR and print the "
        "kernel time per op type",
    )

    depth = studies.add_parser(
        "depth",
        parents=[shared, sized],
        help="the first step of a GPT-2 style model (Hugging Face transformers) at these layer counts: ORTModule "
        "with block graphs, with one graph, and inductor, each in a fresh process",
    )
    depth.add_argument("layers", type=int, nargs="+", metavar="LAYERS")

    shapes = studies.add_parser(
        "shapes",
        parents=[shared, sized, layered],
        help="train Hugging Face GPT-2 and BERT on padded batches of these lengths, with automatic dynamic shapes "
        "and with dynamic_axes declared, each in a fresh process (CPU)",
    )
    shapes.add_argument("lengths", type=int, nargs="+", metavar="LENGTH")

    fsdp = studies.add_parser(
        "fsdp",
        parents=[shared, sized, layered],
        help="train a GPT-2 style model on RANKS processes with DDP, plain FSDP and ort_fsdp in alternation: "
        "per-rank parameter and optimizer memory, and step time",
    )
    fsdp.add_argument("ranks", type=int, metavar="RANKS")

    memory = studies.add_parser(
        "memory",
        parents=[shared],
        help="eager, then ORTModule under each CUDA memory route (SessionSettings(cuda_memory=...)), in one "
        "process: step time and peak device memory",
    )
    memory.add_argument("routes", nargs="*", metavar="ROUTE", help=f"{', '.join(CUDA_MEMORY)} (default: all three)")
    memory.add_argument("--workload", choices=sorted(WORKLOADS), default="gpt2", help="default: gpt2")
    memory.add_argument("--module", help="your own workload instead: package.module:factory")
    memory.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32", help="as for run (default fp32)")
    memory.add_argument(
        "--attention", choices=ATTENTION_PATHS, default="auto", help="ORTModule's attention path (default auto)"
    )

    table = studies.add_parser(
        "table",
        parents=[shared, timed],
        help="the GPU table: transformer, mlp and cnn in fp32 and GPT-2 8x512 in fp32 and bf16, eager, inductor "
        "and ORTModule, step time and peak memory, then Trainer(strategy='ort') against a plain loop",
    )
    table.add_argument(
        "--row",
        type=_row,
        action="append",
        metavar="WORKLOAD/PRECISION",
        help=f"repeatable; default: {' '.join(TABLE_ROWS)}",
    )
    table.add_argument("--tiny", action="store_true", help="GPT-2 with 2 layers of width 64 on 2x32 tokens (dry run)")

    breakdown = studies.add_parser(
        "breakdown",
        parents=[shared, timed],
        help="where a step's time goes, per runtime (default: eager and ort): wall time, device-kernel time, "
        "kernel launches, the host's waits for the device and its copies per step, the costliest host operations "
        "and, on CUDA, the kernels that took the most device time",
    )
    breakdown.add_argument("--workload", choices=sorted(WORKLOADS), default="transformer", help="default: transformer")
    breakdown.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32", help="as for run (default fp32)")
    _add_memory_format(breakdown)
    breakdown.add_argument(
        "--top", type=int, default=TOP, help=f"host operations and device kernels listed per runtime (default {TOP})"
    )

    conv = studies.add_parser(
        "conv",
        parents=[shared],
        help="every form of a 3x3 convolution's input and weight gradients in ONNX Runtime (CPU), against eager's "
        "backward, for the layers of the cnn and resnet18 workloads",
    )
    conv.add_argument(
        "--workload", choices=sorted({layer.workload for layer in LAYERS}), action="append", help="default: both"
    )
    return parser


def _row(spec: str) -> str:
    """``--row``'s type: a ``WORKLOAD/PRECISION`` spec, or argparse's error naming the choices."""
    try:
        table_row(spec)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    return spec


def _machine(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The fields every report starts with (see :class:`~lightning_ort.bench.report.Report`), measured now."""
    import onnxruntime

    return {
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "torch_version": torch.__version__,
        "onnxruntime_version": onnxruntime.__version__,
        "threads": torch.get_num_threads(),
        "heap": args.heap_state,
        "matmul_gflops": matmul_gflops(device),
        "steps": args.steps,
    }


ReportType = TypeVar("ReportType", bound=Report)


def _emit(report: ReportType, args: argparse.Namespace) -> ReportType:
    """Print ``report`` (and write its JSON with ``--json``); returns it."""
    print(report.format())
    if args.json:
        args.json.write_text(json.dumps(dataclasses.asdict(report), indent=2, default=str))
    return report
