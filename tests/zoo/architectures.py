"""The coverage zoo: one small model per architecture users train, written from ``torch.nn`` building blocks.

Every entry is a :class:`~tests.zoo.features.Case`; :mod:`tests.zoo.test_zoo` checks outputs and gradients
against eager PyTorch and records whether the model ran fully in ONNX Runtime, partly, or in PyTorch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.custom_ops import CustomOpMLP, DataDependentBranch
from tests.zoo.features import MLP, Case, CausalLM, ConvBN, CustomFunction, Inputs


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g).requires_grad_()


def _tokens(g: torch.Generator, vocab: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=g)


class ResNetBlock(nn.Module):
    """Two 3x3 conv/BatchNorm/ReLU with a strided 1x1 projection shortcut, then pooling and a head."""

    def __init__(self, channels: int = 8, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.conv1 = nn.Conv2d(channels, width, 3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.shortcut = nn.Sequential(nn.Conv2d(channels, width, 1, stride=2, bias=False), nn.BatchNorm2d(width))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)) + self.shortcut(x))
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))


class DepthwiseSeparable(nn.Module):
    """MobileNet-style: depthwise 3x3 (groups=channels) then pointwise 1x1, BatchNorm and ReLU6."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.pointwise = nn.Conv2d(16, 32, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu6(self.stem(x))
        x = F.relu6(self.bn1(self.depthwise(x)))
        x = F.relu6(self.bn2(self.pointwise(x)))
        return self.head(x.mean(dim=(2, 3)))


class UNet(nn.Module):
    """Two-level encoder/decoder: max-pool down, bilinear upsampling, skip connections by concatenation."""

    def __init__(self) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())

        self.enc1, self.enc2, self.bottom = block(3, 8), block(8, 16), block(16, 32)
        self.up2 = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.dec2 = block(32 + 16, 16)
        self.up1 = nn.Upsample(scale_factor=2, mode="nearest")
        self.dec1 = block(16 + 8, 8)
        self.out = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        b = self.bottom(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([self.up2(b), e2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], dim=1))
        return self.out(d1)


class LSTMTagger(nn.Module):
    """Embedding, a 2-layer bidirectional LSTM, and a per-token head."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(40, 16)
        self.lstm = nn.LSTM(16, 24, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(48, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embedding(tokens))
        return self.head(hidden)


class LSTMForecaster(nn.Module):
    """A 2-layer LSTM over raw feature sequences (data, needing no gradient: PyTorch decomposes the first layer
    differently from the second), regressing the next value from the last step."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, series: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(series)
        return self.head(hidden[:, -1])


