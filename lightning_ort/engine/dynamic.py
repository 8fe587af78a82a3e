"""Dynamic input shapes: which dimensions to capture as symbols, and when a symbolic graph may be reused.

With ``dynamic=None`` (automatic) an ORTModule first builds a graph for the exact shapes it sees; when a call
differs from an earlier signature only in some input sizes, those dimensions (:func:`changed_dims`) become
symbols and one graph serves every later size. ``dynamic=True`` makes every input dimension symbolic at once.
A symbolic graph is captured under :func:`symbolic_inputs`; :class:`ShapeGuards` then decides, per call,
whether it applies: sizes that stayed static must match, and the conditions the trace assumed about the
symbols (PyTorch's shape guards, e.g. ``s0 <= 16`` from slicing a 16-row table) must hold.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TypeAlias

import sympy
import torch
from torch._dynamo.source import LocalSource, TensorProperty
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatefulSymbolicContext

DynamicDims: TypeAlias = frozenset[tuple[int, int]]
"""``(input tensor index, dimension)`` pairs captured as symbols."""

Shapes: TypeAlias = tuple[tuple[int, ...], ...]


def changed_dims(seen: Sequence[Shapes], shapes: Shapes) -> DynamicDims:
    """Dimensions whose size in ``shapes`` differs from at least one earlier call's.

    Example:
        >>> sorted(changed_dims([((8, 12), (8,))], ((8, 20), (8,))))
        [(0, 1)]
    """
    return frozenset(
        (index, dim)
        for old in seen
        for index, (before, now) in enumerate(zip(old, shapes))
        for dim, (a, b) in enumerate(zip(before, now))
        if a != b
    )


def all_dims(shapes: Shapes) -> DynamicDims:
    """Every dimension of every input tensor (``dynamic=True``)."""
    return frozenset((index, dim) for index, shape in enumerate(shapes) for dim in range(len(shape)))


@contextlib.contextmanager
def symbolic_inputs(tensors: Sequence[torch.Tensor], dims: DynamicDims, first_input: int) -> Iterator[ShapeEnv]:
    """Make AOTAutograd fakify ``tensors[first_input:]`` with symbols for ``dims`` (other sizes stay static).

    Yields the shape environment that will hold the symbols and the guards the trace adds.
    """
    shape_env = ShapeEnv()
    context = TracingContext(FakeTensorMode(shape_env=shape_env))
    for index, tensor in enumerate(tensors[first_input:]):
        sizes = [DimDynamic.DYNAMIC if (index, d) in dims else DimDynamic.STATIC for d in range(tensor.dim())]
        context.tensor_to_context[tensor] = StatefulSymbolicContext(
            dynamic_sizes=sizes, tensor_source=LocalSource(f"{_INPUT_PREFIX}{index}")
        )
    with tracing(context):
        yield shape_env


_INPUT_PREFIX = "lightning_ort_input_"


class ShapeGuards:
    """Whether a graph captured with symbolic sizes applies to a call's input tensors.

    Args:
        shape_env: the shape environment of the capture (see :func:`symbolic_inputs`), after tracing.
        shapes: the input shapes of the call the graph was built from.
        dims: the dimensions captured as symbols.
    """

    def __init__(self, shape_env: ShapeEnv, shapes: Shapes, dims: DynamicDims) -> None:
        self._shape_env = shape_env
        self._shapes = shapes
        self._symbols: dict[tuple[int, int], sympy.Symbol] = {}
        for symbol, sources in shape_env.var_to_sources.items():
            for source in sources:
                name = getattr(getattr(source, "base", None), "local_name", "")
                dim = getattr(source, "idx", None)
                is_size = getattr(source, "prop", None) == TensorProperty.SIZE
                if is_size and name.startswith(_INPUT_PREFIX) and isinstance(dim, int):
                    self._symbols.setdefault((int(name.removeprefix(_INPUT_PREFIX)), dim), symbol)
        self._dims = frozenset(dim for dim in dims if dim in self._symbols)

    @property
    def symbolic_dims(self) -> DynamicDims:
        """The dimensions that really are symbols (a size of 0 or 1, or one the model fixes, stays static)."""
        return self._dims

    def accepts(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether the graph computes the right thing for inputs of these sizes."""
        if len(tensors) != len(self._shapes):
            return False
        env: dict[sympy.Symbol, int] = {}
        for index, (tensor, shape) in enumerate(zip(tensors, self._shapes)):
            if tensor.dim() != len(shape):
                return False
            for dim, (actual, expected) in enumerate(zip(tensor.shape, shape)):
                if (index, dim) in self._dims:
                    env[self._symbols[(index, dim)]] = actual
                elif actual != expected:
                    return False
        shape_env = self._shape_env
        for symbol, value in env.items():
            bounds = shape_env.var_to_range.get(symbol)
            if bounds is not None and not (bounds.lower <= value <= bounds.upper):
                return False
            replacement = shape_env.replacements.get(symbol)
            if (
                replacement is not None
                and replacement.free_symbols <= env.keys()
                and int(replacement.xreplace(env)) != value
            ):
                return False
        return all(
            guard.expr.free_symbols <= env.keys() and bool(guard.expr.xreplace(env)) for guard in shape_env.guards
        )


def symbolic_size(size: int | torch.SymInt) -> sympy.Expr | int:
    """A size as an ``int`` or, if symbolic, its sympy expression."""
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        return int(expr) if expr.is_Integer else expr
    return int(size)


def evaluate(size: sympy.Expr | int, env: dict[sympy.Symbol, int]) -> int:
    """The value of a (possibly symbolic) size for the symbol values ``env``."""
    if isinstance(size, int):
        return size
    return int(size.xreplace(env))
