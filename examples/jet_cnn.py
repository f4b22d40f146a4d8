"""A small CNN that tells boosted top-quark jets from QCD jets by their images.

    python -m nbdist datasets jet-images --signal top --events 20000 --out data/jets/ --files 8
    mpiexec -n 5 python -m nbdist train --model examples/jet_cnn.py \\
        --train "data/jets/train_*.h5" --val "data/jets/val_*.h5" --cache-dir /tmp/nbdist-cache

The images are (1, 32, 32) grids of the jet's pT fractions (nbdist.datasets.jet_images).
Most pixels are empty and the filled ones hold a few percent of the jet's pT: the first
layer rescales them, and batch normalisation after the first convolution keeps the
training stable at the default learning rate.
"""

from torch import nn


class PixelScale(nn.Module):
    """Pixel pT fractions (~0.01) to order one: sqrt brings out the soft radiation too."""

    def forward(self, x):
        return (x * 100.0).sqrt()


def build_model():
    return nn.Sequential(
        PixelScale(),
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 16 x 16
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 8 x 8
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),  # 4 x 4
        nn.Flatten(),
        nn.Linear(256, 32),
        nn.ReLU(),
        nn.Linear(32, 2),
    )


loss = nn.CrossEntropyLoss()
metric = "accuracy"
