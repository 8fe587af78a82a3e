"""The CI subset of the OpInfo conformance run: every op family our decompositions and rewrites touch."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.opinfo.conformance import CI_SUBSET, check_op, eligible_ops, op_key


@functools.cache
def _ops() -> dict[str, Any]:
    return {op_key(op): op for op in eligible_ops()}


@pytest.mark.parametrize("name", CI_SUBSET)
def test_op_matches_eager(name: str) -> None:
    outcome = check_op(_ops()[name])
    assert outcome.status in ("pass", "fallback"), f"{name}: {outcome.status}: {outcome.detail}"
