"""ORTModule's options: :class:`DebugOptions`, :class:`LogLevel`, :class:`SessionSettings` and the fallback policy,
with the checks of their values and the logger and output-folder helpers they use.

The Lightning strategies and callback take the same options, plus their own, through
:class:`~lightning_ort.ORTConfig` (:mod:`lightning_ort.lightning.config`).
"""

from __future__ import annotations

import enum
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

import onnxruntime as ort
import torch
from torch import nn

OptimizationLevel = Literal["disable", "basic", "extended", "all"]
"""ONNX Runtime's graph optimization levels, by name."""

CudaMemory = Literal["torch", "shared_arena", "session_arena"]
"""Where CUDA sessions allocate, by name: see :mod:`lightning_ort.engine.runtime.cuda_memory`."""

CUDA_MEMORY: tuple[CudaMemory, ...] = ("torch", "shared_arena", "session_arena")

CpuMatmul = Literal["auto", "mlas", "mkl"]
"""Which library multiplies matrices in CPU sessions, by name: see :mod:`lightning_ort.engine.runtime.cpu_matmul`."""

CPU_MATMUL: tuple[CpuMatmul, ...] = ("auto", "mlas", "mkl")

AttentionPath = Literal["auto", "onnx", "torch"]
"""Where ``F.scaled_dot_product_attention`` runs: translated into the ONNX graphs, kept as one PyTorch op, or
chosen by the device (:func:`attention_on`)."""

ATTENTION_PATHS: tuple[AttentionPath, ...] = ("auto", "onnx", "torch")

ConvWeightGrad = Literal["auto", "onnx", "torch"]
"""Where a convolution's weight gradient is computed: chosen per layer, in the ONNX graphs, or by PyTorch's kernel."""

CONV_WEIGHT_GRADS: tuple[ConvWeightGrad, ...] = ("auto", "onnx", "torch")

Fallback = Literal["auto", "raise"]
"""What ORTModule does with ops ONNX cannot express: run them in PyTorch (``"auto"``) or fail (``"raise"``)."""


def parse_fallback(value: str) -> Fallback:
    """Check a ``fallback`` argument.

    Example:
        >>> parse_fallback("raise")
        'raise'
    """
    if value == "auto":
        return "auto"
    if value == "raise":
        return "raise"
    raise ValueError(f"fallback={value!r} is not a fallback policy; use 'auto' (run such ops in PyTorch) or 'raise'.")


def refuse_static_with_dynamic_axes(dynamic: bool | None, dynamic_axes: object) -> None:
    """Refuse ``dynamic=False`` together with ``dynamic_axes``: they ask for opposite things.

    Example:
        >>> refuse_static_with_dynamic_axes(None, {"input_ids": [0, 1]})
    """
    if dynamic is False and dynamic_axes:
        raise ValueError(
            "dynamic=False builds one graph per shape and dynamic_axes makes axes symbolic: drop one of them."
        )


class LogLevel(str, enum.Enum):
    """Verbosity of ORTModule and of the ONNX Runtime sessions it creates.

    The value is the name, so configuration files and command lines can say ``log_level: VERBOSE``.

    Example:
        >>> LogLevel("INFO").ort_severity
        1
    """

    VERBOSE = "VERBOSE"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"
    FATAL = "FATAL"

    @property
    def ort_severity(self) -> int:
        """ONNX Runtime's ``log_severity_level`` (0 = verbose ... 4 = fatal)."""
        return _ORT_SEVERITY[self]

    @property
    def python_level(self) -> int:
        """The :mod:`logging` level used for the ``lightning_ort`` logger."""
        return _PYTHON_LEVEL[self]


_ORT_SEVERITY = {
    LogLevel.VERBOSE: 0,
    LogLevel.INFO: 1,
    LogLevel.WARNING: 2,
    LogLevel.ERROR: 3,
    LogLevel.FATAL: 4,
}
_PYTHON_LEVEL = {
    LogLevel.VERBOSE: logging.DEBUG,
    LogLevel.INFO: logging.INFO,
    LogLevel.WARNING: logging.WARNING,
    LogLevel.ERROR: logging.ERROR,
    LogLevel.FATAL: logging.CRITICAL,
}


