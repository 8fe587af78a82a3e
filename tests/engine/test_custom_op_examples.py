"""The examples in the docstrings of lightning_ort's own PyTorch ops run and hold.

``torch.library.custom_op`` turns each decorated function into an op object that pytest's doctest collection
does not see, so their examples are read from the source here.
"""

from __future__ import annotations

import ast
import doctest
import inspect
from types import ModuleType

import pytest

from lightning_ort.engine.fx import batch_norm, conv_phases, gelu, layer_norm, max_pool


def _custom_op_docstrings(module: ModuleType) -> list[tuple[str, str, int]]:
    """``(name, docstring, line)`` of each function of ``module`` decorated with ``torch.library.custom_op``."""
    found = []
    for node in ast.parse(inspect.getsource(module)).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        decorators = [d.func for d in node.decorator_list if isinstance(d, ast.Call)]
        if any(isinstance(d, ast.Attribute) and d.attr == "custom_op" for d in decorators):
            found.append((node.name, ast.get_docstring(node) or "", node.lineno))
    return found


@pytest.mark.parametrize(
    "module", [batch_norm, conv_phases, gelu, layer_norm, max_pool], ids=lambda m: m.__name__.rsplit(".", 1)[-1]
)
def test_the_examples_of_each_custom_op_hold(module: ModuleType) -> None:
    ops = _custom_op_docstrings(module)
    assert ops, "the module defines custom ops"
    for name, docstring, line in ops:
        test = doctest.DocTestParser().get_doctest(docstring, dict(vars(module)), name, module.__file__, line)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        runner.run(test)
        assert test.examples, f"{name} has an example"
        assert runner.failures == 0, f"{name}'s example failed"
