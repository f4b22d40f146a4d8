"""A 225k-parameter MLP on digits: checkpoints of a few MB, big enough that a nearly full
disk cannot take the next one while the logs still fit (tests/test_bad_input.py and
bench/faults.py fill a small file system under a run)."""

from torch import nn

import nbdist.datasets


def build_model(params=None):
    return nn.Sequential(nn.Linear(64, 3000), nn.ReLU(), nn.Linear(3000, 10))


loss = nn.CrossEntropyLoss()
metric = "accuracy"


def load_data():
    return nbdist.datasets.digits()
