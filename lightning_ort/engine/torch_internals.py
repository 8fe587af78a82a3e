"""What lightning_ort uses from inside torch that torch does not promise to keep: imported here, and only here.

Each name below is private to torch (a leading underscore in its module path) or an argument newer than the
oldest torch the package supports (:data:`TORCH_FLOOR`). Those that moved or appeared between supported
versions are feature-tested, with a fallback that keeps training working; the rest have been stable across the
supported range and fail at import with an error that names the torch version (:func:`require`). The list,
with what each is for, is in ``docs/how-it-works.md`` ("What we rely on inside torch").
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import os
import re
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch.torch_version import TorchVersion

TORCH_FLOOR = "2.11"
"""The oldest torch release the package is tested with (``nox -s compat``)."""


def require(module: str, *names: str) -> tuple[Any, ...]:
    """``names`` from torch's private ``module``, or an ImportError that names the torch version and the remedy.

    Example:
        >>> (counters,) = require("torch._dynamo.utils", "counters")
        >>> "frames" in counters or isinstance(counters, dict)
        True
    """
    try:
        loaded = importlib.import_module(module)
        return tuple(getattr(loaded, name) for name in names)
    except (ImportError, AttributeError) as err:
        raise ImportError(
            f"lightning_ort needs {', '.join(names)} from {module}, which torch {torch.__version__} does not have "
            f"({err}). lightning_ort is tested with torch {TORCH_FLOOR} to 2.13: install a torch in that range."
        ) from err


# TorchDynamo: its counters, errors and configuration.
dynamo_config: Any = importlib.import_module("torch._dynamo.config")
counters, calculate_time_spent = require("torch._dynamo.utils", "counters", "calculate_time_spent")
BackendCompilerFailed, Unsupported, UserError, UncapturedHigherOrderOpError = require(
    "torch._dynamo.exc", "BackendCompilerFailed", "Unsupported", "UserError", "UncapturedHigherOrderOpError"
)
(aot_autograd,) = require("torch._dynamo.backends.common", "aot_autograd")
(maybe_mark_dynamic,) = require("torch._dynamo", "maybe_mark_dynamic")

# Pytrees (nested arguments and outputs), and what nn.functional and nn keep private.
__all__ = ["AOTDispatchCompiler", "pytree"]
canonical_mask, none_or_dtype = require("torch.nn.functional", "_canonical_mask", "_none_or_dtype")
(LossBase,) = require("torch.nn.modules.loss", "_Loss")
"""The base class of ``torch.nn``'s loss modules (``nn.CrossEntropyLoss``...)."""

# AOTAutograd and fake tensors.
if TYPE_CHECKING:
    from torch._functorch._aot_autograd.schemas import AOTDispatchCompiler
functorch_config: Any = importlib.import_module("torch._functorch.config")
(min_cut_rematerialization_partition,) = require("torch._functorch.partitioners", "min_cut_rematerialization_partition")
detect_fake_mode, tracing = require("torch._guards", "detect_fake_mode", "tracing")
FakeTensor, FakeTensorMode, unset_fake_temporarily = require(
    "torch._subclasses.fake_tensor", "FakeTensor", "FakeTensorMode", "unset_fake_temporarily"
)
core_aten_decompositions, get_decompositions = require(
    "torch._decomp", "core_aten_decompositions", "get_decompositions"
)
(FloorDiv,) = require("torch.utils._sympy.functions", "FloorDiv")
_SYMPY_FUNCTIONS = importlib.import_module("torch.utils._sympy.functions")
SIZE_FUNCTIONS: dict[str, Any] = {
    name: getattr(_SYMPY_FUNCTIONS, name)
    for name in ("CeilToInt", "CleanDiv", "FloorToInt", "IntTrueDiv", "ModularIndexing", "PythonMod")
    if hasattr(_SYMPY_FUNCTIONS, name)
}
"""torch's sympy functions that symbolic sizes can hold, by class name (those this torch has)."""
HigherOrderOperator, OpOverload = require("torch._ops", "HigherOrderOperator", "OpOverload")
AOT_GRAPH_COMPILE_LOG = "torch._functorch._aot_autograd.graph_compile"
"""The logger AOTAutograd reports a deferred backward compilation failure to."""


TRACES_RECURRENT_LAYERS: bool = TorchVersion(torch.__version__) >= (2, 13)  # type: ignore[operator]
"""Whether TorchDynamo traces ``nn.LSTM`` correctly with ``allow_rnn``: torch 2.11 traces an LSTM given a hidden
state into a graph that fails (``hx and cx should also be 3-D``), so there recurrent layers stay graph breaks."""


