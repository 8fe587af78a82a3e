"""ORTModule behaves as the module it wraps: state, modes, copies, optimizers, RNG, errors."""

from __future__ import annotations

import copy
import logging
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_ort import DebugOptions, ExportError, FallbackWarning, ORTModule, ORTModuleError, SessionError
from tests.zoo import MLP, ConvBN, Shared


def test_state_dict_keys_parameters_and_module_are_the_wrapped_ones() -> None:
    model = ConvBN()
    wrapped = ORTModule(model)
    assert list(wrapped.state_dict()) == list(model.state_dict())
    assert all(a is b for a, b in zip(wrapped.parameters(), model.parameters()))
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert wrapped.module is model
    parent = nn.Sequential(wrapped)
    assert list(parent.state_dict()) == list(nn.Sequential(ConvBN()).state_dict())


def test_load_state_dict_round_trip_through_a_parent() -> None:
    source, target = ORTModule(MLP()), ORTModule(MLP())
    target.load_state_dict(source.state_dict())
    x = torch.randn(3, 16)
    torch.testing.assert_close(target(x), source(x))
    parent = nn.Sequential(ORTModule(MLP()))
    parent.load_state_dict(nn.Sequential(source.module).state_dict(), strict=True)
    torch.testing.assert_close(parent(x), source(x))


def test_optimizer_steps_change_outputs_because_parameters_are_inputs() -> None:
    wrapped = ORTModule(MLP())
    x = torch.randn(4, 16)
    before = wrapped(x)
    before.square().mean().backward()
    torch.optim.SGD(wrapped.parameters(), lr=0.5).step()
    after = wrapped(x)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, wrapped.module(x), rtol=1e-4, atol=1e-5)
    assert wrapped.statistics.cache_misses == 1


def test_batchnorm_running_stats_update_as_in_eager() -> None:
    eager = ConvBN()
    wrapped = ORTModule(copy.deepcopy(eager))
    for _ in range(3):
        x = torch.randn(4, 3, 8, 8)
        eager(x)
        wrapped(x)
    for (name, a), (_, e) in zip(wrapped.named_buffers(), eager.named_buffers()):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert int(wrapped.module.features[1].num_batches_tracked) == 3


def test_train_eval_and_no_grad_pick_separate_graphs() -> None:
    wrapped = ORTModule(ConvBN())
    x = torch.randn(2, 3, 8, 8)
    wrapped(x).sum().backward()
    wrapped.eval()
    assert not wrapped.training and not wrapped.module.training
    assert not wrapped.module.features[1].training
    with torch.no_grad():
        out = wrapped(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, wrapped.module(x), rtol=1e-4, atol=1e-5)
    stats = wrapped.statistics
    assert stats.cache_misses == 2
    assert stats.backward_runs == 1 and stats.forward_runs == 2
    assert wrapped.graphs == ["forward", "backward", "inference"]


def test_to_float64_builds_a_graph_for_the_new_dtype() -> None:
    wrapped = ORTModule(Shared())
    wrapped(torch.randn(3, 8))
    wrapped.to(torch.float64)
    x = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(wrapped(x), wrapped.module(x))
    assert wrapped.module.step.weight.dtype == torch.float64
    assert wrapped.statistics.cache_misses == 2


def test_pickle_and_deepcopy_keep_weights_and_sharing() -> None:
    wrapped = ORTModule(Shared())
    x = torch.randn(2, 8)
    expected = wrapped(x)
    for clone in (copy.deepcopy(wrapped), pickle.loads(pickle.dumps(wrapped))):
        assert clone.module.left.weight is clone.module.right.weight
        assert clone._parameters is clone.module._parameters
        torch.testing.assert_close(clone(x), expected)
        assert clone.statistics.cache_misses == 1


def test_add_module_and_module_assignment_raise() -> None:
    wrapped = ORTModule(MLP())
    with pytest.raises(ORTModuleError, match="add_module"):
        wrapped.add_module("extra", nn.Linear(2, 2))
    with pytest.raises(ORTModuleError, match="before wrapping"):
        wrapped.extra = nn.Linear(2, 2)
    assert "extra" not in dict(wrapped.module.named_children())


def test_wrapping_twice_or_after_ddp_is_refused() -> None:
    with pytest.raises(ORTModuleError, match="only once"):
        ORTModule(ORTModule(MLP()))
    with pytest.raises(TypeError, match=r"wraps a torch\.nn\.Module"):
        ORTModule(lambda x: x)  # type: ignore[arg-type]
    with pytest.raises(ORTModuleError, match=r"before DataParallel does"):
        ORTModule(nn.DataParallel(MLP()))


def test_attribute_access_falls_back_to_the_wrapped_module() -> None:
    model = MLP()
    model.hidden_size = 32  # type: ignore[assignment]
    assert ORTModule(model).hidden_size == 32


class _Sampler(MLP):
    """A model with a ``generate`` of its own (not Hugging Face's) that calls ``self``."""

    def generate(self, x: torch.Tensor, steps: int) -> torch.Tensor:
        for _ in range(steps):
            x = torch.cat([x[:, 4:], self(x)], dim=1)
        return x


def test_a_models_own_methods_call_the_wrapper() -> None:
    wrapped = ORTModule(_Sampler())
    x = torch.randn(2, 16)
    with torch.no_grad():
        generated = wrapped.generate(x, steps=3)
        torch.testing.assert_close(generated, wrapped.module.generate(x, steps=3))
    assert wrapped.statistics.forward_runs == 3, "each self(x) inside the model's method runs in ONNX Runtime"


