"""``torch.cdist``'s direct path (prototype and metric-learning heads, k-means layers) in ops ONNX has.

``torch.cdist`` computes the Euclidean distance as a matrix product when either set has more than 25 points
(those ops translate); otherwise, and for every ``p`` other than 2, it calls ``aten._cdist_forward`` and, for
the gradients, ``aten._cdist_backward``, neither with an ONNX translation. Both are decomposed here into the
pairwise differences ATen's kernels compute, ``[..., P, R, M]``, so only where that tensor stays under
:data:`PAIRWISE_ELEMENTS`; larger ones keep ATen's ops (``NotImplemented``), which run in PyTorch.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten

PAIRWISE_ELEMENTS = 1 << 24
"""The most elements of the pairwise difference tensor the decompositions build (64 MiB in float32)."""


def cdist_forward(x1: torch.Tensor, x2: torch.Tensor, p: float, compute_mode: int | None = None) -> torch.Tensor:
    """The ``p``-norm distance ``[..., P, R]`` between the rows of ``x1`` ``[..., P, M]`` and ``x2`` ``[..., R,
    M]``, as ATen's direct kernel computes it: ``p = 0`` counts differing coordinates, ``p = inf`` takes the
    largest absolute difference. ``compute_mode`` only chooses between this and the matrix-product form, whose
    ops translate.

    Example:
        >>> x1, x2 = torch.randn(2, 5, 3), torch.randn(2, 4, 3)
        >>> torch.allclose(cdist_forward(x1, x2, 1.5), aten._cdist_forward(x1, x2, 1.5, None))
        True
    """
    diff = _pairwise_differences(x1, x2)
    if diff is None:
        return NotImplemented
    if p == 0:
        return (diff != 0).sum(-1).to(x1.dtype)
    if math.isinf(p):
        return diff.abs().amax(-1)
    if p == 1:
        return diff.abs().sum(-1)
    if p == 2:
        return diff.square().sum(-1).sqrt()
    return diff.abs().pow(p).sum(-1).pow(1 / p)


def cdist_backward(
    grad: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor, p: float, cdist: torch.Tensor
) -> torch.Tensor:
    """The gradient of :func:`cdist_forward` by ``x1`` (autograd asks for ``x2``'s with the sets swapped): each
    pair's ``d dist / d x1`` (ATen's ``_cdist_backward`` cases), zero where the distance is zero, times the
    pair's output gradient, summed over ``x2``'s rows. An ``x1`` broadcast over ``x2``'s batch keeps ATen's op.

    Example:
        >>> x1, x2 = torch.randn(2, 5, 3), torch.randn(2, 4, 3)
        >>> dist = aten._cdist_forward(x1, x2, 3.0, None)
        >>> g = torch.randn_like(dist)
        >>> torch.allclose(cdist_backward(g, x1, x2, 3.0, dist), aten._cdist_backward(g, x1, x2, 3.0, dist), atol=1e-6)
        True
    """
    diff = _pairwise_differences(x1, x2)
    if diff is None or diff.shape[:-3] != x1.shape[:-2]:
        return NotImplemented
    if p == 0:
        return torch.zeros_like(x1)
    weight = grad.unsqueeze(-1)
    distance = cdist.unsqueeze(-1)
    if p == 1:
        slope = torch.sign(diff)
    elif math.isinf(p):
        slope = torch.sign(diff) * (diff.abs() == distance)
    elif p == 2:
        slope = diff / distance
    elif p < 2:
        slope = torch.sign(diff) * diff.abs().pow(p - 1) / distance.pow(p - 1)
    else:
        slope = diff * diff.abs().pow(p - 2) / distance.pow(p - 1)
    if p < 1:
        slope = torch.where(diff == 0, 0.0, slope)
    if p != 1 and not math.isinf(p):
        slope = torch.where(distance == 0, 0.0, slope)
    return (weight * slope).sum(-2)


def _pairwise_differences(x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor | None:
    """``x1[..., :, None, :] - x2[..., None, :, :]``, or ``None`` where its size is symbolic or past
    :data:`PAIRWISE_ELEMENTS`."""
    if not all(isinstance(size, int) for size in (*x1.shape, *x2.shape)):
        return None
    shape = (*torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2]), x1.shape[-2], x2.shape[-2], x1.shape[-1])
    if math.prod(shape) > PAIRWISE_ELEMENTS:
        return None
    return x1.unsqueeze(-2) - x2.unsqueeze(-3)
