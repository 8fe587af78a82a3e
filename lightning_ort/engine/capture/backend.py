"""The TorchDynamo backend: every graph TorchDynamo traces runs in ONNX Runtime.

:class:`ORTBackend` is what :class:`~lightning_ort.ORTModule` compiles its module with, and what
``torch.compile(model, backend="ort")`` uses through :func:`ort` (registered under the ``torch_dynamo_backends``
entry point). TorchDynamo does what a front end must: it runs the Python between graphs (graph breaks), guards
each graph on what it assumed (shapes, dtypes, ``self.training``, Python constants) and recompiles when a guard
fails. Each graph it hands over becomes a :class:`~lightning_ort.engine.capture.aot.CapturedGraph`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from lightning_ort.engine.capture.aot import CapturedGraph, GraphNames
from lightning_ort.engine.capture.blocks import BlockGraphs
from lightning_ort.engine.capture.build import PENDING_WARNINGS, BuildCounts, BuildLog, BuildOptions, GraphRunner
from lightning_ort.engine.runtime.disk_cache import DiskCache
from lightning_ort.engine.torch_internals import (
    COMPILATION_EVENTS,
    CONFIG_LOGGING_ACCEPTS_FUNCTIONS,
    GRAPH_BREAK_LOGGERS,
    GUARDS_FILTER_SAFELY,
    METRICS_LOGGER,
    RECOMPILE_LOGGER,
    TRACES_RECURRENT_LAYERS,
    BackendCompilerFailed,
    Unsupported,
    UserError,
    compilations_in_flight,
    counters,
    dynamo_config,
    graph_break_reasons,
    in_fsdp_hooks,
    is_config_logging_failure,
    is_fast_path_guard,
    is_graph_break_log,
    recompile_limit_hit,
    recompile_reason,
)
from lightning_ort.errors import (
    CaptureError,
    FallbackWarning,
    GraphBreakWarning,
    RecompileLimitWarning,
    first_line,
    frame_line,
    package_folder,
    user_frame,
    warn,
)
from lightning_ort.logs import ScopedFilter, get_logger
from lightning_ort.options import (
    DebugOptions,
    Fallback,
    SessionSettings,
    parse_attention,
    parse_conv_weight_grad,
    parse_fallback,
)

log = get_logger(__name__)


@dataclass(frozen=True)
class ModuleStatistics(BuildCounts):
    """What an :class:`~lightning_ort.ORTModule` spent building graphs and how often it reused and ran them.

    It holds the build times and counts of :class:`~lightning_ort.BuildCounts` (``export_seconds``,
    ``capture_seconds``, ``onnx_exports``, ``graph_breaks``...) and these:

    Attributes:
        cache_hits: forward calls that built no graph (``None`` from a backend used alone with ``torch.compile``,
            which does not see the calls).
        cache_misses: forward calls that built at least one graph (a first call, or a recompilation); ``None``
            likewise.
        cached_graphs: TorchDynamo graphs currently held, each with its ONNX Runtime sessions.
        forward_runs: ONNX Runtime runs of forward and inference graphs.
        backward_runs: ONNX Runtime runs of backward graphs.
        block_graphs: block graphs built: one per distinct repeated block (and input signature) and pass
            (forward, backward, inference), each exported and loaded into ONNX Runtime once.
        block_reuses: block instances served by a block graph built for another instance.

    Example:
        >>> ModuleStatistics(capture_seconds=1.0, export_seconds=2.0).build_seconds
        3.0
    """

    cache_hits: int | None = 0
    cache_misses: int | None = 0
    cached_graphs: int = 0
    forward_runs: int = 0
    backward_runs: int = 0
    block_graphs: int = 0
    block_reuses: int = 0

    @property
    def onnx_runtime_share(self) -> float | None:
        """The share of the built graphs' ops that ONNX Runtime runs (``None`` before any graph).

        Counts the ops of the graphs TorchDynamo captured: code between graphs (graph breaks) is not an op of any
        graph, and ``graph_breaks`` counts it instead.

        Example:
            >>> ModuleStatistics(graph_ops=90, fallback_ops=9, eager_ops=10).onnx_runtime_share
            0.81
        """
        total = self.graph_ops + self.eager_ops
        return (self.graph_ops - self.fallback_ops) / total if total else None

    @property
    def build_seconds(self) -> float:
        """A graph's first-call cost, without TorchDynamo's own tracing: ``capture_seconds + export_seconds``."""
        return self.capture_seconds + self.export_seconds


class ORTBackend:
    """A TorchDynamo backend that runs each graph's forward and backward in ONNX Runtime.

    Args:
        options: how graphs become ONNX Runtime sessions.
        owner: the model's name, for messages and logs.

    Example:
        >>> backend = ORTBackend()
        >>> model = torch.compile(torch.nn.Linear(4, 2), backend=backend)
        >>> model(torch.randn(3, 4)).sum().backward()
        >>> stats = backend.statistics()
        >>> stats.graphs, stats.forward_runs, stats.backward_runs
        (1, 1, 1)
    """

    def __init__(self, options: BuildOptions | None = None, owner: str = "the model") -> None:
        self._options = options if options is not None else BuildOptions()
        self._owner = owner
        self._warned: set[str] = set()
        self._break_sites: set[tuple[tuple[str, int, int | None], ...]] = set()
        self._build_log = BuildLog()
        self._graphs: list[CapturedGraph] = []
        self._blocks = BlockGraphs()
        self._names = GraphNames()
        self._retired_runs = (0, 0)

    @property
    def options(self) -> BuildOptions:
        return self._options

    @property
    def warned(self) -> set[str]:
        """The fallback warnings already issued for this backend's model (each is issued once)."""
        return self._warned

    @property
    def break_sites(self) -> set[tuple[tuple[str, int, int | None], ...]]:
        """The places this backend's model broke at so far: (file, line, column) of each frame of the stack."""
        return self._break_sites

    @property
    def build_log(self) -> BuildLog:
        """Build time and counts so far (the ORTModule adds graph breaks and recompile-limit hits)."""
        return self._build_log

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        index = len(self._graphs)
        reason = recompile_reason()
        log.info(
            "capturing graph %d of %s (%d ops)%s",
            index,
            self._owner,
            sum(1 for node in gm.graph.nodes if node.op in ("call_function", "call_method", "call_module")),
            f"; TorchDynamo recompiles because {reason}" if reason else "",
        )
        tag = str(index) if index else ""
        graph = CapturedGraph(
            gm, example_inputs, self._owner, tag, self._options, self._build_log, self._blocks, self._names
        )
        compiled = graph.compile()
        self._graphs.append(graph)
        self._build_log.add(graphs=1)
        return compiled

    def runners(self) -> Iterator[tuple[str, GraphRunner]]:
        """``(kind, runner)`` for every built graph; kind is ``"forward"``, ``"backward"`` or ``"inference"``."""
        for graph in self._graphs:
            yield from graph.runners
        yield from self._blocks.runners()

    def retire_block_graphs(self) -> None:
        """Build new block graphs for the graphs captured from now on (see :meth:`BlockGraphs.retire`)."""
        self._blocks.retire()

    def reset(self) -> None:
        """Forget the graphs built so far (their run counts stay in the statistics).

        ``torch._dynamo.reset()`` calls this for a backend passed to ``torch.compile``, and
        :meth:`~lightning_ort.ORTModule.clear_cache` for its model's."""
        self._retired_runs = self._run_counts()
        self._graphs.clear()
        self._blocks.reset()
        self._names = GraphNames()

    def statistics(self, calls: tuple[int, int] | None = None) -> ModuleStatistics:
        """The statistics so far.

        Args:
            calls: ``(cache_hits, cache_misses)``, from a caller that sees the calls and TorchDynamo's events
                (:class:`~lightning_ort.ORTModule`). Without it, the counts only a caller can know
                (``cache_hits``, ``cache_misses``, ``graph_breaks``, ``recompile_limit_hits``) are ``None``.
        """
        forward, backward = self._run_counts()
        counts = dataclasses.asdict(self._build_log.counts)
        if calls is None:
            counts.update(graph_breaks=None, recompile_limit_hits=None)
        return ModuleStatistics(
            cache_hits=calls[0] if calls is not None else None,
            cache_misses=calls[1] if calls is not None else None,
            cached_graphs=len(self._graphs),
            block_graphs=self._blocks.built,
            block_reuses=self._blocks.reused,
            forward_runs=forward,
            backward_runs=backward,
            **counts,
        )

    def _run_counts(self) -> tuple[int, int]:
        forward, backward = self._retired_runs
        for kind, runner in self.runners():
            if kind == "backward":
                backward += runner.runs
            else:
                forward += runner.runs
        return forward, backward


