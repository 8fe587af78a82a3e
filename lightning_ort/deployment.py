"""A trained model as a portable ONNX file for inference, checked against eager PyTorch before it is handed over.

Training graphs are not deployable: they take the weights as inputs, carry the backward's saved tensors, and
ONNX Runtime's optimizations of them are specific to the machine that built them. This module exports the
module's inference forward with ``torch.onnx.export`` instead: weights become initializers, inputs are named after
``forward``'s parameters and outputs after its return structure, chosen axes stay symbolic, and the file holds no
ONNX Runtime optimization (ONNX Runtime applies those where it loads the file). The file is then loaded into a
fresh CPU ``onnxruntime.InferenceSession`` and its outputs compared with eager PyTorch.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import re
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeAlias

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import torch
from torch import nn
from torch.export import Dim

from lightning_ort.engine.capture.blocks import blocks_unmarked
from lightning_ort.engine.onnx.export import quiet_exporter
from lightning_ort.engine.torch_internals import pytree
from lightning_ort.errors import ExportError, first_line, frame_line, innermost_line
from lightning_ort.logs import get_logger
from lightning_ort.options import unwritable_reason

log = get_logger(__name__)

DynamicShapes: TypeAlias = Literal["batch"] | Mapping[str, Any] | Sequence[Any] | None
"""Which input axes stay symbolic: ``"batch"``, ``None``, or ``torch.export``'s ``dynamic_shapes`` (a mapping
from ``forward``'s parameter names, or a tuple in the order of the arguments), with names or ``Dim``s per axis."""

BATCH = "batch"
EDGE_SIZES = (1, 2)
"""The sizes the check runs every symbolic axis at, besides the example's: the low edge of its range, where
``torch.export`` assumed sizes above 1 and a branch on the size may go the other way."""
RTOL, ATOL = 1e-3, 1e-4
"""The check's tolerance: ``|onnx - eager| <= ATOL * max(1, max|eager|) + RTOL * |eager|`` per element."""


@dataclass(frozen=True)
class DeployedModel:
    """An ONNX file written by :func:`export_for_deployment`: where it is, what it takes and returns, how it checked.

    Args:
        path: the ``.onnx`` file (its external data, if any, lies beside it).
        inputs: input names and shapes, symbolic axes by name (``{"x": ("batch", 16)}``).
        outputs: output names and shapes.
        max_error: the largest difference from eager PyTorch over the check's runs; ``None`` when not checked.
        checked_shapes: the input shapes the check ran, one tuple per run: the example, the example with its
            symbolic axes doubled, then at sizes 1 and 2 (runs eager PyTorch cannot take are left out).

    Example:
        >>> DeployedModel(Path("m.onnx"), {"x": ("batch", 4)}, {"output": ("batch", 2)}, 1e-7, ()).input_names
        ['x']
    """

    path: Path
    inputs: dict[str, tuple[int | str, ...]]
    outputs: dict[str, tuple[int | str, ...]]
    max_error: float | None
    checked_shapes: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def input_names(self) -> list[str]:
        return list(self.inputs)

    @property
    def output_names(self) -> list[str]:
        return list(self.outputs)


