"""Training-mode batch norm, and a ReLU or ReLU6 right after it (or after a residual add), as fused ONNX Runtime
kernels on CPU.

ONNX has no training-mode batch norm, and the public onnxruntime wheel no training kernels, so its standard form
is a chain of separate nodes: the means, the centred input and its square, ``BatchNormalization`` with the batch
statistics and ``Relu`` (or ``Clip``) in the forward; about nine in the backward (the activation's mask, two
sums, the scaled difference), each a full pass over the activation. lightning_ort's own CPU kernels
(``engine/runtime/batch_norm_kernels.cpp``) take two passes each way: the per-channel sums, then the elementwise
result.

:func:`fuse_batch_norms` points TorchDynamo's ``F.batch_norm`` calls in training mode, together with an
``F.relu``, ``F.relu6`` or ``F.hardtanh`` that is their only consumer (a clamp of the output), or that alone
consumes their sum with another tensor (a residual block's ``relu(bn(conv(h)) + skip)``), at
:func:`batch_norm_training`: an autograd function over PyTorch ops (:data:`BATCH_NORM_TRAINING` and
:data:`BATCH_NORM_TRAINING_BACKWARD`, and their residual forms :data:`BATCH_NORM_ADD_TRAINING` and
:data:`BATCH_NORM_ADD_TRAINING_BACKWARD`), which the export translates to the kernels
(:mod:`lightning_ort.engine.onnx.custom_ops`). Their PyTorch implementations compute the same values,
for a graph that runs in PyTorch. The forward ops also return the updated running statistics, which the graph
copies into the buffers, as ``F.batch_norm`` updates them in place.
"""

from __future__ import annotations

import inspect
import math
import operator
from typing import Any

import torch
import torch.fx
from torch.nn import functional as F

from lightning_ort.engine.fx.decompositions import channel_layout
from lightning_ort.engine.fx.precision import computed_in_float32, in_compute_dtype