def recompile_reason() -> str | None:
    """Why TorchDynamo is compiling the current frame again, or ``None`` (first compile, or a torch without it)."""
    try:
        from torch._dynamo.utils import get_metrics_context
    except ImportError:
        return None
    reason = getattr(get_metrics_context(), "_metrics", {}).get("recompile_reason")
    return str(reason) if reason else None


def tangents_by_format() -> contextlib.AbstractContextManager[None]:
    """AOTAutograd traces tangents by memory format (contiguous, channels-last), not by the outputs' strides.

    With strides, AOTAutograd copies each incoming gradient into an empty tensor of its output's strides
    (``empty_strided(...).copy_(grad)``). For an output whose elements overlap in memory, such as
    ``h.unfold(1, 6, 4)`` or an overlapping ``as_strided`` view of an intermediate, that copy keeps one of the
    gradients that share an element and drops the others: the backward then computes wrong gradients without
    an error. AOTAutograd only recognises overlap through stride 0 (``expand``). ONNX graphs have no strides,
    so the tangents' layout costs nothing here, and a memory format never loses values. torch releases without
    the setting lay tangents out by memory format already.
    """
    if not hasattr(functorch_config, "guess_tangent_strides_as_outputs"):
        return contextlib.nullcontext()
    return functorch_config.patch(guess_tangent_strides_as_outputs=False)


def nested_compile_region(fn: Callable[..., Any], max_reuse_entries: int) -> Callable[..., Any]:
    """``torch.compiler.nested_compile_region(fn)``, with ``max_reuse_entries`` where torch has that limit.

    torch 2.13 caps the input signatures one region may be traced with (8 by default); 2.11 has no cap.
    """
    region = torch.compiler.nested_compile_region
    if "max_reuse_entries" in inspect.signature(region).parameters:
        return region(fn, max_reuse_entries=max_reuse_entries)
    return region(fn)


INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph
"""The higher-order op a nested compile region's call becomes in a captured graph."""


def size_hint(size: int | torch.SymInt) -> int | None:
    """``size``'s value in the example a graph was traced with (a symbolic size's hint); ``None`` if unknown.

    Reading the hint adds no guard, as ``int(size)`` would: the graph stays as general as TorchDynamo made it.

    Example:
        >>> size_hint(8)
        8
    """
    if isinstance(size, int):
        return size
    node = size.node
    return int(node.hint) if node.has_hint() else None


def tensor_operands(op: Any) -> list[bool]:
    """For each positional argument of ``op``'s schema, whether it takes a tensor (``Tensor other`` of
    ``aten.mul.Tensor``, not ``Scalar alpha`` of ``aten.add.Tensor``): ``OpOverload._schema``.

    Example:
        >>> tensor_operands(torch.ops.aten.add.Tensor)
        [True, True, False]
    """
    return [isinstance(argument.type, torch.TensorType) for argument in op._schema.arguments]


@contextlib.contextmanager
def onednn_off() -> Iterator[None]:
    """oneDNN off for the block, and none of its other settings changed (``torch._C._set_mkldnn_enabled``).

    The public switches do more: ``torch.backends.mkldnn.flags()`` also sets TF32, which warns on every call
    where no Intel GPU is built in, and determinism, and assigning ``torch.backends.mkldnn.enabled`` raises
    after ``torch.backends.disable_global_flags()`` (which PyTorch's own test utilities call).

    Example:
        >>> with onednn_off():
        ...     torch.backends.mkldnn.enabled
        False
    """
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


# The ONNX exporter (torch.onnx's dynamo path).
(ONNX_DEFAULT_OPSET,) = require("torch.onnx._constants", "ONNX_DEFAULT_OPSET")


@dataclass(frozen=True)
class ExporterSteps:
    """The exporter's steps behind ``torch.onnx.export(..., dynamo=True)``, as torch 2.11 to 2.13 lay them out.

    :func:`exporter_steps` gives ``None`` for a torch that lays them out otherwise: graphs are then exported
    through the public ``torch.onnx.export``, and which ops have ONNX translations is learnt from export failures.
    """

    registry_class: Any
    export_core: Callable[..., Any]
    to_onnx_program: Callable[..., Any]
    convert_version: Callable[..., Any]
    implemented_overloads: Callable[..., Any]
    decomposition_table: Callable[..., Any]
    insert_type_promotion_nodes: Callable[..., Any]
    remove_assertion_nodes: Callable[..., Any]


