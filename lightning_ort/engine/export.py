"""Turn an AOTAutograd FX graph into an ONNX model that ONNX Runtime can run.

Three steps, in :func:`export_graph`:

1. :func:`_lift_random_ops` replaces random ops (``rand_like``, ``bernoulli``...) by extra graph inputs, so the
   noise comes from PyTorch's generator: ``torch.manual_seed`` keeps governing reproducibility.
2. :func:`_normalise_outputs` keeps only tensor outputs, once each (ONNX drops ``None`` gradients and
   needs unique output names); :class:`OutputLayout` maps them back to the FX graph's output positions.
   Outputs ONNX Runtime would only copy are produced in PyTorch instead: inputs returned as they are
   (parameters, dropout masks saved for backward) and reshapes of saved tensors, replayed as views.
3. ``torch.onnx.export(..., dynamo=True)`` translates the graph (a failure names the op and the module), and
   :func:`~lightning_ort.engine.onnx_rewrites.simplify` folds its constants.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import operator
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import onnx
import sympy
import torch
import torch.fx
from torch._guards import detect_fake_mode, tracing
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._sympy.functions import FloorDiv

from lightning_ort.engine.decompositions import DROPOUT_KEEP
from lightning_ort.engine.dynamic import evaluate, is_symbolic, symbolic_dims, symbolic_size
from lightning_ort.engine.onnx_rewrites import (
    dequantize_scaled_masks,
    fuse_transposed_operands,
    nchwc_block_size,
    simplify,
    split_gemm_bias,
    sum_rows_by_product,
    use_nchwc_convolutions,
)

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


Size: TypeAlias = int | sympy.Expr
"""A tensor size: an ``int``, or an expression of input-size symbols in a graph with dynamic shapes."""

Symbols: TypeAlias = dict[sympy.Symbol, tuple[int, int]]
"""Where each size symbol is read at run time: ``(ONNX input index, dimension)``."""


@dataclass(frozen=True)
class PassedInput:
    """An FX output that is one of the graph's inputs, returned as is (ONNX Runtime would copy it)."""

    index: int


@dataclass(frozen=True)
class ReshapedOutput:
    """A saved tensor that is a reshape of an ONNX output or a passed-through input, replayed as a view.

    ONNX Runtime's ``Reshape`` cannot alias a graph output, so returning the reshape copies the tensor.
    """

    base: int | PassedInput
    shape: tuple[Size, ...]


Source: TypeAlias = int | PassedInput | ReshapedOutput | sympy.Expr | None


@dataclass(frozen=True)
class OutputLayout:
    """Where each FX output comes from: an ONNX output index, ``None`` for a ``None`` output, an input passed
    through (forward graphs return parameters the backward graph needs), a reshape of either, or a size
    expression for an integer output (dynamic-shape forward graphs return sizes the backward graph needs)."""

    sources: tuple[Source, ...]

    def place(
        self, onnx_outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], env: dict[sympy.Symbol, int]
    ) -> list[Any]:
        return [_place(source, onnx_outputs, inputs, env) for source in self.sources]


def _place(
    source: Source, onnx_outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], env: dict[sympy.Symbol, int]
) -> Any:
    # A module-level function, not a closure in ``place``: a recursive closure is a reference cycle that kept
    # every output alive until the garbage collector ran, so autograd copied each gradient instead of taking it.
    if source is None:
        return None
    if isinstance(source, int):
        return onnx_outputs[source]
    if isinstance(source, PassedInput):
        return inputs[source.index].detach()
    if isinstance(source, ReshapedOutput):
        base = _place(source.base, onnx_outputs, inputs, env)
        return base.view(tuple(evaluate(size, env) for size in source.shape))
    return evaluate(source, env)


