"""Each run of overhead.py, in a process of its own under mpiexec (-n 2 master-worker,
-n 1 allreduce and plain), so that every run starts and is launched alike.

`--topology plain` runs overhead.py's plain PyTorch loop; the others call nbdist.train on
the digits images with the model and options overhead.py chose. Prints the per-epoch
history (for nbdist, the leader's own samples/s accounting).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--topology", choices=("master-worker", "allreduce", "plain"), required=True)
    p.add_argument("--optimizer", required=True)
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--runs-dir", required=True)
    p.add_argument("--busy-poll", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--checkpoint-every", type=int, default=0)
    args = p.parse_args()

    from overhead import MODELS, load_data, nbdist_options, plain_loop

    import nbdist

    if args.topology == "plain":
        emit({"history": plain_loop(args.model, args.epochs, args.batch_size, args.device)})
        return

    options = nbdist_options(
        args.topology,
        args.optimizer,
        args.epochs,
        args.batch_size,
        args.runs_dir,
        args.device,
        args.busy_poll,
        args.checkpoint_every,
    )
    result = nbdist.train(MODELS[args.model], data=load_data(args.model), **options)
    if result is not None:
        emit({"history": result.history})


if __name__ == "__main__":
    main()