def exporter_steps() -> ExporterSteps | None:
    """The exporter's private steps, or ``None`` where they moved or take other arguments.

    Example:
        >>> exporter_steps() is not None
        True
    """
    try:
        from torch.onnx._internal._lazy_import import onnxscript_apis
        from torch.onnx._internal.exporter import _core, _decomp, _fx_passes, _registration
    except ImportError:
        return None
    needed = {"registry", "dynamic_shapes", "verbose", "optimize", "opset_version"}
    if not needed <= set(inspect.signature(_core.export).parameters):
        return None
    try:
        return ExporterSteps(
            registry_class=_registration.ONNXRegistry,
            export_core=_core.export,
            to_onnx_program=_core._exported_program_to_onnx_program,
            convert_version=onnxscript_apis.convert_version,
            implemented_overloads=_decomp.get_onnx_implemented_overloads,
            decomposition_table=_decomp.create_onnx_friendly_decomposition_table,
            insert_type_promotion_nodes=_fx_passes.insert_type_promotion_nodes,
            remove_assertion_nodes=_fx_passes.remove_assertion_nodes,
        )
    except AttributeError:
        return None


EXPORTER_STEPS = exporter_steps()


def graph_break_reasons() -> list[Any] | None:
    """TorchDynamo's record of the graph breaks it hit, oldest first, or ``None`` on a torch without it.

    Each entry has the break's ``reason`` and the ``user_stack`` (``traceback.FrameSummary``s) that led to it;
    ``torch._dynamo.explain`` reads the same record. ``torch._dynamo.reset()`` empties it.
    """
    reasons = getattr(importlib.import_module("torch._dynamo.utils"), "graph_break_reasons", None)
    return reasons if isinstance(reasons, list) else None


# SDPA's fused kernels, by the ATen ops they dispatch to: the set differs between torch releases.
_FUSED_ATTENTION_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
)
FUSED_ATTENTION_FORWARD: frozenset[Any] = frozenset(
    getattr(torch.ops.aten, name).default for name in _FUSED_ATTENTION_OPS if hasattr(torch.ops.aten, name)
) | frozenset({torch.ops.aten.scaled_dot_product_attention.default})
"""SDPA and the fused forward ops it dispatches to (flash, memory-efficient, cuDNN, the CPU flash kernel)."""
FUSED_ATTENTION: frozenset[Any] = FUSED_ATTENTION_FORWARD | frozenset(
    getattr(torch.ops.aten, f"{name}_backward").default
    for name in _FUSED_ATTENTION_OPS
    if hasattr(torch.ops.aten, f"{name}_backward")
)
"""The fused forward ops and their backward ops."""


# TorchDynamo's and the exporter's wording, read where they report nothing else.
RECOMPILE_LOGGER = "torch._dynamo.convert_frame"
"""The logger TorchDynamo warns on when it stops recompiling a function (a recompile limit)."""
GRAPH_BREAK_LOGGERS = (
    "torch._dynamo.variables.tensor",
    "torch._dynamo.symbolic_convert",
    "torch._dynamo.variables.builtin",
)
"""The loggers TorchDynamo writes its own lines about graph breaks to."""


def recompile_limit_hit(record: logging.LogRecord) -> tuple[str, str, str, str] | None:
    """Limit, value, function and reason of TorchDynamo's "hit config.recompile_limit" warning, or ``None``.

    Example:
        >>> record = logging.LogRecord("torch", 30, "", 0, "torch._dynamo hit config.%s (%s)...", None, None)
        >>> record.args = ("recompile_limit", 8, "forward", "size changed")
        >>> recompile_limit_hit(record)
        ('recompile_limit', '8', 'forward', 'size changed')
    """
    args = tuple(record.args or ()) if isinstance(record.args, tuple) else ()
    if not str(record.msg).startswith("torch._dynamo hit config.") or len(args) < 4:
        return None
    limit, value, function, reason = (str(arg) for arg in args[:4])
    return limit, value, function, reason


METRICS_LOGGER = "torch._dynamo.metrics_context"
"""The logger TorchDynamo reports failures to record a compilation's metrics on."""


def _config_logging_accepts_functions() -> bool:
    """Whether TorchDynamo's compilation metrics can record a function in ``ignore_logging_functions``.

    torch 2.11 serialises that setting to JSON with each compilation's metrics, so a function in it fails
    the record, and TorchDynamo logs the ``TypeError``'s traceback at ERROR level (harmless otherwise); later
    releases leave the setting out of the record.
    """
    (config_for_logging,) = require("torch._dynamo.utils", "_get_dynamo_config_for_logging")
    with dynamo_config.patch(ignore_logging_functions={logging.Logger.warning}):
        try:
            config_for_logging()
        except TypeError:
            return False
    return True


