"""ONNX Runtime runs bind PyTorch memory directly (no copies in or out)."""

from __future__ import annotations

import copy
import gc
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import lightning_ort.engine.runtime.session as session_module
from lightning_ort import DebugOptions, ORTModule, SessionSettings
from lightning_ort.bench.vision import ConvNeXt
from lightning_ort.engine.fx.dynamic import evaluate
from lightning_ort.engine.fx.layout import OutputLayout, PassedInput, ReshapedOutput, normalise_outputs
from lightning_ort.engine.fx.noise import Noise
from lightning_ort.engine.onnx.constant_outputs import constant_output_positions, split_constant_outputs
from lightning_ort.engine.onnx.export import ExportedGraph
from lightning_ort.engine.onnx.passes import nchwc_block_size
from tests.helpers import tiny_llama
from tests.zoo import MLP


def test_inputs_and_outputs_are_bound_zero_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    # Inputs are bound to PyTorch's memory; on CPU, outputs are written into ONNX Runtime's arena and the tensors
    # handed back are DLPack views of that memory (on CUDA they are bound like inputs: tests/test_cuda.py).
    bound: list[tuple[str, int, str]] = []
    written: list[int] = []
    original_bind = session_module._bind
    original_from_onnx_runtime = session_module._from_onnx_runtime

    def recording_bind(bind: Any, name: str, tensor: torch.Tensor) -> None:
        bound.append((bind.__name__, tensor.data_ptr(), name))
        original_bind(bind, name, tensor)

    def recording_from_onnx_runtime(values: Any, specs: Any) -> list[torch.Tensor]:
        tensors = original_from_onnx_runtime(values, specs)
        written.extend(t.data_ptr() for t in tensors)
        return tensors

    monkeypatch.setattr(session_module, "_bind", recording_bind)
    monkeypatch.setattr(session_module, "_from_onnx_runtime", recording_from_onnx_runtime)
    wrapped = ORTModule(MLP())
    x = torch.randn(4, 16)
    with torch.no_grad():
        out = wrapped(x)
    input_pointers = {ptr for kind, ptr, _ in bound if kind == "bind_input"}
    assert x.data_ptr() in input_pointers
    assert {p.data_ptr() for p in wrapped.parameters()} <= input_pointers
    assert not [name for kind, _, name in bound if kind == "bind_output"]
    assert out.data_ptr() in written


def test_boolean_outputs_come_back_as_booleans() -> None:
    wrapped = ORTModule(_Positive())
    x = torch.randn(3, 5)
    out = wrapped(x)
    assert out.dtype == torch.bool
    assert torch.equal(out, x > 0)


class _Positive(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x > 0


def test_non_contiguous_input_is_made_contiguous_once() -> None:
    wrapped = ORTModule(MLP())
    x = torch.randn(16, 4).t()
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), wrapped.module(x), rtol=1e-4, atol=1e-5)


def test_session_settings_reach_the_session() -> None:
    wrapped = ORTModule(MLP(), session_settings=SessionSettings(optimization_level="basic", intra_op_num_threads=1))
    wrapped(torch.randn(2, 16))
    assert wrapped.providers == ["CPUExecutionProvider"]
    _, session = next(wrapped._backend.runners())
    options = session._session.get_session_options()
    assert options.intra_op_num_threads == 1
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    assert options.get_session_config_entry("session.force_spinning_stop") == "1"
    assert options.get_session_config_entry("session.use_env_allocators") == "1", "CPU sessions share one arena"
    assert not options.enable_mem_pattern, "no per-graph memory pattern block beside the shared arena"


def test_spinning_can_be_turned_off() -> None:
    wrapped = ORTModule(MLP(), session_settings=SessionSettings(allow_spinning=False))
    wrapped(torch.randn(2, 16))
    _, session = next(wrapped._backend.runners())
    assert session._session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning") == "0"


