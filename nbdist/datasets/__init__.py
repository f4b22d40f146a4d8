"""Small real datasets that are made or shipped offline (nothing is downloaded)."""

from nbdist.datasets.digits import digits

__all__ = ["digits"]
