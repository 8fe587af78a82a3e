"""The forms of a convolution's backward side by side on CPU: ``python -m lightning_ort.bench conv``.

ONNX Runtime's public build has no convolution-gradient kernel, so ORTModule builds a convolution's backward
from forward ops (:mod:`lightning_ort.engine.fx.decompositions`). For each 3x3 layer of the ``cnn`` and
``resnet18`` workloads, this study times every form of each gradient in ONNX Runtime's CPU provider, and eager
PyTorch's own backward (oneDNN), in one process, and checks that each form computes eager's gradient:

* input gradient: ``Conv`` with the flipped kernel (``flipped``, stride 1 only), ``ConvTranspose``
  (``transposed``) and, on images of at most 16 positions, the columns ``weight^T @ grad`` for all images in one
  product folded back by a product with the transposed selection matrix (``selection``);
* weight gradient: the unfolded input (im2col, by a one-hot depthwise ``Conv``, or on images of at most
  16 positions by a product with a 0/1 selection matrix) times the output gradient image by image, then
  summed (``per_image``); the same as one contraction over images and positions (``contraction``); and one
  ``Conv`` of the input with the output gradient as its kernel, batch and channels swapped (``swapped``);
  lightning_ort's ``ConvWeightGrad3x3`` kernel, reading the NCHWc output gradient (``kernel``, AVX-512 CPUs);
  or PyTorch's own kernel, eager's (``torch``). ``conv_weight_grad="auto"`` takes lightning_ort's kernel on images
  of more than 16 positions where it applies, else PyTorch's, run after the backward graph.

The forms ORTModule picks are marked; the decision table is on the performance page.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper
from typing_extensions import override

from lightning_ort.bench.report import Report
from lightning_ort.engine.fx.conv_weight_grad import weight_grad_kernel_applies
from lightning_ort.engine.fx.decompositions import (
    SELECTION_POSITIONS,
    folds_input_gradient,
    selection_matrix,
    weight_grad_in_torch,
)
from lightning_ort.engine.onnx.custom_ops import DOMAIN
from lightning_ort.engine.onnx.passes import (
    KERNEL_NCHWC_BLOCK,
    drop_unused_initializers,
    nchwc_block_size,
    use_nchwc_convolutions,
)
from lightning_ort.engine.runtime import cpu_kernels


@dataclass(frozen=True)
class ConvLayer:
    """A 3x3 convolution with padding 1: ``images`` x ``channels`` x ``size`` x ``size`` in, ``out_channels`` out."""

    workload: str
    images: int
    channels: int
    size: int
    out_channels: int
    stride: int

    @property
    def out_size(self) -> int:
        return (self.size - 1) // self.stride + 1

    def __str__(self) -> str:
        return f"{self.images}x{self.channels}x{self.size}x{self.size} -> {self.out_channels}, stride {self.stride}"


LAYERS = (
    ConvLayer("cnn", 64, 32, 32, 32, 1),
    ConvLayer("cnn", 64, 32, 32, 64, 2),
    ConvLayer("cnn", 64, 64, 16, 64, 1),
    ConvLayer("cnn", 64, 64, 16, 128, 2),
    ConvLayer("cnn", 64, 128, 8, 128, 1),
    ConvLayer("resnet18", 16, 64, 16, 64, 1),
    ConvLayer("resnet18", 16, 64, 16, 128, 2),
    ConvLayer("resnet18", 16, 128, 8, 128, 1),
    ConvLayer("resnet18", 16, 128, 8, 256, 2),
    ConvLayer("resnet18", 16, 256, 4, 256, 1),
    ConvLayer("resnet18", 16, 256, 4, 512, 2),
    ConvLayer("resnet18", 16, 512, 2, 512, 1),
)
"""The 3x3 layers of the ``cnn`` and ``resnet18`` workloads (one of each shape)."""

INPUT_FORMS = ("flipped", "transposed", "selection")
WEIGHT_FORMS = ("per_image", "contraction", "swapped", "kernel")
TORCH_WEIGHT = "torch"
"""The weight-gradient form that is PyTorch's own kernel: eager's weight gradient, run after the backward graph."""


def picked_forms(layer: ConvLayer) -> tuple[str, str]:
    """The input- and weight-gradient forms ORTModule uses for ``layer`` under ``conv_weight_grad="auto"``.

    Example:
        >>> picked_forms(ConvLayer("cnn", 64, 128, 8, 128, 1))[1] in ("kernel", "torch")  # "kernel" on AVX-512
        True
        >>> picked_forms(ConvLayer("resnet18", 16, 256, 4, 512, 2))
        ('selection', 'contraction')
    """
    positions = layer.out_size**2
    if folds_input_gradient([layer.size] * 2, strided=layer.stride > 1):
        input_form = "selection"
    else:
        input_form = "flipped" if layer.stride == 1 else "transposed"
    images = torch.empty(layer.images, layer.channels, layer.size, layer.size)
    weight = torch.empty(layer.out_channels, layer.channels, 3, 3)
    if weight_grad_in_torch(images, weight, [1, 1], 1, "auto"):
        return input_form, "kernel" if _kernel_runs(layer) else TORCH_WEIGHT
    return input_form, "contraction" if positions < layer.out_channels else "per_image"


@dataclass
class ConvResult:
    """One layer: median ms of eager's input and weight gradients and of each ONNX Runtime form, the largest
    distance of a form's gradient from eager's relative to its largest magnitude, and the forms ORTModule picks."""

    layer: str
    workload: str
    eager_input_ms: float
    eager_weight_ms: float
    input_ms: dict[str, float]
    weight_ms: dict[str, float]
    max_relative_error: float
    picked: tuple[str, str]


def run_conv_study(layers: Sequence[ConvLayer], steps: int) -> list[ConvResult]:
    """Time every form of both gradients of each of ``layers`` (median of ``steps`` runs after two untimed)."""
    return [_layer(layer, steps) for layer in layers]


def _layer(layer: ConvLayer, steps: int) -> ConvResult:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(layer.images, layer.channels, layer.size, layer.size, generator=generator)
    w = torch.randn(layer.out_channels, layer.channels, 3, 3, generator=generator)
    grad = torch.randn(layer.images, layer.out_channels, layer.out_size, layer.out_size, generator=generator)
    stride = [layer.stride] * 2

    def eager(mask: list[bool]) -> Callable[[], object]:
        aten = torch.ops.aten.convolution_backward
        return lambda: aten(grad, x, w, None, stride, [1, 1], [1, 1], False, [0, 0], 1, mask)

    gradients: tuple[torch.Tensor, torch.Tensor, None] = eager([True, True, False])()  # type: ignore[assignment]
    expected_input, expected_weight, _ = gradients
    feeds = {"x": x.numpy(), "w": w.numpy(), "gy": grad.numpy()}
    input_ms: dict[str, float] = {}
    weight_ms: dict[str, float] = {}
    error = 0.0
    for forms, times, expected in ((INPUT_FORMS, input_ms, expected_input), (WEIGHT_FORMS, weight_ms, expected_weight)):
        for form in forms:
            model = _FORMS[form](layer)
            if model is None:
                continue
            session = _session(model)
            names = {i.name for i in session.get_inputs()}
            inputs = {name: value for name, value in feeds.items() if name in names}
            got = torch.from_numpy(session.run(None, inputs)[0])
            error = max(error, ((got - expected).abs().max() / expected.abs().max()).item())
            times[form] = _median_ms(functools.partial(session.run, None, inputs), steps)
    return ConvResult(
        str(layer),
        layer.workload,
        _median_ms(eager([True, False, False]), steps),
        _median_ms(eager([False, True, False]), steps),
        input_ms,
        weight_ms,
        error,
        picked_forms(layer),
    )


def _median_ms(run: Callable[[], object], steps: int) -> float:
    run()
    run()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    """The form as ORTModule runs it: its convolutions on NCHWc kernels where :func:`use_nchwc_convolutions` can,
    lightning_ort's kernels registered where it uses them."""
    model = onnx.shape_inference.infer_shapes(model)
    use_nchwc_convolutions(model, nchwc_block_size())
    drop_unused_initializers(model)  # the constants of a kernel chain the NCHWc pass replaced
    options = ort.SessionOptions()
    cpu_kernels.register_kernels(options, model)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _model(
    layer: ConvLayer, nodes: list[onnx.NodeProto], inputs: Sequence[str], constants: dict[str, np.ndarray]
) -> onnx.ModelProto:
    shapes = {
        "x": [layer.images, layer.channels, layer.size, layer.size],
        "w": [layer.out_channels, layer.channels, 3, 3],
        "gy": [layer.images, layer.out_channels, layer.out_size, layer.out_size],
    }
    graph = helper.make_graph(
        nodes,
        "gradient",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, shapes[name]) for name in inputs],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(value, name) for name, value in constants.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _flipped(layer: ConvLayer) -> onnx.ModelProto | None:
    if layer.stride != 1:
        return None
    # the kernel transposed and its taps reversed by the exchange matrix, as the decomposition exports it on CPU
    # (the NCHWc pass then blocks it from the weight directly)
    nodes = [
        helper.make_node("Reshape", ["w", "grouped_shape"], ["grouped"]),
        helper.make_node("Transpose", ["grouped"], ["wt"], perm=[0, 2, 1, 3, 4]),
        helper.make_node("Reshape", ["wt", "taps_shape"], ["taps"]),
        helper.make_node("MatMul", ["taps", "exchange"], ["reversed"]),
        helper.make_node("Reshape", ["reversed", "kernel_shape"], ["flipped"]),
        helper.make_node("Conv", ["gy", "flipped"], ["out"], pads=[1, 1, 1, 1]),
    ]
    constants: dict[str, np.ndarray] = {
        "grouped_shape": np.array([1, layer.out_channels, layer.channels, 3, 3], np.int64),
        "taps_shape": np.array([-1, 9], np.int64),
        "exchange": np.eye(9, dtype=np.float32)[::-1].copy(),
        "kernel_shape": np.array([layer.channels, layer.out_channels, 3, 3], np.int64),
    }
    return _model(layer, nodes, ["w", "gy"], constants)


