"""Deployment files: a trained model exported for inference loads into a plain ``onnxruntime.InferenceSession``,
takes only its named inputs, and matches eager PyTorch (float32: rtol 1e-4, atol 1e-5) on batch sizes it was not
exported with."""

from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from lightning_ort import ExportError, ORTModule
from lightning_ort.deployment import FirstCall, export_for_deployment
from lightning_ort.engine.capture.blocks import marked_blocks

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def _demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_transformer", ROOT / "examples" / "train_transformer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(path: Path, **inputs: torch.Tensor) -> list[torch.Tensor]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return [torch.from_numpy(np.asarray(out)) for out in session.run(None, {k: v.numpy() for k, v in inputs.items()})]


def _eager(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    training = model.training
    model.eval()
    with torch.no_grad():
        out = model(*args, **kwargs)
    model.train(training)
    return out


def test_the_trained_demo_model_runs_in_plain_onnx_runtime_with_its_named_input(tmp_path: Path) -> None:
    demo = _demo()
    torch.manual_seed(0)
    model = ORTModule(demo.TinyLM())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = demo.synthetic_batch(generator)
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert model.statistics.backward_runs == 3

    deployed = model.export(tmp_path / "tinylm.onnx", ids[:4, :-1])
    assert deployed.inputs == {"ids": ("batch", 32)} and deployed.outputs == {"output": ("batch", 32, 96)}
    assert model.training, "the module's train mode is given back"
    assert deployed.max_error is not None and deployed.max_error < 1e-4
    assert deployed.checked_shapes == (((4, 32),), ((8, 32),), ((1, 32),), ((2, 32),))

    proto = onnx.load(str(tmp_path / "tinylm.onnx"))
    onnx.checker.check_model(proto, full_check=True)
    assert [i.name for i in proto.graph.input] == ["ids"], "weights are initializers, not inputs"
    assert len(proto.graph.initializer) >= len(list(model.parameters()))
    assert not {node.domain for node in proto.graph.node} - {"", "ai.onnx"}, "no machine- or runtime-specific op"
    for batch in (2, 5):
        ids = demo.synthetic_batch(generator, batch=batch)[:, :-1]
        (logits,) = _run(tmp_path / "tinylm.onnx", ids=ids)
        torch.testing.assert_close(logits, _eager(model.module, ids), **TOLERANCE)


def test_a_cnn_exports_in_eval_mode_without_this_machines_layouts(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.5),
        nn.Conv2d(8, 16, 3),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    model = ORTModule(net)
    x = torch.randn(6, 3, 16, 16)
    model(x).square().sum().backward()  # batch statistics move the running ones
    deployed = model.export(tmp_path / "cnn.onnx", x)
    assert deployed.inputs == {"input": ("batch", 3, 16, 16)}
    proto = onnx.load(str(tmp_path / "cnn.onnx"))
    assert not any("nchwc" in node.domain.lower() or node.op_type == "ReorderInput" for node in proto.graph.node)
    for batch in (1, 3):
        images = torch.randn(batch, 3, 16, 16)
        (out,) = _run(tmp_path / "cnn.onnx", input=images)
        torch.testing.assert_close(out, _eager(net, images), **TOLERANCE)  # running statistics, no dropout


class Structured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, scale: float = 2.0) -> dict[str, Any]:
        y = self.linear(x)
        return {"logits": y, "extra": (y.sum(-1), y * scale)}


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x), x.mean(-1)


def test_outputs_are_named_after_the_structure_forward_returns(tmp_path: Path) -> None:
    x = torch.randn(2, 4)
    named = export_for_deployment(Structured(), tmp_path / "s.onnx", (x,), {"scale": 3.0})
    assert list(named.outputs) == ["logits", "extra.0", "extra.1"]
    pair = export_for_deployment(Pair(), tmp_path / "p.onnx", (x,))
    assert list(pair.outputs) == ["output_0", "output_1"]


