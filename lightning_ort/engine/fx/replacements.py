"""Replacements of ``torch.nn.functional`` calls in TorchDynamo's graphs, before AOTAutograd traces them.

Some functions trace into ATen ops that export badly: SDPA's fused kernels have backward ops with no ONNX
translation, ``F.multi_head_attention_forward`` splits heads with many layout copies, ``F.dropout``'s mask
is drawn by ONNX's own generator, ``F.rrelu``'s random slopes live in a buffer ATen mutates, and
``F.cross_entropy``'s gradient is built from a scattered one-hot tensor in seven passes over the class scores.
:func:`substitute_functions` points each such call at its replacement here: :func:`attention` (SDPA's math path
written with plain ops), :func:`multi_head_attention`, :func:`dropout` (the input times a one-byte keep mask
drawn by one random op, :func:`dropout_keep`, which the export lifts out as an input drawn in PyTorch, scaled in
the graph), :func:`rrelu` (slopes from a uniform tensor lifted the same way) and :func:`cross_entropy`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx

from lightning_ort.engine.torch_internals import canonical_mask, none_or_dtype
from lightning_ort.options import AttentionPath

aten = torch.ops.aten


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as PyTorch's math path computes it, with one difference in cost.

    Masks are added to the scores as a bias of ``0`` and ``-inf``, as the math path adds them: the sum's gradient
    passes the scores' gradient through unchanged, where a ``masked_fill`` would select it again, full-size, in the
    backward (the softmax's gradient is already zero where the mask removed a score). The bias has the mask's
    shape, usually smaller than the scores'. The math path always uses a "safe" softmax (rows whose scores are
    all ``-inf`` give zeros, not NaNs), which costs a full-size select per attention. Without a mask, or with a
    causal one, no row can be fully masked, so a plain softmax gives the same result; only an explicit mask gets
    the safe one.

    Example:
        >>> q, k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4)
        >>> keep = torch.rand(2, 1, 5, 6) > 0.3
        >>> expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        >>> torch.allclose(attention(q, k, v, attn_mask=keep), expected, atol=1e-6)
        True
    """
    length, source = query.shape[-2], key.shape[-2]
    factor = math.sqrt(1.0 / math.sqrt(query.shape[-1]) if scale is None else scale)
    if enable_gqa:
        repeats = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeats, -3), value.repeat_interleave(repeats, -3)
    scores = (query * factor) @ (key.transpose(-2, -1) * factor)
    if is_causal:
        causal = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        scores = scores + _mask_bias(causal, scores.dtype)
    if attn_mask is not None:
        masked = attn_mask.dtype == torch.bool
        scores = scores + (_mask_bias(attn_mask, scores.dtype) if masked else attn_mask)
        weights = aten._safe_softmax(scores, -1)
    else:
        weights = torch.softmax(scores, -1)
    if dropout_p > 0.0:
        weights = dropout(weights, dropout_p)
    return weights @ value


