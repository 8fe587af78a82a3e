"""onnxruntime-training's ORTModule contract: signatures, Python constants, attributes and methods of the model."""

from __future__ import annotations

import copy
import inspect
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_ort import DebugOptions, FallbackWarning, ORTModule, SessionError
from tests.helpers import GRAD_TOLERANCE, OUTPUT_TOLERANCE


class Positional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + y


class VarArgs(Positional):
    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.linear(x) + sum(rest)


class KeywordOnly(Positional):
    def forward(self, x: torch.Tensor, *, scale: float = 2.0) -> torch.Tensor:  # type: ignore[override]
        return self.linear(x) * scale


class VarKeywords(Positional):
    def forward(self, x: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.linear(x) + sum(extra.values())


@pytest.mark.parametrize("model_type", [Positional, VarArgs, KeywordOnly, VarKeywords])
def test_forward_keeps_the_wrapped_signature(model_type: type[nn.Module]) -> None:
    model = model_type()
    wrapped = ORTModule(model)
    assert inspect.signature(wrapped.forward) == inspect.signature(model.forward)
    assert wrapped.forward.__doc__ == model.forward.__doc__


def test_signature_survives_copies_and_calls_still_run_in_ort() -> None:
    wrapped = ORTModule(Positional())
    x = torch.randn(3, 4)
    for clone in (copy.deepcopy(wrapped), pickle.loads(pickle.dumps(wrapped))):
        assert inspect.signature(clone.forward) == inspect.signature(Positional().forward)
        torch.testing.assert_close(clone(x, x), clone.module(x, x), **OUTPUT_TOLERANCE)
        assert clone.statistics.forward_runs == 1


class Modes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mode: str = "hello") -> torch.Tensor:
        y = self.linear(x)
        return y.relu() if mode == "hello" else y.sigmoid()


def test_string_argument_is_a_constant_that_selects_the_graph() -> None:
    model = Modes()
    wrapped = ORTModule(model)
    x = torch.randn(3, 4)
    for mode in ("hello", "goodbye", "hello"):
        torch.testing.assert_close(wrapped(x, mode=mode), model(x, mode=mode), **OUTPUT_TOLERANCE)
    assert wrapped.statistics.graphs == 2
    assert wrapped.statistics.forward_runs == 3


