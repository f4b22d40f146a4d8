"""The digits MLP with every training step at least PACE seconds long (it sleeps first),
so that a run lasts a known minimum however fast the machine: a test that must act while
the run still trains (lock its store, signal it) is not outrun by it."""

import time

from torch import nn

import nbdist.datasets

PACE = 0.01


class Paced(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        if self.training:
            time.sleep(PACE)
        return self.net(x)


def build_model():
    return Paced()


metric = "accuracy"


def load_data():
    return nbdist.datasets.digits()
