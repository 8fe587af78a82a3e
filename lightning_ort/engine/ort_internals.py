"""What lightning_ort uses from inside ONNX Runtime that it does not promise to keep: imported here, and only here.

The run path binds PyTorch memory through ONNX Runtime's pybind11 layer (``onnxruntime.capi._pybind_state``),
the one its own ``IOBinding`` and ``InferenceSession`` wrap: the Python wrappers build an ``OrtDevice`` per bound
tensor and a DLPack exchange per output, a cost that dominates small graphs (onnxruntime-training's
``ORTModule`` used the same layer). The wording of ONNX Runtime's errors, read to name the failing node, is
parsed here too. Each name is feature-tested at import: an ONNX Runtime without it fails with an error that
names its version.
"""

from __future__ import annotations

import re
from typing import Any

import onnxruntime as ort

ORT_TESTED = "1.20"
"""The oldest ONNX Runtime release the run path is known to work with."""

try:
    from onnxruntime.capi._pybind_state import OrtDevice as CDevice
    from onnxruntime.capi._pybind_state import OrtValueVector, SessionIOBinding
except ImportError as error:
    raise ImportError(
        f"lightning_ort binds PyTorch memory through ONNX Runtime's pybind11 layer, and onnxruntime "
        f"{ort.__version__} lacks part of it ({error}). Install onnxruntime-gpu {ORT_TESTED} or newer."
    ) from error
if not hasattr(ort.OrtDevice, "_get_c_device"):
    raise ImportError(
        f"onnxruntime {ort.__version__}'s OrtDevice has no pybind11 device (`_get_c_device`); install "
        f"onnxruntime-gpu {ORT_TESTED} or newer."
    )

__all__ = ["CDevice", "OrtValueVector", "SessionIOBinding", "c_device", "failing_nodes", "pybind_session"]


def pybind_session(session: ort.InferenceSession) -> Any:
    """The pybind11 session behind ``session``, which :class:`SessionIOBinding` binds to.

    Raises:
        ImportError: this ONNX Runtime keeps it elsewhere.
    """
    inner = getattr(session, "_sess", None)
    if inner is None:
        raise ImportError(
            f"onnxruntime {ort.__version__}'s InferenceSession has no pybind11 session (`_sess`); install "
            f"onnxruntime-gpu {ORT_TESTED} or newer."
        )
    return inner


def c_device(kind: str, index: int) -> CDevice:
    """ONNX Runtime's pybind11 description of the memory of device ``kind`` (``"cpu"``, ``"cuda"``) ``index``."""
    return ort.OrtDevice.make(kind, index)._get_c_device()


_NODE_NAME = re.compile(r"node with name '([^']+)'|in node \(([^)]+)\)")


def failing_nodes(error: BaseException) -> list[str]:
    """The ONNX nodes ONNX Runtime's ``error`` names, without the exporter's ``node_`` prefix.

    Its wording: "Could not find an implementation for MatMul(13) node with name 'node_mm'" (no kernel) and
    "... bound to different types ... in node (node_layer_norm)" (type check).

    Example:
        >>> failing_nodes(RuntimeError("Could not find an implementation for Erf(13) node with name 'node_erf'"))
        ['erf']
    """
    return [name.removeprefix("node_") for match in _NODE_NAME.findall(str(error)) for name in match if name]
