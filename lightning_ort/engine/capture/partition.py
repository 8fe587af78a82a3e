"""Per-op fallback: split a captured graph into ONNX Runtime partitions and the ops that stay in PyTorch.

When a graph holds ops ONNX cannot express, :func:`split_graph` groups every other node into as few
connected partitions as possible (``torch.fx``'s ``CapabilityBasedPartitioner``) and fuses each into a
submodule; the caller exports each partition and swaps its submodule for an ONNX Runtime session. The
outer graph, run by :class:`PartitionedGraph`, then calls ONNX Runtime for the partitions and PyTorch for the
ops in between.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch.fx import traceback as fx_traceback
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from lightning_ort.engine.capture.blocks import BlockCall
from lightning_ort.engine.fx.replacements import DROPOUT_KEEP
from lightning_ort.engine.once import Once
from lightning_ort.engine.onnx.export import copy_graph_module, onnx_registry
from lightning_ort.engine.runtime.session import GraphSession
from lightning_ort.engine.torch_internals import (
    EXPORTER_STEPS,
    FUSED_ATTENTION,
    FakeTensor,
    HigherOrderOperator,
    OpOverload,
)
from lightning_ort.errors import node_origin

aten = torch.ops.aten
prims = torch.ops.prims


def unsupported_nodes(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Nodes of ``gm`` ONNX Runtime cannot run, by name, each with the reason.

    Ops the ONNX exporter neither translates nor decomposes; ops on complex tensors (the exporter stores them
    as real tensors with a trailing axis of 2, which ONNX Runtime's kernels and our session I/O do not
    share: results would come back misshapen). ``bfloat16`` ops on CPU are not among them: the exported graph
    computes them in float32 (:func:`~lightning_ort.engine.onnx.passes.compute_bfloat16_in_float`).
    """
    covered = _onnx_coverage()
    reasons: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, HigherOrderOperator):
            # Such as activation checkpointing's `run_and_save_rng_state`/`run_with_rng_state`, which replay a
            # dropout mask in the recomputation: PyTorch runs them with its own generator state.
            reasons[node.name] = "ONNX has no translation for"
            continue
        if node.op != "call_function" or not isinstance(node.target, OpOverload):
            continue
        dtypes = _dtypes(node)
        if covered is not None and node.target not in covered:
            reasons[node.name] = "ONNX has no translation for"
        elif ignored := _ignored_argument(node):
            reasons[node.name] = f"the ONNX translation ignores `{ignored}` of"
        elif _output_padding_past_stride(node):
            reasons[node.name] = "ONNX Runtime's ConvTranspose needs `output_padding` below `stride` for"
        elif any(dtype.is_complex for dtype in dtypes):
            reasons[node.name] = "ONNX Runtime has no complex tensors for"
    return reasons


def attention_nodes(gm: torch.fx.GraphModule) -> dict[str, str]:
    """SDPA's fused forward and backward nodes of ``gm``, by name, each with the reason it runs in PyTorch.

    Under ``attention="torch"`` these run between ONNX Runtime partitions by request: PyTorch's fused kernels
    compute attention without materializing its scores, and the backward kernel reads the softmax statistics
    its forward saved.
    """
    return {
        node.name: "attention='torch' keeps in PyTorch"
        for node in gm.graph.nodes
        if node.op == "call_function" and node.target in FUSED_ATTENTION
    }


def weight_gradient_nodes(gm: torch.fx.GraphModule) -> dict[str, str]:
    """The weight gradients of ``gm`` that its decompositions left to PyTorch's kernels, by name, each with the
    reason it runs there.

    :func:`~lightning_ort.engine.fx.decompositions.convolution_backward` leaves ``aten.convolution_backward``
    whole, asking for the weight gradient alone, where ``conv_weight_grad`` chooses PyTorch for a layer; any
    other ``convolution_backward`` (a transposed convolution's) is no request but an op ONNX cannot express.
    The casts of such a gradient to its parameter's dtype (autocast's ``bfloat16`` gradient of a float32 weight)
    run there too: in ONNX Runtime they would be a partition of their own after the gradients.

    On CPU an embedding's weight gradient (``aten.embedding_dense_backward``, which
    :func:`~lightning_ort.engine.fx.decompositions.capture_decompositions` keeps whole there) is PyTorch's: a
    zero table with the tokens' gradients added at their rows. In ONNX Runtime it is a ``ScatterElements`` that
    copies a zero input of the table's size before it adds (the vocabulary's table is the largest weight of a
    language model). So are its casts, and a sum of it with the other gradient of a tied weight (a language
    model's head) that the graph returns.
    """
    kept: dict[str, str] = {}
    for node in gm.graph.nodes:
        if (
            node.op == "call_function"
            and node.target is aten.convolution_backward.default
            and not node.args[7]
            and list(node.args[10]) == [False, True, False]
        ):
            kept[node.name] = "conv_weight_grad keeps in PyTorch"
            gradients = [user for user in node.users if user.target is operator.getitem]
            kept |= {cast.name: kept[node.name] for grad in gradients for cast in grad.users if _is_cast(cast)}
        elif node.op == "call_function" and node.target is aten.embedding_dense_backward.default:
            reason = "embedding gradients on CPU run in PyTorch"
            kept[node.name] = reason
            kept |= {user.name: reason for user in node.users if _is_cast(user) or _returned_sum(user)}
    return kept


