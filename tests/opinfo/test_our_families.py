"""OpInfo checks of the op families our decompositions and FX or ONNX rewrites touch."""

from __future__ import annotations

import pytest

from tests.opinfo import assert_matches_eager
from tests.opinfo.conformance import OUR_FAMILIES


@pytest.mark.parametrize("in_model", [False, True], ids=["alone", "in_model"])
@pytest.mark.parametrize("name", OUR_FAMILIES)
def test_op_matches_eager(name: str, in_model: bool) -> None:
    assert_matches_eager(name, in_model)
