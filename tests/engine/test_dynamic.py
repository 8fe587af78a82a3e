"""Dynamic shapes: variable sequence lengths and ragged batches build a bounded number of graphs."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
from torch import nn

import lightning_ort.engine.capture.build as build_module
from lightning_ort import DebugOptions, ExportError, FallbackWarning, ORTModule
from tests.helpers import GRAD_TOLERANCE, OUTPUT_TOLERANCE
from tests.zoo import MLP, CausalLM


def _step_and_compare(wrapped: ORTModule, eager: nn.Module, *inputs: torch.Tensor) -> None:
    actual, expected = wrapped(*inputs), eager(*inputs)
    torch.testing.assert_close(actual, expected, **OUTPUT_TOLERANCE)
    weights = torch.linspace(-1, 1, expected.numel()).view_as(expected)
    (actual * weights).sum().backward()
    (expected * weights).sum().backward()
    for (name, a), e in zip(wrapped.named_parameters(), eager.parameters()):
        assert a.grad is not None and e.grad is not None, name
        torch.testing.assert_close(a.grad, e.grad, **GRAD_TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")
        a.grad, e.grad = None, None


def test_twenty_sequence_lengths_build_two_graphs_and_match_eager() -> None:
    torch.manual_seed(0)
    eager = CausalLM()
    wrapped = ORTModule(copy.deepcopy(eager))
    g = torch.Generator().manual_seed(0)
    lengths = [16, 12, 9, 2, 14, 3, 11, 7, 15, 8, 13, 4, 10, 6, 5, 16, 12, 9, 14, 3]
    assert len(set(lengths)) == 15 and len(lengths) == 20
    for length in lengths:
        _step_and_compare(wrapped, eager, torch.randint(0, 64, (2, length), generator=g))
    stats = wrapped.statistics
    assert stats.cache_misses == 2, "one graph for the first shape, one symbolic graph for every other length"
    assert stats.cache_hits == 18 and stats.cached_graphs == 2
    assert stats.backward_runs == 20


def test_ragged_last_batch_reuses_the_symbolic_graph_next_epoch() -> None:
    torch.manual_seed(0)
    eager = MLP()
    wrapped = ORTModule(copy.deepcopy(eager))
    g = torch.Generator().manual_seed(1)
    for _epoch in range(3):
        for batch in (8, 8, 8, 5):
            _step_and_compare(wrapped, eager, torch.randn(batch, 16, generator=g))
    assert wrapped.statistics.cache_misses == 2


def test_dynamic_false_builds_one_graph_per_shape() -> None:
    wrapped = ORTModule(MLP(), dynamic=False)
    with torch.no_grad():
        for batch in (3, 4, 5, 4):
            wrapped(torch.randn(batch, 16))
    assert (wrapped.statistics.cache_misses, wrapped.statistics.cache_hits) == (3, 1)


def test_dynamic_true_builds_one_graph_from_the_first_call() -> None:
    torch.manual_seed(0)
    eager = CausalLM()
    wrapped = ORTModule(copy.deepcopy(eager), dynamic=True)
    g = torch.Generator().manual_seed(2)
    for batch, length in ((2, 16), (3, 5), (4, 11)):
        _step_and_compare(wrapped, eager, torch.randint(0, 64, (batch, length), generator=g))
    assert wrapped.statistics.cache_misses == 1


class SizeBranch(nn.Module):
    """Takes a different path for long sequences: a symbolic graph built on long ones must not run short ones."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if x.shape[1] > 8:
            return h.cumsum(dim=1)
        return torch.tanh(h)


def test_shape_guards_keep_a_symbolic_graph_to_the_sizes_it_is_valid_for() -> None:
    torch.manual_seed(0)
    eager = SizeBranch()
    wrapped = ORTModule(copy.deepcopy(eager))
    g = torch.Generator().manual_seed(3)
    for length in (12, 10, 16, 4, 6, 11):
        _step_and_compare(wrapped, eager, torch.randn(2, length, 4, generator=g))
    # 12 (static); 10 builds a symbolic graph guarded by "length > 8" (16 and 11 reuse it); 4 fails that guard
    # and builds a second symbolic graph guarded by "length <= 8" (6 reuses it).
    assert wrapped.statistics.cache_misses == 3


def test_dropout_noise_follows_the_symbolic_shape() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5))
    wrapped = ORTModule(model, dynamic=True)
    for length in (5, 9, 30):
        out = wrapped(torch.ones(length, 8))
        assert out.shape == (length, 64)
        zeros = (out == 0).float().mean().item()
        assert 0.3 < zeros < 0.7, f"length {length}: dropped fraction {zeros}"
        out.sum().backward()
    assert wrapped.statistics.cache_misses == 1


def test_symbolic_graphs_round_trip_through_the_disk_cache(tmp_path: Path) -> None:
    torch.manual_seed(0)
    eager = CausalLM()
    first = ORTModule(copy.deepcopy(eager), dynamic=True, cache_dir=tmp_path)
    first(torch.randint(0, 64, (2, 10))).sum().backward()
    second = ORTModule(copy.deepcopy(eager), dynamic=True, cache_dir=tmp_path)
    _step_and_compare(second, eager, torch.randint(0, 64, (2, 10)))
    _step_and_compare(second, eager, torch.randint(0, 64, (3, 7)))
    assert second.statistics.disk_cache_loads == 2 and second.statistics.onnx_exports == 0