class EntryPoint:
    """``torch.compile(model, backend="ort", options={...})``: run the compiled graphs in ONNX Runtime.

    ``options`` takes the names of :class:`~lightning_ort.DebugOptions` and
    :class:`~lightning_ort.SessionSettings` fields, plus ``fallback`` and ``cache_dir`` as
    :class:`~lightning_ort.ORTModule` takes them. Graphs compiled with the same ``options`` share one
    :class:`ORTBackend` (their statistics add up); ``torch._dynamo.reset()`` releases them all, with their ONNX
    Runtime sessions.

    Example:
        >>> model = torch.compile(torch.nn.Linear(4, 2), backend="ort", options={"fallback": "raise"})
        >>> model(torch.randn(3, 4)).shape
        torch.Size([3, 2])
    """

    def __init__(self) -> None:
        self._backends: dict[str, ORTBackend] = {}
        self._lock = threading.Lock()

    def __call__(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: Mapping[str, Any] | None = None
    ) -> Callable[..., Any]:
        options = dict(options or {})
        key = repr(sorted(options.items()))
        with self._lock:
            backend = self._backends.get(key)
            if backend is None:
                backend = self._backends[key] = ORTBackend(backend_options(options))
        return backend(gm, example_inputs)

    def backends(self) -> list[ORTBackend]:
        """The backends of the ``options`` compiled with since the last reset."""
        with self._lock:
            return list(self._backends.values())

    def reset(self) -> None:
        """Release every backend's graphs and sessions (``torch._dynamo.reset()`` calls this)."""
        with self._lock:
            for backend in self._backends.values():
                backend.reset()
            self._backends.clear()


