"""Vision networks for the benchmark, in plain ``torch.nn`` (no torchvision): the convolution shapes of real nets.

* :class:`ResNet18`: ResNet-18 (a 7x7 stride-2 stem, max pooling, four stages of two basic blocks, 64 to 512
  channels), whose cost is dense 3x3 convolutions;
* :class:`MobileNetV2`: MobileNetV2 (inverted residual blocks: a 1x1 expansion, a 3x3 depthwise convolution and
  a 1x1 projection, with ReLU6), whose cost is depthwise and pointwise convolutions;
* :class:`ConvNeXt`: ConvNeXt blocks (a 7x7 depthwise convolution, LayerNorm over channels, a pointwise MLP
  with GELU and a layer scale), at a reduced width and depth;
* :class:`EfficientNetB0`: EfficientNet-B0 (MBConv blocks, :class:`InvertedResidual` with 3x3 or 5x5 depthwise
  convolutions, squeeze-and-excitation and SiLU), whose cost is depthwise convolutions and SiLU's passes;
* :class:`UNet`: a diffusion model's U-Net (residual blocks of GroupNorm, SiLU and 3x3 convolutions, strided
  convolutions down, transposed convolutions up, skips concatenated), at a reduced width.

Each follows the published architecture; the bench's workloads (:mod:`lightning_ort.bench.workloads`) train them
on small images, sized for a CPU step.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 conv/BatchNorm layers and a skip (a 1x1 projection when the shape changes).

    Example:
        >>> BasicBlock(8, 16, stride=2)(torch.randn(2, 8, 8, 8)).shape
        torch.Size([2, 16, 4, 4])
    """

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.skip = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False), nn.BatchNorm2d(channels_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


class ResNet18(nn.Module):
    """ResNet-18 with ``classes`` outputs.

    Example:
        >>> ResNet18(classes=10)(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        stages: list[nn.Module] = []
        channels = 64
        for width, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            stages += [BasicBlock(channels, width, stride), BasicBlock(width, width, 1)]
            channels = width
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(512, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(images)).mean((2, 3)))


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expansion by ``expand``, ``kernel`` x ``kernel`` depthwise convolution, 1x1
    projection, ``activation`` (ReLU6); a skip when the shape is kept. EfficientNet's MBConv is this block with
    SiLU and a squeeze-and-excitation to ``squeezed`` channels after the depthwise convolution.

    Example:
        >>> InvertedResidual(16, 16, stride=1, expand=6)(torch.randn(2, 16, 8, 8)).shape
        torch.Size([2, 16, 8, 8])
        >>> InvertedResidual(16, 16, 1, 6, kernel=5, activation=nn.SiLU, squeezed=4)(torch.randn(2, 16, 8, 8)).shape
        torch.Size([2, 16, 8, 8])
    """

    def __init__(
        self,
        channels_in: int,
        channels_out: int,
        stride: int,
        expand: int,
        kernel: int = 3,
        activation: type[nn.Module] = nn.ReLU6,
        squeezed: int = 0,
    ) -> None:
        super().__init__()
        hidden = channels_in * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [nn.Conv2d(channels_in, hidden, 1, bias=False), nn.BatchNorm2d(hidden), activation()]
        layers += [
            nn.Conv2d(hidden, hidden, kernel, stride, kernel // 2, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            activation(),
        ]
        if squeezed:
            layers.append(SqueezeExcitation(hidden, squeezed))
        layers += [
            nn.Conv2d(hidden, channels_out, 1, bias=False),
            nn.BatchNorm2d(channels_out),
        ]
        self.layers = nn.Sequential(*layers)
        self.residual = stride == 1 and channels_in == channels_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layers(x)
        return x + y if self.residual else y


class MobileNetV2(nn.Module):
    """MobileNetV2 (width 1.0) with ``classes`` outputs.

    Example:
        >>> MobileNetV2(classes=10)(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    # (expansion, channels, blocks, first block's stride), as published.
    SETTINGS = (
        (1, 16, 1, 1),
        (6, 24, 2, 2),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    )

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU6()]
        channels = 32
        for expand, width, blocks, stride in self.SETTINGS:
            for index in range(blocks):
                layers.append(InvertedResidual(channels, width, stride if index == 0 else 1, expand))
                channels = width
        layers += [nn.Conv2d(channels, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.ReLU6()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(1280, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).mean((2, 3)))


class ConvNeXtBlock(nn.Module):
    """ConvNeXt's block: 7x7 depthwise convolution, LayerNorm over channels, Linear to 4x, GELU, Linear back,
    a learned per-channel scale, and the skip.

    Example:
        >>> ConvNeXtBlock(16)(torch.randn(2, 16, 8, 8)).shape
        torch.Size([2, 16, 8, 8])
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = nn.LayerNorm(channels, eps=1e-6)
        self.expand = nn.Linear(channels, 4 * channels)
        self.project = nn.Linear(4 * channels, channels)
        self.scale = nn.Parameter(torch.full((channels,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.depthwise(x).permute(0, 2, 3, 1)
        y = self.project(F.gelu(self.expand(self.norm(y)))) * self.scale
        return x + y.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    """ConvNeXt: a 4x4 stride-4 stem, four stages of :class:`ConvNeXtBlock` with downsampling between them.

    Example:
        >>> ConvNeXt(widths=(8, 16, 24, 32), depths=(1, 1, 1, 1), classes=10)(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self,
        widths: tuple[int, ...] = (96, 192, 384, 768),
        depths: tuple[int, ...] = (3, 3, 9, 3),
        classes: int = 1000,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, widths[0], 4, 4), ChannelNorm(widths[0])]
        for stage, (width, depth) in enumerate(zip(widths, depths)):
            if stage:
                layers += [ChannelNorm(widths[stage - 1]), nn.Conv2d(widths[stage - 1], width, 2, 2)]
            layers += [ConvNeXtBlock(width) for _ in range(depth)]
        self.features = nn.Sequential(*layers)
        self.norm = nn.LayerNorm(widths[-1], eps=1e-6)
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.features(images).mean((2, 3))))


class ChannelNorm(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor, as ConvNeXt's stem and downsampling layers use it."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class SqueezeExcitation(nn.Module):
    """Squeeze-and-excitation: the pooled channels through a SiLU bottleneck gate the activation.

    Example:
        >>> SqueezeExcitation(16, 4)(torch.randn(2, 16, 8, 8)).shape
        torch.Size([2, 16, 8, 8])
    """

    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, squeezed, 1)
        self.expand = nn.Conv2d(squeezed, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.expand(F.silu(self.reduce(x.mean((2, 3), keepdim=True))))
        return x * torch.sigmoid(gate)


class EfficientNetB0(nn.Module):
    """EfficientNet-B0 with ``classes`` outputs (no stochastic depth or dropout: the bench compares steps).

    Example:
        >>> EfficientNetB0(classes=10)(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    # (expansion, channels, blocks, first block's stride, kernel), as published.
    SETTINGS = (
        (1, 16, 1, 1, 3),
        (6, 24, 2, 2, 3),
        (6, 40, 2, 2, 5),
        (6, 80, 3, 2, 3),
        (6, 112, 3, 1, 5),
        (6, 192, 4, 2, 5),
        (6, 320, 1, 1, 3),
    )

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.SiLU()]
        channels = 32
        for expand, width, blocks, stride, kernel in self.SETTINGS:
            for index in range(blocks):
                block_stride = stride if index == 0 else 1
                squeezed = max(1, channels // 4)
                layers.append(InvertedResidual(channels, width, block_stride, expand, kernel, nn.SiLU, squeezed))
                channels = width
        layers += [nn.Conv2d(channels, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.SiLU()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(1280, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).mean((2, 3)))


class GroupNormBlock(nn.Module):
    """A diffusion U-Net's residual block: GroupNorm (8 groups) and SiLU before each 3x3 convolution, a 1x1
    projection on the skip when the width changes.

    Example:
        >>> GroupNormBlock(16, 32)(torch.randn(2, 16, 8, 8)).shape
        torch.Size([2, 32, 8, 8])
    """

    def __init__(self, channels_in: int, channels_out: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(8, channels_in), nn.Conv2d(channels_in, channels_out, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(8, channels_out), nn.Conv2d(channels_out, channels_out, 3, padding=1)
        self.skip = nn.Conv2d(channels_in, channels_out, 1) if channels_in != channels_out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        return self.conv2(F.silu(self.norm2(h))) + self.skip(x)


class UNet(nn.Module):
    """A diffusion model's U-Net at ``width`` channels: two levels down (strided 3x3 convolutions), a middle
    block, two up (2x2 transposed convolutions, the skip concatenated), each level a :class:`GroupNormBlock`.

    Example:
        >>> UNet(width=16)(torch.randn(2, 3, 16, 16)).shape
        torch.Size([2, 3, 16, 16])
    """

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        wide = 2 * width
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.down1, self.pool1 = GroupNormBlock(width, width), nn.Conv2d(width, width, 3, 2, 1)
        self.down2, self.pool2 = GroupNormBlock(width, wide), nn.Conv2d(wide, wide, 3, 2, 1)
        self.middle = GroupNormBlock(wide, wide)
        self.up2, self.block2 = nn.ConvTranspose2d(wide, wide, 2, 2), GroupNormBlock(2 * wide, wide)
        self.up1, self.block1 = nn.ConvTranspose2d(wide, width, 2, 2), GroupNormBlock(2 * width, width)
        self.out = nn.Conv2d(width, 3, 3, padding=1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        first = self.down1(self.stem(images))
        second = self.down2(self.pool1(first))
        h = self.middle(self.pool2(second))
        h = self.block2(torch.cat([self.up2(h), second], dim=1))
        h = self.block1(torch.cat([self.up1(h), first], dim=1))
        return self.out(h)
