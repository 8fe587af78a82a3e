"""lightning_ort's own ONNX Runtime CPU kernels: training-mode batch norm (``batch_norm_kernels.cpp``), the
max-pooling gradient (``max_pool_kernels.cpp``), the weaving of a stride-2 convolution's input gradient, the
subsampling of a strided projection's input and the blocking of convolution weights for ONNX Runtime's NCHWc
kernels (``conv_kernels.cpp``), GELU's and SiLU's gradients (``activation_kernels.cpp``), layer norm's
(``layer_norm_kernels.cpp``), group norm, forward and gradient (``group_norm_kernels.cpp``), transposes
(``transpose_kernels.cpp``) and matrix products through MKL (``matmul_kernels.cpp``), over the part of
ONNX Runtime's C ABI they declare (``ort_custom_ops.h``) and registered by ``register_kernels.cpp``.

The kernels are a small C++ library built on first use with ``torch.utils.cpp_extension`` (in its extension
folder, under a name with a hash of the sources, so that two versions of lightning_ort on one machine do not
rebuild each other's), which ONNX Runtime loads into each session whose model uses their
domain (:data:`~lightning_ort.engine.onnx.custom_ops.DOMAIN`). Once built, a small batch norm runs through them
and is compared with the op's PyTorch form before any graph uses them. Where the build or that check fails (no
C++ compiler, an ONNX Runtime whose C API the kernels do not read right), a warning says so, once, and graphs
keep the standard ONNX ops.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
import torch
from onnx import helper

from lightning_ort.engine.fx.batch_norm import BATCH_NORM_TRAINING
from lightning_ort.engine.once import Once
from lightning_ort.engine.onnx.custom_ops import DOMAIN, uses_kernels
from lightning_ort.engine.torch_internals import unset_fake_temporarily
from lightning_ort.errors import first_line

_HERE = Path(__file__).parent
_SOURCES = [
    _HERE / name
    for name in (
        "batch_norm_kernels.cpp",
        "max_pool_kernels.cpp",
        "conv_kernels.cpp",
        "activation_kernels.cpp",
        "layer_norm_kernels.cpp",
        "group_norm_kernels.cpp",
        "transpose_kernels.cpp",
        "matmul_kernels.cpp",
        "register_kernels.cpp",
    )
]
_HEADERS = (_HERE / "ort_custom_ops.h", _HERE / "x86_tiles.h")
_FLAGS = ["-O3", "-ffp-contract=off", "-fno-trapping-math"]
"""No contraction into fused multiply-adds, so that the batch norm's forward and gradient compute the same values;
no floating-point traps assumed (none are enabled), so that the compiler vectorizes loops that select between
computed values."""


@Once
def kernel_library() -> Path | None:
    """The built and checked kernel library, or ``None`` (with a warning, once) where that fails."""
    try:
        from torch.utils import cpp_extension

        name = f"lightning_ort_cpu_kernels_{_source_digest()}"
        sources = [str(source) for source in _SOURCES]
        path = Path(cpp_extension.load(name, sources, extra_cflags=_FLAGS, is_python_module=False))
        with unset_fake_temporarily():  # the first call may come while TorchDynamo compiles, under fake tensors
            _check(path)
    except Exception as err:
        warnings.warn(
            f"lightning_ort: its CPU kernels (fused batch norm, max-pooling gradient, strided convolutions' input "
            f"gradient, GELU's, SiLU's and layer norm's gradients, group norm) could not be built or did not run "
            f"right ({first_line(err)}); batch norms, max pooling and those gradients run as standard ONNX ops, "
            "which is slower on CPU. Install a C++ compiler (g++ or clang++) to build them.",
            stacklevel=2,
        )
        return None
    return path


def _check(library: Path) -> None:
    """Run a batch norm with ReLU through ``library``'s forward kernel and compare it with the op's PyTorch form.

    Raises:
        Exception: ONNX Runtime refused the library or the node, or the results differ.
    """
    shapes = {"X": [2, 3, 4, 5], "scale": [3], "B": [3], "running_mean": [3], "running_var": [3]}
    outputs = ["Y", "mean", "invstd", "new_running_mean", "new_running_var"]
    attributes: dict[str, Any] = {"epsilon": 1e-5, "momentum": 0.1, "clamp": 1, "min": 0.0, "max": math.inf}
    node = helper.make_node("BatchNormTraining", list(shapes), outputs, domain=DOMAIN, **attributes)
    graph = helper.make_graph(
        [node],
        "batch_norm_kernels_check",
        [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape) for name, shape in shapes.items()],
        [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in outputs],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)]
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    generator = torch.Generator().manual_seed(0)
    feeds = {name: torch.rand(shape, generator=generator) * 2 - 0.5 for name, shape in shapes.items()}
    feeds["running_var"] = feeds["running_var"].abs()
    expected = BATCH_NORM_TRAINING(*feeds.values(), 0.1, 1e-5, True, 0.0, math.inf)
    actual = session.run(None, {name: value.numpy() for name, value in feeds.items()})
    for name, ours, theirs in zip(outputs, actual, expected, strict=True):
        torch.testing.assert_close(torch.from_numpy(ours), theirs, rtol=1e-4, atol=1e-5, msg=f"output {name}")


def _source_digest() -> str:
    """The first 12 hex digits of the SHA-256 of the kernels' sources, their headers and the compiler flags."""
    digest = hashlib.sha256()
    for path in [*_SOURCES, *_HEADERS]:
        digest.update(path.read_bytes())
    digest.update(" ".join(_FLAGS).encode())
    return digest.hexdigest()[:12]


def register_kernels(options: ort.SessionOptions, model: onnx.ModelProto) -> None:
    """Make a session of ``model`` with ``options`` find lightning_ort's kernels, where the model uses them.

    Raises:
        RuntimeError: the model uses them (it was built in a process that had them, and cached) but they cannot
            be built here.
    """
    if not uses_kernels(model):
        return
    library = kernel_library()
    if library is None:
        raise RuntimeError(
            f"the graph uses lightning_ort's CPU kernels ({DOMAIN} nodes), which could not be built here; "
            "clear the graph cache (cache_dir) or install a C++ compiler"
        )
    options.register_custom_ops_library(str(library))
