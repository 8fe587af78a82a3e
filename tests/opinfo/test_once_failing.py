"""OpInfo checks of the ops that once gave wrong results or errors through ORTModule: each now matches eager."""

from __future__ import annotations

import pytest

from tests.opinfo import assert_matches_eager
from tests.opinfo.conformance import ONCE_FAILING


@pytest.mark.parametrize("in_model", [False, True], ids=["alone", "in_model"])
@pytest.mark.parametrize("name", ONCE_FAILING)
def test_op_matches_eager(name: str, in_model: bool) -> None:
    assert_matches_eager(name, in_model)
