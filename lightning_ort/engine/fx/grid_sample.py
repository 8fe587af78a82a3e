"""``F.grid_sample``'s gradients (spatial transformers, optical flow, deformable sampling) as gathers and scatters.

``aten.grid_sampler_2d_backward`` has no ONNX translation, so without this decomposition the backward graph runs
it in PyTorch between two ONNX Runtime partitions. ONNX's ``GridSample`` serves the forward.

The gradients follow ATen's CPU kernel (``GridSamplerKernel.cpp``) step by step: the grid's coordinates are
unnormalized to pixel positions, with the derivative of that map; border and reflection padding clip or mirror
them, multiplying that derivative by 0 or -1 (a position on the border itself counts as outside, as in ATen);
then each output gradient goes to the input pixels the forward read (a ``scatter_add``, ONNX
``ScatterElements`` with ``reduction="add"``), weighted as they were, and the grid's gradient is the channel sum
of the output gradient times the interpolation's slope, read from the input at the same pixels (``gather``).
Bilinear and nearest interpolation are decomposed, with each padding mode and both ``align_corners``; bicubic
stays ATen's (``NotImplemented``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

aten = torch.ops.aten

BILINEAR, NEAREST = 0, 1
"""``interpolation_mode`` values of ``aten.grid_sampler_2d``."""

ZEROS, BORDER, REFLECTION = 0, 1, 2
"""``padding_mode`` values of ``aten.grid_sampler_2d``."""


class _Axis(NamedTuple):
    """Pixel positions along one axis of the input, for each output position, and ``d position / d grid``."""

    position: torch.Tensor
    slope: torch.Tensor


class _Corner(NamedTuple):
    """One input pixel an output position reads: its flat index in the plane (``pixel``), whether it lies in
    the input, and its interpolation weight."""

    pixel: torch.Tensor
    inside: torch.Tensor
    weight: torch.Tensor


def grid_sampler_2d_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    grid: torch.Tensor,
    interpolation_mode: int,
    padding_mode: int,
    align_corners: bool,
    output_mask: Sequence[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The input and grid gradients of ``aten.grid_sampler_2d`` (bilinear or nearest; ``NotImplemented`` else).

    Args:
        grad_output: ``[N, C, H_out, W_out]``.
        input: the sampled images, ``[N, C, H, W]``.
        grid: ``[N, H_out, W_out, 2]``, x then y, -1 and 1 the input's extreme edges or pixel centres.
        interpolation_mode: 0 bilinear, 1 nearest (2, bicubic, is not decomposed).
        padding_mode: 0 zeros, 1 border, 2 reflection.
        align_corners: whether -1 and 1 are the corner pixels' centres rather than their outer edges.
        output_mask: which of the input and grid gradients to compute (``None`` in place of the others).

    Example:
        >>> x, grid = torch.randn(2, 3, 5, 6), torch.rand(2, 4, 7, 2) * 2.4 - 1.2
        >>> g = torch.randn(2, 3, 4, 7)
        >>> ours = grid_sampler_2d_backward(g, x, grid, 0, 2, False, [True, True])
        >>> theirs = aten.grid_sampler_2d_backward(g, x, grid, 0, 2, False, [True, True])
        >>> all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ours, theirs))
        True
    """
    if interpolation_mode not in (BILINEAR, NEAREST) or padding_mode not in (ZEROS, BORDER, REFLECTION):
        return NotImplemented
    if input.dim() != 4 or not all(isinstance(size, int) for size in (*input.shape, *grid.shape)):
        return NotImplemented
    batch, channels, height, width = input.shape
    accumulate = torch.promote_types(input.dtype, torch.float32)
    points = grid.to(accumulate).reshape(batch, -1, 2)
    x = _source_positions(points[..., 0], width, padding_mode, align_corners)
    y = _source_positions(points[..., 1], height, padding_mode, align_corners)
    grad = grad_output.to(accumulate).reshape(batch, channels, -1)
    if interpolation_mode == NEAREST:
        corners = [_corner(torch.round(y.position), torch.round(x.position), height, width, 1.0)]
    else:
        left, top = torch.floor(x.position), torch.floor(y.position)
        right, bottom = left + 1, top + 1
        corners = [
            _corner(top, left, height, width, (right - x.position) * (bottom - y.position)),
            _corner(top, right, height, width, (x.position - left) * (bottom - y.position)),
            _corner(bottom, left, height, width, (right - x.position) * (y.position - top)),
            _corner(bottom, right, height, width, (x.position - left) * (y.position - top)),
        ]
    pixels = torch.cat([corner.pixel for corner in corners], dim=1)[:, None, :].expand(batch, channels, -1)
    grad_input = grad_grid = None
    if output_mask[0]:
        grad_input = _scattered(grad, pixels, corners, height * width).reshape(input.shape)
    if output_mask[1] and interpolation_mode == NEAREST:
        grad_grid = torch.zeros_like(grid)
    elif output_mask[1]:
        planes = input.to(accumulate).reshape(batch, channels, -1)
        grad_grid = _bilinear_grid_grad(grad, planes, pixels, corners, x, y, left, top).reshape(grid.shape)
    return (
        None if grad_input is None else grad_input.to(input.dtype),
        None if grad_grid is None else grad_grid.to(grid.dtype),
    )


