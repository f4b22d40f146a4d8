"""A small Keras MLP on scikit-learn's digits: the same run as digits_mlp.py, in Keras 3.

    mpiexec -n 4 python -m nbdist train --model examples/digits_keras.py --algorithm easgd

The compiled loss and metrics are the ones nbdist trains and validates with (the
optimizer given to compile() is not used: workers and masters take --worker-optimizer
and --master-optimizer, any keras.optimizers name).
"""

import keras

import nbdist.datasets


def build_model():
    model = keras.Sequential(
        [
            keras.Input(shape=(64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def load_data():
    return nbdist.datasets.digits()
