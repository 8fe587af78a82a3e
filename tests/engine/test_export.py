"""The export: lifted random inputs (``Noise``, exact keep probabilities, reproducible with
``torch.manual_seed``), the translation table shared by every graph, and the exporter's decomposition pass
run only for graphs with ops it decomposes."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.onnx._internal.exporter._registration import ONNXRegistry

from lightning_ort import ORTModule
from lightning_ort.engine.fx.decompositions import capture_decompositions
from lightning_ort.engine.fx.noise import Noise
from lightning_ort.engine.onnx.export import export_graph, onnx_registry

CPU = torch.device("cpu")


@pytest.mark.parametrize("compare", ["gt", "ge", "lt", "le"])
@pytest.mark.parametrize("threshold", [0.1, 0.5, 0.25 + 2**-17, 3 * 2**-16, 0.0, 1.0, -0.5, 1.5])
def test_integer_threshold_compares_like_the_uniform_sample(compare: str, threshold: float) -> None:
    # Every 16-bit pattern: bits <compare> limit must equal u <compare> threshold for u = (bits + 2**15) / 2**16.
    noise = Noise("threshold", (2**16,), torch.bool, compare, threshold)
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32)
    uniform = (bits.double() + 2**15) / 2**16
    expected = getattr(torch, compare)(uniform, threshold)
    limit = noise._integer_threshold()
    assert torch.equal(getattr(torch, compare)(bits, limit), expected)


@pytest.mark.parametrize(("threshold", "kept"), [(-0.5, 1.0), (1.5, 0.0), (0.0, 1.0 - 2**-16)])
def test_thresholds_at_and_beyond_the_ends(threshold: float, kept: float) -> None:
    mask = Noise("threshold", (4096,), torch.uint8, "gt", threshold).draw(CPU)
    assert mask.dtype == torch.uint8
    assert set(mask.unique().tolist()) <= {0, 1}
    if kept in (0.0, 1.0):
        assert torch.equal(mask, torch.full_like(mask, int(kept)))


def test_keep_mask_has_the_asked_probability() -> None:
    p = 0.1
    mask = Noise("threshold", (1 << 22,), torch.uint8, "gt", p).draw(CPU)
    assert mask.unique().tolist() == [0, 1]
    kept = float((mask != 0).double().mean())
    assert abs(kept - (1 - p)) < 5 * (p * (1 - p) / mask.numel()) ** 0.5  # five standard deviations
    halves = (mask != 0).view(2, -1).double().mean(dim=1)
    assert abs(float(halves[0] - halves[1])) < 0.002  # no stuck or repeating block


def test_draws_follow_torch_manual_seed() -> None:
    noise = Noise("threshold", (3, 1000), torch.bool, "gt", 0.5)
    torch.manual_seed(3)
    first, second = noise.draw(CPU), noise.draw(CPU)
    torch.manual_seed(3)
    assert torch.equal(noise.draw(CPU), first)
    assert torch.equal(noise.draw(CPU), second)
    assert not torch.equal(first, second)


def test_graphs_on_cuda_get_their_noise_inputs_on_cuda() -> None:
    # Fake CUDA tensors need no GPU. The lifted dropout input used to be a CPU tensor, so torch.export failed on
    # every CUDA graph with dropout ("found two different devices cuda:0, cpu") and ORTModule ran it eagerly.
    with FakeTensorMode():
        x, w = torch.empty(8, 16, device="cuda"), torch.empty(16, 4, device="cuda")

    def dropout_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x @ w, 0.1, training=True).relu()

    gm = make_fx(dropout_product, decomposition_table=capture_decompositions("cuda"))(x, w)
    graph = export_graph(gm, [x, w], "forward", verbose=False)
    assert [noise.kind for noise in graph.noise] == ["threshold"]
    assert len(graph.model.graph.input) == 3


def test_the_translation_table_is_built_once_for_every_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    builds: list[int] = []
    build = ONNXRegistry.from_torchlib

    def counted(**kwargs: object) -> ONNXRegistry:
        builds.append(1)
        return build(**kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ONNXRegistry, "from_torchlib", staticmethod(counted))
    onnx_registry.cache_clear()
    model = ORTModule(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2)))
    model(torch.randn(3, 4)).sum().backward()
    with torch.no_grad():
        model(torch.randn(3, 4))
    assert model.statistics.onnx_exports == 3, "forward, backward and inference graphs"
    assert model.statistics.forward_runs == 2 and model.statistics.backward_runs == 1
    assert len(builds) == 1


class _SqueezeDims(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.squeeze(self.linear(x), dim=(1,))  # aten.squeeze.dims: the exporter decomposes it


@pytest.mark.parametrize(
    ("model", "shape", "decomposed"),
    [
        (torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2)), (3, 4), False),
        (_SqueezeDims(), (3, 1, 4), True),
    ],
    ids=["translated-ops-only", "an-op-to-decompose"],
)
def test_the_decomposition_pass_runs_only_for_graphs_that_need_it(
    model: torch.nn.Module, shape: tuple[int, ...], decomposed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[int] = []
    decompose = torch.export.ExportedProgram.run_decompositions

    def counted(self: torch.export.ExportedProgram, *args: object, **kwargs: object) -> object:
        runs.append(1)
        return decompose(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", counted)
    x = torch.randn(*shape, requires_grad=True)
    wrapped = ORTModule(model)
    out = wrapped(x)
    out.sum().backward()
    expected_x = x.detach().clone().requires_grad_()
    expected = model(expected_x)
    expected.sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, expected_x.grad, rtol=1e-5, atol=1e-6)
    assert wrapped.statistics.fallback_ops == 0
    assert wrapped.statistics.forward_runs == wrapped.statistics.backward_runs == 1
    assert bool(runs) == decomposed, runs
