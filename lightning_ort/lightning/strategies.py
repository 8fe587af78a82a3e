"""Lightning strategies that run the LightningModule's networks through ONNX Runtime.

* ``"ort_ddp"`` / ``"ort_ddp_spawn"``: :class:`ORTDDPStrategy`, Lightning's DDP with every configured submodule
  wrapped in :class:`~lightning_ort.ORTModule` before DDP wraps the LightningModule.
* ``"ort"``: :class:`ORTSingleDeviceStrategy`, the same on one device, so one config runs on a laptop.
* ``"ort_fsdp"``: :class:`ORTFSDPStrategy`, PyTorch FSDP2 sharding each block, the blocks in ONNX Runtime.

The names are registered when this module is imported, which ``lightning_ort`` does as soon as
``lightning.pytorch`` is imported.
"""

from __future__ import annotations

import copy
import inspect
import itertools
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import (
    DDPStrategy,
    ModelParallelStrategy,
    ParallelStrategy,
    SingleDeviceStrategy,
    StrategyRegistry,
)
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_ort.engine.capture.blocks import mark_blocks, unmark_blocks
from lightning_ort.lightning import (
    callback,  # a module, not its class: importing Lightning may start here from callback
)
from lightning_ort.lightning.config import ORTConfig, ort_arguments
from lightning_ort.lightning.lightning_internals import (
    StrategyRegistryType,
    constructed_root_device,
    materialize_distributed_module,
    resolve_parallel_sizes,
)
from lightning_ort.lightning.wrapping import wrapped_submodules
from lightning_ort.logs import get_logger
from lightning_ort.module import ORTModule, original_module

log = get_logger(__name__)


class _ORTStrategyMixin:
    """What both ORT strategies add: the ORTCallback they own and the wrapping step at the start of ``setup``."""

    _ort: callback.ORTCallback

    @property
    def ort_callback(self) -> callback.ORTCallback:
        """The callback that wraps the submodules and logs the ORT metrics."""
        return self._ort

    def _wrap_before_setup(self, trainer: pl.Trainer) -> None:
        self._ort.attach(trainer)
        self._ort.wrap(trainer, trainer.lightning_module)


class ORTDDPStrategy(_ORTStrategyMixin, DDPStrategy):
    """DDP whose LightningModule networks run forward and backward in ONNX Runtime.

    In :meth:`setup` (after ``configure_model``, before precision conversion, device placement, the DDP wrap and
    ``configure_optimizers``) the configured submodules are wrapped with :class:`~lightning_ort.ORTModule`;
    ``training_step``, the loss and logging stay in PyTorch. ``setup`` runs for every fit/validate/test call:
    wrapping is idempotent. Metrics are logged by an :class:`~lightning_ort.ORTCallback` added to the trainer.

    Takes the ORT arguments of :class:`~lightning_ort.ORTConfig` as keyword arguments, and:

    Args:
        start_method: process start method, as for :class:`~lightning.pytorch.strategies.DDPStrategy`.
        **kwargs: the other :class:`~lightning.pytorch.strategies.DDPStrategy` arguments
            (``find_unused_parameters``, ``static_graph``...).

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(strategy=ORTDDPStrategy(log_level="ERROR"), accelerator="cpu", devices=1, logger=False)
    """

    @ort_arguments
    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        ort = callback.ORTCallback(**ORTConfig.take_arguments(kwargs))
        known = set(inspect.signature(DDPStrategy).parameters) | set(
            inspect.signature(DistributedDataParallel).parameters
        )
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"ORTDDPStrategy got unknown argument(s) {unknown}: neither ORT arguments "
                f"({', '.join(ORTConfig.argument_names())}) nor DDPStrategy's or DistributedDataParallel's."
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        self._ort = ort

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._wrap_before_setup(trainer)
        super().setup(trainer)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        for name, start_method in (("ort_ddp", "popen"), ("ort_ddp_spawn", "spawn")):
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"DDP through ONNX Runtime (lightning_ort), start_method '{start_method}'",
                    start_method=start_method,
                )


