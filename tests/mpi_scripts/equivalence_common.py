"""What the equivalence scripts and tests/test_equivalence_mpi.py share: one small model,
fixed data, the optimiser and the global batches of each step.

The MPI scripts and the single-process references in the test import this same file, so
"same init, same batches, same optimiser" holds by construction. The Keras equivalences
(keras_common.py) use its data, batches and allreduce steps: torch is imported only by
the functions that build torch models, so a Keras job never starts it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from torch import nn

SEED = 7
N_FEATURES, N_CLASSES = 10, 3
LR, MOMENTUM = 0.1, 0.9
OPTIMIZER = f"sgd(lr={LR}, momentum={MOMENTUM})"
# About 40 floats per bucket: the model below (10*16+16 + 16*12+12 + 12*3+3 = 419 floats
# in 6 tensors) is then reduced in several buckets, as a big model would be.
BUCKET_FLOATS = 40


def build_model() -> nn.Module:
    from torch import nn

    return nn.Sequential(
        nn.Linear(N_FEATURES, 16),
        nn.Tanh(),
        nn.Linear(16, 12),
        nn.Tanh(),
        nn.Linear(12, N_CLASSES),
    )


def build_batchnorm_model() -> nn.Module:
    """The model above with BatchNorm statistics (the model state that travels with the
    weights: broadcast, sent to a master, averaged at validation, checkpointed)."""
    from torch import nn

    return nn.Sequential(
        nn.Linear(N_FEATURES, 16),
        nn.BatchNorm1d(16),
        nn.Tanh(),
        nn.Linear(16, N_CLASSES),
    )


def initial_model(seed: int = SEED) -> nn.Module:
    import torch

    torch.manual_seed(seed)
    return build_model()


def make_arrays(n: int = 160, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Separable-ish data: the label depends on the features, so training moves the weights."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, N_FEATURES)).astype(np.float32)
    w = rng.normal(size=(N_FEATURES, N_CLASSES)).astype(np.float32)
    y = np.argmax(x @ w + 0.3 * rng.normal(size=(n, N_CLASSES)), axis=1).astype(np.int64)
    return x, y


def make_data(n_train: int = 96, n_val: int = 32):
    """An nbdist ArrayData over make_arrays (for nbdist.train)."""
    from nbdist.data.arrays import ArrayData

    x, y = make_arrays(n_train + n_val)
    return ArrayData(x[:n_train], y[:n_train], x[n_train:], y[n_train:], name="equivalence", num_classes=N_CLASSES)


def global_batches(steps: int, ranks: int, unequal: bool, n: int = 160) -> list[np.ndarray]:
    """The indices of each step's global batch (a fixed permutation, cut in order).

    Equal: 4 samples per rank. Unequal: 4 * ranks + 1 + step % (ranks - 1) samples, so
    the first ranks get one sample more than the others (how many of them changes from
    step to step).
    """
    order = np.random.default_rng(123).permutation(n)
    out, start = [], 0
    for step in range(steps):
        size = 4 * ranks + (1 + step % max(ranks - 1, 1) if unequal else 0)
        if start + size > n:
            start = 0
        out.append(order[start : start + size])
        start += size
    return out


def rank_part(batch: np.ndarray, ranks: int, rank: int) -> np.ndarray:
    return np.array_split(batch, ranks)[rank]


def reference_weights(steps: int, ranks: int, unequal: bool) -> dict[str, np.ndarray]:
    """One process, plain torch: each step on the whole (concatenated) global batch."""
    import torch
    from torch import nn

    x, y = make_arrays()
    model = initial_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loss_fn = nn.CrossEntropyLoss()
    for batch in global_batches(steps, ranks, unequal):
        opt.zero_grad()
        loss_fn(model(torch.from_numpy(x[batch])), torch.from_numpy(y[batch])).backward()
        opt.step()
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def allreduce_steps(comm, backend, steps: int, unequal: bool):
    """`steps` of nbdist's allreduce path for `backend` (of any framework) on the fixed
    data, as run_allreduce takes them: gradients reduced by MpiReducer (several
    buckets), weighted by each rank's sample share, the backend's flat optimiser. Checks
    that the replicas stay bit-identical; returns the backend."""
    from nbdist.algorithms import allreduce_sgd
    from nbdist.specs import parse_spec
    from nbdist.transport.reducers import MpiReducer

    rank, size = comm.Get_rank(), comm.Get_size()
    x, y = make_arrays()
    reducer = MpiReducer(comm, backend, BUCKET_FLOATS)
    assert len(reducer.buckets) >= 3, reducer.buckets
    opt = backend.make_optimizer(parse_spec(OPTIMIZER))
    trailer = np.zeros(4, np.float32)
    for batch in global_batches(steps, size, unequal):
        parts = np.array_split(batch, size)
        sizes = np.array([len(p) for p in parts])
        assert (sizes.max() - sizes.min()) == (1 if unequal else 0), sizes
        mine = parts[rank]
        stats = backend.compute_gradients(x[mine], y[mine], scale=allreduce_sgd.sample_share(sizes, rank))
        trailer[:] = (stats.n, stats.loss_sum, stats.metric_sum, 0.0)
        reducer.finish(trailer)
        assert int(trailer[0]) == len(batch), (trailer, len(batch))
        allreduce_sgd.apply(opt, backend.rule_grads)
    # The replicas must not drift apart: every rank holds exactly rank 0's weights.
    from nbdist.algorithms.arrays import to_numpy

    everyone = np.empty((size, backend.num_params), np.float32)
    comm.Allgather(to_numpy(backend.params), everyone)
    assert all(np.array_equal(everyone[0], row) for row in everyone), "replicas differ"
    return backend


# -- synchronised BatchNorm (--sync-batchnorm) ------------------------------------------
# name -> (layer, input shape after the batch dimension): every BatchNorm kind, momentum
# None (a cumulative average) and no affine parameters included.
SYNC_BN_STEPS = 2
SYNC_BN_SIZES = (3, 4, 5, 6)  # each rank's samples (4 ranks): the counts differ


def sync_bn_layers() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    layers = {
        "1d": (nn.BatchNorm1d(5), (5,)),
        "1d-sequence": (nn.BatchNorm1d(3, momentum=None), (3, 7)),
        "2d": (nn.BatchNorm2d(4), (4, 5, 5)),
        "3d": (nn.BatchNorm3d(2, eps=1e-3), (2, 3, 4, 4)),
        "2d-no-affine": (nn.BatchNorm2d(3, affine=False), (3, 4, 4)),
    }
    for layer, _ in layers.values():
        if layer.affine:  # not the initial ones and zeros: the gradients then depend on them
            nn.init.uniform_(layer.weight, 0.5, 1.5)
            nn.init.uniform_(layer.bias, -0.5, 0.5)
    return layers


def sync_bn_batches(shape: tuple[int, ...], step: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of `step` (rows in rank order) and the upstream gradient dL/dout
    (L = sum(out * g)), away from zero mean and unit spread."""
    rng = np.random.RandomState(100 + step)
    n = sum(SYNC_BN_SIZES)
    x = (rng.randn(n, *shape) * 2.0 + 3.0).astype(np.float32)
    g = rng.randn(n, *shape).astype(np.float32)
    return x, g
