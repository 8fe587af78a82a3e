"""Gradients have their parameters' strides, as in eager PyTorch, for channels-last models.

PyTorch's CPU performance guide advises ``model.to(memory_format=torch.channels_last)`` for convolutional nets.
Their 1x1 and depthwise convolution weights then have strides that differ from row-major ones on a dimension of
size 1 only; ONNX Runtime writes row-major gradients, which autograd takes as they are, and DDP, which compares a
gradient's strides with its bucket's (the parameter's), warned "Grad strides do not match bucket view strides"
and copied those gradients on every step.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lightning_ort import ORTModule
from tests.helpers import assert_grads_close


class MixedConvs(nn.Module):
    """A 3x3 stem, a depthwise 3x3 and a pointwise 1x1 convolution with batch norms, and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.depthwise = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.ReLU())
        self.pointwise = nn.Sequential(nn.Conv2d(16, 32, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.head = nn.Linear(32, 5)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.pointwise(self.depthwise(self.stem(images)))
        return self.head(features.mean((2, 3)))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    images = torch.randn(4, 3, 8, 8, generator=g).contiguous(memory_format=torch.channels_last)
    return images, torch.randint(0, 5, (4,), generator=g)


def _channels_last_pair() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    eager = MixedConvs().to(memory_format=torch.channels_last)
    return eager, copy.deepcopy(eager)


def test_channels_last_gradients_have_the_strides_eager_gives_them() -> None:
    eager, model = _channels_last_pair()
    wrapped = ORTModule(model, fallback="raise")
    images, labels = _batch()
    for _ in range(2):
        for module in (eager, wrapped):
            module.zero_grad(set_to_none=True)
            F.cross_entropy(module(images), labels).backward()
        assert_grads_close(wrapped, eager)
        strides = {name: p.grad.stride() for name, p in wrapped.module.named_parameters() if p.grad is not None}
        expected = {name: p.grad.stride() for name, p in eager.named_parameters() if p.grad is not None}
        assert strides == expected
    assert wrapped.module.pointwise[0].weight.stride() == (16, 1, 16, 16), "the case this test is about"
    assert wrapped.statistics.backward_runs == 2


def test_ddp_takes_the_gradients_into_its_buckets_without_restriding(tmp_path: Path) -> None:
    eager, model = _channels_last_pair()
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        reference = nn.parallel.DistributedDataParallel(eager)
        ddp = nn.parallel.DistributedDataParallel(ORTModule(model, fallback="raise"))
        images, labels = _batch()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                for module in (reference, ddp):
                    module.zero_grad(set_to_none=True)
                    F.cross_entropy(module(images), labels).backward()
        assert not [str(w.message) for w in caught if "strides" in str(w.message)]
        assert_grads_close(ddp.module, eager)
        # What DDP's reducer compares: each gradient's strides with its bucket view's, which are the parameter's.
        mismatched = [n for n, p in ddp.module.module.named_parameters() if p.grad.stride() != p.stride()]
        assert not mismatched
    finally:
        torch.distributed.destroy_process_group()
