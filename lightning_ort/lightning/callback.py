"""``ORTCallback``: ONNX Runtime training for an existing Lightning project, whatever its strategy."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from typing_extensions import override

from lightning_ort.deployment import ExportSpec, FirstCall, export_for_deployment
from lightning_ort.engine.torch_internals import pytree
from lightning_ort.errors import ORTModuleError
from lightning_ort.lightning.config import ORTConfig, ort_arguments
from lightning_ort.lightning.lightning_internals import should_update_logs
from lightning_ort.lightning.metrics import ORTMetrics, onnx_runtime_share, summary_table, total_statistics
from lightning_ort.lightning.wrapping import wrap_submodules, wrapped_submodules
from lightning_ort.logs import get_logger
from lightning_ort.module import ORTModule, is_sharded, original_module

log = get_logger(__name__)

_UNSUPPORTED_PRECISION = {"transformer-engine", "transformer-engine-float16"}


class ORTCallback(Callback):
    """Run the LightningModule's networks through :class:`~lightning_ort.ORTModule` and log ORT metrics.

    Add it to any ``Trainer`` (``"auto"``, ``"ddp"``, single device); the ``"ort"``/``"ort_ddp"`` strategies use
    it internally. Submodules existing at ``setup`` are wrapped before the strategy's DDP wrap; those created in
    ``LightningModule.configure_model`` are wrapped when fitting/validation/testing/prediction starts (safe after
    DDP: an ORTModule shares its parameters with the module it wraps).

    Takes the ORT arguments of :class:`~lightning_ort.ORTConfig` as keyword arguments.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[ORTCallback(log_level="ERROR")], logger=False)
    """

    @ort_arguments
    def __init__(self, **ort_options: Any) -> None:
        self._config = ORTConfig(**ort_options)
        self._metrics = ORTMetrics()
        self._summary_shown = False
        self._first_calls: dict[str, FirstCall] = {}
        self._unsharded: dict[str, nn.Module | None] = {}

    @property
    def config(self) -> ORTConfig:
        """The ORT arguments this callback was made with."""
        return self._config

    def wrap(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, missing_ok: bool = False
    ) -> dict[str, ORTModule]:
        """Wrap ``pl_module``'s configured submodules (idempotent); return every ORTModule in it."""
        _check_precision(trainer)
        modules = wrap_submodules(pl_module, self._config, missing_ok=missing_ok)
        if not modules and not missing_ok:
            raise ValueError(
                f"ORTCallback found nothing to wrap in {type(pl_module).__name__}: no child holds trainable "
                "parameters. Name the submodules to run in ONNX Runtime with modules=[...]."
            )
        return modules

    def attach(self, trainer: pl.Trainer) -> None:
        """Make sure ``trainer`` calls an ORTCallback's hooks (used by the ORT strategies)."""
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if not any(isinstance(callback, ORTCallback) for callback in callbacks):
            callbacks.append(self)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.wrap(trainer, pl_module, missing_ok=True)

    def keep_unsharded_copy(self, path: str, network: nn.Module | None) -> None:
        """Keep ``network``, a copy of the wrapped network at ``path`` made before sharding, for ``export_onnx``.

        A sharded network cannot run on one process; the export loads the gathered weights into this copy. Every
        rank calls this: rank zero, which exports, with the copy, the others with ``None``.
        """
        self._unsharded[path] = network

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        modules = self.wrap(trainer, pl_module)
        if self._config.export_onnx is not None:
            self._first_calls = {path: FirstCall(module) for path, module in modules.items()}

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write ``export_onnx``'s deployment files from the trained weights (rank zero; the others wait)."""
        first_calls, self._first_calls = self._first_calls, {}
        spec = self._config.export_spec
        if spec is None:
            return
        modules = wrapped_submodules(pl_module)
        for path, target in self._config.export_paths(list(modules)).items():
            first = first_calls.get(path)
            if first is not None:
                first.remove()
            if first is None or not first.called:
                rank_zero_warn(
                    f"lightning_ort: export_onnx: `{path}` was not called during fit, so there is no example input "
                    f"to export it with; {target} was not written. Call it from training_step, or export it with "
                    "ORTModule.export(path, *example_inputs)."
                )
                continue
            network = self._deployable(path, modules[path])
            if network is not None and trainer.is_global_zero:
                _export(path, network, first, target, spec, modules[path].dynamic_axes)
        trainer.strategy.barrier("lightning_ort.export_onnx")

    def _deployable(self, path: str, wrapped: ORTModule) -> nn.Module | None:
        """The network to export: the wrapped module, or its unsharded copy loaded with the gathered weights.

        Gathering is a collective: every rank calls this (the unsharded copy is ``None`` except on rank zero).
        """
        network = original_module(wrapped)
        if not is_sharded(wrapped):
            return network
        if path not in self._unsharded:
            raise ORTModuleError(
                f"export_onnx: `{path}` is sharded by FSDP and no unsharded copy of it was kept. Use "
                "strategy='ort_fsdp' (it keeps one when export_onnx is set), or export after gathering the weights."
            )
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(network, options=options)
        copy = self._unsharded[path]
        if copy is not None:
            copy.load_state_dict(state, strict=True, assign=True)
        return copy

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.wrap(trainer, pl_module)

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.wrap(trainer, pl_module)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.wrap(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._summary_shown:
            self._summary_shown = True
            rank_zero_info(
                f"lightning_ort: the wrapped submodules and where they ran (after the first step):\n"
                f"{summary_table(wrapped_submodules(pl_module))}"
            )
        if should_update_logs(trainer):
            self._log_metrics(pl_module, on_step=True)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_metrics(pl_module, on_step=False)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._log_metrics(pl_module, on_step=False)

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_metrics(pl_module, on_step=False)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        stage = getattr(stage, "value", stage)  # Lightning passes its TrainerFn enum ("fit", "validate"...)
        for path, module in wrapped_submodules(pl_module).items():
            if not module.debug_options.profile:
                continue
            profile = module.end_profiling()
            if profile.files:
                rank_zero_info(
                    f"lightning_ort: ONNX Runtime profile of `{path}` ({stage}, {profile.runs} runs after each graph's "
                    f"first; totals):\n{profile.format_table()}\nfiles: {', '.join(map(str, profile.files))}"
                )

    def _log_metrics(self, pl_module: pl.LightningModule, on_step: bool) -> None:
        if not self._config.log_metrics:
            return
        modules = wrapped_submodules(pl_module)
        values = self._metrics.to(pl_module.device).reduce(total_statistics(modules), onnx_runtime_share(modules))
        for name, value in values.items():
            pl_module.log(
                name,
                value,
                on_step=on_step,
                on_epoch=not on_step,
                prog_bar=self._config.prog_bar,
                batch_size=1,
                # The values are reduced over ranks already, so every rank logs the same: Lightning's epoch-level
                # mean keeps them, and asking for it keeps Lightning from warning that they were not synced.
                sync_dist=not on_step,
            )


def _export(
    path: str,
    network: nn.Module,
    first: FirstCall,
    target: Path,
    spec: ExportSpec,
    dynamic_axes: Mapping[str, Sequence[int]],
) -> None:
    """Export ``network`` (at ``path`` in the LightningModule) to ``target`` as ``spec`` says, from its first call."""
    device = next(itertools.chain(network.parameters(), network.buffers()), torch.empty(0)).device
    args, kwargs = pytree.tree_map(
        lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, (first.args, first.kwargs)
    )
    args, kwargs = spec.example(network, args, kwargs)
    shapes = spec.shapes_for(kwargs, dynamic_axes)
    deployed = export_for_deployment(network, target, args, kwargs, dynamic_shapes=shapes, check=spec.check)
    rank_zero_info(
        f"lightning_ort: exported `{path}` for deployment to {deployed.path}: inputs {deployed.inputs}, outputs "
        f"{deployed.outputs}"
        + ("" if deployed.max_error is None else f"; checked against eager PyTorch ({deployed.max_error:.2e} apart)")
    )


def _check_precision(trainer: pl.Trainer) -> None:
    precision = str(trainer.precision)
    if precision in _UNSUPPORTED_PRECISION:
        raise ValueError(
            f"Trainer(precision={precision!r}) is not supported with lightning_ort: Transformer Engine replaces "
            "layers with fused kernels ONNX cannot express. Use precision='bf16-mixed' or '16-mixed' (autocast, "
            "captured into the ONNX graphs) or '32-true'."
        )
