"""nbdist: distributed training and hyper-parameter optimisation on MPI, from Jupyter."""

from nbdist import data, datasets  # nbdist.datasets.digits() after a plain `import nbdist`
from nbdist.__about__ import __version__
from nbdist.api import scale, study, train
from nbdist.cluster import Cluster
from nbdist.layout import Layout
from nbdist.options import StudyOptions, TrainOptions

__all__ = [
    "train",
    "study",
    "scale",
    "Study",
    "Cluster",
    "Layout",
    "TrainOptions",
    "StudyOptions",
    "data",
    "datasets",
    "load_ipython_extension",
    "__version__",
]


def load_ipython_extension(shell):  # IPython's hook: %load_ext nbdist
    from nbdist.magics import load_ipython_extension as load

    load(shell)


def __getattr__(name: str):  # nbdist.Study without importing the notebook layer up front
    if name == "Study":
        from nbdist.notebook_study import Study

        return Study
    raise AttributeError(f"module 'nbdist' has no attribute {name!r}")
