"""Reading ONNX Runtime's profiles: where the time of the graphs' runs goes, by op type.

With ``DebugOptions(profile=True)`` every session is created with ``SessionOptions.enable_profiling``, and ONNX
Runtime writes a Chrome-trace JSON file per session when profiling ends (``ORTModule.end_profiling()``, or the
session's deletion). Each run is a ``model_run`` event; each node's kernel is a ``<node>_kernel_time`` event
inside it, with its op type and provider. :func:`read_profiles` sums those into a :class:`KernelProfile`; the
files themselves open in ``chrome://tracing`` or Perfetto for the timeline.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_KERNEL_SUFFIX = "_kernel_time"


@dataclass(frozen=True)
class OpTime:
    """Kernel time of one op type (``"MatMul"``, ``"Conv"``, ``"MemcpyToHost"``...) over the profiled runs.

    Attributes:
        op_type: the ONNX (or ONNX Runtime contrib) op type, as ONNX Runtime ran it after its graph fusions.
        provider: the execution provider that ran it.
        milliseconds: total kernel time.
        calls: kernel launches.

    Example:
        >>> OpTime("MatMul", "CPUExecutionProvider", 12.5, 8).milliseconds
        12.5
    """

    op_type: str
    provider: str
    milliseconds: float
    calls: int


@dataclass(frozen=True)
class KernelProfile:
    """ONNX Runtime kernel times summed over profiled runs.

    Attributes:
        files: the profile files read (Chrome-trace JSON).
        runs: graph runs counted (``model_run`` events after the skipped ones).
        run_ms: wall time of those runs inside ONNX Runtime.
        ops: kernel time per op type and provider, longest first.
        arena_peak_mib: the most memory ONNX Runtime's CPU arena held during those runs (``0.0`` when the
            profile does not say, as on CUDA). ORTModule's CPU sessions share one arena per process, so this is
            the process's ONNX Runtime memory, including other modules' graphs.

    Example:
        >>> profile = KernelProfile(runs=2, run_ms=10.0, ops=(OpTime("Gemm", "CPUExecutionProvider", 8.0, 2),))
        >>> profile.kernel_ms, profile.overhead_ms
        (8.0, 2.0)
    """

    files: tuple[Path, ...] = ()
    runs: int = 0
    run_ms: float = 0.0
    ops: tuple[OpTime, ...] = field(default_factory=tuple)
    arena_peak_mib: float = 0.0

    @property
    def kernel_ms(self) -> float:
        """Time spent in kernels (the sum over :attr:`ops`)."""
        return sum(op.milliseconds for op in self.ops)

    @property
    def overhead_ms(self) -> float:
        """Time inside the runs but outside kernels: ONNX Runtime's executor, allocation, thread hand-offs."""
        return max(self.run_ms - self.kernel_ms, 0.0)

    def format_table(self, per: int = 1, top: int = 12) -> str:
        """A text table of the ``top`` op types, times divided by ``per`` (e.g. the profiled training steps).

        Example:
            >>> profile = KernelProfile(runs=2, run_ms=10.0, ops=(OpTime("Gemm", "CPUExecutionProvider", 8.0, 2),))
            >>> print(profile.format_table(per=2))
            op type             provider      ms     share  calls
            Gemm                CPU         4.00     80.0%      1
            (outside kernels)               1.00     20.0%
            ONNX Runtime runs               5.00    100.0%      1
            nodes run                                           1
        """
        per = max(per, 1)
        total = self.run_ms or 1.0
        lines = [f"{'op type':<18}  {'provider':<8}  {'ms':>6}  {'share':>8}  {'calls':>5}"]
        for op in self.ops[:top]:
            provider = op.provider.removesuffix("ExecutionProvider")
            lines.append(
                f"{op.op_type:<18}  {provider:<8}  {op.milliseconds / per:>6.2f}  "
                f"{op.milliseconds / total:>8.1%}  {op.calls // per:>5}"
            )
        rest = self.ops[top:]
        if rest:
            rest_ms = sum(op.milliseconds for op in rest)
            rest_calls = sum(op.calls for op in rest)
            lines.append(
                f"{f'({len(rest)} other op types)':<28}  {rest_ms / per:>6.2f}  {rest_ms / total:>8.1%}"
                f"  {rest_calls // per:>5}"
            )
        lines.append(f"{'(outside kernels)':<28}  {self.overhead_ms / per:>6.2f}  {self.overhead_ms / total:>8.1%}")
        lines.append(f"{'ONNX Runtime runs':<28}  {self.run_ms / per:>6.2f}  {1:>8.1%}  {self.runs // per:>5}")
        lines.append(f"{'nodes run':<46}  {sum(op.calls for op in self.ops) // per:>5}")
        return "\n".join(lines)


def read_profiles(files: Iterable[str | Path], skip_runs: int = 0) -> KernelProfile:
    """Sum the kernel times in ONNX Runtime profile ``files``.

    Args:
        files: profile files, one per session (as returned by ``ORTModule.end_profiling().files``).
        skip_runs: runs to leave out at the start of each file: the first run of a session allocates its
            arena and is slower than the steady state.

    Raises:
        ValueError: a file is not an ONNX Runtime profile (named in the message).

    Example:
        >>> read_profiles([]).runs
        0
    """
    paths = tuple(Path(f) for f in files)
    totals: dict[tuple[str, str], list[float]] = {}
    runs = 0
    run_ms = 0.0
    arena_peak = 0
    for path in paths:
        kept = _kept_runs(_load_events(path), skip_runs)
        runs += len(kept.windows)
        run_ms += sum(end - start for start, end in kept.windows) / 1000
        for event in kept.kernels:
            args = event.get("args", {})
            key = (str(args.get("op_name", "?")), str(args.get("provider", "?")))
            entry = totals.setdefault(key, [0.0, 0])
            entry[0] += float(event["dur"]) / 1000
            entry[1] += 1
            arena_peak = max(arena_peak, int(args.get("mem_arena_held", 0)))
    ops = sorted(
        (OpTime(op_type, provider, ms, int(calls)) for (op_type, provider), (ms, calls) in totals.items()),
        key=lambda op: op.milliseconds,
        reverse=True,
    )
    return KernelProfile(paths, runs, run_ms, tuple(ops), arena_peak / 2**20)


@dataclass(frozen=True)
class _KeptRuns:
    windows: list[tuple[float, float]]
    kernels: list[dict[str, Any]]


def _load_events(path: Path) -> list[dict[str, Any]]:
    try:
        events = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not a readable ONNX Runtime profile ({err}).") from err
    if not isinstance(events, list) or not all(isinstance(e, dict) and "ts" in e for e in events):
        raise ValueError(f"{path} is not an ONNX Runtime profile: expected a JSON list of trace events.")
    return events


def _kept_runs(events: Sequence[dict[str, Any]], skip_runs: int) -> _KeptRuns:
    """The ``model_run`` windows after the first ``skip_runs``, and the kernel events inside them."""
    windows = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in events
        if e.get("cat") == "Session" and e.get("name") == "model_run"
    )[skip_runs:]
    starts = [start for start, _ in windows]

    def in_kept_run(timestamp: float) -> bool:
        index = bisect.bisect_right(starts, timestamp) - 1
        return index >= 0 and timestamp <= windows[index][1]

    kernels = [
        e
        for e in events
        if e.get("cat") == "Node" and str(e.get("name", "")).endswith(_KERNEL_SUFFIX) and in_kept_run(float(e["ts"]))
    ]
    return _KeptRuns(windows, kernels)
