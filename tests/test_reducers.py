"""make_reducer's choice on one rank: the sum over one rank is the gradient itself."""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from nbdist.backends.torch import TorchBackend
from nbdist.specs import parse_spec
from nbdist.transport.collectives import Collectives
from nbdist.transport.reducers import AloneReducer, MpiReducer, make_reducer

X, Y = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32), np.array([0, 1, 0, 1, 1, 0])


def gradient(reducer_options: dict) -> tuple[object, np.ndarray]:
    torch.manual_seed(0)
    backend = TorchBackend(torch.nn.Linear(4, 2))
    reducer = make_reducer("auto", MPI.COMM_SELF, backend, 2**20, Collectives(lambda: 30.0), **reducer_options)
    stats = backend.compute_gradients(X, Y)
    trailer = np.array([stats.n, stats.loss_sum, stats.metric_sum, 0.0], np.float32)
    before = trailer.copy()
    reducer.finish(trailer)
    assert np.array_equal(trailer, before)  # the sums over one rank
    return reducer, np.array(backend.rule_grads, copy=True)


def test_one_rank_reduces_nothing_and_keeps_the_gradient_an_mpi_sum_gives():
    alone, grads = gradient({})
    assert isinstance(alone, AloneReducer) and alone.bytes_sent == 0 and alone.way.startswith("mpi")
    summed, reduced = gradient({"alone_reduces_nothing": False})
    assert isinstance(summed, MpiReducer) and summed.bytes_sent == 4 * grads.size
    assert np.abs(grads).max() > 0 and np.array_equal(grads, reduced)


def test_a_compressed_gradient_goes_through_its_codec_on_one_rank_too():
    reducer, _ = gradient({"compression": parse_spec("fp16")})
    assert isinstance(reducer, MpiReducer)
