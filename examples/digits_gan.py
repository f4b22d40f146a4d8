"""A GAN that learns to draw scikit-learn's 8x8 digits (PyTorch).

    mpiexec -n 4 python -m nbdist train --gan --model examples/digits_gan.py --epochs 30

By default --gan trains with EASGD and RMSprop workers; the generator and the
discriminator are synchronised together after both trained on a batch. The final
weights hold both models: "generator.*" and "discriminator.*".
"""

from torch import nn

import nbdist.datasets

latent_dim = 16


def build_generator():
    return nn.Sequential(
        nn.Linear(latent_dim, 128),
        nn.LeakyReLU(0.2),
        nn.Linear(128, 64),
        nn.Tanh(),  # pixels in [-1, 1], as the data below
    )


def build_discriminator():
    return nn.Sequential(
        nn.Linear(64, 128),
        nn.LeakyReLU(0.2),
        nn.Linear(128, 1),  # one logit: real or generated
    )


def load_data():
    return nbdist.datasets.digits(pixel_range=(-1.0, 1.0))