ort = EntryPoint()
"""The ``torch_dynamo_backends`` entry point ``"ort"``."""


def backend_options(options: Mapping[str, Any]) -> BuildOptions:
    """:class:`~lightning_ort.engine.capture.build.BuildOptions` from ``torch.compile``'s ``options`` mapping.

    Example:
        >>> backend_options({"save_onnx": False, "intra_op_num_threads": 2}).settings.intra_op_num_threads
        2
    """
    debug_fields = {f.name for f in dataclasses.fields(DebugOptions)}
    settings_fields = {f.name for f in dataclasses.fields(SessionSettings)}
    build_fields = {"fallback", "cache_dir", "attention", "conv_weight_grad"}
    unknown = set(options) - debug_fields - settings_fields - build_fields
    if unknown:
        raise ValueError(
            f"torch.compile(backend='ort', options=...): unknown option(s) {sorted(unknown)}; the options are "
            f"{sorted(debug_fields | settings_fields | build_fields)}."
        )
    cache_dir = options.get("cache_dir")
    return BuildOptions(
        SessionSettings(**{k: v for k, v in options.items() if k in settings_fields}),
        DebugOptions(**{k: v for k, v in options.items() if k in debug_fields}),
        parse_fallback(options.get("fallback", "auto")),
        DiskCache(cache_dir) if cache_dir is not None else None,
        parse_attention(options.get("attention", "auto")),
        parse_conv_weight_grad(options.get("conv_weight_grad", "auto")),
    )


