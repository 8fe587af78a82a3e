"""Which submodules get wrapped, idempotence, and errors that leave the module unchanged."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_ort import ORTCallback, ORTDDPStrategy, ORTFSDPStrategy, ORTModule, ORTSingleDeviceStrategy
from lightning_ort.engine.capture import aot
from lightning_ort.lightning.config import ORTConfig
from lightning_ort.lightning.wrapping import default_module_names, wrap_submodules
from tests.lightning.models import TinyTransformerLM


def test_default_skips_metrics_losses_and_frozen_children() -> None:
    model = TinyTransformerLM()
    model.frozen = nn.Linear(2, 2).requires_grad_(False)
    assert default_module_names(model) == ["embed", "net", "head"]


def test_wrapping_is_idempotent_and_keeps_state_dict_keys() -> None:
    model = TinyTransformerLM()
    keys = list(model.state_dict())
    first = wrap_submodules(model, ORTConfig())
    second = wrap_submodules(model, ORTConfig())
    assert list(first) == ["embed", "net", "head"]
    assert all(first[name] is second[name] for name in first)
    assert list(model.state_dict()) == keys
    assert isinstance(model.loss_fn, nn.CrossEntropyLoss)


def test_explicit_and_dotted_names() -> None:
    model = TinyTransformerLM()
    wrapped = wrap_submodules(model, ORTConfig(modules=["net.layers.0", "head"]))
    assert list(wrapped) == ["net.layers.0", "head"]
    assert isinstance(model.net.layers[0], ORTModule)
    assert not isinstance(model.net.layers[1], ORTModule)


def test_unknown_name_lists_children_and_wraps_nothing() -> None:
    model = TinyTransformerLM()
    with pytest.raises(ValueError, match=r"has no submodule 'encoder'\. Its children are: embed, net, head"):
        wrap_submodules(model, ORTConfig(modules=["head", "encoder"]))
    assert not isinstance(model.head, ORTModule)
    with pytest.raises(ValueError, match=r"`net` has no submodule 'blocks'"):
        wrap_submodules(model, ORTConfig(modules=["net.blocks"]))


def test_each_network_takes_the_dynamic_axes_its_forward_has() -> None:
    model = TinyTransformerLM()
    wrapped = wrap_submodules(model, ORTConfig(dynamic_axes={"src": [0, 1], "input": [0]}))
    assert {name: m.dynamic_axes for name, m in wrapped.items()} == {
        "embed": {"input": (0,)},  # nn.Embedding.forward(input)
        "net": {"src": (0, 1)},  # nn.TransformerEncoder.forward(src, mask, ...)
        "head": {"input": (0,)},
    }


def test_dynamic_axes_no_network_takes_are_refused_before_wrapping() -> None:
    model = TinyTransformerLM()
    with pytest.raises(ValueError, match=r"dynamic_axes names \['ids'\], which no wrapped network's forward takes"):
        wrap_submodules(model, ORTConfig(dynamic_axes={"ids": [0, 1]}))
    assert not any(isinstance(m, ORTModule) for m in model.modules())
    with pytest.raises(ValueError, match="dynamic=False builds one graph per shape"):
        ORTConfig(dynamic=False, dynamic_axes={"src": [0]})


def test_name_inside_a_wrapped_module_is_refused() -> None:
    model = TinyTransformerLM()
    wrap_submodules(model, ORTConfig(modules=["net"]))
    with pytest.raises(ValueError, match="already an ORTModule"):
        wrap_submodules(model, ORTConfig(modules=["net.layers.0"]))


def test_each_wrapped_module_saves_under_its_own_prefix(tmp_path: Path) -> None:
    model = TinyTransformerLM()
    config = ORTConfig(save_onnx=True, onnx_prefix="lm", save_path=tmp_path)
    wrapped = wrap_submodules(model, config)
    assert {name: m.debug_options.onnx_prefix for name, m in wrapped.items()} == {
        "embed": "lm_embed",
        "net": "lm_net",
        "head": "lm_head",
    }
    assert ORTConfig().debug_options_for("net.layers.0").onnx_prefix == "net.layers.0"


@pytest.mark.parametrize(("blocks", "block_graphs"), [("auto", 0), (["TransformerEncoderLayer"], 2)])
def test_automatic_blocks_stay_automatic_in_the_wrapped_networks(
    blocks: str | list[str], block_graphs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``blocks="auto"`` a wrapped network weighs its blocks' work as ``ORTModule(blocks="auto")`` does and
    inlines light ones; named classes keep their graphs (the CPU has no threshold: one is set for the test)."""
    monkeypatch.setattr(aot, "BLOCK_FLOPS", {"cpu": 1e12})
    model = TinyTransformerLM()
    net = wrap_submodules(model, ORTConfig(modules=["net"], blocks=blocks))["net"]
    assert [cls.__name__ for cls in net.block_classes] == ["TransformerEncoderLayer"]
    model(torch.randint(0, 40, (2, 9))).sum().backward()
    assert net.statistics.block_graphs == block_graphs


