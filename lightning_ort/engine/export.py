"""Turn an AOTAutograd FX graph into an ONNX model that ONNX Runtime can run.

Three steps, in :func:`export_graph`:

1. :func:`_normalise_outputs` keeps only tensor outputs, once each (ONNX drops ``None`` gradients and
   needs unique output names); :class:`OutputLayout` maps them back to the FX graph's output positions.
2. :func:`_lift_random_ops` replaces random ops (``rand_like``, ``bernoulli``...) by extra graph inputs, so the
   noise comes from PyTorch's generator: ``torch.manual_seed`` keeps governing reproducibility.
3. ``torch.onnx.export(..., dynamo=True)`` translates the graph; a failure names the op and the module.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
import torch.fx
from torch._guards import detect_fake_mode

log = logging.getLogger(__name__)

aten = torch.ops.aten


class ExportError(RuntimeError):
    """ONNX export of a captured graph failed; the message names the op and where it came from.

    Args:
        message: what failed, where, and what to do.
        nodes: names of the graph nodes calling the op that failed, when the failure names one.
    """

    def __init__(self, message: str, nodes: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.nodes = tuple(nodes)


@dataclass(frozen=True)
class OutputLayout:
    """Where each FX output comes from: an ONNX output index, or ``None`` for a ``None`` output."""

    sources: tuple[int | None, ...]

    def place(self, onnx_outputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        return [None if index is None else onnx_outputs[index] for index in self.sources]


@dataclass(frozen=True)
class OutputSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Noise:
    """How to draw one lifted random input before each run (plain data, so a graph can be saved to disk).

    ``kind`` is ``"uniform"`` (``torch.rand``), ``"normal"`` (``torch.randn``) or ``"threshold"``: a boolean
    mask ``u <compare> threshold`` for ``u`` uniform on [0, 1), drawn from 16 random bits per element (see
    :func:`_lift_uniform_threshold`).

    Example:
        >>> Noise("threshold", (2, 3), torch.bool, compare="gt", threshold=0.5).draw(torch.device("cpu")).dtype
        torch.bool
    """

    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    compare: str = ""
    threshold: float = 0.0

    def draw(self, device: torch.device) -> torch.Tensor:
        if self.kind == "uniform":
            return torch.rand(self.shape, dtype=self.dtype, device=device)
        if self.kind == "normal":
            return torch.randn(self.shape, dtype=self.dtype, device=device)
        # u = (bits + 2**15) / 2**16 is uniform on [0, 1) in steps of 2**-16; compare the bits with the
        # equivalent threshold instead of materialising u.
        numel = math.prod(self.shape)
        bits = torch.empty(-(-numel // 4), dtype=torch.int64, device=device).random_(-(2**63), None)
        compare = getattr(torch, self.compare)
        return compare(bits.view(torch.int16)[:numel], self.threshold * 65536.0 - 32768.0).view(self.shape)


@dataclass
class ExportedGraph:
    """An ONNX model plus what the session runner needs to feed it and read it back."""

    name: str
    model: onnx.ModelProto
    noise: list[Noise]
    outputs: list[OutputSpec]
    layout: OutputLayout


def export_graph(
    gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor], name: str, verbose: bool
) -> ExportedGraph:
    """Export ``gm`` (an ATen-level FX graph with static shapes) to ONNX.

    Args:
        gm: the graph (not modified: the export works on a copy).
        example_inputs: one (fake or real) tensor per placeholder.
        name: graph name used in messages and file names (``"forward"``, ``"backward"``...).
        verbose: let ``torch.onnx`` print its progress.
    """
    gm = copy_graph_module(gm)
    layout, outputs = _normalise_outputs(gm)
    fake_mode = detect_fake_mode(example_inputs)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        noise, noise_examples = _lift_random_ops(gm)
    gm.recompile()
    inputs = (*example_inputs, *noise_examples)
    gm.eval()
    try:
        with quiet_exporter(verbose):
            program = torch.onnx.export(gm, inputs, dynamo=True, verbose=verbose, optimize=True)
    except Exception as err:
        raise _export_failure(gm, name, err) from err
    if program is None or program.model_proto is None:
        raise ExportError(f"torch.onnx.export returned no model for the {name} graph.")
    model = program.model_proto
    if len(model.graph.input) != len(inputs) or len(model.graph.output) != len(outputs):
        raise ExportError(
            f"The exported {name} graph has {len(model.graph.input)} inputs/{len(model.graph.output)} outputs, "
            f"expected {len(inputs)}/{len(outputs)}. Please report this with save_onnx=True output attached."
        )
    log.debug(
        "exported %s graph: %d nodes, %d inputs, %d outputs", name, len(model.graph.node), len(inputs), len(outputs)
    )
    return ExportedGraph(name, model, noise, outputs, layout)


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` with its own graph (same node names and metadata; attributes shared)."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


@contextlib.contextmanager
def quiet_exporter(verbose: bool) -> Iterator[None]:
    """Keep ``torch.onnx``'s progress lines and warnings out of the user's console unless ``verbose``."""
    if verbose:
        yield
        return
    loggers = [logging.getLogger(name) for name in _EXPORTER_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


_EXPORTER_LOGGERS = ("torch.onnx", "onnxscript", "onnx_ir")


def save_model(model: onnx.ModelProto, path: Path) -> None:
    """Write ``model`` to ``path`` (weights are graph inputs, so the file stays small)."""
    onnx.save_model(model, str(path))
    log.info("saved ONNX model to %s", path)


def _normalise_outputs(gm: torch.fx.GraphModule) -> tuple[OutputLayout, list[OutputSpec]]:
    output_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = output_node.args[0]
    values = list(values) if isinstance(values, (list, tuple)) else [values]
    unique: list[torch.fx.Node] = []
    sources: list[int | None] = []
    for value in values:
        if value is None:
            sources.append(None)
            continue
        if not isinstance(value, torch.fx.Node):
            raise ExportError(
                f"Captured graph returns a non-tensor value {value!r}; only tensors can leave ONNX Runtime."
            )
        if value not in unique:
            unique.append(value)
        sources.append(unique.index(value))
    output_node.args = (tuple(unique),)
    specs = [OutputSpec(tuple(int(s) for s in n.meta["val"].shape), n.meta["val"].dtype) for n in unique]
    return OutputLayout(tuple(sources)), specs


def _lift_random_ops(gm: torch.fx.GraphModule) -> tuple[list[Noise], list[torch.Tensor]]:
    graph = gm.graph
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
    noises: list[Noise] = []
    examples: list[torch.Tensor] = []

    def new_input(noise: Noise) -> torch.fx.Node:
        nonlocal last_placeholder
        with graph.inserting_after(last_placeholder):
            node = graph.placeholder(f"noise_{len(noises)}")
        example = torch.zeros(noise.shape, dtype=noise.dtype)
        node.meta["val"] = example
        last_placeholder = node
        noises.append(noise)
        examples.append(example)
        return node

    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        if node.target in _UNIFORM_OPS and _lift_uniform_threshold(graph, node, new_input):
            continue
        if node.target in _UNIFORM_OPS or node.target in _NORMAL_OPS:
            kind = "uniform" if node.target in _UNIFORM_OPS else "normal"
            node.replace_all_uses_with(new_input(Noise(kind, tuple(val.shape), val.dtype)))
            graph.erase_node(node)
        elif node.target in (aten.bernoulli.default, aten.bernoulli.p):
            _lift_bernoulli(graph, node, new_input)
    graph.eliminate_dead_code()
    return noises, examples


def _scalar(value: object) -> float:
    if not isinstance(value, (int, float)):
        raise ExportError(f"Expected a constant probability in a random op, got {value!r}.")
    return float(value)


def _lift_uniform_threshold(
    graph: torch.fx.Graph, node: torch.fx.Node, new_input: Callable[..., torch.fx.Node]
) -> bool:
    """Lift ``rand_like(x) > p`` (dropout's keep mask) as a boolean input drawn from 16 random bits per element.

    Drawing 64 random bits and splitting them into four 16-bit uniforms is about 4x cheaper than ``torch.rand``
    on CPU, where random numbers are a large share of a training step with dropout. The mask's probability is
    exact up to 2**-16 (``rand`` itself is quantised to 2**-24). Returns ``False`` (nothing lifted) unless the
    uniform sample's only use is one comparison with a constant.
    """
    users = list(node.users)
    if len(users) != 1:
        return False
    (compare,) = users
    if compare.target not in _THRESHOLD_OPS or compare.args[0] is not node or not isinstance(compare.args[1], float):
        return False
    shape = tuple(node.meta["val"].shape)
    mask = new_input(Noise("threshold", shape, torch.bool, _THRESHOLD_OPS[compare.target], compare.args[1]))
    compare.replace_all_uses_with(mask)
    graph.erase_node(compare)
    graph.erase_node(node)
    return True


def _lift_bernoulli(graph: torch.fx.Graph, node: torch.fx.Node, new_input: Callable[..., torch.fx.Node]) -> None:
    val = node.meta["val"]
    shape, dtype = tuple(val.shape), val.dtype
    uniform = new_input(Noise("uniform", shape, torch.float32))
    with graph.inserting_before(node):
        if node.target is aten.bernoulli.p:
            draw = graph.call_function(aten.lt.Scalar, (uniform, _scalar(node.args[1])))
        else:
            draw = graph.call_function(aten.lt.Tensor, (uniform, node.args[0]))
        out = graph.call_function(aten._to_copy.default, (draw,), {"dtype": dtype})
    node.replace_all_uses_with(out)
    graph.erase_node(node)


_THRESHOLD_OPS: dict[object, str] = {
    aten.gt.Scalar: "gt",
    aten.ge.Scalar: "ge",
    aten.lt.Scalar: "lt",
    aten.le.Scalar: "le",
}
_UNIFORM_OPS = {aten.rand.default, aten.rand_like.default}
_NORMAL_OPS = {aten.randn.default, aten.randn_like.default}

_OP_PATTERN = re.compile(r"OpOverload\(op='([\w.]+)', overload='(\w+)'\)")


def _export_failure(gm: torch.fx.GraphModule, name: str, err: Exception) -> ExportError:
    text = str(err)
    match = _OP_PATTERN.search(text)
    if match is None:
        summary = text.strip().splitlines()[0] if text.strip() else type(err).__name__
        return ExportError(
            f"ONNX export of the {name} graph failed: {summary}\n"
            "Run with DebugOptions(log_level=LogLevel.VERBOSE) for the exporter's full report."
        )
    op_name = f"{match.group(1)}.{match.group(2)}"
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == op_name]
    if not nodes:
        base = match.group(1).rsplit(".", 1)[-1]
        nodes = [n for n in gm.graph.nodes if n.op == "call_function" and base in str(n.target)]
    graph_ops = sorted({str(n.target) for n in nodes} - {op_name})
    lowered = f" (lowered from `{'`, `'.join(graph_ops)}`)" if graph_ops else ""
    location = "; ".join(sorted({origin for n in nodes if (origin := node_origin(n))})) or "unknown module"
    return ExportError(
        f"ONNX export of the {name} graph failed at op `{op_name}`{lowered} in {location}: "
        "ONNX has no translation for it.\n"
        "Rewrite that part of the model with supported ops, keep that submodule outside ORTModule "
        "(wrap its siblings instead), or pass fallback='auto' to run just that op in PyTorch.",
        [n.name for n in nodes],
    )


def node_origin(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if stack:
        path, module_type = list(stack.values())[-1]
        type_name = getattr(module_type, "__name__", str(module_type))
        return f"module `{path}` ({type_name})"
    trace = node.meta.get("stack_trace")
    if trace:
        return trace.strip().splitlines()[-2].strip() if len(trace.strip().splitlines()) > 1 else trace.strip()
    return ""
