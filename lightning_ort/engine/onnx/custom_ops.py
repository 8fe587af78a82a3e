"""ONNX translations of lightning_ort's own PyTorch ops, as nodes of its ONNX Runtime kernels.

The ops of :mod:`lightning_ort.engine.fx.batch_norm`, the max-pooling gradient of
:mod:`lightning_ort.engine.fx.max_pool`, the phase weaving of :mod:`lightning_ort.engine.fx.conv_phases`, the 3x3
weight gradient of :mod:`lightning_ort.engine.fx.conv_weight_grad`,
GELU's and SiLU's gradients (:mod:`lightning_ort.engine.fx.gelu`, :mod:`lightning_ort.engine.fx.silu`), layer
norm's (:mod:`lightning_ort.engine.fx.layer_norm`) and group norm (:mod:`lightning_ort.engine.fx.group_norm`) become
nodes of the ``ai.lightning_ort`` domain, which ONNX
Runtime runs with the kernels of :mod:`lightning_ort.engine.runtime.cpu_kernels`; the values-only max pooling is a
standard ``MaxPool``. The exporter's translations are onnxscript functions; each node here is an onnxscript op
with its own schema, which is not registered in ONNX's schema registry (the process's ONNX keeps no trace of it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import onnx
import onnxscript
from onnx.defs import OpSchema
from onnxscript import opset18

from lightning_ort.engine.fx.batch_norm import (
    BATCH_NORM_ADD_TRAINING,
    BATCH_NORM_ADD_TRAINING_BACKWARD,
    BATCH_NORM_TRAINING,
    BATCH_NORM_TRAINING_BACKWARD,
)
from lightning_ort.engine.fx.conv_phases import INTERLEAVE_2X2
from lightning_ort.engine.fx.conv_weight_grad import CONV3X3_WEIGHT_GRAD
from lightning_ort.engine.fx.gelu import APPROXIMATIONS, GELU_BACKWARD
from lightning_ort.engine.fx.group_norm import GROUP_NORM, GROUP_NORM_BACKWARD
from lightning_ort.engine.fx.layer_norm import LAYER_NORM_BACKWARD
from lightning_ort.engine.fx.max_pool import MAX_POOL2D, MAX_POOL2D_BACKWARD
from lightning_ort.engine.fx.silu import SILU_BACKWARD

DOMAIN = "ai.lightning_ort"
"""The ONNX domain of lightning_ort's ONNX Runtime kernels."""


def uses_kernels(model: onnx.ModelProto) -> bool:
    """Whether ``model`` has nodes of lightning_ort's kernels (it imports their domain)."""
    return any(opset.domain == DOMAIN for opset in model.opset_import)


_OPSET = onnxscript.values.Opset(DOMAIN, 1)
FLOAT, INT = OpSchema.AttrType.FLOAT, OpSchema.AttrType.INT


_WINDOW = ("kernel", "stride", "pad", "dilation")


def _op(name: str, inputs: list[str], outputs: list[str], attributes: dict[str, OpSchema.AttrType]) -> Any:
    """An onnxscript op ``DOMAIN::name`` on float32 tensors."""
    schema = OpSchema(
        name,
        DOMAIN,
        1,
        inputs=[OpSchema.FormalParameter(input, "T") for input in inputs],
        outputs=[OpSchema.FormalParameter(output, "T") for output in outputs],
        type_constraints=[("T", ["tensor(float)"], "float32 only")],
        attributes=[OpSchema.Attribute(attribute, kind, "") for attribute, kind in attributes.items()],
    )
    return onnxscript.values.Op(_OPSET, name, schema)


_CLAMP = {"clamp": INT, "min": FLOAT, "max": FLOAT}
_FORWARD = ["X", "scale", "B", "running_mean", "running_var"]
_FORWARD_OUTPUTS = ["Y", "mean", "invstd", "new_running_mean", "new_running_var"]
_STATISTICS = {"epsilon": FLOAT, "momentum": FLOAT}
_GRAD = ["dY", "X", "scale", "B", "mean", "invstd"]
_BATCH_NORM_TRAINING = _op("BatchNormTraining", _FORWARD, _FORWARD_OUTPUTS, {**_STATISTICS, **_CLAMP})
_BATCH_NORM_TRAINING_GRAD = _op("BatchNormTrainingGrad", _GRAD, ["dX", "dscale", "dB"], _CLAMP)
_BATCH_NORM_ADD_TRAINING = _op("BatchNormAddTraining", [*_FORWARD, "Z"], _FORWARD_OUTPUTS, {**_STATISTICS, **_CLAMP})
_BATCH_NORM_ADD_TRAINING_GRAD = _op("BatchNormAddTrainingGrad", [*_GRAD, "Y"], ["dX", "dscale", "dB", "dZ"], _CLAMP)


