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
import logging
import os
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeAlias

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.export import Dim

from lightning_ort.engine.blocks import blocks_unmarked
from lightning_ort.errors import ExportError, first_line

log = logging.getLogger(__name__)

DynamicShapes: TypeAlias = Literal["batch"] | Mapping[str, Any] | None
"""Which input axes stay symbolic: ``"batch"``, a mapping from ``forward``'s parameter names, or ``None``."""

BATCH = "batch"
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
        checked_shapes: the input shapes the check ran, one tuple per run (the example, then the example with its
            named symbolic axes doubled).

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

    ``module`` runs in eval mode for the export and gets its train/eval mode back afterwards.

    Args:
        module: the trained module (not an ORTModule: pass its ``module``).
        path: the ``.onnx`` file to write; missing folders are created.
        args: example positional arguments of ``forward``.
        kwargs: example keyword arguments of ``forward``.
        dynamic_shapes: ``"batch"`` (default): axis 0 is symbolic, named ``batch``, in the first tensor input
            and in every tensor input whose axis 0 has the same size, where the model allows (an axis the model
            fixes stays static, logged at INFO level). ``None``: every axis is static. A mapping from
            ``forward``'s parameter names to ``{axis: name}`` (``{"input_ids": {0: "batch", 1: "sequence"}}``),
            nested like the argument for dicts and lists of tensors; ``torch.export.Dim`` objects are accepted in
            place of names. An axis asked for by name that the model fixes is an error.
        check: load the file into a fresh CPU ``onnxruntime.InferenceSession`` and compare its outputs with eager
            PyTorch on the example, and again with each of its named symbolic axes doubled.
        external_data: store the weights in a separate ``<file>.data``: ``None`` (default) does so above 2 GB,
            the protobuf limit.

    Returns:
        The file, its inputs and outputs, and the check's largest difference from eager.

    Raises:
        ExportError: ``torch.onnx.export`` failed (the error names the reason), an axis asked to be symbolic is
            fixed by the model, or the check found outputs that differ from eager PyTorch.
        ValueError: ``dynamic_shapes`` names a parameter ``forward`` does not have, or the example arguments do
            not fit ``forward``.

    Example:
        >>> import tempfile
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> deployed = export_for_deployment(model, Path(tempfile.mkdtemp()) / "m.onnx", (torch.randn(3, 4),))
        >>> deployed.inputs, deployed.outputs
        ({'input': ('batch', 4)}, {'output': ('batch', 2)})
        >>> deployed.checked_shapes
        (((3, 4),), ((6, 4),))
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"export_for_deployment(module=...) takes a torch.nn.Module, got {type(module).__name__}.")
    path = Path(path)
    owner = type(module).__name__
    example = _Example.bind(module, args, kwargs)
    spec, wanted = _dynamic_spec(example, dynamic_shapes)
    on_doubled_batch: tuple[frozenset[tuple[int, int]], Any] | None = None  # eager's output, for the check
    with _eval_mode(module):
        expected = _eager(module, example)
        if dynamic_shapes == BATCH and wanted:
            takes, output = _try_eager(module, example.doubled(wanted))
            if takes:
                on_doubled_batch = (frozenset(wanted), output)
            else:
                log.info("%s takes only batches of %d: exported with a static batch axis", owner, example.batch)
                spec, wanted = None, {}
        program = _export(module, example, spec, owner)
    graph = program.model.graph
    _name_outputs(graph, expected)
    _name_axes(program, wanted, owner)
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(path, external_data=external_data)
    inputs = {str(value.name): _shape(value) for value in graph.inputs}
    outputs = {str(value.name): _shape(value) for value in graph.outputs}
    if not check:
        return DeployedModel(path, inputs, outputs, None, ())
    runs = [(example, expected)]
    names = {name for name, _ in wanted.values()}
    symbolic = [
        (index, axis)
        for index, shape in enumerate(inputs.values())
        for axis, size in enumerate(shape)
        if isinstance(size, str) and size in names
    ]
    if symbolic:
        doubled = example.doubled(symbolic)
        if on_doubled_batch is not None and on_doubled_batch[0] == frozenset(symbolic):
            runs.append((doubled, on_doubled_batch[1]))
        else:
            runs.append((doubled, _eager_on_doubled_axes(module, doubled, owner)))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    largest = max(_check(session, path, run, reference, outputs, owner) for run, reference in runs)
    shapes = tuple(tuple(tuple(t.shape) for t in run.tensors) for run, _ in runs)
    log.info("%s: wrote %s (%s -> %s), largest difference from eager %.2e", owner, path, inputs, outputs, largest)
    return DeployedModel(path, inputs, outputs, largest, shapes)


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
    def tensors(self) -> list[torch.Tensor]:
        """The tensors of the arguments in ``torch.export``'s order: the ONNX model's inputs."""
        return [leaf for leaf in pytree.tree_leaves((self.args, self.kwargs)) if isinstance(leaf, torch.Tensor)]

    def doubled(self, axes: Iterable[tuple[int, int]]) -> _Example:
        """The example with each ``(tensor index, axis)`` of ``axes`` repeated twice along that axis."""
        chosen: dict[int, list[int]] = {}
        for index, axis in axes:
            chosen.setdefault(index, []).append(axis)
        counter = iter(range(len(self.tensors)))

        def double(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            for axis in chosen.get(next(counter), ()):
                leaf = torch.cat([leaf, leaf], dim=axis)
            return leaf

        args, kwargs = pytree.tree_map(double, (self.args, self.kwargs))
        return _Example(args, kwargs)


def _dynamic_spec(
    example: _Example, dynamic_shapes: DynamicShapes
) -> tuple[Any, dict[tuple[int, int], tuple[str, bool]]]:
    """``torch.export``'s ``dynamic_shapes`` for ``example``, and the axis names wanted per (input, axis).

    Names become ``Dim.AUTO`` (symbolic where the model allows) and are given to the ONNX axes afterwards; the
    flag says whether a name was asked for explicitly (a fixed axis is then an error).
    """
    if dynamic_shapes is not None and dynamic_shapes != BATCH and not isinstance(dynamic_shapes, Mapping):
        raise ValueError(
            f"dynamic_shapes={dynamic_shapes!r}: pass 'batch', None, or a mapping from forward's parameter names to "
            "{axis: name} ({'input_ids': {0: 'batch', 1: 'sequence'}})."
        )
    if example.args and dynamic_shapes not in (None, BATCH):
        raise ValueError(
            "dynamic_shapes by parameter name needs a forward whose parameters all have names; this forward takes "
            "positional-only or *args parameters. Use dynamic_shapes='batch' or None."
        )
    wanted: dict[tuple[int, int], tuple[str, bool]] = {}
    counter = iter(range(len(example.tensors)))
    batch = example.batch

    def batch_axis(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return None
        index = next(counter)
        if leaf.dim() == 0 or leaf.shape[0] != batch:
            return None
        wanted[(index, 0)] = (BATCH, False)
        return {0: Dim.AUTO}

    if dynamic_shapes is None:
        return None, wanted
    if isinstance(dynamic_shapes, str):
        spec = pytree.tree_map(batch_axis, (example.args, example.kwargs))
        return (spec[0] if example.args else spec[1]), wanted
    unknown = set(dynamic_shapes) - set(example.kwargs)
    if unknown:
        raise ValueError(
            f"dynamic_shapes names {sorted(unknown)}, which are not arguments of this forward call; its arguments "
            f"are {list(example.kwargs)}."
        )
    named = {
        name: _named_axes(value, dynamic_shapes.get(name), name, wanted, counter)
        for name, value in example.kwargs.items()
    }
    return named, wanted


def _named_axes(
    value: Any, axes: Any, where: str, wanted: dict[tuple[int, int], tuple[str, bool]], counter: Iterator[int]
) -> Any:
    """One argument's ``dynamic_shapes`` entry, walking ``axes`` alongside the argument's structure."""
    if isinstance(value, torch.Tensor):
        index = next(counter)
        if axes is None:
            return None
        if not isinstance(axes, Mapping):
            raise ValueError(f"dynamic_shapes[{where!r}] must map axis numbers to names, got {axes!r}.")
        spec: dict[int, Any] = {}
        for axis, name in axes.items():
            if not isinstance(axis, int) or not -value.dim() <= axis < value.dim():
                raise ValueError(
                    f"dynamic_shapes[{where!r}]: axis {axis!r} is not an axis of a {value.dim()}-d tensor."
                )
            axis %= value.dim()
            if isinstance(name, str):
                wanted[(index, axis)] = (name, True)
                spec[axis] = Dim.AUTO
            else:
                spec[axis] = name
        return spec
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
    """What ``module`` returns on ``example``, without gradients."""
    with torch.no_grad():
        return module(*example.args, **example.kwargs)


def _try_eager(module: nn.Module, example: _Example) -> tuple[bool, Any]:
    """Whether eager ``module`` runs on ``example``, and its output if it does."""
    try:
        return True, _eager(module, example)
    except Exception:  # any failure means the model cannot take these shapes
        return False, None


def _eager_on_doubled_axes(module: nn.Module, example: _Example, owner: str) -> Any:
    """Eager ``module``'s (eval mode) output on ``example``, the check's run with the symbolic axes doubled."""
    try:
        with _eval_mode(module):
            return _eager(module, example)
    except Exception as error:  # the model itself refuses these sizes
        shapes = [tuple(t.shape) for t in example.tensors]
        raise ExportError(
            f"{owner}: the check runs the model with its symbolic axes doubled (inputs of shapes {shapes}), and "
            f"eager PyTorch fails there: {first_line(error)}. The model does not take other sizes on those axes: "
            "leave them static (dynamic_shapes=None), or name only the axes that vary."
        ) from error


def _export(module: nn.Module, example: _Example, spec: Any, owner: str) -> torch.onnx.ONNXProgram:
    try:
        with warnings.catch_warnings(), blocks_unmarked(module):
            warnings.simplefilter("ignore")
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
        raise ExportError(
            f"{owner} could not be exported to ONNX for deployment: {first_line(_root(error))}. The outputs must be "
            "tensors, or lists, tuples and dicts of them (a Hugging Face model needs use_cache=False among the "
            "example arguments); control flow must not depend on tensor values."
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


def _name_axes(program: torch.onnx.ONNXProgram, wanted: dict[tuple[int, int], tuple[str, bool]], owner: str) -> None:
    """Give the symbolic axes the names asked for, in every shape of the graph.

    An axis the model fixes (``torch.export`` narrowed its range to one size: a branch on the size, a parameter
    per batch row) is made static in the file (the exporter leaves it symbolic), or fails where it was asked for
    by name.
    """
    graph = program.model.graph
    exported = program.exported_program
    assert exported is not None, "torch.onnx.export(dynamo=True) keeps the ExportedProgram"
    user_inputs = set(exported.graph_signature.user_inputs)
    placeholders = [n for n in exported.graph.nodes if n.op == "placeholder" and n.name in user_inputs]
    renames: dict[str, str] = {}
    for (index, axis), (name, required) in wanted.items():
        value = graph.inputs[index]
        fixed = _fixed_size(exported, placeholders[index].meta["val"].shape[axis])
        dim = value.shape[axis] if value.shape is not None else None
        if fixed is None and isinstance(dim, ir.SymbolicDim) and dim.value is not None:
            renames.setdefault(dim.value, name)
            continue
        if required:
            raise ExportError(
                f"{owner}: axis {axis} of input `{value.name}` was asked to be symbolic ({name!r}), but the model "
                f"fixes it to {fixed if fixed is not None else dim} while tracing (a branch on the size, a parameter "
                "or a reshape per position). Leave the axis static, or remove what fixes it."
            )
        log.info("%s: axis %d of input `%s` stays %s: the model fixes it", owner, axis, value.name, fixed)
        if fixed is not None and value.shape is not None:
            value.shape = ir.Shape([fixed if i == axis else d for i, d in enumerate(value.shape)])
    if renames:
        _rename_dims(graph, renames)


def _fixed_size(exported: torch.export.ExportedProgram, size: Any) -> int | None:
    """The one size ``torch.export`` allows for ``size`` (an input's dimension), or ``None`` if it can vary."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    bounds = exported.range_constraints.get(size.node.expr)
    if bounds is not None and bounds.lower == bounds.upper:
        return int(bounds.lower)
    return None


def _rename_dims(graph: ir.Graph, renames: Mapping[str, str]) -> None:
    """Rename the symbols of ``renames`` in every shape of ``graph`` (in expressions such as ``s1*s2`` too)."""
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, renames)) + r")\b")
    values = [*graph.inputs, *graph.outputs, *(v for node in graph.all_nodes() for v in node.outputs)]
    for value in values:
        if value.shape is None:
            continue
        dims = [
            ir.SymbolicDim(pattern.sub(lambda m: renames[m.group(1)], d.value))
            if isinstance(d, ir.SymbolicDim) and d.value is not None
            else d
            for d in value.shape
        ]
        value.shape = ir.Shape(dims)


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
                f"{shapes}, eager PyTorch {tuple(want.shape)}. {path} is wrong "
                "for these shapes: export with dynamic_shapes=None, or name the axes that vary."
            )
        if not want.is_floating_point():
            if not torch.equal(got, want):
                raise ExportError(
                    f"{owner}: the exported model's output `{name}` differs from eager PyTorch in "
                    f"{int((got != want).sum())} element(s) on inputs of shapes {shapes}."
                )
            continue
        want64, got64 = want.double(), got.double()
        scale = max(1.0, float(want64.abs().max())) if want64.numel() else 1.0
        diff = (got64 - want64).abs()
        largest = float(diff.max()) if diff.numel() else 0.0
        worst = max(worst, largest)
        if not bool((diff <= ATOL * scale + RTOL * want64.abs()).all()):
            raise ExportError(
                f"{owner}: the exported model's output `{name}` differs from eager PyTorch by up to {largest:.3g} on "
                f"inputs of shapes {shapes} (tolerance {ATOL:g} x {scale:.3g} "
                f"+ {RTOL:g} x |eager|). {path} was written; do not deploy it without finding why."
            )
    return worst


def _numpy(tensor: torch.Tensor, name: str) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        raise ExportError(
            f"The check feeds input `{name}` to ONNX Runtime through NumPy, which has no bfloat16. Pass check=False "
            "and check the file with ONNX Runtime's OrtValue API, or export with a float32 example."
        )
    return tensor.detach().cpu().numpy()
