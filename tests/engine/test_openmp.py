"""PyTorch's OpenMP worker threads are released before ONNX Runtime runs, and come back for PyTorch."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import torch

from lightning_ort.engine.runtime.openmp import release_openmp_threads

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture
def two_torch_threads() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def _parallel_op() -> torch.Tensor:
    x = torch.ones(1 << 22)
    return x.mul_(2.0)  # large enough for PyTorch to split it over its OpenMP threads


def test_release_ends_idle_worker_threads_and_pytorch_gets_them_back(two_torch_threads: None) -> None:
    _parallel_op()
    with_workers = _thread_count()
    assert release_openmp_threads(), "torch's OpenMP runtime should offer omp_pause_resource_all"
    deadline = time.monotonic() + 5.0
    while _thread_count() >= with_workers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _thread_count() < with_workers, "the idle worker thread should have ended"
    torch.testing.assert_close(_parallel_op(), torch.full((1 << 22,), 2.0))
    assert _thread_count() == with_workers, "the next parallel operator starts its worker again"


def test_release_is_harmless_when_repeated(two_torch_threads: None) -> None:
    assert release_openmp_threads()
    assert release_openmp_threads()
    torch.testing.assert_close(_parallel_op(), torch.full((1 << 22,), 2.0))
