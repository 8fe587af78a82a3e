"""Tensors handed between graphs in ONNX Runtime's NCHWc layout.

ONNX Runtime's CPU convolutions read and write images in NCHWc blocks: ``[N, C, H, W]`` stored as
``[N, C / B, H, W, B]``, B channels innermost. :data:`TO_NCHWC` makes that layout explicit in an FX graph, so that a
value the forward graph saves can reach the backward graph already blocked (the forward's convolution that reads
it blocks it anyway, and the two ``ReorderInput`` nodes become one), and a backward kernel that reads blocks takes
it without reordering it again. The blocked tensor keeps its ``[N, C, H, W]`` shape: only lightning_ort's ops that
are told so read its elements in the blocked order.
"""

from __future__ import annotations

import torch

KERNEL_NCHWC_BLOCK = 16
"""The NCHWc channel block in which lightning_ort's kernels read and write blocked tensors (ONNX Runtime's on
AVX-512)."""


@torch.library.custom_op("lightning_ort::to_nchwc", mutates_args=())
def to_nchwc_op(input: torch.Tensor, block: int) -> torch.Tensor:
    """``input`` (``[N, C, H, W]``, C a multiple of ``block``) with its elements in NCHWc order, ``block`` channels
    innermost, shaped ``[N, C, H, W]``. ONNX Runtime runs it as ``com.microsoft.nchwc::ReorderInput``.

    Example:
        >>> x = torch.arange(2 * 32 * 3 * 3.0).reshape(2, 32, 3, 3)
        >>> blocked = to_nchwc_op(x, 16)
        >>> blocked.shape, blocked.flatten()[:3].tolist()  # channels 0, 1, 2 of the first position
        (torch.Size([2, 32, 3, 3]), [0.0, 9.0, 18.0])
        >>> torch.equal(from_nchwc(blocked, 16), x)
        True
    """
    batch, channels, height, width = input.shape
    blocks = input.reshape(batch, channels // block, block, height, width).permute(0, 1, 3, 4, 2)
    return blocks.contiguous().reshape(input.shape)


@to_nchwc_op.register_fake
def _to_nchwc_fake(input: torch.Tensor, block: int) -> torch.Tensor:
    return torch.empty_like(input, memory_format=torch.contiguous_format)


TO_NCHWC = torch.ops.lightning_ort.to_nchwc.default
"""The op that blocks a value in a graph (:func:`to_nchwc_op`)."""


def from_nchwc(blocked: torch.Tensor, block: int) -> torch.Tensor:
    """The ``[N, C, H, W]`` tensor whose NCHWc form (:func:`to_nchwc_op`) is ``blocked``: what lightning_ort's ops
    compute in PyTorch from a blocked input."""
    batch, channels, height, width = blocked.shape
    blocks = blocked.reshape(batch, channels // block, height, width, block).permute(0, 1, 4, 2, 3)
    return blocks.reshape(blocked.shape)
