"""A 10M-parameter MLP on scikit-learn's digits, the large model of bench/scaling_curves.py
(a model file for `python -m nbdist scale --model`)."""

from torch import nn

import nbdist.datasets

SIZES = (64, 3000, 3000, 350, 10)  # 10.2M parameters


def build_model():
    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


loss = nn.CrossEntropyLoss()
metric = "accuracy"


def load_data():
    return nbdist.datasets.digits()
