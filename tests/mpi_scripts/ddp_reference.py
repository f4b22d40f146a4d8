"""PyTorch DistributedDataParallel on gloo, 2 processes, on the equivalence data.

Called by allreduce_equivalence.py on ranks 0 and 1 of its job (`pair`, their MPI
communicator), so that the reference costs no processes of its own: the two ranks make a
gloo process group of their own (torch.distributed's default group, on a TCPStore that
rank 0 opens on 127.0.0.1, its port sent over MPI) and train PyTorch's own DDP on it. The
same model, seed, optimiser and global batches as allreduce_equivalence.py's `equal`
layout (DDP averages gradients, so every rank gets the same number of samples). Rank 0
saves the model's state_dict to OUT_FILE (safetensors) and prints `OK ddp`.
"""

from __future__ import annotations

import datetime

import equivalence_common as common
import numpy as np

WORLD = 2
TIMEOUT = datetime.timedelta(seconds=60)


def ddp_reference(pair, out_file: str, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    rank = pair.Get_rank()
    assert pair.Get_size() == WORLD, pair.Get_size()
    port = np.zeros(1, np.int64)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        port[0] = store.port
    pair.Bcast(port, root=0)
    if rank != 0:
        store = dist.TCPStore("127.0.0.1", int(port[0]), is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=TIMEOUT)
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
