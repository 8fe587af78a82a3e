"""Output layout of exported graphs: which FX outputs ONNX Runtime produces, and how the rest are rebuilt.

ONNX drops ``None`` gradients and needs unique output names, and ONNX Runtime would copy an output that is
one of the graph's inputs or a reshape of another value. :func:`normalise_outputs` keeps only the tensor
outputs ONNX Runtime must compute, once each; :class:`OutputLayout` puts every FX output back in its place
after a run: ONNX outputs, inputs passed through, reshapes of either, and size expressions.
:class:`GradientStrides` gives a backward graph's gradients their parameters' strides where those differ from
row-major ones on dimensions of size 1 only.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, cast

import sympy
import torch
import torch.fx

from lightning_ort.engine.fx.dynamic import Size, evaluate, symbolic_shape, symbolic_size
from lightning_ort.errors import ExportError

aten = torch.ops.aten


@dataclass(frozen=True)
class PassedInput:
    """An FX output that is one of the graph's inputs, returned as is (ONNX Runtime would copy it)."""

    index: int


@dataclass(frozen=True)
class ReshapedOutput:
    """An FX output that is a reshape of an ONNX output or a passed-through input, rebuilt after the run.

    ONNX Runtime's ``Reshape`` cannot alias a graph output, so returning the reshape copies the tensor (a
    language model's logits: the whole vocabulary's scores for every token). A saved tensor, which only the
    backward graph reads, is rebuilt as a view of its base. A user's output (``own``) is rebuilt as a tensor of its
    own over the base's memory, which nothing else holds: what the user gets is what ONNX Runtime's copy was, a
    tensor that is nobody's view, without the copy.
    """

    base: int | PassedInput
    shape: tuple[Size, ...]
    own: bool = False


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
        shape = tuple(evaluate(size, env) for size in source.shape)
        if source.own:
            return _tensor_over(base, shape)
        return base.view(shape)
    return evaluate(source, env)


@dataclass(frozen=True)
class OutputSpec:
    shape: tuple[Size, ...]
    dtype: torch.dtype


def normalise_outputs(gm: torch.fx.GraphModule, views_from: int | None) -> tuple[OutputLayout, list[OutputSpec]]:
    """Keep ``gm``'s tensor outputs ONNX Runtime must compute, once each, and say where every output comes from.

    Outputs from index ``views_from`` on that reshape another value are returned as views of it (see
    :class:`ReshapedOutput`) where nothing else returns that value or another view of it: two gradients sharing
    one buffer would each see the other's in-place updates. A forward graph's saved tensors (``views_from`` > 0),
    which only the backward graph reads, may all view one value: ONNX Runtime would copy each further view (a
    decoder's normalized hidden states, saved once for each projection that reads them). An output before
    ``views_from`` that reshapes a value ONNX Runtime computes and no other output returns or reshapes becomes a
    tensor of its own over that value's memory.
    """
    output_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = output_node.args[0]
    values = list(values) if isinstance(values, (list, tuple)) else [values]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    computed = [v for v in values if isinstance(v, torch.fx.Node) and v.op != "placeholder"]
    own_tensor = set(values[:views_from] if views_from is not None else values)
    bases = [_reshape_base(v) if isinstance(v, torch.fx.Node) else None for v in values]
    saved = range(views_from, len(values)) if views_from else range(0)
    shared = Counter(base for i, base in enumerate(bases) if base is not None and i not in saved)
    shared.update({base for i, base in enumerate(bases) if base is not None and i in saved})
    returned = set(own_tensor) | {base for base, views in shared.items() if views > 1}
    in_values = {value for value in values if isinstance(value, torch.fx.Node)}
    unique: list[torch.fx.Node] = []

    def tensor_source(node: torch.fx.Node) -> int | PassedInput:
        if node.op == "placeholder" and computed:
            return PassedInput(placeholders.index(node))
        if node not in unique:
            unique.append(node)
        return unique.index(node)

    sources: list[Source] = []
    for value, base in zip(values, bases):
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
        if base is not None and base not in returned:
            shape = symbolic_shape(value.meta["val"].shape)
            if value not in own_tensor:
                sources.append(ReshapedOutput(tensor_source(base), shape))
                continue
            if base.op != "placeholder" and base not in in_values:
                sources.append(ReshapedOutput(tensor_source(base), shape, own=True))
                continue
        sources.append(tensor_source(value))
    if not unique and (views := [i for i, source in enumerate(sources) if isinstance(source, ReshapedOutput)]):
        # Every output is a view of an input: ONNX Runtime cannot load a graph that computes nothing, so the
        # first view is computed there after all.
        unique.append(values[views[0]])
        sources[views[0]] = 0
    output_node.args = (tuple(unique),)
    gm.graph.eliminate_dead_code()
    specs = [OutputSpec(symbolic_shape(n.meta["val"].shape), n.meta["val"].dtype) for n in unique]
    return OutputLayout(tuple(sources)), specs


