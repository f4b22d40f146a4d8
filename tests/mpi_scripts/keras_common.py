"""The Keras twin of equivalence_common.py: the same data, batches and optimiser, a Keras
model of the same shape. The MPI job (keras_job.py) trains it with nbdist and computes the
single-process Keras references in the same processes (TensorFlow is imported once there).

Layers and models have explicit names, so two instances in one process have the same
variable paths and their weights compare by name.
"""

from __future__ import annotations

import equivalence_common as common
import keras
import numpy as np

SEED = common.SEED


def build_model() -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input(shape=(common.N_FEATURES,)),
            keras.layers.Dense(16, activation="tanh", name="hidden1"),
            keras.layers.Dense(12, activation="tanh", name="hidden2"),
            keras.layers.Dense(common.N_CLASSES, name="logits"),
        ],
        name="net",
    )
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def initial_model(seed: int = SEED) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return build_model()


def weights(model: keras.Model) -> dict[str, np.ndarray]:
    """As KerasBackend.named_arrays() names them."""
    return {f"{i:04d}/{v.path}": np.array(v.numpy()) for i, v in enumerate(model.weights)}


def plain_keras(model: keras.Model, batches, x: np.ndarray, y: np.ndarray, momentum: float) -> dict[str, np.ndarray]:
    """Keras's own training step (train_on_batch, keras SGD) on each batch in turn."""
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=common.LR, momentum=momentum),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    for batch in batches:
        model.train_on_batch(x[batch], y[batch])
    return weights(model)
