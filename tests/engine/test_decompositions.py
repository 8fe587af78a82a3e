"""The convolution-backward decomposition matches ATen's kernel."""

from __future__ import annotations

import pytest
import torch

from lightning_ort.engine.decompositions import capture_decompositions, convolution_backward

aten = torch.ops.aten


@pytest.mark.parametrize(
    ("dims", "stride", "padding", "dilation", "groups"),
    [
        (1, 1, 0, 1, 1),
        (1, 2, 1, 1, 2),
        (2, 1, 1, 1, 1),
        (2, 2, 1, 2, 1),
        (2, 3, 2, 1, 4),
        (2, 1, 1, 1, 8),
        (3, 2, 1, 1, 2),
    ],
)
def test_matches_aten(dims: int, stride: int, padding: int, dilation: int, groups: int) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, *([9] * dims), generator=g, dtype=torch.float64)
    w = torch.randn(16, 8 // groups, *([3] * dims), generator=g, dtype=torch.float64)
    args = ([stride] * dims, [padding] * dims, [dilation] * dims, False, [0] * dims, groups)
    y = aten.convolution(x, w, None, *args)
    gy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    expected = aten.convolution_backward(gy, x, w, [16], *args, [True, True, True])
    actual = convolution_backward(gy, x, w, [16], *args, [True, True, True])
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)


def test_respects_output_mask_and_declines_transposed() -> None:
    x, w = torch.randn(2, 4, 6), torch.randn(5, 4, 3)
    gy = torch.randn(2, 5, 4)
    grads = convolution_backward(gy, x, w, None, [1], [0], [1], False, [0], 1, [False, True, False])
    assert grads[0] is None and grads[2] is None and grads[1].shape == w.shape
    assert convolution_backward(gy, x, w, None, [1], [0], [1], True, [0], 1, [True, True, True]) is NotImplemented


def test_table_covers_ops_without_onnx_translation() -> None:
    table = capture_decompositions()
    assert aten.convolution_backward.default in table
    assert aten._native_batch_norm_legit_functional.default in table