def test_a_hugging_face_model_on_padded_batches_exports_with_batch_and_sequence_axes(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64)
    model = ORTModule(transformers.GPT2LMHeadModel(config), blocks="auto")
    ids = torch.randint(0, 1000, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    axes = {0: "batch", 1: "sequence"}
    deployed = model.export(
        tmp_path / "gpt2.onnx",
        input_ids=ids,
        attention_mask=mask,
        use_cache=False,
        dynamic_shapes={"input_ids": axes, "attention_mask": axes},
    )
    assert deployed.inputs == {"input_ids": ("batch", "sequence"), "attention_mask": ("batch", "sequence")}
    assert deployed.outputs == {"logits": ("batch", "sequence", 1000)}
    for batch, length in ((3, 7), (1, 19)):
        ids = torch.randint(0, 1000, (batch, length))
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[0, length // 2 :] = 0
        (logits,) = _run(tmp_path / "gpt2.onnx", input_ids=ids, attention_mask=mask)
        expected = _eager(model.module, input_ids=ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


class FixedBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.per_row = nn.Parameter(torch.randn(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.per_row  # a parameter per batch row: the batch size is fixed


class BranchOnBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * (2.0 if x.shape[0] == 2 else 1.0)  # tracing specializes the batch size


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + torch.randn(x.shape[0], 3)  # random in eval mode: no file can reproduce it


@pytest.mark.parametrize("make", [FixedBatch, BranchOnBatch])
def test_a_fixed_axis_stays_static_by_default_and_fails_when_asked_to_be_symbolic(
    make: type[nn.Module], tmp_path: Path
) -> None:
    x = torch.randn(2, 4)
    deployed = export_for_deployment(make(), tmp_path / "f.onnx", (x,))
    assert deployed.inputs == {"x": (2, 4)} and deployed.checked_shapes == (((2, 4),),)
    assert deployed.outputs == {"output": (2, 3)}
    with pytest.raises(ExportError, match=r"axis 0 of input `x` was asked to be symbolic \('rows'\).*fixes it to 2"):
        export_for_deployment(make(), tmp_path / "g.onnx", (x,), dynamic_shapes={"x": {0: "rows"}})


class Positions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.position = nn.Parameter(torch.randn(12, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.position[: x.shape[1]]


def test_an_axis_the_model_bounds_fails_the_check_where_eager_cannot_run(tmp_path: Path) -> None:
    model, x = Positions(), torch.randn(2, 10, 4)
    axes = {"x": {1: "sequence"}}
    # torch 2.13 leaves the axis unbounded and the doubled run fails; 2.11 bounds it, which is refused at once.
    refused = r"symbolic axes doubled \(inputs of shapes \[\(2, 20, 4\)\]\).*must match|narrows it to \[\d, 12\]"
    with pytest.raises(ExportError, match=refused):
        export_for_deployment(model, tmp_path / "p.onnx", (x,), dynamic_shapes=axes)
    declared = {"x": {1: torch.export.Dim("sequence", max=12)}}  # the range the position table allows
    deployed = export_for_deployment(model, tmp_path / "p.onnx", (x,), dynamic_shapes=declared, check=False)
    assert deployed.inputs == {"x": (2, "sequence", 4)}
    (out,) = _run(deployed.path, x=x[:, :7])
    torch.testing.assert_close(out, _eager(model, x[:, :7]), **TOLERANCE)


def test_bad_arguments_name_what_is_wrong(tmp_path: Path) -> None:
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match=r"dynamic_shapes names \['y'\].*arguments are \['x'\]"):
        export_for_deployment(Pair(), tmp_path / "m.onnx", (x,), dynamic_shapes={"y": {0: "batch"}})
    with pytest.raises(ValueError, match=r"axis 2 is not an axis of a 2-d tensor"):
        export_for_deployment(Pair(), tmp_path / "m.onnx", (x,), dynamic_shapes={"x": {2: "batch"}})
    with pytest.raises(ValueError, match=r"do not fit Pair.forward\(x: .*too many positional arguments"):
        export_for_deployment(Pair(), tmp_path / "m.onnx", (x, x))
    with pytest.raises(TypeError, match=r"takes a torch\.nn\.Module"):
        export_for_deployment(lambda t: t, tmp_path / "m.onnx", (x,))  # type: ignore[arg-type]
    assert not (tmp_path / "m.onnx").exists()


def test_the_check_refuses_a_file_that_differs_from_eager(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"Noisy: the exported model's output `output` differs from eager"):
        export_for_deployment(Noisy(), tmp_path / "n.onnx", (torch.randn(2, 4),))
    unchecked = export_for_deployment(Noisy(), tmp_path / "n.onnx", (torch.randn(2, 4),), check=False)
    assert unchecked.max_error is None and unchecked.checked_shapes == ()


def test_a_hugging_face_model_with_its_default_config_exports_without_its_cache(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    assert model.config.use_cache
    ids = torch.randint(0, 100, (2, 5))
    deployed = export_for_deployment(model, tmp_path / "c.onnx", kwargs={"input_ids": ids})
    assert deployed.outputs == {"logits": ("batch", 5, 100)}
    assert model.config.use_cache, "the model's config is left as it was"


def test_first_call_keeps_copies_of_the_first_arguments_only() -> None:
    model = nn.Linear(4, 2)
    first = FirstCall(model)
    assert not first.called and first.args == ()
    x = torch.ones(3, 4, requires_grad=True)
    model(x)
    x.data.fill_(5)
    model(torch.zeros(5, 4))
    assert first.called and first.args[0].shape == (3, 4)
    assert first.args[0].eq(1).all() and not first.args[0].requires_grad
    assert not model._forward_pre_hooks, "the hook removed itself"


def test_export_leaves_the_module_it_exports_as_it_was(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 2))
    before = copy.deepcopy(net.state_dict())
    model = ORTModule(net)
    model.export(tmp_path / "m.onnx", torch.randn(3, 4))
    assert net.training and model.training
    for key, value in net.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    model(torch.randn(3, 4)).sum().backward()  # still trains through ONNX Runtime
    assert model.statistics.backward_runs == 1


def test_block_graphs_do_not_reach_the_deployment_file(tmp_path: Path) -> None:
    # torch.export reused one marked block's parameters for every instance on torch 2.11.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    with torch.no_grad():
        for index, block in enumerate(encoder.layers):
            block.linear2.bias.fill_(float(index))  # instances that differ
    model = ORTModule(encoder, blocks="auto")
    x = torch.randn(4, 6, 32)
    model(x).sum().backward()
    assert model.statistics.block_graphs >= 2, "the layers trained through block graphs"
    deployed = model.export(tmp_path / "encoder.onnx", x)
    (out,) = _run(deployed.path, src=x)
    torch.testing.assert_close(out, _eager(encoder, x), **TOLERANCE)
    assert len(marked_blocks(encoder)) == 3, "the blocks are marked again after the export"


class BranchAbove4(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * 2 if x.shape[0] > 4 else self.linear(x) * 3


@pytest.mark.parametrize("example_batch", [8, 2])
def test_a_branch_on_the_batch_size_gives_a_file_that_is_right_or_refuses_the_input(
    example_batch: int, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = BranchAbove4().eval()
    deployed = export_for_deployment(model, tmp_path / "b.onnx", (torch.randn(example_batch, 4),))
    assert deployed.inputs == {"x": (example_batch, 4)}, "the narrowed batch axis is static"
    session = ort.InferenceSession(str(deployed.path), providers=["CPUExecutionProvider"])
    for batch in (1, 2, 4, 5, 8):
        x = torch.randn(batch, 4)
        if batch != example_batch:
            with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument):
                session.run(None, {"x": x.numpy()})
            continue
        (out,) = session.run(None, {"x": x.numpy()})
        torch.testing.assert_close(torch.from_numpy(out), _eager(model, x), **TOLERANCE)


@pytest.mark.parametrize(
    "dynamic_shapes",
    [{"x": {0: "batch"}}, ({0: torch.export.Dim("batch")},), {"x": (torch.export.Dim.DYNAMIC, None)}],
    ids=["name", "Dim", "DYNAMIC"],
)
def test_a_narrowed_axis_asked_to_be_symbolic_names_the_guard_and_its_line(dynamic_shapes: Any, tmp_path: Path) -> None:
    pattern = r"axis 0 of input `x` was asked to be symbolic .* narrows it to \[5, inf\].*guard `x.shape\[0\] > 4` at "
    with pytest.raises(ExportError, match=pattern + re.escape(f"{Path(__file__)}:")):
        export_for_deployment(
            BranchAbove4().eval(), tmp_path / "b.onnx", (torch.randn(8, 4),), dynamic_shapes=dynamic_shapes
        )
    assert not (tmp_path / "b.onnx").exists()


def test_a_declared_range_is_kept_and_checked_at_its_low_edge(tmp_path: Path) -> None:
    model = BranchAbove4().eval()
    spec = ({0: torch.export.Dim("batch", min=5)},)
    deployed = export_for_deployment(model, tmp_path / "b.onnx", (torch.randn(8, 4),), dynamic_shapes=spec)
    assert deployed.inputs == {"x": ("batch", 4)}
    assert deployed.checked_shapes == (((8, 4),), ((16, 4),), ((5, 4),), ((6, 4),))


class BranchAbove1(BranchAbove4):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * 2 if x.shape[0] > 1 else self.linear(x) * 3  # torch.export assumes sizes above 1


def test_a_branch_at_the_range_edge_is_refused_by_the_check_and_leaves_no_file(tmp_path: Path) -> None:
    with pytest.raises(
        ExportError, match=r"differs from eager PyTorch .* on inputs of shapes \[\(1, 4\)\].*not written"
    ):
        export_for_deployment(BranchAbove1().eval(), tmp_path / "b.onnx", (torch.randn(8, 4),))
    assert list(tmp_path.iterdir()) == [], "no file and no staging folder are left behind"


def test_torch_export_dynamic_shapes_formats_are_accepted(tmp_path: Path) -> None:
    x = torch.randn(2, 4)
    batch = torch.export.Dim("rows")
    named = export_for_deployment(Pair(), tmp_path / "a.onnx", (x,), dynamic_shapes=({0: batch},))
    assert named.inputs == {"x": ("rows", 4)}
    per_axis = export_for_deployment(Pair(), tmp_path / "b.onnx", (x,), dynamic_shapes={"x": (batch, None)})
    assert per_axis.inputs == {"x": ("rows", 4)}
    automatic = export_for_deployment(
        Pair(), tmp_path / "c.onnx", (x,), dynamic_shapes={"x": {0: torch.export.Dim.AUTO}}
    )
    assert automatic.inputs == {"x": ("x_dim0", 4)}
    static = export_for_deployment(
        Pair(), tmp_path / "d.onnx", (x,), dynamic_shapes={"x": {0: torch.export.Dim.STATIC}}
    )
    assert static.inputs == {"x": (2, 4)}
    with pytest.raises(ValueError, match=r"dynamic_shapes has 2 entries for 1 arguments"):
        export_for_deployment(Pair(), tmp_path / "e.onnx", (x,), dynamic_shapes=({0: batch}, None))
    with pytest.raises(ValueError, match=r"dynamic_shapes\['x'\] has 1 entries for a 2-d tensor"):
        export_for_deployment(Pair(), tmp_path / "e.onnx", (x,), dynamic_shapes={"x": (batch,)})


class PaddedEncoderLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)  # nested tensors on: eager eval takes the fast path
        self.head = nn.Linear(32, 50)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids), src_key_padding_mask=padding))


def test_a_padded_example_through_a_transformer_encoder_is_compared_like_with_like(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = PaddedEncoderLM().eval()
    ids = torch.randint(0, 50, (3, 10))
    padding = torch.zeros(3, 10, dtype=torch.bool)
    padding[1, 6:] = padding[2, 3:] = True
    deployed = export_for_deployment(model, tmp_path / "lm.onnx", (ids, padding))
    assert deployed.max_error is not None and deployed.max_error < 1e-4
    (out,) = _run(deployed.path, ids=ids, padding=padding)
    with torch.no_grad():
        fast = model(ids, padding)
    kept = ~padding
    torch.testing.assert_close(out[kept], fast[kept], **TOLERANCE)  # positions a user reads agree with the fast path


@pytest.mark.parametrize(
    ("target", "reason"),
    [
        ("/proc/nope/m.onnx", r"No such file or directory"),
        ("/etc/hostname/m.onnx", r"/etc/hostname is a file, not a folder"),
        ("/sys/m.onnx", r"ermission denied|Operation not permitted|Read-only"),
    ],
)
def test_a_bad_path_fails_before_any_export(
    target: str, reason: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.onnx, "export", lambda *a, **k: pytest.fail("exported before checking the path"))
    with pytest.raises(ValueError, match=rf"path='{re.escape(target)}' cannot be written: .*({reason})"):
        export_for_deployment(Pair(), target, (torch.randn(2, 4),))
    with pytest.raises(ValueError, match=r"path='.*' is a folder; pass the path of the .onnx file"):
        export_for_deployment(Pair(), tmp_path, (torch.randn(2, 4),))


def test_a_bfloat16_model_the_cpu_provider_cannot_load_says_how_to_deploy_it(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(torch.bfloat16)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    target = tmp_path / "model.onnx"
    with pytest.raises(ExportError, match=r"cannot load the exported file.*float32 copy.*check=False") as caught:
        export_for_deployment(model, target, (x,))
    assert "bfloat16 parameters" in str(caught.value)
    assert not target.exists(), "an unchecked file must not be left in place"
    unchecked = export_for_deployment(model, target, (x,), check=False)
    assert unchecked.max_error is None and target.exists()
    onnx.checker.check_model(str(target))