def _transposed(layer: ConvLayer) -> onnx.ModelProto:
    adjust = layer.size - ((layer.out_size - 1) * layer.stride - 2 + 3)
    node = helper.make_node(
        "ConvTranspose",
        ["gy", "w"],
        ["out"],
        pads=[1, 1, 1, 1],
        strides=[layer.stride] * 2,
        output_padding=[adjust] * 2,
    )
    return _model(layer, [node], ["w", "gy"], {})


def _selection(layer: ConvLayer) -> np.ndarray:
    """The layer's selection matrix ``[positions, 9 * out_positions]`` (:func:`selection_matrix`)."""
    image = torch.empty(1, 1, layer.size, layer.size)
    return selection_matrix(image, [3, 3], [layer.stride] * 2, [1, 1], [1, 1]).numpy()


def _selection_input(layer: ConvLayer) -> onnx.ModelProto | None:
    if layer.size**2 > SELECTION_POSITIONS:
        return None
    selection = _selection(layer).T.copy()
    positions = layer.out_size**2
    nodes = [
        helper.make_node("Transpose", ["gy"], ["gy_t"], perm=[1, 0, 2, 3]),
        helper.make_node("Reshape", ["gy_t", "grad_shape"], ["grad"]),
        helper.make_node("Reshape", ["w", "weight_rows_shape"], ["weight_rows"]),
        helper.make_node("Transpose", ["weight_rows"], ["weight_cols"], perm=[1, 0]),
        helper.make_node("MatMul", ["weight_cols", "grad"], ["columns"]),
        helper.make_node("Reshape", ["columns", "by_image_shape"], ["by_image"]),
        helper.make_node("Transpose", ["by_image"], ["images_first"], perm=[1, 0, 2]),
        helper.make_node("Reshape", ["images_first", "rows_shape"], ["rows"]),
        helper.make_node("MatMul", ["rows", "selection_t"], ["folded"]),
        helper.make_node("Reshape", ["folded", "input_shape"], ["out"]),
    ]
    shapes = {
        "grad_shape": [layer.out_channels, -1],
        "weight_rows_shape": [layer.out_channels, -1],
        "by_image_shape": [layer.channels * 9, layer.images, positions],
        "rows_shape": [layer.images * layer.channels, 9 * positions],
        "input_shape": [layer.images, layer.channels, layer.size, layer.size],
    }
    constants = {name: np.array(shape, np.int64) for name, shape in shapes.items()}
    return _model(layer, nodes, ["w", "gy"], {**constants, "selection_t": selection})


