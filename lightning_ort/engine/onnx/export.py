"""Turn an AOTAutograd FX graph into an ONNX model that ONNX Runtime can run.

Three steps, in :func:`export_graph`:

1. :func:`~lightning_ort.engine.fx.noise.lift_random_ops` replaces random ops (``rand_like``, ``bernoulli``...)
   by extra graph inputs, so the noise comes from PyTorch's generator: ``torch.manual_seed`` keeps governing
   reproducibility.
2. :func:`~lightning_ort.engine.fx.layout.normalise_outputs` keeps only tensor outputs, once each (ONNX drops
   ``None`` gradients and needs unique output names); :class:`~lightning_ort.engine.fx.layout.OutputLayout` maps
   them back to the FX graph's output positions. Outputs ONNX Runtime would only copy are produced in PyTorch
   instead: inputs returned as they are (parameters, dropout masks saved for backward) and reshapes of saved
   tensors, replayed as views.
3. ``torch.onnx.export(..., dynamo=True)`` translates the graph (a failure names the op and the module), and
   :func:`~lightning_ort.engine.onnx.passes.simplify` folds its constants. The exporter's table of ONNX
   translations (:func:`onnx_registry`) is built once per process, and its decomposition pass runs only for
   graphs with ops it has no translation for (:func:`_translate`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import operator
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import sympy
import torch
import torch.fx
from torch.onnx import ONNXProgram

from lightning_ort.engine.fx.dynamic import Symbols, is_symbolic, symbolic_dims, tensor_devices
from lightning_ort.engine.fx.layout import OutputLayout, OutputSpec, normalise_outputs
from lightning_ort.engine.fx.noise import Noise, lift_random_ops
from lightning_ort.engine.fx.passes import placeholders_first
from lightning_ort.engine.once import Once
from lightning_ort.engine.onnx.custom_ops import CUSTOM_TRANSLATIONS
from lightning_ort.engine.onnx.passes import (
    PASSES,
    cast_outputs_to,
    simplify,
)
from lightning_ort.engine.torch_internals import (
    EXPORTER_STEPS,
    ONNX_DEFAULT_OPSET,
    FloorDiv,
    OpOverload,
    detect_fake_mode,
    tensor_operands,
    tracing,
    unset_fake_temporarily,
    untranslated_op,
)
from lightning_ort.errors import ExportError, first_line, node_origin
from lightning_ort.logs import ScopedFilter, get_logger

log = get_logger(__name__)

aten = torch.ops.aten


ONNX_ELEMENT_TYPES: dict[torch.dtype, int] = {
    torch.float32: onnx.TensorProto.FLOAT,
    torch.float16: onnx.TensorProto.FLOAT16,
    torch.bfloat16: onnx.TensorProto.BFLOAT16,
    torch.float64: onnx.TensorProto.DOUBLE,
    torch.int64: onnx.TensorProto.INT64,
    torch.int32: onnx.TensorProto.INT32,
    torch.int16: onnx.TensorProto.INT16,
    torch.int8: onnx.TensorProto.INT8,
    torch.uint8: onnx.TensorProto.UINT8,
    torch.bool: onnx.TensorProto.BOOL,
}
"""The ONNX element type of each PyTorch dtype a graph's inputs and outputs may have."""


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
    carried_sizes: tuple[int, ...] = ()
    """Positions of integer inputs whose values the runner passes as the shape of an empty tensor (see
    :func:`_inline_size_inputs`), after the other tensor inputs."""


def export_graph(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[torch.Tensor],
    name: str,
    verbose: bool,
    views_from: int | None = None,
) -> ExportedGraph:
    """Export ``gm`` (an ATen-level FX graph with static shapes) to ONNX.

    Args:
        gm: the graph (not modified: the export works on a copy).
        example_inputs: one (fake or real) tensor per placeholder.
        name: graph name used in messages and file names (``"forward"``, ``"backward"``...).
        verbose: let ``torch.onnx`` print its progress.
        views_from: index of the first output that may be returned as a view of another value: a forward
            graph's saved tensors, which only the backward graph reads, or 0 for a backward graph, whose
            gradients autograd takes. ``None``: every output reaches the user as a tensor of its own.
    """
    gm = copy_graph_module(gm)
    symbolic = any(is_symbolic(value) for value in example_inputs)
    sizes = any(isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool) for value in example_inputs)
    device = next(iter(tensor_devices(example_inputs)), torch.device("cpu"))
    fake_mode = detect_fake_mode(example_inputs)
    dropped, carried, carrier = _inline_size_inputs(gm, example_inputs, device, fake_mode) if sizes else ((), (), None)
    tensor_inputs = [value for index, value in enumerate(example_inputs) if index not in dropped]
    if carrier is not None:
        tensor_inputs.append(carrier)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        noise, noise_examples = lift_random_ops(gm, device)
    layout, outputs = normalise_outputs(gm, views_from)
    _float64_scalars_as_constants(gm)
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
            program = _translate(gm, inputs, verbose, dynamic_shapes)
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
    cast_outputs_to(model, [ONNX_ELEMENT_TYPES.get(spec.dtype) for spec in outputs])
    done = {step.done: step.rewrite(model) for step in PASSES if device.type in step.devices}
    log.debug(
        "exported %s graph: %d nodes (%s), %d inputs, %d outputs",
        name,
        len(model.graph.node),
        ", ".join(f"{count} {what}" for what, count in done.items()),
        len(inputs),
        len(outputs),
    )
    return ExportedGraph(name, model, noise, outputs, layout, _size_symbols(tensor_inputs), dropped, carried)


