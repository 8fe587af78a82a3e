"""Exported graphs saved on disk, so a new process training the same model skips the ONNX export.

A graph's file name is a SHA-256 key over everything the exported model depends on: the captured FX graph's
code and constants, its inputs' shapes, dtypes and strides, the device, the execution providers and their
options, the CPU's NCHWc channel block (its vector width: convolution weights are laid out for it), the torch,
onnx, onnxscript and onnxruntime versions, and a hash of lightning_ort's own source (a changed translation in a
development install is a different key). A file holds a checksum of its contents: a corrupted, truncated or
foreign file is reported, deleted and rebuilt, never loaded. Size expressions are stored as trees of sympy
classes from a fixed list and rebuilt from them, never evaluated from text. Files are written to a temporary name and
renamed into place, so processes (DDP ranks) writing the same graph never see each other's partial files.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import struct
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
import sympy
import torch
import torch.fx

from lightning_ort.engine.fx.dynamic import Size
from lightning_ort.engine.fx.layout import OutputLayout, OutputSpec, PassedInput, ReshapedOutput, Source
from lightning_ort.engine.fx.noise import Noise
from lightning_ort.engine.once import Once
from lightning_ort.engine.onnx.export import ExportedGraph
from lightning_ort.engine.onnx.passes import nchwc_block_size
from lightning_ort.engine.torch_internals import SIZE_FUNCTIONS, FloorDiv
from lightning_ort.errors import DiskCacheWarning, warn
from lightning_ort.logs import get_logger
from lightning_ort.options import unwritable_reason

log = get_logger(__name__)

_MAGIC = b"LORTGRF2"
_SUFFIX = ".ortgraph"


class DiskCache:
    """A folder of exported graphs shared by processes and runs.

    Args:
        directory: the folder; created if missing. If it cannot be written, a warning says so and the cache
            stays off (training continues, graphs are exported as without a cache).

    Example:
        >>> import tempfile
        >>> cache = DiskCache(tempfile.mkdtemp())
        >>> cache.enabled
        True
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self._directory = Path(directory)
        self._enabled = True
        reason = unwritable_reason(self._directory)
        if reason is not None:
            self._disable(f"cache_dir={str(self._directory)!r} cannot be written ({reason})")

    @property
    def directory(self) -> Path:
        return self._directory

    @property
    def enabled(self) -> bool:
        """Whether graphs are looked up and saved (``False`` after the folder proved unwritable)."""
        return self._enabled

    def key(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        device: torch.device,
        providers: Sequence[str | tuple[str, dict[str, str]]],
    ) -> str:
        """The file key of ``gm`` exported for ``example_inputs`` on ``device`` with ``providers`` (and options)."""
        digest = hashlib.sha256()
        digest.update(repr(_versions()).encode())
        digest.update(f"{device.type}|{providers!r}".encode())
        if device.type == "cpu":
            digest.update(f"nchwc{nchwc_block_size()}".encode())
        digest.update(gm.code.encode())
        for value in example_inputs:
            if isinstance(value, torch.Tensor):
                digest.update(f"T{tuple(value.shape)}{value.stride()}{value.dtype}".encode())
            else:
                digest.update(f"V{value!r}".encode())
        for name, tensor in sorted({**dict(gm.named_parameters()), **dict(gm.named_buffers())}.items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def load(self, key: str, name: str) -> ExportedGraph | None:
        """The graph saved under ``key`` (renamed ``name``), or ``None`` if there is none or it is damaged."""
        if not self._enabled:
            return None
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            self._warn(f"cannot read {path} ({err.strerror or err}); exporting the {name} graph again")
            return None
        try:
            graph = _decode(data, name)
        except Exception as err:  # any damage at all means: rebuild, never crash
            self._warn(f"{path} is damaged ({err}); deleting it and exporting the {name} graph again")
            path.unlink(missing_ok=True)
            return None
        log.info("loaded the %s graph from %s", name, path)
        return graph

    def store(self, key: str, graph: ExportedGraph) -> None:
        """Save ``graph`` under ``key`` atomically (write a temporary file, then rename it into place)."""
        if not self._enabled:
            return
        path = self._path(key)
        temporary = None
        try:
            handle, temporary = tempfile.mkstemp(dir=self._directory, prefix=f".{key[:16]}", suffix=".tmp")
            with os.fdopen(handle, "wb") as file:
                file.write(_encode(graph))
            os.chmod(temporary, 0o644)
            os.replace(temporary, path)
        except OSError as err:
            if temporary is not None:
                Path(temporary).unlink(missing_ok=True)
            self._disable(f"cannot write {path} ({err.strerror or err})")
            return
        log.info("saved the %s graph to %s", graph.name, path)

    def _path(self, key: str) -> Path:
        return self._directory / f"{key}{_SUFFIX}"

    def _disable(self, reason: str) -> None:
        self._enabled = False
        self._warn(f"{reason}; continuing without the on-disk graph cache. Pass a writable folder as cache_dir.")

    def _warn(self, message: str) -> None:
        warn(f"lightning_ort: {message}", DiskCacheWarning)


def _versions() -> tuple[str, ...]:
    return (
        torch.__version__,
        onnx.__version__,
        importlib.metadata.version("onnxscript"),
        ort.__version__,
        source_hash(),
    )


@Once
def source_hash() -> str:
    """SHA-256 of the engine's source files: the code that turns graphs into ONNX models, and the C++ of the ONNX
    Runtime kernels the models may use.

    Example:
        >>> len(source_hash())
        64
    """
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]
    for path in sorted([*package.rglob("*.py"), *package.rglob("*.cpp"), *package.rglob("*.h")]):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _encode(graph: ExportedGraph) -> bytes:
    header = json.dumps(
        {
            "noise": [[n.kind, _sizes_to_json(n.shape), str(n.dtype), n.compare, n.threshold] for n in graph.noise],
            "outputs": [[_sizes_to_json(o.shape), str(o.dtype)] for o in graph.outputs],
            "layout": [_source_to_json(source) for source in graph.layout.sources],
            "symbols": [[symbol.name, index, dim] for symbol, (index, dim) in graph.symbols.items()],
            "dropped_inputs": list(graph.dropped_inputs),
            "carried_sizes": list(graph.carried_sizes),
        }
    ).encode()
    payload = struct.pack("<I", len(header)) + header + graph.model.SerializeToString()
    return _MAGIC + hashlib.sha256(payload).digest() + payload