class TensorAttribute(nn.Module):
    """Keeps a plain tensor (not a registered buffer) on ``self`` and an unused buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.bits = torch.tensor([1, 2, 4, 8])
        self.register_buffer("offset", torch.ones(4))
        self.register_buffer("unused", torch.zeros(4))

    def forward(self, x: torch.Tensor, flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x) + self.offset, torch.bitwise_or(flags, self.bits)


def test_plain_tensor_attribute_and_buffers_work_as_constants() -> None:
    model = TensorAttribute()
    wrapped = ORTModule(model)
    x, flags = torch.randn(3, 4, requires_grad=True), torch.tensor([[1, 0, 3, 0]] * 3)
    out, bits = wrapped(x, flags)
    expected, expected_bits = model(x, flags)
    torch.testing.assert_close(out, expected, **OUTPUT_TOLERANCE)
    torch.testing.assert_close(bits, expected_bits)
    out.sum().backward()
    assert wrapped.statistics.forward_runs == 1 and wrapped.statistics.backward_runs == 1
    model.bits = torch.tensor([16, 16, 16, 16])
    torch.testing.assert_close(wrapped(x, flags)[1], torch.bitwise_or(flags, model.bits))


class WithMethods(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale

    def run_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).tanh()


def test_user_methods_called_on_the_wrapper_run_through_ort() -> None:
    model = WithMethods()
    wrapped = ORTModule(model)
    x = torch.randn(3, 4)
    out = wrapped.run_forward(x)
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    expected = model.run_forward(x)
    expected.sum().backward()
    torch.testing.assert_close(out, expected, **OUTPUT_TOLERANCE)
    for grad, param in zip(grads, model.parameters()):
        torch.testing.assert_close(grad, param.grad, **GRAD_TOLERANCE)
    assert wrapped.statistics.forward_runs == 1 and wrapped.statistics.backward_runs == 1


@pytest.mark.parametrize("value", [True, "text", 3, len])
def test_attributes_set_on_the_wrapper_land_on_the_wrapped_module(value: Any) -> None:
    model = WithMethods()
    wrapped = ORTModule(model)
    wrapped.tag = value
    assert model.tag is value
    assert wrapped.tag is value
    del wrapped.tag
    assert not hasattr(model, "tag")


def test_setattr_through_the_wrapper_changes_the_next_call() -> None:
    model = WithMethods()
    wrapped = ORTModule(model)
    x = torch.randn(3, 4)
    before = wrapped(x)
    wrapped.scale = 3.0
    assert model.scale == 3.0
    torch.testing.assert_close(wrapped(x), before * 3.0, **OUTPUT_TOLERANCE)
    assert wrapped.statistics.forward_runs == 2


def test_save_onnx_needs_a_prefix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="onnx_prefix"):
        DebugOptions(save_onnx=True, save_path=tmp_path)
    with pytest.raises(TypeError, match="onnx_prefix"):
        DebugOptions(save_onnx=True, onnx_prefix=3, save_path=tmp_path)  # type: ignore[arg-type]
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="save_path"):
        DebugOptions(save_onnx=True, onnx_prefix="m", save_path=blocker / "sub")


def test_spatial_sizes_changing_between_calls_keep_running_in_ort() -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, stride=2, padding=1))
    wrapped = ORTModule(copy.deepcopy(eager))
    for size in (16, 21, 30):
        x = torch.randn(2, 3, size, size)
        eager.zero_grad()
        wrapped.zero_grad()
        out = wrapped(x)
        out.square().sum().backward()
        expected = eager(x)
        expected.square().sum().backward()
        torch.testing.assert_close(out, expected, **OUTPUT_TOLERANCE)
        for mine, theirs in zip(wrapped.parameters(), eager.parameters()):
            torch.testing.assert_close(mine.grad, theirs.grad, **GRAD_TOLERANCE)
    stats = wrapped.statistics
    assert stats.forward_runs == 3 and stats.backward_runs == 3 and stats.eager_signatures == 0


class ArgmaxUnfold(nn.Module):
    """Integer indices from ``argmax`` next to ``unfold``, whose backward adds rows at repeated indices."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = x.argmax(-1)
        return self.linear(x).unfold(1, 2, 1).sum(-1) * index[:, 1:].unsqueeze(-1)


def test_argmax_feeding_unfold_trains_wholly_in_onnx_runtime() -> None:
    torch.manual_seed(0)
    eager = ArgmaxUnfold()
    wrapped = ORTModule(copy.deepcopy(eager), fallback="raise")
    x = torch.randn(3, 6, 6)
    wrapped(x).sum().backward()
    eager(x).sum().backward()
    for mine, theirs in zip(wrapped.parameters(), eager.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, **GRAD_TOLERANCE)
    assert wrapped.statistics.backward_runs == 1 and wrapped.statistics.fallback_ops == 0


class Int16Maximum(nn.Module):
    """The maximum of ``argmax`` indices cast to ``int16``: ONNX Runtime's ``ReduceMax`` has no ``int16`` kernel,
    so it refuses the exported forward graph, which the exporter let through."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        largest = x.argmax(-1).to(torch.int16).amax(-1, keepdim=True)
        return self.linear(x).sum(-1) * largest


def test_an_op_onnx_runtime_refuses_falls_back_per_op() -> None:
    torch.manual_seed(0)
    eager = Int16Maximum()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(3, 6, 6)
    with pytest.warns(FallbackWarning, match=r"bisection traced .* to `aten\.amax\.default`"):
        wrapped(x).sum().backward()
    eager(x).sum().backward()
    for mine, theirs in zip(wrapped.parameters(), eager.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, **GRAD_TOLERANCE)
    assert wrapped.statistics.backward_runs == 1 and wrapped.statistics.eager_signatures == 0


def test_fallback_raise_names_the_op_onnx_runtime_refuses() -> None:
    model = Int16Maximum()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(SessionError, match=r"Bisection traced it to the op `aten\.amax\.default`"):
        ORTModule(model, fallback="raise")(torch.randn(3, 6, 6)).sum().backward()
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