def _float64_scalars_as_constants(gm: torch.fx.GraphModule) -> int:
    """Make each Python float that an op on float64 tensors reads as a tensor operand a float64 constant of
    ``gm``, in place; returns how many.

    ``torch.onnx`` writes such a float (``x * 8 ** -0.25`` in attention, GELU's ``1 / sqrt(2)``) as a float32
    constant cast to the tensor's type, so a float64 model would compute with its float32 rounding, 1e-8 off
    where float64 is good to 1e-16. A tensor constant keeps its type and value. Floats that float32 holds
    exactly, and those in ``Scalar`` positions (whose schema takes no tensor), are left as they are.
    """
    replaced = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, OpOverload):
            continue
        reads_float64 = any(
            isinstance(arg, torch.fx.Node)
            and isinstance(arg.meta.get("val"), torch.Tensor)
            and arg.meta["val"].dtype == torch.float64
            for arg in node.args
        )
        if not reads_float64:
            continue
        args = list(node.args)
        for index, (arg, tensor_operand) in enumerate(zip(node.args, tensor_operands(node.target))):
            if not isinstance(arg, float) or not tensor_operand:
                continue
            with unset_fake_temporarily():  # real tensors, also under the capture: the constant is an initializer
                if float(torch.tensor(arg, dtype=torch.float32)) == arg:
                    continue
                name = f"lightning_ort_float64_{replaced}"
                gm.register_buffer(name, torch.tensor(arg, dtype=torch.float64))
            with gm.graph.inserting_before(node):
                args[index] = gm.graph.get_attr(name)
            replaced += 1
        node.args = tuple(args)
    return replaced


def _size_symbols(values: Sequence[Any]) -> Symbols:
    """Where each size symbol of ``values`` can be read: its first ``(value index, dimension)``."""
    symbols: Symbols = {}
    for index, value in enumerate(values):
        for dim, size in enumerate(value.shape if isinstance(value, torch.Tensor) else ()):
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                symbols.setdefault(size.node.expr, (index, dim))
    return symbols


@Once
def onnx_registry() -> Any:
    """The exporter's table of ONNX translations at ``torch.onnx.export``'s default opset, built once.

    ``torch.onnx.export`` builds it again on every call (it indexes every torchlib function); the translation
    never changes it, so one table serves every graph of the process. It has lightning_ort's own ops too
    (:data:`~lightning_ort.engine.onnx.custom_ops.CUSTOM_TRANSLATIONS`). Only asked for where the exporter's
    steps are laid out as expected (:func:`~lightning_ort.engine.torch_internals.exporter_steps`).
    """
    assert EXPORTER_STEPS is not None
    with quiet_exporter(verbose=False):
        registry = EXPORTER_STEPS.registry_class.from_torchlib(opset_version=ONNX_DEFAULT_OPSET)
    for target, translation in CUSTOM_TRANSLATIONS.items():
        registry.register_op(target, translation)
    return registry


def _translate(
    gm: torch.fx.GraphModule, inputs: tuple[Any, ...], verbose: bool, dynamic_shapes: tuple[Any, ...] | None
) -> ONNXProgram | None:
    """``torch.onnx.export(gm, inputs, dynamo=True, optimize=False)``, less the work our graphs do not need.

    ``torch.onnx.export`` traces the graph with ``torch.export``, traces it again to decompose the ops ONNX has
    no translation for, and translates the result with a table of translations it builds for the call. Our
    graphs are core ATen already: when every op of the traced program has a translation, the decomposition
    would change nothing and is skipped, and the table is built once per process (:func:`onnx_registry`).
    Other graphs take the exporter's own path from the traced program on. A ``torch`` whose exporter entry
    point takes other arguments, or whose exporter lacks these steps, gets the public call.
    """
    steps = EXPORTER_STEPS
    if steps is None:
        return torch.onnx.export(
            gm,
            inputs,
            dynamo=True,
            verbose=verbose,
            optimize=False,
            dynamic_shapes=dynamic_shapes,
            custom_translation_table=CUSTOM_TRANSLATIONS,
        )
    registry = onnx_registry()
    program = torch.export.export(gm, inputs, dynamic_shapes=dynamic_shapes, strict=False)
    targets = {node.target for node in program.graph.nodes if node.op == "call_function"}
    if not targets <= _translated_ops():
        return steps.export_core(
            program, registry=registry, verbose=verbose, optimize=False, opset_version=ONNX_DEFAULT_OPSET
        )
    steps.insert_type_promotion_nodes(program.graph_module)
    steps.remove_assertion_nodes(program.graph_module)
    onnx_program = steps.to_onnx_program(program, registry=registry)
    onnx_program.model = steps.convert_version(onnx_program.model, ONNX_DEFAULT_OPSET)
    return onnx_program


