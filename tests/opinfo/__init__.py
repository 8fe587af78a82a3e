"""PyTorch's OpInfo database through ORTModule (:mod:`tests.opinfo.conformance`) and its CI subset."""

from __future__ import annotations

import functools
from typing import Any

from tests.opinfo.conformance import check_op, eligible_ops, op_key


@functools.cache
def _ops() -> dict[str, Any]:
    return {op_key(op): op for op in eligible_ops()}


def assert_matches_eager(name: str, in_model: bool = False) -> None:
    """Run op ``name``'s chosen sample through a fresh ORTModule; it must match eager (in ORT or by fallback).

    ``in_model`` feeds the op from a layer with a parameter (:class:`~tests.opinfo.conformance.OpModule`).
    """
    outcome = check_op(_ops()[name], in_model)
    assert outcome.status in ("pass", "fallback"), f"{name}: {outcome.status}: {outcome.detail}"