def _clamp(clamp: bool, low: float, high: float) -> dict[str, Any]:
    """The kernels' clamp attributes."""
    return {"clamp": int(clamp), "min": low, "max": high}


def batch_norm_training(
    input: Any,
    weight: Any,
    bias: Any,
    running_mean: Any,
    running_var: Any,
    momentum: float,
    eps: float,
    clamp: bool,
    low: float,
    high: float,
) -> Any:
    """:data:`~lightning_ort.engine.fx.batch_norm.BATCH_NORM_TRAINING` as one ``BatchNormTraining`` node."""
    statistics = (running_mean, running_var)
    return _BATCH_NORM_TRAINING(
        input, weight, bias, *statistics, epsilon=eps, momentum=momentum, **_clamp(clamp, low, high)
    )


def batch_norm_training_backward(
    grad_output: Any,
    input: Any,
    weight: Any,
    bias: Any,
    mean: Any,
    invstd: Any,
    clamp: bool,
    low: float,
    high: float,
) -> Any:
    """:data:`~lightning_ort.engine.fx.batch_norm.BATCH_NORM_TRAINING_BACKWARD` as one ``BatchNormTrainingGrad``
    node."""
    return _BATCH_NORM_TRAINING_GRAD(grad_output, input, weight, bias, mean, invstd, **_clamp(clamp, low, high))


def batch_norm_add_training(
    input: Any,
    weight: Any,
    bias: Any,
    running_mean: Any,
    running_var: Any,
    residual: Any,
    momentum: float,
    eps: float,
    clamp: bool,
    low: float,
    high: float,
) -> Any:
    """:data:`~lightning_ort.engine.fx.batch_norm.BATCH_NORM_ADD_TRAINING` as one ``BatchNormAddTraining`` node."""
    statistics = (running_mean, running_var)
    return _BATCH_NORM_ADD_TRAINING(
        input, weight, bias, *statistics, residual, epsilon=eps, momentum=momentum, **_clamp(clamp, low, high)
    )


def batch_norm_add_training_backward(
    grad_output: Any,
    input: Any,
    weight: Any,
    bias: Any,
    mean: Any,
    invstd: Any,
    output: Any,
    clamp: bool,
    low: float,
    high: float,
) -> Any:
    """:data:`~lightning_ort.engine.fx.batch_norm.BATCH_NORM_ADD_TRAINING_BACKWARD` as one
    ``BatchNormAddTrainingGrad`` node."""
    grads = (grad_output, input, weight, bias, mean, invstd, output)
    return _BATCH_NORM_ADD_TRAINING_GRAD(*grads, **_clamp(clamp, low, high))


_MAX_POOL_GRAD = _op(
    "MaxPoolGrad", ["dY", "X"], ["dX"], {f"{part}_{axis}": INT for part in _WINDOW for axis in ("h", "w")}
)


def max_pool2d(input: Any, kernel_size: list[int], stride: list[int], padding: list[int], dilation: list[int]) -> Any:
    """:data:`~lightning_ort.engine.fx.max_pool.MAX_POOL2D` as one ``MaxPool`` without its ``Indices`` output."""
    values, _ = opset18.MaxPool(
        input, kernel_shape=kernel_size, strides=stride, pads=[*padding, *padding], dilations=dilation
    )
    return values


def max_pool2d_backward(
    grad_output: Any, input: Any, kernel_size: list[int], stride: list[int], padding: list[int], dilation: list[int]
) -> Any:
    """:data:`~lightning_ort.engine.fx.max_pool.MAX_POOL2D_BACKWARD` as one ``MaxPoolGrad`` node."""
    attributes = {}
    for part, (height, width) in zip(_WINDOW, (kernel_size, stride, padding, dilation), strict=True):
        attributes[f"{part}_h"], attributes[f"{part}_w"] = height, width
    return _MAX_POOL_GRAD(grad_output, input, **attributes)


_INTERLEAVE_2X2 = _op("Interleave2x2", ["P00", "P01", "P10", "P11"], ["Y"], {"height": INT, "width": INT})