@Once
def _translated_ops() -> frozenset[Any]:
    """The ops :func:`onnx_registry` translates, and the checks the exporter removes before translating."""
    assert EXPORTER_STEPS is not None
    return frozenset(EXPORTER_STEPS.implemented_overloads(onnx_registry())) | _ASSERTIONS


_ASSERTIONS = frozenset(
    {
        aten.sym_constrain_range_for_size.default,
        aten._assert_async.default,
        aten._assert_async.msg,
        aten._assert_scalar.default,
        aten._assert_tensor_metadata.default,
    }
)


def _dynamic_dims(value: torch.Tensor) -> dict[int, Any] | None:
    return {dim: torch.export.Dim.DYNAMIC for dim in symbolic_dims(value)} or None


def _concrete(value: torch.Tensor) -> torch.Tensor:
    """A real tensor shaped like ``value`` at the sizes the trace saw (symbolic export needs real inputs)."""
    shape = [size.node.hint if isinstance(size, torch.SymInt) else int(size) for size in value.shape]
    return torch.zeros(shape, dtype=value.dtype, device=value.device)


def _inline_size_inputs(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], device: torch.device, fake_mode: Any
) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor | None]:
    """Replace integer (size) inputs of a dynamic-shape graph by computations on its tensor inputs' sizes.

    AOTAutograd passes sizes the backward needs (``s0``, ``4*s0``) as integer inputs; ONNX inputs are tensors,
    and these sizes are mostly functions of the tensor inputs' shapes anyway. A size that no tensor input has
    (a backward whose inputs are all flattened to ``s0*s1`` but which must give back ``(s0, s1, n)``) is read
    from the shape of one extra, empty input: ``(s0, s1, 0)``, built by the runner from those integers.

    Returns:
        The dropped input positions, the positions of the integers the empty input carries, and its example
        (``None`` when no size needs it), made in ``fake_mode`` (the example inputs' fake tensor mode, if any).
    """
    graph = gm.graph
    placeholders = placeholders_first(graph)
    if not placeholders:
        return (), (), None
    sources = {symbol: (placeholders[index], dim) for symbol, (index, dim) in _size_symbols(example_inputs).items()}
    first_op = next(node for node in graph.nodes if node.op != "placeholder")
    carried = [
        index
        for index, (node, value) in enumerate(zip(placeholders, example_inputs))
        if isinstance(value, torch.SymInt)
        and node.users
        and isinstance(value.node.expr, sympy.Symbol)
        and value.node.expr not in sources
    ]
    carrier = None
    if carried:
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            carrier = torch.empty((*(example_inputs[i] for i in carried), 0), dtype=torch.uint8, device=device)
        with graph.inserting_after(placeholders[-1]):
            holder = graph.placeholder("carried_sizes")
        holder.meta["val"] = carrier
        for dim, index in enumerate(carried):
            sources[example_inputs[index].node.expr] = (holder, dim)
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
    return tuple(dropped), tuple(carried), carrier


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
    with _EXPORTER_LOGS.scope(), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


_EXPORTER_LOGS = ScopedFilter(
    ("torch.onnx", "torch.export", "torch.fx.experimental.symbolic_shapes", "onnxscript", "onnx_ir"),
    keep=lambda record: record.levelno >= logging.ERROR,
)
"""The exporter's progress lines and warnings, dropped during our exports (errors pass)."""


def save_model(model: onnx.ModelProto, path: Path) -> None:
    """Write ``model`` to ``path`` (weights are graph inputs, so the file stays small)."""
    onnx.save_model(model, str(path))
    log.info("saved ONNX model to %s", path)


def _export_failure(gm: torch.fx.GraphModule, name: str, err: Exception) -> ExportError:
    match = untranslated_op(err)
    if match is None:
        return ExportError(
            f"ONNX export of the {name} graph failed: {first_line(err)}\n"
            "Run with DebugOptions(log_level=LogLevel.VERBOSE) for the exporter's full report."
        )
    op_name = f"{match[0]}.{match[1]}"
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == op_name]
    if not nodes:
        base = match[0].rsplit(".", 1)[-1]
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