def _returned_sum(node: torch.fx.Node) -> bool:
    """Whether ``node`` is an ``add`` whose value the graph only returns."""
    return node.target is aten.add.Tensor and all(user.op == "output" for user in node.users)


def _is_cast(node: torch.fx.Node) -> bool:
    """Whether ``node`` copies its input to its shape and device, changing at most its dtype."""
    if node.op != "call_function" or node.target not in (aten._to_copy.default, prims.convert_element_type.default):
        return False
    source, value = node.all_input_nodes[0].meta.get("val"), node.meta.get("val")
    if not isinstance(source, torch.Tensor) or not isinstance(value, torch.Tensor):
        return False
    return source.shape == value.shape and source.device == value.device


def describe_ops(gm: torch.fx.GraphModule, reasons: dict[str, str]) -> str:
    """``"ONNX has no translation for `aten.foo.default` (module `encoder` (Foo))"``, grouped by reason."""
    grouped: dict[str, dict[str, set[str]]] = {}
    for node in gm.graph.nodes:
        if node.name in reasons:
            origins = grouped.setdefault(reasons[node.name], {}).setdefault(str(node.target), set())
            origins.add(node_origin(node) or "unknown module")
    return "; ".join(
        f"{reason} " + ", ".join(f"`{op}` ({_places(where)})" for op, where in sorted(ops.items()))
        for reason, ops in grouped.items()
    )


def _places(origins: set[str], shown: int = 3) -> str:
    ordered = sorted(origins)
    more = f" and {len(ordered) - shown} more" if len(ordered) > shown else ""
    return ", ".join(ordered[:shown]) + more


_IGNORED_ARGUMENTS = {
    aten.avg_pool2d.default: (6, "divisor_override"),
    aten.avg_pool3d.default: (6, "divisor_override"),
}
"""Op arguments the ONNX translation drops (``AveragePool`` has no divisor): position and name."""


def _ignored_argument(node: torch.fx.Node) -> str | None:
    """The name of an argument of ``node`` that is set but that the ONNX translation would ignore."""
    position, name = _IGNORED_ARGUMENTS.get(node.target, (-1, ""))  # type: ignore[call-overload]
    if position < 0:
        return None
    value = node.args[position] if len(node.args) > position else node.kwargs.get(name)
    return name if value is not None else None


def _output_padding_past_stride(node: torch.fx.Node) -> bool:
    """A transposed convolution with an ``output_padding`` not below its ``stride`` (PyTorch allows it below the
    dilation instead; ONNX Runtime rejects it when the graph runs). Sizes still symbolic are not judged here."""
    if node.target is not aten.convolution.default or not node.args[6]:
        return False
    stride, output_padding = node.args[3], node.args[7]
    assert isinstance(stride, (list, tuple)) and isinstance(output_padding, (list, tuple))
    return any(isinstance(p, int) and isinstance(s, int) and p >= s for p, s in zip(output_padding, stride))


def _dtypes(node: torch.fx.Node) -> set[torch.dtype]:
    """The dtypes of the tensors ``node`` reads and writes."""
    values = [node.meta.get("val"), *(arg.meta.get("val") for arg in node.all_input_nodes)]
    flat = [v for value in values for v in (value if isinstance(value, (tuple, list)) else (value,))]
    return {v.dtype for v in flat if isinstance(v, torch.Tensor)}


def split_graph(gm: torch.fx.GraphModule, unsupported: Iterable[str]) -> tuple[torch.fx.GraphModule, list[str]]:
    """A copy of ``gm`` whose supported nodes are fused into submodules; returns it and their names.

    Args:
        gm: the captured graph (left unchanged, but for fake values given to nodes that lacked them).
        unsupported: names of the nodes that must run in PyTorch.
    """
    _fill_missing_values(gm)
    partitioner = CapabilityBasedPartitioner(
        copy_graph_module(gm), _NodeSupport(frozenset(unsupported)), allows_single_node_partition=True
    )
    with fx_traceback.preserve_node_meta(enable=False):
        fused = partitioner.fuse_partitions(partitioner.propose_partitions())
    for node in fused.graph.nodes:
        # Tensors coming back from ONNX Runtime are contiguous, not strided as during tracing, so a view there
        # may be impossible: reshape is the same op when the strides allow it, and a copy when not.
        if node.op == "call_function" and node.target in (aten.view.default, aten._unsafe_view.default):
            node.target = aten.reshape.default
    fused.recompile()
    names = [node.target for node in fused.graph.nodes if node.op == "call_module"]
    return fused, [str(name) for name in names]


