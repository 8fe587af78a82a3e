"""The input gradient of stride-2 convolutions on CPU: four stride-1 phase convolutions woven by lightning_ort's
``Interleave2x2`` kernel.

These tests check the kernel against the op's PyTorch form bit for bit, the decomposition against ATen's
gradient on the kernels it takes and the ones it leaves to the transposed convolution, the ONNX rewrites that
serve it (a zero padding folded into the NCHWc convolution, the phase kernels gathered from one blocked weight),
and that a residual net with strided blocks trains as eager does with that graph.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from lightning_ort import DebugOptions, ORTModule
from lightning_ort.bench.vision import BasicBlock
from lightning_ort.engine.fx.conv_phases import interleave_2x2_op, phase_input_grad, strided_convolutions
from lightning_ort.engine.onnx.custom_ops import DOMAIN
from lightning_ort.engine.onnx.passes import nchwc_block_size, use_nchwc_convolutions, weave_projection_grads
from tests.helpers import assert_fp64_accuracy, assert_grads_close, kernel_session, session_with_kernels

aten = torch.ops.aten
needs_nchwc = pytest.mark.skipif(nchwc_block_size() == 0, reason="this CPU has no ONNX Runtime NCHWc kernels")


def _interleave_session(
    shapes: list[list[int]], height: int, width: int, op: str = "Interleave2x2", **attributes: int
) -> ort.InferenceSession:
    names = ["p00", "p01", "p10", "p11", "z"][: len(shapes)]
    node = helper.make_node(op, names, ["y"], domain=DOMAIN, height=height, width=width, **attributes)
    return kernel_session(node, dict(zip(names, shapes, strict=True)))


def _to_blocks(t: torch.Tensor) -> np.ndarray:
    """``t`` ([N, C, H, W], C a multiple of 16) in ONNX Runtime's NCHWc layout with 16-channel blocks."""
    n, c, h, w = t.shape
    return t.reshape(n, c // 16, 16, h, w).permute(0, 1, 3, 4, 2).contiguous().reshape(n, c, h, w).numpy()


@pytest.mark.parametrize(("height", "width"), [(8, 8), (7, 9), (1, 6), (5, 1)])
@pytest.mark.parametrize("extra", [0, 1], ids=["exact", "larger-phases"])
def test_the_kernel_weaves_the_phases_as_the_op_does_bit_for_bit(
    library: Path, height: int, width: int, extra: int
) -> None:
    generator = torch.Generator().manual_seed(height * width + extra)
    shapes = [[2, 3, (height - a + 1) // 2 + extra, (width - b + 1) // 2 + extra] for a in (0, 1) for b in (0, 1)]
    phases = [torch.randn(shape, generator=generator) for shape in shapes]
    phases[0][0, 0, 0, 0] = float("nan")
    expected = interleave_2x2_op(*phases, height, width)
    session = _interleave_session(shapes, height, width)
    (actual,) = session.run(None, {n: p.numpy() for n, p in zip(["p00", "p01", "p10", "p11"], phases, strict=True)})
    assert actual.shape == (2, 3, height, width)
    np.testing.assert_array_equal(actual, expected.numpy())


@pytest.mark.parametrize(("height", "width"), [(8, 8), (7, 9)])
def test_the_kernel_adds_the_projections_gradient_to_the_even_rows_even_columns(
    library: Path, height: int, width: int
) -> None:
    generator = torch.Generator().manual_seed(height * width)
    shapes = [[2, 3, (height - a + 1) // 2, (width - b + 1) // 2] for a in (0, 1) for b in (0, 1)]
    phases = [torch.randn(shape, generator=generator) for shape in shapes]
    projection = torch.randn(shapes[0], generator=generator)
    expected = interleave_2x2_op(*phases, height, width)
    expected[..., ::2, ::2] += projection
    names = ["p00", "p01", "p10", "p11", "z"]
    session = _interleave_session([*shapes, shapes[0]], height, width, "Interleave2x2Add")
    (actual,) = session.run(None, {n: p.numpy() for n, p in zip(names, [*phases, projection], strict=True)})
    np.testing.assert_array_equal(actual, expected.numpy())


@pytest.mark.parametrize(("height", "width", "extra"), [(8, 8, 0), (7, 9, 1), (1, 6, 0)])
@pytest.mark.parametrize("op", ["Interleave2x2", "Interleave2x2Add"])
def test_the_kernel_weaves_nchwc_blocks_as_the_op_does_bit_for_bit(
    library: Path, height: int, width: int, extra: int, op: str
) -> None:
    """With ``block=16`` the phases, Z and Y are in 16-channel NCHWc blocks: Y is the plain weave, reordered."""
    generator = torch.Generator().manual_seed(height * width + extra)
    shapes = [[2, 32, (height - a + 1) // 2 + extra, (width - b + 1) // 2 + extra] for a in (0, 1) for b in (0, 1)]
    tensors = [torch.randn(shape, generator=generator) for shape in shapes]
    if op == "Interleave2x2Add":
        shapes.append(shapes[0])
        tensors.append(torch.randn(shapes[0], generator=generator))
    expected = interleave_2x2_op(*tensors[:4], height, width)
    if op == "Interleave2x2Add":
        expected[..., ::2, ::2] += tensors[4][..., : (height + 1) // 2, : (width + 1) // 2]
    session = _interleave_session(shapes, height, width, op, block=16)
    names = ["p00", "p01", "p10", "p11", "z"]
    (actual,) = session.run(None, {n: _to_blocks(t) for n, t in zip(names, tensors, strict=False)})
    np.testing.assert_array_equal(actual, _to_blocks(expected))


def test_the_kernel_refuses_nchwc_blocks_of_part_of_a_block(library: Path) -> None:
    shapes = [[1, 24, 4, 4]] * 4
    session = _interleave_session(shapes, 8, 8, block=16)
    feeds = {n: np.ones(s, np.float32) for n, s in zip(["p00", "p01", "p10", "p11"], shapes, strict=True)}
    with pytest.raises(Exception, match=r"Interleave2x2: block=16 needs block 16 and C a multiple of 16; C is 24"):
        session.run(None, feeds)


def test_a_phase_smaller_than_its_share_of_the_image_is_refused(library: Path) -> None:
    shapes = [[1, 2, 4, 4], [1, 2, 4, 4], [1, 2, 3, 4], [1, 2, 4, 4]]
    session = _interleave_session(shapes, 8, 8)
    feeds = {n: np.ones(s, np.float32) for n, s in zip(["p00", "p01", "p10", "p11"], shapes, strict=True)}
    with pytest.raises(Exception, match=r"Interleave2x2: phase 2 is \[3, 4\], too small for an image of 8x8"):
        session.run(None, feeds)


def test_the_op_has_a_gradient() -> None:
    phases = [torch.randn(1, 2, 3, 3, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    assert torch.autograd.gradcheck(lambda *p: interleave_2x2_op(*p, 5, 6), phases)


@pytest.mark.parametrize("depthwise", [False, True], ids=["dense", "depthwise"])
@pytest.mark.parametrize(
    ("image", "kernel", "padding"),
    [
        ((8, 8), (3, 3), (1, 1)),
        ((7, 9), (3, 3), (1, 1)),
        ((8, 6), (2, 2), (0, 0)),
        ((9, 7), (2, 2), (0, 0)),
        ((6, 8), (3, 2), (1, 0)),
    ],
    ids=["3x3-even", "3x3-odd", "2x2-even", "2x2-odd", "3x2"],
)
def test_the_phase_form_gives_atens_input_gradient(
    image: tuple[int, int], kernel: tuple[int, int], padding: tuple[int, int], depthwise: bool
) -> None:
    generator = torch.Generator().manual_seed(0)
    groups = 5 if depthwise else 1
    x = torch.randn(3, 5, *image, generator=generator)
    w = torch.randn(5 if depthwise else 6, 5 // groups, *kernel, generator=generator)
    grad = torch.randn_like(torch.conv2d(x, w, None, 2, padding, 1, groups))
    ours = phase_input_grad(grad, x, w, [2, 2], list(padding), [1, 1], groups)
    assert ours is not None
    expected = aten.convolution_backward(grad, x, w, None, [2, 2], list(padding), [1, 1], False, [0, 0], groups,
                                         [True, False, False])[0]  # fmt: skip
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("kernel", "stride", "padding", "dilation", "groups", "dtype"),
    [
        (1, 2, 0, 1, 1, torch.float32),  # odd phases have no tap: the transposed convolution is one product
        (4, 2, 1, 1, 1, torch.float32),  # a tap before the first output position
        (3, 1, 1, 1, 1, torch.float32),
        (3, 3, 1, 1, 1, torch.float32),
        (3, 2, 2, 2, 1, torch.float32),
        (3, 2, 1, 1, 2, torch.float32),
        (3, 2, 1, 1, 1, torch.float64),
    ],
    ids=["1x1", "4x4-pad-1", "stride-1", "stride-3", "dilated", "grouped", "float64"],
)
def test_other_convolutions_keep_the_transposed_form(
    kernel: int, stride: int, padding: int, dilation: int, groups: int, dtype: torch.dtype
) -> None:
    x = torch.randn(2, 4, 8, 8, dtype=dtype)
    w = torch.randn(4, 4 // groups, kernel, kernel, dtype=dtype)
    grad = torch.randn_like(torch.conv2d(x, w, None, stride, padding, dilation, groups))
    assert phase_input_grad(grad, x, w, [stride] * 2, [padding] * 2, [dilation] * 2, groups) is None


def test_a_depthwise_convolution_with_several_outputs_per_channel_keeps_the_transposed_form() -> None:
    x, w = torch.randn(2, 4, 8, 8), torch.randn(8, 1, 3, 3)
    grad = torch.randn_like(torch.conv2d(x, w, None, 2, 1, 1, 4))
    assert phase_input_grad(grad, x, w, [2, 2], [1, 1], [1, 1], 4) is None


def test_strided_convolutions_are_counted_in_dynamos_graph() -> None:
    seen: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        seen.append(strided_convolutions(gm))
        return gm.forward

    model = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.Conv2d(8, 8, 3, 1, 1), nn.Conv2d(8, 8, 1, (2, 2)))
    torch.compile(model, backend=backend)(torch.randn(1, 3, 8, 8))
    assert seen == [2]


def _padded_conv_model(block: int, value: float) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, block, 6, 6])
    w = helper.make_tensor_value_info("w", TensorProto.FLOAT, [block, block, 2, 2])
    initializers = [
        numpy_helper.from_array(np.array([0, 0, 0, 0, 0, 0, 1, 1], np.int64), "pads"),
        numpy_helper.from_array(np.array(value, np.float32), "value"),
    ]
    nodes = [
        helper.make_node("Pad", ["x", "pads", "value"], ["padded"], "node_pad"),
        helper.make_node("Conv", ["padded", "w"], ["y"], "node_conv", pads=[1, 0, 0, 1]),
    ]
    graph = helper.make_graph(nodes, "g", [x, w], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    graph.initializer.extend(initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    return onnx.shape_inference.infer_shapes(model)


@needs_nchwc
@pytest.mark.parametrize(("value", "folded"), [(0.0, True), (1.0, False)])
def test_a_zero_padding_is_folded_into_the_nchwc_convolution(value: float, folded: bool) -> None:
    block = nchwc_block_size()
    model = _padded_conv_model(block, value)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, block, 6, 6), dtype=np.float32)}
    feeds["w"] = rng.standard_normal((block, block, 2, 2), dtype=np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, feeds)
    assert use_nchwc_convolutions(model, block) == 1
    assert ("Pad" not in {n.op_type for n in model.graph.node}) == folded
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, feeds)[0], expected, rtol=1e-4, atol=1e-4)


def _projection_sum_model(projection: dict[str, Any]) -> onnx.ModelProto:
    phases = [f"p{i}" for i in range(4)]
    kernel = projection.pop("kernel", 1)
    attributes = {"strides": [2, 2], "output_padding": [1, 0], **projection}
    nodes = [
        helper.make_node("Interleave2x2", phases, ["dx"], "node_weave", domain=DOMAIN, height=8, width=7),
        helper.make_node("ConvTranspose", ["dy", "w"], ["ds"], "node_projection_grad", **attributes),
        helper.make_node("Add", ["ds", "dx"], ["grad"], "node_add"),
    ]
    shapes = [[2, 16, 4, 4], [2, 16, 4, 3], [2, 16, 4, 4], [2, 16, 4, 3]]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in zip(phases, shapes, strict=True)]
    inputs.append(helper.make_tensor_value_info("dy", TensorProto.FLOAT, [2, 32, 4, 4]))
    inputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [32, 16, kernel, kernel]))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("grad", TensorProto.FLOAT, None)])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def _run_with_kernels(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return session_with_kernels(model).run(None, feeds)[0]


@pytest.mark.parametrize(
    ("projection", "woven"),
    [({}, True), ({"kernel": 2, "pads": [0, 0, 0, 1], "output_padding": [0, 0]}, False), ({"group": 2}, False)],
    ids=["1x1-stride-2", "2x2", "grouped"],
)
def test_a_strided_projections_gradient_is_added_in_the_weave(
    library: Path, projection: dict[str, Any], woven: bool
) -> None:
    model = _projection_sum_model(projection)
    rng = np.random.default_rng(3)
    feeds = {value.name: rng.standard_normal(_dims(value), dtype=np.float32) for value in model.graph.input}
    if "group" in projection:
        feeds["w"] = feeds["w"][:, :8]
        del model.graph.input[-1].type.tensor_type.shape.dim[1:]
        for size in [8, 1, 1]:
            model.graph.input[-1].type.tensor_type.shape.dim.add().dim_value = size
    expected = _run_with_kernels(model, feeds)
    assert weave_projection_grads(model) == int(woven)
    ops = [n.op_type for n in model.graph.node]
    assert ("Interleave2x2Add" in ops) == woven and ("ConvTranspose" in ops) != woven
    np.testing.assert_allclose(_run_with_kernels(model, feeds), expected, rtol=1e-5, atol=1e-5)


def _dims(value: onnx.ValueInfoProto) -> list[int]:
    return [dim.dim_value for dim in value.type.tensor_type.shape.dim]


@needs_nchwc
def test_phase_kernels_are_gathered_from_one_blocked_weight() -> None:
    # Four convolutions whose kernels select rows and columns of one [I, O, 3, 3] weight, as the phase form
    # exports them: that weight is blocked once, and each kernel is a gather of its tiles.
    block = nchwc_block_size()
    source = helper.make_tensor_value_info("w", TensorProto.FLOAT, [block, 2 * block, 3, 3])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2 * block, 5, 5])
    nodes, outputs, initializers = [], [], []
    for index, (rows, cols) in enumerate([([1], [1]), ([1], [2, 0]), ([2, 0], [1]), ([2, 0], [2, 0])]):
        initializers += [
            numpy_helper.from_array(np.array(rows, np.int64), f"rows{index}"),
            numpy_helper.from_array(np.array(cols, np.int64), f"cols{index}"),
        ]
        nodes += [
            helper.make_node("Gather", ["w", f"rows{index}"], [f"r{index}"], f"node_rows{index}", axis=2),
            helper.make_node("Gather", [f"r{index}", f"cols{index}"], [f"k{index}"], f"node_cols{index}", axis=3),
            helper.make_node("Conv", ["x", f"k{index}"], [f"y{index}"], f"node_conv{index}"),
        ]
        outputs.append(helper.make_tensor_value_info(f"y{index}", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "g", [x, source], outputs)
    graph.initializer.extend(initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    model = onnx.shape_inference.infer_shapes(model)
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((2, 2 * block, 5, 5), dtype=np.float32)}
    feeds["w"] = rng.standard_normal((block, 2 * block, 3, 3), dtype=np.float32)
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert use_nchwc_convolutions(model, block) == 4
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("ReorderInput") == 3, "the weight twice, the input once"
    assert ops.count("Gather") == 4 and all(
        n.input[0].endswith("_tiles") for n in model.graph.node if n.op_type == "Gather"
    )
    actual = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for ours, theirs in zip(actual, expected, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


def _strided_net() -> nn.Module:
    """A stem, a downsampling residual block (3x3 and 1x1 projection, stride 2), a 2x2 stride-2 layer and a
    depthwise stride-2 one, with channel counts that are multiples of the NCHWc block on AVX-512 and AVX2
    machines."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 1, 1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        BasicBlock(16, 32, 2),
        nn.Conv2d(32, 32, 2, 2),
        nn.Conv2d(32, 32, 3, 2, 1, groups=32),
        nn.Flatten(),
        nn.Linear(32 * 2 * 2, 10),
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_strided_nets_train_through_the_phase_form_as_accurately_as_eager(library: Path, seed: int) -> None:
    torch.manual_seed(seed)
    eager = _strided_net()
    wrapped = ORTModule(copy.deepcopy(eager), fallback="raise", conv_weight_grad="onnx")
    assert_fp64_accuracy(eager, wrapped, torch.randn(6, 3, 16, 16) * 2 + 1, perturbations=2)


def test_a_net_with_strided_blocks_trains_like_eager_with_the_phase_form(library: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    eager = _strided_net()
    debug = DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path)
    wrapped = ORTModule(copy.deepcopy(eager), debug, fallback="raise", conv_weight_grad="onnx")
    x = torch.randn(4, 3, 16, 16)
    for _ in range(2):
        expected, actual = eager(x), wrapped(x)
        grad = torch.randn_like(expected)
        expected.backward(grad)
        actual.backward(grad)
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
        assert_grads_close(wrapped, eager)
    backward = onnx.load(str(tmp_path / "m_training_backward.onnx")).graph.node
    ops = [n.op_type for n in backward]
    assert ops.count("Interleave2x2") == 2, "the 2x2 and the depthwise layers"
    assert ops.count("Interleave2x2Add") == 1, "the strided 3x3 layer, with its block's 1x1 projection"
    assert "ConvTranspose" not in ops and "Pad" not in ops
    flips = sorted(helper.get_node_attr_value(n, "flip") for n in backward if n.op_type == "BlockWeight")
    assert flips == [0, 0, 0, 1], "the two strided layers' and the projection's kernels; the stride-1 3x3's flipped"
