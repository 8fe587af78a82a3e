"""Developer sessions: ``nox -s tests``, ``nox -s lint``, ``nox -s docs``, ``nox -s bench``, ``nox -s opinfo``,
``nox -s compat``.

torch is pinned to 2.13.0 here (the CPU wheel these machines carry); the package itself accepts a range so
GPU users keep their CUDA build. ``compat`` runs the suite on the oldest and the newest torch of that range.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "venv"

TORCH = "torch==2.13.0"
TORCH_RANGE = ("2.11.0", "2.13.0")
"""The oldest and the newest torch the package is tested with (``pyproject.toml`` declares the range)."""

COMPAT_SUBSET = (
    "tests/test_module.py",
    "tests/test_ops_in_model.py",
    "tests/engine/test_blocks.py",
    "tests/engine/test_export.py",
    "tests/lightning/test_wrapping.py",
    "tests/lightning/test_callback.py",
    "tests/lightning/test_export_onnx.py",
)
"""The core ORTModule, block-graph, Lightning and deployment tests: what CI runs on the oldest torch (``-- fast``)."""


@nox.session
def tests(session: nox.Session) -> None:
    session.install(TORCH, "-e", ".[test]")
    session.run("python", "-m", "pytest", "-n", "auto", *session.posargs)


@nox.session
@nox.parametrize("torch", TORCH_RANGE)
def compat(session: nox.Session, torch: str) -> None:
    """The suite on one end of the supported torch range; ``-- fast`` runs :data:`COMPAT_SUBSET` only.

    Versions other than 2.13.0 come from PyPI as CUDA builds (several GB): they run on the CPU all the same.
    """
    session.install(f"torch=={torch}", "-e", ".[test]")
    fast = session.posargs[:1] == ["fast"]
    targets = [*COMPAT_SUBSET, *session.posargs[1:]] if fast else list(session.posargs)
    session.run("python", "-m", "pytest", "-n", "auto", *targets)


@nox.session
def lint(session: nox.Session) -> None:
    session.install(TORCH, "-e", ".[test,lint]")
    session.run("ruff", "check", "lightning_ort", "tests", "examples", "noxfile.py")
    session.run("ruff", "format", "--check", "lightning_ort", "tests", "examples", "noxfile.py")
    session.run("mypy")


@nox.session
def docs(session: nox.Session) -> None:
    session.install(TORCH, "-e", ".[docs]")
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html")


@nox.session
def bench(session: nox.Session) -> None:
    session.install(TORCH, "-e", ".")
    session.run("python", "-m", "lightning_ort.bench", *session.posargs)


@nox.session
def opinfo(session: nox.Session) -> None:
    """PyTorch's OpInfo database through ORTModule: a pass / fallback / wrong / error table (``--ops`` to pick)."""
    session.install(TORCH, "-e", ".[test]")
    session.run("python", "-m", "tests.opinfo.conformance", *session.posargs)
