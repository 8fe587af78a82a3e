"""Build: one ATen graph (a forward, backward or inference graph) becomes what runs it in ONNX Runtime.

:class:`GraphBuilder` turns each graph AOTAutograd hands to :class:`~lightning_ort.engine.capture.aot.CapturedGraph`
into a :class:`~lightning_ort.engine.runtime.session.GraphSession`: loaded from the disk cache or exported to ONNX
(:mod:`lightning_ort.engine.onnx.export`), then opened in ONNX Runtime. A graph with ops ONNX Runtime cannot run,
or with block calls, becomes a :class:`~lightning_ort.engine.capture.partition.PartitionedGraph` instead: those ops in
PyTorch, the rest in ONNX Runtime partitions. When an export or a session fails without naming its op, the op
is found by bisection. :class:`BuildLog` adds up what building cost (:class:`BuildCounts`).
"""

from __future__ import annotations

import dataclasses
import operator
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from lightning_ort.engine.capture.blocks import BlockCall, BlockGraphs
from lightning_ort.engine.capture.partition import (
    PartitionCall,
    PartitionedGraph,
    attention_nodes,
    describe_ops,
    split_graph,
    unsupported_nodes,
    weight_gradient_nodes,
)
from lightning_ort.engine.onnx.export import ExportedGraph, export_graph
from lightning_ort.engine.runtime.disk_cache import DiskCache
from lightning_ort.engine.runtime.session import GraphSession, providers_for
from lightning_ort.errors import ExportError, FallbackWarning, LightningORTError, SessionError, first_line, warn
from lightning_ort.logs import get_logger
from lightning_ort.options import AttentionPath, ConvWeightGrad, DebugOptions, Fallback, LogLevel, SessionSettings

log = get_logger(__name__)


@dataclass(frozen=True)
class BuildOptions:
    """How :class:`CapturedGraph` turns captured graphs into ONNX Runtime sessions.

    Args:
        settings: ONNX Runtime session settings.
        debug: debug options.
        fallback: ``"auto"`` runs ops ONNX cannot express in PyTorch (and code TorchDynamo cannot trace in
            PyTorch between graphs), warning once; ``"raise"`` makes both an error.
        disk_cache: where exported graphs are saved and looked up, or ``None``.
        attention: where ``F.scaled_dot_product_attention`` runs: ``"onnx"`` (its math in the graphs),
            ``"torch"`` (its fused kernels, between ONNX Runtime partitions) or ``"auto"`` (by the device, which
            :class:`~lightning_ort.engine.capture.aot.CapturedGraph` resolves).
        conv_weight_grad: where convolutions' weight gradients are computed (see
            :func:`~lightning_ort.engine.fx.decompositions.weight_grad_in_torch`).
        automatic_blocks: the model's blocks were found by ``blocks="auto"``, not named: those too light for
            graphs of their own on the graph's device are inlined (see
            :data:`~lightning_ort.engine.capture.blocks.BLOCK_FLOPS`).
    """

    settings: SessionSettings = field(default_factory=SessionSettings)
    debug: DebugOptions = field(default_factory=DebugOptions)
    fallback: Fallback = "auto"
    disk_cache: DiskCache | None = None
    attention: AttentionPath = "auto"
    conv_weight_grad: ConvWeightGrad = "auto"
    automatic_blocks: bool = False


