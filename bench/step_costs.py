"""Where a 1-rank training step's time goes, against the plain PyTorch loop.

overhead.py compares whole runs, each in a process of its own; this script takes them
apart, in one process (launched by `mpiexec -n 1`), in alternating rounds, on the digits
CNN of overhead.py with its batches and optimiser:

  plain               overhead.py's plain loop (zero_grad, forward, backward, torch.optim step)
  backend step alone  nbdist's TorchBackend.compute_gradients and flat optimiser step on the
                      same batches, without a role: what the model's step costs in nbdist
  nbdist, checkpoint at the end   nbdist.train, allreduce on 1 rank, --checkpoint-every 0
  nbdist, checkpoint every epoch  the same with the default --checkpoint-every 1

The difference between the last two, times the samples of an epoch, is what one
checkpoint costs the training loop (the copies it takes, and its writer thread's share of
the interpreter); between the backend alone and the first nbdist row, what the role's
bookkeeping costs each step. samples/s are over the middle epochs, as in overhead.py.

Usage: python bench/step_costs.py [--device auto|cpu|cuda] [--epochs 40] [--rounds 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import MODELS, OPTIMIZER, checkpoint_cost_ms, load_data, middle_rate, nbdist_options, plain_loop

MODEL, BATCH = "cnn", 128
ROWS = {
    "plain": "plain PyTorch loop",
    "backend": "backend step alone (no role)",
    "nbdist_end": "nbdist 1 rank, checkpoint at the end",
    "nbdist_every": "nbdist 1 rank, checkpoint every epoch (default)",
}


def backend_alone(device: str, epochs: int) -> float:
    """samples/s of TorchBackend.compute_gradients and TorchFlatOptimizer.step, on the
    batches nbdist's single rank gets."""
    import torch

    from nbdist.backends.base import DeviceRequest
    from nbdist.backends.torch import TorchBackend
    from nbdist.backends.torch_optimizers import TorchFlatOptimizer
    from nbdist.data.sharding import ShardPlan
    from nbdist.specs import parse_spec

    data = load_data(MODEL)
    torch.manual_seed(0)
    backend = TorchBackend(MODELS[MODEL]())
    backend.place(DeviceRequest(device))
    optimizer = TorchFlatOptimizer(torch.optim.SGD, parse_spec(OPTIMIZER), backend.params)
    plan = ShardPlan(data.n_train, 1, BATCH, seed=0)
    history = []
    for epoch in range(epochs):
        started, samples = time.time(), 0
        for indices in plan.epoch(epoch, 0):
            x, y = data.train_batch(indices)
            samples += backend.compute_gradients(x, y).n
            optimizer.step(backend.grads)
        if backend.device.type == "cuda":
            torch.cuda.synchronize(backend.device)
        history.append({"samples": samples, "seconds": time.time() - started})
    return middle_rate(history)


def nbdist_run(device: str, epochs: int, checkpoint_every: int) -> float:
    import nbdist

    with tempfile.TemporaryDirectory(prefix="nbdist-bench-") as runs:
        options = nbdist_options("allreduce", OPTIMIZER, epochs, BATCH, runs, device, checkpoint_every=checkpoint_every)
        result = nbdist.train(MODELS[MODEL], data=load_data(MODEL), **options)
    return middle_rate(result.history)


def measure(device: str, epochs: int, rounds: int) -> dict:
    """The rates of every row, `rounds` times in turn (under mpiexec -n 1)."""
    import torch

    torch.set_num_threads(1)  # as overhead.py's plain loop and nbdist's single rank
    runs = {
        "plain": lambda: middle_rate(plain_loop(MODEL, epochs, BATCH, device)),
        "backend": lambda: backend_alone(device, epochs),
        "nbdist_end": lambda: nbdist_run(device, epochs, 0),
        "nbdist_every": lambda: nbdist_run(device, epochs, 1),
    }
    # Warm-up, 3 epochs each: the imports, the device's context, its kernels.
    plain_loop(MODEL, 3, BATCH, device)
    backend_alone(device, 3)
    nbdist_run(device, 3, 1)
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            rates[name].append(run())
    return {"rates": rates, "samples_per_epoch": load_data(MODEL).n_train}


def main() -> None:
    from _common import emit, header, run_mpi, table

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--epochs", type=int, default=40, help="epochs per run (default 40)")
    p.add_argument("--rounds", type=int, default=4, help="rounds of alternated runs (default 4)")
    p.add_argument("--json", help="also write the rates and the derived costs to this JSON file")
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the launched process
    args = p.parse_args()
    if args.measure:
        emit(measure(args.device, args.epochs, args.rounds))
        return

    header("where a 1-rank step's time goes, against the plain PyTorch loop")
    print(f"   digits {MODEL}, batch {BATCH}, {OPTIMIZER}; {args.epochs} epochs a run, {args.rounds} rounds")
    print()
    argv = [str(Path(__file__).resolve()), "--measure", "--device", args.device]
    argv += ["--epochs", str(args.epochs), "--rounds", str(args.rounds)]
    result = run_mpi(1, argv, timeout=900)[0]
    rates = result["rates"]
    median = {name: statistics.median(values) for name, values in rates.items()}
    plain = median["plain"]
    rows = [
        [label, median[name], median[name] / plain, " ".join(f"{v / plain:.2f}" for v in rates[name])]
        for name, label in ROWS.items()
    ]
    table(rows, ["run", "samples/s (median)", "vs plain", "each round"])
    per_epoch = result["samples_per_epoch"]
    steps_per_epoch = -(-per_epoch // BATCH)
    role_ms = (per_epoch / median["nbdist_end"] - per_epoch / median["backend"]) / steps_per_epoch * 1e3
    checkpoint_ms = checkpoint_cost_ms(per_epoch, median["nbdist_end"], median["nbdist_every"])
    epoch_ms = per_epoch / median["nbdist_end"] * 1e3
    print(f"   an epoch: {per_epoch:,} samples, {steps_per_epoch} steps, {epoch_ms:.1f} ms (nbdist, at the end)")
    print(f"   the role's bookkeeping: {role_ms:+.3f} ms a step (nbdist at the end against the backend alone)")
    print(f"   one epoch's checkpoint: {checkpoint_ms:+.2f} ms of the training loop's time")
    if args.json:
        figures = {**result, "device": args.device, "medians": median}
        figures.update(role_ms_per_step=role_ms, checkpoint_ms=checkpoint_ms, epoch_ms=epoch_ms)
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
