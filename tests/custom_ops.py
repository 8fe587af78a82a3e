"""A custom op with no ONNX translation (as user extensions and third-party kernels are), for fallback tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


@torch.library.custom_op("lightning_ort_tests::softsign", mutates_args=())
def softsign(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + x.abs())


@softsign.register_fake
def _softsign_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _softsign_setup(ctx: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0])


def _softsign_backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    return grad / (1 + x.abs()) ** 2


softsign.register_autograd(_softsign_backward, setup_context=_softsign_setup)


class Softsign(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softsign(x)


class CustomOpMLP(nn.Module):
    """Linear -> custom op -> Linear: the custom op must run in PyTorch, the Linears in ONNX Runtime."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.act = Softsign()
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.inp(x)))


class DataDependentBranch(nn.Module):
    """Chooses a path from a tensor's value: one ONNX graph cannot represent it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if h.mean() > 0:
            return torch.tanh(h) * 2
        return h - 1
