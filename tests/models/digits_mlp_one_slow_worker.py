"""The digits MLP with one worker slower than the other: every training forward pass
sleeps, SLOW_SLEEP seconds on world rank SLOW_RANK (worker 1 of a 3-rank run: a master,
then workers 0 and 1) and FAST_SLEEP elsewhere, so that the slow worker takes several
times as long per batch whatever the load. (The fast one sleeps too: it then still trains
when the master has timed the slow one's windows.) Evaluation does not sleep."""

import time

from mpi4py import MPI
from torch import nn

import nbdist.datasets

SLOW_RANK = 2
SLOW_SLEEP = 0.03
FAST_SLEEP = 0.005


class SleepsPerStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        self.sleep = SLOW_SLEEP if MPI.COMM_WORLD.Get_rank() == SLOW_RANK else FAST_SLEEP

    def forward(self, x):
        if self.training:
            time.sleep(self.sleep)
        return self.net(x)


def build_model():
    return SleepsPerStep()


loss = nn.CrossEntropyLoss()
metric = "accuracy"


def load_data():
    return nbdist.datasets.digits()