def export_for_deployment(
    module: nn.Module,
    path: str | os.PathLike[str],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    dynamic_shapes: DynamicShapes = "batch",
    check: bool = True,
    external_data: bool | None = None,
) -> DeployedModel:
    """Write ``module``'s inference forward (eval mode, no gradients) to ``path`` as a self-contained ONNX model.

    ``module`` runs in eval mode for the export and gets its train/eval mode back afterwards. A Hugging Face
    model (one with ``config.use_cache``) is exported with ``use_cache=False`` unless the example sets it: a cache
    object is not an ONNX output.

    Args:
        module: the trained module (not an ORTModule: pass its ``module``).
        path: the ``.onnx`` file to write; missing folders are created. Checked before any work.
        args: example positional arguments of ``forward``.
        kwargs: example keyword arguments of ``forward``.
        dynamic_shapes: ``"batch"`` (default): axis 0 is symbolic, named ``batch``, in the first tensor input
            and in every tensor input whose axis 0 has the same size, where the model allows (an axis the model
            narrows, by a branch on the size or a parameter per row, stays static, logged at INFO level).
            ``None``: every axis is static. Or ``torch.export``'s format: a mapping from ``forward``'s parameter
            names (or a tuple in the order of the arguments) to ``{axis: name}`` or a tuple with one entry per
            axis, nested like the argument for dicts and lists of tensors. An entry is a name
            (``{"input_ids": {0: "batch", 1: "sequence"}}``), a ``torch.export.Dim`` (named after it, within its
            ``min`` and ``max``), ``Dim.DYNAMIC``, ``Dim.AUTO`` (symbolic where the model allows), or ``None`` /
            ``Dim.STATIC``. An axis asked to be symbolic (all but ``Dim.AUTO``) that the model narrows is an
            error naming the guard and its source line.
        check: load the file into a fresh CPU ``onnxruntime.InferenceSession`` and compare its outputs with eager
            PyTorch on the example, with its symbolic axes doubled, and with them at sizes 1 and 2. A file that
            fails the check is not left at ``path``.
        external_data: store the weights in a separate ``<file>.data``: ``None`` (default) does so above 2 GB,
            the protobuf limit.

    Returns:
        The file, its inputs and outputs, and the check's largest difference from eager.

    Raises:
        ExportError: ``torch.onnx.export`` failed (the error names the reason), an axis asked to be symbolic is
            narrowed by the model, or the check found outputs that differ from eager.
        ValueError: ``path`` cannot be written, ``dynamic_shapes`` names a parameter ``forward`` does not have,
            or the example arguments do not fit ``forward``.

    Example:
        >>> import tempfile
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> deployed = export_for_deployment(model, Path(tempfile.mkdtemp()) / "m.onnx", (torch.randn(3, 4),))
        >>> deployed.inputs, deployed.outputs
        ({'input': ('batch', 4)}, {'output': ('batch', 2)})
        >>> deployed.checked_shapes
        (((3, 4),), ((6, 4),), ((1, 4),), ((2, 4),))
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"export_for_deployment(module=...) takes a torch.nn.Module, got {type(module).__name__}.")
    path = check_export_target(path, "path")
    owner = type(module).__name__
    example = _Example.bind(module, args, _without_cache(module, kwargs))
    spec, wanted = _dynamic_spec(example, dynamic_shapes)
    known: dict[tuple[tuple[int, ...], ...], Any] = {}  # eager's outputs by input shapes, for the check
    with _eval_mode(module):
        expected = _eager(module, example)
        if dynamic_shapes == BATCH and wanted:
            doubled = example.doubled(wanted)
            output = _try_eager(module, doubled)
            if output is not None:
                known[doubled.shapes] = output[0]
            else:
                log.info("%s takes only batches of %d: exported with a static batch axis", owner, example.batch)
                spec, wanted = None, {}
        program = _export(module, example, spec, owner)
    graph = program.model.graph
    _name_outputs(graph, expected)
    _name_axes(program, wanted, owner, lambda index, axis: _guards_on(module, example, spec, index, axis))
    inputs = {str(value.name): _shape(value) for value in graph.inputs}
    outputs = {str(value.name): _shape(value) for value in graph.outputs}
    with tempfile.TemporaryDirectory(prefix=".lightning_ort_export_", dir=path.parent) as staging:
        staged = Path(staging) / path.name
        program.save(staged, external_data=external_data)
        if not check:
            _move_into_place(staged, path)
            return DeployedModel(path, inputs, outputs, None, ())
        known[example.shapes] = expected
        lows = {wish.name: wish.low for wish in wanted.values()}
        largest, shapes = _check_file(module, staged, example, known, inputs, outputs, lows, owner)
        _move_into_place(staged, path)
    log.info("%s: wrote %s (%s -> %s), largest difference from eager %.2e", owner, path, inputs, outputs, largest)
    return DeployedModel(path, inputs, outputs, largest, shapes)


def check_export_target(path: str | os.PathLike[str], argument: str, folder: bool = False) -> Path:
    """``path`` as a ``Path`` once it is known to be writable as a file (or, with ``folder``, as a folder).

    Missing folders on the way are created. Called before any work, so that a bad path fails at once.

    Raises:
        ValueError: ``path`` is a folder where a file is needed, or cannot be written; the error names
            ``argument`` and what stands in the way.

    Example:
        >>> check_export_target("/proc/deploy/model.onnx", "path")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: path='/proc/deploy/model.onnx' cannot be written: No such file or directory. Pass a path in a ...
    """
    path = Path(path)
    if not folder and path.is_dir():
        raise ValueError(
            f"{argument}={str(path)!r} is a folder; pass the path of the .onnx file to write ({path / 'model.onnx'})."
        )
    blocking = next((parent for parent in [path, *path.parents] if parent.exists() and not parent.is_dir()), None)
    if blocking is not None and (blocking != path or folder):
        raise ValueError(
            f"{argument}={str(path)!r} cannot be written: {blocking} is a file, not a folder. Pass a path in a "
            "folder you can write to."
        )
    reason = unwritable_reason(path if folder else path.parent)
    if reason is not None:
        raise ValueError(
            f"{argument}={str(path)!r} cannot be written: {reason}. Pass a path in a folder you can write to."
        )
    return path


def _move_into_place(staged: Path, path: Path) -> None:
    """Move the checked file (and its external data, named after it) from the staging folder to ``path``."""
    for produced in staged.parent.iterdir():
        os.replace(produced, path.parent / produced.name)


def _without_cache(module: nn.Module, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``kwargs`` with ``use_cache=False`` added for a Hugging Face model whose ``forward`` takes it."""
    kwargs = dict(kwargs or {})
    config = getattr(module, "config", None)
    takes = "use_cache" in inspect.signature(module.forward).parameters
    if takes and getattr(config, "use_cache", False) and "use_cache" not in kwargs:
        kwargs["use_cache"] = False
    return kwargs