class GRUClassifier(nn.Module):
    """A GRU over feature sequences; the last hidden state is classified."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(12, 20, batch_first=True)
        self.head = nn.Linear(20, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, last = self.gru(x)
        return self.head(last[-1])


class EncoderClassifier(nn.Module):
    """``nn.TransformerEncoder`` with a padding mask; ``norm_first`` picks pre-norm or post-norm layers."""

    def __init__(self, norm_first: bool) -> None:
        super().__init__()
        self.embedding = nn.Embedding(50, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 3)

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.embedding(tokens), src_key_padding_mask=padding_mask)
        return self.head(hidden.mean(dim=1))


class CausalDecoder(nn.Module):
    """``nn.TransformerDecoder`` over a target sequence with a causal mask, attending to a memory sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(50, 32)
        layer = nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, 2)
        self.head = nn.Linear(32, 50)

    def forward(self, tokens: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        hidden = self.decoder(self.embedding(tokens), memory, tgt_mask=mask, tgt_is_causal=True)
        return self.head(hidden)


class Seq2Seq(nn.Module):
    """``nn.Transformer`` encoder-decoder with source padding and a causal target mask."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(60, 32)
        self.transformer = nn.Transformer(32, 4, 2, 2, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 60)

    def forward(self, source: torch.Tensor, target: torch.Tensor, source_padding: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(target.shape[1])
        hidden = self.transformer(
            self.embedding(source),
            self.embedding(target),
            tgt_mask=mask,
            src_key_padding_mask=source_padding,
            memory_key_padding_mask=source_padding,
        )
        return self.head(hidden)


class ViT(nn.Module):
    """Patch embedding by a strided convolution, class token, learned positions, encoder, head."""

    def __init__(self, image: int = 16, patch: int = 4, width: int = 32) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, width, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, width))
        self.positions = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, width) * 0.02)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patches(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.positions
        return self.head(self.norm(self.encoder(x))[:, 0])


class MixtureOfExperts(nn.Module):
    """Top-2 routing: router softmax, ``topk``, ``gather`` of the chosen weights, ``scatter`` into a dense gate."""

    def __init__(self, width: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 32), nn.GELU(), nn.Linear(32, width)) for _ in range(experts)
        )
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).softmax(dim=-1)
        _, chosen = probs.topk(2, dim=-1)
        weights = probs.gather(-1, chosen)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        gate = torch.zeros_like(probs).scatter(-1, chosen, weights)
        mixed = sum(gate[..., i : i + 1] * expert(x) for i, expert in enumerate(self.experts))
        return self.head(x + mixed)


class PaddedSDPA(nn.Module):
    """Multi-head attention written with ``F.scaled_dot_product_attention`` and a boolean key padding mask."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        out = self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return self.head((out * keep[..., None]).sum(1) / keep.sum(1, keepdim=True))


class SwiGLU(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class RMSNormSwiGLU(nn.Module):
    """LLaMA-style feed-forward blocks: ``nn.RMSNorm`` then SwiGLU, with residuals."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embedding = nn.Embedding(64, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.RMSNorm(width), SwiGLU(width, 64)) for _ in range(2))
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, 64, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


class RotaryAttention(nn.Module):
    """Causal self-attention with rotary position embeddings applied to queries and keys (cos/sin buffers)."""

    def __init__(self, width: int = 32, heads: int = 4, context: int = 16) -> None:
        super().__init__()
        self.heads = heads
        head_dim = width // heads
        inverse = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(context).float(), inverse)
        self.register_buffer("cos", angles.cos().repeat_interleave(2, dim=-1), persistent=False)
        self.register_buffer("sin", angles.sin().repeat_interleave(2, dim=-1), persistent=False)
        self.embedding = nn.Embedding(64, width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, 64)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-2]
        pairs = x.unflatten(-1, (-1, 2))
        rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
        return x * self.cos[:length] + rotated * self.sin[:length]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        batch, length = tokens.shape
        x = self.embedding(tokens)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        attended = F.scaled_dot_product_attention(self._rotate(q), self._rotate(k), v, is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(batch, length, -1) + x)


class BagOfWords(nn.Module):
    """``nn.EmbeddingBag`` (mean) over flattened token lists with offsets, then a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(100, 16, mode="mean")
        self.head = nn.Linear(16, 4)

    def forward(self, tokens: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.bag(tokens, offsets)))


class DictModel(nn.Module):
    """Takes a batch dict, returns a dict with tensors and a constant (the Lightning ``batch`` habit)."""

    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Linear(12, 16)
        self.text = nn.Embedding(30, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        fused = torch.relu(self.image(batch["features"]) + self.text(batch["tokens"]).mean(1))
        logits = self.head(fused)
        return {"logits": logits, "embedding": fused, "num_classes": 3}


def _encoder_inputs(g: torch.Generator) -> Inputs:
    lengths = torch.tensor([[12], [9], [5]])
    return (_tokens(g, 50, 3, 12), torch.arange(12).expand(3, 12) >= lengths), {}


def _seq2seq_inputs(g: torch.Generator) -> Inputs:
    padding = torch.arange(10).expand(2, 10) >= torch.tensor([[10], [6]])
    return (_tokens(g, 60, 2, 10), _tokens(g, 60, 2, 7), padding), {}


def _padded_sdpa_inputs(g: torch.Generator) -> Inputs:
    keep = torch.arange(8).expand(3, 8) < torch.tensor([[8], [5], [2]])
    return (_randn(g, 3, 8, 32), keep), {}


def _bag_inputs(g: torch.Generator) -> Inputs:
    return (_tokens(g, 100, 20), torch.tensor([0, 3, 9, 10, 16])), {}


def _dict_inputs(g: torch.Generator) -> Inputs:
    return ({"features": _randn(g, 4, 12), "tokens": _tokens(g, 30, 4, 6)},), {}


ARCHITECTURES = [
    Case("mlp", MLP, lambda g: ((_randn(g, 8, 16),), {})),
    Case("cnn_batchnorm", ConvBN, lambda g: ((_randn(g, 4, 3, 8, 8),), {})),
    Case("resnet_block", ResNetBlock, lambda g: ((_randn(g, 4, 3, 16, 16),), {})),
    Case("depthwise_separable_conv", DepthwiseSeparable, lambda g: ((_randn(g, 4, 3, 16, 16),), {})),
    Case("unet_upsample_concat", UNet, lambda g: ((_randn(g, 2, 3, 16, 16),), {})),
    Case("lstm_bidirectional", LSTMTagger, lambda g: ((_tokens(g, 40, 3, 7),), {})),
    Case("lstm_on_features", LSTMForecaster, lambda g: ((torch.randn(4, 9, 6, generator=g),), {})),
    Case("gru", GRUClassifier, lambda g: ((_randn(g, 3, 6, 12),), {})),
    Case("transformer_pre_norm", lambda: EncoderClassifier(norm_first=True), _encoder_inputs),
    Case("transformer_post_norm", lambda: EncoderClassifier(norm_first=False), _encoder_inputs),
    Case("decoder_causal_mask", CausalDecoder, lambda g: ((_tokens(g, 50, 2, 9), _randn(g, 2, 5, 32)), {})),
    Case("encoder_decoder", Seq2Seq, _seq2seq_inputs),
    Case("gpt_tied_weights", CausalLM, lambda g: ((_tokens(g, 64, 2, 16),), {})),
    Case("vit_patches", ViT, lambda g: ((_randn(g, 2, 3, 16, 16),), {})),
    Case("mixture_of_experts", MixtureOfExperts, lambda g: ((_randn(g, 6, 16),), {})),
    Case("sdpa_padding_mask", PaddedSDPA, _padded_sdpa_inputs),
    Case("rmsnorm_swiglu", RMSNormSwiGLU, lambda g: ((_tokens(g, 64, 2, 12),), {})),
    Case("rotary_attention", RotaryAttention, lambda g: ((_tokens(g, 64, 2, 16),), {})),
    Case("embedding_bag", BagOfWords, _bag_inputs),
    Case("dict_inputs_outputs", DictModel, _dict_inputs),
    Case("data_dependent_branch", DataDependentBranch, lambda g: ((_randn(g, 4, 8),), {})),
    Case("custom_autograd_function", CustomFunction, lambda g: ((_randn(g, 5, 8),), {})),
    Case("custom_library_op", CustomOpMLP, lambda g: ((_randn(g, 5, 8),), {})),
]