@pytest.mark.parametrize("value", ["yes", 1])
def test_dynamic_must_be_a_bool_or_none(value: object) -> None:
    with pytest.raises(TypeError, match=r"dynamic=.* must be True, False or None"):
        ORTModule(MLP(), dynamic=value)  # type: ignore[arg-type]


def test_symbolic_graph_that_cannot_be_exported_gets_one_graph_per_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_export = build_module.export_graph

    def no_symbolic_export(
        gm: torch.fx.GraphModule, example_inputs: Any, name: str, verbose: bool, views_from: int | None = None
    ) -> Any:
        if any(
            isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in v.shape) for v in example_inputs
        ):
            raise ExportError("simulated: this graph cannot be exported with symbolic sizes")
        return real_export(gm, example_inputs, name, verbose, views_from)

    monkeypatch.setattr(build_module, "export_graph", no_symbolic_export)
    torch.manual_seed(0)
    eager = MLP()
    wrapped = ORTModule(copy.deepcopy(eager))
    g = torch.Generator().manual_seed(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        for batch in (8, 5, 3, 5):
            _step_and_compare(wrapped, eager, torch.randn(batch, 16, generator=g))
    stats = wrapped.statistics
    assert stats.eager_signatures == 0 and stats.forward_runs == 4 and stats.backward_runs == 4
    assert stats.onnx_exports == 6  # the first shape's two graphs, then two for each of the two other shapes


def test_symbolic_attention_gradient_keeps_the_stacked_rewrite(tmp_path: Path) -> None:
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    wrapped = ORTModule(layer, DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path), dynamic=True)
    wrapped(torch.randn(2, 7, 32)).sum().backward()
    backward = onnx.load(str(tmp_path / "m_training_backward.onnx"))
    ops = {node.op_type for node in backward.graph.node}
    assert "ScatterElements" not in ops, "q, k, v gradients must be stacked, not scattered into zeros"
    assert any(d.dim_param for i in backward.graph.input for d in i.type.tensor_type.shape.dim)


def test_declared_axes_make_the_first_graph_serve_every_length() -> None:
    torch.manual_seed(0)
    eager = CausalLM()
    wrapped = ORTModule(copy.deepcopy(eager), dynamic_axes={"ids": [0, 1]})
    assert wrapped.dynamic_axes == {"ids": (0, 1)}
    g = torch.Generator().manual_seed(0)
    for batch, length in ((2, 16), (3, 9), (2, 12), (4, 5)):
        _step_and_compare(wrapped, eager, torch.randint(0, 64, (batch, length), generator=g))
    stats = wrapped.statistics
    assert stats.cache_misses == 1 and stats.cache_hits == 3, "one symbolic graph from the first call"


class Unflatten(nn.Module):
    """Flattens batch and sequence before a graph break and restores them after it: the second graph's backward
    gets only ``(b*s, 8)`` tensors, and must give back a ``(b, s, 8)`` gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[:2]
        flat = self.linear(x).reshape(-1, 8)
        torch._dynamo.graph_break()
        return self.out(flat.tanh()).view(b, s, 8)


def test_sizes_no_tensor_input_has_are_carried_by_an_empty_input(tmp_path: Path) -> None:
    torch.manual_seed(0)
    eager = Unflatten()
    options = DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path)
    wrapped = ORTModule(copy.deepcopy(eager), options, dynamic_axes={"x": [0, 1]})
    exports = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)  # the graph break
        for batch, length in ((2, 5), (3, 4), (4, 7), (5, 3)):
            _step_and_compare(wrapped, eager, torch.randn(batch, length, 6))
            exports.append(wrapped.statistics.onnx_exports)
    # The graph after the break takes b and s as Python ints: static at first, symbolic once they change.
    assert exports[2:] == [exports[1]] * 2, f"no build after the second call: {exports}"
    assert wrapped.statistics.fallback_ops == 0 and wrapped.statistics.eager_signatures == 0
    carriers = [
        path.name
        for path in tmp_path.glob("m_training_backward*.onnx")
        if "optimized" not in path.name and "carried_sizes" in {i.name for i in onnx.load(str(path)).graph.input}
    ]
    assert carriers, "the symbolic backward after the break reads b and s from the empty carrier input"


def test_dynamic_axes_are_checked_against_forward() -> None:
    with pytest.raises(ValueError, match=r"\['tokens'\] are not parameters of CausalLM.forward; its parameters are"):
        ORTModule(CausalLM(), dynamic_axes={"tokens": [0]})
    with pytest.raises(ValueError, match="axes must be integers"):
        ORTModule(CausalLM(), dynamic_axes={"ids": ["batch"]})
    with pytest.raises(ValueError, match="dynamic=False builds one graph per shape"):
        ORTModule(CausalLM(), dynamic=False, dynamic_axes={"ids": [0]})
