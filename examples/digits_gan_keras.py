"""A GAN that learns to draw scikit-learn's 8x8 digits (Keras 3): digits_gan.py in Keras.

    mpiexec -n 4 python -m nbdist train --gan --model examples/digits_gan_keras.py --epochs 30

The final weights hold both models' variables by path: "generator/..." and
"discriminator/...".
"""

import keras

import nbdist.datasets

latent_dim = 16


def build_generator():
    return keras.Sequential(
        [
            keras.Input(shape=(latent_dim,)),
            keras.layers.Dense(128),
            keras.layers.LeakyReLU(0.2),
            keras.layers.Dense(64, activation="tanh"),  # pixels in [-1, 1], as the data below
        ]
    )


def build_discriminator():
    return keras.Sequential(
        [
            keras.Input(shape=(64,)),
            keras.layers.Dense(128),
            keras.layers.LeakyReLU(0.2),
            keras.layers.Dense(1),  # one logit: real or generated
        ]
    )


def load_data():
    return nbdist.datasets.digits(pixel_range=(-1.0, 1.0))
