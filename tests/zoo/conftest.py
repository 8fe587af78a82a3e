"""Print the zoo's coverage summary after the test run."""

from __future__ import annotations

import pytest

from tests.zoo.architectures import ARCHITECTURES
from tests.zoo.coverage import summary
from tests.zoo.test_zoo import RESULTS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    results = [RESULTS[case.name] for case in ARCHITECTURES if case.name in RESULTS]
    if results:
        terminalreporter.write_sep("=", "lightning-ort model zoo coverage")
        terminalreporter.write_line(summary(results))
