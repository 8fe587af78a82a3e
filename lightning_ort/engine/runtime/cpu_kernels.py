"""lightning_ort's own ONNX Runtime CPU kernels: training-mode batch norm (``batch_norm_kernels.cpp``).

The kernels are a small C++ library built on first use with ``torch.utils.cpp_extension`` (in its extension
folder, under a name with a hash of the source, so that two versions of lightning_ort on one machine do not
rebuild each other's), which ONNX Runtime loads into each session whose model uses their
domain (:data:`~lightning_ort.engine.onnx.custom_ops.DOMAIN`). Without a C++ compiler the build fails once, a
warning says so, and graphs keep the standard ONNX ops.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import onnx
import onnxruntime as ort

from lightning_ort.engine.once import Once
from lightning_ort.engine.onnx.custom_ops import DOMAIN
from lightning_ort.errors import first_line

_SOURCE = Path(__file__).with_name("batch_norm_kernels.cpp")
_FLAGS = ["-O3", "-ffp-contract=off"]


@Once
def batch_norm_kernels() -> Path | None:
    """The built kernel library, or ``None`` (with a warning, once) where it cannot be built."""
    try:
        from torch.utils import cpp_extension

        name = f"lightning_ort_batch_norm_kernels_{_source_digest()}"
        path = cpp_extension.load(name, [str(_SOURCE)], extra_cflags=_FLAGS, is_python_module=False)
    except Exception as err:
        warnings.warn(
            f"lightning_ort: its fused batch-norm kernels could not be built ({first_line(err)}); batch norms "
            "run as standard ONNX ops, which is slower on CPU. Install a C++ compiler (g++ or clang++) to build "
            "them.",
            stacklevel=2,
        )
        return None
    return Path(path)


def _source_digest() -> str:
    """The first 12 hex digits of the SHA-256 of the kernels' source and compiler flags."""
    return hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode()).hexdigest()[:12]


def uses_kernels(model: onnx.ModelProto) -> bool:
    """Whether ``model`` has nodes of lightning_ort's kernels."""
    return any(opset.domain == DOMAIN for opset in model.opset_import)


def register_kernels(options: ort.SessionOptions, model: onnx.ModelProto) -> None:
    """Make a session of ``model`` with ``options`` find lightning_ort's kernels, where the model uses them.

    Raises:
        RuntimeError: the model uses them (it was built in a process that had them, and cached) but they cannot
            be built here.
    """
    if not uses_kernels(model):
        return
    library = batch_norm_kernels()
    if library is None:
        raise RuntimeError(
            f"the graph uses lightning_ort's batch-norm kernels ({DOMAIN} nodes), which could not be built here; "
            "clear the graph cache (cache_dir) or install a C++ compiler"
        )
    options.register_custom_ops_library(str(library))
