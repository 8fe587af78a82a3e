"""What every study's report holds first: the machine, the versions and the steps its figures are medians of.

Each study has its own report type, a :class:`Report` with the study's results, and prints it as
:meth:`Report.format` writes it; ``--json`` writes the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass


def peak_cells(peak_mib: float | None, eager_mib: float | None) -> str:
    """A table's ``peak MiB`` and ``x eager`` cells (``-`` where a peak was not measured).

    Example:
        >>> peak_cells(1536.0, 1024.0), peak_cells(None, None)
        ('      1536    1.50x', '         -        -')
    """
    peak = f"{peak_mib:>10.0f}" if peak_mib is not None else f"{'-':>10}"
    ratio = f"{peak_mib / eager_mib:>8.2f}x" if peak_mib and eager_mib else f"{'-':>9}"
    return peak + ratio


@dataclass
class LightningResult:
    """``Trainer(strategy="ort")`` against a plain loop over the same ORTModule (median ms per step), and
    ``lightning_ms``: a ``Trainer`` with Lightning's own single-device strategy over that ORTModule wrapped by
    hand, which is Lightning's loop without lightning_ort's strategy and callback.

    Example:
        >>> print(LightningResult("mlp", 10.0, 11.0, 0.1, 10.8).line())  # doctest: +NORMALIZE_WHITESPACE
        Lightning on mlp: Trainer(strategy='ort') 11.00 ms/step, plain ORTModule loop 10.00 ms/step: +10.0%
        (+1.00 ms); Lightning's own strategy over the same ORTModule 10.80 ms/step (+8.0%)
    """

    workload: str
    plain_loop_ms: float
    trainer_ms: float
    overhead: float
    lightning_ms: float

    def line(self) -> str:
        """The timing as the reports print it."""
        return (
            f"Lightning on {self.workload}: Trainer(strategy='ort') {self.trainer_ms:.2f} ms/step, plain ORTModule "
            f"loop {self.plain_loop_ms:.2f} ms/step: {self.overhead:+.1%} "
            f"({self.trainer_ms - self.plain_loop_ms:+.2f} ms); Lightning's own strategy over the same ORTModule "
            f"{self.lightning_ms:.2f} ms/step ({self.lightning_ms / self.plain_loop_ms - 1.0:+.1%})"
        )


def numerics(precision: str, memory_format: str) -> list[str]:
    """How a study's models computed, for its header: the precision, and the memory format where it is not the
    default.

    Example:
        >>> numerics("fp32", "contiguous"), numerics("bf16", "channels_last")
        (['fp32'], ['bf16', 'channels_last'])
    """
    return [precision, *([memory_format] if memory_format != "contiguous" else [])]


@dataclass
class Report:
    """The machine a study ran on, how its process allocates host memory (:mod:`lightning_ort.bench.heap`),
    and the steps each of its figures is the median of.

    Example:
        >>> print(Report("cpu", "2.13.0", "1.31.1", 2, "heap keeps freed memory", 210.0, 20).format())
        lightning_ort benchmark on cpu (2 threads, heap keeps freed memory), torch 2.13.0, onnxruntime 1.31.1
        matrix-product rate: 210 GFLOP/s (torch.mm 2048x2048, this run); median of 20 steps
        <BLANKLINE>
    """

    device: str
    torch_version: str
    onnxruntime_version: str
    threads: int
    heap: str
    matmul_gflops: float
    steps: int

    def conditions(self) -> list[str]:
        """What the figures were measured under, for the header (a study adds its precision, its cache...)."""
        return [f"median of {self.steps} steps"]

    def body(self) -> list[str]:
        """The study's tables, line by line."""
        return []

    def format(self) -> str:
        """The report as the command prints it."""
        header = [
            f"lightning_ort benchmark on {self.device} ({self.threads} threads, {self.heap}), "
            f"torch {self.torch_version}, "
            f"onnxruntime {self.onnxruntime_version}",
            f"matrix-product rate: {self.matmul_gflops:.0f} GFLOP/s (torch.mm 2048x2048, this run); "
            + "; ".join(self.conditions()),
            "",
        ]
        return "\n".join([*header, *self.body()])