def _decode(data: bytes, name: str) -> ExportedGraph:
    if not data.startswith(_MAGIC):
        raise ValueError("not a lightning_ort graph file")
    digest, payload = data[len(_MAGIC) : len(_MAGIC) + 32], data[len(_MAGIC) + 32 :]
    if hashlib.sha256(payload).digest() != digest:
        raise ValueError("checksum mismatch: the file is truncated or was modified")
    (length,) = struct.unpack_from("<I", payload)
    header = json.loads(payload[4 : 4 + length])
    model = onnx.load_model_from_string(payload[4 + length :])
    noise = [
        Noise(kind, _sizes_from_json(shape), _dtype(dtype), compare, threshold)
        for kind, shape, dtype, compare, threshold in header["noise"]
    ]
    outputs = [OutputSpec(_sizes_from_json(shape), _dtype(dtype)) for shape, dtype in header["outputs"]]
    layout = OutputLayout(tuple(_source_from_json(source) for source in header["layout"]))
    symbols = {_size_from_json({"Symbol": symbol}): (index, dim) for symbol, index, dim in header["symbols"]}
    return ExportedGraph(
        name, model, noise, outputs, layout, symbols, tuple(header["dropped_inputs"]), tuple(header["carried_sizes"])
    )


def _source_to_json(source: Source) -> Any:
    if isinstance(source, PassedInput):
        return {"input": source.index}
    if isinstance(source, ReshapedOutput):
        return {"reshape": _source_to_json(source.base), "shape": _sizes_to_json(source.shape), "own": source.own}
    return _size_to_json(source)


def _source_from_json(value: Any) -> Any:
    if isinstance(value, dict) and "reshape" in value:
        return ReshapedOutput(_source_from_json(value["reshape"]), _sizes_from_json(value["shape"]), value["own"])
    return PassedInput(value["input"]) if isinstance(value, dict) and "input" in value else _size_from_json(value)


def _size_to_json(size: Size | None) -> Any:
    """An int, ``None``, or a size expression as a tree: ``{"Symbol": "s0"}``, ``{"Add": [..., ...]}``."""
    if size is None or isinstance(size, int):
        return size
    return _expression_to_json(size)


def _expression_to_json(expression: Any) -> Any:
    if isinstance(expression, sympy.Symbol):
        return {"Symbol": expression.name}
    if isinstance(expression, sympy.Integer):
        return {"Integer": int(expression)}
    if isinstance(expression, sympy.Rational):
        return {"Rational": [int(expression.p), int(expression.q)]}
    name = type(expression).__name__
    if name not in _EXPRESSIONS:
        raise ValueError(f"size expression {expression} uses {name}, which the cache does not store")
    return {name: [_expression_to_json(arg) for arg in expression.args]}


def _size_from_json(value: Any) -> Any:
    if value is None or isinstance(value, int):
        return value
    if not isinstance(value, dict) or len(value) != 1:
        raise ValueError(f"not a size expression: {value!r}")
    ((name, argument),) = value.items()
    if name == "Symbol" and isinstance(argument, str):
        return sympy.Symbol(argument)
    if name == "Integer" and isinstance(argument, int):
        return sympy.Integer(argument)
    if name == "Rational" and isinstance(argument, list) and all(isinstance(a, int) for a in argument):
        return sympy.Rational(*argument)
    if name not in _EXPRESSIONS or not isinstance(argument, list):
        raise ValueError(f"not a size expression: {value!r}")
    return _EXPRESSIONS[name](*(_size_from_json(arg) for arg in argument))


_EXPRESSIONS: dict[str, Any] = {
    "Add": sympy.Add,
    "Mul": sympy.Mul,
    "Pow": sympy.Pow,
    "Max": sympy.Max,
    "Min": sympy.Min,
    "Mod": sympy.Mod,
    "FloorDiv": FloorDiv,
    **SIZE_FUNCTIONS,
}
"""The sympy classes a stored size expression may use (TorchDynamo's symbolic sizes use no others)."""


def _sizes_to_json(sizes: tuple[Size, ...]) -> list[Any]:
    return [_size_to_json(size) for size in sizes]


def _sizes_from_json(values: list[Any]) -> tuple[Size, ...]:
    return tuple(_size_from_json(value) for value in values)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype
