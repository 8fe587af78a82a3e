"""Activations written out in elementwise ops, folded into their ``torch.nn.functional`` calls.

Models spell GELU and SiLU out in Python (Hugging Face's ``gelu_new`` and ``gelu_fast``, BERT-era ``erf`` GELUs,
``x * torch.sigmoid(x)``). These tests check that each way of writing them becomes the one call, whatever the
grouping and constants' digits, that other functions and chains whose intermediates are read elsewhere stay as
written, and that a model written that way trains as accurately as eager through one ``Gelu`` forward and one
gradient kernel backward.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
import torch
from onnx import helper
from torch import nn
from torch.nn import functional as F

from lightning_ort import DebugOptions, ORTModule
from lightning_ort.engine.fx.activations import fold_activations
from tests.helpers import assert_fp64_accuracy


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``gelu_new`` (GPT-2, GPT-J, BLOOM), as ``transformers.activations.NewGELUActivation``."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_fast(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``gelu_fast``: the same function, grouped otherwise, with a 10-digit constant."""
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def erf_gelu(x: torch.Tensor) -> torch.Tensor:
    """The exact GELU as BERT-era code writes it."""
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def swish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


CASES: list[tuple[Callable[[torch.Tensor], torch.Tensor], Callable[..., torch.Tensor], dict[str, str]]] = [
    (gelu_new, F.gelu, {"approximate": "tanh"}),
    (gelu_fast, F.gelu, {"approximate": "tanh"}),
    (lambda x: (torch.tanh(0.7978845608 * (x + 0.044715 * x**3)) + 1) * x * 0.5, F.gelu, {"approximate": "tanh"}),
    (erf_gelu, F.gelu, {}),
    (swish, F.silu, {}),
    (lambda x: torch.sigmoid(x).mul(x), F.silu, {}),
]


@pytest.mark.parametrize(("activation", "call", "kwargs"), CASES)
def test_each_way_of_writing_an_activation_becomes_its_one_call(
    activation: Callable[[torch.Tensor], torch.Tensor], call: Callable[..., torch.Tensor], kwargs: dict[str, str]
) -> None:
    gm = torch.fx.symbolic_trace(lambda x, y: activation(x) * y)
    assert fold_activations(gm) == 1
    calls = [node for node in gm.graph.nodes if node.op in ("call_function", "call_method")]
    assert len(calls) == 2 and calls[0].target is call and calls[0].kwargs == kwargs, [n.target for n in calls]
    x, y = torch.randn(64, 32) * 3, torch.randn(64, 32)
    # Compared where float32 rounding allows: the written-out erf GELU loses digits to 1 + erf(x) in the negative
    # tail (up to 2e-6 on these inputs), which the one call does not.
    torch.testing.assert_close(gm(x, y), activation(x) * y, rtol=1e-5, atol=1e-5)


def test_other_functions_and_chains_whose_intermediates_are_read_elsewhere_stay() -> None:
    def other_coefficient(x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.05 * torch.pow(x, 3.0))))

    def shared(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inner = x + 0.044715 * torch.pow(x, 3.0)
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * inner)), inner

    def two_tensors(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y * torch.sigmoid(x)

    def quick_gelu(x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)

    for function in (other_coefficient, shared, two_tensors, quick_gelu, lambda x: torch.tanh(x) * x):
        gm = torch.fx.symbolic_trace(function)
        before = [node.target for node in gm.graph.nodes]
        assert fold_activations(gm) == 0 and [node.target for node in gm.graph.nodes] == before, function
    integers = torch.fx.symbolic_trace(swish)
    (x,) = [node for node in integers.graph.nodes if node.op == "placeholder"]
    x.meta["example_value"] = torch.empty(4, dtype=torch.int64)  # as TorchDynamo records it
    assert fold_activations(integers) == 0, "F.silu takes no integer tensor"


class WrittenOutMLP(nn.Module):
    """Linear layers with activations written out, as GPT-2's MLP (``gelu_new``) and others have them."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(24, 64)
        self.mid = nn.Linear(64, 64)
        self.last = nn.Linear(64, 64)
        self.down = nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(swish(self.last(erf_gelu(self.mid(gelu_new(self.up(x)))))))


@pytest.mark.parametrize("seed", [0, 1])
def test_written_out_activations_train_as_one_node_forward_and_one_gradient_kernel(
    library: Path, tmp_path: Path, seed: int
) -> None:
    torch.manual_seed(seed)
    eager = WrittenOutMLP()
    assert_fp64_accuracy(eager, ORTModule(copy.deepcopy(eager), fallback="raise"), torch.randn(32, 24) * 2)
    debug = DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path)
    wrapped = ORTModule(copy.deepcopy(eager), debug, fallback="raise")
    wrapped(torch.randn(8, 24)).square().sum().backward()
    graphs = {kind: onnx.load(str(tmp_path / f"m_training_{kind}.onnx")).graph for kind in ("forward", "backward")}
    forward, backward = (Counter(node.op_type for node in graph.node) for graph in graphs.values())
    assert forward["Gelu"] == 2 and forward["Sigmoid"] == 1, forward
    assert forward["Tanh"] == forward["Erf"] == forward["Pow"] == 0, forward
    assert backward["GeluGrad"] == 2 and backward["SiluGrad"] == 1, backward
    assert backward["Tanh"] == backward["Erf"] == backward["Sigmoid"] == backward["Pow"] == 0, backward
    approximations = [
        helper.get_attribute_value(node.attribute[0]) for node in graphs["backward"].node if node.op_type == "GeluGrad"
    ]
    assert sorted(approximations) == [0, 1], "the erf GELU and the tanh one"
