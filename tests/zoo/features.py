"""Models exercising ORTModule's contract, each with a deterministic input factory (see :mod:`tests.zoo`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
        )
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


class ChannelsLastCNN(nn.Module):
    """Conv/BatchNorm/ReLU and a pooled, flattened head in channels-last memory format, as PyTorch's CPU
    performance guide advises for convolutional nets."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, 10),
        )
        self.to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class UpsamplingDecoder(nn.Module):
    """A U-Net step: a strided encoder convolution, a transposed convolution back up (one with
    ``output_padding``, one grouped), GroupNorm and SiLU, and the skip concatenated."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.GroupNorm(4, 8), nn.SiLU())
        self.up = nn.ConvTranspose2d(8, 8, 3, stride=2, padding=1, output_padding=1)
        self.grouped = nn.ConvTranspose2d(8, 4, 2, stride=2, groups=2, bias=False)
        self.out = nn.Conv2d(11, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(x)
        return self.out(torch.cat([self.up(h), x], dim=1)) + self.grouped(h).mean(dim=1, keepdim=True)


class PoolingHeads(nn.Module):
    """Pooling and padding whose gradients ONNX cannot express directly: AlexNet's local response norm, VGG's
    adaptive pool to a grid, adaptive max pooling, Inception's average pool that does not count padding,
    ResNet-D's ceil-mode average pool, and reflection and replication padding between convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.LocalResponseNorm(3))
        self.pad = nn.Sequential(nn.ReflectionPad2d((1, 2, 2, 1)), nn.Conv2d(8, 8, 3), nn.ReplicationPad2d(1))
        self.inception = nn.AvgPool2d(3, 1, 1, count_include_pad=False)
        self.downsample = nn.AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False)
        # ONNX expresses adaptive max pooling only over windows of one size: 6x4 images to 1x2.
        self.grid, self.peak = nn.AdaptiveAvgPool2d((4, 3)), nn.AdaptiveMaxPool2d((1, 2))
        self.head = nn.Linear(8 * 14, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pad(torch.relu(self.conv(x)))
        h = self.downsample(self.inception(h))
        return self.head(torch.cat([self.grid(h).flatten(1), self.peak(h).flatten(1)], dim=1))


class VideoClip(nn.Module):
    """A 3-d convolutional net over short clips: Conv3d, BatchNorm3d, max, ceil-mode average and adaptive average
    3-d pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv3d(3, 8, 3, padding=1),
            nn.BatchNorm3d(8),
            nn.ReLU(),
            nn.MaxPool3d((1, 2, 2)),
            nn.Conv3d(8, 8, 3, padding=1),
            nn.AvgPool3d(2, ceil_mode=True, count_include_pad=False),
            nn.AdaptiveAvgPool3d((1, 2, 2)),
        )
        self.head = nn.Linear(8 * 4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class Vocoder(nn.Module):
    """A HiFi-GAN-style generator: weight-normalised 1-d convolutions, a transposed convolution upsampling the
    frames, and a dilated residual block, with leaky ReLUs."""

    def __init__(self) -> None:
        super().__init__()
        weight_norm = nn.utils.parametrizations.weight_norm
        self.pre = weight_norm(nn.Conv1d(8, 16, 7, padding=3))
        self.up = weight_norm(nn.ConvTranspose1d(16, 8, 4, stride=2, padding=1))
        self.dilated = nn.ModuleList(weight_norm(nn.Conv1d(8, 8, 3, dilation=d, padding=d)) for d in (1, 3))
        self.post = weight_norm(nn.Conv1d(8, 1, 7, padding=3))

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = self.up(nn.functional.leaky_relu(self.pre(mel), 0.1))
        for conv in self.dilated:
            x = x + conv(nn.functional.leaky_relu(x, 0.1))
        return torch.tanh(self.post(nn.functional.leaky_relu(x, 0.1)))


class TransformerClassifier(nn.Module):
    """``nn.TransformerEncoder`` stack with embedding and head: the model onnxruntime-training failed on."""

    def __init__(self, vocab: int = 50, width: int = 32) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, 3)

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.encoder(self.embedding(tokens), src_key_padding_mask=padding_mask)
        return self.head(hidden.mean(dim=1))


class CausalLM(nn.Module):
    """A small GPT: learned positions, causal self-attention via SDPA, GELU MLP, head tied to the embedding."""

    def __init__(self, vocab: int = 64, width: int = 32, heads: int = 4, layers: int = 2, context: int = 16) -> None:
        super().__init__()
        self.heads = heads
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.randn(context, width) * 0.02)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln1": nn.LayerNorm(width),
                    "qkv": nn.Linear(width, 3 * width),
                    "proj": nn.Linear(width, width),
                    "ln2": nn.LayerNorm(width),
                    "mlp": nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)),
                }
            )
            for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        batch, length = ids.shape
        x = self.tokens(ids) + self.positions[:length]
        for block in self.blocks:
            q, k, v = block["qkv"](block["ln1"](x)).chunk(3, dim=-1)
            q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
            attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + block["proj"](attended.transpose(1, 2).reshape(batch, length, -1))
            x = x + block["mlp"](block["ln2"](x))
        return self.lm_head(self.ln_f(x))


class MultiInput(nn.Module):
    """Positional, keyword, default, ``None``, scalar and bool arguments, nested containers."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(
        self,
        x: torch.Tensor,
        extras: dict[str, torch.Tensor],
        pair: list[torch.Tensor],
        bias: torch.Tensor | None = None,
        scale: float = 1.0,
        use_b: bool = True,
    ) -> torch.Tensor:
        out = self.a(x) * scale + extras["shift"] + pair[0] * pair[1]
        if use_b:
            out = self.b(out)
        if bias is not None:
            out = out + bias
        return out


class DictOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.cls = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        hidden = torch.relu(self.body(x))
        logits = self.cls(hidden)
        return {"logits": logits, "hidden": hidden, "pred": logits.argmax(-1), "positive": logits > 0, "k": 5}


class TupleOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        y = self.proj(x)
        return y.sin(), y.detach() * 2, (y > 0).sum(dim=-1), None


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 2)
        for parameter in self.backbone.parameters():
            parameter.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


class Shared(nn.Module):
    """One Linear applied three times, plus a parameter shared by two submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.step = nn.Linear(8, 8)
        self.left = nn.Linear(8, 4)
        self.right = nn.Linear(8, 4)
        self.right.weight = self.left.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = torch.tanh(self.step(x))
        return self.left(x) - 2 * self.right(x)


class Pair(NamedTuple):
    mean: torch.Tensor
    log_var: torch.Tensor


class NamedTupleOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> Pair:
        mean, log_var = self.enc(x).chunk(2, dim=-1)
        return Pair(mean, log_var)


@dataclass
class ModelOutput:
    """Shaped like Hugging Face's ``ModelOutput``: a dataclass with optional tensor fields."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


class DataclassOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 8)
        self.l2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> ModelOutput:
        h = torch.relu(self.l1(x))
        logits = self.l2(h)
        loss = nn.functional.cross_entropy(logits, labels)
        return ModelOutput(logits=logits, loss=loss, hidden_states=(h,))


class ScaledSquare(torch.autograd.Function):
    """A custom autograd Function whose backward deliberately differs from autograd's (3x instead of 2x)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * 3 * x


class CustomFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ScaledSquare.apply(self.lin(x)).sum(-1)


class ConvLayerNormGELU(nn.Module):
    """1-D convolutions, LayerNorm, GELU, residual and a softmax-weighted pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(4, 16, 5, padding=2)
        self.norm = nn.LayerNorm(16)
        self.conv2 = nn.Conv1d(16, 16, 3, padding=1, groups=4)
        self.score = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.conv1(x).transpose(1, 2)).transpose(1, 2)
        h = h + nn.functional.gelu(self.conv2(h))
        weights = torch.softmax(self.score(h.transpose(1, 2)), dim=1)
        return (h.transpose(1, 2) * weights).sum(1) / math.sqrt(16)


@dataclasses.dataclass
class Case:
    name: str
    make_model: Callable[[], nn.Module]
    make_inputs: Callable[[torch.Generator], Inputs]
    train: bool = True


def _randn(g: torch.Generator, *shape: int, grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, generator=g).requires_grad_(grad)


CASES = [
    Case("mlp", MLP, lambda g: ((_randn(g, 6, 16, grad=True),), {})),
    Case("cnn_batchnorm_train", ConvBN, lambda g: ((_randn(g, 4, 3, 8, 8, grad=True),), {})),
    Case("cnn_batchnorm_eval", ConvBN, lambda g: ((_randn(g, 4, 3, 8, 8, grad=True),), {}), train=False),
    Case(
        "cnn_channels_last",
        ChannelsLastCNN,
        lambda g: ((_randn(g, 4, 3, 8, 8).contiguous(memory_format=torch.channels_last).requires_grad_(),), {}),
    ),
    Case(
        "transformer_encoder",
        TransformerClassifier,
        lambda g: (
            (torch.randint(0, 50, (3, 10), generator=g),),
            {"padding_mask": torch.arange(10).expand(3, 10) >= torch.tensor([[10], [7], [4]])},
        ),
    ),
    Case("pooling_heads", PoolingHeads, lambda g: ((_randn(g, 2, 3, 9, 5, grad=True),), {})),
    Case("video_clip", VideoClip, lambda g: ((_randn(g, 2, 3, 5, 8, 7, grad=True),), {})),
    Case("conv_transpose_decoder", UpsamplingDecoder, lambda g: ((_randn(g, 2, 3, 8, 8, grad=True),), {})),
    Case("vocoder_weight_norm", Vocoder, lambda g: ((_randn(g, 2, 8, 12, grad=True),), {})),
    Case("causal_lm", CausalLM, lambda g: ((torch.randint(0, 64, (2, 16), generator=g),), {})),
    Case(
        "multi_input_kwargs",
        MultiInput,
        lambda g: (
            (_randn(g, 4, 8, grad=True), {"shift": _randn(g, 4, 8, grad=True)}, [_randn(g, 4, 8), _randn(g, 8)]),
            {"bias": _randn(g, 8, grad=True), "scale": 0.5},
        ),
    ),
    Case("dict_output", DictOutput, lambda g: ((_randn(g, 5, 8, grad=True),), {})),
    Case("tuple_output_noncontiguous_input", TupleOutput, lambda g: ((_randn(g, 8, 5).t().requires_grad_(),), {})),
    Case("frozen_backbone", Frozen, lambda g: ((_randn(g, 5, 8, grad=True),), {})),
    Case("shared_parameters", Shared, lambda g: ((_randn(g, 5, 8, grad=True),), {})),
    Case("namedtuple_output", NamedTupleOutput, lambda g: ((_randn(g, 5, 8, grad=True),), {})),
    Case(
        "dataclass_output",
        DataclassOutput,
        lambda g: ((_randn(g, 6, 8, grad=True), torch.randint(0, 3, (6,), generator=g)), {}),
    ),
    Case("custom_autograd_function", CustomFunction, lambda g: ((_randn(g, 5, 8, grad=True),), {})),
    Case("conv1d_layernorm_gelu", ConvLayerNormGELU, lambda g: ((_randn(g, 3, 4, 12, grad=True),), {})),
]