class ORTSingleDeviceStrategy(_ORTStrategyMixin, SingleDeviceStrategy):
    """One device, networks run in ONNX Runtime: ``Trainer(strategy="ort")``.

    Takes the ORT arguments of :class:`~lightning_ort.ORTConfig` as keyword arguments. Without ``device`` it
    uses the device the Trainer's accelerator picked (``accelerator="gpu", devices=1`` gives ``cuda:0``).

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(strategy="ort", accelerator="cpu", devices=1, logger=False)
        >>> type(trainer.strategy).__name__
        'ORTSingleDeviceStrategy'
    """

    strategy_name = "ort"

    @ort_arguments
    def __init__(
        self,
        device: str | torch.device | int | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        **ort_options: Any,
    ) -> None:
        super().__init__(
            device=device if device is not None else "cpu",
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        # Lightning's accelerator connector fills an empty `parallel_devices` with the devices it chose.
        self.parallel_devices: list[torch.device] | None = (
            [constructed_root_device(self)] if device is not None else None
        )
        self._ort = callback.ORTCallback(**ort_options)

    @property
    @override
    def root_device(self) -> torch.device:
        if self.parallel_devices:
            return self.parallel_devices[0]
        return constructed_root_device(self)

    @override
    def setup_environment(self) -> None:
        if self.parallel_devices is not None and len(self.parallel_devices) > 1:
            raise ValueError(
                f"strategy='ort' trains on one device but the Trainer chose {len(self.parallel_devices)} "
                f"({', '.join(map(str, self.parallel_devices))}); use strategy='ort_ddp' or devices=1."
            )
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._wrap_before_setup(trainer)
        super().setup(trainer)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="Single device through ONNX Runtime (lightning_ort)"
            )


