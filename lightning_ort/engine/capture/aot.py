"""Capture: one TorchDynamo graph becomes forward and backward (or inference) graphs run by ONNX Runtime.

TorchDynamo hands each graph it traces (a ``torch``-level FX graph and fake example inputs, parameters
lifted as inputs) to :class:`~lightning_ort.engine.capture.backend.ORTBackend`, which builds a :class:`CapturedGraph`.
That swaps a few ``torch.nn.functional`` calls for forms that export well
(:func:`~lightning_ort.engine.fx.replacements.substitute_functions`) and activations written out in elementwise ops
for their ``torch.nn.functional`` calls (:func:`~lightning_ort.engine.fx.activations.fold_activations`), then
AOTAutograd traces the graph with fake
tensors, decomposes it to core ATen, rewrites the joint graph (:mod:`lightning_ort.engine.fx.passes`), partitions
it with ``min_cut_rematerialization_partition`` and hands each resulting graph to the function of
:meth:`CapturedGraph._graph_compiler`, which has a :class:`~lightning_ort.engine.capture.build.GraphBuilder` build it
into ONNX Runtime sessions. AOTAutograd's runtime wrapper bridges the sessions to PyTorch autograd
(``param.grad`` is filled as in eager) and writes buffer updates back; TorchDynamo's guards decide when a graph
is reused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_ort.engine.capture.blocks import BLOCK_FLOPS, BlockGraphs, has_blocks, inline_blocks, light_blocks
from lightning_ort.engine.capture.build import (
    VIEWS_FROM,
    BuildLog,
    BuildOptions,
    GraphBuilder,
    GraphRunner,
    op_count,
    warn_fallback,
)
from lightning_ort.engine.fx.activations import fold_activations
from lightning_ort.engine.fx.batch_norm import fusable_batch_norms, fuse_batch_norms
from lightning_ort.engine.fx.conv_phases import strided_convolutions
from lightning_ort.engine.fx.conv_weight_grad import kernel_weight_grads
from lightning_ort.engine.fx.decompositions import capture_decompositions
from lightning_ort.engine.fx.dynamic import is_symbolic, tensor_devices
from lightning_ort.engine.fx.gelu import gelus
from lightning_ort.engine.fx.group_norm import group_norms
from lightning_ort.engine.fx.layer_norm import layer_norms
from lightning_ort.engine.fx.layout import GRADIENT_STRIDES, GradientStrides, gradient_strides
from lightning_ort.engine.fx.max_pool import replace_max_pools, replaceable_max_pools
from lightning_ort.engine.fx.passes import move_saved_permutes, optimize_joint_graph
from lightning_ort.engine.fx.replacements import substitute_functions
from lightning_ort.engine.fx.silu import silus
from lightning_ort.engine.onnx.passes import KERNEL_NCHWC_BLOCK, nchwc_block_size
from lightning_ort.engine.runtime.cpu_kernels import kernel_library
from lightning_ort.engine.torch_internals import (
    AOT_GRAPH_COMPILE_LOG,
    aot_autograd,
    functorch_config,
    min_cut_rematerialization_partition,
    onednn_off,
    tangents_by_format,
)
from lightning_ort.errors import (
    CaptureError,
    ExportError,
    SessionError,
    first_line,
)
from lightning_ort.logs import ScopedFilter, get_logger
from lightning_ort.options import attention_on

if TYPE_CHECKING:
    from lightning_ort.engine.torch_internals import AOTDispatchCompiler

log = get_logger(__name__)


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
        attention = attention_on(options.attention, self._device.type, options.settings.cuda_graph)
        self._options = dataclasses.replace(options, attention=attention)
        self._build_log = build_log
        self._backward_failure: ExportError | SessionError | None = None
        self._symbolic = any(is_symbolic(value) for value in example_inputs)
        self._blocks = blocks if blocks is not None else BlockGraphs()
        self._names = names if names is not None else GraphNames()
        self._builder = GraphBuilder(owner, self._device, self._options, build_log, self._blocks, self._symbolic)
        self.runners: list[tuple[str, GraphRunner]] = []

    def compile(self) -> Callable[..., Any]:
        """The function TorchDynamo calls in place of the graph: ONNX Runtime sessions behind AOTAutograd.

        A graph ONNX Runtime cannot build at all (an export failure that names no op) runs in PyTorch with a
        :class:`FallbackWarning`, or raises under ``fallback="raise"``.
        """
        start, exported_before = time.perf_counter(), self._build_log.counts.export_seconds
        if self._options.automatic_blocks:
            self._inline_light_blocks()
        attention_path = self._options.attention
        substitute_functions(self._gm, attention_path)
        fold_activations(self._gm)
        cpu_kernels = self._device.type == "cpu" and _uses_cpu_kernels(self._gm) and kernel_library() is not None
        if cpu_kernels:
            fuse_batch_norms(self._gm)
            replace_max_pools(self._gm)
        conv_weight_kernel = cpu_kernels and nchwc_block_size() == KERNEL_NCHWC_BLOCK
        backend = aot_autograd(
            fw_compiler=self._graph_compiler("forward"),
            bw_compiler=self._graph_compiler("backward"),
            inference_compiler=self._graph_compiler("inference"),
            partition_fn=_partition,
            decompositions=capture_decompositions(
                self._device.type, attention_path, self._options.conv_weight_grad, cpu_kernels, conv_weight_kernel
            ),
        )
        try:
            # SDPA that the substitutions do not reach (inside PyTorch's own multi-head attention for cross
            # attention, for instance) takes its math path: the fused kernels' backward ops have no ONNX
            # translation, and their auxiliary outputs do not survive the export. Under attention="torch" the
            # fused kernels run in PyTorch, forward and backward.
            kernels = sdpa_kernel(SDPBackend.MATH) if attention_path == "onnx" else contextlib.nullcontext()
            # PyTorch decomposes an LSTM layer whose input needs no gradient (a first layer fed data) into oneDNN's
            # inference-only RNN op where oneDNN is on: its backward needs a workspace that op does not write,
            # and ONNX has no translation for it. With oneDNN off every layer becomes gate products and
            # activations, as layers whose input needs a gradient already do.
            with kernels, onednn_off(), _OWN_FAILURES_UNLOGGED.scope(), tangents_by_format():
                compiled = self._compile_with_aot(backend)
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
            self._build_log.add(eager_signatures=1, eager_ops=op_count(self._gm))
            warn_fallback(
                f"lightning_ort: {self._owner} runs in PyTorch for one of its graphs: ONNX Runtime could not build "
                f"its graphs ({first_line(err)}). Run with DebugOptions(save_onnx=True, onnx_prefix='model', "
                "log_level=LogLevel.VERBOSE) to see why; pass fallback='raise' to make this an error."
            )
            if has_blocks(self._gm):  # a block call's own backward runs only inside a compiled graph
                inline_blocks(self._gm)
            return self._gm.forward
        finally:
            exported = self._build_log.counts.export_seconds - exported_before
            self._build_log.add(capture_seconds=time.perf_counter() - start - exported)
        return compiled

    def _inline_light_blocks(self) -> None:
        """Inline the blocks whose forward does less work than a block graph needs on this graph's device."""
        min_flops = BLOCK_FLOPS.get(self._device.type)
        if min_flops is None or not has_blocks(self._gm):
            return
        light = light_blocks(self._gm, min_flops)
        if not light:
            return
        inline_blocks(self._gm, light)
        log.info(
            "%s: blocks='auto' inlines the blocks of the %s graph: a block's forward counts %.2g GFLOP, under the "
            "%.3g GFLOP that pays for its graphs' own runs on %s. Name the block classes (blocks=[...]) to keep "
            "them apart.",
            self._owner,
            self._tag or "first",
            max(light.values()) / 1e9,
            min_flops / 1e9,
            self._device.type,
        )

    def _compile_with_aot(self, backend: Callable[..., Any]) -> Callable[..., Any]:
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
            self._gm, list(args), self._owner, tag, self._options, self._build_log, self._blocks, self._names
        )
        static.runners = self.runners
        self._build_log.add(graphs=1)
        return static.compile()

    def _graph_compiler(self, kind: str) -> AOTDispatchCompiler:
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> GraphRunner | GradientStrides:
            name = self._names.name(self._tag, kind)
            start = time.perf_counter()
            with torch.random.fork_rng(devices=_rng_devices(self._device)), self._build_log.timed("export_seconds"):
                try:
                    runner = self._builder.build(gm, example_inputs, name, kind)
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
            strides = gm.meta.get(GRADIENT_STRIDES)
            return GradientStrides(runner, strides) if strides else runner

        return compile_graph


