"""The graph cache of one ORTModule and its statistics."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

import torch

from lightning_ort.engine.capture import BuildLog, CapturedGraphs, GraphRunner
from lightning_ort.engine.dynamic import Shapes


@dataclass(frozen=True)
class CacheStatistics:
    """What an :class:`~lightning_ort.ORTModule` spent building graphs and how often it reused them.

    Attributes:
        export_seconds: wall time spent turning captured graphs into ONNX Runtime sessions: ONNX export (or
            loading from ``cache_dir``) and session creation, for every new signature's graphs.
        capture_seconds: wall time spent capturing new signatures with AOTAutograd (tracing, decomposition,
            forward/backward partitioning). The first-call cost of a signature is ``capture_seconds +
            export_seconds`` (see :attr:`build_seconds`).
        cache_hits: forward calls that reused a cached graph.
        cache_misses: forward calls that built a new graph.
        cached_graphs: signatures currently cached.
        forward_runs: ONNX Runtime runs of forward and inference graphs.
        backward_runs: ONNX Runtime runs of backward graphs.
        onnx_exports: graphs (or graph partitions) translated to ONNX.
        disk_cache_loads: graphs (or partitions) loaded from ``cache_dir`` instead of being exported.
        fallback_ops: ops of the built graphs that run in PyTorch because ONNX cannot express them.
        eager_signatures: call signatures that run entirely in PyTorch (control flow depending on tensor values).

    Example:
        >>> CacheStatistics().cache_hits
        0
    """

    export_seconds: float = 0.0
    capture_seconds: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    cached_graphs: int = 0
    forward_runs: int = 0
    backward_runs: int = 0
    onnx_exports: int = 0
    disk_cache_loads: int = 0
    fallback_ops: int = 0
    eager_signatures: int = 0

    @property
    def build_seconds(self) -> float:
        """Everything spent building graphs: ``capture_seconds + export_seconds``."""
        return self.capture_seconds + self.export_seconds


class GraphCache:
    """Maps a call signature (see :mod:`lightning_ort.engine.signature`) to its :class:`CapturedGraphs`.

    Graphs for one exact signature are found by key; graphs with symbolic sizes are kept per *general* key
    (the signature without input sizes) and found by asking each whether it accepts the call's tensors.

    Example:
        >>> cache = GraphCache()
        >>> cache.statistics().cached_graphs
        0
    """

    def __init__(self) -> None:
        self._entries: dict[Hashable, CapturedGraphs] = {}
        self._dynamic: dict[Hashable, list[CapturedGraphs]] = {}
        self._seen: dict[Hashable, list[Shapes]] = {}
        self._hits = 0
        self._misses = 0
        self._retired_runs = (0, 0)
        self.build_log = BuildLog()

    def lookup(self, key: Hashable, general_key: Hashable, tensors: Sequence[torch.Tensor]) -> CapturedGraphs | None:
        """The graphs for this call, if built: by exact signature, else a symbolic-shape entry that accepts it."""
        entry = self._entries.get(key)
        if entry is None:
            entry = next((e for e in self._dynamic.get(general_key, ()) if e.accepts(tensors)), None)
        if entry is not None:
            self._hits += 1
        return entry

    def seen_shapes(self, general_key: Hashable) -> list[Shapes]:
        """Input shapes of the calls that built graphs for ``general_key`` so far."""
        return self._seen.get(general_key, [])

    def next_tag(self) -> str:
        """Numbers signatures (``""`` for the first) so saved files of different signatures differ."""
        return "" if not self._misses else str(self._misses)

    def insert(self, key: Hashable, general_key: Hashable, shapes: Shapes, entry: CapturedGraphs) -> None:
        """Add a newly built (not yet run) entry: a miss."""
        self._entries[key] = entry
        self._seen.setdefault(general_key, []).append(shapes)
        self._misses += 1

    def settle(self, key: Hashable, general_key: Hashable, entry: CapturedGraphs) -> None:
        """After an entry's first call: one with symbolic sizes moves to the entries found by acceptance."""
        if entry.symbolic_dims and self._entries.get(key) is entry:
            del self._entries[key]
            self._dynamic.setdefault(general_key, []).append(entry)

    def discard(self, key: Hashable, general_key: Hashable, entry: CapturedGraphs) -> None:
        """Forget a new entry whose first call failed: the call counts as neither hit nor miss."""
        if self._entries.get(key) is entry:
            del self._entries[key]
            self._seen[general_key].pop()
            self._misses -= 1

    def clear(self) -> None:
        """Drop every graph (statistics are kept)."""
        self._retired_runs = self._run_counts()
        self._entries.clear()
        self._dynamic.clear()
        self._seen.clear()

    def statistics(self) -> CacheStatistics:
        forward, backward = self._run_counts()
        return CacheStatistics(
            cache_hits=self._hits,
            cache_misses=self._misses,
            cached_graphs=len(self._entries) + sum(len(entries) for entries in self._dynamic.values()),
            forward_runs=forward,
            backward_runs=backward,
            **dataclasses.asdict(self.build_log),
        )

    def runners(self) -> Iterator[tuple[str, GraphRunner]]:
        """``(kind, runner)`` for every built graph; kind is ``"forward"``, ``"backward"`` or ``"inference"``."""
        for entry in self._entries.values():
            yield from entry.runners
        for entries in self._dynamic.values():
            for entry in entries:
                yield from entry.runners

    def _run_counts(self) -> tuple[int, int]:
        forward, backward = self._retired_runs
        for kind, session in self.runners():
            if kind == "backward":
                backward += session.runs
            else:
                forward += session.runs
        return forward, backward
