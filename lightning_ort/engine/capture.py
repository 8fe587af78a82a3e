"""Capture: one TorchDynamo graph becomes forward and backward (or inference) graphs run by ONNX Runtime.

TorchDynamo hands each graph it traces (a ``torch``-level FX graph and fake example inputs, parameters
lifted as inputs) to :class:`~lightning_ort.engine.backend.ORTBackend`, which builds a :class:`CapturedGraph`.
That swaps a few ``torch.nn.functional`` calls for forms that export well
(:func:`~lightning_ort.engine.fx_passes.substitute_functions`), then AOTAutograd traces the graph with fake
tensors, decomposes it to core ATen, rewrites the joint graph (:mod:`lightning_ort.engine.fx_passes`), partitions
it with ``min_cut_rematerialization_partition`` and calls :meth:`CapturedGraph._compiler`'s function for each
graph. Each graph becomes an ONNX model run by a :class:`~lightning_ort.engine.session.GraphSession` (or, with
ops ONNX cannot express, a :class:`~lightning_ort.engine.partition.PartitionedGraph`). AOTAutograd's runtime
wrapper bridges the sessions to PyTorch autograd (``param.grad`` is filled as in eager) and writes buffer
updates back; TorchDynamo's guards decide when a graph is reused.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_ort.engine.blocks import BlockCall, BlockGraphs, has_blocks, inline_blocks
from lightning_ort.engine.decompositions import capture_decompositions
from lightning_ort.engine.disk_cache import DiskCache
from lightning_ort.engine.dynamic import is_symbolic
from lightning_ort.engine.export import ExportedGraph, export_graph
from lightning_ort.engine.fx_passes import move_saved_permutes, optimize_joint_graph
from lightning_ort.engine.partition import (
    PartitionCall,
    PartitionedGraph,
    describe_ops,
    split_graph,
    unsupported_nodes,
)
from lightning_ort.engine.replacements import substitute_functions
from lightning_ort.engine.session import GraphSession, providers_for
from lightning_ort.engine.torch_internals import (
    AOT_GRAPH_COMPILE_LOG,
    aot_autograd,
    functorch_config,
    min_cut_rematerialization_partition,
    tangents_by_format,
)
from lightning_ort.errors import (
    CaptureError,
    ExportError,
    FallbackWarning,
    LightningORTError,
    SessionError,
    first_line,
    warn,
)
from lightning_ort.options import DebugOptions, Fallback, LogLevel, SessionSettings

if TYPE_CHECKING:
    from torch._functorch._aot_autograd.schemas import AOTDispatchCompiler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildOptions:
    """How :class:`CapturedGraph` turns captured graphs into ONNX Runtime sessions.

    Args:
        settings: ONNX Runtime session settings.
        debug: debug options.
        fallback: ``"auto"`` runs ops ONNX cannot express in PyTorch (and code TorchDynamo cannot trace in
            PyTorch between graphs), warning once; ``"raise"`` makes both an error.
        disk_cache: where exported graphs are saved and looked up, or ``None``.
    """

    settings: SessionSettings = field(default_factory=SessionSettings)
    debug: DebugOptions = field(default_factory=DebugOptions)
    fallback: Fallback = "auto"
    disk_cache: DiskCache | None = None


@dataclass(frozen=True)
class BuildCounts:
    """What building graphs cost and how it went: the counts that capture and export add up.

    :class:`~lightning_ort.CacheStatistics` extends these with the counts of calls and runs.

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


class GraphNames:
    """Names of a backend's graphs, as in saved files: numbered per mode, in the order they are built.

    A training graph's forward and backward share a number, and inference graphs count apart from them: the
    first of each is unnumbered (``forward``, ``backward``, ``inference``), the next ``forward_1``...

    Example:
        >>> names = GraphNames()
        >>> names.name("0", "forward"), names.name("1", "inference"), names.name("0", "backward")
        ('forward', 'inference', 'backward')
        >>> names.name("2", "forward"), names.name("3", "inference")
        ('forward_1', 'inference_1')
    """

    def __init__(self) -> None:
        self._numbers: dict[tuple[str, bool], int] = {}

    def name(self, graph: str, kind: str) -> str:
        """The name of ``graph``'s (a TorchDynamo graph's tag) ``kind`` graph: forward, backward or inference."""
        mode = (graph, kind == "inference")
        if mode not in self._numbers:
            self._numbers[mode] = sum(inference == mode[1] for _, inference in self._numbers)
        number = self._numbers[mode]
        return f"{kind}_{number}" if number else kind


