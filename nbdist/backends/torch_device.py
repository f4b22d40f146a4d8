"""Where a PyTorch model lives (--device), and the copies a staged transfer needs there.

cuda: each rank takes GPU local_rank % gpus, or one clear error where torch sees none.
cpu: the CPU, with the rules and the transport's staging on torch tensors: the device
path a GPU run takes, run where the test suite can check it against the host path.
auto: GPU local_rank % gpus where torch sees one, else the host path (numpy views of the
flat buffers on the CPU, zero-copy for MPI).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import numpy as np
import torch

from nbdist.backends.base import DeviceRequest, ModelError

__all__ = ["Placement", "place", "CudaCopier"]


@dataclass(frozen=True, slots=True)
class Placement:
    device: torch.device
    tensors: bool  # the rules and staging see torch tensors (False: numpy views of them)


def place(request: DeviceRequest) -> Placement:
    if request.choice == "cpu":
        return Placement(torch.device("cpu"), tensors=True)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        return Placement(torch.device("cuda", request.local_rank % gpus), tensors=True)
    if request.choice == "auto":
        return Placement(torch.device("cpu"), tensors=False)
    raise ModelError(
        f"--device cuda: torch sees no GPU on {socket.gethostname()} "
        f"(torch.cuda.is_available() is False, torch {torch.__version__}, built for CUDA "
        f"{torch.version.cuda or 'none'}): use --device auto or cpu, or a CUDA build of torch"
    )


class CudaCopier:
    """Copies between a flat CUDA tensor and pinned host memory on a stream of its own,
    ordered after the work already queued on the current stream (backward's gradients)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def pinned(self, n: int) -> tuple[torch.Tensor, np.ndarray]:
        """n pinned float32 host floats, as a tensor and a numpy view of the same memory."""
        host = torch.empty(n, dtype=torch.float32, pin_memory=True)
        return host, host.numpy()

    def host_tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array)

    def settle(self) -> None:
        """Wait for the work queued on the current stream (before MPI reads device memory)."""
        torch.cuda.current_stream(self.device).synchronize()

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """target <- source, finished when this returns (MPI reads or writes the host side next)."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            target.copy_(source, non_blocking=True)
        self.stream.synchronize()
