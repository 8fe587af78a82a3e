"""Fixtures of the engine's tests: lightning_ort's CPU kernel library, built once per test module."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_ort.engine.runtime import cpu_kernels


@pytest.fixture(scope="module")
def library() -> Path:
    """The built and checked kernel library; the test fails, with the likely cause, where it did not build."""
    path = cpu_kernels.kernel_library()
    assert path is not None, "lightning_ort's CPU kernels did not build (is a C++ compiler installed?)"
    return path
