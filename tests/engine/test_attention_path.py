"""``attention="torch"``: SDPA and its backward run as PyTorch's fused kernels between ONNX Runtime partitions.

On CPU they are the CPU flash-attention kernels; on CUDA (``tests/test_cuda.py``) flash, memory-efficient or
cuDNN. Parity is checked against eager PyTorch on padded batches with an attention mask, as users train.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_ort import ORTConfig, ORTModule
from lightning_ort.engine.capture.backend import backend_options
from lightning_ort.engine.torch_internals import FUSED_ATTENTION
from tests.helpers import assert_grads_close

transformers = pytest.importorskip("transformers")


def _gpt2(layers: int = 2) -> nn.Module:
    config = transformers.GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=128)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _padded_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.parametrize("blocks", [None, "auto"], ids=["one-graph", "block-graphs"])
def test_gpt2_on_padded_batches_trains_as_eager_with_attention_in_pytorch(blocks: str | None) -> None:
    eager = _gpt2(3)
    wrapped = ORTModule(copy.deepcopy(eager), blocks=blocks, attention="torch", fallback="raise")
    batch = _padded_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # kept attention is no fallback: no warning
        actual = wrapped(**batch).loss
    expected = eager(**batch).loss
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    actual.backward()
    expected.backward()
    assert_grads_close(wrapped, eager)
    stats = wrapped.statistics
    assert stats.fallback_ops == 0 and stats.eager_signatures == 0
    assert stats.forward_runs > 0 and stats.backward_runs > 0, "the rest ran in ONNX Runtime"


def test_the_fused_kernels_run_in_pytorch_and_the_math_path_is_not_exported() -> None:
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(16, 48)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

    fused_names = {op.name() for op in FUSED_ATTENTION}
    for attention, fused in (("torch", True), ("onnx", False), ("auto", False)):  # auto: the math on CPU
        wrapped = ORTModule(Attention(), attention=attention)
        wrapped(torch.randn(2, 5, 16)).backward()  # built
        with torch.profiler.profile() as profile:
            wrapped(torch.randn(2, 5, 16)).backward()
        ran = {event.name for event in profile.events()}
        assert bool(ran & fused_names) is fused, (attention, sorted(ran))
        assert not ran & {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul"}, "the projections ran in ORT"


def test_attention_path_is_checked_and_reaches_every_entry_point() -> None:
    with pytest.raises(ValueError, match="attention='fused' is not one of 'auto', 'onnx', 'torch'"):
        ORTModule(nn.Linear(2, 2), attention="fused")  # type: ignore[arg-type]
    assert ORTModule(nn.Linear(2, 2)).attention == "auto"
    assert ORTConfig().module_options.attention == backend_options({}).attention == "auto"
    assert ORTConfig(attention="torch").module_options.attention == "torch"
    assert backend_options({"attention": "torch"}).attention == "torch"