def _check_file(
    module: nn.Module,
    path: Path,
    example: _Example,
    known: Mapping[tuple[tuple[int, ...], ...], Any],
    inputs: Mapping[str, tuple[int | str, ...]],
    outputs: Mapping[str, tuple[int | str, ...]],
    lows: Mapping[str, int],
    owner: str,
) -> tuple[float, tuple[tuple[tuple[int, ...], ...], ...]]:
    """Run the file at ``path`` on the check's inputs against eager ``module``; the largest difference, the shapes.

    The runs: the example; its symbolic axes doubled (eager must take that, or the axes should not be
    symbolic); the symbolic axes at each of :data:`EDGE_SIZES`, counted from the lowest size declared for them in
    ``lows`` (left out where eager PyTorch refuses them). ``known`` holds eager's outputs already computed, by
    input shapes.
    """
    symbolic = {
        (index, axis): lows.get(size, 0)
        for index, shape in enumerate(inputs.values())
        for axis, size in enumerate(shape)
        if isinstance(size, str) and size.isidentifier()
    }
    runs = [(example, known[example.shapes])]
    if symbolic:
        doubled = example.doubled(symbolic)
        with _eval_mode(module):
            reference = known.get(doubled.shapes)
            if reference is None:
                reference = _eager_on_doubled_axes(module, doubled, owner)
            runs.append((doubled, reference))
            for size in EDGE_SIZES:
                edge = example.resized({where: max(size, low + size - 1) for where, low in symbolic.items()})
                if any(edge.shapes == run.shapes for run, _ in runs):
                    continue
                output = _try_eager(module, edge)
                if output is None:
                    log.info("%s: eager PyTorch does not take its symbolic axes at size %d; not checked", owner, size)
                else:
                    runs.append((edge, output[0]))
    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as error:  # ONNX Runtime raises its own types: no kernel, an invalid graph
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters()} - {"float32"})
        hint = (
            f" ONNX Runtime's CPU provider has few kernels for {', '.join(dtypes)} parameters: export a float32 copy "
            "for CPU deployment (`copy.deepcopy(model).float()`), or"
            if dtypes
            else " Please report this with the file attached, or"
        )
        raise ExportError(
            f"{owner}: ONNX Runtime's CPU provider cannot load the exported file, so it was not checked against "
            f"eager PyTorch: {first_line(error)}.{hint} pass check=False to write it unchecked, for a provider "
            "that has these kernels."
        ) from error
    largest = max(_check(session, path, run, reference, outputs, owner) for run, reference in runs)
    return largest, tuple(run.shapes for run, _ in runs)


TRAINING_ONLY_ARGUMENTS = ("labels",)
"""Arguments a model takes only to compute its loss (Hugging Face's ``labels``): left out of deployment files."""

AXIS_NAMES = {0: BATCH, 1: "sequence"}
"""Names in the file of the axes declared in ``dynamic_axes``, by axis; later axes are named ``axis_<n>``."""