def parse_log_level(value: LogLevel | str) -> LogLevel:
    """Turn ``value`` into a :class:`LogLevel`, failing with the allowed names.

    Example:
        >>> parse_log_level("verbose")
        <LogLevel.VERBOSE: 'VERBOSE'>
    """
    if isinstance(value, LogLevel):
        return value
    try:
        return LogLevel(str(value).upper())
    except ValueError:
        allowed = ", ".join(level.value for level in LogLevel)
        raise ValueError(f"log_level={value!r} is not a log level; use one of {allowed}.") from None


@dataclass
class DebugOptions:
    """Debugging switches of :class:`~lightning_ort.ORTModule`, as in onnxruntime-training.

    Args:
        save_onnx: write every exported model and the model ONNX Runtime optimized from it to
            ``<save_path>/<onnx_prefix>_training_forward.onnx``, ``..._training_backward.onnx`` and
            ``..._inference.onnx`` (see :meth:`onnx_file`); needs ``onnx_prefix``.
        log_level: severity for ONNX Runtime's session logs, and the level from which lightning_ort's Python
            records are emitted while the model builds, runs or exports (no logger's level is set: see
            :mod:`lightning_ort.logs`): a :class:`LogLevel` or its name (``"INFO"``); always a :class:`LogLevel`
            once constructed.
        onnx_prefix: file name prefix of the saved models and profiles; required with ``save_onnx``.
        save_path: folder for the saved models and profiles; created if missing, checked for write access at once.
        profile: record ONNX Runtime's profile of every session (each kernel's time, op type and provider, per
            run) into ``<save_path>/<onnx_prefix>_<graph>_profile[_rank<N>]_<timestamp>.json``. The files are
            written when profiling ends: :meth:`~lightning_ort.ORTModule.end_profiling` (which also sums them
            by op type), the end of ``Trainer.fit``/``validate``/``test``/``predict`` with the ORT strategies or
            callback, or the graph's deletion. Profiling slows each run a little; use it to find where time goes,
            over a few dozen steps: ONNX Runtime keeps a session's events in memory until profiling ends and
            records at most a million (ONNX Runtime's limit).

    Example:
        >>> options = DebugOptions(log_level=LogLevel.INFO, onnx_prefix="mlp")
        >>> LogLevel(options.log_level).ort_severity
        1
    """

    save_onnx: bool = False
    log_level: LogLevel | str = LogLevel.WARNING
    onnx_prefix: str = ""
    save_path: str | os.PathLike[str] = field(default_factory=os.getcwd)
    profile: bool = False

    def __post_init__(self) -> None:
        self.log_level = parse_log_level(self.log_level)
        if not isinstance(self.onnx_prefix, str):
            raise TypeError(f"DebugOptions(onnx_prefix={self.onnx_prefix!r}): the prefix must be a str.")
        require_type(self, "save_onnx", bool, "True or False")
        require_type(self, "profile", bool, "True or False")
        require_type(self, "save_path", (str, os.PathLike), "a folder path (str or pathlib.Path)")
        if self.save_onnx and not self.onnx_prefix:
            raise ValueError(
                "DebugOptions(save_onnx=True) needs onnx_prefix, a file name prefix for the saved models "
                "(onnx_prefix='my_model')."
            )
        if self.save_onnx or self.profile:
            switches = " and ".join(name for name in ("save_onnx", "profile") if getattr(self, name))
            ensure_writable_dir(Path(self.save_path), argument="save_path", switches=switches)

    @property
    def python_level(self) -> int:
        """``log_level`` as a Python logging level: the package's records at it and above are emitted during the
        model's calls (see :mod:`lightning_ort.logs`)."""
        return LogLevel(self.log_level).python_level

    def onnx_file(self, graph_name: str) -> Path:
        """Path of the saved model called ``graph_name``: ``<save_path>/<onnx_prefix>_<mode>_<graph_name>.onnx``.

        The mode is ``training`` for graphs with a backward (``forward``, ``backward``) and left out for
        ``inference`` graphs, whose name says it.

        Example:
            >>> DebugOptions(onnx_prefix="mlp").onnx_file("backward_1").name
            'mlp_training_backward_1.onnx'
        """
        mode = "" if graph_name.startswith("inference") else "training_"
        return Path(self.save_path) / f"{self._stem(mode + graph_name)}.onnx"

    def profile_prefix(self, graph_name: str) -> Path:
        """ONNX Runtime's ``profile_file_prefix`` for the graph ``graph_name`` (it appends a timestamp).

        Under ``torch.distributed`` with several processes the prefix names the rank, so ranks sharing
        ``save_path`` write separate files.
        """
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank = f"_rank{torch.distributed.get_rank()}" if distributed and torch.distributed.get_world_size() > 1 else ""
        return Path(self.save_path) / f"{self._stem(graph_name)}_profile{rank}"

    def _stem(self, graph_name: str) -> str:
        return f"{self.onnx_prefix}_{graph_name}" if self.onnx_prefix else graph_name


