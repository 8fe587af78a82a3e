"""Packaging: every imported distribution is declared, the package imports uninstalled, and the
``torch.compile`` backend does not import Lightning while the strategies still register with it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]

DISTRIBUTIONS = {
    "lightning": "lightning",
    "numpy": "numpy",
    "onnx": "onnx",
    "onnx_ir": "onnx-ir",
    "onnxruntime": "onnxruntime-gpu",
    "onnxscript": "onnxscript",
    "sympy": "sympy",
    "torch": "torch",
    "torchmetrics": "torchmetrics",
    "typing_extensions": "typing_extensions",
    "transformers": "transformers",
}
"""Import name of each third-party package lightning_ort imports, and the distribution that provides it."""


def _python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


def _imported_top_level_names() -> set[str]:
    names = set()
    for path in (ROOT / "lightning_ort").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"lightning_ort"}


def test_every_imported_distribution_is_declared() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {
        dep.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip()
        for deps in (project["dependencies"], *project["optional-dependencies"].values())
        for dep in deps
    }
    imported = _imported_top_level_names()
    assert imported <= set(DISTRIBUTIONS), f"map these imports to distributions: {imported - set(DISTRIBUTIONS)}"
    missing = {DISTRIBUTIONS[name] for name in imported} - declared
    assert not missing, f"imported but not declared in pyproject.toml: {sorted(missing)}"


def test_imports_from_a_source_tree_that_is_not_installed() -> None:
    version = _python(
        "import importlib.metadata as metadata\n"
        "def not_installed(name): raise metadata.PackageNotFoundError(name)\n"
        "metadata.version = not_installed\n"
        "import sys; sys.path.insert(0, '.')\n"
        "import lightning_ort; print(lightning_ort.__version__)"
    )
    assert version == "0+unknown"


def test_the_torch_compile_backend_does_not_import_lightning() -> None:
    out = _python(
        "import sys, torch\n"
        "model = torch.compile(torch.nn.Linear(4, 2), backend='ort')\n"
        "model(torch.randn(3, 4)).sum().backward()\n"
        "print('lightning_ort' in sys.modules, 'lightning.pytorch' in sys.modules)"
    )
    assert out == "True False"


def test_the_strategies_register_whether_lightning_is_imported_before_or_after() -> None:
    for order in ("import lightning_ort; import lightning.pytorch", "import lightning.pytorch; import lightning_ort"):
        out = _python(
            f"{order}\n"
            "from lightning.pytorch.strategies import StrategyRegistry\n"
            "print(sorted(name for name in StrategyRegistry if name.startswith('ort')))"
        )
        assert out.splitlines()[-1] == "['ort', 'ort_ddp', 'ort_ddp_spawn', 'ort_fsdp']", order


def test_the_lightning_parts_load_first_and_still_register() -> None:
    for first in ("lightning_ort.ORTCallback", "lightning_ort.ORTDDPStrategy", "lightning_ort.ORTFSDPStrategy"):
        out = _python(
            f"import lightning_ort\n{first}\n"
            "from lightning.pytorch.strategies import StrategyRegistry\n"
            "print(sorted(name for name in StrategyRegistry if name.startswith('ort')))"
        )
        assert out.splitlines()[-1] == "['ort', 'ort_ddp', 'ort_ddp_spawn', 'ort_fsdp']", first


def test_a_failed_registration_registers_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_ort.lightning.strategies import ORTFSDPStrategy, register_strategies

    names = ("ort", "ort_ddp", "ort_ddp_spawn", "ort_fsdp")
    for name in names:
        StrategyRegistry.remove(name)

    def broken(cls: type, registry: object) -> None:
        raise RuntimeError("registration failed")

    monkeypatch.setattr(ORTFSDPStrategy, "register_strategies", classmethod(broken))
    with pytest.raises(RuntimeError, match="registration failed"):
        register_strategies()
    assert not any(name in StrategyRegistry for name in names)
    monkeypatch.undo()
    register_strategies()
    assert all(name in StrategyRegistry for name in names)


def test_the_old_statistics_name_still_works_with_a_deprecation_warning() -> None:
    import lightning_ort

    with pytest.warns(DeprecationWarning, match=r"CacheStatistics is now lightning_ort\.ModuleStatistics"):
        old = lightning_ort.CacheStatistics
    assert old is lightning_ort.ModuleStatistics