@dataclass(frozen=True)
class ExportSpec:
    """What ``export_onnx=`` writes at the end of ``fit``: where, which inputs, and which axes symbolic.

    The example is the network's first call of the fit, cut down to the inference signature: the inputs the file
    takes, and outputs without a loss.

    Args:
        path: a ``.onnx`` file or a folder (see :class:`~lightning_ort.ORTConfig`'s ``export_onnx``).
        inputs: the names of ``forward``'s parameters the file takes, from the first call's arguments
            (``["input_ids", "attention_mask"]``). Default: every argument of the first call except
            :data:`TRAINING_ONLY_ARGUMENTS`.
        dynamic_shapes: as :func:`export_for_deployment` takes it. Default ``"auto"``: the axes the wrapped
            network declares in ``dynamic_axes`` (named ``batch`` for axis 0, ``sequence`` for axis 1, ``axis_<n>``
            after), with axis 0 of the other inputs of the same batch size as ``batch``; without ``dynamic_axes``,
            ``"batch"``.
        check: compare the file with eager PyTorch before keeping it (see :func:`export_for_deployment`).

    Example:
        >>> x, y = torch.ones(3, 2), torch.zeros(3)
        >>> ExportSpec("deploy").example(nn.Linear(2, 2), (x,), {"labels": y})[1].keys()
        dict_keys(['input'])
    """

    path: str | os.PathLike[str]
    inputs: Sequence[str] | None = None
    dynamic_shapes: DynamicShapes | Literal["auto"] = "auto"
    check: bool = True

    def example(
        self, network: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments of ``network``'s recorded call kept for the file: :attr:`inputs`, or all but the loss's.

        Raises:
            ValueError: :attr:`inputs` names an argument the call did not pass.
        """
        signature = inspect.signature(network.forward)
        kinds = {p.kind for p in signature.parameters.values()}
        if kinds & {inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL}:
            named: dict[str, Any] = dict(kwargs)
            positional = tuple(args)
        else:
            named, positional = {**signature.bind_partial(*args).arguments, **kwargs}, ()
        if self.inputs is None:
            return positional, {k: v for k, v in named.items() if k not in TRAINING_ONLY_ARGUMENTS}
        missing = [name for name in self.inputs if name not in named]
        if missing:
            raise ValueError(
                f"export_onnx: inputs={list(self.inputs)} names {missing}, which the first call of "
                f"{type(network).__name__} did not pass; it passed {list(named)}."
            )
        return positional, {name: named[name] for name in self.inputs}

    def shapes_for(self, kwargs: Mapping[str, Any], dynamic_axes: Mapping[str, Sequence[int]]) -> DynamicShapes:
        """The ``dynamic_shapes`` of the file for the example ``kwargs`` and the network's ``dynamic_axes``.

        Example:
            >>> ids = torch.zeros(2, 5, dtype=torch.long)
            >>> ExportSpec("m.onnx").shapes_for({"input_ids": ids, "mask": ids}, {"input_ids": [0, 1]})
            {'input_ids': {0: 'batch', 1: 'sequence'}, 'mask': {0: 'batch'}}
        """
        if self.dynamic_shapes != "auto":
            return self.dynamic_shapes
        declared = {name: axes for name, axes in dynamic_axes.items() if isinstance(kwargs.get(name), torch.Tensor)}
        if not declared:
            return BATCH
        shapes: dict[str, dict[int, str]] = {
            name: {axis: AXIS_NAMES.get(axis, f"axis_{axis}") for axis in axes} for name, axes in declared.items()
        }
        batches = {int(kwargs[name].shape[0]) for name, axes in declared.items() if 0 in axes}
        for name, value in kwargs.items():
            if name not in shapes and isinstance(value, torch.Tensor) and value.dim() and value.shape[0] in batches:
                shapes[name] = {0: BATCH}
        return shapes


class FirstCall:
    """Keeps detached copies of the arguments of ``module``'s first call, the example of a later export.

    A forward pre-hook records the first call and removes itself; later calls cost nothing.

    Example:
        >>> model = nn.Linear(4, 2)
        >>> first = FirstCall(model)
        >>> _ = model(torch.ones(3, 4)), model(torch.zeros(5, 4))
        >>> first.args[0].shape, first.kwargs
        (torch.Size([3, 4]), {})
    """

    def __init__(self, module: nn.Module) -> None:
        self._args: tuple[Any, ...] | None = None
        self._kwargs: dict[str, Any] = {}
        self._handle = module.register_forward_pre_hook(self._record, with_kwargs=True)

    @property
    def called(self) -> bool:
        """Whether the module has been called since this recorder was made."""
        return self._args is not None

    @property
    def args(self) -> tuple[Any, ...]:
        return self._args if self._args is not None else ()

    @property
    def kwargs(self) -> dict[str, Any]:
        return self._kwargs

    def _record(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._args, self._kwargs = pytree.tree_map(_detached_copy, (tuple(args), dict(kwargs)))
        self._handle.remove()

    def remove(self) -> None:
        """Stop waiting for the first call."""
        self._handle.remove()


def _detached_copy(leaf: Any) -> Any:
    return leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf


@dataclass(frozen=True)
class _Example:
    """Example arguments of ``forward``, keyword arguments in the signature's order where it has names for all."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @classmethod
    def bind(cls, module: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> _Example:
        signature = inspect.signature(module.forward)
        try:
            bound = signature.bind(*args, **(kwargs or {}))
        except TypeError as error:
            raise ValueError(
                f"The example arguments do not fit {type(module).__name__}.forward{signature}: {error}. Pass the "
                "arguments of one forward call (a batch as the model takes it)."
            ) from error
        kinds = {p.kind for p in signature.parameters.values()}
        if kinds & {inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL}:
            return cls(tuple(args), dict(kwargs or {}))
        named = dict(bound.arguments)
        extra = named.pop(next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), ""), {})
        return cls((), {**named, **extra})

    @property
    def batch(self) -> int | None:
        """Axis 0's size in the first tensor that has axes: the batch size, where the model takes batches."""
        return next((int(t.shape[0]) for t in self.tensors if t.dim() > 0), None)

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shapes of :attr:`tensors`."""
        return tuple(tuple(t.shape) for t in self.tensors)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The tensors of the arguments in ``torch.export``'s order: the ONNX model's inputs."""
        return [leaf for leaf in pytree.tree_leaves((self.args, self.kwargs)) if isinstance(leaf, torch.Tensor)]

    def doubled(self, axes: Iterable[tuple[int, int]]) -> _Example:
        """The example with each ``(tensor index, axis)`` of ``axes`` repeated twice along that axis."""
        tensors = self.tensors
        return self.resized({(index, axis): 2 * tensors[index].shape[axis] for index, axis in axes})

    def resized(self, sizes: Mapping[tuple[int, int], int]) -> _Example:
        """The example with each ``(tensor index, axis)`` of ``sizes`` cut (or repeated, then cut) to its size."""
        chosen: dict[int, list[tuple[int, int]]] = {}
        for (index, axis), size in sizes.items():
            chosen.setdefault(index, []).append((axis, size))
        counter = iter(range(len(self.tensors)))

        def resize(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            for axis, size in chosen.get(next(counter), ()):
                repeats = -(-size // leaf.shape[axis])
                leaf = torch.cat([leaf] * repeats, dim=axis).narrow(axis, 0, size)
            return leaf

        args, kwargs = pytree.tree_map(resize, (self.args, self.kwargs))
        return _Example(args, kwargs)


@dataclass(frozen=True)
class _Axis:
    """A symbolic axis asked for: its name in the file, whether the model may fix it, and the range declared."""

    name: str
    required: bool
    low: int = 0
    high: float = float("inf")


def _dynamic_spec(example: _Example, dynamic_shapes: DynamicShapes) -> tuple[Any, dict[tuple[int, int], _Axis]]:
    """``torch.export``'s ``dynamic_shapes`` for ``example``, and the axes wanted symbolic per (input, axis).

    Named axes become ``Dim.AUTO`` (symbolic where the model allows) and get their names in the file afterwards;
    ``Dim`` objects are passed on with their range. Whether the model narrowed an axis is judged afterwards,
    against the range asked for.
    """
    if isinstance(dynamic_shapes, str) and dynamic_shapes != BATCH:
        raise ValueError(
            f"dynamic_shapes={dynamic_shapes!r}: pass 'batch', None, or torch.export's dynamic_shapes (a mapping "
            "from forward's parameter names, or a tuple in the order of the arguments, to {axis: name or Dim})."
        )
    wanted: dict[tuple[int, int], _Axis] = {}
    counter = iter(range(len(example.tensors)))
    batch = example.batch

    def batch_axis(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return None
        index = next(counter)
        if leaf.dim() == 0 or leaf.shape[0] != batch:
            return None
        wanted[(index, 0)] = _Axis(BATCH, required=False)
        return {0: Dim.AUTO}

    if dynamic_shapes is None:
        return None, wanted
    if isinstance(dynamic_shapes, str):
        spec = pytree.tree_map(batch_axis, (example.args, example.kwargs))
        return (spec[0] if example.args else spec[1]), wanted
    names = [f"args[{i}]" for i in range(len(example.args))] if example.args else list(example.kwargs)
    values = list(example.args) if example.args else list(example.kwargs.values())
    if isinstance(dynamic_shapes, Mapping):
        if example.args:
            raise ValueError(
                "dynamic_shapes by parameter name needs a forward whose parameters all have names; this forward "
                "takes positional-only or *args parameters. Pass a tuple in the order of the arguments, 'batch' "
                "or None."
            )
        unknown = set(dynamic_shapes) - set(example.kwargs)
        if unknown:
            raise ValueError(
                f"dynamic_shapes names {sorted(unknown)}, which are not arguments of this forward call; its "
                f"arguments are {list(example.kwargs)}."
            )
        per_argument = [dynamic_shapes.get(name) for name in names]
    elif isinstance(dynamic_shapes, Sequence):
        if len(dynamic_shapes) != len(names):
            raise ValueError(
                f"dynamic_shapes has {len(dynamic_shapes)} entries for {len(names)} arguments ({names}): give one "
                "per argument, in order (None for an argument with no symbolic axis)."
            )
        per_argument = list(dynamic_shapes)
    else:
        raise ValueError(
            f"dynamic_shapes={dynamic_shapes!r}: pass 'batch', None, or torch.export's dynamic_shapes (a mapping "
            "from forward's parameter names, or a tuple in the order of the arguments, to {axis: name or Dim})."
        )
    specs = [_named_axes(value, axes, name, wanted, counter) for name, value, axes in zip(names, values, per_argument)]
    return (tuple(specs) if example.args else dict(zip(names, specs))), wanted


def _named_axes(value: Any, axes: Any, where: str, wanted: dict[tuple[int, int], _Axis], counter: Iterator[int]) -> Any:
    """One argument's ``dynamic_shapes`` entry, walking ``axes`` alongside the argument's structure."""
    if isinstance(value, torch.Tensor):
        index = next(counter)
        if axes is None:
            return None
        if isinstance(axes, (list, tuple)):
            if len(axes) != value.dim():
                raise ValueError(
                    f"dynamic_shapes[{where!r}] has {len(axes)} entries for a {value.dim()}-d tensor: give one per "
                    "axis, or a mapping {axis: name}."
                )
            axes = dict(enumerate(axes))
        if not isinstance(axes, Mapping):
            raise ValueError(
                f"dynamic_shapes[{where!r}] must map axis numbers to names or torch.export.Dim, got {axes!r}."
            )
        spec: dict[int, Any] = {}
        for axis, entry in axes.items():
            if not isinstance(axis, int) or not -value.dim() <= axis < value.dim():
                raise ValueError(
                    f"dynamic_shapes[{where!r}]: axis {axis!r} is not an axis of a {value.dim()}-d tensor."
                )
            axis %= value.dim()
            wish = _axis_wish(entry, f"{where}_dim{axis}", where)
            if wish is not None:
                wanted[(index, axis)] = wish
                spec[axis] = entry if _is_dim(entry) else Dim.AUTO if isinstance(entry, str) else entry
        return spec or None
    if isinstance(value, Mapping):
        keyed = axes if isinstance(axes, Mapping) else {}
        return {k: _named_axes(v, keyed.get(k), f"{where}.{k}", wanted, counter) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        listed = list(axes) if isinstance(axes, (list, tuple)) else [None] * len(value)
        return type(value)(
            _named_axes(v, a, f"{where}.{i}", wanted, counter) for i, (v, a) in enumerate(zip(value, listed))
        )
    for _ in (leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)):
        next(counter)
    return None


def _axis_wish(entry: Any, default_name: str, where: str) -> _Axis | None:
    """What one axis entry of ``dynamic_shapes`` asks for: a symbolic axis, or ``None`` for a static one."""
    if entry is None or entry == Dim.STATIC:
        return None
    if isinstance(entry, str):
        return _Axis(entry, required=True)
    if entry == Dim.AUTO:
        return _Axis(default_name, required=False)
    if entry == Dim.DYNAMIC:
        return _Axis(default_name, required=True)
    if _is_dim(entry):
        return _Axis(str(entry.__name__), required=True, low=int(entry.min), high=float(entry.max))
    raise ValueError(
        f"dynamic_shapes[{where!r}]: {entry!r} is not a name, a torch.export.Dim, Dim.AUTO, Dim.DYNAMIC, "
        "Dim.STATIC or None."
    )


def _is_dim(entry: Any) -> bool:
    """Whether ``entry`` is a ``torch.export.Dim`` (a named axis with a range)."""
    return not isinstance(entry, str) and all(hasattr(entry, name) for name in ("__name__", "min", "max"))


@contextlib.contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode while in use; its train/eval mode given back after."""
    training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(training)


def _eager(module: nn.Module, example: _Example) -> Any:
    """What ``module`` computes on ``example``, detached: the reference the file is compared with.

    It runs with autograd on, as training does, so that it computes what the file holds: with gradients off,
    PyTorch takes inference fast paths the exported graph does not have (``nn.TransformerEncoder``'s nested
    tensors give padded positions other values than the math the file carries).
    """
    with torch.enable_grad():
        output = module(*example.args, **example.kwargs)
    return pytree.tree_map(lambda leaf: leaf.detach() if isinstance(leaf, torch.Tensor) else leaf, output)


def _try_eager(module: nn.Module, example: _Example) -> tuple[Any] | None:
    """Eager ``module``'s output on ``example`` (in a 1-tuple), or ``None`` if the model refuses these shapes."""
    try:
        return (_eager(module, example),)
    except Exception:  # any failure means the model cannot take these shapes
        return None


def _eager_on_doubled_axes(module: nn.Module, example: _Example, owner: str) -> Any:
    """Eager ``module``'s output on ``example``, the check's run with the symbolic axes doubled."""
    try:
        return _eager(module, example)
    except Exception as error:  # the model itself refuses these sizes
        shapes = [tuple(t.shape) for t in example.tensors]
        raise ExportError(
            f"{owner}: the check runs the model with its symbolic axes doubled (inputs of shapes {shapes}), and "
            f"eager PyTorch fails there: {first_line(error)}. The model does not take other sizes on those axes: "
            "leave them static (dynamic_shapes=None), or name only the axes that vary."
        ) from error


def _export(module: nn.Module, example: _Example, spec: Any, owner: str) -> torch.onnx.ONNXProgram:
    """``torch.onnx.export`` of ``module`` on ``example``; its output is kept off the console unless DEBUG logs.

    ``torch.export`` prints the partial graph of a failed trace to stderr; the error names the line instead.
    """
    verbose = log.isEnabledFor(logging.DEBUG)
    try:
        with (
            quiet_exporter(verbose),
            contextlib.redirect_stderr(sys.stderr if verbose else io.StringIO()),
            blocks_unmarked(module),
        ):
            program = torch.onnx.export(
                module,
                example.args,
                kwargs=example.kwargs,
                dynamo=True,
                dynamic_shapes=spec,
                optimize=True,
                verbose=False,
            )
    except Exception as error:  # torch.export and the exporter raise many types
        where = innermost_line(str(_root(error)))
        raise ExportError(
            f"{owner} could not be exported to ONNX for deployment: {first_line(_root(error))}"
            + (f", at {where}" if where else "")
            + ". The outputs must be tensors, or lists, tuples and dicts of them; control flow must not depend on "
            "tensor values (express the branch with torch.where, or export the branch you deploy)."
        ) from error
    assert program is not None
    return program


def _root(error: BaseException) -> BaseException:
    """The innermost cause: the exporter wraps torch.export's error in its own."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def _name_outputs(graph: ir.Graph, expected: Any) -> None:
    """Name the graph's outputs after the paths of ``forward``'s tensors (``logits``, ``output_0``, ``output``)."""
    paths = [path for path, leaf in pytree.tree_flatten_with_path(expected)[0] if isinstance(leaf, torch.Tensor)]
    if len(paths) != len(graph.outputs):
        return
    names = [_output_name(path) for path in paths]
    for value, name in zip(graph.outputs, names, strict=True):
        value.name = name


def _output_name(path: tuple[Any, ...]) -> str:
    if not path:
        return "output"
    parts = [str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))) for key in path]
    if isinstance(path[0], pytree.SequenceKey):
        parts[0] = f"output_{parts[0]}"
    return ".".join(parts)


def _name_axes(
    program: torch.onnx.ONNXProgram,
    wanted: Mapping[tuple[int, int], _Axis],
    owner: str,
    guards: Callable[[int, int], list[str]],
) -> None:
    """Give the symbolic axes the names asked for, in every shape of the graph; make narrowed axes static.

    ``torch.export`` narrows an axis's range where the model constrains it (a branch on the size, a parameter per
    batch row), yet the exporter leaves it symbolic: the file would then compute one branch for every size. An
    axis narrowed below the range asked for is made static at the example's size, or, where it was asked for
    explicitly, is an error naming the guards that narrowed it and their source lines (``guards(input, axis)``).
    """
    graph = program.model.graph
    exported = program.exported_program
    assert exported is not None, "torch.onnx.export(dynamo=True) keeps the ExportedProgram"
    placeholders = _user_placeholders(exported)
    renames: dict[str, str] = {}
    for (index, axis), wish in wanted.items():
        value = graph.inputs[index]
        size = placeholders[index].meta["val"].shape[axis]
        example = int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)
        narrowed = _narrowing(exported, size, wish)
        dim = value.shape[axis] if value.shape is not None else None
        if narrowed is None and isinstance(dim, ir.SymbolicDim) and dim.value is not None:
            renames.setdefault(dim.value, wish.name)
            continue
        where = f"axis {axis} of input `{value.name}`"
        if wish.required:
            found = guards(index, axis)
            raise ExportError(
                f"{owner}: {where} was asked to be symbolic ({wish.name!r}), but the model "
                f"{narrowed or f'fixes it to {example}'} while tracing"
                + (f": {'; '.join(found)}" if found else "")
                + ". Leave the axis static, declare the range the model takes (torch.export.Dim(name, min=..., "
                "max=...)), or remove what narrows it."
            )
        log.info("%s: %s stays %d: the model %s", owner, where, example, narrowed or "fixes it")
        if isinstance(dim, ir.SymbolicDim) and dim.value is not None:
            renames[dim.value] = str(example)
        elif value.shape is not None:
            value.shape = ir.Shape([example if i == axis else d for i, d in enumerate(value.shape)])
    if renames:
        _rename_dims(graph, renames)


def _narrowing(exported: torch.export.ExportedProgram, size: Any, wish: _Axis) -> str | None:
    """How ``torch.export`` narrowed ``size`` (an input's dimension) below ``wish``'s range, or ``None``.

    The full range starts at 2: ``torch.export`` assumes sizes above 1 for every symbolic axis (the check runs
    sizes 1 and 2 for what that misses).
    """
    if not isinstance(size, torch.SymInt):
        return f"fixes it to {int(size)}"
    bounds = exported.range_constraints.get(size.node.expr)
    if bounds is None:
        return None
    low, high = int(bounds.lower), float(bounds.upper)
    if low <= max(2, wish.low) and high >= wish.high:
        return None
    return (
        f"fixes it to {low}"
        if low == high
        else f"narrows it to [{low}, {'inf' if high == float('inf') else int(high)}]"
    )


def _guards_on(module: nn.Module, example: _Example, spec: Any, index: int, axis: int) -> list[str]:
    """The guards ``torch.export`` records on input ``index``'s ``axis``, each with its source line.

    The exporter's decompositions start a new shape environment without the guards, so this traces ``module``
    once more (only to explain an error). Sizes appear as ``x.shape[0]``.
    """
    try:
        with warnings.catch_warnings(), blocks_unmarked(module), _eval_mode(module):
            warnings.simplefilter("ignore")
            exported = torch.export.export(
                module, example.args, example.kwargs, dynamic_shapes=_automatic(spec), strict=False
            )
    except Exception:  # the explanation is optional; the caller's error stands without it
        return []
    placeholders = _user_placeholders(exported)
    size = placeholders[index].meta["val"].shape[axis]
    shape_env = getattr(getattr(size, "node", None), "shape_env", None)
    symbols = size.node.expr.free_symbols if isinstance(size, torch.SymInt) else set()
    named = {str(symbol): f"{placeholders[index].name}.shape[{axis}]" for symbol in symbols}
    found = []
    for guard in getattr(shape_env, "guards", ()):
        if symbols and not guard.expr.free_symbols & symbols:
            continue
        user = getattr(getattr(guard, "sloc", None), "maybe_user_loc", None)
        frame = getattr(getattr(guard, "sloc", None), "framework_loc", None)
        where = user or (frame_line(frame) if isinstance(frame, traceback.FrameSummary) else None)
        if where:
            text = re.sub(r"\b\w+\b", lambda m: named.get(m.group(0), m.group(0)), str(guard.expr))
            found.append(f"guard `{text}` at {where}")
    return found


def _user_placeholders(exported: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    """The placeholders of ``exported`` for ``forward``'s inputs (not its parameters and buffers), in order."""
    user_inputs = set(exported.graph_signature.user_inputs)
    return [node for node in exported.graph.nodes if node.op == "placeholder" and node.name in user_inputs]


def _automatic(spec: Any) -> Any:
    """``spec`` with each ``Dim`` replaced by ``Dim.AUTO``, so that tracing records guards instead of failing."""
    if isinstance(spec, Mapping):
        return {key: _automatic(value) for key, value in spec.items()}
    if isinstance(spec, (list, tuple)):
        return type(spec)(_automatic(value) for value in spec)
    return Dim.AUTO if _is_dim(spec) else spec


def _rename_dims(graph: ir.Graph, renames: Mapping[str, str]) -> None:
    """Rename the symbols of ``renames`` in every shape of ``graph`` (in expressions such as ``s1*s2`` too).

    A symbol renamed to a number (an axis made static) becomes that size where it stands alone."""
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, renames)) + r")\b")
    values = [*graph.inputs, *graph.outputs, *(v for node in graph.all_nodes() for v in node.outputs)]
    for value in values:
        if value.shape is None:
            continue
        dims = [
            _renamed(pattern.sub(lambda m: renames[m.group(1)], d.value))
            if isinstance(d, ir.SymbolicDim) and d.value is not None
            else d
            for d in value.shape
        ]
        value.shape = ir.Shape(dims)


