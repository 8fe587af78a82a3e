"""The Lightning side of the options: the arguments of the strategies and of ``ORTCallback``, defined once.

They bundle :mod:`lightning_ort.options` (what an ORTModule takes) with what Lightning adds: which submodules to
wrap, metrics, deployment files.

:class:`ORTConfig` declares and documents every argument; :func:`ort_arguments` puts them into the signature of
each strategy's and the callback's ``__init__`` as keyword-only parameters, so that they read the same from
Python (``ORTDDPStrategy(save_onnx=True)``), from ``help()`` and from LightningCLI (``init_args: {save_onnx:
true}``, where jsonargparse checks each value against its type while parsing).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from torch import nn

from lightning_ort.deployment import ExportSpec, check_export_target
from lightning_ort.options import (
    PROVIDERS_ACCEPTED,
    AttentionPath,
    ConvWeightGrad,
    CpuMatmul,
    CudaMemory,
    DebugOptions,
    Fallback,
    LogLevel,
    ModuleOptions,
    OptimizationLevel,
    SessionSettings,
    argument_type_error,
    require_type,
)


@dataclass(frozen=True)
class ORTConfig:
    """What the strategies and :class:`~lightning_ort.ORTCallback` wrap, and how.

    Every strategy and the callback takes these as keyword arguments of their own
    (``Trainer(strategy=ORTDDPStrategy(save_onnx=True, onnx_prefix="lm"))``); LightningCLI reads them from
    ``init_args``. Values are checked when the config is made: an unwritable ``save_path`` or an unknown
    ``log_level`` fails before training.

    Args:
        modules: LightningModule attribute paths to wrap (dotted for nested ones: ``"model.encoder"``). Default:
            every direct child with trainable parameters that is not a torchmetrics ``Metric`` or a loss module.
        save_onnx: save every exported and ORT-optimized ONNX model (see :class:`~lightning_ort.DebugOptions`).
        log_level: ONNX Runtime's session log severity, and the level of lightning_ort's records during the
            wrapped networks' calls: VERBOSE, INFO, WARNING, ERROR, FATAL.
        onnx_prefix: file name prefix of saved models; each wrapped submodule's files add its path.
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
        cpu_matmul: which library multiplies matrices in CPU sessions: ``"auto"`` (the faster, timed once),
            ``"mlas"`` (ONNX Runtime's) or ``"mkl"`` (PyTorch's; see :class:`~lightning_ort.SessionSettings`).
        attention: where ``F.scaled_dot_product_attention`` runs: ``"auto"`` (PyTorch's fused kernels on CUDA,
            its math in the graphs on CPU), ``"onnx"`` (its math in the graphs) or ``"torch"`` (PyTorch's fused
            kernels between ONNX Runtime partitions; see :class:`~lightning_ort.ORTModule`).
        conv_weight_grad: where convolutions' weight gradients are computed: ``"auto"`` (PyTorch's kernel where
            it is faster, on CPU), ``"onnx"`` or ``"torch"`` (see :class:`~lightning_ort.ORTModule`).
        cuda_memory: where CUDA sessions allocate: ``"torch"`` (PyTorch's caching allocator), ``"shared_arena"``
            or ``"session_arena"`` (see :class:`~lightning_ort.SessionSettings`).
        cuda_graph: on CUDA, replay each static-shape graph as a CUDA graph (see
            :class:`~lightning_ort.SessionSettings`).
        fallback: ``"auto"`` runs ops ONNX cannot express in PyTorch with a warning; ``"raise"`` fails instead.
        cache_dir: folder of exported graphs shared by runs and ranks: a restart with the same model and shapes
            loads them instead of exporting again (default: no on-disk cache).
        dynamic: symbolic input sizes: ``None`` (automatic: sizes that change between calls become symbolic),
            ``True`` (all from the start), ``False`` (one graph per shape).
        blocks: block graphs: ``"auto"`` (default) exports each block class repeated within a wrapped network
            (transformer layers in an ``nn.ModuleList``) once and runs every instance through it, so the first
            step stops growing with depth; class names (``["GPT2Block"]``) choose them; ``None`` captures each
            network as one graph. See :class:`~lightning_ort.ORTModule`.
        dynamic_axes: the axes of the wrapped networks' ``forward`` arguments that vary between batches, by
            parameter name (``{"input_ids": [0, 1], "attention_mask": [0, 1]}``): symbolic from the first step,
            so padded batches of a new length build nothing (see :class:`~lightning_ort.ORTModule`). Each network
            takes the names its ``forward`` has; a name no wrapped network takes is an error.
        export_onnx: at the end of ``fit``, write each wrapped network's inference model for deployment (see
            :meth:`~lightning_ort.ORTModule.export`): a ``.onnx`` file (one wrapped network; with several, each
            file adds the network's path: ``model.net.onnx``) or a folder (``<folder>/<path>.onnx``), or an
            :class:`~lightning_ort.ExportSpec` that also chooses the inputs and the symbolic axes. Rank zero
            writes it from the trained weights (an ``"ort_fsdp"`` model is gathered first), with the network's
            first inputs of the fit, less ``labels``, as the example; the axes declared in ``dynamic_axes`` and
            the batch axis are symbolic, and the file is checked against eager PyTorch. The path is checked for
            write access at once.
        log_metrics: log the ``ort/*`` metrics (see :mod:`lightning_ort.lightning.metrics`).
        prog_bar: also show those metrics in the progress bar.

    Example:
        >>> config = ORTConfig(modules="net", log_level="INFO", blocks="GPT2Block")
        >>> config.modules, config.debug_options.log_level, config.blocks
        (('net',), <LogLevel.INFO: 'INFO'>, ('GPT2Block',))
    """

    modules: Sequence[str] | None = None
    save_onnx: bool = False
    log_level: LogLevel = LogLevel.WARNING
    onnx_prefix: str = ""
    save_path: str | os.PathLike[str] | None = None
    profile: bool = False
    providers: Sequence[str] | None = None
    optimization_level: OptimizationLevel = "all"
    intra_op_num_threads: int = 0
    allow_spinning: bool = True
    release_torch_threads: bool = True
    cpu_matmul: CpuMatmul = "auto"
    cuda_memory: CudaMemory = "torch"
    cuda_graph: bool = False
    attention: AttentionPath = "auto"
    conv_weight_grad: ConvWeightGrad = "auto"
    fallback: Fallback = "auto"
    cache_dir: str | os.PathLike[str] | None = None
    dynamic: bool | None = None
    blocks: Sequence[str] | str | None = "auto"
    dynamic_axes: dict[str, list[int]] | None = None
    export_onnx: str | os.PathLike[str] | ExportSpec | None = None
    log_metrics: bool = True
    prog_bar: bool = False
    module_options: ModuleOptions = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        require_type(self, "log_metrics", bool, "True or False")
        require_type(self, "prog_bar", bool, "True or False")
        require_type(self, "dynamic_axes", (dict, type(None)), "a dict of parameter names to axes, or None")
        require_type(
            self,
            "export_onnx",
            (str, os.PathLike, ExportSpec, type(None)),
            "a .onnx file or a folder, an ExportSpec, or None",
        )
        if self.providers is not None and not isinstance(self.providers, (str, Sequence)):
            raise argument_type_error("providers", self.providers, PROVIDERS_ACCEPTED)
        providers = _names(self.providers) or None
        options = ModuleOptions.checked(
            debug_options=DebugOptions(
                save_onnx=self.save_onnx,
                log_level=self.log_level,
                onnx_prefix=self.onnx_prefix,
                save_path=self.save_path if self.save_path is not None else os.getcwd(),
                profile=self.profile,
            ),
            session_settings=SessionSettings(
                providers=providers,
                optimization_level=self.optimization_level,
                intra_op_num_threads=self.intra_op_num_threads,
                allow_spinning=self.allow_spinning,
                release_torch_threads=self.release_torch_threads,
                cpu_matmul=self.cpu_matmul,
                cuda_memory=self.cuda_memory,
                cuda_graph=self.cuda_graph,
            ),
            fallback=self.fallback,
            cache_dir=self.cache_dir,
            dynamic=self.dynamic,
            blocks=self.blocks if self.blocks in (None, "auto") else _names(self.blocks),
            dynamic_axes=self.dynamic_axes,
            attention=self.attention,
            conv_weight_grad=self.conv_weight_grad,
        )
        normalised = {
            "modules": _names(self.modules),
            "providers": providers,
            "log_level": options.debug_options.log_level,
            "fallback": options.fallback,
            "blocks": options.blocks,
            "export_onnx": _export_spec(self.export_onnx),
            "module_options": options,
        }
        for name, value in normalised.items():
            object.__setattr__(self, name, value)

    @property
    def debug_options(self) -> DebugOptions:
        """The wrapped networks' debug options, before each adds its path to ``onnx_prefix``."""
        return self.module_options.debug_options

    @property
    def session_settings(self) -> SessionSettings:
        """The wrapped networks' ONNX Runtime session settings."""
        return self.module_options.session_settings

    @classmethod
    def argument_names(cls) -> tuple[str, ...]:
        """The names of the ORT arguments, in order."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)

    @classmethod
    def take_arguments(cls, arguments: dict[str, Any]) -> dict[str, Any]:
        """The ORT arguments in ``arguments``, removed from it; the rest stays for the caller.

        Example:
            >>> arguments = {"save_onnx": True, "onnx_prefix": "lm", "static_graph": True}
            >>> ORTConfig.take_arguments(arguments), arguments
            ({'save_onnx': True, 'onnx_prefix': 'lm'}, {'static_graph': True})
        """
        return {name: arguments.pop(name) for name in cls.argument_names() if name in arguments}

    def export_paths(self, networks: Sequence[str]) -> dict[str, Path]:
        """Where ``export_onnx`` puts each wrapped network's file, by the network's attribute path.

        Example:
            >>> ORTConfig(export_onnx="out/model.onnx").export_paths(["net"])
            {'net': PosixPath('out/model.onnx')}
            >>> ORTConfig(export_onnx="out/model.onnx").export_paths(["encoder", "decoder"])
            {'encoder': PosixPath('out/model.encoder.onnx'), 'decoder': PosixPath('out/model.decoder.onnx')}
            >>> ORTConfig(export_onnx="out").export_paths(["net"])
            {'net': PosixPath('out/net.onnx')}
        """
        spec = self.export_spec
        if spec is None:
            return {}
        target = Path(spec.path)
        if target.suffix != ".onnx":
            return {name: target / f"{name}.onnx" for name in networks}
        if len(networks) == 1:
            return {networks[0]: target}
        return {name: target.with_name(f"{target.stem}.{name}.onnx") for name in networks}

    @property
    def export_spec(self) -> ExportSpec | None:
        """``export_onnx`` as an :class:`~lightning_ort.ExportSpec` (a path becomes one with its defaults)."""
        return self.export_onnx if isinstance(self.export_onnx, ExportSpec) else None

    def debug_options_for(self, path: str) -> DebugOptions:
        """Debug options of the submodule at ``path``: its saved files are named ``<onnx_prefix>_<path>_*.onnx``."""
        prefix = f"{self.onnx_prefix}_{path}" if self.onnx_prefix else path
        return dataclasses.replace(self.debug_options, onnx_prefix=prefix)

    def options_for(
        self,
        path: str,
        blocks: Sequence[type[nn.Module]],
        dynamic_axes: Mapping[str, tuple[int, ...]] | None,
    ) -> ModuleOptions:
        """The options of the network at ``path``, checked already: its file prefix, block classes and share of
        ``dynamic_axes`` (resolved across the wrapped networks by :func:`~lightning_ort.lightning.wrapping.
        wrap_submodules`). Under ``blocks="auto"`` the network finds its blocks itself, as ``blocks`` holds."""
        return dataclasses.replace(
            self.module_options,
            debug_options=self.debug_options_for(path),
            blocks="auto" if self.module_options.blocks == "auto" else tuple(blocks),
            dynamic_axes=dict(dynamic_axes) if dynamic_axes else None,
        )


def _export_spec(target: str | os.PathLike[str] | ExportSpec | None) -> ExportSpec | None:
    """``export_onnx`` as an :class:`ExportSpec` whose path is known writable: a file, or a folder (no suffix)."""
    if target is None:
        return None
    spec = target if isinstance(target, ExportSpec) else ExportSpec(Path(target))
    path = Path(spec.path)
    check_export_target(path, "export_onnx", folder=path.suffix != ".onnx")
    return dataclasses.replace(spec, path=path)


def _names(values: Sequence[str] | str | None) -> tuple[str, ...] | None:
    """Names as a tuple: one name alone (``"net"``) becomes ``("net",)``; ``None`` stays ``None``."""
    if values is None:
        return None
    return (values,) if isinstance(values, str) else tuple(values)


Init = TypeVar("Init", bound=Callable[..., None])


def ort_arguments(init: Init) -> Init:
    """Declare :class:`ORTConfig`'s arguments as keyword-only parameters of ``init``, an ``__init__``.

    ``init`` receives them through its ``**kwargs`` (taken out with :meth:`ORTConfig.take_arguments`). A
    ``**kwargs`` named ``ort_options`` holds only these and leaves the signature; any other ``**kwargs`` (a
    strategy's arguments for its Lightning base class) stays in it.

    Example:
        >>> class Owner:
        ...     @ort_arguments
        ...     def __init__(self, **ort_options: Any) -> None:
        ...         self.config = ORTConfig(**ort_options)
        >>> list(inspect.signature(Owner).parameters)[:3]
        ['modules', 'save_onnx', 'log_level']
    """
    signature = inspect.signature(init)
    own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    rest = [
        p for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD and p.name != "ort_options"
    ]
    hints = typing.get_type_hints(ORTConfig)
    declared = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
        for f in dataclasses.fields(ORTConfig)
        if f.init
    ]
    setattr(init, "__signature__", signature.replace(parameters=[*own, *declared, *rest]))  # noqa: B010
    return init
