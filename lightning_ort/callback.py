"""``ORTCallback``: ONNX Runtime training for an existing Lightning project, whatever its strategy."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_ort.metrics import ORTMetrics, summary_table, total_statistics
from lightning_ort.module import ORTModule
from lightning_ort.options import Fallback, LogLevel
from lightning_ort.wrapping import WrapConfig, wrap_submodules, wrapped_submodules

log = logging.getLogger(__name__)

OptimizationLevel = Literal["disable", "basic", "extended", "all"]

_UNSUPPORTED_PRECISION = {"transformer-engine", "transformer-engine-float16"}


class ORTCallback(Callback):
    """Run the LightningModule's networks through :class:`~lightning_ort.ORTModule` and log ORT metrics.

    Add it to any ``Trainer`` (``"auto"``, ``"ddp"``, single device); the ``"ort"``/``"ort_ddp"`` strategies use
    it internally. Submodules existing at ``setup`` are wrapped before the strategy's DDP wrap; those created in
    ``LightningModule.configure_model`` are wrapped when fitting/validation/testing/prediction starts (safe after
    DDP: an ORTModule shares its parameters with the module it wraps).

    Args:
        modules: LightningModule attribute paths to wrap (dotted for nested ones). Default: every direct child
            with trainable parameters that is not a torchmetrics ``Metric`` or a loss module.
        save_onnx: save every exported and ORT-optimized ONNX model (see :class:`~lightning_ort.DebugOptions`).
        log_level: ORT session and ``lightning_ort`` logger verbosity: VERBOSE, INFO, WARNING, ERROR, FATAL.
        onnx_prefix: file name prefix of saved models.
        save_path: folder for saved models and profiles (default: the working directory); checked for write
            access at once.
        profile: record ONNX Runtime's profile of every graph (see :class:`~lightning_ort.DebugOptions`). At the
            end of each ``fit``/``validate``/``test``/``predict`` the profiles are written to ``save_path`` (one
            file per graph and rank) and rank zero logs its kernel time by op type.
        providers: ONNX Runtime execution providers (default: CUDA for CUDA tensors, else CPU).
        optimization_level: ONNX Runtime graph optimization level.
        intra_op_num_threads: ONNX Runtime threads per operator (0 = ONNX Runtime's default).
        allow_spinning: let ONNX Runtime's threads busy-wait inside a run (see
            :class:`~lightning_ort.SessionSettings`; they always stop when the run returns).
        release_torch_threads: on CPU, stop PyTorch's idle OpenMP threads from spinning before each ONNX Runtime
            run (see :class:`~lightning_ort.SessionSettings`).
        fallback: ``"auto"`` runs ops ONNX cannot express in PyTorch with a warning; ``"raise"`` fails instead.
        cache_dir: folder of exported graphs shared by runs and ranks: a restart with the same model and shapes
            loads them instead of exporting again (default: no on-disk cache).
        dynamic: symbolic input sizes: ``None`` (automatic: sizes that change between calls become symbolic),
            ``True`` (all from the start), ``False`` (one graph per shape).
        blocks: block graphs: ``"auto"`` (default) exports each block class repeated within a wrapped network
            (transformer layers in an ``nn.ModuleList``) once and runs every instance through it, so the first
            step stops growing with depth; class names (``["GPT2Block"]``) choose them; ``None`` captures each
            network as one graph. See :class:`~lightning_ort.ORTModule`.
        log_metrics: log the ``ort/*`` metrics (see :mod:`lightning_ort.metrics`).
        prog_bar: also show those metrics in the progress bar.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[ORTCallback(log_level="ERROR")], logger=False)
    """

    def __init__(
        self,
        modules: Sequence[str] | None = None,
        save_onnx: bool = False,
        log_level: LogLevel = LogLevel.WARNING,
        onnx_prefix: str = "",
        save_path: str | os.PathLike[str] | None = None,
        profile: bool = False,
        providers: Sequence[str] | None = None,
        optimization_level: OptimizationLevel = "all",
        intra_op_num_threads: int = 0,
        allow_spinning: bool = True,
        release_torch_threads: bool = True,
        fallback: Fallback = "auto",
        cache_dir: str | os.PathLike[str] | None = None,
        dynamic: bool | None = None,
        blocks: Sequence[str] | str | None = "auto",
        log_metrics: bool = True,
        prog_bar: bool = False,
    ) -> None:
        self._config = WrapConfig.from_arguments(
            modules=modules,
            save_onnx=save_onnx,
            log_level=log_level,
            onnx_prefix=onnx_prefix,
            save_path=save_path,
            profile=profile,
            providers=providers,
            optimization_level=optimization_level,
            intra_op_num_threads=intra_op_num_threads,
            allow_spinning=allow_spinning,
            release_torch_threads=release_torch_threads,
            fallback=fallback,
            cache_dir=cache_dir,
            dynamic=dynamic,
            blocks=blocks,
        )
        self._log_metrics = log_metrics
        self._prog_bar = prog_bar
        self._metrics = ORTMetrics()
        self._summary_shown = False

    @property
    def config(self) -> WrapConfig:
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

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.wrap(trainer, pl_module)

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
        modules = wrapped_submodules(pl_module)
        if not self._summary_shown:
            self._summary_shown = True
            rank_zero_info(
                f"lightning_ort: ONNX Runtime runs these submodules (after the first step):\n{summary_table(modules)}"
            )
        self._log(pl_module, modules, on_step=True)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._log(pl_module, wrapped_submodules(pl_module), on_step=False)

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log(pl_module, wrapped_submodules(pl_module), on_step=False)

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

    def _log(self, pl_module: pl.LightningModule, modules: dict[str, ORTModule], on_step: bool) -> None:
        if not self._log_metrics:
            return
        values = self._metrics.compute(total_statistics(modules), device=pl_module.device)
        for name, value in values.items():
            pl_module.log(
                name,
                value,
                on_step=on_step,
                on_epoch=not on_step,
                prog_bar=self._prog_bar,
                batch_size=1,
                sync_dist=False,
            )


def _check_precision(trainer: pl.Trainer) -> None:
    precision = str(trainer.precision)
    if precision in _UNSUPPORTED_PRECISION:
        raise ValueError(
            f"Trainer(precision={precision!r}) is not supported with lightning_ort: Transformer Engine replaces "
            "layers with fused kernels ONNX cannot express. Use precision='bf16-mixed' or '16-mixed' (autocast, "
            "captured into the ONNX graphs) or '32-true'."
        )
