"""Train PyTorch and PyTorch Lightning models through ONNX Runtime.

Importing the package registers the Lightning strategies ``"ort"``, ``"ort_ddp"``, ``"ort_ddp_spawn"`` and
``"ort_fsdp"`` (when Lightning is imported, before or after it); installing it registers the ``torch.compile``
backend ``"ort"``. The package imports Lightning only for its Lightning parts (``ORTCallback``, the strategies):
``torch.compile(model, backend="ort")`` and ``ORTModule`` alone do not pay for importing it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
import types
import warnings
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("lightning-ort")
except PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"

from lightning_ort.deployment import DeployedModel, ExportSpec, export_for_deployment
from lightning_ort.engine.capture.backend import ModuleStatistics, ORTBackend
from lightning_ort.engine.capture.build import BuildCounts
from lightning_ort.engine.runtime.profiling import KernelProfile, OpTime, read_profiles
from lightning_ort.errors import (
    BlockError,
    CaptureError,
    CudaGraphWarning,
    DiskCacheWarning,
    ExportError,
    FallbackWarning,
    GraphBreakWarning,
    LightningORTError,
    ORTModuleError,
    RecompileLimitWarning,
    SessionError,
)
from lightning_ort.lightning.config import ORTConfig
from lightning_ort.module import ORTModule
from lightning_ort.options import (
    DebugOptions,
    Fallback,
    LogLevel,
    ModuleOptions,
    OptimizationLevel,
    SessionSettings,
)

logging.getLogger(__name__).addHandler(logging.NullHandler())

_LIGHTNING_PARTS = {
    "ORTCallback": "lightning_ort.lightning.callback",
    "ORTDDPStrategy": "lightning_ort.lightning.strategies",
    "ORTFSDPStrategy": "lightning_ort.lightning.strategies",
    "ORTSingleDeviceStrategy": "lightning_ort.lightning.strategies",
}
"""Names that import Lightning, imported on first use."""


def __getattr__(name: str) -> Any:
    if name in _LIGHTNING_PARTS:
        return getattr(importlib.import_module(_LIGHTNING_PARTS[name]), name)
    if name == "CacheStatistics":
        warnings.warn(
            "lightning_ort.CacheStatistics is now lightning_ort.ModuleStatistics (it holds build times and run "
            "counts, not only cache figures); the old name will be removed.",
            DeprecationWarning,
            stacklevel=2,
        )
        return ModuleStatistics
    raise AttributeError(f"module 'lightning_ort' has no attribute {name!r}")


class _RegisterWithLightning(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Registers the strategies right after ``lightning.pytorch`` is imported, if it was not imported yet.

    ``Trainer(strategy="ort_ddp")`` looks the name up in Lightning's strategy registry, which only its own
    modules fill; Lightning has no entry point for other packages' strategies. Importing Lightning here would
    register them, at a cost of seconds for every ``import lightning_ort`` that only wants ``ORTModule``. This
    finder waits for Lightning's import instead, registers the strategies once it is done, and removes itself
    from ``sys.meta_path`` the first time it is consulted for ``lightning.pytorch``.
    """

    _lock = threading.Lock()

    def __init__(self) -> None:
        self._loader: importlib.abc.Loader | None = None

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "lightning.pytorch":
            return None
        with self._lock:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        assert self._loader is not None, "find_spec chose the loader"
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        assert self._loader is not None, "find_spec chose the loader"
        self._loader.exec_module(module)
        _register()


def _register() -> None:
    """Import the strategies, which register themselves (once one of our modules importing Lightning finishes,
    if one started the import of ``lightning.pytorch``)."""
    if "lightning_ort.lightning.strategies" not in sys.modules:
        importlib.import_module("lightning_ort.lightning.strategies")


if "lightning.pytorch" in sys.modules:
    _register()
else:
    sys.meta_path.insert(0, _RegisterWithLightning())

__all__ = [
    "BlockError",
    "BuildCounts",
    "ModuleOptions",
    "ModuleStatistics",
    "CaptureError",
    "DebugOptions",
    "DeployedModel",
    "CudaGraphWarning",
    "DiskCacheWarning",
    "ExportError",
    "ExportSpec",
    "Fallback",
    "FallbackWarning",
    "GraphBreakWarning",
    "RecompileLimitWarning",
    "KernelProfile",
    "LightningORTError",
    "LogLevel",
    "ORTCallback",
    "ORTConfig",
    "ORTDDPStrategy",
    "ORTFSDPStrategy",
    "ORTModule",
    "ORTModuleError",
    "ORTSingleDeviceStrategy",
    "OpTime",
    "OptimizationLevel",
    "ORTBackend",
    "SessionError",
    "SessionSettings",
    "export_for_deployment",
    "read_profiles",
]
