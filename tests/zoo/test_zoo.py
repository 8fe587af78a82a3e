"""The coverage zoo: every architecture trains correctly through ORTModule; at least 90% run fully in ORT.

The summary table is printed at the end of the pytest run (``tests/conftest.py``, from the results each test
records as a report property) and by ``python -m tests.zoo``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from lightning_ort.engine.torch_internals import TRACES_RECURRENT_LAYERS
from tests.zoo.architectures import ARCHITECTURES
from tests.zoo.coverage import FULL, PYTORCH, ZOO_PROPERTY, ZooResult, run_case, summary
from tests.zoo.features import Case

RESULTS: dict[str, ZooResult] = {}


def _result(case: Case) -> ZooResult:
    """The case's result, run once per process (``--dist loadfile`` keeps this file in one pytest-xdist worker)."""
    if case.name not in RESULTS:
        RESULTS[case.name] = run_case(case)
    return RESULTS[case.name]


@pytest.mark.parametrize("case", ARCHITECTURES, ids=[c.name for c in ARCHITECTURES])
def test_architecture_trains_like_eager(case: Case, record_property: Callable[[str, Any], None]) -> None:
    result = _result(case)
    record_property(ZOO_PROPERTY, dataclasses.asdict(result))
    assert result.correct, f"{case.name}: output error {result.output_error:.2e}, grad error {result.grad_error:.2e}"


RECURRENT = {"lstm_bidirectional", "lstm_on_features", "gru"}
"""Architectures built on ``nn.LSTM``/``nn.GRU``, which TorchDynamo traces only from torch 2.13."""


def test_zoo_coverage() -> None:
    results = [_result(case) for case in ARCHITECTURES]
    assert len(results) >= 20
    assert all(r.correct for r in results), summary(results)
    if not TRACES_RECURRENT_LAYERS:
        recurrent = [r for r in results if r.name in RECURRENT]
        assert all(r.runs_in == PYTORCH for r in recurrent), summary(results)
        results = [r for r in results if r.name not in RECURRENT]
    full = sum(r.runs_in == FULL for r in results)
    assert full >= 0.9 * len(results), summary(results)
