"""ONNX-level rewrites: Gemm biases split off, transposed MatMul operands fused where that pays, NCHWc convolutions,
bfloat16 computed in float32, reshapes collapsed, integer pads concatenated for CUDA."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from lightning_ort import DebugOptions, ORTModule
from lightning_ort.engine.onnx.custom_ops import DOMAIN
from lightning_ort.engine.onnx.passes import (
    DISABLED_ORT_OPTIMIZERS,
    collapse_reshapes,
    compute_bfloat16_in_float,
    compute_cuda_bfloat16_gaps_in_float,
    cuda_host_nodes,
    dequantize_scaled_masks,
    drop_identity_casts,
    fold_channels_last_transposes,
    fuse_transposed_operands,
    merge_slices,
    nchwc_block_size,
    pad_by_concat,
    split_gemm_bias,
    subsample_images,
    sum_rows_by_product,
    use_nchwc_convolutions,
)
from tests.helpers import input_gradient_model, session_with_kernels

needs_nchwc = pytest.mark.skipif(nchwc_block_size() == 0, reason="this CPU has no ONNX Runtime NCHWc kernels")


def test_fused_matmul_computes_the_same_product() -> None:
    nodes = [
        helper.make_node("Transpose", ["b"], ["bt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["a", "bt"], ["y"]),
        helper.make_node("Transpose", ["b"], ["other"], perm=[1, 0, 2]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3, 4]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 5, 4]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 5]),
            helper.make_tensor_value_info("other", TensorProto.FLOAT, [5, 2, 4]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    assert fuse_transposed_operands(model) == 1
    assert [n.op_type for n in model.graph.node] == ["FusedMatMul", "Transpose"]  # the other transpose stays
    session = ort.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"], disabled_optimizers=list(DISABLED_ORT_OPTIMIZERS)
    )
    a, b = np.random.rand(2, 3, 4).astype(np.float32), np.random.rand(2, 5, 4).astype(np.float32)
    y, other = session.run(None, {"a": a, "b": b})
    np.testing.assert_allclose(y, a @ b.transpose(0, 2, 1), rtol=1e-5)
    np.testing.assert_allclose(other, b.transpose(1, 0, 2))


def test_weight_gradient_keeps_its_transpose_explicit(tmp_path: Path) -> None:
    # Linear(8, 4)'s weight gradient is grad.T @ input, a transposed *left* operand, with fewer rows (4) than
    # columns (8): ONNX Runtime's fused kernel for that is slower than an explicit Transpose and MatMul.
    wrapped = ORTModule(torch.nn.Linear(8, 4), DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path))
    wrapped(torch.randn(5, 8)).sum().backward()
    for name in ("m_training_backward.onnx", "m_training_backward_optimized.onnx"):
        graph = onnx.load(str(tmp_path / name)).graph
        assert not any(_attribute(node, "transA") == 1 for node in graph.node), name
    assert any(
        node.op_type == "Transpose"
        for node in onnx.load(str(tmp_path / "m_training_backward_optimized.onnx")).graph.node
    )


def test_weight_gradient_with_more_rows_fuses_its_transpose(tmp_path: Path) -> None:
    # Linear(4, 16): the gradient has more rows (16) than columns (4), where transA measured faster.
    torch.manual_seed(0)
    eager = torch.nn.Linear(4, 16)
    wrapped = ORTModule(copy.deepcopy(eager), DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path))
    x = torch.randn(5, 4)
    wrapped(x).square().sum().backward()
    eager(x).square().sum().backward()
    graph = onnx.load(str(tmp_path / "m_training_backward.onnx")).graph
    assert any(node.op_type == "FusedMatMul" and _attribute(node, "transA") == 1 for node in graph.node)
    torch.testing.assert_close(wrapped.module.weight.grad, eager.weight.grad, rtol=1e-5, atol=1e-6)


def test_batched_left_transpose_is_fused() -> None:
    a, b = np.random.rand(3, 4, 5).astype(np.float32), np.random.rand(3, 4, 6).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["a"], ["at"], perm=[0, 2, 1]), helper.make_node("MatMul", ["at", "b"], ["y"])],
        "g",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [3, 4, 5]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [3, 4, 6]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5, 6])],
        value_info=[helper.make_tensor_value_info("at", TensorProto.FLOAT, [3, 5, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    assert fuse_transposed_operands(model) == 1
    assert [n.op_type for n in model.graph.node] == ["FusedMatMul"]
    session = ort.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"], disabled_optimizers=list(DISABLED_ORT_OPTIMIZERS)
    )
    (y,) = session.run(None, {"a": a, "b": b})
    np.testing.assert_allclose(y, a.transpose(0, 2, 1) @ b, rtol=1e-5)


def _attribute(node: onnx.NodeProto, name: str) -> int:
    return next((attr.i for attr in node.attribute if attr.name == name), 0)


def test_linear_bias_is_added_after_the_product(tmp_path: Path) -> None:
    # The exporter writes Linear as Gemm(x, Transpose(W), b); it runs as FusedMatMul(x, W, transB) and Add.
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    wrapped = ORTModule(copy.deepcopy(eager), DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path))
    x = torch.randn(5, 16)
    torch.testing.assert_close(wrapped(x), eager(x), rtol=1e-5, atol=1e-6)
    for name in ("m_training_forward.onnx", "m_training_forward_optimized.onnx"):
        ops = [node.op_type for node in onnx.load(str(tmp_path / name)).graph.node]
        assert "Gemm" not in ops and ops.count("Add") == 2, (name, ops)
    assert ops.count("FusedMatMul") == 2, ops


def test_gemm_with_scaling_or_matrix_bias_is_left_whole() -> None:
    inputs = [
        helper.make_tensor_value_info("a", TensorProto.FLOAT, [3, 4]),
        helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 5]),
        helper.make_tensor_value_info("b", TensorProto.FLOAT, [5]),
        helper.make_tensor_value_info("c", TensorProto.FLOAT, [3, 5]),
    ]
    nodes = [
        helper.make_node("Gemm", ["a", "w", "b"], ["y1"], alpha=2.0),
        helper.make_node("Gemm", ["a", "w", "c"], ["y2"]),
        helper.make_node("Gemm", ["w", "a", "b"], ["y3"], transA=1, transB=1),
        helper.make_node("Gemm", ["a", "w"], ["y4"]),
    ]
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, []))
    assert split_gemm_bias(model) == 0
    assert [n.op_type for n in model.graph.node] == ["Gemm"] * 4


def _scaled_mask_model(mask_type: int, scale_dims: list[int], extra_reader: bool) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Cast", ["m"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["s", "f"], ["scaled"], "node_mul"),
        helper.make_node("Mul", ["x", "scaled"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64])]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("f", TensorProto.FLOAT, [64]))
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [64]),
        helper.make_tensor_value_info("m", mask_type, [64]),
    ]
    scale = helper.make_tensor("s", TensorProto.FLOAT, scale_dims, [1 / 0.9])
    graph = helper.make_graph(nodes, "g", inputs, outputs, [scale])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_scaled_mask_is_one_dequantize_node_with_the_same_values() -> None:
    model = _scaled_mask_model(TensorProto.UINT8, [], extra_reader=False)
    assert dequantize_scaled_masks(model) == 1
    assert [n.op_type for n in model.graph.node] == ["DequantizeLinear", "Mul"]
    assert model.graph.node[0].name == "node_mul", "the node keeps the product's name (errors point at it)"
    x = np.random.rand(64).astype(np.float32)
    mask = (np.random.rand(64) > 0.1).astype(np.uint8)
    (y,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "m": mask}
    )
    np.testing.assert_array_equal(y, x * (mask.astype(np.float32) * np.float32(1 / 0.9)))


@pytest.mark.parametrize(
    ("mask_type", "scale_dims", "extra_reader"),
    [(TensorProto.BOOL, [], False), (TensorProto.UINT8, [1], False), (TensorProto.UINT8, [], True)],
    ids=["boolean mask", "1-d scale", "cast read twice"],
)
def test_other_cast_products_are_left_alone(mask_type: int, scale_dims: list[int], extra_reader: bool) -> None:
    model = _scaled_mask_model(mask_type, scale_dims, extra_reader)
    assert dequantize_scaled_masks(model) == 0
    assert [n.op_type for n in model.graph.node] == ["Cast", "Mul", "Mul"]


def _conv_model(
    in_channels: int, out_channels: int, attributes: dict[str, object], bias: bool, dtype: int = TensorProto.FLOAT
) -> onnx.ModelProto:
    inputs = [
        helper.make_tensor_value_info("x", dtype, ["batch", in_channels, 9, 9]),
        helper.make_tensor_value_info("w", dtype, [out_channels, in_channels // int(attributes.get("group", 1)), 3, 3]),
    ]
    if bias:
        inputs.append(helper.make_tensor_value_info("b", dtype, [out_channels]))
    conv = helper.make_node("Conv", [i.name for i in inputs], ["y"], "node_convolution", **attributes)
    graph = helper.make_graph([conv], "g", inputs, [helper.make_tensor_value_info("y", dtype, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return _run_all(model, feeds)[0]


def test_nchwc_block_size_is_a_block_ort_uses_or_zero() -> None:
    assert nchwc_block_size() in (0, 4, 8, 16)


@needs_nchwc
@pytest.mark.parametrize(
    ("attributes", "bias"),
    [
        ({"pads": [1, 1, 1, 1]}, False),
        ({"pads": [1, 1, 1, 1]}, True),
        ({"pads": [0, 1, 2, 1], "strides": [2, 2]}, True),
        ({"pads": [2, 2, 2, 2], "dilations": [2, 2]}, False),
        ({"strides": [2, 1]}, False),
    ],
)
def test_nchwc_convolution_computes_the_same_as_conv(attributes: dict[str, object], bias: bool) -> None:
    block = nchwc_block_size()
    channels = 2 * block
    model = _conv_model(channels, block, attributes, bias)
    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.standard_normal((3, channels, 9, 9), dtype=np.float32),
        "w": rng.standard_normal((block, channels, 3, 3), dtype=np.float32),
    }
    if bias:
        feeds["b"] = rng.standard_normal(block, dtype=np.float32)
    expected = _run(model, feeds)
    assert use_nchwc_convolutions(model, block) == 1
    assert [(n.domain, n.op_type) for n in model.graph.node][-3:] == [
        ("com.microsoft.nchwc", "ReorderInput"),
        ("com.microsoft.nchwc", "Conv"),
        ("com.microsoft.nchwc", "ReorderOutput"),
    ]
    np.testing.assert_allclose(_run(model, feeds), expected, rtol=1e-4, atol=1e-4)


@needs_nchwc
@pytest.mark.parametrize("blocks", [(1, 1), (3, 2), (2, 5)], ids=["one-block", "3-out-2-in", "2-out-5-in"])
def test_nchwc_weights_are_reordered_without_a_transpose(blocks: tuple[int, int]) -> None:
    # The weight is reordered each run (it is a graph input); MLAS's threaded ReorderInput does it, not the
    # single-threaded Transpose that made the reorder most of ResNet-18's step.
    block = nchwc_block_size()
    out_channels, in_channels = blocks[0] * block, blocks[1] * block
    model = _conv_model(in_channels, out_channels, {"pads": [1, 1, 1, 1]}, False)
    rng = np.random.default_rng(1)
    feeds = {
        "x": rng.standard_normal((2, in_channels, 9, 9), dtype=np.float32),
        "w": rng.standard_normal((out_channels, in_channels, 3, 3), dtype=np.float32),
    }
    expected = _run(model, feeds)
    assert use_nchwc_convolutions(model, block) == 1
    assert "Transpose" not in {node.op_type for node in model.graph.node}
    np.testing.assert_allclose(_run(model, feeds), expected, rtol=1e-4, atol=1e-4)


@needs_nchwc
@pytest.mark.parametrize(
    ("blocks", "kernel"), [((1, 1), 3), ((3, 2), 3), ((2, 5), 3), ((2, 1), 5)], ids=["1x1", "3x2", "2x5", "5x5"]
)
def test_input_gradient_kernels_are_blocked_from_the_forward_weight(blocks: tuple[int, int], kernel: int) -> None:
    # The transposed, tap-reversed kernel is not computed: two ReorderInput and one Gather of tiles block it
    # straight from the forward weight, and the transpose and the exchange product go.
    block = nchwc_block_size()
    out_channels, in_channels = blocks[0] * block, blocks[1] * block
    model = input_gradient_model(out_channels, in_channels, kernel)
    rng = np.random.default_rng(3)
    feeds = {
        "w": rng.standard_normal((out_channels, in_channels, kernel, kernel), dtype=np.float32),
        "gy": rng.standard_normal((2, out_channels, 6, 6), dtype=np.float32),
    }
    expected = _run(model, feeds)
    assert use_nchwc_convolutions(model, block) == 1
    assert [n.op_type for n in model.graph.node if n.domain == ""] == ["Reshape"] * 3 + ["Gather", "Reshape"]
    np.testing.assert_allclose(_run(model, feeds), expected, rtol=1e-4, atol=1e-4)  # NCHWc sums in its own order


@needs_nchwc
def test_an_exchange_product_read_elsewhere_stays() -> None:
    block = nchwc_block_size()
    model = input_gradient_model(block, block, 3)
    model.graph.output.append(helper.make_tensor_value_info("reversed", TensorProto.FLOAT, None))
    assert use_nchwc_convolutions(model, block) == 1
    assert {"Transpose", "MatMul", "Gather"} <= {n.op_type for n in model.graph.node}
    other = input_gradient_model(block, block, 3)
    other.graph.initializer[2].CopyFrom(numpy_helper.from_array(np.eye(9, dtype=np.float32), "exchange"))
    assert use_nchwc_convolutions(other, block) == 1, "a product with another matrix is blocked as it is"
    assert "Gather" not in {n.op_type for n in other.graph.node}


@needs_nchwc
@pytest.mark.parametrize(
    ("kernel", "attributes", "bias", "batch"),
    [
        (3, {"pads": [1, 1, 1, 1]}, False, 3),
        (3, {"pads": [1, 1, 1, 1], "strides": [2, 2]}, True, 3),
        (7, {"pads": [3, 3, 3, 3]}, True, 2),  # ConvNeXt's 7x7 depthwise layers
        (5, {"dilations": [2, 2]}, False, 1),  # a depthwise weight gradient: one "image", the gradient as kernel
    ],
)
def test_depthwise_convolutions_run_on_nchwc_kernels_with_the_same_result(
    kernel: int, attributes: dict[str, object], bias: bool, batch: int
) -> None:
    block = nchwc_block_size()
    channels = 2 * block
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", channels, 13, 13]),
        helper.make_tensor_value_info("w", TensorProto.FLOAT, [channels, 1, kernel, kernel]),
        *([helper.make_tensor_value_info("b", TensorProto.FLOAT, [channels])] if bias else []),
    ]
    conv = helper.make_node("Conv", [i.name for i in inputs], ["y"], "node_depthwise", group=channels, **attributes)
    graph = helper.make_graph([conv], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    rng = np.random.default_rng(2)
    feeds = {
        "x": rng.standard_normal((batch, channels, 13, 13), dtype=np.float32),
        "w": rng.standard_normal((channels, 1, kernel, kernel), dtype=np.float32),
    }
    if bias:
        feeds["b"] = rng.standard_normal(channels, dtype=np.float32)
    expected = _run(model, feeds)
    assert use_nchwc_convolutions(model, block) == 1
    assert ("com.microsoft.nchwc", "Conv") in [(n.domain, n.op_type) for n in model.graph.node]
    assert "Transpose" not in {node.op_type for node in model.graph.node}
    np.testing.assert_allclose(_run(model, feeds), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("in_channels", "out_channels", "attributes", "dtype"),
    [
        (16, 32, {"group": 16}, TensorProto.FLOAT),  # depthwise with two output channels per input channel
        (24, 24, {"group": 24}, TensorProto.FLOAT),  # depthwise, channels not a multiple of the block
        (3, 16, {}, TensorProto.FLOAT),  # a first layer's 3 input channels
        (16, 24, {}, TensorProto.FLOAT),  # output channels not a multiple of the block
        (16, 16, {"group": 2}, TensorProto.FLOAT),
        (16, 16, {"auto_pad": "SAME_UPPER"}, TensorProto.FLOAT),
        (16, 16, {}, TensorProto.DOUBLE),
    ],
)
def test_other_convolutions_stay_plain(
    in_channels: int, out_channels: int, attributes: dict[str, object], dtype: int
) -> None:
    model = _conv_model(in_channels, out_channels, attributes, bias=False, dtype=dtype)
    assert use_nchwc_convolutions(model, 16) == 0
    assert [n.op_type for n in model.graph.node] == ["Conv"]
    assert use_nchwc_convolutions(_conv_model(16, 16, {}, bias=False), 0) == 0  # no NCHWc kernels on this CPU


@needs_nchwc
@needs_nchwc
def test_convolutions_of_one_input_share_its_reorder() -> None:
    # A strided block's 3x3 convolution and its 1x1 projection read the block's input: one blocked copy of it.
    block = nchwc_block_size()
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, block, 8, 8])
    weights = [
        helper.make_tensor_value_info("w3", TensorProto.FLOAT, [block, block, 3, 3]),
        helper.make_tensor_value_info("w1", TensorProto.FLOAT, [2 * block, block, 1, 1]),
    ]
    convs = [
        helper.make_node("Conv", ["x", "w3"], ["y3"], "node_conv3", pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Conv", ["x", "w1"], ["y1"], "node_conv1", strides=[2, 2]),
    ]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("y3", "y1")]
    graph = helper.make_graph(convs, "g", [x, *weights], outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    rng = np.random.default_rng(2)
    feeds = {value.name: rng.standard_normal(_shape(value), dtype=np.float32) for value in [x, *weights]}
    expected = _run_all(model, feeds)
    assert use_nchwc_convolutions(model, block) == 2
    reorders = [n for n in model.graph.node if n.op_type == "ReorderInput" and list(n.input) == ["x"]]
    assert len(reorders) == 1
    for actual, wanted in zip(_run_all(model, feeds), expected, strict=True):
        np.testing.assert_allclose(actual, wanted, rtol=1e-4, atol=1e-4)


def _shape(value: onnx.ValueInfoProto) -> list[int]:
    return [dim.dim_value for dim in value.type.tensor_type.shape.dim]


def test_conv_net_trains_like_eager_on_nchwc_kernels(tmp_path: Path) -> None:
    torch.manual_seed(0)
    eager = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(32),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 32, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 16, 3, padding=2, dilation=2),
        torch.nn.Flatten(),
        torch.nn.Linear(16 * 8 * 8, 10),
    )
    wrapped = ORTModule(copy.deepcopy(eager), DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path))
    x = torch.randn(4, 3, 16, 16)
    for _ in range(2):
        ours, theirs = wrapped(x), eager(x)
        ours.square().sum().backward()
        theirs.square().sum().backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    for (name, mine), reference in zip(wrapped.module.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-4, atol=1e-4, msg=name)
    # The weight gradients of the 16x16 layers run in PyTorch (conv_weight_grad="auto"), after the one backward
    # partition that computes every input gradient.
    for graph in ("forward", "backward_part0"):
        nodes = onnx.load(str(tmp_path / f"m_training_{graph}.onnx")).graph.node
        assert any(n.domain == "com.microsoft.nchwc" and n.op_type == "Conv" for n in nodes), graph
    backward = onnx.load(str(tmp_path / "m_training_backward_part0.onnx")).graph.node
    flipped = [n for n in backward if n.op_type == "BlockWeight" and helper.get_node_attr_value(n, "flip") == 1]
    assert len(flipped) == 2, "both stride-1 input gradients (16->32, 32->16) blocked from the forward weight"


def _row_sum_model(
    shape: list[int | str], axes: list[int], keepdims: int, dtype: int = TensorProto.FLOAT
) -> onnx.ModelProto:
    axes_tensor = helper.make_tensor("axes", TensorProto.INT64, [len(axes)], axes)
    node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], "node_sum", keepdims=keepdims)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", dtype, shape)],
        [helper.make_tensor_value_info("y", dtype, None)],
        [axes_tensor],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize(
    ("shape", "axes", "keepdims", "ops"),
    [
        ([2048, 64], [0], 1, ["MatMul"]),  # already rows, and the product's [1, 64] is the result's shape
        ([2048, 64], [-2], 0, ["MatMul", "Reshape"]),
        ([16, 128, 32], [0, 1], 0, ["Reshape", "MatMul", "Reshape"]),
        ([16, 8, 4, 4], [1, 0], 1, ["Reshape", "MatMul", "Reshape"]),
    ],
)
def test_row_sums_become_a_product_with_ones_and_sum_the_same(
    shape: list[int], axes: list[int], keepdims: int, ops: list[str]
) -> None:
    model = _row_sum_model(shape, axes, keepdims)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    expected = _run(model, {"x": x})
    assert sum_rows_by_product(model) == 1
    assert [n.op_type for n in model.graph.node] == ops
    (product,) = [n for n in model.graph.node if n.op_type == "MatMul"]
    assert product.name == "node_sum", "the product keeps the reduction's name (errors point at it)"
    assert "axes" not in {init.name for init in model.graph.initializer}, "the unused axes are dropped"
    actual = _run(model, {"x": x})
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("shape", "axes", "dtype"),
    [
        ([64, 32], [1], TensorProto.FLOAT),
        ([64, 32], [0, 1], TensorProto.FLOAT),
        (["batch", 32], [0], TensorProto.FLOAT),
        ([64, 32], [0], TensorProto.DOUBLE),
        ([8, 4, 4], [0, 2], TensorProto.FLOAT),
    ],
    ids=["trailing axis", "every axis", "symbolic rows", "float64", "not only leading axes"],
)
def test_other_reductions_are_left_alone(shape: list[int | str], axes: list[int], dtype: int) -> None:
    model = _row_sum_model(shape, axes, 1, dtype)
    assert sum_rows_by_product(model) == 0
    assert [n.op_type for n in model.graph.node] == ["ReduceSum"]


def _bfloat16_model() -> onnx.ModelProto:
    """float32 in and out; inside, bfloat16 values: a cast, a bfloat16 weight, a product, a softmax, a constant."""
    weight = helper.make_tensor(
        "w", TensorProto.BFLOAT16, [4, 3], np.full(12, 0x3F80 + 3, np.uint16).tobytes(), raw=True
    )
    one = helper.make_tensor("one", TensorProto.BFLOAT16, [1], np.array([0x3F80], np.uint16).tobytes(), raw=True)
    nodes = [
        helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16),
        helper.make_node("MatMul", ["xb", "w"], ["hb"]),
        helper.make_node("Shape", ["hb"], ["shape"]),
        helper.make_node("ConstantOfShape", ["shape"], ["ones"], value=one),
        helper.make_node("Add", ["hb", "ones"], ["ab"]),
        helper.make_node("Softmax", ["ab"], ["sb"], axis=-1),
        helper.make_node("Cast", ["sb"], ["y"], to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("hb", TensorProto.BFLOAT16, [2, 3]),
        ],
        [weight],
        value_info=[helper.make_tensor_value_info(name, TensorProto.BFLOAT16, [2, 3]) for name in ("ones", "ab", "sb")]
        + [helper.make_tensor_value_info("xb", TensorProto.BFLOAT16, [2, 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_bfloat16_ops_run_on_cpu_in_float32_rounded_where_the_graph_casts() -> None:
    model = _bfloat16_model()
    with pytest.raises(Exception, match=r"NOT_IMPLEMENTED|Could not find an implementation"):
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert compute_bfloat16_in_float(model) == 5  # MatMul, Shape, ConstantOfShape, Add, Softmax
    assert {init.data_type for init in model.graph.initializer} == {TensorProto.FLOAT}
    assert [(o.name, o.type.tensor_type.elem_type) for o in model.graph.output] == [
        ("y", TensorProto.FLOAT),
        ("hb", TensorProto.BFLOAT16),
    ]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = torch.tensor([[1.001, 2.0, -0.5, 0.25], [3.0, 1.0, 0.5, 2.0]])
    y, hb = torch.empty(2, 3), torch.empty(2, 3, dtype=torch.bfloat16)
    binding = session.io_binding()
    binding.bind_input("x", "cpu", 0, TensorProto.FLOAT, [2, 4], x.data_ptr())
    binding.bind_output("y", "cpu", 0, TensorProto.FLOAT, [2, 3], y.data_ptr())
    binding.bind_output("hb", "cpu", 0, TensorProto.BFLOAT16, [2, 3], hb.data_ptr())
    session.run_with_iobinding(binding)
    weight = torch.full((4, 3), 1.0 + 3 / 128)  # bfloat16 0x3F83
    product = x.bfloat16().float() @ weight  # the input is rounded where the graph casts it; the product is not
    torch.testing.assert_close(y, torch.softmax(product + 1, -1), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(hb, product.bfloat16(), rtol=0, atol=0)  # an output keeps its bfloat16 type


def test_graph_without_bfloat16_or_with_subgraphs_is_left_alone() -> None:
    plain = _scaled_mask_model(TensorProto.UINT8, [], extra_reader=False)
    before = plain.SerializeToString()
    assert compute_bfloat16_in_float(plain) == 0
    assert plain.SerializeToString() == before
    model = _bfloat16_model()
    branch = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["z"])],
        "b",
        [],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
    )
    model.graph.node.append(helper.make_node("If", ["flag"], ["w_out"], then_branch=branch, else_branch=branch))
    before = model.SerializeToString()
    assert compute_bfloat16_in_float(model) == 0
    assert model.SerializeToString() == before


def _gradient_casts_model() -> onnx.ModelProto:
    """What :func:`compute_bfloat16_in_float` leaves of autocast's weight gradients: products computed in float32
    cast to float32 (``grad_w``, ``grad_v``, graph outputs; ``scaled``, read by a node), one cast from a graph
    input (``copy``), a value cast into two outputs (``grad_u``, ``grad_u2``) and rounded to float16."""
    nodes = [
        helper.make_node("MatMul", ["x", "x"], ["w_float"]),
        helper.make_node("Cast", ["w_float"], ["grad_w"], to=TensorProto.FLOAT),
        helper.make_node("Relu", ["x"], ["v_float"]),
        helper.make_node("Cast", ["v_float"], ["scaled"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["scaled", "x"], ["v2_float"]),
        helper.make_node("Cast", ["v2_float"], ["grad_v"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["x"], ["copy"], to=TensorProto.FLOAT),
        helper.make_node("Neg", ["x"], ["u_float"]),
        helper.make_node("Cast", ["u_float"], ["grad_u"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["u_float"], ["grad_u2"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["u_float"], ["rounded"], to=TensorProto.FLOAT16),
    ]
    square = [3, 3]
    outputs = [
        helper.make_tensor_value_info(name, TensorProto.FLOAT, square)
        for name in ("grad_w", "grad_v", "copy", "grad_u", "grad_u2")
    ] + [helper.make_tensor_value_info("rounded", TensorProto.FLOAT16, square)]
    value_info = [
        helper.make_tensor_value_info(name, TensorProto.FLOAT, square)
        for name in ("w_float", "v_float", "scaled", "v2_float", "u_float")
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, square)], outputs, value_info=value_info
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_casts_to_the_type_they_read_are_dropped_and_their_outputs_written_by_the_producer() -> None:
    model = _gradient_casts_model()
    x = np.random.default_rng(0).standard_normal((3, 3)).astype(np.float32)
    expected = _run_all(model, {"x": x})
    assert drop_identity_casts(model) == 4  # grad_w, scaled, grad_v, grad_u
    onnx.checker.check_model(model, full_check=True)
    casts = [(node.input[0], node.output[0]) for node in model.graph.node if node.op_type == "Cast"]
    assert casts == [("x", "copy"), ("grad_u", "grad_u2"), ("grad_u", "rounded")]  # a graph input's, a 2nd output's
    producers = {node.output[0]: node.op_type for node in model.graph.node}
    assert (producers["grad_w"], producers["grad_v"], producers["grad_u"]) == ("MatMul", "Mul", "Neg")
    assert next(node for node in model.graph.node if node.op_type == "Mul").input[0] == "v_float"
    for actual, wanted in zip(_run_all(model, {"x": x}), expected, strict=True):
        np.testing.assert_array_equal(actual, wanted)
    assert drop_identity_casts(model) == 0


def test_reshape_chains_and_reshapes_that_change_nothing_are_removed_with_the_same_result() -> None:
    def shape(name: str, values: list[int]) -> onnx.TensorProto:
        return numpy_helper.from_array(np.array(values, np.int64), name)

    nodes = [
        helper.make_node("Reshape", ["x", "to_6x4"], ["flat"]),  # read by the chain below and by Relu
        helper.make_node("Reshape", ["flat", "to_24"], ["line"]),
        helper.make_node("Reshape", ["line", "to_2x12"], ["y"]),  # reads x directly afterwards
        helper.make_node("Reshape", ["x", "to_2x3x4"], ["same"]),  # changes nothing
        helper.make_node("Relu", ["same"], ["r"]),
        helper.make_node("Relu", ["flat"], ["f"]),
        helper.make_node("Reshape", ["flat", "copy_first_4"], ["z"]),  # 0 copies a size of its input: kept
        helper.make_node("Reshape", ["x", "to_2x3x4"], ["returned"]),  # the graph returns it: kept
    ]
    float_value = functools.partial(helper.make_tensor_value_info, elem_type=TensorProto.FLOAT)
    graph = helper.make_graph(
        nodes,
        "g",
        [float_value("x", shape=[2, 3, 4])],
        [float_value(name, shape=None) for name in ("y", "r", "f", "z", "returned")],
        [
            shape(name, values)
            for name, values in [
                ("to_6x4", [6, 4]),
                ("to_24", [24]),
                ("to_2x12", [2, 12]),
                ("to_2x3x4", [2, 3, 4]),
                ("copy_first_4", [0, 4]),
            ]
        ],
        value_info=[
            float_value(name, shape=dims) for name, dims in [("flat", [6, 4]), ("line", [24]), ("same", [2, 3, 4])]
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    x = np.random.rand(2, 3, 4).astype(np.float32)
    expected = _run_all(model, {"x": x})
    assert collapse_reshapes(model) == 2  # `line`'s reshape, skipped by the chain, and `same`
    assert [(n.output[0], n.input[0]) for n in model.graph.node if n.op_type == "Reshape"] == [
        ("flat", "x"),
        ("y", "x"),
        ("z", "flat"),
        ("returned", "x"),
    ]
    for actual, wanted in zip(_run_all(model, {"x": x}), expected):
        np.testing.assert_array_equal(actual, wanted)


def test_a_slice_of_a_slice_on_other_axes_is_one_slice_with_the_same_result() -> None:
    def constant(name: str, values: list[int]) -> onnx.TensorProto:
        return numpy_helper.from_array(np.array(values, np.int64), name)

    nodes = [
        helper.make_node("Slice", ["x", "zero", "seven", "axis_2", "two"], ["rows"], "rows"),
        helper.make_node("Slice", ["rows", "one", "seven", "axis_3", "two"], ["grid"], "grid"),
        helper.make_node("Slice", ["x", "zero", "seven", "axis_2", "two"], ["shared"], "shared"),  # read twice
        helper.make_node("Slice", ["shared", "one", "seven", "axis_3", "two"], ["a"], "a"),
        helper.make_node("Relu", ["shared"], ["b"], "b"),
        helper.make_node("Slice", ["x", "zero", "seven", "axis_2", "two"], ["again"], "again"),  # the same axis
        helper.make_node("Slice", ["again", "one", "seven", "axis_2", "two"], ["c"], "c"),
        helper.make_node("Slice", ["x", "zero", "seven", "axis_2", "two"], ["cut"], "cut"),  # non-constant ends
        helper.make_node("Slice", ["cut", "one", "ends", "axis_3", "two"], ["d"], "d"),
    ]
    float_value = functools.partial(helper.make_tensor_value_info, elem_type=TensorProto.FLOAT)
    graph = helper.make_graph(
        nodes,
        "g",
        [float_value("x", shape=[2, 3, 8, 8]), helper.make_tensor_value_info("ends", TensorProto.INT64, [1])],
        [float_value(name, shape=None) for name in ("grid", "a", "b", "c", "d")],
        [
            constant(name, values)
            for name, values in [
                ("zero", [0]),
                ("one", [1]),
                ("seven", [7]),
                ("two", [2]),
                ("axis_2", [2]),
                ("axis_3", [3]),
            ]
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    feeds = {"x": np.random.rand(2, 3, 8, 8).astype(np.float32), "ends": np.array([7], np.int64)}
    expected = _run_all(model, feeds)
    assert merge_slices(model) == 1
    assert [n.name for n in model.graph.node] == ["grid", "shared", "a", "b", "again", "c", "cut", "d"]
    grid = model.graph.node[0]
    assert grid.input[0] == "x"
    for actual, wanted in zip(_run_all(model, feeds), expected, strict=True):
        np.testing.assert_array_equal(actual, wanted)


def test_a_strided_pointwise_convolutions_weight_gradient_subsamples_its_input_in_one_slice(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 1, 2, bias=False))
    debug = DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path)
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    ORTModule(model, debug, conv_weight_grad="onnx")(x).square().sum().backward()
    graphs = [onnx.load(str(tmp_path / f"m_training_{graph}.onnx")).graph for graph in ("forward", "backward")]
    assert [n.op_type for graph in graphs for n in graph.node].count("Slice") == 1


@pytest.mark.parametrize(
    ("shape", "starts", "ends", "axes", "steps", "rewritten"),
    [
        ((2, 3, 8, 8), [0, 0], [7, 7], [2, 3], [2, 2], True),
        ((2, 3, 9, 7), [0, 0], [2**62, 2**62], [-2, -1], [2, 3], True),
        ((1, 2, 5, 6), [0, 0], [6, 5], [3, 2], [1, 2], True),
        ((2, 3, 8, 8), [1, 0], [8, 8], [2, 3], [2, 2], False),  # starts at the second row
        ((2, 3, 8, 8), [0, 0], [6, 8], [2, 3], [2, 2], False),  # drops the last rows
        ((2, 3, 8, 8), [0, 0], [-1, 8], [2, 3], [2, 2], False),  # ends counted from the back
        ((2, 3, 8, 8), [0], [8], [3], [2], False),  # one image axis
    ],
)
def test_an_image_subsample_runs_in_the_kernel_with_the_same_values(
    library: Path,
    shape: tuple[int, ...],
    starts: list[int],
    ends: list[int],
    axes: list[int],
    steps: list[int],
    rewritten: bool,
) -> None:
    constants = [
        numpy_helper.from_array(np.array(values, np.int64), name)
        for name, values in [("starts", starts), ("ends", ends), ("axes", axes), ("steps", steps)]
    ]
    node = helper.make_node("Slice", ["x", "starts", "ends", "axes", "steps"], ["y"], "node_slice")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        constants,
    )
    plain = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    assert subsample_images(copy.deepcopy(plain)) == 0, "a graph without lightning_ort's kernels gains no dependency"
    model = copy.deepcopy(plain)
    model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    x.flat[[0, 2, 4, 6]] = [np.nan, -np.inf, -0.0, np.inf]  # kept by every subsample above that starts at 0
    (expected,) = _run_all(plain, {"x": x})
    assert subsample_images(model) == int(rewritten)
    assert [n.op_type for n in model.graph.node] == ["Subsample" if rewritten else "Slice"]
    (actual,) = session_with_kernels(model).run(None, {"x": x})
    np.testing.assert_array_equal(actual, expected)
    np.testing.assert_array_equal(np.signbit(actual), np.signbit(expected))


def _run_all(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8])
@pytest.mark.parametrize(
    ("pads", "axes", "value"),
    [([0, 0, 0, 1], None, 100), ([1, 2, 0, 3], None, 7), ([2, 1], [-1], 0), ([0, 1, 1, 0], None, None)],
)
def test_integer_pad_becomes_a_concatenation_with_the_same_values(
    dtype: type, pads: list[int], axes: list[int] | None, value: int | None
) -> None:
    inputs = ["x", "pads", "value" if value is not None else "", *(["axes"] if axes is not None else [])]
    initializers = [numpy_helper.from_array(np.array(pads, np.int64), "pads")]
    if value is not None:
        initializers.append(numpy_helper.from_array(np.array(value, dtype), "value"))
    if axes is not None:
        initializers.append(numpy_helper.from_array(np.array(axes, np.int64), "axes"))
    elem_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(
        [helper.make_node("Pad", inputs, ["y"], "pad")],
        "g",
        [helper.make_tensor_value_info("x", elem_type, [3, 4])],
        [helper.make_tensor_value_info("y", elem_type, None)],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    x = np.arange(12, dtype=dtype).reshape(3, 4)
    expected = _run(model, {"x": x})
    assert cuda_host_nodes(model) == ["Pad pad"]
    rewritten = copy.deepcopy(model)
    assert pad_by_concat(rewritten) == 1
    assert "Pad" not in [node.op_type for node in rewritten.graph.node]
    assert cuda_host_nodes(rewritten) == []
    np.testing.assert_array_equal(_run(rewritten, {"x": x}), expected)


@pytest.mark.parametrize(
    ("elem_type", "mode", "pads"),
    [
        (TensorProto.FLOAT, "constant", [0, 1]),
        (TensorProto.INT64, "reflect", [0, 1]),
        (TensorProto.INT64, "constant", [0, -1]),
        (TensorProto.INT64, "constant", [0, 0]),  # adds nothing: no block to concatenate
    ],
)
def test_pads_with_a_cuda_kernel_or_that_are_not_constant_blocks_stay(
    elem_type: int, mode: str, pads: list[int]
) -> None:
    graph = helper.make_graph(
        [helper.make_node("Pad", ["x", "pads"], ["y"], "pad", mode=mode)],
        "g",
        [helper.make_tensor_value_info("x", elem_type, [4])],
        [helper.make_tensor_value_info("y", elem_type, None)],
        [numpy_helper.from_array(np.array(pads, np.int64), "pads")],
    )
    model = helper.make_model(graph, ir_version=10)
    assert pad_by_concat(model) == 0
    assert [node.op_type for node in model.graph.node] == ["Pad"]


def test_static_gpt2_graphs_hold_no_shape_computation_and_nothing_for_the_host_on_cuda(tmp_path: Path) -> None:
    """The graphs of Hugging Face GPT-2 at a static shape compute no shape; the one node the CUDA provider would
    run on the host (the loss's ``Pad`` of the int64 labels) is gone after the CUDA graphs' passes."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 100, (2, 16))
    debug = DebugOptions(save_onnx=True, onnx_prefix="gpt2", save_path=tmp_path)
    ORTModule(model, debug)(input_ids=ids, labels=ids).loss.backward()
    graphs = {path.stem: onnx.load(path) for path in tmp_path.glob("gpt2_*.onnx") if "optimized" not in path.stem}
    # on CPU the embeddings' weight gradients run in PyTorch, after the backward graph's one partition
    assert set(graphs) == {"gpt2_training_forward", "gpt2_training_backward_part0"}
    assert [node.split()[0] for node in cuda_host_nodes(graphs["gpt2_training_forward"])] == ["Pad"]
    assert cuda_host_nodes(graphs["gpt2_training_backward_part0"]) == []
    forward = graphs["gpt2_training_forward"]
    inputs = {value.name: _random_input(value) for value in forward.graph.input}
    expected = _run_all(forward, inputs)
    assert pad_by_concat(forward) == 1
    assert cuda_host_nodes(forward) == []
    for got, want in zip(_run_all(forward, inputs), expected):
        np.testing.assert_array_equal(got, want)


def _random_input(value: onnx.ValueInfoProto) -> np.ndarray:
    tensor = value.type.tensor_type
    dtype = helper.tensor_dtype_to_np_dtype(tensor.elem_type)
    shape = [dim.dim_value for dim in tensor.shape.dim]
    rng = np.random.default_rng(0)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, 100, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def test_bfloat16_nodes_without_a_cuda_kernel_compute_in_float_and_round_once() -> None:
    """LogSoftmax, Greater (a boolean result) and ReduceMean have no bfloat16 CUDA kernel: each reads float32
    casts of its bfloat16 inputs, and its bfloat16 results are cast back; Mul, which has one, is left alone.
    The rewritten graph runs (on the CPU provider here)."""
    bf16 = TensorProto.BFLOAT16
    inputs = [helper.make_tensor_value_info(name, bf16, [4, 8]) for name in ("x", "y")]
    outputs = [
        helper.make_tensor_value_info("logp", bf16, [4, 8]),
        helper.make_tensor_value_info("big", TensorProto.BOOL, [4, 8]),
        helper.make_tensor_value_info("mean", bf16, [4, 1]),
    ]
    nodes = [
        helper.make_node("LogSoftmax", ["y"], ["logp"], "logp", axis=-1),
        helper.make_node("Greater", ["x", "y"], ["big"], "big"),
        helper.make_node("ReduceMean", ["x", "axes"], ["mean"], "mean", keepdims=1),
    ]
    graph = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(np.array([1]), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)

    assert compute_cuda_bfloat16_gaps_in_float(model) == 3
    ops = [(n.op_type, n.attribute[0].i if n.op_type == "Cast" else None) for n in model.graph.node]
    assert ops == [
        ("Cast", TensorProto.FLOAT), ("LogSoftmax", None), ("Cast", bf16),
        ("Cast", TensorProto.FLOAT), ("Cast", TensorProto.FLOAT), ("Greater", None),
        ("Cast", TensorProto.FLOAT), ("ReduceMean", None), ("Cast", bf16),
    ]  # fmt: skip
    onnx.checker.check_model(model, full_check=True)
    assert compute_cuda_bfloat16_gaps_in_float(model) == 0, "nothing left to move"
    product = helper.make_graph([helper.make_node("Mul", ["x", "y"], ["logp"])], "g", inputs, outputs[:1])
    assert compute_cuda_bfloat16_gaps_in_float(helper.make_model(product)) == 0

    x, y = torch.randn(4, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    for name, value in (("x", x), ("y", y)):
        binding.bind_input(name, "cpu", 0, bf16, [4, 8], value.data_ptr())
    results = {
        "logp": torch.empty(4, 8, dtype=torch.bfloat16),
        "big": torch.empty(4, 8, dtype=torch.bool),
        "mean": torch.empty(4, 1, dtype=torch.bfloat16),
    }
    for name, tensor in results.items():
        element = bf16 if tensor.dtype == torch.bfloat16 else TensorProto.BOOL
        binding.bind_output(name, "cpu", 0, element, list(tensor.shape), tensor.data_ptr())
    session.run_with_iobinding(binding)
    # Computed in float32 and rounded once, as PyTorch's CUDA kernels accumulate in float32.
    assert torch.equal(results["logp"], torch.log_softmax(y.float(), -1).bfloat16())
    assert torch.equal(results["mean"], x.float().mean(1, keepdim=True).bfloat16())
    assert torch.equal(results["big"], x > y)
    torch.testing.assert_close(results["logp"], torch.log_softmax(y, -1))


def _channels_last_model(saved: bool) -> onnx.ModelProto:
    """An NCHWc convolution's output transposed to channels-last, and a channels-last tensor transposed back for
    another NCHWc convolution (ConvNeXt's layer norms between depthwise convolutions); with ``saved``, the
    first convolution's NCHW output is also a graph output."""
    nchwc = "com.microsoft.nchwc"
    nodes = [
        helper.make_node("ReorderInput", ["x"], ["xb"], domain=nchwc),
        helper.make_node("ReorderOutput", ["xb"], ["y"], domain=nchwc, channels=32),
        helper.make_node("Transpose", ["y"], ["y_last"], perm=[0, 2, 3, 1]),
        helper.make_node("Relu", ["y_last"], ["z_last"]),
        helper.make_node("Transpose", ["z_last"], ["z"], perm=[0, 3, 1, 2]),
        helper.make_node("ReorderInput", ["z"], ["zb"], domain=nchwc),
        helper.make_node("ReorderOutput", ["zb"], ["out"], domain=nchwc, channels=32),
    ]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ["out", *(["y"] * saved)]]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 32, 5, 6])], outputs
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(nchwc, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


@needs_nchwc
@pytest.mark.parametrize("saved", [False, True], ids=["folded", "output-kept"])
def test_channels_last_transposes_fold_into_nchwc_reorders(saved: bool) -> None:
    model = _channels_last_model(saved)
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 32, 5, 6), dtype=np.float32)}
    expected = _run_all(model, feeds)
    assert fold_channels_last_transposes(model) == (1 if saved else 2)
    transposes = [list(n.input) for n in model.graph.node if n.op_type == "Transpose"]
    assert transposes == ([["y"]] if saved else []), "a ReorderOutput another node reads keeps its NCHW output"
    for ours, theirs in zip(_run_all(model, feeds), expected, strict=True):
        np.testing.assert_array_equal(ours, theirs)