@pytest.mark.parametrize("release", [True, False])
def test_cpu_runs_release_torch_threads_first(monkeypatch: pytest.MonkeyPatch, release: bool) -> None:
    # One release before each of the four runs.
    monkeypatch.setattr(session_module, "RELEASE_MIN_RUN_S", 0.0)
    wrapped = ORTModule(MLP(), session_settings=SessionSettings(release_torch_threads=release))
    runs_before_release = _record_releases(monkeypatch, wrapped)
    for _ in range(2):
        wrapped(torch.randn(2, 16)).sum().backward()
    assert runs_before_release == ([0, 1, 2, 3] if release else [])
    assert _total_runs(wrapped) == 4


def test_graphs_with_short_runs_keep_torch_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    # With no run long enough, only each graph's first run (no duration known yet) releases the threads.
    monkeypatch.setattr(session_module, "RELEASE_MIN_RUN_S", float("inf"))
    wrapped = ORTModule(MLP())
    runs_before_release = _record_releases(monkeypatch, wrapped)
    for _ in range(3):
        wrapped(torch.randn(2, 16)).sum().backward()
    assert runs_before_release == [0, 1]
    assert _total_runs(wrapped) == 6


def _record_releases(monkeypatch: pytest.MonkeyPatch, wrapped: ORTModule) -> list[int]:
    """Replace the thread release by a recorder: the list gets, per release, how many graph runs came before it."""
    runs_before_release: list[int] = []

    def recording_release() -> bool:
        runs_before_release.append(_total_runs(wrapped))
        return True

    monkeypatch.setattr(session_module, "release_openmp_threads", recording_release)
    return runs_before_release


def _total_runs(wrapped: ORTModule) -> int:
    return sum(session.runs for _, session in wrapped._backend.runners())


def test_bad_session_settings_fail_with_allowed_values() -> None:
    with pytest.raises(ValueError, match="optimization_level='max' is not one of disable, basic, extended, all"):
        SessionSettings(optimization_level="max")
    with pytest.raises(ValueError, match="not available in this onnxruntime build"):
        SessionSettings(providers=("NoSuchExecutionProvider",))


def test_inputs_returned_by_a_graph_are_passed_through_without_a_copy() -> None:
    # The forward graph returns parameters the backward graph needs; ONNX Runtime would copy them (Identity).
    wrapped = ORTModule(torch.nn.Linear(16, 16))
    wrapped(torch.randn(4, 16, requires_grad=True)).sum().backward()
    forward = _forward_graph(wrapped)
    passed = [s for s in forward.layout.sources if isinstance(s, PassedInput)]
    assert passed, "the saved input should be returned as is"
    assert len(forward.model.graph.output) == len(forward.outputs)


def test_passed_through_inputs_come_back_detached_and_unchanged() -> None:
    # Inputs are bound as they are (no detach per input on every run); the few returned as outputs are detached.
    weight = torch.randn(3, 4, requires_grad=True)
    passed, reshaped = OutputLayout((PassedInput(0), ReshapedOutput(PassedInput(0), (12,)))).place([], [weight], {})
    assert not passed.requires_grad and not reshaped.requires_grad
    assert passed.data_ptr() == reshaped.data_ptr() == weight.data_ptr()
    assert reshaped.shape == (12,)


def test_gradients_that_reshape_a_product_come_back_as_views() -> None:
    # A convolution's weight gradient is a product reshaped to the weight's shape; ONNX Runtime cannot alias a
    # graph output, so returning the reshape would copy every weight gradient once more.
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(16, 4, 3))
    wrapped = ORTModule(copy.deepcopy(eager), conv_weight_grad="onnx")
    x = torch.randn(3, 8, 6, 6)
    wrapped(x).square().sum().backward()
    eager(x).square().sum().backward()
    backward = next(runner._graph for kind, runner in wrapped._backend.runners() if kind == "backward")
    assert sum(isinstance(s, ReshapedOutput) for s in backward.layout.sources) == 2, backward.layout.sources
    producers = {output: node.op_type for node in backward.model.graph.node for output in node.output}
    assert "Reshape" not in {producers[output.name] for output in backward.model.graph.output}
    _assert_grads_match(wrapped, eager)
    pointers = [param.grad.data_ptr() for param in wrapped.module.parameters()]
    assert len(set(pointers)) == len(pointers)