def _fill_missing_values(gm: torch.fx.GraphModule) -> None:
    """Give nodes without a fake ``val`` one, computed from their inputs' (partitions' inputs need them).

    AOTAutograd's partitioner leaves none on the higher-order operators it adds to a backward graph
    (activation checkpointing's ``run_with_rng_state``).
    """
    for node in gm.graph.nodes:
        if node.op != "call_function" or "val" in node.meta:
            continue
        inputs = [arg.meta.get("val") for arg in node.all_input_nodes]
        fake = next((v.fake_mode for v in inputs if isinstance(v, FakeTensor)), None)
        if fake is None or any(v is None for v in inputs):
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda arg: arg.meta["val"])
        with fake:
            node.meta["val"] = node.target(*args, **kwargs)


class PartitionCall(torch.nn.Module):
    """Stands in for the fused partition ``partition``: runs ``session`` and returns what the partition did.

    Args:
        partition: the fused submodule (its output decides between a tensor and a tuple).
        session: the partition's ONNX Runtime session (AOTAutograd's boxed convention).
    """

    def __init__(self, partition: torch.fx.GraphModule, session: GraphSession) -> None:
        super().__init__()
        self._session = session
        self._single = not isinstance(partition.graph.output_node().args[0], (tuple, list))

    def forward(self, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor | None, ...] | None:
        outputs = self._session(list(args))
        return outputs[0] if self._single else tuple(outputs)


class PartitionedGraph:
    """Runs a split graph: ONNX Runtime sessions for the partitions, PyTorch for the rest.

    Called like a :class:`~lightning_ort.engine.runtime.session.GraphSession` (AOTAutograd's boxed convention).

    Args:
        gm: the split graph, its partitions already replaced by :class:`PartitionCall` modules.
        name: the graph's name (``"forward"``...).
        sessions: the partitions' sessions.
        fallback_ops: how many nodes run in PyTorch.
    """

    def __init__(
        self, gm: torch.fx.GraphModule, name: str, sessions: Sequence[GraphSession], fallback_ops: int
    ) -> None:
        # An instance attribute, so that TorchDynamo's wrapper around backward graphs copies it (functools.wraps).
        self._boxed_call = True
        self._gm = gm
        self._sessions = list(sessions)
        self.name = name
        self.fallback_ops = fallback_ops
        self.runs = 0
        self._dtypes = _traced_dtypes(gm)

    @property
    def providers(self) -> list[str]:
        seen: list[str] = []
        for session in self._sessions:
            seen.extend(p for p in session.providers if p not in seen)
        return seen

    def end_profiling(self) -> list[Path]:
        """Stop profiling the partitions' sessions; their profile files."""
        return [path for session in self._sessions for path in session.end_profiling()]

    def __call__(self, args: list[torch.Tensor]) -> list[torch.Tensor | None]:
        inputs = list(args)
        args.clear()
        outputs = self._gm(*inputs)
        if self._sessions:  # a graph of block calls and glue alone ran nothing in ONNX Runtime itself
            self.runs += 1
        values = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        return [
            value.to(dtype) if dtype is not None and isinstance(value, torch.Tensor) and value.dtype != dtype else value
            for value, dtype in zip(values, self._dtypes)
        ]


def _traced_dtypes(gm: torch.fx.GraphModule) -> list[torch.dtype | None]:
    """The dtype each output of ``gm`` was traced with (``None`` for a non-tensor output).

    An op left to PyTorch may return another dtype than its traced (meta) one: the CPU layer norm of a float16
    tensor returns float32 statistics where the trace says float16. The graph reading them next (the backward
    graph, exported from the trace) takes the traced dtype only.
    """
    returned = gm.graph.output_node().args[0]
    values = returned if isinstance(returned, (list, tuple)) else [returned]
    return [
        value.meta["val"].dtype
        if isinstance(value, torch.fx.Node) and isinstance(value.meta.get("val"), torch.Tensor)
        else None
        for value in values
    ]


class _NodeSupport(OperatorSupportBase):
    def __init__(self, unsupported: frozenset[str]) -> None:
        self._unsupported = unsupported

    def is_node_supported(self, submodules: Any, node: torch.fx.Node) -> bool:
        if node.op != "call_function" or node.name in self._unsupported or isinstance(node.target, BlockCall):
            return False
        if node.target is operator.getitem:
            source = node.args[0]
            return isinstance(source, torch.fx.Node) and source.name not in self._unsupported
        return True


@Once
def _onnx_coverage() -> frozenset[Any] | None:
    """Ops the exporter translates, plus those it decomposes first (the same tables ``torch.onnx.export`` uses).

    ``None`` on a torch whose exporter does not expose them: export failures then tell which ops to leave out.
    """
    steps = EXPORTER_STEPS
    if steps is None:
        return None
    translated = steps.implemented_overloads(onnx_registry())
    decomposed = steps.decomposition_table(set(translated))
    return frozenset(translated) | frozenset(decomposed) | {DROPOUT_KEEP}  # lifted before export
