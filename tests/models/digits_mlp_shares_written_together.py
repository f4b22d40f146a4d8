"""The digits MLP, with every rank's checkpoint writer reporting its share of epoch 2 only
together with epoch 3's: as a disk slow enough, or epochs short enough, make it happen
now and then (two shares written between two of a worker's messages)."""

from torch import nn

import nbdist.datasets
from nbdist.train.writer import CheckpointWriter

HELD, WITH = "epoch-0002", "epoch-0003"
_written = CheckpointWriter.written


def _written_together(self):
    done = [*getattr(self, "held", []), *_written(self)]
    self.held = [HELD] if HELD in done and WITH not in done else []
    return [label for label in done if label not in self.held]


CheckpointWriter.written = _written_together


def build_model():
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


metric = "accuracy"


def load_data():
    return nbdist.datasets.digits()
