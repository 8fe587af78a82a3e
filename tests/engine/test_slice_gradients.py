"""Slices' gradients: summed over adjacent ranges, one ``cat``; alone, a zero ``pad``; never a scatter.

Rotary position embeddings (Llama, Mistral, GPT-NeoX) rotate each head's halves, ``cat((-x2, x1))``, whose
gradient sums two slices' gradients. The exported backward graph is read for the ops that build them, and the
parameters' gradients are compared with eager PyTorch's.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import nn

from lightning_ort import DebugOptions, ORTModule
from tests.helpers import assert_grads_close, tiny_llama


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``rotate_half``, as Llama's attention applies it."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Sliced(nn.Module):
    """A projection whose output goes through ``slicing`` before a second projection."""

    def __init__(self, slicing: Callable[[torch.Tensor], torch.Tensor], width: int = 16) -> None:
        super().__init__()
        self.slicing = slicing
        self.inner = nn.Linear(width, width)
        self.outer = nn.LazyLinear(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        return self.outer(self.slicing(y)).square().mean()


def _rotary(y: torch.Tensor) -> torch.Tensor:
    angles = torch.arange(y.shape[-1], dtype=y.dtype) / y.shape[-1]
    return y * angles.cos() + rotate_half(y) * angles.sin()


SLICINGS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    "rotary": (_rotary, "Concat"),
    "one_slice": (lambda y: y[:, 3:11], "Pad"),
    "overlapping_slices": (lambda y: y[:, :10] * y[:, 6:], "Pad"),
    "gapped_slices": (lambda y: torch.cat((y[:, :4], y[:, 9:13]), dim=1), "Pad"),
}


def _backward_ops(prefix: Path) -> collections.Counter[str]:
    (path,) = prefix.parent.glob(f"{prefix.name}*backward.onnx")
    return collections.Counter(node.op_type for node in onnx.load(path).graph.node)


@pytest.mark.parametrize("slicing", sorted(SLICINGS))
def test_slice_gradients_are_cats_or_pads_with_eagers_values(slicing: str, tmp_path: Path) -> None:
    function, expected_op = SLICINGS[slicing]
    torch.manual_seed(0)
    eager = Sliced(function)
    x = torch.randn(6, 16)
    eager(x)  # the lazy layer's shape
    wrapped = ORTModule(
        copy.deepcopy(eager), debug_options=DebugOptions(save_onnx=True, onnx_prefix=str(tmp_path / "m"))
    )
    actual, expected = wrapped(x), eager(x)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    actual.backward()
    expected.backward()
    assert_grads_close(wrapped, eager)
    ops = _backward_ops(tmp_path / "m")
    assert ops[expected_op] >= 1 and not ops["ScatterND"] and not ops["ScatterElements"], ops


def test_strided_slices_keep_their_gradient_and_train_as_eager() -> None:
    torch.manual_seed(0)
    eager = Sliced(lambda y: y[:, 1::3])
    x = torch.randn(6, 16)
    eager(x)
    wrapped = ORTModule(copy.deepcopy(eager), fallback="raise")
    actual, expected = wrapped(x), eager(x)
    actual.backward()
    expected.backward()
    torch.testing.assert_close(actual, expected)
    assert_grads_close(wrapped, eager)
    assert wrapped.statistics.backward_runs == 1


def test_hugging_face_llama_rotates_and_squares_without_scatters_or_powers(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    eager = tiny_llama()
    wrapped = ORTModule(
        copy.deepcopy(eager), debug_options=DebugOptions(save_onnx=True, onnx_prefix=str(tmp_path / "llama"))
    )
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    actual = wrapped(input_ids=ids, attention_mask=mask, labels=labels).loss
    expected = eager(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    actual.backward()
    expected.backward()
    assert_grads_close(wrapped, eager)
    graph = onnx.load(tmp_path / "llama_training_backward_part0.onnx").graph  # the embedding's gradient apart
    ops = collections.Counter(node.op_type for node in graph.node)
    assert not ops["ScatterND"], "the rotations' gradients are concatenations"
    constants = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    constants |= {
        node.output[0]: numpy_helper.to_array(node.attribute[0].t)
        for node in graph.node
        if node.op_type == "Constant" and node.attribute[0].name == "value"
    }
    exponents = [constants.get(node.input[1]) for node in graph.node if node.op_type == "Pow"]
    assert all(e is not None and float(e) != 1.0 for e in exponents), "the squares' gradient takes x, not x ** 1"