def _source_positions(coordinates: torch.Tensor, size: int, padding_mode: int, align_corners: bool) -> _Axis:
    """Input pixel positions of normalized ``coordinates`` along an axis of ``size`` pixels, padded as
    ``padding_mode`` says, and their derivative by the coordinates (ATen's
    ``grid_sampler_compute_source_index_set_grad``)."""
    scale = (size - 1) / 2 if align_corners else size / 2
    position = (coordinates + 1) * scale if align_corners else ((coordinates + 1) * size - 1) / 2
    slope = torch.full_like(position, scale)
    if padding_mode == REFLECTION:
        low, high = (0, 2 * (size - 1)) if align_corners else (-1, 2 * size - 1)
        position, sign = _reflected(position, low, high)
        slope = slope * sign
    if padding_mode in (BORDER, REFLECTION):
        interior = (position > 0) & (position < size - 1)
        position = torch.clamp(position, 0, size - 1)
        slope = slope * interior
    return _Axis(position, slope)


def _reflected(position: torch.Tensor, twice_low: int, twice_high: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``position`` mirrored into ``[twice_low / 2, twice_high / 2]`` and the sign the mirroring gives its
    derivative (ATen's ``reflect_coordinates_set_grad``)."""
    if twice_low == twice_high:
        return torch.zeros_like(position), torch.zeros_like(position)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    shifted = position - low
    sign = torch.where(shifted < 0, -1.0, 1.0).to(position.dtype)
    distance = torch.abs(shifted)
    extra = torch.fmod(distance, span)
    odd = torch.fmod(torch.floor(distance / span), 2) != 0
    mirrored = torch.where(odd, span - extra, extra) + low
    return mirrored, torch.where(odd, -sign, sign)


def _corner(row: torch.Tensor, col: torch.Tensor, height: int, width: int, weight: torch.Tensor | float) -> _Corner:
    """The pixel at (``row``, ``col``) (float positions, whole numbers) of an input plane, with ``weight``."""
    inside = (row >= 0) & (row < height) & (col >= 0) & (col < width)
    pixel = torch.clamp(row, 0, height - 1).long() * width + torch.clamp(col, 0, width - 1).long()
    weight = torch.as_tensor(weight, dtype=row.dtype, device=row.device) * inside
    return _Corner(pixel, inside, weight)


def _scattered(grad: torch.Tensor, pixels: torch.Tensor, corners: list[_Corner], plane: int) -> torch.Tensor:
    """``grad`` ``[N, C, L]`` added to each corner's pixel, times its weight, in ``[N, C, plane]`` zeros: one
    ``scatter_add`` at ``pixels``, the corners' indices side by side (``[N, C, corners * L]``)."""
    batch, channels, _ = grad.shape
    values = torch.cat([grad * corner.weight[:, None, :] for corner in corners], dim=2)
    return grad.new_zeros((batch, channels, plane)).scatter_add(2, pixels, values)


def _bilinear_grid_grad(
    grad: torch.Tensor,
    planes: torch.Tensor,
    pixels: torch.Tensor,
    corners: list[_Corner],
    x: _Axis,
    y: _Axis,
    left: torch.Tensor,
    top: torch.Tensor,
) -> torch.Tensor:
    """The grid's gradient ``[N, L, 2]`` under bilinear interpolation: the channel sums of ``grad`` times the
    slope of the interpolated value along x and along y, times each axis's ``slope``; the corners' values
    gathered from ``planes`` at ``pixels`` (as :func:`_scattered` adds at them)."""
    batch, channels, length = grad.shape
    values = planes.gather(2, pixels).reshape(batch, channels, len(corners), length)
    inside = torch.stack([corner.inside for corner in corners], dim=1).to(grad.dtype)
    weighted = (values * grad[:, :, None, :]).sum(dim=1) * inside
    top_left, top_right, bottom_left, bottom_right = weighted.unbind(1)
    dy, dx = y.position - top, x.position - left
    along_x = (top_right - top_left) * (1 - dy) + (bottom_right - bottom_left) * dy
    along_y = (bottom_left - top_left) * (1 - dx) + (bottom_right - top_right) * dx
    return torch.stack([along_x * x.slope, along_y * y.slope], dim=-1)
