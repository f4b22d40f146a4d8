"""The per-rank training loop and its services: checkpoints, early stopping, results."""
