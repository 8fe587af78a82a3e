"""Train PyTorch and PyTorch Lightning models through ONNX Runtime.

Importing the package registers the Lightning strategies ``"ort"``, ``"ort_ddp"``, ``"ort_ddp_spawn"`` and
``"ort_fsdp"``;
installing it registers the ``torch.compile`` backend ``"ort"``.
"""

from __future__ import annotations

from lightning_ort.callback import ORTCallback
from lightning_ort.engine.backend import CacheStatistics, ORTBackend
from lightning_ort.engine.blocks import BlockError
from lightning_ort.engine.capture import CaptureError, FallbackWarning
from lightning_ort.engine.disk_cache import DiskCacheWarning
from lightning_ort.engine.export import ExportError
from lightning_ort.engine.profiling import KernelProfile, OpTime, read_profiles
from lightning_ort.engine.session import SessionError
from lightning_ort.module import ORTModule, ORTModuleError
from lightning_ort.options import DebugOptions, LogLevel, SessionSettings
from lightning_ort.strategies import ORTDDPStrategy, ORTFSDPStrategy, ORTSingleDeviceStrategy, register_strategies

register_strategies()

__all__ = [
    "BlockError",
    "CacheStatistics",
    "CaptureError",
    "DebugOptions",
    "DiskCacheWarning",
    "ExportError",
    "FallbackWarning",
    "KernelProfile",
    "LogLevel",
    "ORTCallback",
    "ORTDDPStrategy",
    "ORTFSDPStrategy",
    "ORTModule",
    "ORTModuleError",
    "ORTSingleDeviceStrategy",
    "OpTime",
    "ORTBackend",
    "SessionError",
    "SessionSettings",
    "read_profiles",
]

__version__ = "0.1.0"
