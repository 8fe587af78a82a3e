"""Outputs, input gradients and parameter gradients of ORTModule match eager PyTorch on a model zoo."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_ort import ORTModule
from tests.helpers import (
    GRAD_TOLERANCE,
    assert_grads_close,
    assert_outputs_close,
    clone_inputs,
    leaf_tensors,
    weighted_loss,
)
from tests.zoo import CASES, Case, CausalLM


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_forward_and_backward_match_eager(case: Case) -> None:
    torch.manual_seed(0)
    eager = case.make_model().train(case.train)
    wrapped = ORTModule(copy.deepcopy(eager)).train(case.train)
    args, kwargs = case.make_inputs(torch.Generator().manual_seed(1))
    eager_args, eager_kwargs = clone_inputs((args, kwargs))
    ort_args, ort_kwargs = clone_inputs((args, kwargs))

    expected = eager(*eager_args, **eager_kwargs)
    actual = wrapped(*ort_args, **ort_kwargs)
    assert_outputs_close(actual, expected)

    weighted_loss(expected).backward()
    weighted_loss(actual).backward()
    for a, e in zip(leaf_tensors((ort_args, ort_kwargs)), leaf_tensors((eager_args, eager_kwargs))):
        if e.requires_grad:
            torch.testing.assert_close(a.grad, e.grad, **GRAD_TOLERANCE)
    assert_grads_close(wrapped, eager)
    for (name, a), (_, e) in zip(wrapped.named_buffers(), eager.named_buffers()):
        torch.testing.assert_close(a, e, **GRAD_TOLERANCE, msg=lambda m, n=name: f"buffer {n}: {m}")

    stats = wrapped.statistics
    assert (stats.forward_runs, stats.backward_runs) == (1, 1), "both passes must run in ONNX Runtime"
    assert stats.fallback_ops == 0, "no op may fall back to PyTorch"
    assert stats.cache_misses == 1


def test_training_loss_curve_tracks_eager_for_20_steps() -> None:
    torch.manual_seed(0)
    eager = CausalLM()
    wrapped = ORTModule(copy.deepcopy(eager))
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=3e-3)
    ort_opt = torch.optim.AdamW(wrapped.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(7)
    eager_losses, ort_losses = [], []
    for _ in range(20):
        ids = torch.randint(0, 64, (4, 16), generator=g)
        for model, opt, losses in ((eager, eager_opt, eager_losses), (wrapped, ort_opt, ort_losses)):
            logits = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert eager_losses[-1] < eager_losses[0]
    for step, (a, e) in enumerate(zip(ort_losses, eager_losses)):
        assert abs(a - e) <= 1e-3, f"step {step}: ORT loss {a} vs eager {e}"
    stats = wrapped.statistics
    assert (stats.forward_runs, stats.backward_runs, stats.cache_misses) == (20, 20, 1)


class TwoHeads(torch.nn.Module):
    """Two ORTModules chained after a shared ORT backbone; one head reuses the backbone's parameters."""

    def __init__(self, wrap: bool) -> None:
        super().__init__()
        backbone = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh())
        head_a = torch.nn.Linear(16, 4)
        head_b = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
        self.shared = backbone[0]
        self.backbone = ORTModule(backbone) if wrap else backbone
        self.head_a = ORTModule(head_a) if wrap else head_a
        self.head_b = ORTModule(head_b) if wrap else head_b

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.backbone(x)
        again = self.backbone(x * 2)
        return self.head_a(features), self.head_b(features + again).sum(-1) + self.shared(x).sum(-1)


def test_several_ortmodules_chained_and_sharing_a_backbone() -> None:
    torch.manual_seed(0)
    eager = TwoHeads(wrap=False)
    wrapped = TwoHeads(wrap=True)
    wrapped.load_state_dict(eager.state_dict())
    assert list(wrapped.state_dict()) == list(eager.state_dict())
    x_e = torch.randn(5, 8, requires_grad=True)
    x_o = x_e.detach().clone().requires_grad_()
    expected, actual = eager(x_e), wrapped(x_o)
    assert_outputs_close(actual, expected)
    weighted_loss(expected).backward()
    weighted_loss(actual).backward()
    torch.testing.assert_close(x_o.grad, x_e.grad, **GRAD_TOLERANCE)
    assert_grads_close(wrapped, eager)
    for module in (wrapped.backbone, wrapped.head_a, wrapped.head_b):
        assert module.statistics.backward_runs >= 1
    assert wrapped.backbone.statistics.forward_runs == 2
    assert wrapped.backbone.statistics.cache_hits == 1