def tracing_settings() -> contextlib.ExitStack[bool | None]:
    """TorchDynamo settings for ORTModule's calls, set for each call only and restored after it.

    TorchDynamo's configuration is process-wide, so these never outlive the call:

    * ``allow_rnn``: trace ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN``, which otherwise break the graph and run in
      PyTorch; traced, they run in ONNX Runtime like any other op. Not on torch releases that trace them wrongly
      (:data:`~lightning_ort.engine.torch_internals.TRACES_RECURRENT_LAYERS`).
    * ``ignore_logging_functions`` gains ``logging.Logger.warning_once``, the one-time advice that Hugging Face
      ``transformers`` adds to every logger (for instance about ``loss_type`` in each causal LM's loss): a
      logger call breaks the graph, and TorchDynamo then traces the layers before it twice. Skipped while
      tracing, such a warning prints when the code runs outside a graph. Where TorchDynamo's compilation
      metrics cannot record that setting (torch 2.11), its error log about it is dropped during the call.
    """
    changes: dict[str, Any] = {}
    if TRACES_RECURRENT_LAYERS:
        changes["allow_rnn"] = True
    warning_once = getattr(logging.Logger, "warning_once", None)
    settings = contextlib.ExitStack()
    if warning_once is not None:
        changes["ignore_logging_functions"] = {*dynamo_config.ignore_logging_functions, warning_once}
        if not CONFIG_LOGGING_ACCEPTS_FUNCTIONS:
            settings.enter_context(_CONFIG_LOGGING_FAILURES.scope())
    if changes:
        settings.enter_context(dynamo_config.patch(**changes))
    return settings


_FAST_PATH_MODULES = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder)