@dataclass(frozen=True)
class BuildCounts:
    """What building graphs cost and how it went: the counts that capture and export add up.

    :class:`~lightning_ort.ModuleStatistics` extends these with the counts of calls and runs.

    Attributes:
        capture_seconds: wall time spent in AOTAutograd (tracing, decomposition, forward/backward partitioning)
            for the graphs TorchDynamo handed over.
        export_seconds: wall time spent turning captured graphs into ONNX Runtime sessions: ONNX export (or
            loading from ``cache_dir``), splitting around ops ONNX cannot express, and session creation.
        translation_seconds: the part of ``export_seconds`` spent translating FX graphs to ONNX and optimizing the
            ONNX models.
        session_seconds: the part of ``export_seconds`` spent creating ONNX Runtime sessions (ONNX Runtime's
            graph optimizations and kernel selection).
        onnx_exports: graphs (or graph partitions) translated to ONNX.
        disk_cache_loads: graphs (or partitions) loaded from ``cache_dir`` instead of being exported.
        fallback_ops: ops of the built graphs that run in PyTorch because ONNX cannot express them.
        eager_signatures: TorchDynamo graphs that run entirely in PyTorch (ONNX Runtime could not build them).
        graphs: TorchDynamo graphs built so far; more than one per call means graph breaks.
        graph_ops: ATen ops of the forward, backward and inference graphs built (a block graph's once), including
            the ``fallback_ops`` among them.
        eager_ops: ops of the TorchDynamo graphs that run entirely in PyTorch (``eager_signatures``).
        graph_breaks: graph breaks TorchDynamo reported: Python it could not trace, run in PyTorch between graphs.
            ``None`` where nothing watched TorchDynamo's calls (a backend used alone with ``torch.compile``).
        recompile_limit_hits: code TorchDynamo stopped compiling after too many recompilations (it runs in
            PyTorch from then on); ``None`` likewise.

    Example:
        >>> BuildCounts().onnx_exports
        0
    """

    capture_seconds: float = 0.0
    export_seconds: float = 0.0
    translation_seconds: float = 0.0
    session_seconds: float = 0.0
    onnx_exports: int = 0
    disk_cache_loads: int = 0
    fallback_ops: int = 0
    eager_signatures: int = 0
    graphs: int = 0
    graph_ops: int = 0
    eager_ops: int = 0
    graph_breaks: int | None = 0
    recompile_limit_hits: int | None = 0


class BuildLog:
    """Adds up :class:`BuildCounts` over the graphs of one backend.

    Example:
        >>> build_log = BuildLog()
        >>> build_log.add(onnx_exports=1)
        >>> with build_log.timed("session_seconds"):
        ...     pass
        >>> build_log.counts.onnx_exports, build_log.counts.session_seconds >= 0
        (1, True)
    """

    def __init__(self) -> None:
        self._counts = BuildCounts()

    @property
    def counts(self) -> BuildCounts:
        """The counts so far."""
        return self._counts

    def add(self, **amounts: float) -> None:
        """Add ``amounts`` to the counts of the same names."""
        totals: dict[str, Any] = {name: (getattr(self._counts, name) or 0) + amount for name, amount in amounts.items()}
        self._counts = dataclasses.replace(self._counts, **totals)

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Add the wall time of the ``with`` block to the count ``name`` (also when the block raises)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(**{name: time.perf_counter() - start})


GraphRunner = GraphSession | PartitionedGraph
"""What runs one graph: a session, or partitions around the ops that run in PyTorch."""


