"""Backward gradients kept in ONNX Runtime's NCHWc layout between the convolutions that produce and read them.

These tests check the rewrite (:func:`keep_gradients_blocked`) on small graphs: which nodes take the blocked
layout, where reorders go and stay, and where it changes nothing; and, on a residual net with a strided block,
that the backward graph runs its batch-norm gradients and phase weave on blocks and trains with eager's float64
accuracy. The kernels' blocked forms are checked against their plain forms in ``test_batch_norm_kernels.py`` and
``test_conv_phases.py``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import onnx
import pytest
import torch
from onnx import helper
from torch import nn

from lightning_ort import DebugOptions, ORTModule
from lightning_ort.bench.vision import BasicBlock
from lightning_ort.engine.onnx.custom_ops import DOMAIN
from lightning_ort.engine.onnx.passes import KERNEL_NCHWC_BLOCK, keep_gradients_blocked, nchwc_block_size
from tests.helpers import assert_fp64_accuracy

NCHWC = "com.microsoft.nchwc"
BLOCKS = nchwc_block_size() == KERNEL_NCHWC_BLOCK and torch.backends.cpu.get_cpu_capability() == "AVX512"


def _backward_model(shape: list[int], dx_readers: list[str], residual: bool = False) -> onnx.ModelProto:
    """An input-gradient convolution's blocked output, reordered for a batch-norm gradient whose dX is read by
    ``dx_readers`` (``"conv"``: through a ``ReorderInput``; ``"plain"``: a ``Relu``; ``"output"``: the graph)."""
    values = ["x", "dy", "dg", "dx", *(["y", "dz"] if residual else [])]
    info = [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape) for name in values]
    grad_inputs = ["dg", "x", "s", "b", "m", "i", *(["y"] if residual else [])]
    grad_outputs = ["dx", "ds", "db", *(["dz"] if residual else [])]
    op = "BatchNormAddTrainingGrad" if residual else "BatchNormTrainingGrad"
    nodes = [
        helper.make_node("ReorderInput", ["dy"], ["dy_b"], domain=NCHWC),
        helper.make_node("Conv", ["dy_b", "w"], ["dg_b"], domain=NCHWC),
        helper.make_node("ReorderOutput", ["dg_b"], ["dg"], domain=NCHWC, channels=shape[1]),
        helper.make_node(op, grad_inputs, grad_outputs, domain=DOMAIN, clamp=1, min=0.0, max=float("inf")),
    ]
    outputs = []
    for index, reader in enumerate(dx_readers):
        if reader == "conv":
            nodes.append(helper.make_node("ReorderInput", ["dx"], [f"dx_b{index}"], domain=NCHWC))
            nodes.append(helper.make_node("Conv", [f"dx_b{index}", "w"], [f"out{index}"], domain=NCHWC))
        elif reader == "plain":
            nodes.append(helper.make_node("Relu", ["dx"], [f"out{index}"]))
        else:
            outputs.append(info[values.index("dx")])
    inputs = [info[values.index(name)] for name in ("x", "dy", *(["y"] if residual else []))]
    graph = helper.make_graph(nodes, "g", inputs, outputs, value_info=info)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])


def _ops(model: onnx.ModelProto) -> list[str]:
    return [node.op_type for node in model.graph.node]


def _block(node: onnx.NodeProto) -> int:
    return next((attribute.i for attribute in node.attribute if attribute.name == "block"), 0)


def test_a_batch_norm_gradient_between_convolutions_reads_and_writes_blocks() -> None:
    model = _backward_model([8, 32, 8, 8], ["conv"])
    assert keep_gradients_blocked(model, KERNEL_NCHWC_BLOCK) == 1
    assert _ops(model) == ["ReorderInput", "Conv", "BatchNormTrainingGrad", "Conv"]
    first, grad, second = model.graph.node[1:]
    assert grad.input[0] == first.output[0] and second.input[0] == grad.output[0] and _block(grad) == 16


def test_a_gradient_also_read_plain_or_returned_gets_one_reorder_back() -> None:
    model = _backward_model([8, 32, 8, 8], ["conv", "conv", "plain", "output"])
    assert keep_gradients_blocked(model, KERNEL_NCHWC_BLOCK) == 1
    nodes = model.graph.node
    (back,) = [node for node in nodes if node.op_type == "ReorderOutput"]
    assert list(back.output) == ["dx"] and dict(_attribute_ints(back)) == {"channels": 32}
    assert [node.op_type for node in nodes if "dx" in node.input] == ["Relu"]
    assert _ops(model).count("ReorderInput") == 1, "only the first convolution's input reorder is left"


def test_a_gradient_the_graph_declares_no_shape_for_takes_its_channels_from_x() -> None:
    model = _backward_model([8, 32, 8, 8], ["conv", "plain"])
    kept = [value for value in model.graph.value_info if value.name != "dx"]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)
    assert keep_gradients_blocked(model, KERNEL_NCHWC_BLOCK) == 1
    (back,) = [node for node in model.graph.node if node.op_type == "ReorderOutput"]
    assert list(back.output) == ["dx"] and dict(_attribute_ints(back)) == {"channels": 32}


def _attribute_ints(node: onnx.NodeProto) -> list[tuple[str, int]]:
    return [(attribute.name, attribute.i) for attribute in node.attribute]


def test_a_residual_gradient_passes_its_blocks_on_to_an_add() -> None:
    model = _backward_model([8, 32, 8, 8], ["conv"], residual=True)
    graph = model.graph
    graph.node.append(helper.make_node("ReorderOutput", ["dg_b"], ["skip"], domain=NCHWC, channels=32))
    graph.node.append(helper.make_node("Add", ["dz", "skip"], ["sum"]))
    graph.node.append(helper.make_node("ReorderInput", ["sum"], ["sum_b"], domain=NCHWC))
    graph.node.append(helper.make_node("Conv", ["sum_b", "w"], ["out_sum"], domain=NCHWC))
    graph.value_info.extend(
        helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [8, 32, 8, 8]) for name in ("skip", "sum")
    )
    assert keep_gradients_blocked(model, KERNEL_NCHWC_BLOCK) == 2
    assert "ReorderOutput" not in _ops(model) and _ops(model).count("ReorderInput") == 1
    (add,) = [node for node in graph.node if node.op_type == "Add"]
    grad = next(node for node in graph.node if node.op_type == "BatchNormAddTrainingGrad")
    assert add.input[0] == grad.output[3] and add.input[1] == "dg_b" and not add.attribute


@pytest.mark.parametrize(
    ("shape", "block", "reason"),
    [
        ([64, 32, 32, 32], 16, "a block of channels over 64 32x32 images outgrows the cache its re-read needs"),
        ([8, 24, 8, 8], 16, "channels that are not whole blocks"),
        ([8, 32, 8, 8], 8, "ONNX Runtime's AVX2 block, which the kernels do not read"),
    ],
)
def test_where_blocks_do_not_pay_or_do_not_fit_the_graph_is_left_alone(
    shape: list[int], block: int, reason: str
) -> None:
    model = _backward_model(shape, ["conv"])
    before = model.SerializeToString()
    assert keep_gradients_blocked(model, block) == 0, reason
    assert model.SerializeToString() == before


def test_a_gradient_read_plain_only_stays_plain() -> None:
    model = _backward_model([8, 32, 8, 8], ["plain", "output"])
    assert keep_gradients_blocked(model, KERNEL_NCHWC_BLOCK) == 0


class _StridedNet(nn.Module):
    """A stem, a residual block and a strided one with a 1x1 projection; on images of 10x10, every 3x3 weight
    gradient runs in lightning_ort's kernel, which reads the output gradient blocked."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.blocks = nn.Sequential(BasicBlock(32, 32, 1), BasicBlock(32, 64, 2))
        self.head = nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


