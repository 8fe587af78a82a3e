"""Under CPU ``bfloat16`` autocast, vision nets run on the same lightning_ort CPU kernels as in float32.

Autocast makes convolutions return ``bfloat16``, and with them the batch norms, activations and poolings after
them. ONNX Runtime computes those ops in float32
(:func:`~lightning_ort.engine.onnx.passes.compute_bfloat16_in_float`), so the fast paths written for float32
apply to them: the fused batch norms, values-only max pooling, stride-2 phase gradients, the activations' and
norms' one-pass gradients. These tests compare the kernels each net's graphs hold with and without autocast,
check that a weight gradient PyTorch computes is cast to its parameter's dtype in PyTorch too (no ONNX Runtime
partition of casts after it), and that the kernels' PyTorch forms agree with their fake forms on ``bfloat16``.
The nets' accuracy under autocast is tested in ``tests/test_autocast.py``.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
import torch
from torch import nn

from lightning_ort import DebugOptions, ORTModule
from lightning_ort.bench.vision import BasicBlock, ConvNeXtBlock, GroupNormBlock, InvertedResidual
from lightning_ort.engine.fx.batch_norm import (
    BATCH_NORM_ADD_TRAINING,
    BATCH_NORM_ADD_TRAINING_BACKWARD,
    BATCH_NORM_TRAINING,
    BATCH_NORM_TRAINING_BACKWARD,
)
from lightning_ort.engine.fx.gelu import GELU_BACKWARD
from lightning_ort.engine.fx.group_norm import GROUP_NORM, GROUP_NORM_BACKWARD
from lightning_ort.engine.fx.layer_norm import LAYER_NORM_BACKWARD
from lightning_ort.engine.fx.max_pool import MAX_POOL2D, MAX_POOL2D_BACKWARD
from lightning_ort.engine.fx.silu import SILU_BACKWARD
from lightning_ort.engine.onnx.custom_ops import DOMAIN


def _resnet() -> nn.Module:
    stem = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)]
    return nn.Sequential(*stem, BasicBlock(16, 16, 1), BasicBlock(16, 32, 2), *head)


def _efficientnet() -> nn.Module:
    block = InvertedResidual(16, 24, 2, 4, kernel=5, activation=nn.SiLU, squeezed=4)
    head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(24, 10)]
    return nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1), nn.SiLU(), block, *head)


def _convnext() -> nn.Module:
    head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)]
    return nn.Sequential(nn.Conv2d(3, 16, 4, 4), ConvNeXtBlock(16), *head)


def _group_norm_net() -> nn.Module:
    head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)]
    return nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1), GroupNormBlock(8, 16), *head)


NETS: dict[str, Callable[[], nn.Module]] = {
    "resnet": _resnet,
    "efficientnet": _efficientnet,
    "convnext": _convnext,
    "group_norm": _group_norm_net,
}
"""Batch norm with ReLU, residual adds, max pooling and a strided projection; SiLU with a 5x5 stride-2 depthwise
convolution; a 7x7 depthwise convolution, channel layer norm and GELU; group norm with SiLU."""


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(8, 3, 32, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator)


def _graph_kernels(
    model: nn.Module, tmp_path: Path, autocast: bool, conv_weight_grad: str = "onnx"
) -> tuple[Counter[str], list[str]]:
    """The lightning_ort kernels that compute in the graphs of one training step of ``model`` (not the weights'
    layout changes, whose count follows which weights the partitioner saves), and the graphs' file names."""
    debug = DebugOptions(save_onnx=True, onnx_prefix="net", save_path=str(tmp_path))
    wrapped = ORTModule(copy.deepcopy(model), debug, fallback="raise", conv_weight_grad=conv_weight_grad)  # type: ignore[arg-type]
    images, labels = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = wrapped(images)
    nn.functional.cross_entropy(logits.float(), labels).backward()
    files = sorted(path.name for path in tmp_path.glob("net_*.onnx") if not path.stem.endswith("_optimized"))
    kernels: Counter[str] = Counter()
    for name in files:
        nodes = onnx.load(tmp_path / name).graph.node
        kernels.update(node.op_type for node in nodes if node.domain == DOMAIN and node.op_type != "BlockWeight")
    return kernels, files


@pytest.mark.parametrize("net", sorted(NETS))
def test_autocast_graphs_use_the_kernels_of_float32_graphs(net: str, tmp_path: Path) -> None:
    model = NETS[net]()
    float32, float32_files = _graph_kernels(model, tmp_path / "float32", autocast=False)
    bfloat16, bfloat16_files = _graph_kernels(model, tmp_path / "bfloat16", autocast=True)
    assert float32, "the net uses lightning_ort's kernels in float32"
    assert bfloat16 == float32
    assert bfloat16_files == float32_files


