"""An MLP on scikit-learn's digits, given as two pipeline stages (--worker-parallel pipeline).

    python -m nbdist launch -n 5 train --model examples/digits_pipeline.py \
        --procs-per-worker 2 --worker-parallel pipeline --micro-batches 4 --algorithm easgd

Each worker spans two processes, one stage each; the master holds the whole model, the
stages in a row (build_model is not needed: without one, the stages in a row are the
model, and the same file trains unsplit too).
"""

from torch import nn

import nbdist.datasets


def build_stages():
    return [
        nn.Sequential(nn.Linear(64, 128), nn.ReLU()),
        nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)),
    ]


loss = nn.CrossEntropyLoss()
metric = "accuracy"


def load_data():
    return nbdist.datasets.digits()
