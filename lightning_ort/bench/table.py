"""The GPU table in one command: ``python -m lightning_ort.bench table --device cuda``.

One process runs the rows a GPU comparison needs, each with eager PyTorch, inductor and ORTModule (on CUDA
also ORTModule replaying CUDA graphs, ``ort/cuda_graph=on``): the reference workloads (``transformer``,
``mlp``, ``cnn``) in fp32, then Hugging Face GPT-2 (12 layers, width 768, 8 x 512 tokens) in fp32 and under bf16
autocast. For each runtime it reports the median step against eager's, the first step, and on CUDA the peak
device memory against eager's: PyTorch's peak allocated memory while the runtime is built and warmed up, plus
the growth of the device memory held outside PyTorch's allocator, measured in this process, one runtime after
another (the ``run`` study's fresh process per runtime would export and compile every model twice more). Its
timed steps then alternate between the runtimes in blocks, as ``run``'s do. Last, ``Trainer(strategy="ort")``
against a plain ORTModule loop on the first row's workload. The report ends with the time the whole table took;
each row also goes to stderr as soon as it is measured, so that a run cut short by a time limit keeps it.

``--tiny`` shrinks GPT-2 (2 layers, width 64, 2 x 32 tokens) so that the command can be tried on a CPU before
GPU time is spent on it; ``--row WORKLOAD/PRECISION`` and ``--runtime`` choose what runs.
"""

from __future__ import annotations

import functools
import gc
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from typing_extensions import override

from lightning_ort.bench.report import LightningResult, Report, peak_cells
from lightning_ort.bench.runtimes import (
    PRECISIONS,
    Runner,
    empty_cuda_mark,
    max_loss_gap,
    peak_mib,
    time_in_blocks,
    warmed_runner,
)
from lightning_ort.bench.workloads import WORKLOADS, Workload, gpt2_workload
from lightning_ort.errors import first_line

TABLE_ROWS = ("transformer/fp32", "mlp/fp32", "cnn/fp32", "gpt2/fp32", "gpt2/bf16")
"""The rows the table runs by default, as ``WORKLOAD/PRECISION``."""
TABLE_RUNTIMES = ("eager", "inductor", "ort", "ort/cuda_graph=on")
"""The runtimes of each row on CUDA by default (on CPU, without ``ort/cuda_graph=on``, a CUDA setting)."""

TINY_GPT2: Callable[[torch.device], Workload] = functools.partial(gpt2_workload, layers=2, width=64, batch=2, length=32)
"""``--tiny``'s GPT-2: the default configuration's structure at a size a CPU trains in a second."""


def table_row(spec: str) -> tuple[str, str]:
    """``"gpt2/bf16"`` as ``("gpt2", "bf16")``; ``ValueError`` naming the choices for anything else.

    Example:
        >>> table_row("gpt2/bf16")
        ('gpt2', 'bf16')
    """
    workload, _, precision = spec.partition("/")
    if workload not in WORKLOADS or precision not in PRECISIONS:
        raise ValueError(
            f"{spec!r} is not a row: WORKLOAD/PRECISION with WORKLOAD one of {', '.join(sorted(WORKLOADS))} and "
            f"PRECISION one of {', '.join(PRECISIONS)}"
        )
    return workload, precision


@dataclass
class TableRun:
    """One runtime on one row: median and first step, peak device memory (``None`` on CPU, where freed memory
    is not returned to the system and one process cannot tell its runtimes apart), what of an ORTModule's
    step ran in PyTorch (``""``: nothing), and why the runtime could not train the row (``""``: it did; the
    figures are then NaN)."""

    runtime: str
    step_ms: float
    first_step_s: float
    peak_mib: float | None
    pytorch_fallback: str = ""
    step_ms_all: list[float] = field(default_factory=list, repr=False)
    error: str = ""


@dataclass
class TableRow:
    """Every runtime on one workload under one precision; ``max_abs_loss_diff`` is the largest distance of an
    ORTModule's loss from eager's over the same steps."""

    workload: str
    precision: str
    runs: list[TableRun]
    max_abs_loss_diff: float


def table_workload(name: str, device: torch.device, tiny: bool = False) -> Workload:
    """Workload ``name`` on ``device``, GPT-2 at :data:`TINY_GPT2`'s size where ``tiny``."""
    workload = (TINY_GPT2 if tiny and name == "gpt2" else WORKLOADS[name])(device)
    workload.model.to(device)
    return workload