@pytest.mark.skipif(not BLOCKS, reason="the kernels' NCHWc forms run where ONNX Runtime blocks 16 channels (AVX-512)")
def test_a_residual_net_keeps_its_backward_in_blocks_with_eagers_float64_accuracy(tmp_path: Path) -> None:
    torch.manual_seed(0)
    eager = _StridedNet()
    debug = DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path)
    wrapped = ORTModule(copy.deepcopy(eager), debug, fallback="raise")
    x = torch.randn(6, 3, 10, 10, generator=torch.Generator().manual_seed(1))  # 5x5 after the strided block
    assert_fp64_accuracy(eager, wrapped, x, perturbations=2)
    backward = onnx.load(str(tmp_path / "m_training_backward_part0.onnx")).graph
    grads = [node for node in backward.node if node.op_type.startswith("BatchNorm")]
    weaves = [node for node in backward.node if node.op_type == "Interleave2x2Add"]
    assert len(grads) == 6 and len(weaves) == 1 and _block(weaves[0]) == 16
    assert sum(_block(node) == 16 for node in grads) == 5, "all but the stem's, whose dX PyTorch reads"
    producers = {output: node for node in backward.node for output in node.output}
    reordered = [producers[n.input[0]].op_type for n in backward.node if n.op_type == "ReorderInput"]
    assert "BatchNormTrainingGrad" not in reordered and "BatchNormAddTrainingGrad" not in reordered
    assert wrapped.statistics.fallback_ops == 0
