"""Sphinx configuration: ``nox -s docs`` builds ``docs/_build/html``."""

from __future__ import annotations

from importlib import metadata

project = "lightning-ort"
author = "lightning-ort developers"
release = metadata.version("lightning-ort")
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
html_theme = "alabaster"
autodoc_typehints = "description"
myst_heading_anchors = 3
