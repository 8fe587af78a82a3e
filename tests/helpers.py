"""Shared helpers for comparing ORTModule against eager PyTorch."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper
from torch.utils._pytree import tree_leaves, tree_map_only

from lightning_ort.engine.onnx.custom_ops import DOMAIN
from lightning_ort.engine.runtime import cpu_kernels

OUTPUT_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
GRAD_TOLERANCE = {"rtol": 1e-3, "atol": 1e-4}


def session_with_kernels(model: onnx.ModelProto) -> ort.InferenceSession:
    """A CPU session of ``model`` that finds lightning_ort's kernels, where it uses them."""
    options = ort.SessionOptions()
    cpu_kernels.register_kernels(options, model)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def kernel_session(node: onnx.NodeProto, inputs: dict[str, Sequence[int] | None]) -> ort.InferenceSession:
    """A CPU session of one node of lightning_ort's kernels, its float32 ``inputs`` named with their shapes
    (``None``: any shape) and its outputs those the node names."""
    graph = helper.make_graph(
        [node],
        node.op_type,
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in inputs.items()],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in node.output],
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)]
    return session_with_kernels(helper.make_model(graph, opset_imports=opsets, ir_version=10))


def input_gradient_model(out_channels: int, in_channels: int, kernel: int) -> onnx.ModelProto:
    """A convolution's input gradient as the decomposition exports it: the forward weight ``w`` transposed and
    its taps reversed by the exchange matrix, convolved with the output gradient ``gy``."""
    taps = kernel * kernel
    constants = {
        "grouped_shape": np.array([1, out_channels, in_channels, kernel, kernel], np.int64),
        "taps_shape": np.array([-1, taps], np.int64),
        "exchange": np.eye(taps, dtype=np.float32)[::-1].copy(),
        "kernel_shape": np.array([in_channels, out_channels, kernel, kernel], np.int64),
    }
    nodes = [
        helper.make_node("Reshape", ["w", "grouped_shape"], ["grouped"], "node_view"),
        helper.make_node("Transpose", ["grouped"], ["swapped"], "node_permute", perm=[0, 2, 1, 3, 4]),
        helper.make_node("Reshape", ["swapped", "taps_shape"], ["taps"], "node_view_1"),
        helper.make_node("MatMul", ["taps", "exchange"], ["reversed"], "node_mm"),
        helper.make_node("Reshape", ["reversed", "kernel_shape"], ["flipped"], "node_view_2"),
        helper.make_node("Conv", ["gy", "flipped"], ["gx"], "node_convolution", pads=[kernel // 2] * 4),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [out_channels, in_channels, kernel, kernel]),
            helper.make_tensor_value_info("gy", TensorProto.FLOAT, [2, out_channels, 6, 6]),
        ],
        [helper.make_tensor_value_info("gx", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(value, name) for name, value in constants.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    return onnx.shape_inference.infer_shapes(model)


def clone_inputs(value: Any) -> Any:
    """Deep copy of an argument tree: same values, strides and ``requires_grad``, fresh leaves."""
    return tree_map_only(
        torch.Tensor,
        lambda t: t.detach().clone().requires_grad_(t.requires_grad),
        value,
    )


def leaf_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in an argument or output tree: containers, named tuples and dataclasses, in order."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return leaf_tensors([getattr(value, f.name) for f in dataclasses.fields(value)])
    leaves = tree_leaves(value)
    if len(leaves) == 1 and leaves[0] is value:
        return [value] if isinstance(value, torch.Tensor) else []
    return [tensor for leaf in leaves for tensor in leaf_tensors(leaf)]


def weighted_loss(output: Any) -> torch.Tensor:
    """A scalar depending on every differentiable output, with fixed pseudo-random cotangents."""
    terms = []
    g = torch.Generator().manual_seed(1234)
    for tensor in leaf_tensors(output):
        if tensor.requires_grad and tensor.is_floating_point():
            weights = torch.randn(tensor.shape, generator=g).to(tensor.device)
            terms.append((tensor * weights).sum())
    return sum(terms[1:], start=terms[0]) if terms else torch.zeros(())


def assert_same_structure(actual: Any, expected: Any) -> None:
    """Same container types and same non-tensor leaves."""
    assert type(actual) is type(expected), f"{type(actual)} != {type(expected)}"
    placeholder = object()
    strip = (
        tree_map_only(torch.Tensor, lambda _: placeholder, actual),
        tree_map_only(torch.Tensor, lambda _: placeholder, expected),
    )
    if isinstance(actual, (tuple, list, dict)):
        assert strip[0] == strip[1]


def assert_outputs_close(actual: Any, expected: Any) -> None:
    assert_same_structure(actual, expected)
    actual_tensors, expected_tensors = leaf_tensors(actual), leaf_tensors(expected)
    assert len(actual_tensors) == len(expected_tensors)
    for a, e in zip(actual_tensors, expected_tensors):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert a.requires_grad == e.requires_grad
        torch.testing.assert_close(a, e, **OUTPUT_TOLERANCE)


def assert_grads_close(
    actual: torch.nn.Module,
    expected: torch.nn.Module,
    rtol: float = GRAD_TOLERANCE["rtol"],
    atol: float = GRAD_TOLERANCE["atol"],
) -> None:
    """Each parameter's gradient in ``actual`` (the ORTModule) is ``expected``'s within ``rtol`` and ``atol``, and
    one is missing exactly where the other is."""
    for (name, a), (_, e) in zip(actual.named_parameters(), expected.named_parameters(), strict=True):
        if e.grad is None:
            assert a.grad is None, f"{name}: ORT produced a gradient where eager has none"
            continue
        assert a.grad is not None, f"{name}: no gradient from ORT"
        torch.testing.assert_close(a.grad, e.grad, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


FP64_MULTIPLE = 3.0
FP64_SLACK = 1e-4


def _relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.double() - reference).norm() / reference.norm().clamp_min(1e-30))


def float64_drift(
    names: Sequence[str],
    ort: Sequence[torch.Tensor | None],
    eager: Sequence[torch.Tensor | None],
    reference: Sequence[torch.Tensor | None],
    perturbed: Sequence[Sequence[torch.Tensor | None]] = (),
) -> str:
    """The first of ``names`` whose ORT value is further from the float64 ``reference`` than allowed, or ``""``.

    Allowed: :data:`FP64_MULTIPLE` times eager float32's relative distance, plus :data:`FP64_SLACK`. With
    ``perturbed`` (eager float32's values for inputs perturbed by a few float32 ulps), eager's distance is the
    largest of those runs' (see :func:`assert_fp64_accuracy`).
    """
    for index, (name, mine, exact) in enumerate(zip(names, ort, reference, strict=True)):
        if exact is None:
            continue
        theirs = [eager[index], *(run[index] for run in perturbed)]
        if mine is None or any(value is None for value in theirs):
            return f"{name}: no value from {'ORT' if mine is None else 'eager'} where float64 has one"
        allowed = FP64_MULTIPLE * max(_relative(value, exact) for value in theirs if value is not None) + FP64_SLACK
        error = _relative(mine, exact)
        if error > allowed:
            return f"{name}: ORT's distance to float64 {error:.2e} > {allowed:.2e} (3x eager's + 1e-4)"
    return ""


PERTURBATION = 1e-6
"""Relative size of the input perturbations of :func:`assert_fp64_accuracy` (about 8 float32 ulps)."""


def assert_fp64_accuracy(
    eager: torch.nn.Module, wrapped: torch.nn.Module, *inputs: torch.Tensor, perturbations: int = 0
) -> None:
    """ORT's outputs and parameter gradients are as close to float64's as eager float32's are.

    A float64 copy of ``eager`` is the reference (torch._dynamo's accuracy checker does the same): each
    relative distance of ``wrapped`` to it must stay within :data:`FP64_MULTIPLE` times eager float32's, plus
    :data:`FP64_SLACK`. This tells float32 noise, which deep nets amplify, from drift.

    Eager float32 runs the same ops as float64 with each result rounded, so its distance is rounding alone. A
    net whose gradients change with which near-zero pre-activations a ReLU lets through (thousands of ReLUs
    after batch norm) gets another gradient from any float32 computation that rounds differently, ONNX
    Runtime's or PyTorch's own on a slightly different input. ``perturbations`` measures that: eager float32
    also runs on that many copies of the inputs perturbed by :data:`PERTURBATION` (relative), and eager's
    distance is the largest of its runs'. A model whose inputs are all integers (token ids) has copies of its
    parameters perturbed instead.

    Args:
        eager: the float32 model; ``wrapped`` runs a copy of it.
        wrapped: the ORTModule (its parameters equal ``eager``'s).
        inputs: float32 inputs.
        perturbations: eager runs on perturbed inputs (or with perturbed parameters).
    """
    reference = copy.deepcopy(eager).double()
    generator = torch.Generator().manual_seed(99)

    def perturb(x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            return x
        return x * (1 + PERTURBATION * torch.randn(x.shape, generator=generator, dtype=x.dtype))

    def perturbed_run(index: int) -> tuple[str, torch.nn.Module, list[torch.Tensor]]:
        model = copy.deepcopy(eager)
        if not any(x.is_floating_point() for x in inputs):
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.copy_(perturb(parameter))
        return f"perturbed{index}", model, [perturb(x) for x in inputs]

    runs = [
        ("float64", reference, [x.double() if x.is_floating_point() else x for x in inputs]),
        ("eager", eager, list(inputs)),
        ("ort", wrapped, list(inputs)),
        *(perturbed_run(i) for i in range(perturbations)),
    ]
    results = {}
    for name, model, args in runs:
        model.zero_grad()
        output = model(*args)
        weighted_loss(output).backward()
        results[name] = (
            [t.detach() for t in leaf_tensors(output)],
            [p.grad for p in model.parameters()],
        )
    names = ["output"] * len(results["eager"][0]) + [n for n, _ in eager.named_parameters()]
    values = {key: [*outs, *grads] for key, (outs, grads) in results.items()}
    perturbed = [values[f"perturbed{i}"] for i in range(perturbations)]
    drift = float64_drift(names, values["ort"], values["eager"], values["float64"], perturbed)
    assert not drift, drift


def tiny_llama() -> torch.nn.Module:
    """Hugging Face ``LlamaForCausalLM`` with 2 layers of width 64, 4 heads over 2 key-value heads, 128 tokens."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)
