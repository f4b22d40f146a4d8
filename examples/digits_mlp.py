"""A small MLP on scikit-learn's digits (8x8 images flattened to 64 features).

    mpiexec -n 4 python -m nbdist train --model examples/digits_mlp.py --algorithm easgd
    mpiexec -n 9 python -m nbdist study --model examples/digits_mlp.py --groups 2 --folds 2 --workers 1 \
        --space "lr=log(1e-3,0.5) hidden=int(8,128) optimizer=cat(sgd,adam)" --trials 12

In a study, build_model gets the trial's parameters (here `hidden`; `lr` and `optimizer`
set the optimiser); trained on its own, the defaults.
"""

from torch import nn

import nbdist.datasets


def build_model(params=None):
    hidden = int((params or {}).get("hidden", 64))
    return nn.Sequential(
        nn.Linear(64, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


loss = nn.CrossEntropyLoss()
metric = "accuracy"


def load_data():
    return nbdist.datasets.digits()