def _renamed(dim: str) -> int | ir.SymbolicDim:
    """A renamed dimension: an ``int`` where a symbol was replaced by a size, else still symbolic."""
    return int(dim) if dim.isdigit() else ir.SymbolicDim(dim)


def _shape(value: ir.Value) -> tuple[int | str, ...]:
    if value.shape is None:
        return ()
    return tuple(d if isinstance(d, int) else str(d.value) for d in value.shape)


def _check(
    session: ort.InferenceSession,
    path: Path,
    example: _Example,
    reference: Any,
    outputs: Mapping[str, Any],
    owner: str,
) -> float:
    """Run the file's ``session`` on ``example``; the largest difference from ``reference``, eager's output."""
    shapes = [tuple(t.shape) for t in example.tensors]
    expected = [leaf for leaf in pytree.tree_leaves(reference) if isinstance(leaf, torch.Tensor)]
    feeds = {meta.name: _numpy(t, meta.name) for meta, t in zip(session.get_inputs(), example.tensors, strict=True)}
    produced = session.run(None, feeds)
    worst = 0.0
    for name, actual, tensor in zip(outputs, produced, expected, strict=True):
        want = tensor.detach().cpu()
        got = torch.from_numpy(np.asarray(actual))
        if tuple(got.shape) != tuple(want.shape):
            raise ExportError(
                f"{owner}: the exported model's output `{name}` has shape {tuple(got.shape)} on inputs of shapes "
                f"{shapes}, eager PyTorch {tuple(want.shape)}: the file would be wrong for these shapes, so it was "
                f"not written to {path.name}. Export with dynamic_shapes=None, or name the axes that vary."
            )
        if not want.is_floating_point():
            if not torch.equal(got, want):
                raise ExportError(
                    f"{owner}: the exported model's output `{name}` differs from eager PyTorch in "
                    f"{int((got != want).sum())} element(s) on inputs of shapes {shapes}."
                )
            continue
        defined = ~want.isnan()  # where eager computes NaN (a fully masked row), there is nothing to compare
        want64, got64 = want.double()[defined], got.double()[defined]
        scale = max(1.0, float(want64.abs().max())) if want64.numel() else 1.0
        diff = (got64 - want64).abs().nan_to_num(nan=float("inf"))
        largest = float(diff.max()) if diff.numel() else 0.0
        worst = max(worst, largest)
        if not bool((diff <= ATOL * scale + RTOL * want64.abs()).all()):
            raise ExportError(
                f"{owner}: the exported model's output `{name}` differs from eager PyTorch by up to {largest:.3g} on "
                f"inputs of shapes {shapes} (tolerance {ATOL:g} x {scale:.3g} + {RTOL:g} x |eager|), so it was not "
                f"written to {path.name}. Find why before deploying it: a branch on a size or on a tensor's value "
                "(export with dynamic_shapes=None), or random ops in eval mode."
            )
    return worst


def _numpy(tensor: torch.Tensor, name: str) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        raise ExportError(
            f"The check feeds input `{name}` to ONNX Runtime through NumPy, which has no bfloat16. Pass check=False "
            "and check the file with ONNX Runtime's OrtValue API, or export with a float32 example."
        )
    return tensor.detach().cpu().numpy()