def _uses_cpu_kernels(gm: torch.fx.GraphModule) -> bool:
    """Whether TorchDynamo's graph ``gm`` has calls that lightning_ort's CPU kernels compute (batch norms in
    training mode, max pooling, stride-2 convolutions' input gradients, large 3x3 layers' weight gradients, GELU's,
    SiLU's and layer norm's gradients, group norms), so that the kernels are built only for graphs that use them."""
    counts = (
        fusable_batch_norms,
        replaceable_max_pools,
        strided_convolutions,
        kernel_weight_grads,
        gelus,
        silus,
        layer_norms,
        group_norms,
    )
    return any(count(gm) for count in counts)


def _not_our_failure(record: logging.LogRecord) -> bool:
    failure = record.exc_info[1] if record.exc_info else None
    return not isinstance(failure, (ExportError, SessionError))


_OWN_FAILURES_UNLOGGED = ScopedFilter((AOT_GRAPH_COMPILE_LOG,), keep=_not_our_failure)
"""Drops AOTAutograd's records of our export or session failures during a capture (we report those ourselves).

AOTAutograd compiles a dynamic-shape graph's backward ahead of time and logs a failure, with its traceback, at
WARNING level before deferring it to the first backward; :meth:`CapturedGraph.compile` reports it instead, and
builds one graph per shape."""


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
    forward.meta[VIEWS_FROM] = saved_from
    backward.meta[VIEWS_FROM] = 0
    primals = joint_inputs[0] if len(joint_inputs) == 2 else ()
    backward.meta[GRADIENT_STRIDES] = gradient_strides(primals if isinstance(primals, (list, tuple)) else (), backward)
    return forward, backward


def _rng_devices(device: torch.device) -> list[int]:
    return [device.index or 0] if device.type == "cuda" else []


def _graph_device(example_inputs: Sequence[Any], owner: str) -> torch.device:
    devices = tensor_devices(example_inputs)
    if len(devices) > 1:
        raise CaptureError(
            f"{owner} computes with tensors on several devices {sorted(map(str, devices))} in one graph; "
            "move the module and its inputs to one device first."
        )
    return devices.pop() if devices else torch.device("cpu")