def _columns(layer: ConvLayer) -> tuple[list[onnx.NodeProto], dict[str, np.ndarray]]:
    """im2col: ``cols`` ``[images, channels * 9, positions]``, as the decomposition unfolds the input."""
    shape = np.array([layer.images, layer.channels * 9, layer.out_size**2], np.int64)
    if layer.size**2 <= SELECTION_POSITIONS:
        selection = _selection(layer)
        nodes = [
            helper.make_node("Reshape", ["x", "images_shape"], ["images"]),
            helper.make_node("MatMul", ["images", "selection"], ["unfolded"]),
            helper.make_node("Reshape", ["unfolded", "columns_shape"], ["cols"]),
        ]
        images_shape = np.array([-1, layer.size**2], np.int64)
        return nodes, {"images_shape": images_shape, "selection": selection, "columns_shape": shape}
    one_hot = np.tile(np.eye(9, dtype=np.float32).reshape(9, 1, 3, 3), (layer.channels, 1, 1, 1))
    nodes = [
        helper.make_node(
            "Conv", ["x", "one_hot"], ["unfolded"], pads=[1, 1, 1, 1], strides=[layer.stride] * 2, group=layer.channels
        ),
        helper.make_node("Reshape", ["unfolded", "columns_shape"], ["cols"]),
    ]
    return nodes, {"one_hot": one_hot, "columns_shape": shape}


