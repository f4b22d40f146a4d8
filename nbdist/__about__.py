"""The version of nbdist, written here only: setuptools reads it for the package's
metadata (pyproject.toml), `nbdist.__version__` and the docs site take it from here."""

__version__ = "0.1.0"
