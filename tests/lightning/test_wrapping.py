"""Which submodules get wrapped, idempotence, and errors that leave the module unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from lightning_ort import ORTModule
from lightning_ort.wrapping import WrapConfig, default_module_names, wrap_submodules
from tests.lightning.models import TinyTransformerLM


def test_default_skips_metrics_losses_and_frozen_children() -> None:
    model = TinyTransformerLM()
    model.frozen = nn.Linear(2, 2).requires_grad_(False)
    assert default_module_names(model) == ["embed", "net", "head"]


def test_wrapping_is_idempotent_and_keeps_state_dict_keys() -> None:
    model = TinyTransformerLM()
    keys = list(model.state_dict())
    first = wrap_submodules(model, WrapConfig())
    second = wrap_submodules(model, WrapConfig())
    assert list(first) == ["embed", "net", "head"]
    assert all(first[name] is second[name] for name in first)
    assert list(model.state_dict()) == keys
    assert isinstance(model.loss_fn, nn.CrossEntropyLoss)


def test_explicit_and_dotted_names() -> None:
    model = TinyTransformerLM()
    wrapped = wrap_submodules(model, WrapConfig.from_arguments(modules=["net.layers.0", "head"]))
    assert list(wrapped) == ["net.layers.0", "head"]
    assert isinstance(model.net.layers[0], ORTModule)
    assert not isinstance(model.net.layers[1], ORTModule)


def test_unknown_name_lists_children_and_wraps_nothing() -> None:
    model = TinyTransformerLM()
    with pytest.raises(ValueError, match=r"has no submodule 'encoder'\. Its children are: embed, net, head"):
        wrap_submodules(model, WrapConfig.from_arguments(modules=["head", "encoder"]))
    assert not isinstance(model.head, ORTModule)
    with pytest.raises(ValueError, match=r"`net` has no submodule 'blocks'"):
        wrap_submodules(model, WrapConfig.from_arguments(modules=["net.blocks"]))


def test_name_inside_a_wrapped_module_is_refused() -> None:
    model = TinyTransformerLM()
    wrap_submodules(model, WrapConfig.from_arguments(modules=["net"]))
    with pytest.raises(ValueError, match="already an ORTModule"):
        wrap_submodules(model, WrapConfig.from_arguments(modules=["net.layers.0"]))


def test_each_wrapped_module_saves_under_its_own_prefix(tmp_path: Path) -> None:
    model = TinyTransformerLM()
    config = WrapConfig.from_arguments(save_onnx=True, onnx_prefix="lm", save_path=tmp_path)
    wrapped = wrap_submodules(model, config)
    assert {name: m.debug_options.onnx_prefix for name, m in wrapped.items()} == {
        "embed": "lm_embed",
        "net": "lm_net",
        "head": "lm_head",
    }
    assert WrapConfig().debug_options_for("net.layers.0").onnx_prefix == "net.layers.0"