class CapturedGraph:
    """One TorchDynamo graph compiled into ONNX Runtime sessions through AOTAutograd.

    Args:
        gm: the graph TorchDynamo traced (``torch``-level ops; parameters and buffers are inputs).
        example_inputs: fake tensors (and sizes) like the graph's inputs.
        owner: the model's name, for messages.
        tag: identifies this graph among the backend's (``""`` for the first, ``"1"``...), for messages.
        options: how graphs become sessions.
        build_log: where build time and counts are added up.
        blocks: the backend's block graphs, shared by its captured graphs; ``None`` builds them for this graph.
        names: the backend's graph names, shared by its captured graphs; ``None`` names this graph's alone.
    """

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        owner: str,
        tag: str,
        options: BuildOptions,
        build_log: BuildLog,
        blocks: BlockGraphs | None = None,
        names: GraphNames | None = None,
    ) -> None:
        self._gm = gm
        self._example_inputs = list(example_inputs)
        self._owner = owner
        self._device = _graph_device(example_inputs, owner)
        self._tag = tag
        self._options = options
        self._log = build_log
        self._backward_failure: ExportError | SessionError | None = None
        self._symbolic = any(is_symbolic(value) for value in example_inputs)
        self._blocks = blocks if blocks is not None else BlockGraphs()
        self._names = names if names is not None else GraphNames()
        self.runners: list[tuple[str, GraphRunner]] = []

    def compile(self) -> Callable[..., Any]:
        """The function TorchDynamo calls in place of the graph: ONNX Runtime sessions behind AOTAutograd.

        A graph ONNX Runtime cannot build at all (an export failure that names no op) runs in PyTorch with a
        :class:`FallbackWarning`, or raises under ``fallback="raise"``.
        """
        start, exported_before = time.perf_counter(), self._log.counts.export_seconds
        substitute_functions(self._gm)
        backend = aot_autograd(
            fw_compiler=self._compiler("forward"),
            bw_compiler=self._compiler("backward"),
            inference_compiler=self._compiler("inference"),
            partition_fn=_partition,
            decompositions=capture_decompositions(self._device.type),
        )
        try:
            # SDPA that the substitutions do not reach (inside PyTorch's own multi-head attention for cross
            # attention, for instance) takes its math path: the fused kernels' backward ops have no ONNX
            # translation, and their auxiliary outputs do not survive the export.
            with sdpa_kernel(SDPBackend.MATH), _OwnFailuresUnlogged(AOT_GRAPH_COMPILE_LOG), tangents_by_format():
                compiled = self._traced_by_aot(backend)
            if self._backward_failure is not None:
                # AOTAutograd builds a dynamic-shape backward during the forward but defers its failure to the
                # first backward; report it now, while the graph can still run in PyTorch instead.
                raise self._backward_failure
        except (ExportError, SessionError) as err:
            # Failures that name ops were already narrowed to per-op fallback; what reaches here names none (or
            # the same ops failed again). A dynamic-shape graph gets static graphs, one per shape; any other
            # graph can only run whole in PyTorch.
            if self._options.fallback == "raise":
                raise
            if self._symbolic:
                log.info(
                    "%s: the dynamic-shape %s graph could not be built (%s); building one graph per input shape",
                    self._owner,
                    self._tag or "first",
                    first_line(err),
                )
                return PerShapeGraphs(self)
            self._log.add(eager_signatures=1, eager_ops=op_count(self._gm))
            warn_fallback(
                f"lightning_ort: {self._owner} runs in PyTorch for one of its graphs: ONNX Runtime could not build "
                f"its graphs ({first_line(err)}). Run with DebugOptions(save_onnx=True, onnx_prefix='model', "
                "log_level=LogLevel.VERBOSE) to see why; pass fallback='raise' to make this an error."
            )
            return self._gm.forward
        finally:
            exported = self._log.counts.export_seconds - exported_before
            self._log.add(capture_seconds=time.perf_counter() - start - exported)
        return compiled

    def _traced_by_aot(self, backend: Callable[..., Any]) -> Callable[..., Any]:
        """``backend`` applied to the graph; blocks AOTAutograd refuses to keep apart are inlined instead."""
        blocks = self._blocks.snapshot()
        try:
            return backend(self._gm, self._example_inputs)
        except (ExportError, SessionError):
            raise
        except RuntimeError as err:
            if not has_blocks(self._gm):
                raise
            self._blocks.restore(blocks)
            log.info(
                "%s: block graphs are not possible for the %s graph (%s); capturing it with the blocks inlined",
                self._owner,
                self._tag or "first",
                first_line(err),
            )
            inline_blocks(self._gm)
            return backend(self._gm, self._example_inputs)

    def specialize(self, args: Sequence[Any], index: int) -> Callable[..., Any]:
        """This graph compiled for the static shapes of ``args`` (real call arguments); ``index`` names it."""
        tag = f"{self._tag}_static{index}" if self._tag else f"static{index}"
        static = CapturedGraph(
            self._gm, list(args), self._owner, tag, self._options, self._log, self._blocks, self._names
        )
        static.runners = self.runners
        self._log.add(graphs=1)
        return static.compile()

    def _compiler(self, kind: str) -> AOTDispatchCompiler:
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> GraphRunner:
            name = self._names.name(self._tag, kind)
            start = time.perf_counter()
            with torch.random.fork_rng(devices=_rng_devices(self._device)), self._log.timed("export_seconds"):
                try:
                    runner = self._build(gm, example_inputs, name, kind)
                except (ExportError, SessionError) as err:
                    failure = type(err)(f"{self._owner}: {err}", err.nodes)
                    if kind == "backward":
                        self._backward_failure = failure
                    raise failure from err
            log.info(
                "built %s graph of %s in %.2fs (providers %s)",
                name,
                self._owner,
                time.perf_counter() - start,
                runner.providers,
            )
            self.runners.append((kind, runner))
            return runner

        return compile_graph

    def _build(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], name: str, kind: str = "forward"
    ) -> GraphRunner:
        """A runner for ``gm`` (see :meth:`_runner`), its ops counted in ``graph_ops``."""
        runner = self._runner(gm, example_inputs, name, kind)
        self._log.add(graph_ops=op_count(gm))
        return runner

    def _runner(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], name: str, kind: str = "forward"
    ) -> GraphRunner:
        """A runner for ``gm``: one session, or partitions around the ops and blocks that run apart from it."""
        blocks = self._blocks.substitute(gm, kind, self._build, name)
        key: str | None = None
        if not blocks:
            key, graph = self._cached(gm, example_inputs, name)
            if graph is not None:
                return self._open(graph)
        unsupported = unsupported_nodes(gm, self._device)
        if unsupported and self._options.fallback == "raise":
            raise ExportError(
                f"the {name} graph has ops ONNX Runtime cannot run: {describe_ops(gm, unsupported)}.\n"
                "Rewrite that part of the model with supported ops or dtypes, keep that submodule outside "
                "ORTModule, or pass fallback='auto' to run just those ops in PyTorch.",
                list(unsupported),
            )
        if not unsupported and not blocks:
            try:
                return self._open(self._export(gm, example_inputs, name, key))
            except (ExportError, SessionError) as err:
                if self._options.fallback == "raise":
                    raise self._traced(gm, err) from err
                unsupported = self._failing_nodes(gm, {}, err)
        return self._split(gm, unsupported, name)

    def _split(self, gm: torch.fx.GraphModule, unsupported: dict[str, str], name: str) -> PartitionedGraph:
        """Run ``unsupported`` nodes in PyTorch, block calls in their own graphs, the rest in ONNX Runtime partitions.

        A partition whose export (or session creation) fails at another op gets that op moved to PyTorch as
        well, and the graph is split again.
        """
        while True:
            split, partitions = split_graph(gm, unsupported)
            sessions: list[GraphSession] = []
            try:
                for index, partition in enumerate(partitions):
                    sub = getattr(split, partition)
                    examples = [node.meta["val"] for node in sub.graph.nodes if node.op == "placeholder"]
                    sessions.append(self._session(sub, examples, f"{name}_part{index}"))
                    setattr(split, partition, PartitionCall(sub, sessions[-1]))
            except (ExportError, SessionError) as err:
                unsupported = {**unsupported, **self._failing_nodes(gm, unsupported, err)}
                continue
            if unsupported:
                self._log.add(fallback_ops=len(unsupported))
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

    def _failing_nodes(
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
            raise err  # CapturedGraph.compile builds static graphs instead
        if not blamed:
            bisected = sum(reason in _BISECTED.values() for reason in unsupported.values())
            culprit = self._bisect(gm, unsupported) if bisected < _MAX_BISECTED else None
            if culprit is None:
                raise err
            return {culprit: _BISECTED[type(err)]}
        return dict.fromkeys(blamed, _failure_reason(err))

    def _traced(self, gm: torch.fx.GraphModule, err: ExportError | SessionError) -> ExportError | SessionError:
        """``err``, naming the ops behind it when its message names none and bisection finds them for certain.

        Ops are bisected out (at most :data:`_MAX_BISECTED`) until the rest of the graph builds; if it never
        does, the failure is not the ops' and ``err`` is returned as it is.
        """
        if _graph_nodes(gm, err) or self._symbolic:
            return err
        culprits: dict[str, str] = {}
        while len(culprits) < _MAX_BISECTED:
            culprit = self._bisect(gm, culprits)
            if culprit is None:
                return err
            culprits[culprit] = "the op"
            if self._builds(gm, set(culprits)):
                return type(err)(
                    f"{err}\nBisection traced it to {describe_ops(gm, culprits)}: the graph builds without "
                    f"{'them' if len(culprits) > 1 else 'it'}. Rewrite that part of the model, keep that submodule "
                    "outside ORTModule, or pass fallback='auto' to run just those ops in PyTorch.",
                    list(culprits),
                )
        return err

    def _bisect(self, gm: torch.fx.GraphModule, unsupported: dict[str, str]) -> str | None:
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
            return self._builds(gm, {*unsupported, *(set(runnable) - set(kept))})

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

    def _builds(self, gm: torch.fx.GraphModule, excluded: set[str]) -> bool:
        """Whether ONNX Runtime builds every partition of ``gm`` left once the ``excluded`` nodes run in PyTorch."""
        split, partitions = split_graph(gm, excluded)
        try:
            for partition in partitions:
                sub = getattr(split, partition)
                examples = [node.meta["val"] for node in sub.graph.nodes if node.op == "placeholder"]
                self._open(self._translate(sub, examples, "probe", verbose=False))
        except (ExportError, SessionError):
            return False
        return True

    def _session(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], name: str) -> GraphSession:
        """A session on ``gm``: loaded from the disk cache, or exported (and saved there)."""
        key, graph = self._cached(gm, example_inputs, name)
        return self._open(graph if graph is not None else self._export(gm, example_inputs, name, key))

    def _cached(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], name: str
    ) -> tuple[str | None, ExportedGraph | None]:
        """``gm``'s disk cache key (``None`` without a usable cache) and its saved graph, if there is one."""
        disk = self._options.disk_cache
        if disk is None or not disk.enabled:
            return None, None
        key = disk.key(gm, example_inputs, self._device, providers_for(self._device, self._options.settings))
        graph = disk.load(key, name)
        if graph is not None:
            self._log.add(disk_cache_loads=1)
        return key, graph

    def _export(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], name: str, key: str | None
    ) -> ExportedGraph:
        """Export ``gm``; save it in the disk cache under ``key`` when there is one."""
        verbose = LogLevel(self._options.debug.log_level).ort_severity == 0
        graph = self._translate(gm, example_inputs, name, verbose, saved_from=gm.meta.get(_SAVED_FROM))
        self._log.add(onnx_exports=1)
        if key is not None and self._options.disk_cache is not None:
            self._options.disk_cache.store(key, graph)
        return graph

    def _translate(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        name: str,
        verbose: bool,
        saved_from: int | None = None,
    ) -> ExportedGraph:
        with self._log.timed("translation_seconds"):
            try:
                return export_graph(gm, example_inputs, name, verbose, saved_from)
            except LightningORTError:
                raise
            except Exception as err:  # our own export code failed: the graph runs in PyTorch, not a crash
                raise ExportError(
                    f"lightning_ort's export of the {name} graph failed with {type(err).__name__}: {first_line(err)} "
                    f"(at {_raised_at(err)}). This is a bug in lightning_ort: please report it with the model."
                ) from err

    def _open(self, graph: ExportedGraph) -> GraphSession:
        with self._log.timed("session_seconds"):
            return GraphSession(graph, self._device, self._options.settings, self._options.debug)