class _Around(nn.Module):
    """Code of the caller's own around an ORTModule: what an outer ``torch.compile`` compiles."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.pre = nn.Linear(16, 16)
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(torch.tanh(self.pre(x))) * 2


def test_an_outer_torch_compile_compiles_around_the_wrapped_module() -> None:
    torch.manual_seed(0)
    eager = _Around(MLP())
    wrapped = ORTModule(copy.deepcopy(eager.body))
    outer = _Around(wrapped)
    outer.pre.load_state_dict(eager.pre.state_dict())
    compiled = torch.compile(outer)
    x = torch.randn(4, 16)
    for _ in range(2):
        eager(x).sum().backward()
        compiled(x).sum().backward()
    for (name, expected), actual in zip(eager.named_parameters(), outer.parameters(), strict=True):
        torch.testing.assert_close(actual.grad, expected.grad, msg=lambda m, n=name: f"{n}: {m}")
    stats = wrapped.statistics
    assert (stats.forward_runs, stats.backward_runs, stats.graphs) == (2, 2, 1)


def test_capture_and_export_leave_the_rng_state_alone() -> None:
    wrapped = ORTModule(ConvBN())
    torch.manual_seed(123)
    state = torch.get_rng_state()
    wrapped(torch.ones(2, 3, 8, 8)).sum().backward()
    assert torch.equal(torch.get_rng_state(), state)


class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x)) + torch.rand_like(x) * 0.01


def test_dropout_runs_in_ort_and_is_reproducible_with_manual_seed() -> None:
    model = DropoutNet()
    with torch.no_grad():
        model.lin.bias.fill_(5.0)
    x = torch.randn(64, 32, requires_grad=True)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        wrapped = ORTModule(copy.deepcopy(model))
        torch.manual_seed(5)
        out = wrapped(x)
        (grad,) = torch.autograd.grad(out.sum(), x)
        assert wrapped.statistics.forward_runs == 1 and wrapped.statistics.backward_runs == 1
        return out, grad

    (out1, grad1), (out2, grad2) = run(), run()
    torch.testing.assert_close(out1, out2)
    torch.testing.assert_close(grad1, grad2)
    kept = (out1 > 1.0).float()
    assert 0.3 < kept.mean().item() < 0.7
    torch.testing.assert_close(grad1, (kept * 2) @ model.lin.weight, rtol=1e-4, atol=1e-4)
    torch.manual_seed(6)
    assert not torch.equal(ORTModule(copy.deepcopy(model))(x), out1)


def test_unsupported_argument_fails_as_eager_does_and_changes_nothing() -> None:
    wrapped = ORTModule(MLP())
    before = [p.detach().clone() for p in wrapped.parameters()]
    with pytest.raises(TypeError, match="must be Tensor, not str"):
        wrapped("hello")
    assert all(torch.equal(a, b) for a, b in zip(before, wrapped.parameters()))
    assert wrapped.statistics.forward_runs == 0


class Untranslatable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.odd = OddOp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.odd(self.pre(x))


class OddOp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.special.zeta(x, x + 2)


def test_export_failure_names_the_op_and_module_and_keeps_module_intact() -> None:
    model = Untranslatable()
    before = copy.deepcopy(model.state_dict())
    wrapped = ORTModule(model, fallback="raise")
    with pytest.raises(ExportError, match=r"zeta.*module `odd` \(OddOp\)"), torch.no_grad():
        wrapped(torch.rand(2, 4))
    assert wrapped.statistics.cache_misses == 0 and wrapped.statistics.cached_graphs == 0
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


def test_unwritable_save_path_fails_at_construction(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match=r"save_path=.*cannot be written"):
        DebugOptions(save_onnx=True, onnx_prefix="m", save_path=blocker / "models")


def test_missing_kernel_names_the_graph_module_and_provider() -> None:
    wrapped = ORTModule(MLP().double(), fallback="raise")
    with (
        pytest.raises(
            SessionError, match=r"MLP: ONNX Runtime could not load the inference graph .*CPUExecutionProvider.*Erf"
        ),
        torch.no_grad(),
    ):
        wrapped(torch.randn(2, 16, dtype=torch.float64))
    assert wrapped.statistics.cached_graphs == 0


def test_missing_kernel_runs_just_that_op_in_pytorch_by_default() -> None:
    # float64 Erf has no CPU kernel and ONNX Runtime's failure names only ONNX nodes: bisection finds GELU.
    model = MLP().double()
    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(2, 16, dtype=torch.float64)
    with (
        pytest.warns(FallbackWarning, match=r"inference graph runs 1 op\(s\) in PyTorch: bisection .*aten\.gelu"),
        torch.no_grad(),
    ):
        torch.testing.assert_close(wrapped(x), model(x))
    stats = wrapped.statistics
    assert stats.eager_signatures == 0 and stats.fallback_ops == 1 and stats.forward_runs == 1


def test_wrapped_submodules_named_like_the_wrappers_properties_come_first() -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    class Network(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.graphs = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
            self.module = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.graphs:
                x = layer(x)
            return self.module(x)

    holder = nn.Module()
    holder.net = ORTModule(Network())
    assert isinstance(holder.net.graphs, nn.ModuleList) and isinstance(holder.net.module, nn.Linear)
    assert list(get_model_state_dict(holder)) == [name for name, _ in holder.named_parameters()]
    holder.net(torch.randn(3, 4)).sum().backward()
    assert holder.net.statistics.backward_runs == 1


def test_a_hugging_face_models_calls_log_no_torchdynamo_error() -> None:
    # Skipping Hugging Face's logger.warning_once while tracing must not make TorchDynamo fail to record its
    # compilation metrics (torch 2.11 logged a TypeError traceback at ERROR level for every compilation).
    transformers = pytest.importorskip("transformers")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    try:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        ORTModule(model)(input_ids=ids, labels=ids).loss.backward()
    finally:
        logger.removeHandler(handler)
    assert [record.getMessage() for record in records] == []
