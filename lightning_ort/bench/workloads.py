"""The benchmark's reference workloads, fixed so that figures compare across versions, and ``--module`` factories.

* ``transformer``: ``Embedding(1000, 256)``, ``nn.TransformerEncoder`` of 4 pre-norm layers (8 heads, ff 1024,
  dropout 0.1), ``Linear(256, 1000)``; 32 x 64 tokens, cross-entropy.
* ``mlp``: ``Linear(512, 2048) GELU LayerNorm Linear(2048, 2048) GELU Linear(2048, 10)``, batch 256.
* ``cnn``: a conv/BatchNorm/ReLU stem and three residual stages (32, 64, 128 channels) on 64 images 32x32x3.
* ``resnet18``, ``mobilenet``, ``convnext``, ``efficientnet``: the vision networks of
  :mod:`lightning_ort.bench.vision` (ResNet-18, MobileNetV2, ConvNeXt at widths 48-384 and depths 2, 2, 4, 2, and
  EfficientNet-B0) on 16 images of 64x64x3, 100 classes: dense 3x3, depthwise 3x3 and 7x7 convolutions, and
  depthwise 5x5 ones with SiLU and squeeze-and-excitation. ``unet``: a diffusion U-Net (GroupNorm, SiLU,
  transposed convolutions; width 32) predicting the noise added to 16 images of 32x32x3, mean squared error. They
  run only when asked for (``--workload resnet18``).
* ``gpt2``: Hugging Face ``GPT2LMHeadModel`` with its default configuration (12 layers, width 768, dropout 0.1),
  8 x 512 tokens, its own loss from ``labels``. Sized for a GPU, so it runs only when asked for
  (``--workload gpt2``); it needs ``transformers``.

A factory for ``--module`` takes a :class:`torch.device` and returns ``(module, inputs, loss_fn)``: ``inputs``
a tuple of tensors for ``module(*inputs)`` and ``loss_fn(output)`` a scalar tensor.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from lightning_ort.bench.vision import BasicBlock, ConvNeXt, EfficientNetB0, MobileNetV2, ResNet18, UNet


@dataclass
class Workload:
    """A model, one batch of inputs and a loss: what one training step runs."""

    name: str
    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    loss_fn: Callable[[Any], torch.Tensor]
    kwargs: dict[str, torch.Tensor] = field(default_factory=dict)
    memory_format: str = "contiguous"
    """``"channels_last"`` where the model and its 4-D inputs were converted to it (the bench's ``--memory-format``)."""

    def forward(self, model: nn.Module) -> Any:
        """``model``'s output on this workload's batch."""
        return model(*self.inputs, **self.kwargs)


class TransformerLM(nn.Module):
    """``Embedding(vocab, width)``, a pre-norm ``nn.TransformerEncoder`` and a ``Linear(width, vocab)`` head.

    Example:
        >>> TransformerLM(vocab=50, width=16, heads=2, layers=1)(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 50])
    """

    def __init__(self, vocab: int, width: int, heads: int, layers: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)))


