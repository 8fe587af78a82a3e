"""Developer sessions: ``nox -s tests``, ``nox -s lint``, ``nox -s docs``, ``nox -s bench``, ``nox -s opinfo``.

torch is pinned to 2.13.0 here (the CPU wheel these machines carry); the package itself accepts a range so
GPU users keep their CUDA build.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "venv"

TORCH = "torch==2.13.0"


@nox.session
def tests(session: nox.Session) -> None:
    session.install(TORCH, "-e", ".[test]")
    session.run("python", "-m", "pytest", "-n", "auto", *session.posargs)


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
