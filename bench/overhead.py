"""What nbdist costs one worker: its training throughput against a plain PyTorch loop.

Same model, data, batch size, optimizer, batch order and one torch thread everywhere:

  plain          one process: for each batch, zero_grad, forward, backward, torch.optim step
  master-worker  `mpiexec -n 2`: 1 master + 1 worker, Downpour, sync_every=1 (the worker
                 sends every gradient and waits for the master's weights; the master's
                 optimizer is the one above)
  allreduce      `mpiexec -n 1`: the allreduce topology on one rank

The default model is a small CNN on scikit-learn's digits as 8x8 images (~151k
parameters, batch 128: a few milliseconds of compute per step on one core); `--model mlp`
takes a 64-512-512-10 MLP (~300k parameters) instead. samples/s is taken over the middle
epochs (the first has the warm-up, the last nbdist's final validation).

The speed of a process on this 2-core development machine varies by 10-20% from one
process to the next (the same plain loop ran at 10,757 and 14,470 samples/s in two
processes a minute apart), more than the 5% the aim allows. So every run, the plain loop
too, is a fresh process launched by mpiexec, and the runs alternate in rounds: plain,
master-worker, allreduce, ..., plain. The aim is on the median of the nbdist runs' samples/s
over the median of the plain runs'; each round's own ratio (against the mean of the plain
runs just before and after it) is shown too, so that the spread can be seen. Runs are long
(30 epochs, about 3 s of steady state each) so that a run's rate is not one hiccup.
The plain loop saves nothing, so the nbdist runs the aims are on write their checkpoint
at the end only (`--checkpoint-every 0`); a third run, allreduce with the default
checkpoint every epoch, shows what that costs, printed as milliseconds an epoch (a fixed
cost per checkpoint: large against this benchmark's epochs of a dozen steps (batch 128),
small against real ones). `--busy-poll off` as a fourth run of each round shows
what the rank's waits cost when they sleep (the default, auto, polls without sleeping
where the ranks fit the cores). Aim: master-worker >= 0.95x plain.
Usage: python bench/overhead.py [--quick] [--rounds N]
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

OPTIMIZER = "sgd(lr=0.05, momentum=0.9)"
AIM = 0.95


def cnn():
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 4 * 4, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def mlp():
    from torch import nn

    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


MODELS = {"cnn": cnn, "mlp": mlp}


def load_data(model: str):
    from nbdist.datasets import digits

    return digits(images=(model == "cnn"))


def plain_loop(model: str, epochs: int, batch_size: int, device: str = "auto") -> list[dict]:
    """The loop a PyTorch user writes, on the batches nbdist's single worker gets, with
    the model on `device` (auto: the CPU, as nbdist's auto on a machine without a GPU)."""
    import torch
    from torch import nn

    from nbdist.data.sharding import ShardPlan

    torch.set_num_threads(1)
    on = torch.device("cpu" if device == "auto" else device)
    data = load_data(model)
    torch.manual_seed(0)
    net = MODELS[model]().to(on)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    plan = ShardPlan(data.n_train, 1, batch_size, seed=0)
    history = []
    for epoch in range(epochs):
        t0 = time.time()
        samples, loss_sum = 0, 0.0
        for indices in plan.epoch(epoch, 0):
            x, y = data.train_batch(indices)
            xb, yb = torch.from_numpy(x).to(on, non_blocking=True), torch.from_numpy(y).to(on, non_blocking=True)
            opt.zero_grad()
            loss = loss_fn(net(xb), yb)
            loss.backward()
            opt.step()
            samples += len(yb)
            loss_sum += loss.item() * len(yb)  # nbdist's per-step bookkeeping does the same
        if on.type == "cuda":
            torch.cuda.synchronize(on)
        history.append({"samples": samples, "seconds": time.time() - t0, "train_loss": loss_sum / samples})
    return history


def middle_rate(history: list[dict]) -> float:
    middle = history[1:-1] or history
    return sum(h["samples"] for h in middle) / sum(h["seconds"] for h in middle)


def launched_run(
    n: int,
    topology: str,
    model: str,
    epochs: int,
    batch_size: int,
    busy_poll: str = "auto",
    device: str = "auto",
    checkpoint_every: int = 0,
) -> list[dict]:
    """One run (`topology` plain, master-worker or allreduce) as a fresh `mpiexec -n n`
    process; its per-epoch history."""
    from _common import run_mpi

    with tempfile.TemporaryDirectory(prefix="nbdist-bench-") as runs:
        argv = [
            str(Path(__file__).with_name("_overhead_worker.py")),
            "--model",
            model,
            "--topology",
            topology,
            "--optimizer",
            OPTIMIZER,
            "--epochs",
            str(epochs),
            "--batch-size",
            str(batch_size),
            "--runs-dir",
            runs,
            "--busy-poll",
            busy_poll,
            "--device",
            device,
            "--checkpoint-every",
            str(checkpoint_every),
        ]
        return run_mpi(n, argv)[0]["history"]


def nbdist_options(
    topology: str,
    optimizer: str,
    epochs: int,
    batch_size: int,
    runs_dir: str,
    device: str = "auto",
    busy_poll: str = "auto",
    checkpoint_every: int = 0,
) -> dict:
    """nbdist.train's options for a run of this benchmark (and step_costs.py's): quiet, no
    validation until the end, seed 0; master-worker is one Downpour worker with
    sync_every=1 (plain SGD), the optimiser on the master; allreduce steps it on the rank."""
    options = dict(
        epochs=epochs,
        batch_size=batch_size,
        runs_dir=runs_dir,
        quiet=True,
        validate_every=10**6,
        seed=0,
        busy_poll=busy_poll,
        device=device,
        checkpoint_every=checkpoint_every,
    )
    if topology == "master-worker":
        options.update(topology=topology, algorithm="downpour", workers=1, sync_every=1, master_optimizer=optimizer)
    else:
        options.update(topology=topology, worker_optimizer=optimizer)
    return options


def checkpoint_cost_ms(samples_per_epoch: int, rate_at_end: float, rate_every_epoch: float) -> float:
    """What an epoch's checkpoint adds to an epoch of the loop: the difference of the epoch
    times at the samples/s of the runs that checkpoint every epoch and at the end only."""
    return (samples_per_epoch / rate_every_epoch - samples_per_epoch / rate_at_end) * 1e3


def param_count(model: str) -> int:
    return sum(p.numel() for p in MODELS[model]().parameters())


# The nbdist runs of a round: (label, ranks, topology, --busy-poll, --checkpoint-every).
# The plain loop saves nothing, so the runs the aims are on write their one checkpoint at
# the end (in the last epoch, which the rates leave out); the default's checkpoint every
# epoch has a row of its own, and its cost per checkpoint is printed.
RUNS = [
    ("nbdist master-worker (1 master + 1 worker, downpour)", 2, "master-worker", "auto", 0),
    ("nbdist allreduce (1 rank)", 1, "allreduce", "auto", 0),
    ("nbdist allreduce (1 rank), a checkpoint every epoch (default)", 1, "allreduce", "auto", 1),
    ("nbdist master-worker, --busy-poll off (waits sleep)", 2, "master-worker", "off", 0),
]


def main() -> None:
    from _common import aim, header, table

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer epochs and rounds (about a minute)")
    p.add_argument("--model", choices=sorted(MODELS), default="cnn")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=None, help="epochs per run (default 30, quick 15)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of alternated runs (default 5, quick 3)")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the model lives, in the plain loop and nbdist's --device alike (default auto)",
    )
    p.add_argument("--json", help="also write the ratios and rates to this JSON file")
    args = p.parse_args()
    epochs = args.epochs or (15 if args.quick else 30)
    rounds = args.rounds or (3 if args.quick else 5)
    data = load_data(args.model)

    header("nbdist overhead on one worker against a plain PyTorch loop")
    print(
        f"   model {args.model}: {param_count(args.model):,} parameters; data digits "
        f"{tuple(data.x_train.shape)} train; batch {args.batch_size}; {OPTIMIZER}; {epochs} epochs per run; "
        f"{rounds} rounds"
    )
    print()

    plain = [launched_run(1, "plain", args.model, epochs, args.batch_size, device=args.device)]
    nbdist: dict[str, list[list[dict]]] = {label: [] for label, *_ in RUNS}
    for _ in range(rounds):
        for label, n, topology, busy_poll, checkpoint_every in RUNS:
            nbdist[label].append(
                launched_run(n, topology, args.model, epochs, args.batch_size, busy_poll, args.device, checkpoint_every)
            )
        plain.append(launched_run(1, "plain", args.model, epochs, args.batch_size, device=args.device))
    plain_rates = [middle_rate(h) for h in plain]
    plain_median = statistics.median(plain_rates)
    # Round i's nbdist runs lie between plain runs i and i+1.
    around = [(plain_rates[i] + plain_rates[i + 1]) / 2 for i in range(rounds)]

    # The three train the same model on the same batches with the same optimizer (one
    # Downpour worker with sync_every=1 is plain SGD), so their losses must agree too.
    rows = [["plain PyTorch loop (1 process)", plain_median, 1.0, "", plain[-1][-1]["train_loss"]]]
    ratios = {}
    for label, *_ in RUNS:
        rates = [middle_rate(h) for h in nbdist[label]]
        ratios[label] = statistics.median(rates) / plain_median
        rows.append(
            [
                label,
                statistics.median(rates),
                ratios[label],
                " ".join(f"{rate / ref:.2f}" for rate, ref in zip(rates, around, strict=True)),
                nbdist[label][-1][-1]["train_loss"],
            ]
        )
    table(rows, ["run", "samples/s (median)", "vs plain (medians)", "each round", f"train loss, epoch {epochs}"])
    print(f"   plain loop runs: {', '.join(f'{r:,.0f}' for r in plain_rates)} samples/s")
    at_end, every_epoch = (statistics.median(middle_rate(h) for h in nbdist[RUNS[i][0]]) for i in (1, 2))
    checkpoint_ms = checkpoint_cost_ms(data.n_train, at_end, every_epoch)
    print(f"   a checkpoint every epoch costs the 1-rank loop {checkpoint_ms:+.2f} ms an epoch (medians)")
    print()
    aim("master-worker, 1 worker vs plain loop (medians)", AIM, ratios[RUNS[0][0]])
    aim("allreduce, 1 rank vs plain loop (medians)", AIM, ratios[RUNS[1][0]])
    if args.json:
        figures = {
            "device": args.device,
            "model": args.model,
            "plain_samples_per_s": plain_rates,
            "ratios": ratios,
            "checkpoint_ms_per_epoch": checkpoint_ms,
        }
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
