"""The TorchDynamo front end: graph breaks, recompilations, side effects and ``torch.compile(backend="ort")``."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn

from lightning_ort import CaptureError, FallbackWarning, ORTModule
from lightning_ort.engine.runtime.session import GraphSession
from tests.helpers import GRAD_TOLERANCE, OUTPUT_TOLERANCE


class BranchOnValue(nn.Module):
    """Control flow on a tensor's value between two matrix products: a graph break."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.first(x))
        if hidden.sum() > 0:
            hidden = hidden * 2
        return self.second(hidden)


class LazyState(nn.Module):
    """Caches a tensor and a counter on ``self`` inside forward, and checks ``self.training``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.table: torch.Tensor | None = None
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.table is None or self.table.shape[0] != x.shape[0]:
            self.table = torch.arange(x.shape[0], dtype=x.dtype).unsqueeze(1)
        out = self.linear(x) + self.table
        return out * 0.5 if self.training else out


def _run_counter(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the ONNX Runtime graphs run from now on, one entry per run."""
    runs: list[str] = []
    original = GraphSession.__call__

    def counted(self: GraphSession, args: list[torch.Tensor]) -> list[torch.Tensor]:
        runs.append(self.name)
        return original(self, args)

    monkeypatch.setattr(GraphSession, "__call__", counted)
    return runs


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_graph_break_runs_both_sides_in_onnx_runtime(sign: float) -> None:
    torch.manual_seed(0)
    eager = BranchOnValue()
    with torch.no_grad():
        eager.first.bias.fill_(sign * 3)
    wrapped = ORTModule(BranchOnValue())
    wrapped.load_state_dict(eager.state_dict())
    x = torch.randn(5, 8)
    with pytest.warns(FallbackWarning, match="graph break"):
        actual = wrapped(x)
    expected = eager(x)
    torch.testing.assert_close(actual, expected, **OUTPUT_TOLERANCE)
    actual.square().sum().backward()
    expected.square().sum().backward()
    for ours, theirs in zip(wrapped.parameters(), eager.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, **GRAD_TOLERANCE)
    stats = wrapped.statistics
    assert stats.graphs >= 2 and stats.graph_breaks >= 1
    assert stats.forward_runs >= 2 and stats.backward_runs >= 2
    assert stats.eager_signatures == 0


class OneItem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.linear(x)
        return self.linear(hidden) * hidden.sum().item()


def test_a_graph_break_is_counted_once_as_torchdynamo_counts_it_for_the_module_alone() -> None:
    counters = torch._dynamo.utils.counters["graph_break"]
    before = sum(counters.values())
    torch.compile(OneItem(), backend="eager")(torch.randn(3, 4))
    alone = sum(counters.values()) - before
    wrapped = ORTModule(OneItem())
    with pytest.warns(FallbackWarning, match="graph break"):
        wrapped(torch.randn(3, 4)).sum().backward()
    assert wrapped.statistics.graph_breaks == alone == 1


def test_graph_break_raises_with_file_and_line_under_fallback_raise() -> None:
    wrapped = ORTModule(BranchOnValue(), fallback="raise")
    before = [p.detach().clone() for p in wrapped.parameters()]
    with pytest.raises(CaptureError, match=r"test_dynamo\.py:\d+ \(`if hidden\.sum\(\) > 0:`\).*fallback='auto'"):
        wrapped(torch.randn(3, 8))
    assert all(torch.equal(a, b) for a, b in zip(before, wrapped.parameters()))


def test_side_effects_in_forward_happen_as_in_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    runs = _run_counter(monkeypatch)
    eager, inner = LazyState(), LazyState()
    inner.load_state_dict(eager.state_dict())
    wrapped = ORTModule(inner)
    for rows in (4, 4, 4):
        x = torch.randn(rows, 6)
        torch.testing.assert_close(wrapped(x), eager(x), **OUTPUT_TOLERANCE)
    assert inner.calls == eager.calls == 3
    assert inner.table is not None and torch.equal(inner.table, eager.table)
    wrapped.eval()
    eager.eval()
    x = torch.randn(4, 6)
    torch.testing.assert_close(wrapped(x), eager(x), **OUTPUT_TOLERANCE)
    assert runs and wrapped.statistics.forward_runs == 4


def test_recompile_reason_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    wrapped = ORTModule(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.2)))
    wrapped(torch.randn(2, 4))
    with caplog.at_level(logging.INFO, logger="lightning_ort"):
        wrapped.eval()
        wrapped(torch.randn(2, 4))
    assert any("recompiles because" in r.getMessage() and "training" in r.getMessage() for r in caplog.records)


def test_twenty_sequence_lengths_use_at_most_two_graphs() -> None:
    wrapped = ORTModule(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)))
    for length in range(3, 23):
        wrapped(torch.randn(2, length, 8)).sum().backward()
    stats = wrapped.statistics
    assert stats.graphs <= 2 and stats.cache_hits >= 18 and stats.backward_runs == 20


def test_recompile_limit_warns_with_the_remedy() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
            return self.linear(x) * scale

    wrapped = ORTModule(Scaled(), dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FallbackWarning)
        for step in range(4):
            wrapped(torch.randn(2, 3), 1.0 + step)
    messages = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    assert any("recompile_limit" in m and "dynamic=True" in m for m in messages), messages
    assert wrapped.statistics.recompile_limit_hits == 1


def test_torch_compile_backend_ort(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "ort" in torch._dynamo.list_backends()
    runs = _run_counter(monkeypatch)
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    model.load_state_dict(eager.state_dict())
    compiled = torch.compile(model, backend="ort", options={"fallback": "raise", "intra_op_num_threads": 1})
    x = torch.randn(4, 8)
    actual, expected = compiled(x), eager(x)
    torch.testing.assert_close(actual, expected, **OUTPUT_TOLERANCE)
    actual.square().sum().backward()
    expected.square().sum().backward()
    for ours, theirs in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, **GRAD_TOLERANCE)
    assert any(name.startswith("forward") for name in runs) and any(name.startswith("backward") for name in runs)


def test_torch_compile_backend_rejects_unknown_options() -> None:
    compiled = torch.compile(nn.Linear(2, 2), backend="ort", options={"save_onx": True})
    with pytest.raises(Exception, match=r"unknown option\(s\) \['save_onx'\]"):
        compiled(torch.randn(1, 2))


def test_hugging_face_warning_once_does_not_break_the_graph() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    expected = model(input_ids=ids, labels=ids).loss
    wrapped = ORTModule(model)
    loss = wrapped(input_ids=ids, labels=ids).loss  # its loss property calls logger.warning_once (loss_type)
    loss.backward()
    torch.testing.assert_close(loss, expected, **OUTPUT_TOLERANCE)
    stats = wrapped.statistics
    assert stats.graph_breaks == 0 and stats.graphs == 1, "one graph: the advice is skipped while tracing"
    assert torch._dynamo.config.ignore_logging_functions == set(), "set for ORTModule's call only"
