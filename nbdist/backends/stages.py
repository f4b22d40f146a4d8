"""A PyTorch model cut into pipeline stages (--worker-parallel pipeline).

Each process of a worker holds one stage as a TorchBackend of its own (flat float32
params and grads, so the rules and checkpoints see it like any model) and runs it one
micro-batch at a time: `forward` keeps the micro-batch's input and output for its
backward pass, `backward` takes the gradient of the output and gives the gradient of the
input, and the last stage's `loss_backward` starts it from the loss. Gradients add up
over a batch's micro-batches, each weighted by its share of the batch's samples, so a
batch's gradient is the unsplit model's.

The whole model is the stages in a row (`stage_model`): its flat buffer is the stages'
buffers one after another, last stage first (TorchBackend lays parameters out in
reverse order), which is how a worker's leader gathers them into one message.

Under --topology allreduce each stage's gradient is reduced with the same stage of the
other replicas in buckets (`bucket_hooks`): a bucket starts once the batch's last
micro-batch has gone backward through it (`begin_batch` counts the hook calls).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from nbdist.backends.base import BatchStats, ModelError
from nbdist.backends.torch import TorchBackend

__all__ = ["TorchStage", "stage_model", "check_stages"]


def check_stages(stages: list[Any]) -> None:
    """Every stage a torch module (a pipeline is PyTorch only), at least one parameter each."""
    for index, stage in enumerate(stages):
        if not isinstance(stage, nn.Module):
            raise ModelError(
                f"--worker-parallel pipeline is PyTorch only: stage {index} of build_stages() is a "
                f"{type(stage).__name__}, not a torch.nn.Module"
            )
        if not any(p.requires_grad for p in stage.parameters()):
            raise ModelError(
                f"--worker-parallel pipeline: stage {index} of build_stages() has no trainable "
                f"parameters; move its layers into a neighbouring stage"
            )


def stage_model(stages: list[Any]) -> nn.Module:
    """The whole model: the stages in a row (what a master holds and validates)."""
    check_stages(stages)
    return nn.Sequential(*stages)


class TorchStage(TorchBackend):
    """One pipeline stage: `first` takes the data, `last` computes the loss."""

    def __init__(self, stage: nn.Module, index: int, count: int, loss: Any = None, metric: Any = "accuracy"):
        super().__init__(stage, loss, metric)
        self.index, self.first, self.last = index, index == 0, index == count - 1
        self._saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}

    def begin_batch(self, micro: int = 1) -> None:
        """Gradients add up over the `micro` micro-batches of one batch: start from zero. A
        bucket (bucket_hooks) is ready once every micro-batch's backward has reached it."""
        self._flat_grads.zero_()
        self._saved.clear()
        self._pending = [size * micro for size in self._bucket_sizes]

    def end_batch(self) -> None:
        """After the batch's last backward (bucket hooks only)."""
        if self._on_ready is not None:
            self._finish_buckets()

    def forward(self, micro: int, inputs: np.ndarray) -> np.ndarray | None:
        """Run micro-batch `micro`; its output as float32 host memory to send on (None on
        the last stage, whose output stays for the loss)."""
        x = torch.from_numpy(inputs).to(self.device)
        if not self.first:
            x.requires_grad_(True)
        output = self.model(x)
        if not isinstance(output, torch.Tensor):
            raise ModelError(
                f"--worker-parallel pipeline: stage {self.index} returned a {type(output).__name__}; "
                f"a stage returns one tensor"
            )
        self._saved[micro] = (None if self.first else x, output)
        if self.last:
            return None
        return np.ascontiguousarray(output.detach().to(torch.float32).cpu().numpy())

    def loss_backward(self, micro: int, targets: np.ndarray, weight: float) -> tuple[BatchStats, np.ndarray | None]:
        """Last stage: the loss of micro-batch `micro` times `weight`, backward; its sums
        and the gradient of the stage's input."""
        x, output = self._saved.pop(micro)
        y = self._tensor(targets)
        loss = self.loss_fn(output, y)
        (loss * weight).backward()
        n = len(y)
        with torch.no_grad():
            metric = float(self._metric(output, y)) if self._metric else 0.0
        return BatchStats(float(loss.detach()) * n, metric, n), self._input_grad(x)

    def backward(self, micro: int, output_grad: np.ndarray) -> np.ndarray | None:
        """Backward of micro-batch `micro` from the gradient of its output; the gradient
        of its input (None on the first stage: the data needs none)."""
        x, output = self._saved.pop(micro)
        output.backward(torch.from_numpy(output_grad).to(self.device).view_as(output))
        return self._input_grad(x)

    def infer(self, inputs: np.ndarray) -> np.ndarray:
        """Validation: the stage's output for `inputs` (eval mode, no gradient), to send on."""
        self.model.eval()
        try:
            with torch.no_grad():
                output = self.model(torch.from_numpy(inputs).to(self.device))
        finally:
            self.model.train()
        return np.ascontiguousarray(output.to(torch.float32).cpu().numpy())

    @staticmethod
    def _input_grad(x: torch.Tensor | None) -> np.ndarray | None:
        if x is None or x.grad is None:
            return None
        return np.ascontiguousarray(x.grad.to(torch.float32).cpu().numpy())
