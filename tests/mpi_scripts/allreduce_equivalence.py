"""nbdist's real allreduce path on fixed data; the weights are saved for comparison.

Usage: mpiexec -n N python tests/mpi_scripts/allreduce_equivalence.py OUT_DIR STEPS

For each of two batch layouts (`equal`: 4 samples per rank; `unequal`: sizes differ by
one between ranks), every rank builds the same model (same seed), wraps it in a
TorchBackend and takes equivalence_common.allreduce_steps: it reduces its gradients with
`MpiReducer` (one Iallreduce per bucket, started from inside backward; a small
bucket cap gives several buckets), weights its
gradient by `allreduce_sgd.sample_share` and steps the backend's flat optimiser, as
`nbdist.roles.allreduce.run_allreduce` does. This runs over all N ranks and then,
when N > 2, again over pairs of ranks (COMM_WORLD split in two-rank communicators), so
one job gives the N-rank and the 2-rank results. Rank 0 writes
OUT_DIR/<ranks>-<layout>.safetensors (the model's state_dict). Every rank checks that
all replicas are bit-identical and that the reduced sample count is the global batch
size. Layout `device` is `equal` with the backend placed by --device cpu: the rules and
the MpiReducer's staging then work on torch tensors, as on a GPU.
On 4 ranks the job then runs synchronised BatchNorm layers (--sync-batchnorm) over
COMM_WORLD and writes OUT_DIR/syncbn-<layer>.safetensors (see sync_batchnorm).
Last, ranks 0 and 1 train PyTorch's DistributedDataParallel on gloo on the `equal` layout
(ddp_reference.py) and rank 0 writes OUT_DIR/ddp.safetensors.
Prints `OK <ranks>-<layout>` (and `OK syncbn`, `OK ddp`); any failure aborts the job so that no rank hangs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import equivalence_common as common
import numpy as np
import torch
from ddp_reference import ddp_reference
from mpi4py import MPI
from rank_main import run_or_abort
from safetensors.numpy import save_file
from torch import nn

from nbdist.backends import DeviceRequest
from nbdist.backends.torch import TorchBackend
from nbdist.transport.probe import idle_barrier
from nbdist.transport.staging import Staging


def train(comm: MPI.Intracomm, steps: int, unequal: bool, device: bool = False) -> TorchBackend:
    backend = TorchBackend(common.initial_model(), nn.CrossEntropyLoss(), "accuracy")
    if device:
        backend.place(DeviceRequest("cpu"))
        assert isinstance(backend.rule_grads, torch.Tensor)
    weights = Staging(backend.params, backend.copier)  # as run_allreduce does (a no-op here: same seed)
    comm.Bcast(weights.to_host(), root=0)
    weights.to_device()
    return common.allreduce_steps(comm, backend, steps, unequal)


def fp16_overflow_on_one_rank(comm: MPI.Intracomm, steps: int) -> str:
    """fp16 through the same reducer: rank 0's second gradient is asked 2**8 times larger
    (as an outlier batch's would be), so that only its backward pass overflows (at the
    default scale 2**16 this model's overflows from 2**22). Every rank must skip that step
    (the reduced gradient is not finite), halve the same loss scale, and stay bit-identical."""
    from nbdist.algorithms import allreduce_sgd
    from nbdist.specs import parse_spec
    from nbdist.transport.reducers import MpiReducer

    rank, size = comm.Get_rank(), comm.Get_size()
    backend = TorchBackend(common.initial_model(), nn.CrossEntropyLoss(), "accuracy", precision="fp16")
    reducer = MpiReducer(comm, backend, common.BUCKET_FLOATS)
    opt = backend.make_optimizer(parse_spec(common.OPTIMIZER))
    x, y = common.make_arrays()
    trailer = np.zeros(4, np.float32)
    for step, batch in enumerate(common.global_batches(steps, size, unequal=False)):
        mine = np.array_split(batch, size)[rank]
        outlier = 2.0**8 if step == 1 and rank == 0 else 1.0
        stats = backend.compute_gradients(x[mine], y[mine], scale=outlier / size)
        assert np.isfinite(stats.loss_sum), "the forward pass overflowed: only the backward pass should"
        trailer[:] = 0.0
        reducer.finish(trailer)
        allreduce_sgd.apply(opt, backend.grads)
    backend.loss_scale.settle(backend.grads)
    mine = np.array([opt.skipped, backend.loss_scale.scale])
    everyone = np.empty((size, 2))
    comm.Allgather(mine, everyone)
    params = np.empty((size, backend.params.size), np.float32)
    comm.Allgather(backend.params, params)
    assert all(np.array_equal(params[0], row) for row in params), "fp16 replicas differ"
    assert (everyone == everyone[0]).all(), everyone
    return f"skipped={int(everyone[0, 0])} scale={everyone[0, 1]:g}"


def sync_batchnorm(comm: MPI.Intracomm, out_dir: Path) -> None:
    """Each layer of equivalence_common.sync_bn_layers, converted as TorchBackend converts
    a model's for --sync-batchnorm and reducing over `comm` (4 ranks) with the transport's
    SumOverRanks; rank r trains on its rows of each global batch. Rank 0 writes
    OUT_DIR/syncbn-<layer>.safetensors: the outputs and input gradients of every rank (in
    rank order), the parameter gradients (bias, weight) summed over the ranks as the
    gradient allreduce does, per step, and the running statistics at the end. Every rank
    checks that its running statistics are bit-identical to the others'."""
    from nbdist.backends.torch_batchnorm import convert_batchnorm
    from nbdist.transport.batch_sums import SumOverRanks
    from nbdist.transport.collectives import Collectives

    rank = comm.Get_rank()
    rows = np.cumsum((0, *common.SYNC_BN_SIZES))
    mine = slice(rows[rank], rows[rank + 1])
    for name, (layer, shape) in common.sync_bn_layers().items():
        model, [sync] = convert_batchnorm(nn.Sequential(layer))
        sync.reduce = SumOverRanks(comm, Collectives(lambda: 60.0))
        saved = {}
        for step in range(common.SYNC_BN_STEPS):
            x, g = common.sync_bn_batches(shape, step)
            xr = torch.from_numpy(x[mine]).requires_grad_()
            model.zero_grad()
            out = model(xr)
            (out * torch.from_numpy(g[mine])).sum().backward()
            for what, local in (("out", out.detach().numpy()), ("dx", xr.grad.numpy())):
                gathered = comm.gather(local, root=0)
                if rank == 0:
                    saved[f"{what}-{step}"] = np.concatenate(gathered)
            if sync.affine:
                summed = np.concatenate([sync.bias.grad.numpy(), sync.weight.grad.numpy()])
                comm.Allreduce(MPI.IN_PLACE, summed)
                saved[f"grads-{step}"] = summed
        state = {k: v.numpy().astype(np.float64) for k, v in model.state_dict().items() if k.startswith(("0.r", "0.n"))}
        for key, mine_ in state.items():
            everyone = comm.allgather(mine_)
            assert all((e == everyone[0]).all() for e in everyone), f"{name}: {key} differs between ranks: {everyone}"
        if rank == 0:
            saved.update(state)
            save_file(saved, str(out_dir / f"syncbn-{name}.safetensors"))
    if rank == 0:
        print("OK syncbn", flush=True)


def main() -> None:
    torch.set_num_threads(1)
    run(MPI.COMM_WORLD, Path(sys.argv[1]), int(sys.argv[2]))


def run(world: MPI.Intracomm, out_dir: Path, steps: int) -> None:
    """Every phase above over the ranks of `world` (COMM_WORLD, or the first 4 ranks of
    equivalence_job.py's job)."""
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
    if world.Get_size() == len(common.SYNC_BN_SIZES):
        sync_batchnorm(world, out_dir)
    result = fp16_overflow_on_one_rank(world, steps)
    if world.Get_rank() == 0:
        print(f"OK fp16-overflow {result}", flush=True)
    # PyTorch's DDP on ranks 0 and 1 (the reference of test_allreduce_matches_pytorch_ddp_on_gloo).
    pair = world.Split(0 if world.Get_rank() < 2 else MPI.UNDEFINED, world.Get_rank())
    if pair != MPI.COMM_NULL:
        ddp_reference(pair, str(out_dir / "ddp.safetensors"), steps)
        pair.Free()
    idle_barrier(world, 120)  # the other ranks sleep meanwhile, leaving the cores to the two


def finish() -> None:
    """Leave without the interpreter's teardown once MPI is finalised: gloo's threads
    sometimes end in std::terminate ("terminate called without an active exception")
    while C++ statics are destroyed, after the work was done and saved (1 run in many)."""
    MPI.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    run_or_abort(main)
    finish()
