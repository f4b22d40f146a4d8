"""The digits MLP with a slow validation: every forward pass in eval mode sleeps
VALIDATION_SLEEP seconds first, and every training step TRAINING_SLEEP (so an epoch lasts
longer than a validation). Whether an asynchronous master serves its workers while it
validates then shows in when its updates were applied."""

import time

from torch import nn

import nbdist.datasets

VALIDATION_SLEEP = 0.5
TRAINING_SLEEP = 0.02


class SlowToValidate(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        time.sleep(TRAINING_SLEEP if self.training else VALIDATION_SLEEP)
        return self.net(x)


def build_model():
    return SlowToValidate()


metric = "accuracy"


def load_data():
    return nbdist.datasets.digits()
