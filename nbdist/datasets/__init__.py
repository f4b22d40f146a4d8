"""Small real datasets that are made or shipped offline (nothing is downloaded)."""

from nbdist.datasets.digits import digits
from nbdist.datasets.jet_images import JetSample, jet_images

__all__ = ["digits", "jet_images", "JetSample"]
