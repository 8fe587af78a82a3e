"""What lightning_ort uses from inside Lightning that Lightning does not promise to keep: imported here, and only
here.

Each name is feature-tested at import: a Lightning without it fails with an error that names its version.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

LIGHTNING_TESTED = "2.5"
"""The oldest Lightning release the strategies are known to work with."""

try:
    # The type of Lightning's strategy registry, which ``register_strategies`` receives.
    from lightning.fabric.strategies.registry import _StrategyRegistry as StrategyRegistryType

    # Allocates and initialises the parameters of a module sharded under ``init_module(empty_init=True)``.
    from lightning.pytorch.strategies.model_parallel import (
        _materialize_distributed_module as materialize_distributed_module,
    )
except ImportError as error:
    raise ImportError(
        f"lightning_ort needs parts of lightning {pl.__version__} it does not have ({error}). Install lightning "
        f"{LIGHTNING_TESTED} or newer."
    ) from error

__all__ = [
    "StrategyRegistryType",
    "constructed_root_device",
    "materialize_distributed_module",
    "resolve_parallel_sizes",
    "should_update_logs",
]


def should_update_logs(trainer: pl.Trainer) -> bool:
    """Whether this training step is one Lightning writes its logs on (``log_every_n_steps``), as Lightning's
    ``LearningRateMonitor`` asks."""
    return bool(trainer._logger_connector.should_update_logs)


def constructed_root_device(strategy: pl.strategies.SingleDeviceStrategy) -> torch.device:
    """The device a single-device strategy was constructed with, before Lightning's accelerator connector runs."""
    device: torch.device = strategy._root_device
    return device


def resolve_parallel_sizes(strategy: pl.strategies.ModelParallelStrategy, data: int, tensor: int) -> None:
    """Give a ``ModelParallelStrategy`` its data- and tensor-parallel sizes where they are still ``"auto"``."""
    if strategy._tensor_parallel_size == "auto":
        strategy._tensor_parallel_size = tensor
    if strategy._data_parallel_size == "auto":
        strategy._data_parallel_size = data