@dataclass(frozen=True)
class OutputSpec:
    shape: tuple[Size, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Noise:
    """How to draw one lifted random input before each run (plain data, so a graph can be saved to disk).

    ``kind`` is ``"uniform"`` (``torch.rand``), ``"normal"`` (``torch.randn``) or ``"threshold"``: a mask
    ``u <compare> threshold`` for ``u`` uniform on [0, 1), drawn from 16 random bits per element (see
    :func:`_lift_uniform_threshold`), as ``bool`` or as ``uint8`` 0/1 (dropout's keep mask,
    :func:`lightning_ort.engine.decompositions.dropout_keep`).

    Example:
        >>> Noise("threshold", (2, 3), torch.bool, compare="gt", threshold=0.5).draw(torch.device("cpu")).dtype
        torch.bool
        >>> keep = Noise("threshold", (1000,), torch.uint8, "gt", 0.5).draw(torch.device("cpu"))
        >>> keep.dtype, sorted(keep.unique().tolist())
        (torch.uint8, [0, 1])
    """

    kind: str
    shape: tuple[Size, ...]
    dtype: torch.dtype
    compare: str = ""
    threshold: float = 0.0

    def draw(self, device: torch.device, env: dict[sympy.Symbol, int] | None = None) -> torch.Tensor:
        """A fresh sample; ``env`` gives the values of symbolic sizes."""
        shape = tuple(evaluate(size, env or {}) for size in self.shape)
        if self.kind == "uniform":
            return torch.rand(shape, dtype=self.dtype, device=device)
        if self.kind == "normal":
            return torch.randn(shape, dtype=self.dtype, device=device)
        limit = self._integer_threshold()
        if not -(2**15) <= limit < 2**15:  # every 16-bit value compares like 0 with an out-of-range limit
            return torch.full(shape, getattr(operator, self.compare)(0, limit), dtype=self.dtype, device=device)
        return _threshold_mask(math.prod(shape), device, self.compare, limit).view(self.dtype).view(shape)

    def _integer_threshold(self) -> int:
        """The integer ``limit`` with ``bits <compare> limit`` exactly when ``u <compare> threshold``.

        ``u = (bits + 2**15) / 2**16`` is uniform on [0, 1) in steps of 2**-16, so ``u > t`` holds when
        ``bits > floor(t * 2**16 - 2**15)`` (``ceil`` for ``ge``/``lt``). Comparing int16 with an integer is 3x
        faster than with a float, which promotes every element.
        """
        bound = self.threshold * 65536.0 - 32768.0
        return math.floor(bound) if self.compare in ("gt", "le") else math.ceil(bound)


_NUMPY_COMPARISONS = {"gt": "greater", "ge": "greater_equal", "lt": "less", "le": "less_equal"}


def _threshold_mask(numel: int, device: torch.device, compare: str, limit: int) -> torch.Tensor:
    """``bits <compare> limit`` for ``numel`` uniformly random int16 ``bits`` drawn from PyTorch's generator for
    ``device``: a flat boolean mask.

    On CPU, PyTorch's generator (a serial Mersenne Twister) only draws the seed of a NumPy SFC64 generator,
    which fills the bits twice as fast (2M values: 0.8 vs 1.6 ms), and NumPy compares them: its int16
    comparison drew the transformer benchmark's 16 masks (16.8M elements) in 34 ms against 39-48 ms with
    PyTorch's. ``torch.manual_seed`` still fixes every mask.
    """
    words = -(-numel // 4)
    if device.type != "cpu":
        bits = torch.empty(words, dtype=torch.int64, device=device).random_(-(2**63), None)
        return getattr(torch, compare)(bits.view(torch.int16)[:numel], limit)
    seed = int(torch.empty((), dtype=torch.int64).random_())
    values = np.random.SFC64(seed).random_raw(words).view(np.int16)[:numel]
    return torch.from_numpy(getattr(np, _NUMPY_COMPARISONS[compare])(values, limit))


@dataclass
class ExportedGraph:
    """An ONNX model plus what the session runner needs to feed it and read it back."""

    name: str
    model: onnx.ModelProto
    noise: list[Noise]
    outputs: list[OutputSpec]
    layout: OutputLayout
    symbols: Symbols = field(default_factory=dict)
    dropped_inputs: tuple[int, ...] = ()


def export_graph(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[torch.Tensor],
    name: str,
    verbose: bool,
    saved_from: int | None = None,
) -> ExportedGraph:
    """Export ``gm`` (an ATen-level FX graph with static shapes) to ONNX.

    Args:
        gm: the graph (not modified: the export works on a copy).
        example_inputs: one (fake or real) tensor per placeholder.
        name: graph name used in messages and file names (``"forward"``, ``"backward"``...).
        verbose: let ``torch.onnx`` print its progress.
        saved_from: index of the first output that only the backward graph reads (a forward graph's saved
            tensors); those may be returned as views. ``None``: every output reaches the user.
    """
    gm = copy_graph_module(gm)
    symbolic = any(is_symbolic(value) for value in example_inputs)
    sizes = any(isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool) for value in example_inputs)
    dropped = _inline_size_inputs(gm, example_inputs) if sizes else ()
    tensor_inputs = [value for index, value in enumerate(example_inputs) if index not in dropped]
    device = next((value.device for value in tensor_inputs if isinstance(value, torch.Tensor)), torch.device("cpu"))
    fake_mode = detect_fake_mode(example_inputs)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        noise, noise_examples = _lift_random_ops(gm, device)
    layout, outputs = _normalise_outputs(gm, saved_from)
    gm.recompile()
    inputs: tuple[Any, ...] = (*tensor_inputs, *noise_examples)
    dynamic_shapes = None
    if symbolic:
        dynamic_shapes = tuple(_dynamic_dims(value) for value in inputs)
        inputs = tuple(_concrete(value) for value in inputs)
    gm.eval()
    try:
        # Not inside the capture's tracing context or fake mode: the ONNX optimizer folds constants with real
        # tensors (a graph's tensor constants, such as T5's relative-position buckets).
        with quiet_exporter(verbose), tracing(None), unset_fake_temporarily():
            program = torch.onnx.export(
                gm, inputs, dynamo=True, verbose=verbose, optimize=False, dynamic_shapes=dynamic_shapes
            )
            if program is not None:
                simplify(program.model)
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
    on_cpu = device.type == "cpu"
    split = split_gemm_bias(model) if on_cpu else 0  # measured on CPU only
    fused = fuse_transposed_operands(model)
    blocked = use_nchwc_convolutions(model, nchwc_block_size()) if on_cpu else 0
    masks = dequantize_scaled_masks(model) if on_cpu else 0
    row_sums = sum_rows_by_product(model) if on_cpu else 0
    log.debug(
        "exported %s graph: %d nodes (%d biases split from Gemm, %d transposed matmul operands fused, "
        "%d convolutions on NCHWc kernels, %d masks scaled by DequantizeLinear, %d row sums as products), "
        "%d inputs, %d outputs",
        name,
        len(model.graph.node),
        split,
        fused,
        blocked,
        masks,
        row_sums,
        len(inputs),
        len(outputs),
    )
    return ExportedGraph(name, model, noise, outputs, layout, _size_symbols(tensor_inputs), dropped)


def _size_symbols(values: Sequence[Any]) -> Symbols:
    """Where each size symbol of ``values`` can be read: its first ``(value index, dimension)``."""
    symbols: Symbols = {}
    for index, value in enumerate(values):
        for dim, size in enumerate(value.shape if isinstance(value, torch.Tensor) else ()):
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                symbols.setdefault(size.node.expr, (index, dim))
    return symbols


def _dynamic_dims(value: torch.Tensor) -> dict[int, Any] | None:
    return {dim: torch.export.Dim.DYNAMIC for dim in symbolic_dims(value)} or None


def _concrete(value: torch.Tensor) -> torch.Tensor:
    """A real tensor shaped like ``value`` at the sizes the trace saw (symbolic export needs real inputs)."""
    shape = [size.node.hint if isinstance(size, torch.SymInt) else int(size) for size in value.shape]
    return torch.zeros(shape, dtype=value.dtype, device=value.device)


def _inline_size_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[int, ...]:
    """Replace integer (size) inputs of a dynamic-shape graph by computations on its tensor inputs' sizes.

    AOTAutograd passes sizes the backward needs (``s0``, ``4*s0``) as integer inputs; ONNX inputs are tensors,
    and these sizes are functions of the tensor inputs' shapes anyway. Returns the dropped input positions.
    """
    graph = gm.graph
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    if not placeholders:
        return ()
    sources = {symbol: (placeholders[index], dim) for symbol, (index, dim) in _size_symbols(example_inputs).items()}
    # A split graph's partitions interleave placeholders with ops: gather them first (their order is kept).
    first_op = next(node for node in graph.nodes if node.op != "placeholder")
    ops_seen = False
    for node in list(graph.nodes):
        ops_seen = ops_seen or node is first_op
        if ops_seen and node.op == "placeholder":
            first_op.prepend(node)
    built: dict[sympy.Expr, torch.fx.Node | int] = {}
    dropped = []
    for index, (node, value) in enumerate(zip(placeholders, example_inputs)):
        if not isinstance(value, (torch.SymInt, int)) or isinstance(value, bool):
            continue
        expr = value.node.expr if isinstance(value, torch.SymInt) else sympy.Integer(value)
        if not node.users:  # TorchDynamo passes sizes and strides the graph may not read
            graph.erase_node(node)
            dropped.append(index)
            continue
        with graph.inserting_before(first_op):
            replacement = _size_node(graph, expr, sources, built)
        if isinstance(replacement, torch.fx.Node):
            replacement.meta.setdefault("val", value)
        _replace_uses(node, replacement)
        graph.erase_node(node)
        dropped.append(index)
    return tuple(dropped)


def _replace_uses(node: torch.fx.Node, replacement: torch.fx.Node | int) -> None:
    """Like ``node.replace_all_uses_with``, but the replacement may be a constant."""

    def swap(arg: torch.fx.Node) -> torch.fx.Node | int:
        return replacement if arg is node else arg

    for user in list(node.users):
        user.args = torch.fx.node.map_arg(user.args, swap)
        user.kwargs = torch.fx.node.map_arg(user.kwargs, swap)


def _size_node(
    graph: torch.fx.Graph,
    expr: sympy.Expr,
    sources: dict[sympy.Symbol, tuple[torch.fx.Node, int]],
    built: dict[sympy.Expr, torch.fx.Node | int],
) -> torch.fx.Node | int:
    if expr in built:
        return built[expr]
    result: torch.fx.Node | int
    if expr.is_Integer:
        result = int(expr)
    elif isinstance(expr, sympy.Symbol):
        if expr not in sources:
            raise ExportError(f"size {expr} is not the size of any tensor input; cannot export it to ONNX.")
        node, dim = sources[expr]
        result = graph.call_function(aten.sym_size.int, (node, dim))
    elif isinstance(expr, (sympy.Mul, sympy.Add)):
        combine = operator.mul if isinstance(expr, sympy.Mul) else operator.add
        terms = [_size_node(graph, arg, sources, built) for arg in expr.args]
        result = terms[0]
        for term in terms[1:]:
            result = graph.call_function(combine, (result, term))
    elif isinstance(expr, FloorDiv):
        numerator, denominator = (_size_node(graph, arg, sources, built) for arg in expr.args)
        result = graph.call_function(operator.floordiv, (numerator, denominator))
    else:
        raise ExportError(f"size expression {expr} has no ONNX form here; train with dynamic=False.")
    built[expr] = result
    return result


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


def _normalise_outputs(gm: torch.fx.GraphModule, saved_from: int | None) -> tuple[OutputLayout, list[OutputSpec]]:
    output_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = output_node.args[0]
    values = list(values) if isinstance(values, (list, tuple)) else [values]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    computed = [v for v in values if isinstance(v, torch.fx.Node) and v.op != "placeholder"]
    user_visible = set(values[:saved_from] if saved_from is not None else values)
    unique: list[torch.fx.Node] = []

    def tensor_source(node: torch.fx.Node) -> int | PassedInput:
        if node.op == "placeholder" and computed:
            return PassedInput(placeholders.index(node))
        if node not in unique:
            unique.append(node)
        return unique.index(node)

    sources: list[Source] = []
    for value in values:
        if value is None:
            sources.append(None)
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            sources.append(sympy.Integer(value))
            continue
        if not isinstance(value, torch.fx.Node):
            raise ExportError(
                f"Captured graph returns a non-tensor value {value!r}; only tensors can leave ONNX Runtime."
            )
        if isinstance(value.meta.get("val"), torch.SymInt):
            sources.append(sympy.sympify(symbolic_size(value.meta["val"])))
            continue
        base = _reshape_base(value)
        if value not in user_visible and base is not None and base not in user_visible:
            sources.append(ReshapedOutput(tensor_source(base), _sizes(value.meta["val"].shape)))
            continue
        sources.append(tensor_source(value))
    output_node.args = (tuple(unique),)
    gm.graph.eliminate_dead_code()
    specs = [OutputSpec(tuple(symbolic_size(s) for s in n.meta["val"].shape), n.meta["val"].dtype) for n in unique]
    return OutputLayout(tuple(sources)), specs


def _reshape_base(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor that ``node`` reshapes (through a chain of reshapes), or ``None`` if it is no reshape.

    ONNX outputs and the inputs bound to ONNX Runtime are contiguous, so a view of the base always exists.
    """
    base = node
    while base.op == "call_function" and base.target in _RESHAPES and isinstance(base.args[0], torch.fx.Node):
        base = base.args[0]
    return None if base is node else base


_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default}


def _lift_random_ops(gm: torch.fx.GraphModule, device: torch.device) -> tuple[list[Noise], list[torch.Tensor]]:
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    last_placeholder: torch.fx.Node | None = placeholders[-1] if placeholders else None
    noises: list[Noise] = []
    examples: list[torch.Tensor] = []

    def new_input(noise: Noise, shape: Sequence[int | torch.SymInt]) -> torch.fx.Node:
        nonlocal last_placeholder
        # A graph (partition) may read no input at all: its noise inputs then come first.
        where = graph.inserting_after(last_placeholder) if last_placeholder else graph.inserting_before()
        with where:
            node = graph.placeholder(f"noise_{len(noises)}")
        example = torch.zeros(tuple(shape), dtype=noise.dtype, device=device)
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
            node.replace_all_uses_with(new_input(Noise(kind, _sizes(val.shape), val.dtype), val.shape))
            graph.erase_node(node)
        elif node.target in (aten.bernoulli.default, aten.bernoulli.p):
            _lift_bernoulli(graph, node, new_input)
        elif node.target is DROPOUT_KEEP:
            p = _scalar(node.args[1])
            keep = Noise("threshold", _sizes(val.shape), val.dtype, "gt", p)
            node.replace_all_uses_with(new_input(keep, val.shape))
            graph.erase_node(node)
    graph.eliminate_dead_code()
    return noises, examples


def _sizes(shape: Sequence[int | torch.SymInt]) -> tuple[Size, ...]:
    return tuple(symbolic_size(size) for size in shape)


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
    shape = node.meta["val"].shape
    noise = Noise("threshold", _sizes(shape), torch.bool, _THRESHOLD_OPS[compare.target], compare.args[1])
    mask = new_input(noise, shape)
    compare.replace_all_uses_with(mask)
    graph.erase_node(compare)
    graph.erase_node(node)
    return True


def _lift_bernoulli(graph: torch.fx.Graph, node: torch.fx.Node, new_input: Callable[..., torch.fx.Node]) -> None:
    val = node.meta["val"]
    uniform = new_input(Noise("uniform", _sizes(val.shape), torch.float32), val.shape)
    dtype = val.dtype
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


def first_line(err: BaseException | str) -> str:
    """The first non-empty line of ``err``'s message (its type name if the message is empty), for summaries."""
    text = str(err).strip()
    if not text:
        return type(err).__name__ if isinstance(err, BaseException) else ""
    return text.splitlines()[0].strip()


def _export_failure(gm: torch.fx.GraphModule, name: str, err: Exception) -> ExportError:
    text = str(err)
    match = _OP_PATTERN.search(text)
    if match is None:
        return ExportError(
            f"ONNX export of the {name} graph failed: {first_line(err)}\n"
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


_DYNAMO_ROOT = re.compile(r"^L\['\w+'\]\.?")
"""TorchDynamo's name for the traced function's argument (``L['module'].encoder`` is ``encoder``)."""


def node_origin(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if stack:
        path, module_type = list(stack.values())[-1]
        path = _DYNAMO_ROOT.sub("", path) or "."
        type_name = getattr(module_type, "__name__", str(module_type))
        return f"module `{path}` ({type_name})"
    trace = node.meta.get("stack_trace")
    if trace:
        return trace.strip().splitlines()[-2].strip() if len(trace.strip().splitlines()) > 1 else trace.strip()
    return ""
