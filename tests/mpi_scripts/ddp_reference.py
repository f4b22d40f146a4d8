"""PyTorch DistributedDataParallel on gloo, 2 processes, on the equivalence data.

Usage: python tests/mpi_scripts/ddp_reference.py OUT_FILE STEPS PORT

The same model, seed, optimiser and global batches as allreduce_equivalence.py's `equal`
layout (DDP averages gradients, so every rank gets the same number of samples). Rank 0
saves the model's state_dict to OUT_FILE (safetensors) and prints `OK ddp`. The parent
only spawns the two ranks (torch is imported in them, not here: it costs seconds).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

WORLD = 2


def worker(rank: int, out_file: str, steps: int, port: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import equivalence_common as common
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        x, y = common.make_arrays()
        model = common.initial_model()
        ddp = DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=common.LR, momentum=common.MOMENTUM)
        loss_fn = nn.CrossEntropyLoss()
        for batch in common.global_batches(steps, WORLD, unequal=False):
            mine = common.rank_part(batch, WORLD, rank)
            opt.zero_grad()
            loss_fn(ddp(torch.from_numpy(x[mine])), torch.from_numpy(y[mine])).backward()
            opt.step()
        if rank == 0:
            from safetensors.torch import save_file

            save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, out_file)
            print("OK ddp", flush=True)
    finally:
        dist.destroy_process_group()


def finished_worker(rank: int, out_file: str, steps: int, port: int) -> None:
    """`worker`, then leave without the interpreter's teardown: gloo's threads sometimes
    end in std::terminate ("terminate called without an active exception") while C++
    statics are destroyed, after the work was done and saved (1 run in many)."""
    worker(rank, out_file, steps, port)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> int:
    out, steps, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=finished_worker, args=(rank, out, steps, port)) for rank in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.kill()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
