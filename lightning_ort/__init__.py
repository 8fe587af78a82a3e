"""Train PyTorch and PyTorch Lightning models through ONNX Runtime.

Importing the package registers the Lightning strategies ``"ort"``, ``"ort_ddp"``, ``"ort_ddp_spawn"`` and
``"ort_fsdp"``;
installing it registers the ``torch.compile`` backend ``"ort"``.
"""

from __future__ import annotations

from importlib.metadata import version

from lightning_ort.callback import ORTCallback
from lightning_ort.config import OptimizationLevel, ORTConfig
from lightning_ort.engine.backend import CacheStatistics, ORTBackend
from lightning_ort.engine.capture import BuildCounts
from lightning_ort.engine.profiling import KernelProfile, OpTime, read_profiles
from lightning_ort.errors import (
    BlockError,
    CaptureError,
    DiskCacheWarning,
    ExportError,
    FallbackWarning,
    LightningORTError,
    ORTModuleError,
    SessionError,
)
from lightning_ort.module import ORTModule
from lightning_ort.options import DebugOptions, Fallback, LogLevel, SessionSettings
from lightning_ort.strategies import ORTDDPStrategy, ORTFSDPStrategy, ORTSingleDeviceStrategy, register_strategies

register_strategies()

__all__ = [
    "BlockError",
    "BuildCounts",
    "CacheStatistics",
    "CaptureError",
    "DebugOptions",
    "DiskCacheWarning",
    "ExportError",
    "Fallback",
    "FallbackWarning",
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
    "read_profiles",
]

__version__ = version("lightning-ort")