@torch.library.custom_op("lightning_ort::batch_norm_training", mutates_args=())
def batch_norm_training_op(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    momentum: float,
    eps: float,
    clamp: bool,
    low: float,
    high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch norm with the batch's statistics, then clamped to ``[low, high]`` if ``clamp``:
    ``(output, mean, invstd, new_running_mean, new_running_var)``.

    ReLU is the clamp to ``[0, inf]``, ReLU6 to ``[0, 6]``. ``invstd = 1 / sqrt(var + eps)`` with the biased
    variance; the running statistics are updated as PyTorch updates them (``momentum`` times the batch's mean or
    unbiased variance, plus ``1 - momentum`` times the running value). ``input`` is ``[N, C, ...]``, the others
    ``[C]``. ONNX Runtime runs it as ``ai.lightning_ort::BatchNormTraining``.

    Example:
        >>> x, w, b, mean, var = torch.randn(4, 3, 5, 5), torch.rand(3), torch.randn(3), torch.zeros(3), torch.ones(3)
        >>> out, *_ = batch_norm_training_op(x, w, b, mean, var, 0.1, 1e-5, True, 0.0, math.inf)
        >>> torch.allclose(out, torch.relu(F.batch_norm(x, mean, var, w, b, True, 0.1, 1e-5)), atol=1e-5)
        True
    """
    return _batch_norm_training(input, weight, bias, running_mean, running_var, None, momentum, eps, clamp, low, high)


def _batch_norm_training(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    residual: torch.Tensor | None,
    momentum: float,
    eps: float,
    clamp: bool,
    low: float,
    high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward ops' PyTorch form; ``residual`` is added before the clamp. 16-bit operands are computed in
    float32, as the kernels compute them; the output has ``input``'s dtype, the statistics ``weight``'s."""
    dims, _, count = channel_layout(input)
    x, scale, shift, running_mean, running_var = in_compute_dtype(input, weight, bias, running_mean, running_var)
    var, mean = torch.var_mean(x, dims, correction=0)
    invstd = torch.rsqrt(var + eps)
    output = _normalized(x, scale, shift, mean, invstd)
    if residual is not None:
        output = output + in_compute_dtype(residual)[0]
    if clamp:
        output = output.clamp(low, high)
    new_running_mean = momentum * mean + (1 - momentum) * running_mean
    new_running_var = momentum * (var * (count / max(count - 1, 1))) + (1 - momentum) * running_var
    per_channel = weight.dtype
    return (
        output.to(input.dtype),
        mean.to(per_channel),
        invstd.to(per_channel),
        new_running_mean.to(per_channel),
        new_running_var.to(per_channel),
    )


def _normalized(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor
) -> torch.Tensor:
    """``input * a + b`` with ``a = weight * invstd`` and ``b = bias - mean * a`` per channel: the form the
    kernels (and PyTorch's CPU kernel) compute, from which the backward recomputes the clamp's mask."""
    _, shape, _ = channel_layout(input)
    scale = weight * invstd
    return input * scale.reshape(shape) + (bias - mean * scale).reshape(shape)


@batch_norm_training_op.register_fake
def _batch_norm_training_fake(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    momentum: float,
    eps: float,
    clamp: bool,
    low: float,
    high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    per_channel = torch.empty_like(weight)
    return torch.empty_like(input), per_channel, per_channel.clone(), per_channel.clone(), per_channel.clone()


@torch.library.custom_op("lightning_ort::batch_norm_training_backward", mutates_args=())
def batch_norm_training_backward_op(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    clamp: bool,
    low: float,
    high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`batch_norm_training_op`'s ``output``: ``(grad_input, grad_weight, grad_bias)``.

    With ``clamp``, ``grad_output`` is kept only where the normalized value was strictly inside ``[low, high]``
    (above ``low`` for an infinite ``high``), as PyTorch's ReLU and hardtanh gradients keep it; the normalized
    value is recomputed from ``input``, so the forward's result need not be kept for it. ONNX Runtime runs it as
    ``ai.lightning_ort::BatchNormTrainingGrad``.

    Example:
        >>> x, w, b, g = torch.randn(4, 3, 5, 5), torch.rand(3), torch.randn(3), torch.randn(4, 3, 5, 5)
        >>> out, mean, invstd, *_ = batch_norm_training_op(x, w, b, w, w, 0.1, 1e-5, True, 0.0, math.inf)
        >>> grads = batch_norm_training_backward_op(g, x, w, b, mean, invstd, True, 0.0, math.inf)
        >>> x_, w_, b_ = (t.clone().requires_grad_() for t in (x, w, b))
        >>> torch.relu(F.batch_norm(x_, None, None, w_, b_, True, 0.1, 1e-5)).backward(g)
        >>> all(torch.allclose(a, e, atol=1e-4) for a, e in zip(grads, (x_.grad, w_.grad, b_.grad)))
        True
    """
    grad_output, x, weight_, bias_, mean_, invstd_ = in_compute_dtype(grad_output, input, weight, bias, mean, invstd)
    grad = _kept(grad_output, _normalized(x, weight_, bias_, mean_, invstd_), clamp, low, high)
    grad_input, grad_weight, grad_bias = _input_grads(grad, x, weight_, mean_, invstd_)
    return grad_input.to(input.dtype), grad_weight.to(weight.dtype), grad_bias.to(weight.dtype)


def _kept(grad_output: torch.Tensor, value: torch.Tensor, clamp: bool, low: float, high: float) -> torch.Tensor:
    """``grad_output`` where the clamp's input (or output: the same there) ``value`` was strictly inside
    ``[low, high]`` (above ``low`` for an infinite ``high``), else 0."""
    if not clamp:
        return grad_output
    inside = value > low if math.isinf(high) else (value > low) & (value < high)
    return grad_output.where(inside, 0.0)


def _input_grads(
    grad: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch norm's ``(grad_input, grad_weight, grad_bias)`` for the gradient ``grad`` of its normalized output."""
    dims, shape, count = channel_layout(input)
    centred = input - mean.reshape(shape)
    grad_sum = grad.sum(dims)
    dot = (grad * centred).sum(dims)
    projection = (dot * invstd * invstd / count).reshape(shape)
    grad_input = (grad - (grad_sum / count).reshape(shape) - centred * projection) * (weight * invstd).reshape(shape)
    return grad_input, dot * invstd, grad_sum


@batch_norm_training_backward_op.register_fake
def _batch_norm_training_backward_fake(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    clamp: bool,
    low: float,
    high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(input), torch.empty_like(weight), torch.empty_like(weight)


@torch.library.custom_op("lightning_ort::batch_norm_add_training", mutates_args=())
def batch_norm_add_training_op(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    residual: torch.Tensor,
    momentum: float,
    eps: float,
    clamp: bool,
    low: float,
    high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`batch_norm_training_op` with ``residual`` (``input``'s shape) added before the clamp: a residual
    block's ``relu(bn(x) + skip)``. ONNX Runtime runs it as ``ai.lightning_ort::BatchNormAddTraining``.

    Example:
        >>> x, z, w, b = torch.randn(4, 3, 5, 5), torch.randn(4, 3, 5, 5), torch.rand(3), torch.randn(3)
        >>> out, *_ = batch_norm_add_training_op(x, w, b, b, w, z, 0.1, 1e-5, True, 0.0, math.inf)
        >>> torch.allclose(out, torch.relu(F.batch_norm(x, None, None, w, b, True) + z), atol=1e-5)
        True
    """
    return _batch_norm_training(
        input, weight, bias, running_mean, running_var, residual, momentum, eps, clamp, low, high
    )


@batch_norm_add_training_op.register_fake
def _batch_norm_add_training_fake(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    residual: torch.Tensor,
    momentum: float,
    eps: float,
    clamp: bool,
    low: float,
    high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _batch_norm_training_fake(input, weight, bias, running_mean, running_var, momentum, eps, clamp, low, high)


@torch.library.custom_op("lightning_ort::batch_norm_add_training_backward", mutates_args=())
def batch_norm_add_training_backward_op(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    output: torch.Tensor,
    clamp: bool,
    low: float,
    high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`batch_norm_add_training_op`'s ``output``: ``(grad_input, grad_weight, grad_bias,
    grad_residual)``.

    The clamp's mask is read from the forward's ``output``, which lies strictly inside ``[low, high]`` exactly
    where the clamped sum did (and which a residual block keeps anyway, as the next layer's input);
    ``grad_residual`` is the masked ``grad_output``. ONNX Runtime runs it as
    ``ai.lightning_ort::BatchNormAddTrainingGrad``.

    Example:
        >>> x, z, g, w, b = torch.randn(4, 3, 5, 5), torch.randn(4, 3, 5, 5), torch.randn(4, 3, 5, 5), *torch.rand(2, 3)
        >>> out, mean, invstd, *_ = batch_norm_add_training_op(x, w, b, b, w, z, 0.1, 1e-5, True, 0.0, math.inf)
        >>> grads = batch_norm_add_training_backward_op(g, x, w, b, mean, invstd, out, True, 0.0, math.inf)
        >>> x_, z_, w_, b_ = (t.clone().requires_grad_() for t in (x, z, w, b))
        >>> torch.relu(F.batch_norm(x_, None, None, w_, b_, True) + z_).backward(g)
        >>> all(torch.allclose(a, e, atol=1e-4) for a, e in zip(grads, (x_.grad, w_.grad, b_.grad, z_.grad)))
        True
    """
    grad_output, x, weight_, mean_, invstd_, output_ = in_compute_dtype(
        grad_output, input, weight, mean, invstd, output
    )
    grad = _kept(grad_output, output_, clamp, low, high)
    grad_input, grad_weight, grad_bias = _input_grads(grad, x, weight_, mean_, invstd_)
    return grad_input.to(input.dtype), grad_weight.to(weight.dtype), grad_bias.to(weight.dtype), grad.to(input.dtype)


@batch_norm_add_training_backward_op.register_fake
def _batch_norm_add_training_backward_fake(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    output: torch.Tensor,
    clamp: bool,
    low: float,
    high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(input), torch.empty_like(weight), torch.empty_like(weight), torch.empty_like(input)


BATCH_NORM_TRAINING = torch.ops.lightning_ort.batch_norm_training.default
"""The forward op :func:`batch_norm_training` records in captured graphs."""

BATCH_NORM_TRAINING_BACKWARD = torch.ops.lightning_ort.batch_norm_training_backward.default
"""The backward op :func:`batch_norm_training` records in captured graphs."""

BATCH_NORM_ADD_TRAINING = torch.ops.lightning_ort.batch_norm_add_training.default
"""The forward op :func:`batch_norm_training` records for a batch norm with a residual add."""

BATCH_NORM_ADD_TRAINING_BACKWARD = torch.ops.lightning_ort.batch_norm_add_training_backward.default
"""The backward op :func:`batch_norm_training` records for a batch norm with a residual add."""


Clamp = tuple[float, float] | None
"""The bounds of the activation after a batch norm, ``(low, high)``: ``(0.0, inf)`` for ReLU, ``(0.0, 6.0)`` for
ReLU6; ``None`` for none."""


def _clamp_arguments(clamp: Clamp) -> tuple[bool, float, float]:
    """The ops' ``clamp``, ``low`` and ``high`` arguments for ``clamp``."""
    return (False, 0.0, math.inf) if clamp is None else (True, float(clamp[0]), float(clamp[1]))


class _BatchNormTraining(torch.autograd.Function):
    """:data:`BATCH_NORM_TRAINING` forward, :data:`BATCH_NORM_TRAINING_BACKWARD` backward, or their residual forms
    where ``residual`` is given; the statistics are not differentiable."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        running_mean: torch.Tensor,
        running_var: torch.Tensor,
        residual: torch.Tensor | None,
        momentum: float,
        eps: float,
        clamp: Clamp,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        statistics = (running_mean, running_var)
        if residual is None:
            outputs = BATCH_NORM_TRAINING(input, weight, bias, *statistics, momentum, eps, *_clamp_arguments(clamp))
        else:
            outputs = BATCH_NORM_ADD_TRAINING(
                input, weight, bias, *statistics, residual, momentum, eps, *_clamp_arguments(clamp)
            )
        output, mean, invstd, new_running_mean, new_running_var = outputs
        ctx.clamp = clamp
        ctx.residual = residual is not None
        ctx.save_for_backward(input, weight, bias, mean, invstd, *([output] if ctx.residual else []))
        ctx.mark_non_differentiable(new_running_mean, new_running_var)
        return output, new_running_mean, new_running_var

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        if not ctx.residual:
            grads = BATCH_NORM_TRAINING_BACKWARD(grad_output, *ctx.saved_tensors, *_clamp_arguments(ctx.clamp))
            return *grads, None, None, None, None, None, None
        *grads, grad_residual = BATCH_NORM_ADD_TRAINING_BACKWARD(
            grad_output, *ctx.saved_tensors, *_clamp_arguments(ctx.clamp)
        )
        return *grads, None, None, grad_residual, None, None, None


def batch_norm_training(
    input: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    momentum: float,
    eps: float,
    clamp: Clamp,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.batch_norm(input, running_mean, running_var, weight, bias, True, momentum, eps)``, plus ``residual`` if
    given, then clamped to ``clamp``'s bounds (ReLU, ReLU6) if given, as the fused ops; the running statistics
    are updated in place as PyTorch updates them (the unbiased variance).

    Example:
        >>> x, mean, var = torch.randn(4, 3, 5, 5), torch.zeros(3), torch.ones(3)
        >>> out = batch_norm_training(x, mean, var, None, None, 0.1, 1e-5, clamp=None)
        >>> torch.allclose(mean, 0.1 * x.mean((0, 2, 3)), atol=1e-6)
        True
    """

    def ones() -> torch.Tensor:
        return torch.ones(input.shape[1], dtype=torch.promote_types(input.dtype, torch.float32), device=input.device)

    scale = weight if weight is not None else ones()
    shift = bias if bias is not None else torch.zeros_like(ones())
    mean_in = running_mean if running_mean is not None else torch.zeros_like(ones())
    var_in = running_var if running_var is not None else ones()
    output, new_mean, new_var = _BatchNormTraining.apply(
        input, scale, shift, mean_in, var_in, residual, momentum, eps, clamp
    )
    if running_mean is not None:
        running_mean.copy_(new_mean)
    if running_var is not None:
        running_var.copy_(new_var)
    return output


_BATCH_NORM_SIGNATURE = inspect.signature(F.batch_norm)
_RELUS = (F.relu, torch.relu, torch.relu_)
_HARDTANH_SIGNATURE = inspect.signature(F.hardtanh)


def _fusable_arguments(node: torch.fx.Node) -> dict[str, Any] | None:
    """``F.batch_norm``'s arguments at ``node``, where the fused ops compute it: training mode with a float
    momentum, a CPU input of 3 or more dims and affine parameters (or none) that ONNX Runtime computes in float32
    (float32, or ``bfloat16`` under autocast)."""
    if node.op != "call_function" or node.target is not F.batch_norm:
        return None
    bound = _BATCH_NORM_SIGNATURE.bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    if arguments["training"] is not True or type(arguments["momentum"]) is not float:
        return None
    if not isinstance(arguments["eps"], float):
        return None
    tensors = [arguments[name] for name in ("input", "weight", "bias")]
    values = [t.meta.get("example_value") if isinstance(t, torch.fx.Node) else t for t in tensors]
    if not isinstance(values[0], torch.Tensor) or values[0].dim() < 3 or values[0].device.type != "cpu":
        return None
    if any(not isinstance(v, torch.Tensor) or not computed_in_float32(v) for v in values if v is not None):
        return None
    return arguments


def _only_clamp(node: torch.fx.Node) -> tuple[torch.fx.Node, tuple[float, float]] | None:
    """The ReLU, ReLU6 or hardtanh that is ``node``'s only consumer, if one is, and its bounds."""
    if len(node.users) != 1:
        return None
    (user,) = node.users
    if not user.args or user.args[0] is not node:
        return None
    relu = (user.op == "call_function" and user.target in _RELUS) or (
        user.op == "call_method" and user.target in ("relu", "relu_")
    )
    if relu:
        return user, (0.0, math.inf)
    if user.op == "call_function" and user.target is F.relu6:
        return user, (0.0, 6.0)
    if user.op == "call_function" and user.target is F.hardtanh:
        bound = _HARDTANH_SIGNATURE.bind(*user.args, **user.kwargs)
        bound.apply_defaults()
        low, high = bound.arguments["min_val"], bound.arguments["max_val"]
        if type(low) in (int, float) and type(high) in (int, float) and low < high:
            return user, (float(low), float(high))
    return None


_ADDS = (operator.add, operator.iadd, torch.add)
_IN_PLACE_ADDS = (operator.iadd,)


def _residual_add(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """The addition that is ``node``'s only consumer, if one is, and its other operand: a CPU tensor of ``node``'s
    shape and dtype (no broadcast, no promotion), which an in-place addition does not update."""
    if len(node.users) != 1:
        return None
    (user,) = node.users
    function = user.op == "call_function" and user.target in _ADDS
    method = user.op == "call_method" and user.target in ("add", "add_")
    if not (function or method) or user.kwargs or len(user.args) != 2 or node not in user.args:
        return None
    in_place = user.target in _IN_PLACE_ADDS or user.target == "add_"
    other = user.args[1] if user.args[0] is node else user.args[0]
    if in_place and user.args[0] is not node:
        return None
    if not isinstance(other, torch.fx.Node) or other is node:
        return None
    ours, theirs = node.meta.get("example_value"), other.meta.get("example_value")
    if not isinstance(ours, torch.Tensor) or not isinstance(theirs, torch.Tensor):
        return None
    if theirs.shape != ours.shape or theirs.dtype != ours.dtype or theirs.device.type != "cpu":
        return None
    return user, other


def fusable_batch_norms(gm: torch.fx.GraphModule) -> int:
    """How many ``F.batch_norm`` calls of TorchDynamo's graph ``gm`` :func:`fuse_batch_norms` would replace."""
    return sum(_fusable_arguments(node) is not None for node in gm.graph.nodes)


def fuse_batch_norms(gm: torch.fx.GraphModule) -> int:
    """Point ``gm``'s training-mode ``F.batch_norm`` calls (float32 or ``bfloat16``, on CPU, with a float momentum) at
    :func:`batch_norm_training`, with the ``F.relu``, ``F.relu6`` or ``F.hardtanh`` that alone consumes one, or
    that alone consumes its sum with a tensor of its shape (a residual add); returns the calls replaced.

    Example:
        >>> graph = torch.fx.Graph()
        >>> x = graph.placeholder("x")
        >>> x.meta["example_value"] = torch.empty(2, 3, 4, 4)
        >>> normed = graph.call_function(F.batch_norm, (x, None, None, None, None, True, 0.1, 1e-5))
        >>> _ = graph.output(graph.call_function(F.relu, (normed,)))
        >>> gm = torch.fx.GraphModule(torch.nn.Module(), graph)
        >>> fuse_batch_norms(gm), [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"]
        (1, ['batch_norm_training'])
    """
    replaced = 0
    for node in list(gm.graph.nodes):
        arguments = _fusable_arguments(node)
        if arguments is None:
            continue
        activation, residual = _only_clamp(node), None
        added = _residual_add(node) if activation is None else None
        if added is not None and (after_add := _only_clamp(added[0])) is not None:
            activation, residual = after_add, added
        last = activation[0] if activation is not None else node
        with gm.graph.inserting_after(last):
            fused = gm.graph.call_function(
                batch_norm_training,
                tuple(arguments[name] for name in ("input", "running_mean", "running_var", "weight", "bias")),
                {
                    "momentum": arguments["momentum"],
                    "eps": arguments["eps"],
                    "clamp": activation[1] if activation is not None else None,
                    "residual": residual[1] if residual is not None else None,
                },
            )
        fused.meta = dict(last.meta)
        last.replace_all_uses_with(fused)
        if activation is not None:
            gm.graph.erase_node(activation[0])
        if residual is not None:
            gm.graph.erase_node(residual[0])
        gm.graph.erase_node(node)
        replaced += 1
    if replaced:
        gm.recompile()
    return replaced