def _reshape_base(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor that ``node`` reshapes (through a chain of reshapes), or ``None`` if it is no reshape.

    An ``expand`` to its input's own shape counts as one (a batched matmul's operand, which ATen expands to the
    batch shape it already has, and attention saves for its backward). ONNX outputs and the inputs bound to ONNX
    Runtime are contiguous, so a view of the base always exists.
    """
    base = node
    while _is_reshape(base):
        base = cast(torch.fx.Node, base.args[0])
    return None if base is node else base


def _is_reshape(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    if node.target is aten.expand.default:
        value, source = node.meta.get("val"), node.args[0].meta.get("val")
        if not isinstance(value, torch.Tensor) or not isinstance(source, torch.Tensor):
            return False
        return symbolic_shape(value.shape) == symbolic_shape(source.shape)
    return node.target in _RESHAPES


_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default}


def row_major(size: object, stride: object) -> bool:
    """Whether ``stride`` (static) is the row-major layout of ``size``, ignoring the stride of size-1 dimensions."""
    if not isinstance(size, (list, tuple)) or not isinstance(stride, (list, tuple)) or len(size) != len(stride):
        return False
    if not all(isinstance(value, int) for value in (*size, *stride)):
        return False
    expected = 1
    for extent, step in zip(reversed(size), reversed(stride), strict=True):
        if extent != 1 and step != expected:
            return False
        expected *= extent
    return True


def _tensor_over(base: torch.Tensor, shape: Sequence[int], stride: Sequence[int] | None = None) -> torch.Tensor:
    """A tensor of its own (no ``_base``) over ``base``'s memory with ``shape`` and ``stride`` (row-major if
    ``None``): what a graph output would have been, without copying the memory ONNX Runtime wrote."""
    layout = _row_major_strides(shape) if stride is None else stride
    return base.new_empty((0,)).set_(base.untyped_storage(), base.storage_offset(), shape, layout)


def _row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(math.prod(shape[dim + 1 :]) for dim in range(len(shape)))


GRADIENT_STRIDES = "lightning_ort_gradient_strides"
"""``GraphModule.meta`` key of a backward graph: :func:`gradient_strides` of its outputs."""


def gradient_strides(primals: Sequence[Any], backward: torch.fx.GraphModule) -> dict[int, tuple[int, ...]]:
    """The backward graph's gradients whose parameters' strides differ from row-major ones on dimensions of size 1
    only: output index -> the parameter's strides (static shapes).

    The backward graph returns one gradient per forward input (``primals``, in order). PyTorch gives a gradient
    its parameter's strides; a channels-last model's 1x1 and depthwise convolution weights (``[64, 32, 1, 1]``
    with strides ``(32, 1, 32, 32)``) differ from row-major ones on a dimension of size 1 only, so autograd takes
    ONNX Runtime's row-major gradient as it is, and DDP, which compares a gradient's strides with its bucket's,
    warns that they do not match and copies the gradient on every step.

    Example:
        >>> graph = torch.fx.Graph()
        >>> grad = graph.placeholder("grad")
        >>> grad.meta["val"] = torch.empty(4, 8, 1, 1)
        >>> _ = graph.output((grad, None))
        >>> weight = torch.empty(4, 8, 1, 1).to(memory_format=torch.channels_last)
        >>> gradient_strides([weight, torch.empty(3)], torch.fx.GraphModule({}, graph))
        {0: (8, 1, 8, 8)}
    """
    output = next(n for n in reversed(backward.graph.nodes) if n.op == "output")
    grads = output.args[0] if isinstance(output.args[0], (list, tuple)) else (output.args[0],)
    if len(grads) != len(primals):
        return {}
    strides: dict[int, tuple[int, ...]] = {}
    for index, (primal, grad) in enumerate(zip(primals, grads)):
        if not (isinstance(primal, torch.Tensor) and isinstance(grad, torch.fx.Node)):
            continue
        value = grad.meta.get("val")
        shape, stride = tuple(primal.shape), tuple(primal.stride())
        if not (isinstance(value, torch.Tensor) and tuple(value.shape) == shape and row_major(shape, stride)):
            continue
        if stride != _row_major_strides(shape):
            strides[index] = stride
    return strides


class GradientStrides:
    """Runs a backward graph and gives the gradients of :func:`gradient_strides` their parameters' strides, each a
    tensor of its own over the memory the graph wrote (no copy).

    Called like the runner it wraps (AOTAutograd's boxed convention).

    Args:
        runner: the backward graph's runner.
        strides: output index -> strides.
    """

    def __init__(self, runner: Callable[[list[Any]], list[Any]], strides: dict[int, tuple[int, ...]]) -> None:
        # An instance attribute, so that TorchDynamo's wrapper around backward graphs copies it (functools.wraps).
        self._boxed_call = True
        self._runner = runner
        self._strides = strides

    def __call__(self, args: list[Any]) -> list[Any]:
        outputs = list(self._runner(args))
        for index, stride in self._strides.items():
            grad = outputs[index]
            if isinstance(grad, torch.Tensor) and grad.is_contiguous() and grad.stride() != stride:
                outputs[index] = _tensor_over(grad, grad.shape, stride)
        return outputs
