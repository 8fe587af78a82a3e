"""Accumulating ``index_put`` on CPU as ``scatter_add``: gradients at indices that come out right on every run.

``aten.index_put(self, indices, values, accumulate=True)`` is how PyTorch's decompositions add rows of gradients at
advanced indices (the gradient of ``x[idx]``), or at token ids (an embedding's gradient, which on CPU runs in
PyTorch instead: see :func:`~lightning_ort.engine.capture.partition.weight_gradient_nodes`). The ONNX exporter
translates it to ``ScatterND`` with ``reduction="add"``, whose CPU kernel in ONNX Runtime adds the rows on several
threads without ordering them: where two threads add to the same row (the same index twice), one's sum is lost, and
the gradient is wrong on some runs and right on others. :func:`index_put` writes the same sum as ``scatter_add``
over the rows, which exports to ``ScatterElements`` with ``reduction="add"``, a kernel that adds in order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch


def index_put(
    self: torch.Tensor, indices: Sequence[torch.Tensor | None], values: torch.Tensor, accumulate: bool = False
) -> Any:
    """``aten.index_put`` (and ``aten._unsafe_index_put``) with ``accumulate`` on a CPU tensor as ``scatter_add``
    of ``values``' rows at the rows ``indices`` pick; ``NotImplemented`` (the exporter's own translation) for
    replacing puts and boolean masks.

    The indices, broadcast together, pick rows of ``self`` with its indexed dims moved first and viewed as
    ``[rows, width]``; negative ones count from the end. ``values`` is laid out as ``self[indices]`` is: the
    picked positions where the first indexed dim was if the indexed dims are adjacent, else first.

    Example:
        >>> grad = torch.zeros(5, 3)
        >>> ids, rows = torch.tensor([1, 4, 1, -1]), torch.arange(12.0).reshape(4, 3)
        >>> torch.equal(index_put(grad, [ids], rows, True), grad.index_put([ids], rows, accumulate=True))
        True
    """
    if not accumulate or self.device.type != "cpu" or all(i is None for i in indices):
        return NotImplemented
    if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
        return NotImplemented
    dims = [dim for dim, index in enumerate(indices) if index is not None]
    others = [dim for dim in range(self.dim()) if dim not in dims]
    picked = torch.broadcast_tensors(*(index for index in indices if index is not None))
    positions = list(picked[0].shape)
    linear: torch.Tensor | None = None
    for index, dim in zip(picked, dims, strict=True):
        index = torch.where(index < 0, index + self.shape[dim], index).long()
        linear = index if linear is None else linear * self.shape[dim] + index
    assert linear is not None
    before = [dim for dim in others if dim < dims[0]] if dims == list(range(dims[0], dims[-1] + 1)) else []
    laid_out = [*(self.shape[d] for d in before), *positions, *(self.shape[d] for d in others if d not in before)]
    updates = values.expand(laid_out)
    if before:  # the picked positions first, as in the rows
        leading, count = len(before), len(positions)
        updates = updates.permute(
            [*range(leading, leading + count), *range(leading), *range(leading + count, len(laid_out))]
        )
    order = [*dims, *others]
    moved = self.permute(order) if order != list(range(self.dim())) else self
    rows, width = math.prod(self.shape[d] for d in dims), math.prod(self.shape[d] for d in others)
    count = math.prod(positions)
    target = linear.reshape(count, 1).expand(count, width)
    added = moved.reshape(rows, width).scatter_add(0, target, updates.reshape(count, width)).reshape(moved.shape)
    return added.permute([order.index(dim) for dim in range(self.dim())]) if moved is not self else added