class GraphBuilder:
    """Builds the graphs of one captured graph into ONNX Runtime sessions (see the module docstring).

    Args:
        owner: the model's name, for messages.
        device: the device the graphs compute on.
        options: how graphs become sessions.
        build_log: where build time and counts are added up.
        blocks: the backend's block graphs, which block calls in a graph run.
        symbolic: whether the graphs have symbolic sizes (a failure then builds static graphs instead of
            bisecting).
    """

    def __init__(
        self,
        owner: str,
        device: torch.device,
        options: BuildOptions,
        build_log: BuildLog,
        blocks: BlockGraphs,
        symbolic: bool,
    ) -> None:
        self._owner = owner
        self._device = device
        self._options = options
        self._build_log = build_log
        self._blocks = blocks
        self._symbolic = symbolic

    def build(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], name: str, kind: str = "forward"
    ) -> GraphRunner:
        """A runner for ``gm`` (see :meth:`_runner_for`), its ops counted in ``graph_ops``."""
        runner = self._runner_for(gm, example_inputs, name, kind)
        self._build_log.add(graph_ops=op_count(gm))
        return runner

    def _runner_for(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], name: str, kind: str = "forward"
    ) -> GraphRunner:
        """A runner for ``gm``: one session, or partitions around the ops and blocks that run apart from it."""
        blocks = self._blocks.substitute(gm, kind, self.build, name)
        key: str | None = None
        if not blocks:
            key, graph = self._load_cached(gm, example_inputs, name)
            if graph is not None:
                return self._open_session(graph)
        kept = {**(attention_nodes(gm) if self._options.attention == "torch" else {}), **weight_gradient_nodes(gm)}
        unsupported = {name: reason for name, reason in unsupported_nodes(gm).items() if name not in kept}
        if unsupported and self._options.fallback == "raise":
            raise ExportError(
                f"the {name} graph has ops ONNX Runtime cannot run: {describe_ops(gm, unsupported)}.\n"
                "Rewrite that part of the model with supported ops or dtypes, keep that submodule outside "
                "ORTModule, or pass fallback='auto' to run just those ops in PyTorch.",
                list(unsupported),
            )
        if not unsupported and not kept and not blocks:
            try:
                return self._open_session(self._export_and_store(gm, example_inputs, name, key))
            except (ExportError, SessionError) as err:
                if self._options.fallback == "raise":
                    raise self._with_culprits(gm, err) from err
                unsupported = self._blamed_nodes(gm, {}, err)
        return self._split_around(gm, unsupported, name, kept)

    def _split_around(
        self, gm: torch.fx.GraphModule, unsupported: dict[str, str], name: str, kept: dict[str, str]
    ) -> PartitionedGraph:
        """Run ``unsupported`` and ``kept`` nodes in PyTorch, block calls in their own graphs, the rest in ONNX
        Runtime partitions. ``kept`` ones run there by request: they are neither warned about nor counted.

        A partition whose export (or session creation) fails at another op gets that op moved to PyTorch as
        well, and the graph is split again.
        """
        while True:
            split, partitions = split_graph(gm, {**kept, **unsupported})
            sessions: list[GraphSession] = []
            try:
                for index, partition in enumerate(partitions):
                    sub = getattr(split, partition)
                    if gm.meta.get(VIEWS_FROM) == 0:
                        sub.meta[VIEWS_FROM] = 0  # a backward graph's values all go to autograd or other ops
                    examples = [node.meta["val"] for node in sub.graph.nodes if node.op == "placeholder"]
                    sessions.append(self._partition_session(sub, examples, f"{name}_part{index}"))
                    setattr(split, partition, PartitionCall(sub, sessions[-1]))
            except (ExportError, SessionError) as err:
                unsupported = {**unsupported, **self._blamed_nodes(gm, {**kept, **unsupported}, err)}
                continue
            if unsupported:
                self._build_log.add(fallback_ops=len(unsupported))
                rest = (
                    f"The rest runs in ONNX Runtime ({len(sessions)} partition(s))"
                    if sessions
                    else "Nothing else in that graph runs in ONNX Runtime"
                )
                warn_fallback(
                    f"lightning_ort: {self._owner}'s {name} graph runs {len(unsupported)} op(s) in "
                    f"PyTorch: {describe_ops(gm, unsupported)}. {rest}. Pass fallback='raise' to make this an error."
                )
            return PartitionedGraph(split, name, sessions, len(unsupported))

    def _blamed_nodes(
        self, gm: torch.fx.GraphModule, unsupported: dict[str, str], err: ExportError | SessionError
    ) -> dict[str, str]:
        """The nodes of ``gm`` behind ``err``, with the reason, beyond those already ``unsupported``.

        Errors that name FX nodes give them. Others (ONNX Runtime rejecting the exported model, naming only
        ONNX nodes) are traced to one node by halving the nodes left in ONNX Runtime while a half still fails,
        at most :data:`_MAX_BISECTED` times per graph (a failure that every node shows is not an op's).
        Re-raises ``err`` when no new node can be blamed, so the graph runs whole in PyTorch.
        """
        blamed = [node for node in _graph_nodes(gm, err) if node not in unsupported]
        if not blamed and self._symbolic:
            raise err  # the captured graph builds static graphs instead
        if not blamed:
            bisected = sum(reason in _BISECTED.values() for reason in unsupported.values())
            culprit = self._bisect_failing_node(gm, unsupported) if bisected < _MAX_BISECTED else None
            if culprit is None:
                raise err
            return {culprit: _BISECTED[type(err)]}
        return dict.fromkeys(blamed, _failure_reason(err))

    def _with_culprits(self, gm: torch.fx.GraphModule, err: ExportError | SessionError) -> ExportError | SessionError:
        """``err``, naming the ops behind it when its message names none and bisection finds them for certain.

        Ops are bisected out (at most :data:`_MAX_BISECTED`) until the rest of the graph builds; if it never
        does, the failure is not the ops' and ``err`` is returned as it is.
        """
        if _graph_nodes(gm, err) or self._symbolic:
            return err
        culprits: dict[str, str] = {}
        while len(culprits) < _MAX_BISECTED:
            culprit = self._bisect_failing_node(gm, culprits)
            if culprit is None:
                return err
            culprits[culprit] = "the op"
            if self._partitions_build(gm, set(culprits)):
                return type(err)(
                    f"{err}\nBisection traced it to {describe_ops(gm, culprits)}: the graph builds without "
                    f"{'them' if len(culprits) > 1 else 'it'}. Rewrite that part of the model, keep that submodule "
                    "outside ORTModule, or pass fallback='auto' to run just those ops in PyTorch.",
                    list(culprits),
                )
        return err

    def _bisect_failing_node(self, gm: torch.fx.GraphModule, unsupported: dict[str, str]) -> str | None:
        """A node whose partition alone fails to export or load, found by halving ``gm``'s runnable nodes."""
        runnable = [
            node.name
            for node in gm.graph.nodes
            if node.op == "call_function"
            and node.target is not operator.getitem
            and not isinstance(node.target, BlockCall)
            and node.name not in unsupported
        ]

        def builds(kept: Sequence[str]) -> bool:
            return self._partitions_build(gm, {*unsupported, *(set(runnable) - set(kept))})

        candidates = runnable
        while len(candidates) > 1:
            half = len(candidates) // 2
            failing = [part for part in (candidates[:half], candidates[half:]) if not builds(part)]
            if not failing:
                return None  # the failure needs nodes from both halves
            candidates = failing[0]  # with both failing, the other half's culprit is found in the next round
        if candidates and not builds(candidates):
            return candidates[0]
        return None

    def _partitions_build(self, gm: torch.fx.GraphModule, excluded: set[str]) -> bool:
        """Whether ONNX Runtime builds every partition of ``gm`` left once the ``excluded`` nodes run in PyTorch."""
        split, partitions = split_graph(gm, excluded)
        try:
            for partition in partitions:
                sub = getattr(split, partition)
                examples = [node.meta["val"] for node in sub.graph.nodes if node.op == "placeholder"]
                self._open_session(self._translate_to_onnx(sub, examples, "probe", verbose=False))
        except (ExportError, SessionError):
            return False
        return True

    def _partition_session(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], name: str) -> GraphSession:
        """A session on ``gm``: loaded from the disk cache, or exported (and saved there)."""
        key, graph = self._load_cached(gm, example_inputs, name)
        return self._open_session(graph if graph is not None else self._export_and_store(gm, example_inputs, name, key))

    def _load_cached(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], name: str
    ) -> tuple[str | None, ExportedGraph | None]:
        """``gm``'s disk cache key (``None`` without a usable cache) and its saved graph, if there is one."""
        disk = self._options.disk_cache
        if disk is None or not disk.enabled:
            return None, None
        key = disk.key(gm, example_inputs, self._device, providers_for(self._device, self._options.settings))
        graph = disk.load(key, name)
        if graph is not None:
            self._build_log.add(disk_cache_loads=1)
        return key, graph

    def _export_and_store(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], name: str, key: str | None
    ) -> ExportedGraph:
        """Export ``gm``; save it in the disk cache under ``key`` when there is one."""
        verbose = LogLevel(self._options.debug.log_level).ort_severity == 0
        graph = self._translate_to_onnx(gm, example_inputs, name, verbose, views_from=gm.meta.get(VIEWS_FROM))
        self._build_log.add(onnx_exports=1)
        if key is not None and self._options.disk_cache is not None:
            self._options.disk_cache.store(key, graph)
        return graph

    def _translate_to_onnx(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        name: str,
        verbose: bool,
        views_from: int | None = None,
    ) -> ExportedGraph:
        with self._build_log.timed("translation_seconds"):
            try:
                return export_graph(gm, example_inputs, name, verbose, views_from)
            except LightningORTError:
                raise
            except Exception as err:  # our own export code failed: the graph runs in PyTorch, not a crash
                raise ExportError(
                    f"lightning_ort's export of the {name} graph failed with {type(err).__name__}: {first_line(err)} "
                    f"(at {_raised_at(err)}). This is a bug in lightning_ort: please report it with the model."
                ) from err

    def _open_session(self, graph: ExportedGraph) -> GraphSession:
        with self._build_log.timed("session_seconds"):
            return GraphSession(graph, self._device, self._options.settings, self._options.debug)