def ensure_writable_dir(path: Path, argument: str, switches: str) -> None:
    """Create ``path`` if needed and prove it writable, or raise naming ``argument`` and the ``switches`` needing it."""
    reason = unwritable_reason(path)
    if reason is not None:
        raise ValueError(
            f"{argument}={str(path)!r} cannot be written ({reason}); "
            f"pass a writable folder as {argument} or set {switches}=False."
        )


def unwritable_reason(path: Path) -> str | None:
    """Why ``path`` cannot serve as an output folder (it is created if missing), or ``None`` if it can."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".lightning_ort_write_check"):
            pass
    except OSError as err:
        return str(err.strerror or err)
    return None


@dataclass(frozen=True)
class SessionSettings:
    """How ONNX Runtime sessions are created.

    Args:
        providers: execution providers in priority order. ``None`` picks ``CUDAExecutionProvider`` for CUDA
            tensors and ``CPUExecutionProvider`` otherwise.
        optimization_level: ONNX Runtime graph optimization level: ``"disable"``, ``"basic"``, ``"extended"``
            or ``"all"``.
        intra_op_num_threads: threads for one operator; ``0`` lets ONNX Runtime decide.
        allow_spinning: let ONNX Runtime's worker threads busy-wait between the parallel sections of one run
            instead of sleeping. On by default: waking sleeping threads for each of an operator's many small
            parallel sections cost more than it saved (a 3x3 convolution ran slower on two threads than on one).
            Spinning always stops when a run returns (``session.force_spinning_stop``): PyTorch runs the loss,
            autograd and the optimizer between ONNX Runtime calls, and threads still spinning then would take
            its cores.
        release_torch_threads: on CPU, make PyTorch's idle OpenMP worker threads stop busy-waiting before each
            ONNX Runtime run, so that they do not share the cores with ONNX Runtime's threads. PyTorch's next
            parallel operator starts them again, so graphs whose last run took under 1 ms run without it.
            See :mod:`lightning_ort.engine.runtime.openmp`.
        cpu_matmul: which library multiplies matrices in CPU sessions: ``"auto"`` (whichever of the two ran the
            faster on a few layer-sized products, timed once per process), ``"mlas"`` (ONNX Runtime's own) or
            ``"mkl"`` (the MKL that PyTorch was built with, called on ONNX Runtime's threads). The two round
            differently, and ``"auto"``'s timing may choose differently from one run to the next on a busy
            machine: name one where runs must repeat bit for bit. See :mod:`lightning_ort.engine.runtime.cpu_matmul`.
        cuda_memory: where CUDA sessions allocate: ``"torch"`` (PyTorch's caching allocator, one pool with
            PyTorch), ``"shared_arena"`` (one ONNX Runtime arena for all sessions) or ``"session_arena"`` (ONNX
            Runtime's default, an arena per session). See :mod:`lightning_ort.engine.runtime.cuda_memory`.
        cuda_graph: on CUDA, replay each graph with static shapes as a CUDA graph (ONNX Runtime's
            ``enable_cuda_graph``): one launch per run instead of one per kernel, for models whose steps are many
            small kernels. Inputs are copied into the captured graph's own buffers and its outputs copied out;
            parameters stay bound as they are. A captured graph's session allocates from an arena of its own,
            whatever ``cuda_memory`` says. A graph that cannot be captured (symbolic sizes, control flow, a node
            the CUDA provider runs on the host) runs uncaptured, with a :class:`~lightning_ort.CudaGraphWarning`
            saying why. See :mod:`lightning_ort.engine.runtime.cuda_graph`.

    Example:
        >>> SessionSettings(optimization_level="extended").graph_optimization_level.name
        'ORT_ENABLE_EXTENDED'
    """

    providers: tuple[str, ...] | None = None
    optimization_level: OptimizationLevel = "all"
    intra_op_num_threads: int = 0
    allow_spinning: bool = True
    release_torch_threads: bool = True
    cpu_matmul: CpuMatmul = "auto"
    cuda_memory: CudaMemory = "torch"
    cuda_graph: bool = False

    def __post_init__(self) -> None:
        require_type(self, "optimization_level", str, f"one of {', '.join(map(repr, _OPTIMIZATION_LEVELS))}")
        require_type(self, "intra_op_num_threads", int, "an int >= 0 (0 lets ONNX Runtime decide)")
        require_type(self, "allow_spinning", bool, "True or False")
        require_type(self, "release_torch_threads", bool, "True or False")
        require_type(self, "cpu_matmul", str, f"one of {', '.join(map(repr, CPU_MATMUL))}")
        require_type(self, "cuda_memory", str, f"one of {', '.join(map(repr, CUDA_MEMORY))}")
        require_type(self, "cuda_graph", bool, "True or False")
        if self.providers is not None and (
            isinstance(self.providers, str) or not all(isinstance(p, str) for p in self.providers)
        ):
            raise argument_type_error("providers", self.providers, PROVIDERS_ACCEPTED)
        if self.optimization_level not in _OPTIMIZATION_LEVELS:
            allowed = ", ".join(_OPTIMIZATION_LEVELS)
            raise ValueError(f"optimization_level={self.optimization_level!r} is not one of {allowed}.")
        if self.cpu_matmul not in CPU_MATMUL:
            allowed = ", ".join(map(repr, CPU_MATMUL))
            raise ValueError(f"cpu_matmul={self.cpu_matmul!r} is not one of {allowed}.")
        if self.cuda_memory not in CUDA_MEMORY:
            allowed = ", ".join(map(repr, CUDA_MEMORY))
            raise ValueError(f"cuda_memory={self.cuda_memory!r} is not one of {allowed}.")
        if self.intra_op_num_threads < 0:
            raise ValueError(f"intra_op_num_threads={self.intra_op_num_threads} must be >= 0 (0 = ORT's default).")
        if self.providers is not None:
            available = ort.get_available_providers()
            unknown = [p for p in self.providers if p not in available]
            if unknown:
                raise ValueError(
                    f"providers={list(self.providers)!r}: {unknown} not available in this onnxruntime build; "
                    f"available: {available}."
                )

    @property
    def graph_optimization_level(self) -> ort.GraphOptimizationLevel:
        """The :class:`onnxruntime.GraphOptimizationLevel` for ``optimization_level``."""
        return _OPTIMIZATION_LEVELS[self.optimization_level]


_OPTIMIZATION_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def require_type(owner: object, name: str, kind: type | tuple[type, ...], accepted: str) -> None:
    """Raise a TypeError naming argument ``name`` of ``owner`` and the values it accepts, unless it is a ``kind``.

    Example:
        >>> require_type(SessionSettings(), "intra_op_num_threads", int, "an int >= 0")
    """
    value = getattr(owner, name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise argument_type_error(name, value, accepted)


def argument_type_error(name: str, value: object, accepted: str) -> TypeError:
    """The TypeError for argument ``name`` given ``value``, saying what it accepts."""
    return TypeError(f"{name}={value!r} is not accepted: {name} must be {accepted}.")


PROVIDERS_ACCEPTED = "a list of execution provider names (['CPUExecutionProvider']) or None"


BlockSpec = str | type[nn.Module]
"""A block class, or its name (``"GPT2Block"``, or with its module path)."""


@dataclass(frozen=True)
class ModuleOptions:
    """Every option of an :class:`~lightning_ort.ORTModule`, checked once by :meth:`checked`.

    ``ORTModule(...)`` checks its arguments through it, and the Lightning side (:class:`~lightning_ort.ORTConfig`)
    checks the strategies' and the callback's once, when they are made, then wraps each network with
    :meth:`ORTModule.with_options <lightning_ort.ORTModule.with_options>`, which checks nothing again. What
    depends on the wrapped module (the block classes it holds, the parameters its ``forward`` takes) is resolved
    when it is wrapped.

    Example:
        >>> options = ModuleOptions.checked(fallback="raise", dynamic_axes={"input_ids": [0, 1]})
        >>> options.fallback, options.dynamic_axes
        ('raise', {'input_ids': (0, 1)})
    """

    debug_options: DebugOptions = field(default_factory=DebugOptions)
    session_settings: SessionSettings = field(default_factory=SessionSettings)
    fallback: Fallback = "auto"
    cache_dir: Path | None = None
    dynamic: bool | None = None
    blocks: tuple[BlockSpec, ...] | Literal["auto"] | None = None
    dynamic_axes: dict[str, tuple[int, ...]] | None = None
    attention: AttentionPath = "auto"
    conv_weight_grad: ConvWeightGrad = "auto"

    @classmethod
    def checked(
        cls,
        debug_options: DebugOptions | None = None,
        session_settings: SessionSettings | None = None,
        fallback: str = "auto",
        cache_dir: str | os.PathLike[str] | None = None,
        dynamic: bool | None = None,
        blocks: Sequence[BlockSpec] | str | None = None,
        dynamic_axes: Mapping[str, Sequence[int] | int] | None = None,
        attention: str = "auto",
        conv_weight_grad: str = "auto",
    ) -> ModuleOptions:
        """The options, each checked and in one form.

        Raises:
            TypeError: an option of the wrong type (the error names it and what it takes).
            ValueError: an unknown fallback, attention path or ``conv_weight_grad``, an axis that is not an integer, or
                ``dynamic=False`` with ``dynamic_axes``.
        """
        if debug_options is not None and not isinstance(debug_options, DebugOptions):
            raise argument_type_error("debug_options", debug_options, "a DebugOptions or None")
        if session_settings is not None and not isinstance(session_settings, SessionSettings):
            raise argument_type_error("session_settings", session_settings, "a SessionSettings or None")
        if not isinstance(dynamic, (bool, type(None))):
            raise argument_type_error("dynamic", dynamic, "True, False or None (automatic)")
        if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
            raise argument_type_error("cache_dir", cache_dir, "a folder path (str or pathlib.Path) or None")
        return cls(
            debug_options if debug_options is not None else DebugOptions(),
            session_settings if session_settings is not None else SessionSettings(),
            parse_fallback(fallback),
            Path(cache_dir) if cache_dir is not None else None,
            dynamic,
            _block_specs(blocks),
            _axes(dynamic_axes, dynamic),
            parse_attention(attention),
            parse_conv_weight_grad(conv_weight_grad),
        )


def parse_attention(value: str) -> AttentionPath:
    """``value`` as an :data:`AttentionPath`.

    Raises:
        TypeError: ``value`` is not a string.
        ValueError: ``value`` is not ``"auto"``, ``"onnx"`` or ``"torch"``.

    Example:
        >>> parse_attention("torch")
        'torch'
    """
    return _choice(
        "attention",
        value,
        ATTENTION_PATHS,
        "'auto' (default) chooses by the device, 'onnx' exports attention's math into the graphs, "
        "'torch' keeps F.scaled_dot_product_attention as PyTorch's fused kernels.",
    )


def attention_on(attention: AttentionPath, device_type: str, cuda_graph: bool) -> Literal["onnx", "torch"]:
    """Where attention runs on a device of ``device_type``: ``attention`` itself unless it is ``"auto"``.

    ``"auto"`` keeps SDPA as PyTorch's fused kernels on CUDA, where they take less time and memory than the
    exported math (the performance page measures both), and exports it on the CPU, where ONNX Runtime's
    kernels are the faster, and under CUDA graphs, which capture whole graphs.

    Example:
        >>> attention_on("auto", "cuda", cuda_graph=False), attention_on("auto", "cpu", cuda_graph=False)
        ('torch', 'onnx')
        >>> attention_on("auto", "cuda", cuda_graph=True), attention_on("torch", "cpu", cuda_graph=False)
        ('onnx', 'torch')
    """
    if attention != "auto":
        return attention
    return "torch" if device_type == "cuda" and not cuda_graph else "onnx"


def parse_conv_weight_grad(value: str) -> ConvWeightGrad:
    """``value`` as a :data:`ConvWeightGrad`.

    Raises:
        TypeError: ``value`` is not a string.
        ValueError: ``value`` is not ``"auto"``, ``"onnx"`` or ``"torch"``.

    Example:
        >>> parse_conv_weight_grad("torch")
        'torch'
    """
    return _choice(
        "conv_weight_grad",
        value,
        CONV_WEIGHT_GRADS,
        "'auto' (default) chooses per layer, 'onnx' computes every convolution's weight gradient in the ONNX "
        "Runtime graphs, 'torch' in PyTorch's own kernel.",
    )


_Choice = TypeVar("_Choice", bound=str)


def _choice(argument: str, value: object, choices: tuple[_Choice, ...], meanings: str) -> _Choice:
    """``value`` as one of ``choices``; a TypeError for a non-string, a ValueError naming ``argument``, the choices
    and their ``meanings`` for another string."""
    allowed = ", ".join(map(repr, choices))
    if not isinstance(value, str):
        raise argument_type_error(argument, value, f"one of {allowed}")
    for choice in choices:
        if value == choice:
            return choice
    raise ValueError(f"{argument}={value!r} is not one of {allowed}: {meanings}")


def _block_specs(blocks: Sequence[BlockSpec] | str | None) -> tuple[BlockSpec, ...] | Literal["auto"] | None:
    """``blocks`` as ``None``, ``"auto"`` or a tuple of classes and class names."""
    if blocks is None:
        return None
    if blocks == "auto":
        return "auto"
    specs = (blocks,) if isinstance(blocks, (str, type)) else tuple(blocks)
    if not all(isinstance(spec, str) or (isinstance(spec, type) and issubclass(spec, nn.Module)) for spec in specs):
        raise argument_type_error("blocks", blocks, "'auto', None, or nn.Module classes or their names")
    return specs


def _axes(
    dynamic_axes: Mapping[str, Sequence[int] | int] | None, dynamic: bool | None
) -> dict[str, tuple[int, ...]] | None:
    """``dynamic_axes`` with each parameter's axes as a tuple of ints; ``None`` for none."""
    if not dynamic_axes:
        return None
    if not isinstance(dynamic_axes, Mapping):
        raise TypeError(
            f"dynamic_axes={dynamic_axes!r}: pass a mapping from forward's parameter names to axes, such as "
            '{"input_ids": [0, 1]}.'
        )
    refuse_static_with_dynamic_axes(dynamic, dynamic_axes)
    axes: dict[str, tuple[int, ...]] = {}
    for name, dims in dynamic_axes.items():
        listed = [dims] if isinstance(dims, int) else list(dims)
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in listed):
            raise ValueError(f"dynamic_axes={{{name!r}: {dims!r}}}: axes must be integers, such as [0, 1].")
        axes[name] = tuple(listed)
    return axes