def _mask_bias(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as an additive bias: ``0`` where ``keep`` is true, ``-inf`` elsewhere."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, float("-inf"))


@torch.library.custom_op("lightning_ort::dropout_keep", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def dropout_keep(like: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout's keep mask for ``like``: 1 with probability ``1 - p``, else 0, as ``uint8``.

    One random op for the whole mask, so the partitioner saves the mask itself for the backward graph
    (random ops are never recomputed) and the export lifts it as one input drawn in PyTorch (see
    :class:`lightning_ort.engine.fx.noise.Noise`). One byte per element, as eager's boolean mask, where a
    float32 mask would hold four. ``uint8`` rather than ``bool``, because ONNX Runtime scales it to floats in
    one ``DequantizeLinear`` node, faster than a ``Where`` on a boolean mask or a ``Cast`` and a product.

    Example:
        >>> keep = dropout_keep(torch.empty(10_000), 0.25)
        >>> keep.dtype, sorted(keep.unique().tolist()), round(float(keep.float().mean()), 1)
        (torch.uint8, [0, 1], 0.8)
    """
    return (torch.rand_like(like) > p).to(torch.uint8)


@dropout_keep.register_fake
def _dropout_keep_fake(like: torch.Tensor, p: float) -> torch.Tensor:
    return torch.empty_like(like, dtype=torch.uint8)


DROPOUT_KEEP = torch.ops.lightning_ort.dropout_keep.default
"""The op :func:`dropout_keep` records in captured graphs (lifted out of them by the export)."""


_EAGER_DROPOUT = torch.nn.functional.dropout


def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """``F.dropout`` as ``input * (dropout_keep(input, p) * (1 / (1 - p)))``: the same distribution, a cheaper
    graph.

    The mask's gradient is not needed (it is random), so the backward graph scales the saved one-byte mask and
    multiplies. For 16-bit inputs the scaled mask is float32 and the product is rounded once, as eager's
    dropout does: a 16-bit ``1 / (1 - p)`` would scale every kept element with the same rounding error
    (-0.16% in bfloat16 for ``p=0.1``). ``p`` of 0 or 1, or outside training, is left to PyTorch's own
    ``F.dropout``.

    Example:
        >>> x = torch.randn(1000, requires_grad=True)
        >>> y = dropout(x, 0.5)
        >>> y.sum().backward()
        >>> torch.equal(x.grad, (y != 0).float() * 2)
        True
    """
    if not training or p <= 0.0 or p >= 1.0:
        return _EAGER_DROPOUT(input, p, training, inplace)
    scaled = dropout_keep(input.detach(), p).to(input.dtype if input.element_size() >= 4 else torch.float32)
    scaled = scaled * (1.0 / (1.0 - p))
    if inplace:
        return input.mul_(scaled)
    return (input * scaled).to(input.dtype)


_EAGER_RRELU = torch.nn.functional.rrelu


def rrelu(
    input: torch.Tensor,
    lower: float = 1.0 / 8,
    upper: float = 1.0 / 3,
    training: bool = False,
    inplace: bool = False,
) -> torch.Tensor:
    """``F.rrelu`` in training as ``where(input > 0, input, input * slope)``, ``slope`` uniform on
    ``[lower, upper)`` per element: the same distribution and gradient as ATen's, in ops that export.

    ATen's ``rrelu_with_noise`` draws the slopes into a ``noise`` buffer it mutates and reads back in the backward;
    that op has no ONNX translation, so it ran in PyTorch between two ONNX Runtime partitions. Here the slopes come
    from one ``rand_like``, which the export lifts out as an input drawn from PyTorch's generator for every run
    (as dropout's mask), and the partitioner saves them for the backward (random ops are never recomputed). As in
    ATen, an element at 0 takes the slope's gradient. Outside training it is ATen's own fixed slope, a leaky ReLU
    with ``(lower + upper) / 2``; in place, the call is PyTorch's own.

    Example:
        >>> x = torch.tensor([-4.0, -2.0, 0.0, 3.0], requires_grad=True)
        >>> y = rrelu(x, 0.1, 0.3, training=True)
        >>> y.sum().backward()
        >>> slope = x.grad[:2]
        >>> bool(((slope >= 0.1) & (slope < 0.3)).all()), y[3].item(), x.grad[3].item()
        (True, 3.0, 1.0)
        >>> torch.allclose(y[:2], x[:2].detach() * slope)
        True
    """
    if inplace:
        return _EAGER_RRELU(input, lower, upper, training, inplace)
    if not training:
        return torch.nn.functional.leaky_relu(input, (lower + upper) / 2)
    slope = torch.rand_like(input) * (upper - lower) + lower
    return torch.where(input > 0, input, input * slope)


_EAGER_MULTI_HEAD_ATTENTION = torch.nn.functional.multi_head_attention_forward


def multi_head_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    embed_dim_to_check: int,
    num_heads: int,
    in_proj_weight: torch.Tensor | None,
    in_proj_bias: torch.Tensor | None,
    bias_k: torch.Tensor | None,
    bias_v: torch.Tensor | None,
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight: torch.Tensor,
    out_proj_bias: torch.Tensor | None,
    training: bool = True,
    key_padding_mask: torch.Tensor | None = None,
    need_weights: bool = True,
    attn_mask: torch.Tensor | None = None,
    use_separate_proj_weight: bool = False,
    q_proj_weight: torch.Tensor | None = None,
    k_proj_weight: torch.Tensor | None = None,
    v_proj_weight: torch.Tensor | None = None,
    static_k: torch.Tensor | None = None,
    static_v: torch.Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``F.multi_head_attention_forward`` for self-attention, with the heads split in the batch-first layout.

    PyTorch's implementation splits heads with views of the sequence-first layout that eager gets for free but
    ONNX materialises (about 7 transposes per layer forward, as many backward). For self-attention without
    attention weights (what ``nn.TransformerEncoderLayer`` asks for) this computes the same products and masks
    with two: one to split q, k, v and heads, one to merge heads; ``nn.MultiheadAttention``'s own batch-first
    transposes around the call cancel in ONNX Runtime. Every other configuration runs PyTorch's own function.

    Example:
        >>> mha = torch.nn.MultiheadAttention(8, 2)
        >>> x, padding = torch.randn(5, 3, 8), torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 5])
        >>> expected, _ = mha(x, x, x, key_padding_mask=padding, need_weights=False)
        >>> actual, _ = multi_head_attention(
        ...     x, x, x, 8, 2, mha.in_proj_weight, mha.in_proj_bias, None, None, False, 0.0,
        ...     mha.out_proj.weight, mha.out_proj.bias, key_padding_mask=padding, need_weights=False)
        >>> torch.allclose(actual, expected, atol=1e-6)
        True
    """
    supported = (
        query is key
        and key is value
        and query.dim() == 3
        and not need_weights
        and not use_separate_proj_weight
        and bias_k is None
        and static_k is None
        and not add_zero_attn
        and not (is_causal and attn_mask is None)
    )
    if not supported or in_proj_weight is None:
        return _EAGER_MULTI_HEAD_ATTENTION(
            query,
            key,
            value,
            embed_dim_to_check,
            num_heads,
            in_proj_weight,
            in_proj_bias,
            bias_k,
            bias_v,
            add_zero_attn,
            dropout_p,
            out_proj_weight,
            out_proj_bias,
            training=training,
            key_padding_mask=key_padding_mask,
            need_weights=need_weights,
            attn_mask=attn_mask,
            use_separate_proj_weight=use_separate_proj_weight,
            q_proj_weight=q_proj_weight,
            k_proj_weight=k_proj_weight,
            v_proj_weight=v_proj_weight,
            static_k=static_k,
            static_v=static_v,
            average_attn_weights=average_attn_weights,
            is_causal=is_causal,
        )
    key_padding_mask = canonical_mask(
        mask=key_padding_mask,
        mask_name="key_padding_mask",
        other_type=none_or_dtype(attn_mask),
        other_name="attn_mask",
        target_type=query.dtype,
    )
    attn_mask = canonical_mask(
        mask=attn_mask,
        mask_name="attn_mask",
        other_type=None,
        other_name="",
        target_type=query.dtype,
        check_other=False,
    )
    inputs = query.transpose(0, 1)
    batch, length, width = inputs.shape
    heads = num_heads
    mask = None
    causal = is_causal and key_padding_mask is None
    if not causal:
        if attn_mask is not None:
            mask = (
                attn_mask.view(1, 1, length, length)
                if attn_mask.dim() == 2
                else attn_mask.view(batch, heads, length, length)
            )
        if key_padding_mask is not None:
            padding = key_padding_mask.view(batch, 1, 1, length)
            mask = padding if mask is None else mask + padding
    projected = torch.nn.functional.linear(inputs, in_proj_weight, in_proj_bias)
    q, k, v = projected.view(batch, length, 3, heads, width // heads).permute(2, 0, 3, 1, 4).unbind(0)
    attended = attention(q, k, v, mask, dropout_p if training else 0.0, causal)
    merged = attended.transpose(1, 2).reshape(batch, length, width)
    return torch.nn.functional.linear(merged, out_proj_weight, out_proj_bias).transpose(0, 1), None


_EAGER_CROSS_ENTROPY = torch.nn.functional.cross_entropy


def cross_entropy(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """``F.cross_entropy`` whose gradient over class scores ``[rows, classes]`` takes three passes over them.

    ATen's gradient (``nll_loss_backward``, then ``_log_softmax_backward_data``) scatters the loss's gradient
    into a zero tensor of the scores' size, scales it, sums it per row, and subtracts the softmax times that
    sum: seven nodes over a tensor that a language model's vocabulary makes the largest of the step. It equals
    ``(softmax - one_hot) * g`` per row, which :class:`_ClassScoresCrossEntropy` computes as the exponential of
    the saved log-softmax (the tensor ATen saves too), scaled per row, with ``g`` subtracted at each target by
    one ``scatter_add``. Other calls (class weights, label smoothing, probability targets, more than two
    dimensions, ``reduction="none"``) are ``F.cross_entropy`` itself.

    Example:
        >>> scores = torch.randn(4, 5, requires_grad=True)
        >>> target = torch.tensor([1, -100, 4, 0])
        >>> ours, = torch.autograd.grad(cross_entropy(scores, target), scores)
        >>> theirs, = torch.autograd.grad(torch.nn.functional.cross_entropy(scores, target), scores)
        >>> torch.allclose(ours, theirs, atol=1e-7)
        True
    """
    plain = (
        input.dim() == 2
        and target.dim() == 1
        and not target.dtype.is_floating_point
        and input.dtype in (torch.float32, torch.float64)
        and weight is None
        and size_average is None
        and reduce is None
        and reduction in ("mean", "sum")
        and label_smoothing == 0.0
    )
    if not plain:
        return _EAGER_CROSS_ENTROPY(
            input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing
        )
    loss: torch.Tensor = _ClassScoresCrossEntropy.apply(input, target, ignore_index, reduction == "mean")
    return loss


class _ClassScoresCrossEntropy(torch.autograd.Function):
    """Cross-entropy of scores ``[rows, classes]`` against class indices, its gradient in three passes."""

    @staticmethod
    def forward(
        ctx: Any,
        scores: torch.Tensor,
        target: torch.Tensor,
        ignore_index: int,
        mean: bool,
    ) -> torch.Tensor:
        log_probs = torch.log_softmax(scores, 1)
        kept = target != ignore_index
        index = torch.where(kept, target, 0).unsqueeze(1)
        losses = torch.where(kept, -log_probs.gather(1, index).squeeze(1), 0.0)
        count = kept.sum().to(scores.dtype)
        ctx.mean = mean
        ctx.save_for_backward(log_probs, index, kept, count)
        return losses.sum() / count if mean else losses.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        log_probs, index, kept, count = ctx.saved_tensors
        per_row = torch.where(kept, grad / count if ctx.mean else grad, 0.0).unsqueeze(1)
        return (log_probs.exp() * per_row).scatter_add(1, index, -per_row), None, None, None


def substitute_functions(gm: torch.fx.GraphModule, attention_path: AttentionPath = "onnx") -> int:
    """Replace calls of ``torch.nn.functional`` functions whose traced form exports badly, in place.

    SDPA's fused kernels have backward ops with no ONNX translation (:func:`attention` is its math path; with
    ``attention_path="torch"`` SDPA stays, to run in PyTorch between ONNX Runtime partitions),
    ``F.multi_head_attention_forward`` splits heads with many layout copies (:func:`multi_head_attention`),
    ``F.dropout`` becomes a mask the export can draw in PyTorch (:func:`dropout`), ``F.rrelu``'s slopes a uniform
    tensor drawn the same way (:func:`rrelu`), and ``F.cross_entropy``'s
    gradient takes three passes over the class scores instead of seven (:func:`cross_entropy`). Returns the
    calls replaced.

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x: torch.nn.functional.dropout(x, 0.1))
        >>> substitute_functions(gm)
        1
    """
    replaced = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _SUBSTITUTES:
            continue
        if attention_path == "onnx" or node.target is not torch.nn.functional.scaled_dot_product_attention:
            node.target = _SUBSTITUTES[node.target]
            replaced += 1
    if replaced:
        gm.recompile()
    return replaced


_SUBSTITUTES = {
    torch.nn.functional.scaled_dot_product_attention: attention,
    torch.nn.functional.multi_head_attention_forward: multi_head_attention,
    torch.nn.functional.dropout: dropout,
    torch.nn.functional.rrelu: rrelu,
    torch.nn.functional.cross_entropy: cross_entropy,
}
