"""``F.grid_sample``'s gradients decomposed (:mod:`lightning_ort.engine.fx.grid_sample`): ATen's values, and a
spatial transformer that trains in ONNX Runtime alone."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_ort import ORTModule
from lightning_ort.engine.fx.grid_sample import BILINEAR, BORDER, NEAREST, REFLECTION, ZEROS, grid_sampler_2d_backward
from tests.helpers import assert_fp64_accuracy

aten = torch.ops.aten


def _grid(batch: int, height: int, width: int) -> torch.Tensor:
    """Points up to 30% past the input's edges, and some on the edges, pixel centres and corners themselves."""
    grid = torch.rand(batch, height, width, 2, dtype=torch.float64) * 2.6 - 1.3
    grid[:, 0, :4] = torch.tensor([[-1.0, -1.0], [1.0, 1.0], [0.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
    return grid


@pytest.mark.parametrize("interpolation", [BILINEAR, NEAREST], ids=["bilinear", "nearest"])
@pytest.mark.parametrize("padding", [ZEROS, BORDER, REFLECTION], ids=["zeros", "border", "reflection"])
@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("size", [(5, 7), (1, 4)], ids=["5x7", "1x4"])
def test_gradients_match_aten(interpolation: int, padding: int, align_corners: bool, size: tuple[int, int]) -> None:
    torch.manual_seed(0)
    images = torch.randn(2, 3, *size, dtype=torch.float64)
    grid = _grid(2, 4, 6)
    grad = torch.randn(2, 3, 4, 6, dtype=torch.float64)
    args = (grad, images, grid, interpolation, padding, align_corners, [True, True])
    ours, theirs = grid_sampler_2d_backward(*args), aten.grid_sampler_2d_backward(*args)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-12, atol=1e-12, msg="input gradient")
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-12, atol=1e-12, msg="grid gradient")


def test_computes_only_the_gradients_asked_for() -> None:
    images, grid, grad = torch.randn(1, 2, 3, 3), _grid(1, 2, 4).float(), torch.randn(1, 2, 2, 4)
    only_input = grid_sampler_2d_backward(grad, images, grid, BILINEAR, ZEROS, False, [True, False])
    only_grid = grid_sampler_2d_backward(grad, images, grid, BILINEAR, ZEROS, False, [False, True])
    assert only_input[1] is None and only_input[0] is not None and only_input[0].shape == images.shape
    assert only_grid[0] is None and only_grid[1] is not None and only_grid[1].shape == grid.shape


def test_half_precision_input_gradients_accumulate_in_float32() -> None:
    # 64 output points read the same pixel: each 0.1 added in bfloat16 would stall far below 6.4.
    images = torch.zeros(1, 1, 2, 2, dtype=torch.bfloat16)
    grid = torch.full((1, 8, 8, 2), -1.0, dtype=torch.bfloat16)
    grad = torch.full((1, 1, 8, 8), 0.1, dtype=torch.bfloat16)
    grad_input, _ = grid_sampler_2d_backward(grad, images, grid, NEAREST, ZEROS, True, [True, False])
    assert grad_input.dtype == torch.bfloat16
    assert grad_input[0, 0, 0, 0].item() == pytest.approx(6.4, rel=1e-2)


def test_bicubic_interpolation_stays_atens() -> None:
    images, grid, grad = torch.randn(1, 1, 4, 4), torch.zeros(1, 2, 2, 2), torch.randn(1, 1, 2, 2)
    assert grid_sampler_2d_backward(grad, images, grid, 2, ZEROS, False, [True, True]) is NotImplemented


class SpatialTransformer(nn.Module):
    """A spatial transformer network (Jaderberg et al.): a localisation net predicts an affine map, the images are
    resampled by it, and a small classifier reads them."""

    def __init__(self, mode: str, padding_mode: str) -> None:
        super().__init__()
        self.mode, self.padding_mode = mode, padding_mode
        self.localisation = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 6))
        with torch.no_grad():  # near the identity, as a trained localisation net starts
            self.localisation[-1].weight.mul_(0.1)
            self.localisation[-1].bias.copy_(torch.tensor([0.9, 0.1, 0.05, -0.1, 0.9, -0.05]))
        self.classifier = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(16, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        theta = self.localisation(images).view(-1, 2, 3)
        grid = F.affine_grid(theta, list(images.shape), align_corners=False)
        resampled = F.grid_sample(images, grid, self.mode, self.padding_mode, align_corners=False)
        return self.head(self.classifier(resampled))


@pytest.mark.parametrize(
    ("mode", "padding_mode"), [("bilinear", "zeros"), ("bilinear", "reflection"), ("nearest", "border")]
)
def test_spatial_transformer_trains_in_onnx_runtime_as_eager(mode: str, padding_mode: str) -> None:
    # A sample point within rounding of a pixel boundary moves its bilinear slope (the grid's gradient) or its
    # nearest pixel, so ORT is held to eager float32's own distance to float64, on perturbed inputs too.
    torch.manual_seed(0)
    model = SpatialTransformer(mode, padding_mode)
    wrapped = ORTModule(copy.deepcopy(model), fallback="raise")
    assert_fp64_accuracy(model, wrapped, torch.randn(8, 3, 16, 16), perturbations=2)
    assert wrapped.statistics.backward_runs == 1 and wrapped.statistics.fallback_ops == 0
