"""A small MLP on scikit-learn's digits (8x8 images flattened to 64 features).

    mpiexec -n 4 python -m nbdist train --model examples/digits_mlp.py --algorithm easgd
"""

from torch import nn

import nbdist.datasets


def build_model():
    return nn.Sequential(
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


loss = nn.CrossEntropyLoss()
metric = "accuracy"


def load_data():
    return nbdist.datasets.digits()