def test_weight_gradients_computed_by_pytorch_are_cast_there(tmp_path: Path) -> None:
    convolutions = (layer for _ in range(2) for layer in (nn.Conv2d(3, 3, 3, 1, 1), nn.ReLU()))
    model = nn.Sequential(*convolutions, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 10))
    _, files = _graph_kernels(model, tmp_path, autocast=True, conv_weight_grad="torch")
    assert files == ["net_training_backward_part0.onnx", "net_training_forward.onnx"]


def _bn_args(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 5, 5, generator=generator).to(dtype)
    weight, bias = torch.rand(3, generator=generator) + 0.5, torch.randn(3, generator=generator)
    return x, weight, bias, torch.zeros(3), torch.ones(3)


def test_fused_batch_norm_ops_compute_bfloat16_in_float32_with_their_fake_dtypes() -> None:
    x, weight, bias, mean, var = _bn_args(torch.bfloat16)
    residual = torch.randn(4, 3, 5, 5).bfloat16()
    clamp = (True, 0.0, float("inf"))
    for op, extra in ((BATCH_NORM_TRAINING, ()), (BATCH_NORM_ADD_TRAINING, (residual,))):
        torch.library.opcheck(op, (x, weight, bias, mean, var, *extra, 0.1, 1e-5, *clamp))
        output, save_mean, invstd, *_ = op(x, weight, bias, mean, var, *extra, 0.1, 1e-5, *clamp)
        expected, *_ = op(x.float(), weight, bias, mean, var, *(t.float() for t in extra), 0.1, 1e-5, *clamp)
        assert (output.dtype, save_mean.dtype, invstd.dtype) == (torch.bfloat16, torch.float32, torch.float32)
        torch.testing.assert_close(output, expected.bfloat16(), rtol=0, atol=0)  # one rounding, of the float32 value
    output, save_mean, invstd, *_ = BATCH_NORM_ADD_TRAINING(x, weight, bias, mean, var, residual, 0.1, 1e-5, *clamp)
    grad = torch.randn(4, 3, 5, 5).bfloat16()
    backward_args = (
        (BATCH_NORM_TRAINING_BACKWARD, (grad, x, weight, bias, save_mean, invstd, *clamp)),
        (BATCH_NORM_ADD_TRAINING_BACKWARD, (grad, x, weight, bias, save_mean, invstd, output, *clamp)),
    )
    for op, args in backward_args:
        torch.library.opcheck(op, args)
        grads = op(*args)
        assert [g.dtype for g in grads[:3]] == [torch.bfloat16, torch.float32, torch.float32]


def test_group_norm_ops_compute_bfloat16_in_float32_with_their_fake_dtypes() -> None:
    generator = torch.Generator().manual_seed(0)
    x, grad = torch.randn(2, 6, 4, 4, generator=generator).bfloat16(), torch.randn(2, 6, 4, 4).bfloat16()
    weight, bias = torch.rand(6, generator=generator) + 0.5, torch.randn(6, generator=generator)
    torch.library.opcheck(GROUP_NORM, (x, weight, bias, 3, 1e-5))
    output, mean, rstd = GROUP_NORM(x, weight, bias, 3, 1e-5)
    expected = nn.functional.group_norm(x.float(), 3, weight, bias, 1e-5)
    assert (output.dtype, mean.dtype, rstd.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    torch.testing.assert_close(output, expected.bfloat16(), rtol=0, atol=0)
    torch.library.opcheck(GROUP_NORM_BACKWARD, (grad, x, weight, mean, rstd, 3))
    grads = GROUP_NORM_BACKWARD(grad, x, weight, mean, rstd, 3)
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.float32, torch.float32]


def test_activation_norm_and_pooling_ops_take_bfloat16_with_their_fake_dtypes() -> None:
    generator = torch.Generator().manual_seed(0)
    x, grad = torch.randn(2, 4, 8, 8, generator=generator).bfloat16(), torch.randn(2, 4, 8, 8).bfloat16()
    weight = torch.rand(8, generator=generator) + 0.5
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [8], weight, None, 1e-5)
    window = ([3, 3], [2, 2], [1, 1], [1, 1])
    pooled = MAX_POOL2D(x, *window)
    cases = [
        (GELU_BACKWARD, (grad, x, "tanh")),
        (SILU_BACKWARD, (grad, x)),
        (LAYER_NORM_BACKWARD, (grad, x, weight, mean, rstd)),
        (MAX_POOL2D, (x, *window)),
        (MAX_POOL2D_BACKWARD, (torch.randn(pooled.shape).bfloat16(), x, *window)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)
        outputs = op(*args)
        first = outputs[0] if isinstance(outputs, tuple) else outputs
        assert first.dtype == torch.bfloat16
