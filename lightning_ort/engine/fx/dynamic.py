"""Symbolic sizes in exported graphs: a size as a sympy expression of input-size symbols, and its value per call.

TorchDynamo decides which input dimensions are symbolic (automatic dynamic shapes, or ``dynamic=True``) and
guards the graphs it compiles; an ONNX graph with symbolic dimensions then computes its output sizes and the
shapes of its lifted random inputs from these expressions, evaluated on each call's input sizes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias

import sympy
import torch

Size: TypeAlias = int | sympy.Expr
"""A tensor size: an ``int``, or an expression of input-size symbols in a graph with dynamic shapes."""

Symbols: TypeAlias = dict[sympy.Symbol, tuple[int, int]]
"""Where each size symbol is read at run time: ``(ONNX input index, dimension)``."""


def symbolic_size(size: int | torch.SymInt) -> sympy.Expr | int:
    """A size as an ``int`` or, if symbolic, its sympy expression."""
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        return int(expr) if expr.is_Integer else expr
    return int(size)


def symbolic_dims(value: torch.Tensor) -> list[int]:
    """The dimensions of ``value`` whose size is symbolic."""
    return [dim for dim, size in enumerate(value.shape) if not isinstance(symbolic_size(size), int)]


def tensor_devices(values: Iterable[Any]) -> set[torch.device]:
    """The devices a graph with example inputs ``values`` computes on.

    A 0-dim CPU tensor counts only where no tensor lives elsewhere: PyTorch lets such a tensor take part in the
    ops of any device, and TorchDynamo passes the Python floats it does not specialise (``dynamic=True``: a
    ``LayerNorm``'s ``eps``) as 0-dim float64 CPU tensors beside a CUDA model's tensors.

    Example:
        >>> tensor_devices([torch.ones(2), torch.tensor(1e-5, dtype=torch.float64), 3])
        {device(type='cpu')}
    """
    tensors = [value for value in values if isinstance(value, torch.Tensor) and value.device.type != "meta"]
    devices = {value.device for value in tensors if value.dim() > 0 or value.device.type != "cpu"}
    return devices or {value.device for value in tensors}


def is_symbolic(value: object) -> bool:
    """Whether ``value`` (a graph's example input) is a symbolic integer or a tensor with a symbolic size."""
    if isinstance(value, torch.SymInt):
        return not isinstance(symbolic_size(value), int)
    return isinstance(value, torch.Tensor) and bool(symbolic_dims(value))


def evaluate(size: sympy.Expr | int, env: dict[sympy.Symbol, int]) -> int:
    """The value of a (possibly symbolic) size for the symbol values ``env``."""
    if isinstance(size, int):
        return size
    return int(size.xreplace(env))


def symbolic_shape(shape: Sequence[int | torch.SymInt]) -> tuple[Size, ...]:
    """A shape as sizes: ``int`` where static, sympy expressions where symbolic."""
    return tuple(symbolic_size(size) for size in shape)