def test_views_of_one_base_are_returned_as_tensors_of_their_own() -> None:
    # Two gradients viewing one buffer would each see the other's in-place updates (clipping, zero_grad).
    def shared(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, c = a * 2, a * 3
        return b.view(4), b.view(2, 2), c.view(4)

    gm = make_fx(shared)(torch.randn(2, 2))
    layout, specs = normalise_outputs(gm, 0)
    first, second, third = layout.sources
    assert isinstance(first, int) and isinstance(second, int) and first != second
    assert isinstance(third, ReshapedOutput)
    assert [spec.shape for spec in specs] == [(4,), (2, 2), (2, 2)]


def test_a_forward_graphs_saved_tensors_share_the_value_they_view() -> None:
    # Only the backward graph reads saved tensors; ONNX Runtime would copy each further view into an output.
    def forward(a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b = a * 2
        return a + 1, b.view(4), b.view(2, 2), b.expand(2, 2)

    gm = make_fx(forward)(torch.randn(2, 2))
    layout, specs = normalise_outputs(gm, 1)
    assert layout.sources == (0, ReshapedOutput(1, (4,)), ReshapedOutput(1, (2, 2)), ReshapedOutput(1, (2, 2)))
    assert [spec.shape for spec in specs] == [(2, 2), (2, 2)]

    def mixed(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = a * 2
        return b.view(4), b.view(2, 2)

    layout, specs = normalise_outputs(make_fx(mixed)(torch.randn(2, 2)), 1)
    assert layout.sources == (0, 1), "a user's output, which may be updated in place, shares no memory"
    assert [spec.shape for spec in specs] == [(4,), (2, 2)]


def test_a_decoders_saved_attention_operands_leave_onnx_runtime_without_copies() -> None:
    # Llama's attention saves its matmuls' operands, which are expands to their own shape, and one normalized
    # hidden state per projection: each was a graph output of its own, copied by an Identity or a Reshape.
    torch.manual_seed(0)
    eager = tiny_llama()
    wrapped = ORTModule(copy.deepcopy(eager))
    ids = torch.randint(0, 128, (2, 16))
    wrapped(input_ids=ids, labels=ids).loss.backward()
    eager(input_ids=ids, labels=ids).loss.backward()
    graph = _forward_graph(wrapped).model.graph
    producers = {output: node.op_type for node in graph.node for output in node.output}
    copies = [o.name for o in graph.output if producers.get(o.name) in ("Identity", "Reshape")]
    assert not copies, copies
    _assert_grads_match(wrapped, eager)


def test_a_users_output_that_reshapes_a_computed_value_is_that_values_memory_as_a_tensor_of_its_own() -> None:
    def outputs(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        b, c = a * 2, a * 3
        return b.view(4), c, c.view(4), a.view(4)

    gm = make_fx(outputs)(torch.randn(2, 2))
    layout, specs = normalise_outputs(gm, None)
    own, returned, of_returned, of_input = layout.sources
    assert own == ReshapedOutput(0, (4,), own=True)
    assert returned == 1 and of_returned == 2, "a reshape of a value returned too is computed: no shared memory"
    assert of_input == 3, "nor is an input's memory handed out"
    assert [spec.shape for spec in specs] == [(2, 2), (2, 2), (4,), (4,)]
    base = torch.arange(4.0).view(2, 2)
    (placed,) = OutputLayout((own,)).place([base], [], {})
    assert placed._base is None and placed.shape == (4,) and placed.data_ptr() == base.data_ptr()


class _LanguageHead(torch.nn.Module):
    """Token embeddings and a vocabulary head whose scores are reshaped back to (batch, tokens, vocabulary)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.head = torch.nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        batch, tokens = ids.shape
        return self.head(self.embed(ids).view(batch * tokens, 16)).view(batch, tokens, 50)


def test_logits_leave_onnx_runtime_without_a_copy_and_take_in_place_updates() -> None:
    # ONNX Runtime's Reshape copies into a graph output: the whole vocabulary's scores for every token, once more.
    torch.manual_seed(0)
    eager = _LanguageHead()
    wrapped = ORTModule(copy.deepcopy(eager))
    ids = torch.randint(0, 50, (4, 8))
    logits, expected = wrapped(ids), eager(ids)
    torch.testing.assert_close(logits, expected)
    assert logits._base is None and logits.is_contiguous()
    logits.mul_(2)  # in place, as users treat outputs
    expected.mul_(2)
    logits.logsumexp(-1).sum().backward()
    expected.logsumexp(-1).sum().backward()
    _assert_grads_match(wrapped, eager)
    forward = _forward_graph(wrapped)
    producers = {output: node.op_type for node in forward.model.graph.node for output in node.output}
    assert producers[forward.model.graph.output[0].name] != "Reshape"
    assert forward.layout.sources[0] == ReshapedOutput(0, (4, 8, 50), own=True)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(ids), eager(ids))


def test_a_graph_whose_outputs_all_view_its_inputs_still_computes_one() -> None:
    # ONNX Runtime cannot load a graph without outputs; the first view is computed in the graph instead.
    def views(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a.view(4), b.view(2, 3)

    gm = make_fx(views)(torch.randn(2, 2), torch.randn(6))
    layout, specs = normalise_outputs(gm, 0)
    first, second = layout.sources
    assert first == 0 and isinstance(second, ReshapedOutput) and second.base == PassedInput(1)
    assert [spec.shape for spec in specs] == [(4,)]


def _forward_graph(wrapped: ORTModule) -> ExportedGraph:
    return next(runner._graph for kind, runner in wrapped._backend.runners() if kind == "forward")


def _assert_grads_match(wrapped: ORTModule, eager: torch.nn.Module) -> None:
    for (name, param), ref in zip(wrapped.module.named_parameters(), eager.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, rtol=1e-4, atol=1e-5, msg=name)


class _DropoutBlock(torch.nn.Module):
    """Linear layers on a 3-d input (reshaped to 2-d inside ``F.linear``'s backward) with dropout between."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.drop = torch.nn.Dropout(0.25)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(torch.relu(self.up(x))))


class _KeepAll(torch.nn.Module):
    """Dropout whose mask keeps every element: the eager reference for a drawn all-true mask."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (1 - 0.25)


def test_saved_tensors_leave_onnx_runtime_without_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    # Saved reshapes (Reshape), dropout masks and twice-transposed weights (Identity) would each be a full copy
    # made by ONNX Runtime; they come out as views of other outputs or as the inputs themselves.
    def keep_all(noise: Noise, device: torch.device, env: dict[Any, int]) -> torch.Tensor:
        shape = tuple(evaluate(size, env) for size in noise.shape)
        return torch.ones(shape, dtype=noise.dtype, device=device)  # every element kept

    monkeypatch.setattr(Noise, "draw", keep_all)
    torch.manual_seed(0)
    eager = _DropoutBlock()
    wrapped = ORTModule(copy.deepcopy(eager))
    eager.drop = _KeepAll()
    x = torch.randn(4, 8, 16)
    wrapped(x).sum().backward()
    eager(x).sum().backward()
    forward = _forward_graph(wrapped)
    graph = forward.model.graph
    saved = {output.name for output in graph.output[1:]}
    producers = {node.output[0]: node for node in graph.node}
    copying = [
        node.op_type
        for node in graph.node
        if node.output[0] in saved
        and (node.op_type in ("Identity", "Reshape") or producers.get(node.input[0], node).op_type == "Transpose")
    ]
    assert not copying, copying
    sources = forward.layout.sources
    assert any(isinstance(s, ReshapedOutput) for s in sources), sources
    assert any(isinstance(s, PassedInput) and s.index >= len(eager.state_dict()) + 1 for s in sources), sources
    _assert_grads_match(wrapped, eager)


def test_permuted_views_are_saved_unpermuted() -> None:
    # Attention saves q, k and the probabilities as transposed views; ONNX Runtime would write each as a
    # transposed copy. The forward graph saves the untransposed tensors and the backward graph permutes them.
    torch.manual_seed(0)
    eager = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(2, 7, 32)
    wrapped(x).sum().backward()
    eager(x).sum().backward()
    graph = _forward_graph(wrapped).model.graph
    saved = {output.name for output in graph.output[1:]}
    consumed = {name for node in graph.node for name in node.input}
    only_saved = [n.output[0] for n in graph.node if n.op_type == "Transpose" and n.output[0] in saved - consumed]
    assert not only_saved, only_saved
    _assert_grads_match(wrapped, eager)


def test_permuted_views_the_forward_computes_anyway_stay_saved(tmp_path: Path) -> None:
    # ConvNeXt's blocks permute each depthwise convolution's output to channels-last for a layer norm. The
    # forward graph writes that permuted tensor anyway, so it is saved as it is: the backward graph reads it
    # without a transpose, and the forward's transpose folds into the convolution's NCHWc reorder.
    torch.manual_seed(0)
    eager = ConvNeXt(widths=(16, 32), depths=(1, 1), classes=5)
    debug = DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path)
    wrapped = ORTModule(copy.deepcopy(eager), debug)
    x = torch.randn(2, 3, 32, 32)
    wrapped(x).sum().backward()
    eager(x).sum().backward()
    _assert_grads_match(wrapped, eager)
    for path in [path for path in tmp_path.glob("m_training_backward*.onnx") if "optimized" not in path.name]:
        backward = onnx.load(str(path)).graph
        inputs = {value.name for value in backward.input}
        transposes = [n for n in backward.node if n.op_type == "Transpose" and n.input[0] in inputs]
        to_channels_last = [n.name for n in transposes if helper.get_node_attr_value(n, "perm") == [0, 2, 3, 1]]
        assert not to_channels_last, (path.name, to_channels_last)
    if nchwc_block_size() > 1:
        forward = onnx.load(str(tmp_path / "m_training_forward.onnx")).graph
        reordered = {n.output[0] for n in forward.node if n.op_type == "ReorderOutput"}
        assert not [n.name for n in forward.node if n.op_type == "Transpose" and n.input[0] in reordered]


def test_outputs_are_freed_by_reference_counting_and_gradients_taken_without_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A reference cycle around a run's outputs kept them (saved activations included) alive until the garbage
    # collector ran, and autograd copied every gradient instead of taking the tensor ONNX Runtime wrote.
    written: list[weakref.ref[torch.Tensor]] = []
    written_at: set[int] = set()
    original_call = session_module.GraphSession.__call__

    def recording_call(self: session_module.GraphSession, args: list[Any]) -> list[Any]:
        outputs = original_call(self, args)
        if self.name.startswith("backward"):
            written.extend(weakref.ref(t) for t in outputs if isinstance(t, torch.Tensor))
            written_at.update(t.data_ptr() for t in outputs if isinstance(t, torch.Tensor))
        return outputs

    monkeypatch.setattr(session_module.GraphSession, "__call__", recording_call)
    wrapped = ORTModule(MLP())
    x = torch.randn(4, 16)
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):
            written.clear()
            written_at.clear()
            wrapped.zero_grad(set_to_none=True)
            wrapped(x).square().sum().backward()
            assert all(ref() is None for ref in written)
            grads = [p.grad for p in wrapped.parameters()]
            assert all(g is not None and g.data_ptr() in written_at for g in grads)
    finally:
        gc.enable()


class CausalMix(nn.Module):
    """Mixes each position with those before it through a causal mask the model builds itself, as a
    hand-written attention does: the mask depends on no input, and its ``masked_fill`` saves it for the backward."""

    def __init__(self, width: int = 8, length: int = 16) -> None:
        super().__init__()
        self.scores = nn.Linear(width, length)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        return self.scores(x).masked_fill(~causal, 0.0) @ x


def test_outputs_that_depend_on_no_input_are_computed_once_and_copied_per_call() -> None:
    """A causal mask saved for the backward depends on no input: ONNX Runtime would copy it into the output at
    every run with a synchronous copy (on CUDA a device synchronisation, which CUDA graph capture refuses)."""
    torch.manual_seed(0)
    eager = CausalMix()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(2, 16, 8)
    eager(x).logsumexp(-1).mean().backward()
    wrapped(x).logsumexp(-1).mean().backward()
    _assert_grads_match(wrapped, eager)

    forward = next(runner for kind, runner in wrapped._backend.runners() if kind == "forward")
    model = forward._graph.model
    positions = constant_output_positions(model)
    masks = [model.graph.output[position].name for position in positions]
    assert masks and all(name.startswith("bitwise_not") for name in masks)
    session_outputs = [output.name for output in forward._session.get_outputs()]
    assert len(session_outputs) == len(model.graph.output) - len(masks) and not set(masks) & set(session_outputs)

    values = [forward._constants[position] for position in positions]
    assert all(value.dtype == torch.bool and value.shape == (16, 16) for value in values)
    assert torch.equal(values[0], ~torch.ones(16, 16, dtype=torch.bool).tril())
    handed = forward._with_constants([torch.zeros(1)] * len(session_outputs))
    again = forward._with_constants([torch.zeros(1)] * len(session_outputs))
    for position, value in zip(positions, values):
        assert torch.equal(handed[position], value) and handed[position].data_ptr() != value.data_ptr()
        handed[position].fill_(True)
        assert torch.equal(again[position], value), "each call gets a copy of its own"


def test_constant_outputs_split_from_a_graph_compute_what_it_computes() -> None:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 3]) for name in ("y", "c", "r", "z")]
    nodes = [
        helper.make_node("Constant", [], ["one"], value=helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])),
        helper.make_node("Relu", ["x"], ["y"]),
        helper.make_node("Expand", ["one", "shape"], ["c"]),
        helper.make_node("RandomUniformLike", ["c"], ["r"]),
        helper.make_node("Add", ["y", "c"], ["z"]),
    ]
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [2, 3])
    model = helper.make_model(
        helper.make_graph(nodes, "g", [x], outputs, [shape]), opset_imports=[helper.make_opsetid("", 17)], ir_version=10
    )
    assert constant_output_positions(model) == [1], "random ops and what reads an input are not constants"
    split = split_constant_outputs(model)
    assert split is not None and split.positions == [1]
    assert [o.name for o in split.graph.graph.output] == ["y", "r", "z"] and len(split.graph.graph.input) == 1
    assert [o.name for o in split.constants.graph.output] == ["c"] and not split.constants.graph.input
    assert [n.op_type for n in split.constants.graph.node] == ["Constant", "Expand"]
    onnx.checker.check_model(split.graph, full_check=True)
    onnx.checker.check_model(split.constants, full_check=True)
    whole = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    value = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    y, c, _, z = whole.run(None, {"x": value})
    rest = ort.InferenceSession(split.graph.SerializeToString(), providers=["CPUExecutionProvider"])
    constants = ort.InferenceSession(split.constants.SerializeToString(), providers=["CPUExecutionProvider"])
    y2, _, z2 = rest.run(None, {"x": value})
    (c2,) = constants.run(None, {})
    assert np.array_equal(y, y2) and np.array_equal(z, z2) and np.array_equal(c, c2)
    only_constants = helper.make_model(helper.make_graph(nodes[:1], "g", [x], [outputs[1]]))
    assert split_constant_outputs(only_constants) is None, "a graph with nothing left to run stays whole"
