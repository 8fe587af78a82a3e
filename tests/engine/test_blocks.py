"""Block graphs: a repeated block is exported once and every instance runs its sessions, with eager parity."""

from __future__ import annotations

import copy
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.torch_version import TorchVersion
from typing_extensions import override

from lightning_ort import BlockError, ExportError, FallbackWarning, ORTModule
from lightning_ort.engine.capture import aot
from lightning_ort.engine.capture.aot import CapturedGraph
from lightning_ort.engine.capture.blocks import (
    inline_blocks,
    light_blocks,
    mark_blocks,
    marked_blocks,
    repeated_classes,
    resolve_blocks,
)
from lightning_ort.engine.torch_internals import maybe_mark_dynamic
from tests.helpers import assert_grads_close, assert_outputs_close, weighted_loss


class Block(nn.Module):
    """A pre-norm MLP block with a constant buffer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x)))) * self.scale * mask.unsqueeze(-1)


class Deep(nn.Module):
    def __init__(self, depth: int = 12, width: int = 16, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(x)


def _batch(length: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (3, length), generator=g)
    mask = (torch.arange(length) < torch.tensor([[length], [5], [3]])).float()
    return ids, mask


def test_a_twelve_block_model_exports_each_distinct_graph_once() -> None:
    torch.manual_seed(0)
    eager = Deep()
    whole = ORTModule(copy.deepcopy(eager))
    blocked = ORTModule(copy.deepcopy(eager), blocks="auto")
    assert [cls.__name__ for cls in blocked.block_classes] == ["Block"]
    for _ in range(2):
        outputs = [model(*_batch()) for model in (eager, whole, blocked)]
        for model, output in zip((eager, whole, blocked), outputs):
            model.zero_grad()
            weighted_loss(output).backward()
        for output, model in zip(outputs[1:], (whole, blocked)):
            assert_outputs_close(output, outputs[0])
            assert_grads_close(model, eager)
            torch.testing.assert_close(model.state_dict(), eager.state_dict())
    stats = blocked.statistics
    assert (stats.block_graphs, stats.block_reuses) == (2, 22), "one forward and one backward block graph"
    assert stats.graphs == 1 and stats.fallback_ops == 0 and stats.eager_signatures == 0
    # The block graphs ran once per block and step, the partitions around them once per step.
    runs = {runner.name: runner.runs for _, runner in blocked._backend.runners()}
    assert runs == {"forward": 2, "backward": 2, "forward_block0": 24, "backward_block0": 24}
    # Forward and backward: the partitions before and after the blocks (embedding, head), and one block graph.
    assert stats.onnx_exports == 6
    assert float(eager.calls) == 2 == float(blocked.module.calls)


class CountingBlock(Block):
    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.register_buffer("calls", torch.zeros(()))

    @override
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return super().forward(x, mask)


def test_blocks_that_update_buffers_are_inlined_into_one_graph(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    eager = Deep(depth=3)
    eager.layers = nn.ModuleList(CountingBlock(16) for _ in range(3))
    blocked = ORTModule(copy.deepcopy(eager), blocks="auto")
    with caplog.at_level(logging.INFO, logger="lightning_ort.engine.capture.aot"):
        for model in (eager, blocked):
            weighted_loss(model(*_batch())).backward()
    assert "capturing it with the blocks inlined" in caplog.text
    assert_grads_close(blocked, eager)
    torch.testing.assert_close(blocked.state_dict(), eager.state_dict())
    stats = blocked.statistics
    assert stats.block_graphs == 0 and stats.eager_signatures == 0 and stats.backward_runs == 1


def _block_flops(model: nn.Module, dynamic: bool) -> list[float]:
    """The forward work :func:`light_blocks` counts for each distinct block subgraph TorchDynamo traces."""
    counts: list[float] = []

    def backend(gm: torch.fx.GraphModule, _: Any) -> Any:
        counts.extend(light_blocks(gm, float("inf")).values())
        inline_blocks(gm)
        return gm.forward

    def run(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # A function of its own: compiled modules share one wrapper frame, whose recompile limit the rest of a
        # test process may have used up.
        return model(ids, mask)

    mark_blocks(model, [Block])
    ids, mask = _batch()
    if dynamic:
        maybe_mark_dynamic(ids, 1)
        maybe_mark_dynamic(mask, 1)
    torch.compile(run, backend=backend)(ids, mask)
    return counts


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "symbolic"])
def test_a_blocks_forward_work_is_counted_on_its_traced_shapes(dynamic: bool) -> None:
    # 3 x 7 tokens through Linear(16, 32) and Linear(32, 16): 2 * 21 * 16 * 32 operations each. (torch 2.11 traces
    # the symbolic block into two subgraphs, each counted.)
    counts = _block_flops(Deep(depth=3), dynamic)
    assert counts and set(counts) == {2 * 2 * 21 * 16 * 32}


def test_automatic_blocks_too_light_for_the_device_are_inlined(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``blocks="auto"`` keeps a block's graphs only where its forward's work reaches the device's threshold;
    named block classes are kept whatever their work (the CPU has no threshold: one is set for the test)."""
    torch.manual_seed(0)
    eager = Deep(depth=4)
    monkeypatch.setattr(aot, "BLOCK_FLOPS", {"cpu": 1e6})
    automatic = ORTModule(copy.deepcopy(eager), blocks="auto")
    named = ORTModule(copy.deepcopy(eager), blocks=[Block])
    with caplog.at_level(logging.INFO, logger="lightning_ort.engine.capture.aot"):
        outputs = [model(*_batch()) for model in (eager, automatic, named)]
        for output in outputs:
            weighted_loss(output).backward()
    assert "blocks='auto' inlines the blocks of the first graph: a block's forward counts 4.3e-05 GFLOP" in caplog.text
    for output, model in zip(outputs[1:], (automatic, named)):
        assert_outputs_close(output, outputs[0])
        assert_grads_close(model, eager)
    assert automatic.statistics.block_graphs == 0 and automatic.statistics.backward_runs == 1
    assert named.statistics.block_graphs == 2

    monkeypatch.setattr(aot, "BLOCK_FLOPS", {"cpu": 4e4})
    heavy_enough = ORTModule(copy.deepcopy(eager), blocks="auto")
    weighted_loss(heavy_enough(*_batch())).backward()
    assert heavy_enough.statistics.block_graphs == 2