def _token_loss(targets: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda logits: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def transformer_workload(device: torch.device) -> Workload:
    """Embedding(1000, 256), 4 pre-norm layers (8 heads, ff 1024, dropout 0.1), 32 x 64 tokens."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (32, 65), generator=g).to(device)
    model = TransformerLM(vocab=1000, width=256, heads=8, layers=4)
    return Workload("transformer", model, (ids[:, :-1],), _token_loss(ids[:, 1:]))


def mlp_workload(device: torch.device) -> Workload:
    """Linear(512, 2048) GELU LayerNorm Linear(2048, 2048) GELU Linear(2048, 10), batch 256."""
    g = torch.Generator().manual_seed(1)
    x, labels = torch.randn(256, 512, generator=g).to(device), torch.randint(0, 10, (256,), generator=g).to(device)
    model = nn.Sequential(
        nn.Linear(512, 2048), nn.GELU(), nn.LayerNorm(2048), nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 10)
    )
    return Workload("mlp", model, (x,), _token_loss(labels))


def cnn_workload(device: torch.device) -> Workload:
    """A ResNet-style stem and three stages (32, 64, 128 channels) on 64 images of 32x32x3, 10 classes."""
    g = torch.Generator().manual_seed(1)
    images = torch.randn(64, 3, 32, 32, generator=g).to(device)
    labels = torch.randint(0, 10, (64,), generator=g).to(device)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, 1, 1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        BasicBlock(32, 32, 1),
        BasicBlock(32, 64, 2),
        BasicBlock(64, 128, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 10),
    )
    return Workload("cnn", model, (images,), _token_loss(labels))


def _images(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """16 images of 64x64x3 and their labels among 100 classes, the same for every vision workload."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 3, 64, 64, generator=g).to(device), torch.randint(0, 100, (16,), generator=g).to(device)


def resnet18_workload(device: torch.device) -> Workload:
    """ResNet-18, 100 classes, on 16 images of 64x64x3."""
    images, labels = _images(device)
    return Workload("resnet18", ResNet18(classes=100), (images,), _token_loss(labels))


def mobilenet_workload(device: torch.device) -> Workload:
    """MobileNetV2 (width 1.0), 100 classes, on 16 images of 64x64x3."""
    images, labels = _images(device)
    return Workload("mobilenet", MobileNetV2(classes=100), (images,), _token_loss(labels))


def convnext_workload(device: torch.device) -> Workload:
    """ConvNeXt blocks at widths 48, 96, 192, 384 and depths 2, 2, 4, 2, 100 classes, on 16 images of 64x64x3."""
    images, labels = _images(device)
    model = ConvNeXt(widths=(48, 96, 192, 384), depths=(2, 2, 4, 2), classes=100)
    return Workload("convnext", model, (images,), _token_loss(labels))


def efficientnet_workload(device: torch.device) -> Workload:
    """EfficientNet-B0, 100 classes, on 16 images of 64x64x3."""
    images, labels = _images(device)
    return Workload("efficientnet", EfficientNetB0(classes=100), (images,), _token_loss(labels))


def unet_workload(device: torch.device) -> Workload:
    """A diffusion U-Net (width 32) on 16 images of 32x32x3, its loss the mean squared error to a noise target."""
    g = torch.Generator().manual_seed(1)
    images = torch.randn(16, 3, 32, 32, generator=g).to(device)
    noise = torch.randn(16, 3, 32, 32, generator=g).to(device)
    return Workload("unet", UNet(width=32), (images,), lambda output: F.mse_loss(output, noise))


def gpt2_workload(
    device: torch.device, *, layers: int = 12, width: int = 768, batch: int = 8, length: int = 512
) -> Workload:
    """Hugging Face GPT2LMHeadModel, default configuration (12 layers, width 768), 8 x 512 tokens, its own loss.

    The keywords shrink it for a dry run on CPU (``bench table --tiny``); the ``gpt2`` workload is the default.
    """
    transformers = import_transformers("run --workload gpt2")
    g = torch.Generator().manual_seed(1)
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=max(width // 64, 1), n_positions=1024)
    ids = torch.randint(0, config.vocab_size, (batch, length), generator=g).to(device)
    model = transformers.GPT2LMHeadModel(config)
    return Workload("gpt2", model, (), lambda output: output.loss, {"input_ids": ids, "labels": ids})


WORKLOADS: dict[str, Callable[[torch.device], Workload]] = {
    "transformer": transformer_workload,
    "mlp": mlp_workload,
    "cnn": cnn_workload,
    "resnet18": resnet18_workload,
    "mobilenet": mobilenet_workload,
    "convnext": convnext_workload,
    "efficientnet": efficientnet_workload,
    "unet": unet_workload,
    "gpt2": gpt2_workload,
}
DEFAULT_WORKLOADS = ("transformer", "mlp", "cnn")
"""What runs without ``--workload``."""


def load_factory(spec: str) -> Callable[[torch.device], Workload]:
    """Turn ``"pkg.mod:factory"`` into a workload factory (see the module docstring for the contract)."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"--module expects 'package.module:factory', got {spec!r}.")
    factory = getattr(importlib.import_module(module_name), attribute)

    def build(device: torch.device) -> Workload:
        model, inputs, loss_fn = factory(device)
        return Workload(spec, model, tuple(inputs), loss_fn)

    return build


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA), so that a timer around a step measures the step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hugging_face_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: Mapping[str, torch.Tensor], device: torch.device
) -> float:
    """One timed training step of a Hugging Face model whose loss comes from ``batch``'s labels (seconds)."""
    synchronize(device)
    start = time.perf_counter()
    loss = model(**batch).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    synchronize(device)
    return time.perf_counter() - start


def import_transformers(study: str) -> Any:
    """The ``transformers`` package, or an ImportError saying that the benchmark's ``study`` needs it."""
    try:
        return importlib.import_module("transformers")
    except ImportError as err:
        raise ImportError(
            f"python -m lightning_ort.bench {study} builds Hugging Face models: pip install transformers"
        ) from err