def _per_image(layer: ConvLayer) -> onnx.ModelProto:
    nodes, constants = _columns(layer)
    nodes += [
        helper.make_node("Reshape", ["gy", "grad_shape"], ["g"]),
        helper.make_node("Transpose", ["g"], ["gt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["cols", "gt"], ["products"]),
        helper.make_node("ReduceSum", ["products", "images_axis"], ["summed"], keepdims=0),
        helper.make_node("Transpose", ["summed"], ["flat"], perm=[1, 0]),
        helper.make_node("Reshape", ["flat", "weight_shape"], ["out"]),
    ]
    constants |= _weight_constants(layer)
    constants["grad_shape"] = np.array([layer.images, layer.out_channels, layer.out_size**2], np.int64)
    constants["images_axis"] = np.array([0], np.int64)
    return _model(layer, nodes, ["x", "gy"], constants)


def _contraction(layer: ConvLayer) -> onnx.ModelProto:
    nodes, constants = _columns(layer)
    nodes += [
        helper.make_node("Transpose", ["cols"], ["cols_t"], perm=[1, 0, 2]),
        helper.make_node("Reshape", ["cols_t", "rows_shape"], ["rows"]),
        helper.make_node("Transpose", ["gy"], ["g"], perm=[1, 0, 2, 3]),
        helper.make_node("Reshape", ["g", "grad_rows_shape"], ["grad_rows"]),
    ]
    if layer.images * layer.out_size**2 <= layer.out_channels:  # the decomposition's order, no transposed result
        nodes += [
            helper.make_node("Transpose", ["rows"], ["cols_rows"], perm=[1, 0]),
            helper.make_node("MatMul", ["grad_rows", "cols_rows"], ["flat"]),
        ]
    else:
        nodes += [
            helper.make_node("Transpose", ["grad_rows"], ["grad_cols"], perm=[1, 0]),
            helper.make_node("MatMul", ["rows", "grad_cols"], ["product"]),
            helper.make_node("Transpose", ["product"], ["flat"], perm=[1, 0]),
        ]
    nodes.append(helper.make_node("Reshape", ["flat", "weight_shape"], ["out"]))
    constants |= _weight_constants(layer)
    constants["rows_shape"] = np.array([layer.channels * 9, -1], np.int64)
    constants["grad_rows_shape"] = np.array([layer.out_channels, -1], np.int64)
    return _model(layer, nodes, ["x", "gy"], constants)


def _swapped(layer: ConvLayer) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2, 3]),
        helper.make_node("Transpose", ["gy"], ["gt"], perm=[1, 0, 2, 3]),
        helper.make_node("Conv", ["xt", "gt"], ["full"], pads=[1, 1, 1, 1], dilations=[layer.stride] * 2),
        helper.make_node("Slice", ["full", "zeros", "threes", "spatial"], ["kernel"]),
        helper.make_node("Transpose", ["kernel"], ["out"], perm=[1, 0, 2, 3]),
    ]
    constants = {"zeros": [0, 0], "threes": [3, 3], "spatial": [2, 3]}
    return _model(layer, nodes, ["x", "gy"], {name: np.array(value, np.int64) for name, value in constants.items()})