def _graph_nodes(gm: torch.fx.GraphModule, err: ExportError | SessionError) -> list[str]:
    """The nodes of ``gm`` that ``err`` names (an ONNX Runtime message names ONNX nodes, which are not)."""
    names = {node.name for node in gm.graph.nodes}
    return [node for node in err.nodes if node in names]


def warn_fallback(message: str) -> None:
    """Warn that part of a model runs in PyTorch; while :data:`PENDING_WARNINGS` collects, only record it.

    Graphs are built deep inside TorchDynamo, where no ``stacklevel`` reaches the user's code;
    :class:`~lightning_ort.engine.capture.backend.DynamoEvents` collects the messages and warns from the user's call.
    """
    if PENDING_WARNINGS.collecting:
        PENDING_WARNINGS.messages.append(message)
    else:
        warn(message, FallbackWarning)


class PendingWarnings(threading.local):
    """Fallback warnings held back while a call runs (see :func:`warn_fallback`), per thread: two models compiled
    in two threads keep their warnings apart."""

    def __init__(self) -> None:
        self.collecting = False
        self.messages: list[str] = []


PENDING_WARNINGS = PendingWarnings()


_MAX_BISECTED = 4
"""Nodes one graph may have moved to PyTorch by bisection before it runs whole in PyTorch instead."""