class BreakingBlock(Block):
    """A block whose forward prints: a graph break TorchDynamo cannot keep inside a block graph."""

    @override
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return super().forward(x, mask)


def _breaking_model() -> Deep:
    torch.manual_seed(0)
    model = Deep(depth=3)
    model.layers = nn.ModuleList(BreakingBlock(16) for _ in range(3))
    return model


def test_a_block_with_a_graph_break_is_captured_with_the_model_and_named() -> None:
    eager = _breaking_model()
    wrapped = ORTModule(copy.deepcopy(eager), blocks="auto")
    assert wrapped.block_classes == (BreakingBlock,)
    with pytest.warns(
        FallbackWarning, match=r"block BreakingBlock \(`layers.0`\) is captured with the model's"
    ) as record:
        weighted_loss(wrapped(*_batch())).backward()
    assert "test_blocks.py" in record[0].filename
    weighted_loss(eager(*_batch())).backward()
    assert_grads_close(wrapped, eager)
    assert wrapped.block_classes == () and not marked_blocks(wrapped.module)
    stats = wrapped.statistics
    assert stats.block_graphs == 0 and stats.forward_runs > 0 and stats.backward_runs > 0


def test_a_block_with_a_graph_break_is_an_error_under_fallback_raise() -> None:
    wrapped = ORTModule(_breaking_model(), blocks="auto", fallback="raise")
    with pytest.raises(BlockError, match=r"BreakingBlock \(`layers.0`\) cannot be captured.*graph_break\(\)"):
        wrapped(*_batch())


