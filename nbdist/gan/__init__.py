"""Generative adversarial networks: a generator and a discriminator trained as one model.

`GanModel` is what a model file or a `%%distnn train --gan` cell defines; the framework's
GAN backend (`gan_backend`: torch_backend.py, keras_backend.py) trains it with the
alternation in `training.py`; `GaussianMMD` measures how close generated samples are to real ones.
"""

from nbdist.gan.backend import gan_backend
from nbdist.gan.model import GanModel
from nbdist.gan.stats import GaussianMMD, median_distance

__all__ = ["GanModel", "GaussianMMD", "median_distance", "gan_backend"]
