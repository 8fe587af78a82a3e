"""CUDA graph replay (``SessionSettings(cuda_graph=True)``): which graphs can be captured, and the fixed buffers a
captured graph reads and writes, exercised on CPU (the CPU provider ignores graph ids, so the buffers, the
copies and the parameter binding run as they do on CUDA). The captures themselves are in ``tests/test_cuda.py``."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from lightning_ort import CudaGraphWarning, ORTConfig, ORTModule, SessionSettings
from lightning_ort.engine.fx.layout import OutputSpec
from lightning_ort.engine.onnx.export import ExportedGraph
from lightning_ort.engine.ort_internals import pybind_session
from lightning_ort.engine.runtime import cuda_graph
from lightning_ort.engine.runtime import session as session_module
from lightning_ort.engine.runtime.cuda_graph import CapturedGraphs, capture_refusal
from lightning_ort.engine.runtime.session import _bind


def _affine_session() -> tuple[ort.InferenceSession, list[OutputSpec]]:
    """``y = x @ w + b`` and ``z = relu(y)``, with ``x`` (3x4), ``w`` (4x2) and ``b`` (2) as inputs."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])]
    nodes.append(helper.make_node("Relu", ["y"], ["z"]))
    graph = helper.make_graph(
        nodes,
        "affine",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 2]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [2]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, [3, 2]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session, [OutputSpec((3, 2), torch.float32), OutputSpec((3, 2), torch.float32)]


def _graphs() -> CapturedGraphs:
    session, outputs = _affine_session()
    return CapturedGraphs(
        pybind_session(session), ["x", "w", "b"], ["y", "z"], outputs, torch.device("cpu"), None, _bind
    )


def test_replays_read_new_inputs_and_parameters_updated_in_place_and_return_fresh_outputs() -> None:
    graphs = _graphs()
    w, b = nn.Parameter(torch.randn(4, 2)), nn.Parameter(torch.randn(2))
    results = []
    for _ in range(4):
        x = torch.randn(3, 4)
        y, z = graphs.run([x, w, b])  # type: ignore[misc]
        torch.testing.assert_close(y, x @ w.detach() + b.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(z, torch.relu(y))
        results.append((y, y.clone()))
        with torch.no_grad():
            w.add_(0.5)  # an optimizer's in-place update: the bound parameter is read as it is now
        assert len(graphs) == 1, "one set of parameters, one graph"
    for kept, value in results:
        assert torch.equal(kept, value), "a later replay must not overwrite an earlier call's outputs"


def test_each_set_of_parameters_gets_its_own_graph_up_to_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_graph, "MAX_GRAPHS", 2)
    graphs = _graphs()
    layers = [(nn.Parameter(torch.randn(4, 2)), nn.Parameter(torch.randn(2))) for _ in range(3)]
    x = torch.randn(3, 4)
    for w, b in layers[:2]:
        y, _ = graphs.run([x, w, b])  # type: ignore[misc]
        torch.testing.assert_close(y, x @ w.detach() + b.detach(), rtol=1e-6, atol=1e-6)
    assert len(graphs) == 2
    assert graphs.run([x, *layers[2]]) is None, "a third set runs uncaptured, beside the graphs"
    y, _ = graphs.run([x, *layers[0]])  # type: ignore[misc]
    torch.testing.assert_close(y, x @ layers[0][0].detach() + layers[0][1].detach(), rtol=1e-6, atol=1e-6)


def _graph(nodes: list[object], symbols: dict[object, tuple[int, int]] | None = None) -> ExportedGraph:
    x = helper.make_tensor_value_info("x", TensorProto.INT64, [2, 3])
    model = helper.make_model(helper.make_graph(nodes, "g", [x], []))  # type: ignore[arg-type]
    return ExportedGraph("forward", model, [], [], None, symbols or {})  # type: ignore[arg-type]


def test_graphs_that_cannot_be_captured_say_why() -> None:
    relu = helper.make_node("Relu", ["x"], ["y"], "relu")
    assert capture_refusal(_graph([relu])) is None
    refusal = capture_refusal(_graph([relu], {object(): (0, 0)}))
    assert refusal is not None and "symbolic" in refusal
    refusal = capture_refusal(_graph([helper.make_node("If", ["c"], ["y"], "branch")]))
    assert refusal is not None and "If branch" in refusal
    pads = numpy_helper.from_array(np.array([0, 1, 0, 1], np.int64), "pads")
    pad = _graph([helper.make_node("Pad", ["x", "pads"], ["y"], "pad")])
    pad.model.graph.initializer.append(pads)
    refusal = capture_refusal(pad)
    assert refusal is not None and "Pad pad" in refusal and "host" in refusal
    shape = capture_refusal(_graph([helper.make_node("Shape", ["x"], ["s"], "shape")]))
    assert shape is not None and "Shape shape" in shape


def test_cuda_graph_is_a_session_setting_that_the_lightning_config_carries() -> None:
    assert SessionSettings().cuda_graph is False
    assert ORTConfig(cuda_graph=True).session_settings.cuda_graph is True
    with pytest.raises(TypeError, match="cuda_graph"):
        SessionSettings(cuda_graph="yes")  # type: ignore[arg-type]


def test_cpu_models_train_as_before_with_cuda_graph_asked_for() -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    wrapped = ORTModule(
        nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), session_settings=SessionSettings(cuda_graph=True)
    )
    wrapped.load_state_dict(eager.state_dict())
    x = torch.randn(5, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CudaGraphWarning)
        torch.testing.assert_close(wrapped(x), eager(x))
    assert wrapped.statistics.forward_runs == 1


def test_models_train_alike_through_the_replay_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every graph of Hugging Face GPT-2 (block graphs, dropout, the padded-label loss) run through the captured
    graphs' buffers, as on CUDA, trains as the same model run directly by ONNX Runtime."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(session_module, "_captures", lambda graph, device, settings: settings.cuda_graph)
    replays: list[int] = []
    original = CapturedGraphs.run

    def counting(self: CapturedGraphs, inputs: list[torch.Tensor]) -> list[torch.Tensor] | None:
        replays.append(len(inputs))
        return original(self, inputs)

    monkeypatch.setattr(CapturedGraphs, "run", counting)
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(config)
    models = [
        ORTModule(copy.deepcopy(base), session_settings=SessionSettings(cuda_graph=flag), blocks=["GPT2Block"])
        for flag in (False, True)
    ]
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-3) for model in models]
    ids = torch.randint(0, 64, (2, 16))
    for step in range(4):
        losses = []
        for model, optimizer in zip(models, optimizers):
            torch.manual_seed(step)  # the same dropout masks for both
            loss = model(input_ids=ids, labels=ids).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    for expected, actual in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    # per step and direction: the parts before and after the blocks, and one run per GPT2Block
    assert len(replays) == 4 * 2 * (2 + config.n_layer), "every run replayed"