def run_table_row(
    workload: Workload, precision: str, runtimes: Sequence[str], device: torch.device, steps: int, warmup: int
) -> TableRow:
    """Build and warm up each of ``runtimes`` (eager first) on ``workload`` one after another, measuring its peak
    device memory, then time ``steps`` steps of each in alternating blocks.

    A runtime other than eager that raises while it is built or warmed up is reported with its error, and the
    row goes on without it, so that one failing setting does not cost the rest of a GPU run.
    """
    runners: list[Runner] = []
    peaks: list[float | None] = []
    errors: dict[str, str] = {}
    for name in runtimes:
        mark = empty_cuda_mark(device)
        try:
            runners.append(warmed_runner(name, workload, device, precision, warmup))
        except Exception as err:
            if name == "eager":
                raise
            errors[name] = f"{type(err).__name__}: {err}"
            gc.collect()
            continue
        peaks.append(peak_mib(device, mark))
    time_in_blocks(runners, steps)
    measured = {
        runner.name: TableRun(
            runner.name,
            statistics.median(runner.times_ms),
            runner.first_step_s,
            peak,
            runner.pytorch_fallback(),
            runner.times_ms,
        )
        for runner, peak in zip(runners, peaks)
    }
    nan = float("nan")
    runs = [measured.get(name) or TableRun(name, nan, nan, None, error=errors[name]) for name in runtimes]
    return TableRow(workload.name, precision, runs, max_loss_gap(runners))


def run_table(
    rows: Sequence[str],
    runtimes: Sequence[str],
    device: torch.device,
    steps: int,
    warmup: int,
    tiny: bool = False,
    on_row: Callable[[TableRow], None] | None = None,
) -> list[TableRow]:
    """Each of ``rows`` (``WORKLOAD/PRECISION``) with ``runtimes``, each handed to ``on_row`` as soon as it is
    measured; the models of one row are freed before the next is built, so that each row's peaks start from the
    same empty device."""
    results = []
    for spec in rows:
        name, precision = table_row(spec)
        workload = table_workload(name, device, tiny)
        results.append(run_table_row(workload, precision, runtimes, device, steps, warmup))
        if on_row is not None:
            on_row(results[-1])
        del workload
        gc.collect()
    return results


def print_row(row: TableRow) -> None:
    """Print one measured row to stderr at once (``table`` prints the whole table when it ends), so that a run
    stopped by a time limit keeps the rows it measured."""
    print("\n".join(format_table([row])), file=sys.stderr, flush=True)


def format_table(rows: Sequence[TableRow]) -> list[str]:
    """The table ``table`` prints: per row and runtime, the step and the peak, each against eager's."""
    width = max([22, *(len(run.runtime) + 2 for row in rows for run in row.runs)])
    lines = [
        f"{'workload':<13}{'precision':<11}{'runtime':<{width}}{'step ms':>9}{'vs eager':>10}{'first step s':>14}"
        f"{'peak MiB':>10}{'x eager':>9}"
    ]
    for row in rows:
        eager = row.runs[0]
        for run in row.runs:
            if run.error:
                lines.append(
                    f"{row.workload:<13}{row.precision:<11}{run.runtime:<{width}}  failed: {_first_line(run.error)}"
                )
                continue
            lines.append(
                f"{row.workload:<13}{row.precision:<11}{run.runtime:<{width}}{run.step_ms:>9.2f}"
                f"{eager.step_ms / run.step_ms:>9.2f}x{run.first_step_s:>14.2f}"
                + peak_cells(run.peak_mib, eager.peak_mib)
            )
            if run.pytorch_fallback:
                lines.append(f"{'':<24}  ^ not all ONNX Runtime: {run.pytorch_fallback}")
        lines.append(f"{'':<24}(max |loss eager - loss ORT| {row.max_abs_loss_diff:.1e})")
    return lines


def _first_line(message: str, width: int = 160) -> str:
    """The first line of ``message`` (:func:`~lightning_ort.errors.first_line`), cut to ``width`` characters."""
    line = first_line(message)
    return line if len(line) <= width else line[: width - 3] + "..."


@dataclass
class TableReport(Report):
    """The ``table`` study: every row with every runtime, the Lightning overhead, and how long it all took."""

    rows: list[TableRow] = field(default_factory=list)
    lightning: LightningResult | None = None
    seconds: float = 0.0
    tiny: bool = False

    @override
    def conditions(self) -> list[str]:
        sizes = ["GPT-2 at --tiny's size"] if self.tiny else []
        return [*sizes, *super().conditions(), "peaks measured in this process, one runtime after another"]

    @override
    def body(self) -> list[str]:
        lines = format_table(self.rows)
        if self.lightning is not None:
            lines += ["", self.lightning.line()]
        return [*lines, "", f"the table took {self.seconds:.0f} s"]
