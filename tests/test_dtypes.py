"""Models whose parameters are ``bfloat16``, ``float16`` or ``float64`` (``model.to(dtype)``, not autocast) train
through ORTModule as they do in eager PyTorch.

Half-precision models: every op runs in ONNX Runtime, each output and gradient keeps its parameter's dtype, and
the gradients are as close to a float64 copy's as eager's own (the CPU graphs compute in float32 between casts).
Float64 models: the gradients match eager float64's to float64 precision; no constant or statistic may pass
through float32 on the way.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from lightning_ort import FallbackWarning, ORTModule
from lightning_ort.engine.onnx import export
from lightning_ort.errors import SessionError
from tests.helpers import float64_drift, leaf_tensors, weighted_loss


class Block(nn.Module):
    """Biased projections, a layer norm, scaled-dot-product attention and a GELU: the ops whose dtypes the export
    has to keep (bias gradients are sums, attention has an inexact scale, layer norm saves statistics)."""

    def __init__(self, width: int = 32, heads: int = 4, activation: Callable[[], nn.Module] = nn.GELU) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.ff = nn.Sequential(nn.Linear(width, 2 * width), activation(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.ff(x)


def _gradients(model: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    output = model(x)
    weighted_loss(output).backward()
    return [t.detach() for t in leaf_tensors(output)], [p.grad for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_trains_in_onnx_runtime_as_eager(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    reference = Block().double()
    eager = copy.deepcopy(reference).to(dtype)
    wrapped = ORTModule(copy.deepcopy(reference).to(dtype))
    x = torch.randn(4, 10, 32, dtype=torch.float64)

    exact_outputs, exact_grads = _gradients(reference, x)
    eager_outputs, eager_grads = _gradients(eager, x.to(dtype))
    ort_outputs, ort_grads = _gradients(wrapped, x.to(dtype))

    assert [t.dtype for t in ort_outputs] == [t.dtype for t in eager_outputs] == [dtype]
    assert all(g is not None and g.dtype == dtype and g.shape == p.shape for g, p in zip(ort_grads, eager.parameters()))
    names = ["output", *(name for name, _ in eager.named_parameters())]
    drift = float64_drift(
        names, [*ort_outputs, *ort_grads], [*eager_outputs, *eager_grads], [*exact_outputs, *exact_grads]
    )
    assert not drift, drift
    stats = wrapped.statistics
    assert (stats.forward_runs, stats.backward_runs, stats.fallback_ops) == (1, 1, 0)


def test_float64_model_keeps_float64_precision() -> None:
    torch.manual_seed(0)
    eager = Block(activation=nn.ReLU).double()  # ONNX Runtime has no float64 Erf kernel: GELU would run in PyTorch
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(4, 10, 32, dtype=torch.float64)

    eager_outputs, eager_grads = _gradients(eager, x)
    ort_outputs, ort_grads = _gradients(wrapped, x)

    torch.testing.assert_close(ort_outputs, eager_outputs, rtol=1e-12, atol=1e-12)
    for (name, _), actual, expected in zip(eager.named_parameters(), ort_grads, eager_grads):
        # float32 anywhere on the way (attention's scale, the layer norm's saved statistics) is 1e-8 off
        torch.testing.assert_close(actual, expected, rtol=1e-11, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    stats = wrapped.statistics
    assert (stats.forward_runs, stats.backward_runs, stats.fallback_ops) == (1, 1, 0)


def test_an_output_of_another_type_than_pytorch_gives_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the casts to PyTorch's types, a ``bfloat16`` model's bias gradients leave the exported graph as
    float32: ONNX Runtime's memory must then be refused, not read as ``bfloat16`` values."""
    monkeypatch.setattr(export, "cast_outputs_to", lambda model, element_types: 0)
    wrapped = ORTModule(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(torch.bfloat16))
    output = wrapped(torch.randn(8, 16, dtype=torch.bfloat16))
    with pytest.raises(SessionError, match=r"returned a torch.float32 tensor as output \d+, where PyTorch's graph"):
        output.float().sum().backward()


def test_float16_autocast_on_cpu_with_an_op_left_to_pytorch() -> None:
    """ONNX Runtime's CPU provider has no float16 layer norm, so under CPU float16 autocast it runs in PyTorch,
    whose kernel returns float32 statistics where the traced graph says float16: the backward graph, exported
    from the trace, must still get float16."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 2))
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.float16), pytest.warns(FallbackWarning, match="native_layer_norm"):
        expected, actual = eager(x), wrapped(x)
    assert actual.dtype == expected.dtype == torch.float16
    expected.float().pow(2).sum().backward()
    actual.float().pow(2).sum().backward()
    for (name, e), a in zip(eager.named_parameters(), wrapped.parameters(), strict=True):
        torch.testing.assert_close(a.grad, e.grad, rtol=2e-2, atol=2e-3, msg=lambda m, n=name: f"{n}: {m}")
    stats = wrapped.statistics
    assert (stats.forward_runs, stats.backward_runs, stats.fallback_ops) == (1, 1, 1)