class ORTFSDPStrategy(_ORTStrategyMixin, ModelParallelStrategy):
    """Fully sharded data parallel (PyTorch FSDP2) with every block's forward and backward in ONNX Runtime.

    ``Trainer(strategy="ort_fsdp")``: each rank holds 1/N of the parameters, gradients and optimizer state. The
    configured networks are wrapped in :class:`~lightning_ort.ORTModule` with block graphs; each block (a
    transformer layer, found as for ``blocks="auto"`` or named by ``blocks``) is sharded with ``fully_shard``,
    then each network with its remaining parameters. Before a block runs, FSDP all-gathers its parameters; the
    block's forward runs in ONNX Runtime through the graph shared by every block of its class, and so does its
    backward, after which FSDP reduce-scatters the gradients. The code between the blocks (embeddings, head, the
    loss) runs in PyTorch: TorchDynamo does not trace FSDP's hooks, so it cannot capture the network around
    them. Checkpoints are sharded folders by default (``save_distributed_checkpoint=False`` gathers one full
    file on rank 0); both hold the plain model's keys. A model built under
    ``trainer.init_module(empty_init=True)`` is materialized once sharded: each rank allocates only its shards.

    Takes the ORT arguments of :class:`~lightning_ort.ORTConfig` as keyword arguments, and:

    Args:
        activation_checkpointing: recompute each block's forward during the backward (in ONNX Runtime, inside
            the block's backward graph) instead of keeping its activations.
        reshard_after_forward: free the gathered parameters after each block's forward and gather them again
            for its backward (FSDP's default); ``False`` keeps them until the backward, trading memory for
            communication.
        save_distributed_checkpoint: save a folder of per-rank shards (default) or one full checkpoint file.
        process_group_backend: ``"gloo"`` on CPU, ``"nccl"`` on CUDA by default.
        timeout: the process group's timeout.

    Raises:
        ValueError: in ``setup``, before training: a trainable parameter lies outside the wrapped networks
            (FSDP would not synchronize it), or ``blocks`` names classes no network holds.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(strategy="ort_fsdp", accelerator="cpu", devices=1, logger=False)
        >>> type(trainer.strategy).__name__
        'ORTFSDPStrategy'
    """

    strategy_name = "ort_fsdp"

    @ort_arguments
    def __init__(
        self,
        activation_checkpointing: bool = False,
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **ort_options: Any,
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._activation_checkpointing = activation_checkpointing
        self._reshard_after_forward = reshard_after_forward
        self._ort = callback.ORTCallback(**ort_options)

    @property
    def activation_checkpointing(self) -> bool:
        return self._activation_checkpointing

    @override
    def setup_environment(self) -> None:
        # Every process is one data-parallel shard: no tensor parallelism.
        resolve_parallel_sizes(self, data=self.num_nodes * self.num_processes, tensor=1)
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Wrap and shard the networks, then set up as every strategy does (precision, device, optimizers).

        ``ModelParallelStrategy.setup`` is skipped: it requires ``configure_model`` to apply the parallelism,
        which this strategy applies itself.
        """
        assert self.model is not None
        self._wrap_before_setup(trainer)
        self._shard(trainer.lightning_module)
        # Parameters created under ``trainer.init_module(empty_init=True)`` are allocated once sharded.
        materialize_distributed_module(self.model, self.root_device)
        ParallelStrategy.setup(self, trainer)

    def _shard(self, root: pl.LightningModule) -> None:
        """``fully_shard`` every block of every wrapped network, then each network (once: ``setup`` repeats)."""
        networks = wrapped_submodules(root)
        outside = [
            name
            for name, parameter in root.named_parameters()
            if parameter.requires_grad and not any(name.startswith(f"{path}.") for path in networks)
        ]
        if outside:
            raise ValueError(
                f"strategy='ort_fsdp' shards the networks it wraps ({', '.join(networks) or 'none'}), but these "
                f"trainable parameters lie outside them: {', '.join(outside[:5])}"
                f"{' and more' if len(outside) > 5 else ''}. Name their modules in modules=[...] as well."
            )
        mesh = self.device_mesh["data_parallel"]
        for path, network in networks.items():
            if isinstance(network, FSDPModule):
                continue
            if self._ort.config.export_onnx is not None:
                self._ort.keep_unsharded_copy(path, unsharded_copy(network) if self.is_global_zero else None)
            blocks = shard_network(
                network,
                mesh,
                activation_checkpointing=self._activation_checkpointing,
                reshard_after_forward=self._reshard_after_forward,
            )
            rank_zero_info(
                f"ort_fsdp: `{path}` sharded over {mesh.size()} ranks as {len(blocks)} block(s) of "
                f"{', '.join(cls.__name__ for cls in network.block_classes) or 'no repeated class'} and the rest"
            )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="FSDP2 with blocks in ONNX Runtime (lightning_ort)"
            )


def shard_network(
    network: ORTModule,
    mesh: DeviceMesh,
    *,
    activation_checkpointing: bool = False,
    reshard_after_forward: bool = True,
) -> list[nn.Module]:
    """``fully_shard`` each block of ``network`` over ``mesh``, then ``network`` itself; returns the blocks.

    The blocks are the instances of ``network.block_classes``, each made a block graph first (so that one ONNX Runtime
    graph serves every block) or, with ``activation_checkpointing``, a checkpointed block.

    Example:
        >>> import torch.distributed as dist
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> store = dist.HashStore()
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> network = ORTModule(nn.Sequential(*(nn.TransformerEncoderLayer(8, 2) for _ in range(2))), blocks="auto")
        >>> len(shard_network(network, init_device_mesh("cpu", (1,))))
        2
        >>> dist.destroy_process_group()
    """
    blocks = mark_blocks(original_module(network), network.block_classes, checkpoint=activation_checkpointing)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(network, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return blocks


def unsharded_copy(network: ORTModule) -> nn.Module:
    """A plain copy of the module ``network`` wraps, on the CPU and without block marks, to export after training.

    Parameters not yet allocated (``trainer.init_module(empty_init=True)``) stay on the meta device; the export
    assigns the gathered weights to them.

    Example:
        >>> from lightning_ort.engine.capture.blocks import marked_blocks
        >>> network = ORTModule(nn.Sequential(*(nn.TransformerEncoderLayer(8, 2) for _ in range(2))), blocks="auto")
        >>> plain = unsharded_copy(network)
        >>> type(plain).__name__, marked_blocks(plain)
        ('Sequential', [])
    """
    plain = copy.deepcopy(original_module(network))
    unmark_blocks(plain)
    if not any(t.is_meta for t in itertools.chain(plain.parameters(), plain.buffers())):
        plain = plain.cpu()
    return plain


def register_strategies() -> None:
    """Register ``"ort"``, ``"ort_ddp"``, ``"ort_ddp_spawn"`` and ``"ort_fsdp"`` with Lightning (safe to repeat).

    All or nothing: a failure removes the names registered before it.
    """
    before = set(StrategyRegistry)
    try:
        ORTDDPStrategy.register_strategies(StrategyRegistry)
        ORTSingleDeviceStrategy.register_strategies(StrategyRegistry)
        ORTFSDPStrategy.register_strategies(StrategyRegistry)
    except Exception:
        for name in set(StrategyRegistry) - before:
            StrategyRegistry.remove(name)
        raise


register_strategies()
