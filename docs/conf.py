"""Sphinx configuration of nbdist's docs site: `make docs` builds it into docs/_build/html.

Offline by design: no intersphinx, no theme or maths from a CDN (furo uses the system's
fonts; MathJax ships with the site), and the tutorials are rendered from the notebooks
without running them (tests/test_notebooks.py runs them). docs/_ext/offline_site.py fails
the build if a page would load anything from the internet.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(DOCS / "_ext"))

from nbdist.__about__ import __version__  # noqa: E402

project = "nbdist"
author = "nbdist developers"
copyright = "2026, nbdist developers"
version = release = __version__

extensions = [
    "myst_nb",  # Markdown pages (MyST) and the notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx-mathjax-offline",
    "nbdist_reference",  # the pages generated from the code (options, CLI, registries)
    "offline_site",
]

exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
# Single backticks in docstrings (reStructuredText) read as code, as they do in Markdown.
default_role = "code"
# Command lines stay as typed: "--epochs" keeps its two hyphens instead of becoming a dash.
smartquotes = False

# -- MyST and the notebooks -----------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]
myst_heading_anchors = 3
# The test suite executes every tutorial (tests/test_notebooks.py); the site shows them as
# committed, without outputs, and builds without an MPI cluster.
nb_execution_mode = "off"
# No ipywidgets JavaScript from a CDN: the tutorials have no widget state to show.
nb_ipywidgets_js = {}

# -- autodoc ---------------------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_default_options = {"undoc-members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# Optional frameworks the API pages mention but the docs build needs not import.
autodoc_mock_imports: list[str] = []

# -- HTML ------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"nbdist {release}"
html_static_path: list[str] = []
html_show_sourcelink = False
