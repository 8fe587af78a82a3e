"""Accuracy against float64 on convolutional and windowed-attention nets built as torchvision builds them.

ORT's outputs and parameter gradients must stay within 3x eager float32's distance from a float64 copy (plus
1e-4). Every net is checked over several seeds of its weights and inputs: a discrete choice that ONNX Runtime
made differently from PyTorch (a tie in a max pool, a ReLU exactly at zero, a ceil-mode border window) shows on
some weights only. The nets follow torchvision's SqueezeNet 1.1, RegNetY and DenseNet (squeeze-and-excitation,
grouped convolutions, dense concatenation, batch norm in training mode) and Swin's shifted-window attention,
written with plain ``torch.nn`` modules.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_ort import ORTModule
from tests.helpers import assert_fp64_accuracy

SEEDS = (0, 1, 2)


class Fire(nn.Module):
    """SqueezeNet's block: a 1x1 squeeze convolution, then 1x1 and 3x3 expand convolutions concatenated."""

    def __init__(self, channels: int, squeeze: int, expand1: int, expand3: int) -> None:
        super().__init__()
        self.squeeze, self.act = nn.Conv2d(channels, squeeze, 1), nn.ReLU(inplace=True)
        self.e1, self.a1 = nn.Conv2d(squeeze, expand1, 1), nn.ReLU(inplace=True)
        self.e3, self.a3 = nn.Conv2d(squeeze, expand3, 3, padding=1), nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.squeeze(x))
        return torch.cat([self.a1(self.e1(x)), self.a3(self.e3(x))], 1)


