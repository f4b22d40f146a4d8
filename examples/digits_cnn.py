"""A small CNN on scikit-learn's digits as 1x8x8 images, with BatchNorm (its running
statistics are synchronised like the weights).

    mpiexec -n 4 python -m nbdist train --model examples/digits_cnn.py --topology allreduce
"""

from torch import nn

import nbdist.datasets


def build_model():
    return nn.Sequential(
        nn.Conv2d(1, 16, kernel_size=3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 10),
    )


loss = nn.CrossEntropyLoss()
metric = "accuracy"


def load_data():
    return nbdist.datasets.digits(images=True)