class _OwnFailuresUnlogged(logging.Filter):
    """Drops a logger's records of our export or session failures while in use (we report those ourselves).

    AOTAutograd compiles a dynamic-shape graph's backward ahead of time and logs a failure, with its traceback,
    at WARNING level before deferring it to the first backward; :meth:`CapturedGraph.compile` reports it
    instead, and builds one graph per shape.

    Args:
        logger: the name of the logger to filter.
    """

    def __init__(self, logger: str) -> None:
        super().__init__()
        self._logger = logging.getLogger(logger)

    def __enter__(self) -> None:
        self._logger.addFilter(self)

    def __exit__(self, *exc_info: object) -> None:
        self._logger.removeFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        failure = record.exc_info[1] if record.exc_info else None
        return not isinstance(failure, (ExportError, SessionError))


class PerShapeGraphs:
    """Runs a dynamic-shape graph that ONNX Runtime could not build, as one static graph per input shape.

    Some exports only fail with symbolic sizes (an attribute ONNX needs as a constant, such as a transposed
    convolution's ``output_padding``, becomes a size expression); TorchDynamo has already decided the graph is
    dynamic, so the specialization happens here, keyed by the call's shapes and integer arguments.

    Args:
        graph: the dynamic-shape graph.
    """

    def __init__(self, graph: CapturedGraph) -> None:
        self._graph = graph
        self._compiled: dict[tuple[Any, ...], Callable[..., Any]] = {}

    def __call__(self, *args: Any) -> Any:
        key = tuple((tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else a for a in args)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = self._graph.specialize(args, len(self._compiled))
        return compiled(*args)


def _graph_nodes(gm: torch.fx.GraphModule, err: ExportError | SessionError) -> list[str]:
    """The nodes of ``gm`` that ``err`` names (an ONNX Runtime message names ONNX nodes, which are not)."""
    names = {node.name for node in gm.graph.nodes}
    return [node for node in err.nodes if node in names]


def warn_fallback(message: str) -> None:
    """Warn that part of a model runs in PyTorch; while :data:`PENDING_WARNINGS` collects, only record it.

    Graphs are built deep inside TorchDynamo, where no ``stacklevel`` reaches the user's code;
    :class:`~lightning_ort.engine.backend.DynamoEvents` collects the messages and warns from the user's call.
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


def _partition(
    joint: torch.fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    # No common-subexpression pass here: the ONNX translation and ONNX Runtime remove duplicates themselves,
    # and functorch's pass imports torch._inductor's pattern matcher, which costs memory and first-call time.
    with functorch_config.patch(cse=False):
        forward, backward = min_cut_rematerialization_partition(optimize_joint_graph(joint), joint_inputs, **kwargs)
    saved_from = kwargs["num_fwd_outputs"]
    moved = move_saved_permutes(forward, backward, saved_from)
    log.debug("%d saved permuted views moved to the backward graph", moved)
    forward.meta[_SAVED_FROM] = saved_from
    return forward, backward


_MAX_BISECTED = 4
"""Nodes one graph may have moved to PyTorch by bisection before it runs whole in PyTorch instead."""

_BISECTED: dict[type[Exception], str] = {
    SessionError: "bisection traced ONNX Runtime's failure to load the graph to",
    ExportError: "bisection traced the ONNX export's failure to",
}
"""Fallback reasons of the nodes :meth:`CapturedGraph._bisect` found, by the error that started it."""

_SAVED_FROM = "lightning_ort_saved_from"
"""``GraphModule.meta`` key: index of the forward graph's first output that only the backward graph reads."""


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


def _rng_devices(device: torch.device) -> list[int]:
    return [device.index or 0] if device.type == "cuda" else []


def _graph_device(example_inputs: Sequence[Any], owner: str) -> torch.device:
    devices = {v.device for v in example_inputs if isinstance(v, torch.Tensor) and v.device.type != "meta"}
    if len(devices) > 1:
        raise CaptureError(
            f"{owner} computes with tensors on several devices {sorted(map(str, devices))} in one graph; "
            "move the module and its inputs to one device first."
        )
    return devices.pop() if devices else torch.device("cpu")
