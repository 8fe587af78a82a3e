"""Train PyTorch and PyTorch Lightning models through ONNX Runtime."""

from __future__ import annotations

from lightning_ort.engine.cache import CacheStatistics
from lightning_ort.engine.export import ExportError
from lightning_ort.module import ORTModule, ORTModuleError
from lightning_ort.options import DebugOptions, LogLevel, SessionSettings

__all__ = [
    "CacheStatistics",
    "DebugOptions",
    "ExportError",
    "LogLevel",
    "ORTModule",
    "ORTModuleError",
    "SessionSettings",
]

__version__ = "0.1.0"
