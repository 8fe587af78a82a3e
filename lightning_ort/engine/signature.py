"""Flatten user arguments and outputs into tensors plus a structure, and build graph cache keys."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

_CONSTANT_TYPES = (bool, int, float, type(None), torch.dtype, torch.device)


class TensorMeta(NamedTuple):
    """What about a tensor decides which graph runs it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        return cls(tuple(tensor.shape), tensor.dtype, tensor.device, tensor.requires_grad)


@dataclass(frozen=True)
class FlatInputs:
    """The tensors of a call plus a hashable description of everything else.

    Python scalars, bools and ``None`` are part of ``structure``: a call with a different value uses
    (or builds) a different graph, exactly as tracing would specialise on them.

    Example:
        >>> flat = FlatInputs.from_call(["x", "scale"], (torch.ones(2),), {"scale": 2.0})
        >>> len(flat.tensors), flat.rebuild(flat.tensors)[1]
        (1, {'scale': 2.0})
    """

    tensors: tuple[torch.Tensor, ...]
    structure: tuple[Any, ...]

    @classmethod
    def from_call(cls, parameter_names: Sequence[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> FlatInputs:
        """Flatten ``forward(*args, **kwargs)``; ``parameter_names`` name positional arguments in errors."""
        tensors: list[torch.Tensor] = []
        arg_specs = tuple(
            _flatten_input(value, parameter_names[i] if i < len(parameter_names) else f"args[{i}]", tensors)
            for i, value in enumerate(args)
        )
        kwarg_specs = tuple((key, _flatten_input(value, key, tensors)) for key, value in kwargs.items())
        return cls(tuple(tensors), (arg_specs, kwarg_specs))

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Put ``tensors`` (same order as :attr:`tensors`) back into ``(args, kwargs)``."""
        arg_specs, kwarg_specs = self.structure
        it = iter(tensors)
        args = tuple(_unflatten_input(spec, it) for spec in arg_specs)
        kwargs = {key: _unflatten_input(spec, it) for key, spec in kwarg_specs}
        return args, kwargs


def forward_parameter_names(module: torch.nn.Module) -> list[str]:
    """Names of ``module.forward``'s positional parameters, for error messages."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _flatten_input(value: Any, path: str, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise TypeError(
                f"ORTModule got argument `{path}` as a {value.layout} tensor; ONNX Runtime takes dense tensors. "
                f"Pass `{path}.to_dense()` instead."
            )
        if value.is_nested or value.is_quantized or value.is_complex():
            kind = "nested" if value.is_nested else "quantized" if value.is_quantized else "complex"
            raise TypeError(f"ORTModule got argument `{path}` as a {kind} tensor, which ONNX Runtime cannot take.")
        tensors.append(value)
        return ("tensor",)
    if isinstance(value, _CONSTANT_TYPES):
        return ("const", type(value), value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return (
            "namedtuple",
            type(value),
            tuple(_flatten_input(v, f"{path}.{f}", tensors) for f, v in zip(value._fields, value)),
        )
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_flatten_input(v, f"{path}[{i}]", tensors) for i, v in enumerate(value)))
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, (str, int)):
                raise TypeError(f"ORTModule got a dict argument `{path}` with key {key!r}; use str or int keys.")
        items = tuple((k, _flatten_input(v, f"{path}[{k!r}]", tensors)) for k, v in value.items())
        return ("dict", type(value), items)
    raise TypeError(
        f"ORTModule got argument `{path}` of type {type(value).__name__}, which it cannot pass to ONNX Runtime. "
        "Supported: tensors, None, bool, int, float, and lists/tuples/dicts of them. "
        f"Convert `{path}` to a tensor, or compute it outside the wrapped module."
    )


def _unflatten_input(spec: Any, tensors: Iterator[torch.Tensor]) -> Any:
    kind = spec[0]
    if kind == "tensor":
        return next(tensors)
    if kind == "const":
        return spec[2]
    if kind == "namedtuple":
        return spec[1](*(_unflatten_input(s, tensors) for s in spec[2]))
    if kind in ("list", "tuple"):
        values = [_unflatten_input(s, tensors) for s in spec[1]]
        return values if kind == "list" else tuple(values)
    return spec[1]((k, _unflatten_input(s, tensors)) for k, s in spec[2])


@dataclass
class FlatOutputs:
    """A module's output split into tensors and a function putting them back.

    Handles tensors, ``None`` and other constants, lists, tuples, namedtuples, dicts and dataclasses
    (Hugging Face ``ModelOutput`` included).

    Example:
        >>> flat = FlatOutputs.from_output({"logits": torch.ones(1), "n": 3})
        >>> flat.rebuild([torch.zeros(1)])
        {'logits': tensor([0.]), 'n': 3}
    """

    tensors: list[torch.Tensor]
    rebuild: Callable[[Sequence[torch.Tensor]], Any]

    @classmethod
    def from_output(cls, output: Any) -> FlatOutputs:
        tensors: list[torch.Tensor] = []
        builder = _flatten_output(output, tensors)
        return cls(tensors, lambda values: builder(iter(values)))


def _flatten_output(value: Any, tensors: list[torch.Tensor]) -> Callable[[Iterator[torch.Tensor]], Any]:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return next
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = [f.name for f in dataclasses.fields(value) if getattr(value, f.name) is not None]
        builders = [_flatten_output(getattr(value, name), tensors) for name in names]
        cls = type(value)
        return lambda it: cls(**{name: build(it) for name, build in zip(names, builders)})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        builders = [_flatten_output(v, tensors) for v in value]
        nt_cls = type(value)
        return lambda it: nt_cls(*(build(it) for build in builders))
    if isinstance(value, (list, tuple)):
        builders = [_flatten_output(v, tensors) for v in value]
        seq_cls = type(value)
        return lambda it: seq_cls(build(it) for build in builders)
    if isinstance(value, dict):
        keys = list(value)
        builders = [_flatten_output(value[k], tensors) for k in keys]
        dict_cls = type(value)
        return lambda it: dict_cls((k, build(it)) for k, build in zip(keys, builders))
    return lambda it: value
