"""nbdist's real allreduce path on fixed data; the weights are saved for comparison.

Usage: mpiexec -n N python tests/mpi_scripts/allreduce_equivalence.py OUT_DIR STEPS

For each of two batch layouts (`equal`: 4 samples per rank; `unequal`: sizes differ by
one between ranks), every rank builds the same model (same seed), wraps it in a
TorchBackend and takes equivalence_common.allreduce_steps: it reduces its gradients with
`GradientReducer` (one Iallreduce per bucket, started from inside backward; a small
bucket cap gives several buckets), weights its
gradient by `allreduce_sgd.sample_share` and steps the backend's flat optimiser, as
`nbdist.roles.allreduce.run_allreduce` does. This runs over all N ranks and then,
when N > 2, again over pairs of ranks (COMM_WORLD split in two-rank communicators), so
one job gives the N-rank and the 2-rank results. Rank 0 writes
OUT_DIR/<ranks>-<layout>.safetensors (the model's state_dict). Every rank checks that
all replicas are bit-identical and that the reduced sample count is the global batch
size. Layout `device` is `equal` with the backend placed by --device cpu: the rules and
the GradientReducer's staging then work on torch tensors, as on a GPU.
Prints `OK <ranks>-<layout>`; any failure aborts the job so that no rank hangs.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402
from torch import nn  # noqa: E402

import equivalence_common as common  # noqa: E402
from nbdist.backends import DeviceRequest  # noqa: E402
from nbdist.backends.torch import TorchBackend  # noqa: E402
from rank_main import run_or_abort  # noqa: E402


def train(comm: MPI.Intracomm, steps: int, unequal: bool, device: bool = False) -> TorchBackend:
    backend = TorchBackend(common.initial_model(), nn.CrossEntropyLoss(), "accuracy")
    if device:
        backend.place(DeviceRequest("cpu"))
        assert isinstance(backend.rule_grads, torch.Tensor)
    comm.Bcast(backend.params, root=0)  # as run_allreduce does (a no-op here: same seed)
    return common.allreduce_steps(comm, backend, steps, unequal)


def main() -> None:
    out_dir, steps = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    sizes = [world.Get_size()] + ([2] if world.Get_size() > 2 else [])
    for ranks in sizes:
        comm = world if ranks == world.Get_size() else world.Split(world.Get_rank() // ranks, world.Get_rank())
        for layout in ("equal", "unequal", "device"):
            backend = train(comm, steps, layout == "unequal", device=layout == "device")
            if world.Get_rank() == 0:
                out_dir.mkdir(parents=True, exist_ok=True)
                save_file(backend.named_arrays(), str(out_dir / f"{ranks}-{layout}.safetensors"))
                print(f"OK {ranks}-{layout} steps={steps}", flush=True)
        if comm is not world:
            comm.Free()
        world.Barrier()


if __name__ == "__main__":
    run_or_abort(main)
