"""Capture a module's computation as forward/backward (or inference) FX graphs with AOTAutograd.

:class:`CapturedGraphs` wraps ``module`` as a pure function of ``(parameters, buffers, input tensors)``
and hands it to :func:`torch._functorch.aot_autograd.aot_function`: AOTAutograd traces it once with fake
tensors, decomposes it to core ATen, rewrites the joint graph (:mod:`lightning_ort.engine.rewrites`),
partitions it with ``min_cut_rematerialization_partition`` and calls :meth:`CapturedGraphs._compile` for
each graph. Each graph becomes an ONNX model run by a :class:`~lightning_ort.engine.session.GraphSession`.
AOTAutograd's runtime wrapper then bridges the two sessions to PyTorch autograd (``param.grad`` is filled
as in eager) and writes buffer updates back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
import unittest.mock
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch._functorch import config as functorch_config
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx import traceback as fx_traceback
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_ort.engine.decompositions import attention, capture_decompositions, dropout, multihead_attention
from lightning_ort.engine.disk_cache import DiskCache
from lightning_ort.engine.dynamic import DynamicDims, ShapeGuards, symbolic_inputs
from lightning_ort.engine.export import ExportedGraph, ExportError, export_graph, first_line
from lightning_ort.engine.partition import (
    PartitionCall,
    PartitionedGraph,
    describe_ops,
    split_graph,
    unsupported_nodes,
)
from lightning_ort.engine.rewrites import move_saved_permutes, optimize_joint_graph
from lightning_ort.engine.session import GraphSession, SessionError, provider_names
from lightning_ort.engine.signature import FlatInputs, FlatOutputs
from lightning_ort.options import DebugOptions, Fallback, SessionSettings

if TYPE_CHECKING:
    from torch._functorch._aot_autograd.schemas import AOTDispatchCompiler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildOptions:
    """How :class:`CapturedGraphs` turns captured graphs into ONNX Runtime sessions.

    Args:
        settings: ONNX Runtime session settings.
        debug: debug options.
        fallback: ``"auto"`` runs ops ONNX cannot express in PyTorch (and a whole call in PyTorch when its
            control flow depends on tensor values), warning once; ``"raise"`` makes both an error.
        disk_cache: where exported graphs are saved and looked up, or ``None``.
    """

    settings: SessionSettings = field(default_factory=SessionSettings)
    debug: DebugOptions = field(default_factory=DebugOptions)
    fallback: Fallback = "auto"
    disk_cache: DiskCache | None = None


@dataclass
class BuildLog:
    """What building graphs cost and how it went, accumulated by :class:`CapturedGraphs` of one ORTModule.

    Example:
        >>> BuildLog().onnx_exports
        0
    """

    capture_seconds: float = 0.0
    export_seconds: float = 0.0
    onnx_exports: int = 0
    disk_cache_loads: int = 0
    fallback_ops: int = 0
    eager_signatures: int = 0


GraphRunner = GraphSession | PartitionedGraph


class CapturedGraphs:
    """The graphs of one call signature of ``module``: built on first call, then reused.

    Args:
        module: the wrapped module.
        state_names: names of the parameters and buffers passed as graph inputs (in that order).
        inputs: the flattened call this signature was made from.
        device: where the graph runs.
        tag: distinguishes this signature's saved files (``"forward"``, ``"forward_1"``...).
        options: how graphs become sessions.
        build_log: where build time and counts are added up.
        dynamic_dims: input dimensions to capture as symbols (see :mod:`lightning_ort.engine.dynamic`); the
            graphs then serve every size :meth:`accepts` allows.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        state_names: Sequence[str],
        inputs: FlatInputs,
        device: torch.device,
        tag: str,
        options: BuildOptions,
        build_log: BuildLog,
        dynamic_dims: DynamicDims = frozenset(),
    ) -> None:
        self._module = module
        self._state_names = list(state_names)
        self._inputs = inputs
        self._device = device
        self._tag = tag
        self._options = options
        self._log = build_log
        self._rebuild_output: Callable[[Sequence[torch.Tensor]], Any] | None = None
        self._runs_eagerly = False
        self._compile_seconds = 0.0
        self._dynamic_dims = dynamic_dims
        self._guards: ShapeGuards | None = None
        self._backward_failure: ExportError | SessionError | None = None
        self.runners: list[tuple[str, GraphRunner]] = []
        self._function = aot_function(
            self._functional_forward,
            fw_compiler=self._compiler("forward"),
            bw_compiler=self._compiler("backward"),
            inference_compiler=self._compiler("inference"),
            partition_fn=_partition,
            decompositions=capture_decompositions(device.type),
            num_params_buffers=len(self._state_names),
            dynamic=bool(dynamic_dims),
        )

    @property
    def symbolic_dims(self) -> DynamicDims:
        """Input dimensions these graphs take at any size (empty: the graphs are for one shape)."""
        return self._guards.symbolic_dims if self._guards is not None else frozenset()

    def accepts(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether these (symbolic-shape) graphs can run ``tensors``: only meaningful after the first call."""
        return self._guards is not None and self._guards.accepts(tensors)

    def __call__(self, state: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> Any:
        """Run the graphs on the current ``state`` (parameters, buffers) and input ``tensors``."""
        if self._runs_eagerly:
            return self._run_eager(tensors)
        if self._dynamic_dims:
            # Contiguous inputs have strides that are functions of their sizes; a non-contiguous one would add
            # stride symbols (and guards on them) that tell nothing about the computation.
            tensors = [t.contiguous() for t in tensors]
        if self._rebuild_output is None:
            start, compiled_before = time.perf_counter(), self._compile_seconds
            try:
                with _capture_context(self._module), contextlib.ExitStack() as symbolic:
                    if self._dynamic_dims:
                        shape_env = symbolic.enter_context(
                            symbolic_inputs([*state, *tensors], self._dynamic_dims, len(state))
                        )
                    flat = self._function(*state, *tensors)
                if self._backward_failure is not None:
                    # AOTAutograd builds a dynamic-shape backward during the forward but defers its failure to
                    # the first backward; report it now, while the caller can still build differently.
                    raise self._backward_failure
                if self._dynamic_dims:
                    shapes = tuple(tuple(t.shape) for t in tensors)
                    self._guards = ShapeGuards(shape_env, shapes, self._dynamic_dims)
            except _DATA_DEPENDENT_ERRORS as err:
                self._log.capture_seconds += time.perf_counter() - start
                return self._fall_back_to_eager(err, tensors)
            except (ExportError, SessionError) as err:
                # Failures that name ops were already narrowed to per-op fallback; what reaches here names none
                # (or the same ops failed again), so a static signature can only run whole in PyTorch. A symbolic
                # one raises: ORTModule then tries one graph per shape (dynamic=None) or reports it (dynamic=True).
                if self._options.fallback == "raise" or self._dynamic_dims:
                    raise
                self._log.capture_seconds += time.perf_counter() - start
                return self._run_eagerly_from_now(
                    f"ONNX Runtime could not build its graphs ({first_line(err)}). Run with "
                    "DebugOptions(save_onnx=True, log_level=LogLevel.VERBOSE) to see why",
                    tensors,
                )
            self._log.capture_seconds += time.perf_counter() - start - (self._compile_seconds - compiled_before)
        else:
            flat = self._function(*state, *tensors)
        assert self._rebuild_output is not None
        return self._rebuild_output(flat)

    def _functional_forward(self, *flat: torch.Tensor) -> list[torch.Tensor]:
        count = len(self._state_names)
        state = dict(zip(self._state_names, flat[:count]))
        args, kwargs = self._inputs.rebuild(flat[count:])
        output = torch.func.functional_call(self._module, state, args, kwargs)
        flat_output = FlatOutputs.from_output(output)
        self._rebuild_output = flat_output.rebuild
        return flat_output.tensors

    def _run_eager(self, tensors: Sequence[torch.Tensor]) -> Any:
        args, kwargs = self._inputs.rebuild(tensors)
        return self._module(*args, **kwargs)

    def _fall_back_to_eager(self, err: Exception, tensors: Sequence[torch.Tensor]) -> Any:
        owner = type(self._module).__name__
        where = _user_frame(err)
        if self._options.fallback == "raise":
            raise CaptureError(
                f"{owner}: its forward reads tensor values at {where} ({type(err).__name__}), so one graph cannot "
                "represent it. Express the branch with tensor ops (torch.where, masking), move it outside the "
                "wrapped module, or pass fallback='auto' to run such calls in PyTorch."
            ) from err
        return self._run_eagerly_from_now(
            f"its forward reads tensor values at {where} (a data-dependent branch or .item()), which one ONNX "
            "graph cannot represent",
            tensors,
        )

    def _run_eagerly_from_now(self, reason: str, tensors: Sequence[torch.Tensor]) -> Any:
        """Run this signature in PyTorch from now on, with a warning that says ``reason``."""
        self._runs_eagerly = True
        self._log.eager_signatures += 1
        warnings.warn(
            f"lightning_ort: {type(self._module).__name__} runs in PyTorch for this input signature: {reason}. "
            "Pass fallback='raise' to make this an error.",
            FallbackWarning,
            stacklevel=5,
        )
        return self._run_eager(tensors)

    def _compiler(self, kind: str) -> AOTDispatchCompiler:
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> GraphRunner:
            name = kind if not self._tag else f"{kind}_{self._tag}"
            start = time.perf_counter()
            owner = type(self._module).__name__
            with torch.random.fork_rng(devices=_rng_devices(self._device)):
                try:
                    runner = self._build(gm, example_inputs, name)
                except (ExportError, SessionError) as err:
                    failure = type(err)(f"{owner}: {err}", err.nodes)
                    if kind == "backward":
                        self._backward_failure = failure
                    raise failure from err
            seconds = time.perf_counter() - start
            log.info("built %s graph of %s in %.2fs (providers %s)", name, owner, seconds, runner.providers)
            self.runners.append((kind, runner))
            self._compile_seconds += seconds
            self._log.export_seconds += seconds
            return runner

        return compile_graph

    def _build(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], name: str) -> GraphRunner:
        key, graph = self._cached(gm, example_inputs, name)
        if graph is not None:
            return self._open(graph)
        unsupported = unsupported_nodes(gm, self._device)
        if not unsupported:
            try:
                return self._open(self._export(gm, example_inputs, name, key))
            except (ExportError, SessionError) as err:
                if self._options.fallback == "raise" or not err.nodes:
                    raise
                unsupported = dict.fromkeys(err.nodes, _failure_reason(err))
        elif self._options.fallback == "raise":
            raise ExportError(
                f"the {name} graph has ops ONNX Runtime cannot run: {describe_ops(gm, unsupported)}.\n"
                "Rewrite that part of the model with supported ops or dtypes, keep that submodule outside "
                "ORTModule, or pass fallback='auto' to run just those ops in PyTorch.",
                list(unsupported),
            )
        return self._split(gm, unsupported, name)

    def _split(self, gm: torch.fx.GraphModule, unsupported: dict[str, str], name: str) -> PartitionedGraph:
        """Run ``unsupported`` nodes in PyTorch and the rest in ONNX Runtime partitions.

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
                if not err.nodes or set(err.nodes) <= unsupported.keys():
                    raise
                unsupported = {**unsupported, **dict.fromkeys(err.nodes, _failure_reason(err))}
                continue
            self._log.fallback_ops += len(unsupported)
            warnings.warn(
                f"lightning_ort: {type(self._module).__name__}'s {name} graph runs {len(unsupported)} op(s) in "
                f"PyTorch: {describe_ops(gm, unsupported)}. The rest runs in ONNX Runtime ({len(sessions)} "
                "partition(s)). Pass fallback='raise' to make this an error.",
                FallbackWarning,
                stacklevel=2,
            )
            return PartitionedGraph(split, name, sessions, len(unsupported))

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
        key = disk.key(gm, example_inputs, self._device, provider_names(self._device, self._options.settings))
        graph = disk.load(key, name)
        if graph is not None:
            self._log.disk_cache_loads += 1
        return key, graph

    def _export(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], name: str, key: str | None
    ) -> ExportedGraph:
        """Export ``gm``; save it in the disk cache under ``key`` when there is one."""
        verbose = self._options.debug.log_level.ort_severity == 0
        graph = export_graph(gm, example_inputs, name, verbose, saved_from=gm.meta.get(_SAVED_FROM))
        self._log.onnx_exports += 1
        if key is not None and self._options.disk_cache is not None:
            self._options.disk_cache.store(key, graph)
        return graph

    def _open(self, graph: ExportedGraph) -> GraphSession:
        return GraphSession(graph, self._device, self._options.settings, self._options.debug)