def interleave_2x2(even_even: Any, even_odd: Any, odd_even: Any, odd_odd: Any, height: int, width: int) -> Any:
    """:data:`~lightning_ort.engine.fx.conv_phases.INTERLEAVE_2X2` as one ``Interleave2x2`` node."""
    return _INTERLEAVE_2X2(even_even, even_odd, odd_even, odd_odd, height=height, width=width)


_CONV_WEIGHT_GRAD_3X3 = _op("ConvWeightGrad3x3", ["X", "dY"], ["dW"], {"stride": INT})


def conv3x3_weight_grad(input: Any, grad_output: Any, stride: int) -> Any:
    """:data:`~lightning_ort.engine.fx.conv_weight_grad.CONV3X3_WEIGHT_GRAD` as one ``ConvWeightGrad3x3`` node, on
    ``input`` and ``grad_output`` as they are: the CPU graph's NCHWc pass
    (:func:`~lightning_ort.engine.onnx.passes.use_nchwc_convolutions`) gives it ``grad_output``'s blocked copy."""
    return _CONV_WEIGHT_GRAD_3X3(input, grad_output, stride=stride)


_GELU_GRAD = _op("GeluGrad", ["dY", "X"], ["dX"], {"approximate": INT})


def gelu_backward(grad_output: Any, input: Any, approximate: str) -> Any:
    """:data:`~lightning_ort.engine.fx.gelu.GELU_BACKWARD` as one ``GeluGrad`` node."""
    return _GELU_GRAD(grad_output, input, approximate=APPROXIMATIONS.index(approximate))


_SILU_GRAD = _op("SiluGrad", ["dY", "X"], ["dX"], {})


def silu_backward(grad_output: Any, input: Any) -> Any:
    """:data:`~lightning_ort.engine.fx.silu.SILU_BACKWARD` as one ``SiluGrad`` node."""
    return _SILU_GRAD(grad_output, input)


_LAYER_NORM_GRAD = _op("LayerNormGrad", ["dY", "X", "scale", "mean", "invstd"], ["dX", "dscale", "dB"], {})


def layer_norm_backward(grad_output: Any, input: Any, weight: Any, mean: Any, invstd: Any) -> Any:
    """:data:`~lightning_ort.engine.fx.layer_norm.LAYER_NORM_BACKWARD` as one ``LayerNormGrad`` node."""
    return _LAYER_NORM_GRAD(grad_output, input, weight, mean, invstd)


_GROUP_NORM_TRAINING = _op(
    "GroupNormTraining", ["X", "scale", "B"], ["Y", "mean", "rstd"], {"groups": INT, "epsilon": FLOAT}
)
_GROUP_NORM_GRAD = _op("GroupNormGrad", ["dY", "X", "scale", "mean", "rstd"], ["dX", "dscale", "dB"], {"groups": INT})


def group_norm(input: Any, weight: Any, bias: Any, groups: int, eps: float) -> Any:
    """:data:`~lightning_ort.engine.fx.group_norm.GROUP_NORM` as one ``GroupNormTraining`` node."""
    return _GROUP_NORM_TRAINING(input, weight, bias, groups=groups, epsilon=eps)


def group_norm_backward(grad_output: Any, input: Any, weight: Any, mean: Any, rstd: Any, groups: int) -> Any:
    """:data:`~lightning_ort.engine.fx.group_norm.GROUP_NORM_BACKWARD` as one ``GroupNormGrad`` node."""
    return _GROUP_NORM_GRAD(grad_output, input, weight, mean, rstd, groups=groups)


CUSTOM_TRANSLATIONS: dict[Any, Callable[..., Any]] = {
    BATCH_NORM_TRAINING: batch_norm_training,
    BATCH_NORM_TRAINING_BACKWARD: batch_norm_training_backward,
    BATCH_NORM_ADD_TRAINING: batch_norm_add_training,
    BATCH_NORM_ADD_TRAINING_BACKWARD: batch_norm_add_training_backward,
    MAX_POOL2D: max_pool2d,
    MAX_POOL2D_BACKWARD: max_pool2d_backward,
    INTERLEAVE_2X2: interleave_2x2,
    CONV3X3_WEIGHT_GRAD: conv3x3_weight_grad,
    GELU_BACKWARD: gelu_backward,
    SILU_BACKWARD: silu_backward,
    LAYER_NORM_BACKWARD: layer_norm_backward,
    GROUP_NORM: group_norm,
    GROUP_NORM_BACKWARD: group_norm_backward,
}
"""The exporter's translations of lightning_ort's own ops (``custom_translation_table``)."""