def squeezenet(num_classes: int = 10) -> nn.Module:
    """torchvision's ``squeezenet1_1`` layer for layer, with its initialisation."""
    features = nn.Sequential(
        nn.Conv2d(3, 64, 3, stride=2),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, ceil_mode=True),
        Fire(64, 16, 64, 64),
        Fire(128, 16, 64, 64),
        nn.MaxPool2d(3, 2, ceil_mode=True),
        Fire(128, 32, 128, 128),
        Fire(256, 32, 128, 128),
        nn.MaxPool2d(3, 2, ceil_mode=True),
        Fire(256, 48, 192, 192),
        Fire(384, 48, 192, 192),
        Fire(384, 64, 256, 256),
        Fire(512, 64, 256, 256),
    )
    final = nn.Conv2d(512, num_classes, 1)
    model = nn.Sequential(
        features, nn.Dropout(0.0), final, nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten()
    )
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            if module is final:
                nn.init.normal_(module.weight, std=0.01)
            else:
                nn.init.kaiming_uniform_(module.weight)
            nn.init.zeros_(module.bias)
    return model


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(channels, squeezed, 1), nn.Conv2d(squeezed, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.sigmoid(self.fc2(F.relu(self.fc1(F.adaptive_avg_pool2d(x, 1)))))
        return x * scale


def conv_bn(channels: int, out: int, kernel: int, stride: int = 1, groups: int = 1, relu: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(channels, out, kernel, stride, kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(out),
    ]
    return nn.Sequential(*layers, nn.ReLU(inplace=True)) if relu else nn.Sequential(*layers)


class YBlock(nn.Module):
    """RegNetY's residual block: 1x1, grouped 3x3 (stride), squeeze-and-excitation, 1x1; projected shortcut."""

    def __init__(self, channels: int, out: int, stride: int, group_width: int = 8) -> None:
        super().__init__()
        self.a = conv_bn(channels, out, 1)
        self.b = conv_bn(out, out, 3, stride, groups=out // group_width)
        self.se = SqueezeExcitation(out, max(1, channels // 4))
        self.c = conv_bn(out, out, 1, relu=False)
        self.proj = conv_bn(channels, out, 1, stride, relu=False) if stride != 1 or channels != out else None
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.proj is None else self.proj(x)
        return self.act(shortcut + self.c(self.se(self.b(self.a(x)))))


def regnet_y(num_classes: int = 10) -> nn.Module:
    """A RegNetY-style net (torchvision's ``regnet_y_400mf`` narrowed): stem, stages of Y blocks, head."""
    stages: list[nn.Module] = []
    channels = 16
    for width, depth in ((24, 1), (48, 2), (104, 2)):
        for index in range(depth):
            stages.append(YBlock(channels, width, 2 if index == 0 else 1))
            channels = width
    model = nn.Sequential(
        conv_bn(3, 16, 3, 2), *stages, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)
    )
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.normal_(module.weight, std=(2.0 / (module.kernel_size[0] ** 2 * module.out_channels)) ** 0.5)
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.01)
            nn.init.zeros_(module.bias)
    return model


class DenseLayer(nn.Module):
    """DenseNet's layer: BN-ReLU-1x1 bottleneck, BN-ReLU-3x3; its output is concatenated to its input."""

    def __init__(self, channels: int, growth: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.BatchNorm2d(channels), nn.Conv2d(channels, 4 * growth, 1, bias=False)
        self.norm2, self.conv2 = nn.BatchNorm2d(4 * growth), nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        new = self.conv2(F.relu(self.norm2(self.conv1(F.relu(self.norm1(features))))))
        return torch.cat([features, new], 1)


def densenet(num_classes: int = 10, growth: int = 12) -> nn.Module:
    """A DenseNet-style net (torchvision's ``densenet121`` shortened): stem, dense blocks, transitions, head."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, 2 * growth, 7, 2, 3, bias=False),
        nn.BatchNorm2d(2 * growth),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    channels = 2 * growth
    for block, depth in enumerate((3, 4)):
        for _ in range(depth):
            layers.append(DenseLayer(channels, growth))
            channels += growth
        if block == 0:
            layers += [nn.BatchNorm2d(channels), nn.ReLU(inplace=True), nn.Conv2d(channels, channels // 2, 1)]
            layers.append(nn.AvgPool2d(2, 2))
            channels //= 2
    model = nn.Sequential(
        *layers, nn.BatchNorm2d(channels), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten()
    )
    model.append(nn.Linear(channels, num_classes))
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight)
        elif isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)
    return model


def shifted_window_attention(
    x: torch.Tensor, qkv: nn.Linear, proj: nn.Linear, bias: torch.Tensor, window: int, heads: int, shift: int
) -> torch.Tensor:
    """torchvision's ``shifted_window_attention``: pad, roll, attend within windows (masking across shifts)."""
    batch, height, width, channels = x.shape
    x = F.pad(x, (0, 0, 0, (window - width % window) % window, 0, (window - height % window) % window))
    _, pad_h, pad_w, _ = x.shape
    shift = 0 if window >= pad_h else shift
    if shift > 0:
        x = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
    windows = (pad_h // window) * (pad_w // window)
    x = x.view(batch, pad_h // window, window, pad_w // window, window, channels).permute(0, 1, 3, 2, 4, 5)
    x = x.reshape(batch * windows, window * window, channels)
    q, k, v = qkv(x).reshape(x.size(0), x.size(1), 3, heads, channels // heads).permute(2, 0, 3, 1, 4)
    attn = (q * (channels // heads) ** -0.5).matmul(k.transpose(-2, -1)) + bias
    if shift > 0:
        mask = x.new_zeros((pad_h, pad_w))
        slices = ((0, -window), (-window, -shift), (-shift, None))
        count = 0
        for rows in slices:
            for cols in slices:
                mask[rows[0] : rows[1], cols[0] : cols[1]] = count
                count += 1
        mask = mask.view(pad_h // window, window, pad_w // window, window).permute(0, 2, 1, 3)
        mask = mask.reshape(windows, window * window)
        mask = mask.unsqueeze(1) - mask.unsqueeze(2)
        mask = mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)
        attn = attn.view(x.size(0) // windows, windows, heads, x.size(1), x.size(1)) + mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, heads, x.size(1), x.size(1))
    x = F.softmax(attn, -1).matmul(v).transpose(1, 2).reshape(x.size(0), x.size(1), channels)
    x = proj(x).view(batch, pad_h // window, pad_w // window, window, window, channels)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(batch, pad_h, pad_w, channels)
    if shift > 0:
        x = torch.roll(x, shifts=(shift, shift), dims=(1, 2))
    return x[:, :height, :width, :].contiguous()


def stochastic_depth(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """torchvision's row-mode ``stochastic_depth``: drop whole samples of a residual branch."""
    if not training or p == 0.0:
        return x
    noise = torch.empty([x.shape[0]] + [1] * (x.ndim - 1), dtype=x.dtype, device=x.device).bernoulli_(1 - p)
    return x * noise.div_(1 - p)


class WindowAttention(nn.Module):
    def __init__(self, dim: int, heads: int, window: int, shift: int) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.heads, self.window, self.shift = heads, window, shift
        self.table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads) * 0.02)
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + window - 1
        self.register_buffer("index", (relative[:, :, 0] * (2 * window - 1) + relative[:, :, 1]).flatten())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.window * self.window
        bias = self.table[self.index].view(n, n, -1).permute(2, 0, 1).contiguous().unsqueeze(0)
        return shifted_window_attention(x, self.qkv, self.proj, bias, self.window, self.heads, self.shift)


class SwinBlock(nn.Module):
    def __init__(self, dim: int, heads: int, window: int, shift: int, drop_path: float) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), WindowAttention(dim, heads, window, shift)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop_path = drop_path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + stochastic_depth(self.attn(self.norm1(x)), self.drop_path, self.training)
        return x + stochastic_depth(self.mlp(self.norm2(x)), self.drop_path, self.training)


class Swin(nn.Module):
    """A Swin-style classifier: patch embedding, a regular and a shifted window block, mean pooling, head."""

    def __init__(self, drop_path: float = 0.0, num_classes: int = 10) -> None:
        super().__init__()
        self.embed, self.norm = nn.Conv2d(3, 32, 4, 4), nn.LayerNorm(32)
        self.blocks = nn.Sequential(SwinBlock(32, 2, 4, 0, drop_path), SwinBlock(32, 2, 4, 2, drop_path))
        self.head = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.embed(x).permute(0, 2, 3, 1))
        return self.head(self.blocks(x).mean((1, 2)))


NETS: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "squeezenet": (squeezenet, 0),
    "regnet_y": (regnet_y, 0),
    "densenet": (densenet, 2),
    "swin": (Swin, 0),
}
"""Each net and the eager runs on perturbed inputs its float64 check takes (:func:`assert_fp64_accuracy`).

DenseNet's parameter gradients move in eager PyTorch itself when its input moves by a few float32 ulps: some of
its many ReLU inputs after batch norm lie that close to zero, and each one that changes side changes a batch-norm
weight's gradient. Any computation that rounds otherwise than PyTorch's does the same, so its check measures
eager's own spread (the coverage page, "Accuracy against float64", has the figures).
"""


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", list(NETS))
def test_gradients_stay_as_close_to_float64_as_eager(name: str, seed: int) -> None:
    build, perturbations = NETS[name]
    torch.manual_seed(seed)
    eager = build()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(100 + seed))
    assert_fp64_accuracy(eager, wrapped, x, perturbations=perturbations)
    assert wrapped.statistics.forward_runs == 1 and wrapped.statistics.backward_runs == 1
    assert wrapped.statistics.fallback_ops == 0 and wrapped.statistics.eager_signatures == 0


def test_swin_with_stochastic_depth_trains_in_onnx_runtime() -> None:
    torch.manual_seed(0)
    model = ORTModule(Swin(drop_path=0.2), blocks="auto")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, labels = torch.randn(4, 3, 32, 32), torch.tensor([1, 2, 3, 4])
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    stats = model.statistics
    assert stats.eager_signatures == 0 and stats.fallback_ops == 0
    assert stats.forward_runs >= 3 and stats.backward_runs >= 3
    assert all(torch.isfinite(torch.tensor(losses)))
