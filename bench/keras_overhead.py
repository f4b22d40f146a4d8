"""What nbdist's Keras backend costs a worker: its step against Keras's own training step.

Same Keras model, data, batch order, optimizer (SGD 0.05, momentum 0.9), one TensorFlow
thread, in one process:

  keras          model.train_on_batch (Keras's compiled train step, weights in variables)
  nbdist step    KerasBackend.compute_gradients + its flat optimizer's step: what a worker
                 or an allreduce rank does per batch, without the messages (stateless call
                 on tensors cut from the flat buffer, gradient out, flat keras optimizer)
  nbdist train   nbdist.train, allreduce topology on one rank (COMM_SELF): the whole loop
                 with sharding, records and validation

Two models: the digits MLP of the tests (64-64-10, batch 32: per-call overhead dominates)
and a 64-512-512-10 MLP (batch 128). samples/s over the middle epochs; the three runs
alternate for several rounds and each keeps its best round, so load that comes and goes
hits all of them. The two step loops are timed in the process's CPU seconds: an epoch
of the large MLP is 11 batches (about 20 ms), and in wall time another process's time
slice in one of them moved the ratio by half (0.50x at a load average of 21, 1.03x a
minute before); nbdist.train's own epoch times are wall time. Aim: nbdist step >= 0.95x
keras.
Usage: python bench/keras_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

OPTIMIZER = "sgd(lr=0.05, momentum=0.9)"
AIM = 0.95
SIZES = {"small": ((64,), 32), "large": ((512, 512), 128)}


def build(hidden: tuple[int, ...]):
    import keras

    keras.utils.set_random_seed(0)
    layers = [keras.Input(shape=(64,))] + [keras.layers.Dense(h, activation="relu") for h in hidden]
    model = keras.Sequential(layers + [keras.layers.Dense(10, activation="softmax")])
    model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def batches(n: int, batch_size: int, epochs: int):
    from nbdist.data.sharding import ShardPlan

    plan = ShardPlan(n, 1, batch_size, seed=0)
    return [plan.epoch(epoch, 0) for epoch in range(epochs)]


def rate(seconds: list[float], samples: int) -> float:
    middle = seconds[1:-1] or seconds
    return samples * len(middle) / sum(middle)


def keras_loop(hidden, data, batch_size: int, epochs: int) -> float:
    import keras

    model = build(hidden)
    model.compile(
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
    )
    seconds = []
    for epoch in batches(data.n_train, batch_size, epochs):
        t0 = time.process_time()
        for indices in epoch:
            model.train_on_batch(*data.train_batch(indices))
        seconds.append(time.process_time() - t0)
    return rate(seconds, data.n_train)


def nbdist_step(hidden, data, batch_size: int, epochs: int) -> float:
    from nbdist.backends import backend_for
    from nbdist.specs import parse_spec

    backend = backend_for(build(hidden), sample=data.x_train[:256])
    opt = backend.make_optimizer(parse_spec(OPTIMIZER))
    seconds = []
    for epoch in batches(data.n_train, batch_size, epochs):
        t0 = time.process_time()
        for indices in epoch:
            backend.compute_gradients(*data.train_batch(indices))
            opt.step(backend.grads)
        seconds.append(time.process_time() - t0)
    return rate(seconds, data.n_train)


def nbdist_train(hidden, data, batch_size: int, epochs: int) -> float:
    from mpi4py import MPI

    import nbdist

    with tempfile.TemporaryDirectory(prefix="nbdist-bench-") as runs:
        result = nbdist.train(
            lambda: build(hidden),
            data=data,
            comm=MPI.COMM_SELF,
            topology="allreduce",
            worker_optimizer=OPTIMIZER,
            epochs=epochs,
            batch_size=batch_size,
            runs_dir=runs,
            quiet=True,
        )
    middle = result.history[1:-1] or result.history
    return sum(h["samples"] for h in middle) / sum(h["seconds"] for h in middle)


def main() -> None:
    from _common import aim, header, table

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer epochs and rounds")
    args = p.parse_args()
    epochs, rounds = (4, 2) if args.quick else (10, 3)

    import keras
    import tensorflow as tf

    from nbdist.datasets import digits

    data = digits()
    header("nbdist's Keras backend against Keras's own train step")
    print(
        f"   keras {keras.__version__}, tensorflow {tf.__version__}; digits {tuple(data.x_train.shape)} train; "
        f"{OPTIMIZER}; {epochs} epochs per run, best of {rounds} alternating rounds"
    )
    print()
    rows, met = [], True
    for name, (hidden, batch_size) in SIZES.items():
        best = {"keras": 0.0, "step": 0.0, "train": 0.0}
        for _ in range(rounds):
            for key, run in (("keras", keras_loop), ("step", nbdist_step), ("train", nbdist_train)):
                best[key] = max(best[key], run(hidden, data, batch_size, epochs))
        peer, step, train = best["keras"], best["step"], best["train"]
        label = f"{name} MLP 64-{'-'.join(map(str, hidden))}-10, batch {batch_size}"
        rows += [
            [f"{label}: keras train_on_batch", peer, 1.0],
            [f"{label}: nbdist step", step, step / peer],
            [f"{label}: nbdist.train allreduce, 1 rank", train, train / peer],
        ]
        met &= aim(f"nbdist step vs keras, {name}", AIM, step / peer)
    print()
    table(rows, ["run", "samples/s", "vs keras"])


if __name__ == "__main__":
    main()
