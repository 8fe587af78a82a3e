"""Per-op fallback: ops ONNX cannot express run in PyTorch, the rest of the graph in ONNX Runtime."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import lightning_ort.engine.capture.build as build_module
from lightning_ort import CaptureError, ExportError, FallbackWarning, ORTModule
from lightning_ort.errors import SessionError
from tests.custom_ops import CustomOpMLP, DataDependentBranch
from tests.helpers import GRAD_TOLERANCE, OUTPUT_TOLERANCE, assert_grads_close
from tests.zoo import MLP


def _train_step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach()


def test_custom_op_runs_in_pytorch_between_ort_partitions() -> None:
    torch.manual_seed(0)
    eager = CustomOpMLP()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(5, 8)
    with pytest.warns(FallbackWarning, match=r"1 op\(s\) in PyTorch.*lightning_ort_tests.softsign.*module `act`"):
        actual = _train_step(wrapped, x)
    torch.testing.assert_close(actual, _train_step(eager, x), **OUTPUT_TOLERANCE)
    assert_grads_close(wrapped, eager)
    stats = wrapped.statistics
    assert stats.fallback_ops == 1
    assert (stats.forward_runs, stats.backward_runs) == (1, 1)
    assert stats.onnx_exports == 3  # two forward partitions around the custom op, one backward graph

    _train_step(wrapped, x)
    assert wrapped.statistics.cache_hits == 1 and wrapped.statistics.onnx_exports == 3


def test_fallback_raise_names_op_module_and_remedy_and_leaves_model_intact() -> None:
    model = CustomOpMLP()
    before = copy.deepcopy(model.state_dict())
    wrapped = ORTModule(model, fallback="raise")
    with pytest.raises(ExportError, match=r"(?s)softsign.*module `act` \(Softsign\).*fallback='auto'"):
        wrapped(torch.randn(2, 8))
    assert wrapped.statistics.cached_graphs == 0
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])
    assert all(p.grad is None for p in model.parameters())


def test_op_failing_in_translation_falls_back_too() -> None:
    # special_zeta is in the exporter's registry but its translation fails: found at export, moved to PyTorch.
    class Zeta(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.special.zeta(self.lin(x).abs() + 1.5, 2.0) + self.lin(x)

    eager = Zeta()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.rand(3, 4)
    with torch.no_grad():
        with pytest.warns(FallbackWarning, match="special_zeta"):
            actual = wrapped(x)
        torch.testing.assert_close(actual, eager(x), **OUTPUT_TOLERANCE)
    assert wrapped.statistics.fallback_ops == 1


def test_data_dependent_branch_is_a_graph_break_with_onnx_runtime_on_both_sides() -> None:
    torch.manual_seed(0)
    eager = DataDependentBranch()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(4, 8)
    with pytest.warns(FallbackWarning, match=r"graph break: Data-dependent branching"):
        actual = _train_step(wrapped, x)
    torch.testing.assert_close(actual, _train_step(eager, x), **OUTPUT_TOLERANCE)
    for a, e in zip(wrapped.parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, e.grad, **GRAD_TOLERANCE)
    stats = wrapped.statistics
    assert stats.eager_signatures == 0 and stats.graph_breaks >= 1 and stats.forward_runs >= 1
    _train_step(wrapped, -x)
    torch.testing.assert_close(_train_step(wrapped, -x), _train_step(eager, -x), **OUTPUT_TOLERANCE)


def test_data_dependent_branch_with_fallback_raise() -> None:
    wrapped = ORTModule(DataDependentBranch(), fallback="raise")
    with pytest.raises(CaptureError, match=r"(?s)custom_ops.py:\d+ .*torch.where.*fallback='auto'"):
        wrapped(torch.randn(2, 8))
    assert wrapped.statistics.cached_graphs == 0


def test_unknown_fallback_policy_is_refused() -> None:
    with pytest.raises(ValueError, match=r"fallback='eager' is not a fallback policy"):
        ORTModule(torch.nn.Linear(2, 2), fallback="eager")  # type: ignore[arg-type]


def _unloadable(*args: object, **kwargs: object) -> None:
    raise SessionError("ONNX Runtime could not load the forward graph: an unexpected failure naming no node")


def test_graph_onnx_runtime_cannot_load_runs_that_signature_in_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build_module, "GraphSession", _unloadable)
    torch.manual_seed(0)
    eager = MLP()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(4, 16)
    with pytest.warns(FallbackWarning, match=r"MLP runs in PyTorch .*could not build its graphs \(.*naming no"):
        actual = _train_step(wrapped, x)
    torch.testing.assert_close(actual, _train_step(eager, x), **OUTPUT_TOLERANCE)
    assert_grads_close(wrapped, eager)
    assert wrapped.statistics.eager_signatures == 1 and wrapped.statistics.forward_runs == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train_step(wrapped, x)  # the same graph: PyTorch again, without another warning or build attempt


def test_graph_onnx_runtime_cannot_load_with_fallback_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build_module, "GraphSession", _unloadable)
    model = MLP()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(SessionError, match="naming no node"):
        ORTModule(model, fallback="raise")(torch.randn(2, 16))
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


class _CumprodBetweenLayers(torch.nn.Module):
    """``cumprod``'s exported backward is a model ONNX Runtime refuses (an ``ArgMax`` on booleans), naming no op."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.last = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.cumprod(torch.tanh(self.first(x)), dim=1))


def test_op_onnx_runtime_rejects_runs_in_pytorch_and_the_layers_stay_in_ort() -> None:
    torch.manual_seed(0)
    eager = _CumprodBetweenLayers()
    wrapped = ORTModule(copy.deepcopy(eager))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, wrapped)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FallbackWarning)
        for step in range(3):
            x = torch.randn(5, 8)
            losses = []
            for model, optimizer in zip((eager, wrapped), optimizers):
                optimizer.zero_grad()
                loss = model(x).square().mean()
                loss.backward()
                losses.append(loss)
            assert_grads_close(wrapped, eager)
            torch.testing.assert_close(losses[1], losses[0], **OUTPUT_TOLERANCE)
            for optimizer in optimizers:
                optimizer.step()
            if step == 0:
                with torch.profiler.profile() as profile:
                    wrapped(x).square().mean().backward()
                wrapped.zero_grad()
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    assert fallbacks and all("cumprod" in message for message in fallbacks), fallbacks
    assert len({message.split("graph runs")[0] for message in fallbacks}) == len(fallbacks)  # once per graph
    ran = {event.name for event in profile.events()}
    assert not ran & {"aten::mm", "aten::addmm", "aten::linear", "aten::matmul"}
    assert "aten::cumprod" in ran
    stats = wrapped.statistics
    assert stats.fallback_ops >= 1 and stats.eager_signatures == 0 and stats.backward_runs == 4


def test_fallback_in_a_block_graph_names_the_module_by_its_path() -> None:
    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cummax(self.proj(x), -1).values  # no ONNX translation

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn, self.ff = Attention(), torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.ff(self.attn(x)) + x

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer() for _ in range(3)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    eager = Stack()
    wrapped = ORTModule(copy.deepcopy(eager), blocks="auto")
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = _train_step(wrapped, x)
    messages = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    assert any("cummax" in m and "module `layers.0.attn` (Attention)" in m for m in messages), messages
    assert not any(".forward.args[" in m for m in messages)
    torch.testing.assert_close(actual, _train_step(eager, x), **OUTPUT_TOLERANCE)
    assert wrapped.statistics.block_graphs > 0
