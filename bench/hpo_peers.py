"""Hyper-parameter optimisation against its peers: nbdist's schedulers and searchers,
Optuna's TPE with its Hyperband pruner, TPE alone, and random search, on the same space
and the same training function, with equal budgets in training epochs.

Each method trains the digits CNN (examples/digits_cnn.py's, with a width, dropout, batch
size, optimiser and learning rate to tune) one epoch at a time, through one function
that every method calls the same way (a generator yielding the validation accuracy after
each epoch); a trial trains at most EPOCHS epochs, a method at most BUDGET in all. Per
seed it records the epochs consumed until a trial first reached the target accuracy, and
the best accuracy reached within the budget.

Aim (issue 28): nbdist's best set-up reaches the target in at most 0.8x the epochs
Optuna's best needs, and its best accuracy is at least Optuna's.

Usage: python bench/hpo_peers.py [--quick] [--seeds 5] [--budget 400] [--target 0.975]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import aim_at_most, header, table  # noqa: E402

SPACE = "lr=log(1e-4,3e-1) width=int(4,48) dropout=real(0,0.5) batch=cat(16,32,64,128) optimizer=cat(adam,sgd)"
EPOCHS = 27


class Task:
    """The data, held once, and the training function every method calls."""

    def __init__(self):
        import numpy as np
        import torch

        import nbdist.datasets

        torch.set_num_threads(1)
        data = nbdist.datasets.digits(images=True)
        x, y = data.train_batch(np.arange(data.n_train))
        vx, vy = data.val_batch(np.arange(data.n_val))
        self.x, self.y = torch.as_tensor(x), torch.as_tensor(y).long()
        self.vx, self.vy = torch.as_tensor(vx), torch.as_tensor(vy).long()
        self.classes = int(self.y.max()) + 1
        self.consumed = 0  # epochs trained by the method under test
        self.curve: list[tuple[int, float]] = []  # (epochs consumed, accuracy) of each epoch

    def model(self, width: int, dropout: float):
        from torch import nn

        channels, side = self.x.shape[1], self.x.shape[-1]
        return nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(2 * width * (side // 2) ** 2, self.classes),
        )

    def train(self, params: dict, seed: int) -> Iterator[float]:
        """The validation accuracy after each epoch (the same for every method)."""
        import torch

        torch.manual_seed(seed)
        model = self.model(int(params["width"]), float(params["dropout"]))
        make = torch.optim.Adam if params["optimizer"] == "adam" else torch.optim.SGD
        opt = make(model.parameters(), lr=float(params["lr"]))
        loss_fn = torch.nn.CrossEntropyLoss()
        batch = int(params["batch"])
        generator = torch.Generator().manual_seed(seed)
        for _ in range(EPOCHS):
            model.train()
            for idx in torch.randperm(len(self.x), generator=generator).split(batch):
                opt.zero_grad()
                loss_fn(model(self.x[idx]), self.y[idx]).backward()
                opt.step()
            model.eval()
            with torch.no_grad():
                accuracy = float((model(self.vx).argmax(1) == self.vy).float().mean())
            self.consumed += 1
            self.curve.append((self.consumed, accuracy))
            yield accuracy


class OutOfBudget(Exception):
    pass


def nbdist_method(searcher: str, scheduler: str) -> Callable[[Task, int, int], None]:
    def run(task: Task, seed: int, budget: int) -> None:
        from nbdist.hpo import optimize

        optimize(
            lambda p: task.train(p, seed * 1000 + len(task.curve)),
            space=SPACE,
            searcher=searcher,
            scheduler=scheduler,
            epochs=EPOCHS,
            trials=10_000,
            budget_epochs=budget,
            objective_name="val_acc",
            seed=seed,
            say=lambda _line: None,
        )

    return run


def optuna_method(sampler: str, pruner: str | None) -> Callable[[Task, int, int], None]:
    def run(task: Task, seed: int, budget: int) -> None:
        import optuna

        from nbdist.hpo.space_input import parse_space

        optuna.logging.set_verbosity(optuna.logging.ERROR)  # not the trial cut off by the budget
        space = parse_space(SPACE)
        samplers = {"tpe": optuna.samplers.TPESampler, "random": optuna.samplers.RandomSampler}
        pruners = {"hyperband": lambda: optuna.pruners.HyperbandPruner(min_resource=1, max_resource=EPOCHS)}
        study = optuna.create_study(
            direction="maximize",
            sampler=samplers[sampler](seed=seed),
            pruner=pruners[pruner]() if pruner else optuna.pruners.NopPruner(),
        )

        def objective(trial: optuna.Trial) -> float:
            params = {}
            for name, dim in space.items():
                if hasattr(dim, "categories"):
                    params[name] = trial.suggest_categorical(name, list(dim.categories))
                elif isinstance(dim.low, int):
                    params[name] = trial.suggest_int(name, dim.low, dim.high, log=dim.log)
                else:
                    params[name] = trial.suggest_float(name, dim.low, dim.high, log=dim.log)
            value = 0.0
            for epoch, value in enumerate(task.train(params, seed * 1000 + len(task.curve)), start=1):
                trial.report(value, epoch)
                if task.consumed >= budget:
                    raise OutOfBudget
                if trial.should_prune():
                    raise optuna.TrialPruned
            return value

        try:
            study.optimize(objective, catch=())
        except OutOfBudget:
            pass

    return run


METHODS: dict[str, Callable[[Task, int, int], None]] = {
    "nbdist asha + optuna tpe": nbdist_method("optuna(sampler='tpe')", "asha(min_epochs=1, reduction=3)"),
    "nbdist hyperband + bayes": nbdist_method("bayes", "hyperband(min_epochs=1, reduction=3)"),
    "nbdist asha + random": nbdist_method("random", "asha(min_epochs=1, reduction=3)"),
    "nbdist bayes": nbdist_method("bayes", "fifo"),
    "optuna tpe + hyperband": optuna_method("tpe", "hyperband"),
    "optuna tpe": optuna_method("tpe", None),
    "random search": optuna_method("random", None),
}
OPTUNA = ("optuna tpe + hyperband", "optuna tpe")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, a budget of 40 epochs, 9-epoch trials")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--budget", type=int, default=400)
    parser.add_argument("--target", type=float, default=0.975)
    args = parser.parse_args()
    global EPOCHS
    if args.quick:
        args.seeds, args.budget, EPOCHS = 1, 40, 9
    header(
        f"HPO peers: digits CNN, trials of at most {EPOCHS} epochs, a budget of {args.budget} epochs, "
        f"{args.seeds} seeds, target accuracy {args.target}"
    )
    task = Task()
    rows, reached, best = [], {}, {}
    for name, method in METHODS.items():
        to_target, bests, seconds = [], [], 0.0
        for seed in range(args.seeds):
            task.consumed, task.curve = 0, []
            started = time.perf_counter()
            method(task, seed, args.budget)
            seconds += time.perf_counter() - started
            first = next((e for e, acc in task.curve if acc >= args.target), None)
            to_target.append(first)
            bests.append(max((acc for e, acc in task.curve if e <= args.budget), default=0.0))
        hits = [e for e in to_target if e is not None]
        reached[name] = statistics.median(e if e is not None else 2 * args.budget for e in to_target)
        best[name] = statistics.mean(bests)
        rows.append(
            [
                name,
                f"{len(hits)}/{args.seeds}",
                reached[name] if hits else "-",
                f"{best[name]:.4f}",
                f"{seconds / args.seeds:.0f}",
            ]
        )
        print(f"   {name}: {rows[-1][1:]}", flush=True)
    table(rows, ["method", "reached target", "median epochs to target", "mean best accuracy", "s per seed"])
    ours = min((n for n in METHODS if n.startswith("nbdist")), key=lambda n: reached[n])
    theirs = min(OPTUNA, key=lambda n: reached[n])
    print(f"nbdist's best: {ours}; Optuna's best: {theirs}")
    aim_at_most("epochs to target, nbdist's best / Optuna's best", 0.8, reached[ours] / reached[theirs])
    print(f"best accuracy, nbdist's best / Optuna's best: {best[ours] / best[theirs]:.3f} (aim: >= 1)")


if __name__ == "__main__":
    main()
