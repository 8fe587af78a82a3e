"""Test configuration: CUDA tests skip on machines without a GPU and onnxruntime-gpu's CUDA provider; the model
zoo's coverage table is printed after the run.

The zoo's results reach the table as test-report properties, so the table also appears when pytest-xdist runs
the tests in worker processes (``-n auto``): the reports, not the workers' memory, come back to the main process.
"""

from __future__ import annotations

import onnxruntime as ort
import pytest
import torch

from tests.zoo.architectures import ARCHITECTURES
from tests.zoo.coverage import ZOO_PROPERTY, ZooResult, summary

ZOO_RESULTS: dict[str, ZooResult] = {}


def cuda_available() -> bool:
    return torch.cuda.is_available() and "CUDAExecutionProvider" in ort.get_available_providers()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU, a CUDA build of torch and onnxruntime-gpu")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for name, value in report.user_properties:
        if name == ZOO_PROPERTY:
            result = ZooResult(**value)
            ZOO_RESULTS[result.name] = result


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    ours = {case.name for case in ARCHITECTURES}
    zoo = [ZOO_RESULTS[case.name] for case in ARCHITECTURES if case.name in ZOO_RESULTS]
    others = [result for name, result in ZOO_RESULTS.items() if name not in ours]
    for title, results in (("lightning-ort model zoo coverage", zoo), ("Hugging Face models, padded batches", others)):
        if results:
            terminalreporter.write_sep("=", title)
            terminalreporter.write_line(summary(results))
