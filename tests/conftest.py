"""Test configuration: CUDA tests skip on machines without a GPU and onnxruntime-gpu's CUDA provider."""

from __future__ import annotations

import onnxruntime as ort
import pytest
import torch


def cuda_available() -> bool:
    return torch.cuda.is_available() and "CUDAExecutionProvider" in ort.get_available_providers()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU, a CUDA build of torch and onnxruntime-gpu")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