def test_an_fsdp_sharded_block_with_a_graph_break_fails_at_the_first_forward(tmp_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        wrapped = ORTModule(_breaking_model(), blocks="auto")
        mesh = init_device_mesh("cpu", (1,))
        for block in marked_blocks(wrapped.module):
            fully_shard(block, mesh=mesh)
        fully_shard(wrapped, mesh=mesh)
        with pytest.raises(BlockError, match=r"BreakingBlock \(`layers.0`\) cannot be captured as one graph"):
            wrapped(*_batch())
        assert wrapped.block_classes == (BreakingBlock,) and len(marked_blocks(wrapped.module)) == 3
    finally:
        torch.distributed.destroy_process_group()


def test_block_graphs_run_no_matrix_product_in_pytorch() -> None:
    blocked = ORTModule(Deep(depth=4), blocks="auto")
    blocked(*_batch()).sum().backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        blocked(*_batch()).sum().backward()
    ran = {event.name for event in profile.events()}
    assert not ran & {"aten::mm", "aten::addmm", "aten::linear", "aten::matmul"}


REGIONS_REUSED_ACROSS_SHAPES = TorchVersion(torch.__version__) >= (2, 13)
"""torch 2.11 traces a block region again when its graph turns dynamic-shape: one more block graph per pass."""


def test_inference_and_new_lengths_reuse_the_blocks() -> None:
    torch.manual_seed(0)
    eager = Deep(depth=3)
    blocked = ORTModule(copy.deepcopy(eager), blocks="auto")
    with torch.no_grad():
        torch.testing.assert_close(blocked(*_batch()), eager(*_batch()), rtol=1e-4, atol=1e-5)
    for length in (9, 11):
        torch.testing.assert_close(blocked(*_batch(length)), eager(*_batch(length)), rtol=1e-4, atol=1e-5)
    stats = blocked.statistics
    # An inference graph for the first length (no_grad), then a training graph with a symbolic length for the
    # others: one inference and two training block graphs (forward, backward), each reused by the other blocks.
    assert (stats.graphs, stats.block_graphs, stats.block_reuses, stats.eager_signatures) == (
        (2, 3, 6, 0) if REGIONS_REUSED_ACROSS_SHAPES else (2, 5, 4, 0)
    )


def test_dynamic_shapes_with_blocks_match_eager() -> None:
    torch.manual_seed(0)
    eager = Deep(depth=3)
    blocked = ORTModule(copy.deepcopy(eager), blocks="auto")
    for length in (7, 10, 12):
        for model in (eager, blocked):
            model.zero_grad()
            weighted_loss(model(*_batch(length))).backward()
        assert_grads_close(blocked, eager)
    stats = blocked.statistics
    # A static graph for the first length, a dynamic one (symbolic length) for the others.
    assert (stats.graphs, stats.block_graphs, stats.block_reuses, stats.eager_signatures) == (
        (2, 4, 8, 0) if REGIONS_REUSED_ACROSS_SHAPES else (2, 6, 6, 0)
    )


def test_the_disk_cache_serves_block_graphs(tmp_path: Path) -> None:
    first = ORTModule(Deep(depth=3), blocks="auto", cache_dir=tmp_path)
    first(*_batch()).sum().backward()
    assert first.statistics.onnx_exports > 0
    second = ORTModule(Deep(depth=3), blocks="auto", cache_dir=tmp_path)
    second(*_batch()).sum().backward()
    stats = second.statistics
    assert stats.onnx_exports == 0 and stats.disk_cache_loads == first.statistics.onnx_exports
    assert stats.block_graphs == 2


def test_repeated_composites_are_found_and_leaf_layers_are_not() -> None:
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
    assert repeated_classes(mlp) == {}
    assert repeated_classes(Deep(depth=5)) == {Block: 5}
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, batch_first=True), num_layers=3)
    assert repeated_classes(encoder) == {nn.TransformerEncoderLayer: 3}, "layers, not their inner Linear"


