"""A 10.2M-parameter MLP on digits: big enough that a stop checkpoint takes time to write
(tests/test_faults_mpi.py stops it with SIGTERM)."""

from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(64, 2500), nn.ReLU(), nn.Linear(2500, 4000), nn.ReLU(), nn.Linear(4000, 10))
