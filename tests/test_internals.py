"""Private names of torch, ONNX Runtime and Lightning are used in one module per library, and nowhere else: a
release that moves one breaks one file, whose feature tests say which version."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_ort"
LIBRARIES = ("torch", "onnxruntime", "lightning", "lightning_fabric", "pytorch_lightning")
INTERNALS = {
    PACKAGE / "engine" / "torch_internals.py",
    PACKAGE / "engine" / "ort_internals.py",
    PACKAGE / "lightning" / "lightning_internals.py",
}
NAMED_TUPLE_METHODS = {"_replace", "_asdict", "_fields", "_make"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


CONSTRUCTORS = {"__init__", "__post_init__", "__new__", "__setstate__"}


def _own_attributes() -> set[str]:
    """Private names the package defines itself: its functions, classes and module globals, the attributes its
    constructors set, and names it spells out as strings (``self.__dict__["_module"]``).

    An attribute set outside a constructor does not count: assigning a base class's private attribute (a
    Lightning strategy's) is using it. The internals modules, which spell out the libraries' names, do not
    count.
    """
    names: set[str] = set()
    for path in set(PACKAGE.rglob("*.py")) - INTERNALS:
        tree = ast.parse(path.read_text())
        constructors = [
            node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name in CONSTRUCTORS
        ]
        for node in [node for body in constructors for node in ast.walk(body)]:
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names.add(node.value)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return names


def _outside_libraries(tree: ast.AST) -> set[str]:
    """Names ``tree`` binds by importing modules other than the libraries' (``sys``, ``ctypes``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] not in LIBRARIES}
    return names


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def _is_op_namespace(node: ast.expr) -> bool:
    """Whether ``node`` is ``aten``, ``prims`` or ``torch.ops.aten``: ATen operators' names (``_to_copy``) are
    their names in the IR, not private Python."""
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name in {"aten", "prims"}


def private_uses(source: str, own: set[str]) -> list[str]:
    """``line: what`` for each private name of the libraries that ``source`` imports or reads."""
    found = []
    tree = ast.parse(source)
    others = _outside_libraries(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                root, *parts = alias.name.split(".")
                if root in LIBRARIES and any(_private(part) for part in parts):
                    found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            root, *parts = node.module.split(".")
            if root in LIBRARIES and (
                any(_private(part) for part in parts) or any(_private(alias.name) for alias in node.names)
            ):
                found.append(f"{node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            root = _root(node)
            if node.attr in own or node.attr in NAMED_TUPLE_METHODS or _is_op_namespace(node.value):
                continue
            if isinstance(root, ast.Name) and root.id in others:
                continue
            found.append(f"{node.lineno}: .{node.attr}")
    return found


def test_private_names_of_other_libraries_are_used_only_in_the_internals_modules() -> None:
    own = _own_attributes()
    offenders = {
        str(path.relative_to(PACKAGE)): uses
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in INTERNALS and (uses := private_uses(path.read_text(), own))
    }
    assert not offenders, f"use these through the internals modules instead: {offenders}"


@pytest.mark.parametrize(
    "line",
    [
        "import torch._dynamo.utils",
        "from torch.utils import _pytree",
        "from torch.nn.modules.loss import _Loss",
        "from onnxruntime.capi import _pybind_state",
        "value = trainer._logger_connector",
        "session._sess.run_with_iobinding(binding)",
        "self._tensor_parallel_size = 1",
    ],
)
def test_the_check_finds_a_private_name(line: str) -> None:
    assert private_uses(line, _own_attributes()), line
