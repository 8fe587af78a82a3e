"""lightning_ort's errors and warnings: one base class for every error, and one way to warn.

Every error says what went wrong, where (the argument, op, module path or file and line) and what to do.
Warnings point at the user's line that called into lightning_ort (the first frame outside lightning_ort,
PyTorch and Lightning), and under ``torch.distributed`` only rank zero issues them, as Lightning's
``rank_zero_warn`` does.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
import warnings
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.fx


class LightningORTError(RuntimeError):
    """Base class of lightning_ort's errors.

    Args:
        message: what went wrong, where, and what to do.
        nodes: names of the captured graph's nodes the failure names (empty when it names none); the per-op
            fallback sends those ops to PyTorch.

    Example:
        >>> error = ExportError("ONNX export of the forward graph failed at op `aten.foo`", ["foo_1"])
        >>> isinstance(error, LightningORTError), error.nodes
        (True, ('foo_1',))
    """

    def __init__(self, message: str, nodes: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.nodes = tuple(nodes)


class ORTModuleError(LightningORTError):
    """Misuse of :class:`~lightning_ort.ORTModule` that the original onnxruntime-training ORTModule also refused."""


class CaptureError(LightningORTError):
    """TorchDynamo could not capture the model as graphs ONNX Runtime runs, and ``fallback="raise"`` was asked for."""


class ExportError(LightningORTError):
    """ONNX export failed: of a captured graph (the message names the op and where it came from), or of a model
    for deployment (the reason, or the output that differs from eager PyTorch)."""


class SessionError(LightningORTError):
    """ONNX Runtime could not load an exported graph (typically: no kernel for an op and dtype on the provider),
    or failed while running one."""


class BlockError(LightningORTError, ValueError):
    """``blocks=`` names a class the model does not hold, or a block cannot be captured as one graph."""


class FallbackWarning(UserWarning):
    """Part of a model (some ops, code between graphs, or a whole graph) runs in PyTorch instead of ONNX Runtime."""


class GraphBreakWarning(FallbackWarning):
    """TorchDynamo split a forward at a graph break: the code at the break runs in PyTorch."""


class RecompileLimitWarning(FallbackWarning):
    """TorchDynamo stopped recompiling a function (a recompile limit): from then on it runs in PyTorch."""


class CudaGraphWarning(UserWarning):
    """A graph asked to be replayed as a CUDA graph (``SessionSettings(cuda_graph=True)``) runs uncaptured; the
    message says why."""


class DiskCacheWarning(UserWarning):
    """The on-disk graph cache could not be used for one graph; training goes on without it."""


def package_folder(module: str) -> str | None:
    """The folder of the imported package ``module``, ending in a separator; ``None`` if it is not imported."""
    loaded = sys.modules.get(module)
    file = getattr(loaded, "__file__", None)
    return os.path.dirname(file) + os.sep if file else None


_INTERNAL_MODULES = ("lightning_ort", "torch", "lightning", "lightning_fabric", "pytorch_lightning")


def _internal_folders() -> tuple[str, ...]:
    folders = (package_folder(name) for name in _INTERNAL_MODULES)
    return (*(folder for folder in folders if folder), "<frozen ")


def user_stacklevel(frame: FrameType | None) -> int:
    """The ``stacklevel`` of the first frame outside lightning_ort, PyTorch and Lightning, counted from ``frame``.

    ``frame`` itself is level 1.
    """
    internal = _internal_folders()
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame = frame.f_back
        level += 1
    return level


def _on_rank_zero() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def warn(message: str, category: type[Warning] = FallbackWarning) -> None:
    """Issue ``message`` from the user's line that called into lightning_ort, on rank zero only.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn("lightning_ort: part of the model runs in PyTorch")
        >>> caught[0].category.__name__
        'FallbackWarning'
    """
    if _on_rank_zero():
        warnings.warn(message, category, stacklevel=user_stacklevel(sys._getframe(1)) + 1)


def first_line(error: BaseException | str) -> str:
    """The first non-empty line of ``error``'s message (its type name if the message is empty), for summaries.

    Example:
        >>> first_line(ValueError("\\nbad shape\\nmore detail"))
        'bad shape'
    """
    text = str(error).strip()
    if not text:
        return type(error).__name__ if isinstance(error, BaseException) else ""
    return text.splitlines()[0].strip()


_DYNAMO_ROOT = re.compile(r"^L\['\w+'\]\.?")
"""TorchDynamo's name for the traced function's argument (``L['module'].encoder`` is ``encoder``)."""

_BLOCK_ARGUMENT = re.compile(r"\.forward\.args\[\d+\]")
"""How a block graph's nodes name the block module, an argument of its call (``layers.0.forward.args[1].attn``
is ``layers.0.attn``)."""


def node_origin(node: torch.fx.Node) -> str:
    """Where a captured graph's node came from: its module path and class, else its source line ("" if unknown)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if stack:
        path, module_type = list(stack.values())[-1]
        path = _BLOCK_ARGUMENT.sub("", _DYNAMO_ROOT.sub("", path)) or "."
        type_name = getattr(module_type, "__name__", str(module_type))
        return f"module `{path}` ({type_name})"
    return innermost_line(node.meta.get("stack_trace") or "")


_FILE_LINE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)')


def innermost_line(trace: str) -> str:
    """``file:line (`code`)`` of a formatted stack trace's innermost frame ("" if it has none).

    Example:
        >>> innermost_line('Traceback:\\n  File "m.py", line 3, in forward\\n    if x.sum() > 0:')
        'm.py:3 (`if x.sum() > 0:`)'


    Python 3.11 underlines the failing expression with a line of ``^`` and ``~``, which is not the code.
    """
    lines = trace.splitlines()
    for index in range(len(lines) - 1, -1, -1):
        match = _FILE_LINE.match(lines[index])
        if match:
            code = lines[index + 1].strip() if index + 1 < len(lines) else ""
            return f"{match['file']}:{match['line']}" + (f" (`{code}`)" if code else "")
    return ""


def user_frame(error: BaseException) -> str:
    """``file:line (`code`)`` of the model code TorchDynamo stopped at."""
    stack = getattr(error, "real_stack", None)
    return frame_line(stack[-1]) if stack else "an unknown line"


def frame_line(frame: traceback.FrameSummary) -> str:
    """``file:line (`code`)`` of a stack ``frame`` (without the code where Python has none)."""
    code = (frame.line or "").strip()
    return f"{frame.filename}:{frame.lineno}" + (f" (`{code}`)" if code else "")
