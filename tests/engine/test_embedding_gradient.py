"""On CPU an embedding's weight gradient runs in PyTorch after the backward graph, not as a scatter into zeros.

ONNX Runtime's ``ScatterElements`` copies a zero input of the whole table before it adds the tokens' gradients;
PyTorch's ``embedding_dense_backward`` adds them into a zero table directly. Parity is checked against eager on
models others wrote (Hugging Face Llama with its own table, GPT-2 with the table tied to its head), and the
exported backward graph is read for what runs in ONNX Runtime.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
import torch
from torch import nn

from lightning_ort import DebugOptions, ORTModule
from tests.helpers import assert_grads_close, tiny_llama

transformers = pytest.importorskip("transformers")


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("factory", [tiny_llama, _gpt2], ids=["llama", "gpt2-tied-head"])
def test_language_models_train_as_eager_with_the_table_gradient_in_pytorch(
    factory: Callable[[], nn.Module], tmp_path: Path
) -> None:
    torch.manual_seed(0)
    eager = factory()
    options = DebugOptions(save_onnx=True, onnx_prefix="lm", save_path=str(tmp_path))
    wrapped = ORTModule(copy.deepcopy(eager), fallback="raise", debug_options=options)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a gradient kept in PyTorch is no fallback
        actual = wrapped(input_ids=ids, attention_mask=mask, labels=ids).loss
        actual.backward()
    expected = eager(input_ids=ids, attention_mask=mask, labels=ids).loss
    expected.backward()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert_grads_close(wrapped, eager)
    stats = wrapped.statistics
    assert stats.fallback_ops == 0 and stats.backward_runs == 1
    backward = sorted(path.name for path in tmp_path.glob("lm_training_backward*.onnx"))
    assert backward == ["lm_training_backward_part0.onnx", "lm_training_backward_part0_optimized.onnx"], (
        "one ONNX Runtime partition, the tied head's sum included in PyTorch's part"
    )
    graph = onnx.shape_inference.infer_shapes(onnx.load(tmp_path / backward[0])).graph
    shapes = {
        value.name: [d.dim_value for d in value.type.tensor_type.shape.dim]
        for value in [*graph.value_info, *graph.output]
    }
    scattered = [shapes.get(node.output[0]) for node in graph.node if node.op_type.startswith("Scatter")]
    assert [128, 64] not in scattered, "no scatter into a zero table (the loss's gradient scatters at its targets)"


class Bag(nn.Module):
    """Token embeddings with a padding row and frequency-scaled gradients, summed into a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(50, 8, padding_idx=0, scale_grad_by_freq=True)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.tokens(ids).mean(1))


def test_padding_rows_and_frequency_scaling_match_eager() -> None:
    torch.manual_seed(0)
    eager = Bag()
    wrapped = ORTModule(copy.deepcopy(eager), fallback="raise")
    ids = torch.tensor([[0, 3, 3, 7], [5, 0, 3, 49]])
    wrapped(ids).square().sum().backward()
    eager(ids).square().sum().backward()
    assert_grads_close(wrapped, eager)
    assert wrapped.module.tokens.weight.grad is not None
    assert not wrapped.module.tokens.weight.grad[0].any(), "the padding row gets no gradient"
    assert wrapped.statistics.backward_runs == 1