_BISECTED: dict[type[Exception], str] = {
    SessionError: "bisection traced ONNX Runtime's failure to load the graph to",
    ExportError: "bisection traced the ONNX export's failure to",
}
"""Fallback reasons of the nodes :meth:`GraphBuilder._bisect_failing_node` found, by the error that started it."""

VIEWS_FROM = "lightning_ort_views_from"
"""``GraphModule.meta`` key: index of the graph's first output that may be returned as a view (see
:func:`~lightning_ort.engine.onnx.export.export_graph`)."""


def op_count(gm: torch.fx.GraphModule) -> int:
    """The ops of ``gm``: its function calls, less tuple indexing and calls of block graphs (counted in theirs)."""
    return sum(
        1
        for node in gm.graph.nodes
        if node.op in ("call_function", "call_method", "call_module")
        and node.target is not operator.getitem
        and not isinstance(node.target, BlockCall)
    )


def _raised_at(err: BaseException) -> str:
    """``file:line`` where ``err`` was raised."""
    frames = traceback.extract_tb(err.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "an unknown line"


def _failure_reason(err: ExportError | SessionError) -> str:
    if isinstance(err, SessionError):
        return "ONNX Runtime has no kernel (for these dtypes, on this provider) for"
    return "the ONNX translation failed for"
