"""nbdist: distributed training and hyper-parameter optimisation on MPI, from Jupyter."""

from nbdist.api import train
from nbdist.layout import Layout
from nbdist.options import TrainOptions

__all__ = ["train", "Layout", "TrainOptions"]
__version__ = "0.1.0"
