"""Sphinx configuration for curvax's documentation (MyST Markdown, API reference from docstrings).

Build: ``pip install ".[docs]" && sphinx-build -W -b html docs docs/_build/html``.
The benchmark page's plots are drawn from ``benchmarks/results/*.json`` at build time
(``docs/_ext/benchmark_plots.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent / "_ext"))

import curvax  # noqa: E402

project = "curvax"
author = "curvax developers"
copyright = "2026, curvax developers"
release = curvax.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "benchmark_plots",
    "api_pages",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "_generated/benchmark_results.md"]
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# ``Attributes:`` sections as fields: as attribute directives they would describe a dataclass's
# fields a second time (autodoc's ``:members:`` already does).
napoleon_use_ivar = True
# Type hints name jax/numpy types Sphinx cannot resolve without intersphinx (no network at build
# time); those references are not warnings about our documentation.
nitpicky = False
suppress_warnings = ["ref.python"]

html_theme = "furo"
html_title = f"curvax {release}"
html_static_path: list[str] = []
