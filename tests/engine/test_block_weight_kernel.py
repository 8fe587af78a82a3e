"""``BlockWeight``: a convolution weight blocked for ONNX Runtime's NCHWc convolution in one pass, exactly as the
``ReorderInput`` chain it replaces lays it out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from lightning_ort.engine.onnx.custom_ops import DOMAIN
from lightning_ort.engine.onnx.passes import nchwc_block_size, use_nchwc_convolutions
from tests.helpers import input_gradient_model, kernel_session, session_with_kernels

needs_nchwc = pytest.mark.skipif(nchwc_block_size() <= 1, reason="ONNX Runtime has no NCHWc kernels on this CPU")


def _blocked(weight: np.ndarray, block: int, flip: bool) -> np.ndarray:
    """The reference layout: ``[O/B, I/B, taps, Bi, Bo]`` of ``weight`` or of its transposed, tap-reversed kernel."""
    out_channels, in_channels, *kernel = weight.shape
    tiles = weight.reshape(out_channels // block, block, in_channels // block, block, -1)
    if flip:
        return tiles[..., ::-1].transpose(2, 0, 4, 1, 3).reshape(in_channels, out_channels, *kernel)
    return tiles.transpose(0, 2, 4, 3, 1).reshape(weight.shape)


@pytest.mark.parametrize("flip", [False, True], ids=["forward", "flipped"])
@pytest.mark.parametrize(
    ("shape", "block"),
    [
        ((16, 16, 3, 3), 16),
        ((48, 32, 3, 3), 16),
        ((32, 80, 1, 1), 16),
        ((32, 16, 5, 5), 16),
        ((16, 32, 7, 7), 16),
        ((16, 24, 3, 3), 8),
        ((16, 8, 5, 5), 8),
        ((8, 24, 7, 3), 4),
    ],
    ids=["one-tile", "3x2-3x3", "2x5-1x1", "2x1-5x5", "1x2-7x7", "block-8-3x3", "block-8-5x5", "block-4"],
)
def test_block_weight_lays_out_every_element_as_the_reference(
    library: Path, shape: tuple[int, ...], block: int, flip: bool
) -> None:
    weight = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    node = helper.make_node("BlockWeight", ["W"], ["Y"], domain=DOMAIN, block=block, flip=int(flip))
    (actual,) = kernel_session(node, {"W": shape}).run(None, {"W": weight})
    np.testing.assert_array_equal(actual, _blocked(weight, block, flip))


def test_block_weight_refuses_channels_that_are_not_whole_blocks(library: Path) -> None:
    node = helper.make_node("BlockWeight", ["W"], ["Y"], domain=DOMAIN, block=16, flip=0)
    session = kernel_session(node, {"W": None})
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match="multiples of block 16"):
        session.run(None, {"W": np.zeros((16, 24, 3, 3), np.float32)})


def _conv_graphs(block: int) -> onnx.ModelProto:
    """A dense convolution and an input gradient as the decomposition exports it (the forward weight
    transposed and its taps reversed by the exchange matrix), both of one weight ``w``, in a graph that also
    uses lightning_ort's kernels (a ``GeluGrad``)."""
    out_channels, in_channels = 3 * block, 2 * block
    model = input_gradient_model(out_channels, in_channels, 3)
    graph = model.graph
    graph.node.extend(
        [
            helper.make_node("Conv", ["x", "w"], ["y"], "node_forward_convolution", pads=[1, 1, 1, 1]),
            helper.make_node("GeluGrad", ["gx", "gx"], ["z"], "node_gelu_grad", domain=DOMAIN, approximate=0),
        ]
    )
    graph.input.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, in_channels, 6, 6]))
    del graph.output[:]
    graph.output.extend(helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("y", "z"))
    model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model


@needs_nchwc
def test_graphs_with_the_kernels_block_weights_in_one_node_each(library: Path) -> None:
    block = nchwc_block_size()
    model = _conv_graphs(block)
    rng = np.random.default_rng(1)
    feeds = {
        name: rng.standard_normal([d.dim_value for d in value.type.tensor_type.shape.dim], dtype=np.float32)
        for name, value in ((i.name, i) for i in model.graph.input)
    }
    expected = session_with_kernels(model).run(None, feeds)
    assert use_nchwc_convolutions(model, block, kernels=True) == 2
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("BlockWeight") == 2
    reordered = {n.input[0] for n in model.graph.node if n.op_type == "ReorderInput"}
    assert reordered == {"x", "gy"}, "only the images are reordered by ReorderInput"
    assert "Transpose" not in ops and "Gather" not in ops
    for ours, theirs in zip(session_with_kernels(model).run(None, feeds), expected, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