def test_an_unknown_block_name_lists_the_repeated_classes_and_changes_nothing() -> None:
    model = Deep(depth=3)
    with pytest.raises(BlockError, match=r"no module of class 'GPT2Block'.*repeated within its containers: Block"):
        ORTModule(model, blocks=["GPT2Block"])
    assert marked_blocks(model) == []
    assert "forward" not in model.layers[0].__dict__


def test_a_model_without_repeated_blocks_is_one_graph(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lightning_ort.engine.capture.blocks"):
        assert resolve_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), "auto") == []
    assert "no block repeated within a container" in caplog.text
    model = ORTModule(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), blocks="auto")
    model(torch.randn(2, 4)).sum().backward()
    assert model.statistics.block_graphs == 0 and model.statistics.backward_runs == 1


def test_blocks_named_by_class_or_name() -> None:
    assert resolve_blocks(Deep(depth=2), [Block]) == [Block]
    assert resolve_blocks(Deep(depth=2), ["Block"]) == [Block]
    assert resolve_blocks(Deep(depth=2), f"{Block.__module__}.Block") == [Block]


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("class_name", "config"),
    [
        ("LlamaForCausalLM", "LlamaConfig"),
        ("GPT2LMHeadModel", "GPT2Config"),
        ("BertForMaskedLM", "BertConfig"),
    ],
)
def test_hugging_face_layers_on_padded_batches_match_eager(class_name: str, config: str) -> None:
    settings = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 3,
        "n_embd": 32,
        "n_layer": 3,
        "n_head": 4,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "pad_token_id": 0,
    }
    torch.manual_seed(0)
    eager = getattr(transformers, class_name)(getattr(transformers, config)(**settings)).train()
    eager.config.use_cache = False
    blocked = ORTModule(copy.deepcopy(eager), blocks="auto")
    ids = torch.randint(3, 64, (3, 10), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(10) < torch.tensor([[10], [7], [4]])).long()
    labels = ids.masked_fill(mask == 0, -100)
    for model in (eager, blocked):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    expected = eager(input_ids=ids, attention_mask=mask, labels=labels).loss
    actual = blocked(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
    assert_grads_close(blocked, eager)
    stats = blocked.statistics
    assert len(blocked.block_classes) == 1 and stats.block_graphs >= 2 and stats.block_reuses >= 4
    assert stats.fallback_ops == 0 and stats.eager_signatures == 0


def test_bert_fine_tuning_with_dropout_and_blocks_runs_in_onnx_runtime() -> None:
    # Dropout between BERT's blocks puts noise inputs into partitions whose inputs come after some of their ops.
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    model = ORTModule(transformers.BertForSequenceClassification(config), blocks="auto")
    ids, mask = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        model(input_ids=ids, attention_mask=mask.long(), labels=torch.tensor([0, 1, 1])).loss.backward()
    stats = model.statistics
    assert stats.eager_signatures == 0 and stats.fallback_ops == 0 and stats.block_graphs == 2
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters() if p.requires_grad)


def test_a_graph_with_block_calls_that_runs_in_pytorch_still_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    def unbuildable(self: CapturedGraph, backend: Any) -> Any:
        raise ExportError("simulated: a failure that names no op")

    monkeypatch.setattr(CapturedGraph, "_compile_with_aot", unbuildable)
    torch.manual_seed(0)
    eager = Deep(depth=3)
    blocked = ORTModule(copy.deepcopy(eager), blocks="auto")
    with pytest.warns(FallbackWarning, match="runs in PyTorch for one of its graphs"):
        weighted_loss(blocked(*_batch())).backward()
    weighted_loss(eager(*_batch())).backward()
    assert blocked.statistics.eager_signatures == 1
    assert_grads_close(blocked, eager)