class CaptureError(RuntimeError):
    """The wrapped module could not be captured as one graph and ``fallback="raise"`` was asked for."""


class FallbackWarning(UserWarning):
    """Part of a model (some ops, or a whole call) runs in PyTorch instead of ONNX Runtime."""


_DATA_DEPENDENT_ERRORS = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    GuardOnDataDependentSymNode,
)


def _partition(
    joint: torch.fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    # No common-subexpression pass here: the ONNX translation (onnxscript's optimizer) and ONNX Runtime remove
    # duplicates themselves (the three benchmark workloads export node for node the same graphs), and
    # functorch's pass imports torch._inductor's pattern matcher: 20-30 MiB resident and ~0.5 s of the first call.
    with functorch_config.patch(cse=False):
        forward, backward = min_cut_rematerialization_partition(optimize_joint_graph(joint), joint_inputs, **kwargs)
    saved_from = kwargs["num_fwd_outputs"]
    moved = move_saved_permutes(forward, backward, saved_from)
    log.debug("%d saved permuted views moved to the backward graph", moved)
    forward.meta[_SAVED_FROM] = saved_from
    return forward, backward


_SAVED_FROM = "lightning_ort_saved_from"
"""``GraphModule.meta`` key: index of the forward graph's first output that only the backward graph reads."""


def _failure_reason(err: ExportError | SessionError) -> str:
    if isinstance(err, SessionError):
        return "ONNX Runtime has no kernel (for these dtypes, on this provider) for"
    return "the ONNX translation failed for"


def _user_frame(err: BaseException) -> str:
    """``file:line`` of the innermost traceback frame in model code: the user's, or ``torch.nn``'s modules."""
    frames = traceback.extract_tb(err.__traceback__)
    torch_dir = os.path.dirname(torch.__file__)
    internal = (torch_dir, os.path.dirname(os.path.dirname(__file__)))
    model_code = os.path.join(torch_dir, "nn", "")
    user = [f for f in frames if f.filename.startswith(model_code) or not f.filename.startswith(internal)]
    if not user:
        return "an unknown line"
    frame = user[-1]
    return f"{frame.filename}:{frame.lineno} (`{(frame.line or '').strip()}`)"


def _rng_devices(device: torch.device) -> list[int]:
    return [device.index or 0] if device.type == "cuda" else []


@contextlib.contextmanager
def _capture_context(module: torch.nn.Module) -> Iterator[None]:
    """Settings that make tracing produce ONNX-exportable graphs.

    * ``F.scaled_dot_product_attention`` is :func:`~lightning_ort.engine.decompositions.attention`, its math
      path in plain ops (the fused kernels' backward ops have no ONNX translation), and SDPA called by other
      names takes the math path;
    * the ``nn.TransformerEncoder`` fast path (a fused inference kernel) is off;
    * ``F.dropout`` (``nn.Dropout`` too) is :func:`~lightning_ort.engine.decompositions.dropout`: a product
      with a scaled keep mask drawn by one random op, which the export lifts out;
    * batch-first ``nn.MultiheadAttention`` self-attention is computed in its own layout
      (:func:`~lightning_ort.engine.decompositions.multihead_attention`: 2 transposes instead of about 7);
    * ``nn.Transformer``'s check whether a given mask is causal (it compares mask values, which one graph
      cannot do) is skipped: the answer is only a hint, and the explicit mask gives the same result;
    * each traced node records the submodule it came from, for export error messages.
    """
    names = {id(m): (name or type(module).__name__, type(m)) for name, m in module.named_modules()}
    stack: list[tuple[str, type]] = []

    def enter(mod: torch.nn.Module, _args: Any) -> None:
        if id(mod) in names:
            stack.append(names[id(mod)])
            fx_traceback.get_current_meta()["nn_module_stack"] = {path: (path, t) for path, t in stack}

    def leave(mod: torch.nn.Module, _args: Any, _output: Any) -> None:
        if id(mod) in names and stack:
            stack.pop()
            fx_traceback.get_current_meta()["nn_module_stack"] = {path: (path, t) for path, t in stack}

    fastpath = torch.backends.mha.get_fastpath_enabled()
    with contextlib.ExitStack() as stack_ctx:
        stack_ctx.enter_context(sdpa_kernel(SDPBackend.MATH))
        stack_ctx.enter_context(fx_traceback.preserve_node_meta())
        pre = torch.nn.modules.module.register_module_forward_pre_hook(enter)
        post = torch.nn.modules.module.register_module_forward_hook(leave)
        stack_ctx.callback(pre.remove)
        stack_ctx.callback(post.remove)
        torch.backends.mha.set_fastpath_enabled(False)
        stack_ctx.callback(torch.backends.mha.set_fastpath_enabled, fastpath)
        stack_ctx.enter_context(
            unittest.mock.patch.object(torch.nn.modules.transformer, "_detect_is_causal_mask", _declared_causal)
        )
        stack_ctx.enter_context(
            unittest.mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", attention)
        )
        stack_ctx.enter_context(unittest.mock.patch.object(torch.nn.MultiheadAttention, "forward", multihead_attention))
        stack_ctx.enter_context(unittest.mock.patch.object(torch.nn.functional, "dropout", dropout))
        yield


def _declared_causal(mask: torch.Tensor | None, is_causal: bool | None = None, size: int | None = None) -> bool:
    """``nn.Transformer``'s causal-mask hint without inspecting mask values: causal only when declared so."""
    return bool(is_causal)
