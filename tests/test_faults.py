"""Bad input and faults: clear errors, eager-like NaN handling, nothing half-modified."""

from __future__ import annotations

import copy

import pytest
import torch

import lightning_ort.engine.capture.aot as aot_module
from lightning_ort import ExportError, FallbackWarning, ORTModule, SessionError
from tests.zoo import MLP
from tests.zoo.features import CausalLM


def test_nan_and_inf_inputs_propagate_as_in_eager() -> None:
    torch.manual_seed(0)
    eager = MLP()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(4, 16)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    x_eager, x_ort = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, actual = eager(x_eager), wrapped(x_ort)
    assert torch.equal(actual.isnan(), expected.isnan()) and actual.isnan().any()
    finite = expected.isfinite()
    torch.testing.assert_close(actual[finite], expected[finite], rtol=1e-4, atol=1e-5)
    expected.sum().backward()
    actual.sum().backward()
    assert x_ort.grad is not None and x_eager.grad is not None
    assert torch.equal(x_ort.grad.isnan(), x_eager.grad.isnan())
    for a, e in zip(wrapped.parameters(), eager.parameters()):
        assert a.grad is not None and e.grad is not None
        assert torch.equal(a.grad.isnan(), e.grad.isnan())


def test_wrong_input_dtype_fails_as_eager_does() -> None:
    wrapped = ORTModule(MLP())
    with pytest.raises(RuntimeError, match="dtype"):
        wrapped(torch.randn(2, 16, dtype=torch.float64))
    assert wrapped.statistics.forward_runs == 0
    assert wrapped(torch.randn(2, 16)).shape == (2, 4)
    assert wrapped.statistics.forward_runs == 1


def test_input_on_another_device_fails_as_eager_does_and_builds_nothing() -> None:
    model = MLP()
    x = torch.randn(2, 16, device="meta")
    with pytest.raises(RuntimeError, match="device"):
        model(x)
    wrapped = ORTModule(model)
    with pytest.raises(RuntimeError, match="device"):
        wrapped(x)
    assert wrapped.statistics.cached_graphs == 0


def test_unspecialised_float_scalars_do_not_count_as_a_second_device() -> None:
    """``dynamic=True`` passes a ``LayerNorm``'s ``eps`` as a 0-dim float64 CPU tensor, also beside a CUDA model's
    tensors (faked here): the graph computes on CUDA; a CPU tensor of more dims is a second device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_ort.engine.fx.dynamic import tensor_devices

    with FakeTensorMode():
        on_cuda = torch.empty(2, 16, device="cuda")
    eps = torch.tensor(1e-5, dtype=torch.float64)
    assert tensor_devices([2, on_cuda, eps]) == {on_cuda.device}
    assert tensor_devices([eps, 1.0]) == {torch.device("cpu")}
    assert tensor_devices([on_cuda, eps, torch.ones(2)]) == {on_cuda.device, torch.device("cpu")}

    seen: list[list[object]] = []

    def spy(values: list[object]) -> set[torch.device]:
        seen.append(list(values))
        return tensor_devices(values)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(aot_module, "tensor_devices", spy)
        ORTModule(CausalLM(), dynamic=True)(torch.randint(0, 64, (2, 16))).sum().backward()
    scalars = [v for v in seen[0] if isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point()]
    assert scalars, "the case above is what TorchDynamo passes a dynamic graph"


def test_session_failure_mid_training_leaves_parameters_grads_and_optimizer_untouched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    model = ORTModule(MLP())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(8, 16)
    for _ in range(2):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    optimizer.zero_grad()
    parameters = copy.deepcopy(model.state_dict())
    optimizer_state = copy.deepcopy(optimizer.state_dict())

    loss = model(x).square().mean()
    for kind, session in model._backend.runners():
        if kind == "backward":  # the backward run fails inside ONNX Runtime
            monkeypatch.setattr(session, "_run", _broken_run)
    with pytest.raises(SessionError, match=r"(?s)failed while running the backward graph.*Nothing was written"):
        loss.backward()
    assert all(p.grad is None for p in model.parameters())
    for name, value in model.state_dict().items():
        assert torch.equal(value, parameters[name]), name
    assert optimizer.state_dict()["state"].keys() == optimizer_state["state"].keys()
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(optimizer_state["state"][index][key]))

    monkeypatch.undo()
    optimizer.zero_grad()
    model(x).square().mean().backward()  # the user retries: training continues
    optimizer.step()
    assert model.statistics.backward_runs == 3


def _broken_run(*args: object) -> None:
    raise RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : simulated kernel failure")


def test_a_failure_inside_our_own_export_code_runs_the_graph_in_pytorch_and_names_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import lightning_ort.engine.capture.build as build

    def broken_export(*args: object, **kwargs: object) -> None:
        raise KeyError("val")

    monkeypatch.setattr(build, "export_graph", broken_export)
    torch.manual_seed(0)
    eager = MLP()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(4, 16)
    with pytest.warns(FallbackWarning, match=r"runs in PyTorch.*KeyError: 'val' \(at .*test_faults\.py:\d+\)"):
        actual = wrapped(x)
    torch.testing.assert_close(actual, eager(x))
    assert wrapped.statistics.eager_signatures == 1 and wrapped.statistics.forward_runs == 0

    strict = ORTModule(MLP(), fallback="raise")
    with pytest.raises(ExportError, match=r"KeyError: 'val'.*This is a bug in lightning_ort"):
        strict(x)


def test_transposed_convolution_with_output_padding_past_its_stride_runs_in_pytorch() -> None:
    torch.manual_seed(0)
    eager = torch.nn.ConvTranspose2d(2, 4, 3, stride=2, output_padding=2, dilation=3)
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(2, 2, 5, 5)
    with pytest.warns(FallbackWarning, match=r"output_padding.*Nothing else in that graph runs in ONNX Runtime"):
        actual = wrapped(x)
    torch.testing.assert_close(actual, eager(x), rtol=1e-4, atol=1e-5)
    assert wrapped.statistics.fallback_ops == 1