def _kernel_runs(layer: ConvLayer) -> bool:
    """Whether lightning_ort's 3x3 weight-gradient kernel takes ``layer`` on this machine."""
    images = torch.empty(layer.images, layer.channels, layer.size, layer.size)
    weight = torch.empty(layer.out_channels, layer.channels, 3, 3)
    stride = [layer.stride] * 2
    applies = weight_grad_kernel_applies(images, weight, stride, [1, 1], [1, 1], 1)
    return applies and nchwc_block_size() == KERNEL_NCHWC_BLOCK and cpu_kernels.kernel_library() is not None


def _kernel(layer: ConvLayer) -> onnx.ModelProto | None:
    if not _kernel_runs(layer):
        return None
    node = helper.make_node("ConvWeightGrad3x3", ["x", "gy"], ["out"], domain=DOMAIN, stride=layer.stride)
    model = _model(layer, [node], ["x", "gy"], {})
    model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model


def _weight_constants(layer: ConvLayer) -> dict[str, np.ndarray]:
    return {"weight_shape": np.array([layer.out_channels, layer.channels, 3, 3], np.int64)}


_FORMS: dict[str, Callable[[ConvLayer], onnx.ModelProto | None]] = {
    "flipped": _flipped,
    "transposed": _transposed,
    "selection": _selection_input,
    "per_image": _per_image,
    "contraction": _contraction,
    "swapped": _swapped,
    "kernel": _kernel,
}


def format_conv_report(results: Sequence[ConvResult]) -> list[str]:
    """The study's table: per layer, eager's time and each form's, the picked form marked with ``*`` (on eager's
    weight gradient where ORTModule runs PyTorch's kernel for it)."""
    forms = [*INPUT_FORMS, *WEIGHT_FORMS]
    lines = [
        "ms per gradient; * the form ORTModule picks; 'vs eager': picked input + weight gradient against eager's",
        f"{'layer':<38}{'eager in':>9}{'eager w':>10}" + "".join(f"{form:>13}" for form in forms) + f"{'vs eager':>10}",
    ]
    for result in results:
        cells = []
        for form in forms:
            value = result.input_ms.get(form, result.weight_ms.get(form))
            mark = "*" if form in result.picked else " "
            cells.append(f"{'-':>12} " if value is None else f"{value:>12.2f}{mark}")
        weight_ms = {**result.weight_ms, TORCH_WEIGHT: result.eager_weight_ms}
        picked = result.input_ms[result.picked[0]] + weight_ms[result.picked[1]]
        ratio = (result.eager_input_ms + result.eager_weight_ms) / picked
        torch_mark = "*" if result.picked[1] == TORCH_WEIGHT else " "
        lines.append(
            f"{result.workload + ' ' + result.layer:<38}{result.eager_input_ms:>9.2f}"
            f"{result.eager_weight_ms:>9.2f}{torch_mark}" + "".join(cells) + f"{ratio:>9.2f}x"
        )
    worst = max((result.max_relative_error for result in results), default=0.0)
    lines.append(f"(every form within {worst:.1e} of eager's gradient, relative to its largest magnitude)")
    return lines


@dataclass
class ConvReport(Report):
    """The ``conv`` study: every form of each 3x3 layer's gradients, against eager's (CPU)."""

    conv: list[ConvResult] = field(default_factory=list)

    @override
    def body(self) -> list[str]:
        return format_conv_report(self.conv)