@pytest.mark.parametrize("owner", [ORTCallback, ORTDDPStrategy, ORTSingleDeviceStrategy, ORTFSDPStrategy])
def test_strategies_and_callback_pass_every_wrapping_argument_through(owner: type, tmp_path: Path) -> None:
    # Each declares all of ORTConfig's arguments, by the same names and types, and hands each one on.
    arguments = {
        "modules": ["net"],
        "save_onnx": True,
        "log_level": "ERROR",
        "onnx_prefix": "run",
        "save_path": str(tmp_path),
        "profile": True,
        "providers": ["CPUExecutionProvider"],
        "optimization_level": "basic",
        "intra_op_num_threads": 1,
        "allow_spinning": False,
        "release_torch_threads": False,
        "cpu_matmul": "mlas",
        "cuda_memory": "shared_arena",
        "cuda_graph": True,
        "attention": "torch",
        "conv_weight_grad": "onnx",
        "fallback": "raise",
        "cache_dir": str(tmp_path / "cache"),
        "dynamic": True,
        "blocks": ["TransformerEncoderLayer"],
        "dynamic_axes": {"src": [0, 1]},
        "export_onnx": str(tmp_path / "deploy"),
    }
    declared = inspect.signature(owner).parameters
    assert set(arguments) | {"log_metrics", "prog_bar"} == set(ORTConfig.argument_names())
    assert all(declared[name].annotation is not inspect.Parameter.empty for name in ORTConfig.argument_names())
    assert declared["log_level"].default == "WARNING" and declared["blocks"].default == "auto"
    made = owner(**arguments)
    config = made.config if isinstance(made, ORTCallback) else made.ort_callback.config
    assert config == ORTConfig(**arguments)
    assert not config.session_settings.allow_spinning
    assert not config.session_settings.release_torch_threads
    assert config.session_settings.cpu_matmul == "mlas"
    assert config.session_settings.cuda_memory == "shared_arena" and config.module_options.attention == "torch"
    assert config.module_options.conv_weight_grad == "onnx"
    assert config.session_settings.cuda_graph
    assert config.debug_options.profile
    assert config.blocks == ("TransformerEncoderLayer",)
    assert config.export_paths(["net"]) == {"net": tmp_path / "deploy" / "net.onnx"}


@pytest.mark.parametrize("owner", [ORTCallback, ORTDDPStrategy, ORTSingleDeviceStrategy, ORTFSDPStrategy])
def test_an_unknown_or_bad_ort_argument_fails_at_construction(owner: type) -> None:
    with pytest.raises(TypeError, match="save_onx"):
        owner(save_onx=True)
    with pytest.raises(ValueError, match="log_level='LOUD'"):
        owner(log_level="LOUD")
