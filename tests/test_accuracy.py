"""Accuracy against float64: ORT's errors stay within a small multiple of eager float32's on deep conv nets."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_ort import ORTModule
from tests.helpers import assert_fp64_accuracy


class Fire(nn.Module):
    """SqueezeNet's block: a 1x1 squeeze convolution, then 1x1 and 3x3 expand convolutions concatenated."""

    def __init__(self, channels: int, squeeze: int, expand: int) -> None:
        super().__init__()
        self.squeeze = nn.Conv2d(channels, squeeze, 1)
        self.expand1 = nn.Conv2d(squeeze, expand, 1)
        self.expand3 = nn.Conv2d(squeeze, expand, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.squeeze(x))
        return torch.cat([torch.relu(self.expand1(x)), torch.relu(self.expand3(x))], 1)


def squeezenet_features() -> nn.Module:
    """SqueezeNet 1.1's first layers: a stride-2 convolution, ceil-mode max pools and four Fire blocks."""
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, stride=2),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, ceil_mode=True),
        Fire(64, 16, 64),
        Fire(128, 16, 64),
        nn.MaxPool2d(3, 2, ceil_mode=True),
        Fire(128, 32, 128),
        Fire(256, 32, 128),
        nn.MaxPool2d(3, 2, ceil_mode=True),
    )


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, channels // 4, 1)
        self.expand = nn.Conv2d(channels // 4, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.sigmoid(self.expand(torch.relu(self.reduce(x.mean((2, 3), keepdim=True)))))
        return x * scale


def grouped_se_net() -> nn.Module:
    """Grouped convolutions with batch norm and squeeze-and-excitation blocks (a RegNet/ResNeXt-style stage)."""
    layers: list[nn.Module] = [nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU()]
    for channels in (32, 64):
        layers += [
            nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1, groups=8),
            nn.BatchNorm2d(2 * channels),
            nn.ReLU(),
            SqueezeExcite(2 * channels),
        ]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))


def _kaiming(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    return model


@pytest.mark.parametrize("build", [squeezenet_features, grouped_se_net], ids=["squeezenet", "grouped_se"])
def test_conv_stack_gradients_stay_as_close_to_float64_as_eager(build: object) -> None:
    torch.manual_seed(0)
    eager = _kaiming(build())  # type: ignore[operator]
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(4, 3, 64, 64)
    assert_fp64_accuracy(eager, wrapped, x)
    assert wrapped.statistics.forward_runs == 1 and wrapped.statistics.backward_runs == 1
