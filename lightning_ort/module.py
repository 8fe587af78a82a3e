"""``ORTModule``: an ``nn.Module`` whose forward and backward run in ONNX Runtime."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_ort.engine.cache import CacheStatistics, GraphCache
from lightning_ort.engine.capture import BuildOptions, CapturedGraphs, FallbackWarning
from lightning_ort.engine.disk_cache import DiskCache
from lightning_ort.engine.dynamic import DynamicDims, Shapes, all_dims, changed_dims
from lightning_ort.engine.export import ExportError, first_line
from lightning_ort.engine.profiling import KernelProfile, read_profiles
from lightning_ort.engine.session import SessionError
from lightning_ort.engine.signature import FlatInputs, TensorMeta, forward_parameter_names
from lightning_ort.options import DebugOptions, Fallback, SessionSettings, configure_logger, parse_fallback

log = logging.getLogger(__name__)

_SHARED_STATE = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


class ORTModuleError(RuntimeError):
    """Misuse of :class:`ORTModule` that the original onnxruntime-training ORTModule also refused."""


class ORTModule(nn.Module):
    """Run ``module``'s forward and backward passes in ONNX Runtime; behave as ``module`` everywhere else.

    On the first call with a new signature (input shapes, dtypes, devices, Python constants, train/eval and
    grad mode) the module is traced with AOTAutograd into forward and backward graphs, each exported to ONNX
    and loaded into an ``onnxruntime.InferenceSession`` with graph optimizations on. Later calls with the
    same signature reuse them; ``loss.backward()`` runs the backward graph in ONNX Runtime and fills
    ``param.grad``. Under ``torch.no_grad()`` an inference graph without gradient work runs instead.

    The wrapper shares the wrapped module's parameters, buffers and submodules: ``state_dict()`` keys,
    ``parameters()`` and checkpoints are the same as without it. Wrap before ``DistributedDataParallel``.

    Ops that ONNX cannot express (custom ops, a few rare ATen ops) run in PyTorch between ONNX Runtime
    partitions of the same graph; a call whose control flow depends on tensor values (``if x.sum() > 0``) runs
    in PyTorch for that input signature. Both warn once (:class:`~lightning_ort.FallbackWarning`) naming the ops
    and submodules; ``fallback="raise"`` makes them errors.

    Args:
        module: the model to run in ONNX Runtime.
        debug_options: saving ONNX files and log verbosity (see :class:`~lightning_ort.DebugOptions`).
        session_settings: execution providers, optimization level and threads of the sessions.
        fallback: ``"auto"`` (default) runs what ONNX cannot express in PyTorch, with a warning; ``"raise"``
            fails instead, naming the op, its submodule and what to do.
        cache_dir: a folder where exported graphs are saved; a later process training the same model with the
            same input shapes loads them instead of exporting again. ``None`` (default) keeps graphs in memory
            only. An unwritable folder is reported with a warning and training goes on without it.
        dynamic: input sizes captured as symbols, so one graph serves many shapes. ``None`` (default,
            automatic): the first shape gets its own graph; when a later call differs only in some input sizes
            (another sequence length, a ragged last batch), those dimensions become symbolic in the next graph,
            which then serves every size. ``True``: every input dimension is symbolic from the first call.
            ``False``: one graph per input shape (fastest per step when shapes repeat: ONNX Runtime optimizes
            for the exact sizes).

    Example:
        >>> model = ORTModule(nn.Linear(4, 2))
        >>> loss = model(torch.randn(3, 4)).sum()
        >>> loss.backward()
        >>> model.statistics.forward_runs, model.statistics.backward_runs
        (1, 1)
    """

    def __init__(
        self,
        module: nn.Module,
        debug_options: DebugOptions | None = None,
        session_settings: SessionSettings | None = None,
        fallback: Fallback = "auto",
        cache_dir: str | os.PathLike[str] | None = None,
        dynamic: bool | None = None,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"ORTModule wraps a torch.nn.Module, got {type(module).__name__}.")
        if isinstance(module, ORTModule):
            raise ORTModuleError("This module is already an ORTModule; wrap the original module only once.")
        if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            raise ORTModuleError(
                f"ORTModule must wrap the model before {type(module).__name__} does: "
                "use DistributedDataParallel(ORTModule(model)). DataParallel is not supported."
            )
        fallback = parse_fallback(fallback)
        if not isinstance(dynamic, (bool, type(None))):
            raise TypeError(f"ORTModule(dynamic={dynamic!r}): dynamic must be True, False or None (automatic).")
        super().__init__()
        debug = debug_options if debug_options is not None else DebugOptions()
        object.__setattr__(self, "_original_module", module)
        for name in _SHARED_STATE:
            self.__dict__[name] = module.__dict__[name]
        self.training = module.training
        self._build_options = BuildOptions(
            session_settings if session_settings is not None else SessionSettings(),
            debug,
            fallback,
            DiskCache(cache_dir) if cache_dir is not None else None,
        )
        self._dynamic = dynamic
        self._static_keys: set[Hashable] = set()
        self._forward_parameter_names = forward_parameter_names(module)
        self._cache = GraphCache()
        configure_logger(debug.log_level)

    @property
    def module(self) -> nn.Module:
        """The original module: its methods and attributes, running in PyTorch."""
        return self._original_module

    @property
    def debug_options(self) -> DebugOptions:
        return self._build_options.debug

    @property
    def session_settings(self) -> SessionSettings:
        return self._build_options.settings

    @property
    def fallback(self) -> Fallback:
        """``"auto"`` (ops ONNX Runtime cannot run go to PyTorch) or ``"raise"``."""
        return self._build_options.fallback

    @property
    def dynamic(self) -> bool | None:
        """Symbolic input sizes: ``None`` automatic, ``True`` all dimensions, ``False`` one graph per shape."""
        return self._dynamic

    @property
    def cache_dir(self) -> Path | None:
        """The on-disk graph cache folder, or ``None`` when graphs are kept in memory only."""
        disk = self._build_options.disk_cache
        return disk.directory if disk is not None else None

    @property
    def statistics(self) -> CacheStatistics:
        """Export time, graph-cache hits and misses, cached graphs and ONNX Runtime run counts so far."""
        return self._cache.statistics()

    @property
    def providers(self) -> list[str]:
        """Execution providers of the sessions built so far (empty before the first call)."""
        seen: list[str] = []
        for _, runner in self._cache.runners():
            seen.extend(p for p in runner.providers if p not in seen)
        return seen

    @property
    def graphs(self) -> list[str]:
        """Names of the graphs built so far, as in saved file names (``["forward", "backward", "inference_1"]``)."""
        return [runner.name for _, runner in self._cache.runners()]

    def end_profiling(self, skip_runs: int = 1) -> KernelProfile:
        """Stop profiling the graphs built so far, write their profiles and sum their kernel times by op type.

        Needs ``DebugOptions(profile=True)``. Graphs built after this call are profiled again until the next call.

        Args:
            skip_runs: runs to leave out of the sums at the start of each graph's profile (the first run allocates
                ONNX Runtime's memory and is slower); the files keep every run.

        Raises:
            ORTModuleError: profiling was not switched on.

        Example:
            >>> import tempfile
            >>> model = ORTModule(nn.Linear(4, 2), DebugOptions(profile=True, save_path=tempfile.mkdtemp()))
            >>> for _ in range(3):
            ...     model(torch.randn(3, 4)).sum().backward()
            >>> profile = model.end_profiling()
            >>> len(profile.files), profile.runs  # forward and backward graphs, two runs each after the first
            (2, 4)
        """
        if not self.debug_options.profile:
            raise ORTModuleError(
                "ORTModule.end_profiling() needs profiling switched on: "
                "ORTModule(module, DebugOptions(profile=True, save_path=...))."
            )
        files = [path for _, runner in self._cache.runners() for path in runner.end_profiling()]
        return read_profiles(files, skip_runs=skip_runs)

    def clear_cache(self) -> None:
        """Drop every cached graph; the next call builds again. Statistics keep counting."""
        self._cache.clear()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module's forward in ONNX Runtime (see the class docstring)."""
        inputs = FlatInputs.from_call(self._forward_parameter_names, args, kwargs)
        state = self._graph_state()
        state_tensors = [tensor for _, tensor in state]
        general_key = self._signature(inputs, state)
        shapes = tuple(tuple(t.shape) for t in inputs.tensors)
        key = (general_key, shapes)
        entry = self._cache.lookup(key, general_key, inputs.tensors)
        if entry is not None:
            return entry(state_tensors, inputs.tensors)
        # The signature holds every tensor's device: a hit has the devices of the call that built its graphs.
        device = _graph_device(state_tensors, inputs.tensors, type(self._original_module).__name__)
        dims = self._dynamic_dims(general_key, shapes)
        build = (key, general_key, shapes, inputs, state, device)
        if not dims or self._dynamic is not None:
            return self._build_and_run(*build, dims)
        try:
            return self._build_and_run(*build, dims)
        except (ExportError, SessionError) as err:
            self._static_keys.add(general_key)
            warnings.warn(
                f"lightning_ort: {type(self._original_module).__name__}: no graph with symbolic sizes for input "
                f"dimensions {sorted(dims)} ({first_line(err)}); building one graph per input shape instead. Pass "
                "dynamic=False to skip the attempt.",
                FallbackWarning,
                stacklevel=2,
            )
            return self._build_and_run(*build, frozenset())

    def _build_and_run(
        self,
        key: Hashable,
        general_key: Hashable,
        shapes: Shapes,
        inputs: FlatInputs,
        state: list[tuple[str, torch.Tensor]],
        device: torch.device,
        dims: DynamicDims,
    ) -> Any:
        tag = self._cache.next_tag()
        log.info(
            "building a new graph for %s (signature %s%s)",
            type(self._original_module).__name__,
            tag or "0",
            f", dynamic dims {sorted(dims)}" if dims else "",
        )
        entry = CapturedGraphs(
            self._original_module,
            [name for name, _ in state],
            inputs,
            device,
            tag,
            self._build_options,
            self._cache.build_log,
            dims,
        )
        self._cache.insert(key, general_key, shapes, entry)
        try:
            output = entry([tensor for _, tensor in state], inputs.tensors)
        except Exception:
            self._cache.discard(key, general_key, entry)
            raise
        self._cache.settle(key, general_key, entry)
        return output

    def _dynamic_dims(self, general_key: Hashable, shapes: Shapes) -> DynamicDims:
        if self._dynamic is False:
            return frozenset()
        if self._dynamic is True:
            return all_dims(shapes)
        if general_key in self._static_keys:
            return frozenset()
        return changed_dims(self._cache.seen_shapes(general_key), shapes)

    def _graph_state(self) -> list[tuple[str, torch.Tensor]]:
        """``named_parameters()`` then ``named_buffers()`` of the wrapped module, in one walk over its submodules
        (this runs on every call: two walks took 120-250 us for the benchmark's transformer)."""
        parameters: dict[torch.Tensor, str] = {}
        buffers: dict[torch.Tensor, str] = {}
        for prefix, module in self._original_module.named_modules():
            dot = f"{prefix}." if prefix else ""
            for name, parameter in module._parameters.items():
                if parameter is not None and parameter not in parameters:
                    parameters[parameter] = dot + name
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer not in buffers:
                    buffers[buffer] = dot + name
        return [(name, tensor) for table in (parameters, buffers) for tensor, name in table.items()]

    def _signature(self, inputs: FlatInputs, state: list[tuple[str, torch.Tensor]]) -> Hashable:
        """Everything that selects a graph except the input tensors' sizes (those are checked separately)."""
        return (
            self.training,
            torch.is_grad_enabled(),
            _autocast_state(),
            inputs.structure,
            tuple(TensorMeta.of(t)._replace(shape=(len(t.shape),)) for t in inputs.tensors),
            tuple((name, t.shape, t.dtype, t.device, t.requires_grad) for name, t in state),
        )

    def train(self, mode: bool = True) -> ORTModule:
        self._original_module.train(mode)
        self.training = mode
        return self

    def apply(self, fn: Callable[[nn.Module], None]) -> ORTModule:
        self._original_module.apply(fn)
        return self

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._original_module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        return self._original_module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._original_module._load_from_state_dict(*args, **kwargs)

    def add_module(self, name: str, module: nn.Module | None) -> None:
        raise ORTModuleError(
            f"ORTModule does not take new submodules (add_module({name!r}, ...)): its graphs were traced from the "
            "wrapped module. Add the submodule to the original module before wrapping it."
        )

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, nn.Module):
            self.add_module(name, value)
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_original_module")
            if original is None:
                raise
            return getattr(original, name)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__["_cache"] = GraphCache()

    def __repr__(self) -> str:
        return f"ORTModule({self._original_module!r})"


def _graph_device(state: list[torch.Tensor], inputs: tuple[torch.Tensor, ...], owner: str) -> torch.device:
    devices = {t.device for t in (*state, *inputs) if t.device.type != "meta"}
    if len(devices) > 1:
        raise RuntimeError(
            f"ORTModule({owner}) got tensors on several devices {sorted(map(str, devices))}; "
            "move the module and its inputs to one device first."
        )
    return devices.pop() if devices else torch.device("cpu")


def _autocast_state() -> tuple[Any, ...]:
    return tuple(
        (device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda") if torch.is_autocast_enabled(device)
    )
