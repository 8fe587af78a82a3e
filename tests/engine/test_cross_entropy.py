"""``F.cross_entropy`` over class scores: its gradient in three passes over the scores, with eager's values.

The scores of a language model's head (rows x vocabulary) are the largest tensor of its step, so the passes its
gradient takes over them are counted in the exported backward graph; parity is checked against eager on batches
with ignored targets, as padded language-model batches have.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_ort import DebugOptions, ORTModule
from tests.helpers import assert_grads_close

ROWS, CLASSES = 24, 301


class Head(nn.Module):
    """A projection to class scores and the loss over them, as a language model's head computes it."""

    def __init__(self, **loss_options: Any) -> None:
        super().__init__()
        self.proj = nn.Linear(16, CLASSES)
        self.loss_options = loss_options

    def forward(self, features: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.proj(features).float(), target, **self.loss_options).sum()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    target = torch.randint(0, CLASSES, (ROWS,), generator=g)
    target[::5] = -100  # padding
    return torch.randn(ROWS, 16, generator=g), target


def _train_both(prefix: Path, **loss_options: Any) -> tuple[torch.Tensor, torch.Tensor, ORTModule, nn.Module]:
    torch.manual_seed(0)
    eager = Head(**loss_options)
    wrapped = ORTModule(copy.deepcopy(eager), debug_options=DebugOptions(save_onnx=True, onnx_prefix=str(prefix)))
    features, target = _batch()
    expected, actual = eager(features, target), wrapped(features, target)
    expected.backward()
    actual.backward()
    assert (wrapped.statistics.forward_runs, wrapped.statistics.backward_runs) == (1, 1)
    return actual, expected, wrapped, eager


def _backward_graph(prefix: Path) -> onnx.ModelProto:
    (path,) = prefix.parent.glob(f"{prefix.name}*backward.onnx")
    return onnx.shape_inference.infer_shapes(onnx.load(path))


def _passes_over_scores(model: onnx.ModelProto) -> list[str]:
    """The op types of the graph's nodes whose output has the scores' shape."""
    shapes = {
        value.name: [d.dim_value for d in value.type.tensor_type.shape.dim]
        for value in [*model.graph.value_info, *model.graph.output]
    }
    return [node.op_type for node in model.graph.node if shapes.get(node.output[0]) == [ROWS, CLASSES]]


def _scatter_adds(model: onnx.ModelProto) -> int:
    return sum(
        node.op_type == "ScatterElements" and onnx.helper.get_node_attr_value(node, "reduction") == b"add"
        for node in model.graph.node
        if any(attr.name == "reduction" for attr in node.attribute)
    )


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_gradient_takes_three_passes_over_the_scores_with_eagers_values(tmp_path: Path, reduction: str) -> None:
    actual, expected, wrapped, eager = _train_both(tmp_path / "head", reduction=reduction)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    assert_grads_close(wrapped, eager)
    backward = _backward_graph(tmp_path / "head")
    assert sorted(_passes_over_scores(backward)) == ["Exp", "Mul", "ScatterElements"]
    assert _scatter_adds(backward) == 1


@pytest.mark.parametrize(
    "loss_options",
    [
        {"label_smoothing": 0.1},
        {"weight": torch.rand(CLASSES, generator=torch.Generator().manual_seed(2))},
        {"reduction": "none"},
    ],
    ids=["label-smoothing", "class-weights", "no-reduction"],
)
def test_other_cross_entropies_keep_pytorchs_own_gradient(tmp_path: Path, loss_options: dict[str, Any]) -> None:
    actual, expected, wrapped, eager = _train_both(tmp_path / "head", **loss_options)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    assert_grads_close(wrapped, eager)
    assert _scatter_adds(_backward_graph(tmp_path / "head")) == 0


def test_a_batch_whose_targets_are_all_ignored_gives_eagers_loss_and_gradient() -> None:
    torch.manual_seed(0)
    eager = Head(reduction="sum")
    wrapped = ORTModule(copy.deepcopy(eager))
    features, target = _batch()
    target[:] = -100
    expected, actual = eager(features, target), wrapped(features, target)
    expected.backward()
    actual.backward()
    assert actual.item() == expected.item() == 0.0
    assert_grads_close(wrapped, eager)
    assert wrapped.proj.weight.grad is not None and not wrapped.proj.weight.grad.any()