CONFIG_LOGGING_ACCEPTS_FUNCTIONS = _config_logging_accepts_functions()


def is_config_logging_failure(record: logging.LogRecord) -> bool:
    """Whether ``record`` is TorchDynamo's report that its configuration could not be serialised for the
    compilation metrics (see :data:`CONFIG_LOGGING_ACCEPTS_FUNCTIONS`): a ``TypeError`` raised inside
    ``_get_dynamo_config_for_logging``."""
    error = record.exc_info[1] if record.exc_info else None
    if not isinstance(error, TypeError):
        return False
    return any(frame.name == "_get_dynamo_config_for_logging" for frame in traceback.extract_tb(error.__traceback__))


def is_graph_break_log(record: logging.LogRecord) -> bool:
    """Whether ``record`` is one of TorchDynamo's own lines about a graph break."""
    return "graph break" in str(record.msg).lower()


def uncaptured_reason(error: BaseException) -> str:
    """The graph break that kept TorchDynamo from capturing a nested compile region, from its error's text."""
    return str(getattr(error, "msg", error)).split("Got graph break/error:", 1)[-1].strip()


_EXPORTER_OP = re.compile(r"OpOverload\(op='([\w.]+)', overload='(\w+)'\)")


def untranslated_op(error: BaseException) -> tuple[str, str] | None:
    """The ATen op (packet, overload) that ``torch.onnx``'s ``error`` says it has no translation for, or ``None``.

    Example:
        >>> untranslated_op(RuntimeError("... OpOverload(op='aten.nonzero', overload='default') ..."))
        ('aten.nonzero', 'default')
    """
    match = _EXPORTER_OP.search(str(error))
    return (match.group(1), match.group(2)) if match else None


FSDP_FOLDER = os.path.join(os.path.dirname(torch.__file__), "distributed", "fsdp") + os.sep
"""Where FSDP's code lies: its hooks around a sharded module are a graph break by design."""


def in_fsdp_hooks(stack: Sequence[traceback.FrameSummary]) -> bool:
    """Whether a graph break with user stack ``stack`` happened in FSDP's own hooks (``fully_shard``'s pre- and
    post-forward, which TorchDynamo is told to skip)."""
    return bool(stack) and stack[-1].filename.startswith(FSDP_FOLDER)


# TorchDynamo's compilation events and guards, for torch.backends.mha's attention fast-path switch: it is off only
# while TorchDynamo compiles (and so traces) a call of ours, and the guard TorchDynamo puts on it is dropped, so
# that calls of compiled graphs leave the switch alone.
(COMPILATION_EVENTS,) = require("torch._dynamo.callback", "callback_handler")
FAST_PATH_FLAG = "_is_fastpath_enabled"
"""The module global of ``torch.backends.mha`` that ``set_fastpath_enabled`` sets and TorchDynamo guards on."""
_PENDING_COMPILATIONS = "_CompilationCallbackHandler__pending_callbacks_counter"


GUARDS_FILTER_SAFELY: bool = TorchVersion(torch.__version__) >= (2, 13)  # type: ignore[operator]
"""Whether ``torch.compile``'s ``guard_filter_fn`` works on every model. Torch 2.11 builds the guards twice to
filter them and fails on some the second time (Hugging Face GPT-2 with block graphs: "Guarded object must be
identical"); there the switch is held off for the whole of each call that could take the fast path."""


def compilations_in_flight() -> bool:
    """Whether TorchDynamo is compiling anything in this process now (``True`` when this torch does not say, so
    that a caller falls back to what is safe without the answer)."""
    return getattr(COMPILATION_EVENTS, _PENDING_COMPILATIONS, 1) > 0


def is_fast_path_guard(entry: Any) -> bool:
    """Whether a TorchDynamo guard (an entry given to ``torch.compile``'s ``guard_filter_fn``) checks
    ``torch.backends.mha``'s fast-path switch.

    Example:
        >>> from types import SimpleNamespace
        >>> is_fast_path_guard(SimpleNamespace(name="G['__import_torch_dot_backends_dot_mha']._is_fastpath_enabled"))
        True
    """
    return str(getattr(entry, "name", "")).endswith("." + FAST_PATH_FLAG)
