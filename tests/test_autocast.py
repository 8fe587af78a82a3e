"""Mixed precision: Hugging Face models under ``torch.autocast`` train in ONNX Runtime with eager's accuracy, on
CPU and (where one is present) on CUDA; so do convolutional nets under CPU bfloat16 autocast.

ONNX Runtime's CPU provider has no ``bfloat16`` kernels beyond casts: the exported graphs compute those ops in
float32 (rounding where autocast casts). For float16 it inserts its own casts. The CUDA provider has bfloat16 and
float16 kernels for every op these models' graphs hold. Either way no op may be left to PyTorch, and the gradients
must be as close to float64 as eager autocast's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_ort import ORTModule
from lightning_ort.bench.vision import BasicBlock, ConvNeXtBlock, InvertedResidual, UNet

transformers = pytest.importorskip("transformers")

VOCAB = 1000


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return transformers.GPT2LMHeadModel(config)


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
    )
    return transformers.LlamaForCausalLM(config)


def _bert() -> torch.nn.Module:
    config = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        vocab_size=VOCAB,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    return transformers.BertForSequenceClassification(config)


MODELS: dict[str, Callable[[], torch.nn.Module]] = {"gpt2": _gpt2, "llama": _llama, "bert": _bert}
LOSS_RTOL = {torch.bfloat16: 1.6e-2, torch.float16: 1e-3}
"""``torch.testing.assert_close``'s relative tolerance for the dtype."""


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _padded_batch(model_name: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB, (2, 16), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 10:] = 0
    labels = torch.tensor([0, 2]) if model_name == "bert" else input_ids.masked_fill(attention_mask == 0, -100)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    return {name: tensor.to(device) for name, tensor in batch.items()}


def _step(model: torch.nn.Module, batch: dict[str, torch.Tensor], dtype: torch.dtype | None) -> tuple[Any, Any]:
    """One training step's loss and flattened gradients (float64); float16 goes through a ``GradScaler``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    device = batch["input_ids"].device.type
    scaler = torch.amp.GradScaler(device, enabled=dtype is torch.float16)
    with torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = model(**batch).loss
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    grads = torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])
    return loss.detach().double(), grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_autocast_trains_in_onnx_runtime_as_accurately_as_eager(
    model_name: str, dtype: torch.dtype, device: str
) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = MODELS[model_name]().to(device)
    batch = _padded_batch(model_name, device)
    _, grads64 = _step(copy.deepcopy(model).double(), batch, None)
    eager_loss, eager_grads = _step(copy.deepcopy(model), batch, dtype)
    ort_model = ORTModule(copy.deepcopy(model))
    ort_loss, ort_grads = _step(ort_model, batch, dtype)

    torch.testing.assert_close(ort_loss, eager_loss, rtol=LOSS_RTOL[dtype], atol=1e-5)
    eager_error = ((eager_grads - grads64).norm() / grads64.norm()).item()
    ort_error = ((ort_grads - grads64).norm() / grads64.norm()).item()
    assert ort_error <= 1.5 * eager_error, (
        f"gradient error against float64: ORT {ort_error:.2e}, eager {eager_error:.2e}"
    )
    statistics = ort_model.statistics
    assert statistics.fallback_ops == 0
    assert statistics.eager_ops == 0
    assert statistics.forward_runs >= 1
    assert statistics.backward_runs >= 1


def _resnet() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, 1, 1, bias=False),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        BasicBlock(16, 32, 2),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, 10),
    )


def _efficientnet() -> torch.nn.Module:
    block = InvertedResidual(16, 24, 2, 4, kernel=5, activation=torch.nn.SiLU, squeezed=4)
    head = [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(24, 10)]
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, 1, 1), torch.nn.SiLU(), block, *head)


def _unet() -> torch.nn.Module:
    return torch.nn.Sequential(UNet(width=8), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(3, 10))


def _convnext() -> torch.nn.Module:
    head = [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 10)]
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 4, 4), ConvNeXtBlock(16), *head)


VISION_MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "resnet": _resnet,
    "efficientnet": _efficientnet,
    "unet": _unet,
    "convnext": _convnext,
}
"""Batch norm with ReLU and a strided projection; SiLU, a depthwise 5x5 convolution and squeeze-and-excitation;
group norm, strided and transposed convolutions; a 7x7 depthwise convolution, channel layer norm and GELU: what
CNNs run under autocast, on lightning_ort's CPU kernels."""


def _vision_step(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, autocast: bool) -> Any:
    """Flattened float64 gradients of one cross-entropy step, under CPU bfloat16 autocast where ``autocast``."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(images)
    torch.nn.functional.cross_entropy(logits.double(), labels).backward()
    return torch.cat([p.grad.flatten().double() for p in model.parameters()])


@pytest.mark.parametrize("model_name", sorted(VISION_MODELS))
def test_vision_models_train_under_bf16_autocast_in_onnx_runtime_as_accurately_as_eager(model_name: str) -> None:
    torch.manual_seed(0)
    model = VISION_MODELS[model_name]()
    generator = torch.Generator().manual_seed(0)
    images, labels = torch.randn(8, 3, 16, 16, generator=generator), torch.randint(0, 10, (8,), generator=generator)
    grads64 = _vision_step(copy.deepcopy(model).double(), images.double(), labels, autocast=False)
    eager_grads = _vision_step(copy.deepcopy(model), images, labels, autocast=True)
    ort_model = ORTModule(copy.deepcopy(model), fallback="raise")
    ort_grads = _vision_step(ort_model, images, labels, autocast=True)
    eager_error = ((eager_grads - grads64).norm() / grads64.norm()).item()
    ort_error = ((ort_grads - grads64).norm() / grads64.norm()).item()
    assert ort_error <= 1.5 * eager_error, (
        f"gradient error against float64: ORT {ort_error:.2e}, eager {eager_error:.2e}"
    )
    assert ort_model.statistics.backward_runs == 1 and ort_model.statistics.fallback_ops == 0


def test_autocast_inference_in_onnx_runtime_matches_eager() -> None:
    torch.manual_seed(0)
    model = _gpt2().eval()
    batch = _padded_batch("gpt2")
    del batch["labels"]
    ort_model = ORTModule(copy.deepcopy(model))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(**batch).logits
        actual = ort_model(**batch).logits
    assert actual.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(actual.float(), expected.float(), rtol=1.6e-2, atol=2e-2)
    assert ort_model.statistics.forward_runs >= 1
    assert ort_model.statistics.fallback_ops == 0