class _FastPathSwitch:
    """``torch.backends.mha``'s fast-path switch, held off while TorchDynamo compiles a call of ours that could
    take the fast path.

    TorchDynamo reads the switch while it traces: a graph traced with it on holds the fast path's fused op, which
    has no ONNX translation, or breaks at its nested tensors. TorchDynamo reports when compilations start in the
    process (the first of concurrent ones) and when they end (the last). While one of our calls that could take
    the fast path runs, the switch is held off from the start of compilations to their end; calls that run
    compiled graphs leave it alone, since the guard TorchDynamo puts on it is dropped (:func:`keep_guards`). A
    call that begins while a compilation is already under way, whose start was reported before the call, holds
    the switch off for its whole length instead, as every such call does where the guard cannot be dropped
    (:data:`~lightning_ort.engine.torch_internals.GUARDS_FILTER_SAFELY`). The compilation events are listened to
    only while such a call runs, and the last one to return restores the switch.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls = 0
        self._held = False
        self._found = True

    @contextlib.contextmanager
    def calling(self) -> Iterator[None]:
        """Around one call that could take the fast path."""
        with self._lock:
            self._calls += 1
            if self._calls == 1:
                COMPILATION_EVENTS.register_start_callback(self._compiling)
                COMPILATION_EVENTS.register_end_callback(self._compiled)
            if compilations_in_flight() or not GUARDS_FILTER_SAFELY:
                self._hold()
        try:
            yield
        finally:
            with self._lock:
                self._calls -= 1
                if self._calls == 0:
                    COMPILATION_EVENTS.remove_start_callback(self._compiling)
                    COMPILATION_EVENTS.remove_end_callback(self._compiled)
                    self._release()

    def _compiling(self, _: Any) -> None:
        with self._lock:
            if self._calls:
                self._hold()

    def _compiled(self, _: Any) -> None:
        with self._lock:
            self._release()

    def _hold(self) -> None:
        if not self._held:
            self._found = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)
            self._held = True

    def _release(self) -> None:
        if self._held:
            torch.backends.mha.set_fastpath_enabled(self._found)
            self._held = False


_FAST_PATH = _FastPathSwitch()


def keep_guards(entries: Sequence[Any]) -> list[bool]:
    """``torch.compile``'s ``guard_filter_fn`` for ORTModule: every guard but the one on the attention fast-path
    switch, which :func:`fast_path_off` holds off while TorchDynamo traces, whatever it is when graphs run."""
    return [not is_fast_path_guard(entry) for entry in entries]


def fast_path_modules(module: nn.Module) -> tuple[nn.Module, ...]:
    """The submodules of ``module`` that can take PyTorch's attention inference fast path (see
    :func:`fast_path_off`); found once, when a model is wrapped, not on every call.

    Example:
        >>> encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 1)
        >>> [type(m).__name__ for m in fast_path_modules(encoder)]
        ['TransformerEncoder', 'TransformerEncoderLayer', 'MultiheadAttention']
    """
    return tuple(child for child in module.modules() if isinstance(child, _FAST_PATH_MODULES))


def fast_path_off(modules: Sequence[nn.Module]) -> contextlib.AbstractContextManager[None]:
    """Keep PyTorch's attention inference fast path out of the graphs a call compiles, for a call that could take
    it in one of ``modules``.

    ``nn.MultiheadAttention`` and ``nn.TransformerEncoder(Layer)`` in eval mode or without autograd run one
    fused op, over nested tensors for padded batches, that neither TorchDynamo nor ONNX translate. The switch
    (``torch.backends.mha.set_fastpath_enabled``) is process-wide, so it is off only while TorchDynamo compiles
    during such a call (see :class:`_FastPathSwitch`): a call that runs graphs compiled before, and a training
    call with autograd (which cannot take the fast path), leave it alone.

    Example:
        >>> encoder = fast_path_modules(nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), 1))
        >>> with torch.no_grad(), fast_path_off(encoder):
        ...     torch.backends.mha.get_fastpath_enabled()  # nothing is compiling
        True
    """
    grad = torch.is_grad_enabled()
    if any(not (grad and module.training) for module in modules):
        return _FAST_PATH.calling()
    return contextlib.nullcontext()


class DynamoEvents:
    """One call through TorchDynamo: its graph breaks and recompile-limit hits become warnings and statistics.

    TorchDynamo records graph breaks (with the user stack that led to each) and reports recompile-limit hits in
    its log, not to the backend; this context manager reads both around a call that compiled anything. Under
    ``fallback="raise"`` the model is compiled with ``fullgraph=True`` and TorchDynamo's refusal becomes a
    :class:`CaptureError` naming the file and line. An error raised in the backend reaches the caller as itself,
    not wrapped by TorchDynamo.

    A graph break is counted once per place in the code (file, line and column of each frame of its stack,
    lightning_ort's own frames left out), as ``torch._dynamo.explain`` counts it: a compiled entry point that
    calls the model (``ORTModule``'s) breaks at that call when the forward breaks, and TorchDynamo records the
    same break again when it compiles the forward on its own. Each warning is issued once per model, and
    TorchDynamo's own log lines about graph breaks are folded into it while the call runs, unless ``TORCH_LOGS``
    asks for ``graph_breaks``.

    Args:
        backend: the model's backend: its build log counts graph breaks and recompile-limit hits, and it keeps
            the warnings issued and the places that broke.
        owner: the model's name, for messages.
        fallback: the model's fallback policy.

    Example:
        >>> backend = ORTBackend()
        >>> model = torch.compile(torch.nn.Linear(4, 2), backend=backend)
        >>> with DynamoEvents(backend, "Linear", "auto") as events:
        ...     _ = model(torch.randn(3, 4))
        >>> events.compiled
        True
    """

    def __init__(self, backend: ORTBackend, owner: str, fallback: Fallback) -> None:
        self._backend = backend
        self._build_log = backend.build_log
        self._owner = owner
        self._fallback = fallback
        self._frames = 0
        self._breaks: dict[str, int] = {}
        self._recorded = 0
        self._scopes = contextlib.ExitStack()
        self.compiled = False

    def __enter__(self) -> DynamoEvents:
        self._frames = counters["frames"]["total"]
        self._breaks = dict(counters["graph_break"])
        self._recorded = len(graph_break_reasons() or ())
        _limit_hits().clear()
        self._scopes = contextlib.ExitStack()
        self._scopes.enter_context(_LIMIT_LOGS.scope())
        self._scopes.enter_context(_BREAK_LOGS.scope())
        PENDING_WARNINGS.collecting = True
        PENDING_WARNINGS.messages.clear()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _: Any) -> None:
        self._scopes.close()
        PENDING_WARNINGS.collecting = False
        self.compiled = counters["frames"]["total"] != self._frames
        if isinstance(error, BackendCompilerFailed):
            raise error.inner_exception from None
        if isinstance(error, (Unsupported, UserError)) and self._fallback == "raise":
            reason = first_line(getattr(error, "msg", error))
            stack = list(getattr(error, "real_stack", None) or [])
            raise CaptureError(
                f"{self._owner}: TorchDynamo cannot capture its forward as one graph at {user_frame(error)}: "
                f"{reason}. {break_advice(reason, stack)} Or pass fallback='auto' to run that code in PyTorch "
                "between ONNX Runtime graphs."
            ) from error
        if not self.compiled:
            return
        for message in PENDING_WARNINGS.messages:
            self._warn(message)
        PENDING_WARNINGS.messages.clear()
        for reason, stack in self._new_breaks():
            self._build_log.add(graph_breaks=1)
            if in_fsdp_hooks(stack):  # FSDP's hooks around a sharded block: its design, not a fallback
                log.info("%s: TorchDynamo split the forward at FSDP's hooks (%s)", self._owner, frame_line(stack[-1]))
                continue
            rest = (
                "the graphs on both sides run in ONNX Runtime"
                if self._build_log.counts.graphs
                else "TorchDynamo captured no graph, so nothing of it runs in ONNX Runtime"
            )
            where = f", at {frame_line(stack[-1])}" if stack else ""
            self._warn(
                f"lightning_ort: TorchDynamo split the forward of {self._owner} at a graph break: "
                f"{first_line(reason)}{where}. That code runs in PyTorch; {rest}. {break_advice(reason, stack)} "
                "Pass fallback='raise' to make this an error.",
                GraphBreakWarning,
            )
        for limit, value, function, reason in _limit_hits():
            self._build_log.add(recompile_limit_hits=1)
            self._warn(
                f"lightning_ort: {self._owner}'s {function} runs in PyTorch from now on: TorchDynamo hit "
                f"torch._dynamo.config.{limit} ({value}) recompiling it, last because {reason}. A value that "
                "changes every step (a Python float or int argument, a shape with dynamic=False) causes this: pass "
                "it as a tensor, construct the module with dynamic=True, or raise the limit.",
                RecompileLimitWarning,
            )
        _limit_hits().clear()

    def _new_breaks(self) -> list[tuple[str, list[traceback.FrameSummary]]]:
        """The graph breaks of this call at places the model had not broken before: reason and user stack."""
        recorded = graph_break_reasons()
        if recorded is None:  # a torch without the record: each new count of a reason, without its place
            return [
                (reason, [])
                for reason, count in counters["graph_break"].items()
                for _ in range(count - self._breaks.get(reason, 0))
            ]
        found = []
        for entry in recorded[self._recorded if len(recorded) >= self._recorded else 0 :]:
            stack = [frame for frame in entry.user_stack if not frame.filename.startswith(_PACKAGE_FOLDER)]
            site = tuple((frame.filename, frame.lineno, getattr(frame, "colno", None)) for frame in stack)
            if site in self._backend.break_sites:
                continue
            self._backend.break_sites.add(site)
            found.append((str(entry.reason), stack))
        return found

    def _warn(self, message: str, category: type[FallbackWarning] = FallbackWarning) -> None:
        """Issue ``message`` as a ``category`` warning unless this model already had it."""
        if message not in self._backend.warned:
            self._backend.warned.add(message)
            warn(message, category)


_PACKAGE_FOLDER = str(package_folder(__name__.split(".")[0]))
"""lightning_ort's own folder: its frames (ORTModule's entry point) are not the model's code."""


_LIBRARY_REMEDIES = {
    "_detect_is_causal_mask": (
        "nn.Transformer compares the mask it is given with a causal mask it builds, to find out whether the mask "
        "is causal: pass is_causal=True (src_is_causal, tgt_is_causal, memory_is_causal) together with a causal "
        "mask, and it does not compare."
    ),
}
"""What a user can do about a graph break inside torch's or a library's own code, by the function it is in."""


def break_advice(reason: str, stack: Sequence[traceback.FrameSummary] = ()) -> str:
    """What to do about a graph break, by its cause as TorchDynamo words it and by where it happened.

    A break inside torch's or another installed library's code is not the user's to move: the advice then names
    the library function and the call in the model that reached it.

    Example:
        >>> break_advice("Attempted to wrap sparse Tensor").split(":")[0]
        'A sparse tensor reached the model'
    """
    if stack and _in_library(stack[-1].filename):
        remedy = _LIBRARY_REMEDIES.get(stack[-1].name)
        if remedy is not None:
            return remedy
        caller = next((frame for frame in reversed(stack) if not _in_library(frame.filename)), stack[0])
        return (
            f"The break is inside library code ({stack[-1].name} at {frame_line(stack[-1])}), reached from "
            f"{frame_line(caller)}: what is passed there decides what that code does (look for an argument or a "
            "setting of that library that avoids the break); otherwise that code runs correctly in PyTorch."
        )
    lowered = reason.lower()
    if "sparse" in lowered:
        return (
            "A sparse tensor reached the model: ONNX Runtime computes with dense tensors; pass `.to_dense()`, or "
            "keep the sparse op outside the wrapped module."
        )
    if any(cue in lowered for cue in ("data-dependent", "data dependent", ".item()", "jump", "dynamic shape operator")):
        return (
            "The code depends on a tensor's value: express the branch with tensor ops (torch.where, masking), or "
            "move that code outside the wrapped module."
        )
    if any(cue in lowered for cue in ("unsupported", "not supported", "attempted to call", "cannot")):
        return "TorchDynamo cannot trace that call or argument type: move that code outside the wrapped module."
    return "Move that code outside the wrapped module if it should not run in PyTorch."


def _in_library(filename: str) -> bool:
    """Whether ``filename`` is torch's or an installed package's code, not the user's."""
    return filename.startswith(str(package_folder("torch"))) or any(
        part in filename for part in ("site-packages", "dist-packages")
    )


_HITS = threading.local()
"""This thread's recompile-limit hits during the call :class:`DynamoEvents` watches: limit, value, function,
reason."""


def _limit_hits() -> list[tuple[str, str, str, str]]:
    if not hasattr(_HITS, "hits"):
        _HITS.hits = []
    hits: list[tuple[str, str, str, str]] = _HITS.hits
    return hits


def _record_limit_hit(record: logging.LogRecord) -> bool:
    hit = recompile_limit_hit(record)
    if hit is not None:
        _limit_hits().append(hit)
    return True


_LIMIT_LOGS = ScopedFilter((RECOMPILE_LOGGER,), keep=_record_limit_hit)
"""Records TorchDynamo's "hit config.recompile_limit" warnings during our calls."""

_CONFIG_LOGGING_FAILURES = ScopedFilter((METRICS_LOGGER,), keep=lambda record: not is_config_logging_failure(record))
"""Drops TorchDynamo's error log about a configuration its compilation metrics cannot record (torch 2.11)."""

_BREAK_LOGS = ScopedFilter(
    GRAPH_BREAK_LOGGERS,
    keep=lambda record: "graph_breaks" in os.environ.get("TORCH_LOGS", "") or not is_graph_break_log(record),
)
"""Drops TorchDynamo's own log lines about graph breaks during our calls: the warning says the same once.
``TORCH_LOGS=graph_breaks`` keeps them."""
