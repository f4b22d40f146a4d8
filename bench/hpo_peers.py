"""Hyper-parameter optimisation against its peers: nbdist's schedulers and searchers,
Optuna's TPE with its Hyperband pruner, TPE alone, and random search, on the same space
and the same training function, with equal budgets in training epochs.

Two tasks: the digits CNN (examples/digits_cnn.py's shape) and the jet CNN
(examples/jet_cnn.py's shape, on the 2,000 Pythia top-vs-QCD jet images that
bench/scaling_curves.py caches, generated here on first use, summed from 32x32 to 16x16
pixels so that a unit stays short). Each has a width, dropout, batch size, optimiser and
learning rate to tune. Every method trains one epoch at a time through one function (a
generator yielding the validation accuracy after each epoch); a trial trains at most
--trial-epochs epochs, a method at most --budget in all. A unit is one (task, method,
seed): it records the epochs consumed until a trial first reached the target accuracy,
and the best accuracy reached within the budget.

Aim (issue 28): nbdist's best set-up reaches the target in at most 0.8x the epochs
Optuna's best needs, and its best accuracy is at least Optuna's.

The measurement accumulates across sessions in bench/_hpo_peers_runs.RUNS (JSON lines):

    python bench/hpo_peers.py --task digits --method nbdist-asha-tpe --seed 0   # one unit
    python bench/hpo_peers.py --next      # the first unit not yet recorded (exit 3: none left)
    python bench/hpo_peers.py --report    # the aggregated tables into a dated markdown file
    python bench/hpo_peers.py --quick     # a smoke run: 1 seed, small budgets, nothing recorded
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _hpo_peers_runs as runs  # noqa: E402
from _common import ROOT  # noqa: E402

SPACES = {
    "digits": "lr=log(1e-4,3e-1) width=int(4,48) dropout=real(0,0.5) batch=cat(16,32,64,128) optimizer=cat(adam,sgd)",
    # Narrower than digits': a 32x32-pixel jet image costs more per epoch than an 8x8 digit.
    "jets": "lr=log(1e-4,3e-1) width=int(4,16) dropout=real(0,0.5) batch=cat(16,32,64,128) optimizer=cat(adam,sgd)",
}
TARGETS = {"digits": (0.975, 0.985), "jets": (0.95, 0.955)}  # the aim's target first
JETS = {"signal": "top", "events": 2000, "files": 4}  # bench/scaling_curves.py's sample
NOTHING_LEFT = 3  # --next's exit status when every unit is recorded


class Task:
    """The data, held once, and the training function every method calls."""

    def __init__(self, name: str, trial_epochs: int, cache: Path):
        import numpy as np
        import torch

        torch.set_num_threads(1)
        self.name, self.trial_epochs = name, trial_epochs
        if name == "digits":
            import nbdist.datasets

            data = nbdist.datasets.digits(images=True)
            x, y = data.train_batch(np.arange(data.n_train))
            vx, vy = data.val_batch(np.arange(data.n_val))
        else:
            x, y, vx, vy = jet_arrays(cache)
        self.x, self.y = torch.as_tensor(x), torch.as_tensor(y).long()
        self.vx, self.vy = torch.as_tensor(vx), torch.as_tensor(vy).long()
        self.classes = int(self.y.max()) + 1
        self.consumed = 0  # epochs trained by the method under test
        self.trials = 0  # trainings started
        self.curve: list[tuple[int, float]] = []  # (epochs consumed, accuracy) of each epoch

    def model(self, width: int, dropout: float):
        from torch import nn

        channels, side = self.x.shape[1], self.x.shape[-1]
        if self.name == "digits":
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
        sys.path.insert(0, str(ROOT / "examples"))
        from jet_cnn import PixelScale

        return nn.Sequential(
            PixelScale(),
            nn.Conv2d(channels, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(2 * width * (side // 4) ** 2, 32),
            nn.ReLU(),
            nn.Linear(32, self.classes),
        )

    def train(self, params: dict, seed: int) -> Iterator[float]:
        """The validation accuracy after each epoch (the same for every method)."""
        import torch

        self.trials += 1
        torch.manual_seed(seed)
        model = self.model(int(params["width"]), float(params["dropout"]))
        make = torch.optim.Adam if params["optimizer"] == "adam" else torch.optim.SGD
        opt = make(model.parameters(), lr=float(params["lr"]))
        loss_fn = torch.nn.CrossEntropyLoss()
        batch = int(params["batch"])
        generator = torch.Generator().manual_seed(seed)
        for _ in range(self.trial_epochs):
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


def jet_arrays(cache: Path):
    """Training and validation images summed to 16x16 pixels (pT fractions add up), labels."""
    import nbdist.datasets

    out = cache / f"jets-{JETS['signal']}-{JETS['events']}-{JETS['files']}"
    sample = nbdist.datasets.jet_images(
        out, signal=JETS["signal"], events=JETS["events"], files=JETS["files"], underlying_event=False, progress=False
    )
    data = sample.load()

    def pooled(images):
        n, channels, side, _ = images.shape
        return images.reshape(n, channels, side // 2, 2, side // 2, 2).sum(axis=(3, 5))

    return pooled(data.x_train), data.y_train, pooled(data.x_val), data.y_val


class OutOfBudget(Exception):
    pass


Method = Callable[[Task, int, int], None]


def nbdist_method(searcher: str, scheduler: str) -> Method:
    def run(task: Task, seed: int, budget: int) -> None:
        from nbdist.hpo import optimize

        optimize(
            lambda p: task.train(p, seed * 1000 + len(task.curve)),
            space=SPACES[task.name],
            searcher=searcher,
            scheduler=scheduler,
            epochs=task.trial_epochs,
            trials=10_000,
            budget_epochs=budget,
            objective_name="val_acc",
            seed=seed,
            say=lambda _line: None,
        )

    return run


def optuna_method(sampler: str, pruner: str | None) -> Method:
    def run(task: Task, seed: int, budget: int) -> None:
        import optuna

        from nbdist.hpo.space_input import parse_space

        optuna.logging.set_verbosity(optuna.logging.ERROR)  # not the trial cut off by the budget
        space = parse_space(SPACES[task.name])
        samplers = {"tpe": optuna.samplers.TPESampler, "random": optuna.samplers.RandomSampler}
        study = optuna.create_study(
            direction="maximize",
            sampler=samplers[sampler](seed=seed),
            pruner=optuna.pruners.HyperbandPruner(min_resource=1, max_resource=task.trial_epochs)
            if pruner == "hyperband"
            else optuna.pruners.NopPruner(),
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


METHODS: dict[str, Method] = {
    "nbdist-asha-tpe": nbdist_method("optuna(sampler='tpe')", "asha(min_epochs=1, reduction=3)"),
    "optuna-tpe-hyperband": optuna_method("tpe", "hyperband"),
    "optuna-tpe": optuna_method("tpe", None),
    "random": optuna_method("random", None),
    "nbdist-hyperband-bayes": nbdist_method("bayes", "hyperband(min_epochs=1, reduction=3)"),
    "nbdist-asha-random": nbdist_method("random", "asha(min_epochs=1, reduction=3)"),
    "nbdist-bayes": nbdist_method("bayes", "fifo"),
}
assert tuple(METHODS) == runs.METHOD_ORDER, "bench/_hpo_peers_runs.py orders the same methods"


def how_scheduled() -> str:
    """The priority this process runs at (bg-run's units run at idle priority)."""
    policy = {getattr(os, "SCHED_IDLE", -1): "idle", getattr(os, "SCHED_BATCH", -1): "batch"}
    kind = policy.get(os.sched_getscheduler(0), "normal") if hasattr(os, "sched_getscheduler") else "?"
    return f"{kind}, nice {os.nice(0)}"


def commit() -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
        return done.stdout.strip()

    dirty = git("status", "--porcelain", "--", "bench/hpo_peers.py", "bench/_hpo_peers_runs.py", "nbdist")
    return git("rev-parse", "--short", "HEAD") + ("-dirty" if dirty else "")


def run_unit(unit: runs.Unit, budget: int, trial_epochs: int, cache: Path) -> dict:
    """Train one (task, method, seed) and describe what happened."""
    load_before, made_by = list(os.getloadavg()), commit()
    started, cpu_started = time.perf_counter(), time.process_time()
    task = Task(unit.task, trial_epochs, cache)
    METHODS[unit.method](task, unit.seed, budget)
    within = [(e, acc) for e, acc in task.curve if e <= budget]
    improvements, best = [], float("-inf")
    for e, acc in within:
        if acc > best:
            best = acc
            improvements.append([e, round(acc, 6)])
    return {
        "task": unit.task,
        "method": unit.method,
        "seed": unit.seed,
        "budget": budget,
        "trial_epochs": trial_epochs,
        "target": TARGETS[unit.task][0],
        "epochs_to_target": runs.first_reaching(improvements, TARGETS[unit.task][0]),
        "best_accuracy": round(max(best, 0.0), 6),
        "improvements": improvements,
        "trials": task.trials,
        "epochs_used": task.consumed,
        "wall_s": round(time.perf_counter() - started, 1),
        "cpu_s": round(time.process_time() - cpu_started, 1),
        "load_before": [round(v, 2) for v in load_before],
        "load_after": [round(v, 2) for v in os.getloadavg()],
        "priority": how_scheduled(),
        "commit": made_by,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
    }


def record_unit(unit: runs.Unit, args: argparse.Namespace) -> None:
    if runs.is_recorded(runs.load_runs(args.runs), unit, args.budget, args.trial_epochs):
        print(f"already recorded in {args.runs}: {unit}")
        return
    print(f"running {unit} (budget {args.budget}, trials of at most {args.trial_epochs} epochs)", flush=True)
    record = run_unit(unit, args.budget, args.trial_epochs, Path(args.cache).expanduser())
    runs.append_run(args.runs, record)
    print(
        f"recorded: epochs to {record['target']}: {record['epochs_to_target']}, best {record['best_accuracy']:.4f}, "
        f"{record['trials']} trials, {record['wall_s']:.0f} s ({record['cpu_s']:.0f} s of CPU), "
        f"load {record['load_before'][0]:.2f} -> {record['load_after'][0]:.2f}, {record['priority']}",
        flush=True,
    )


def shown(path: Path) -> str:
    """A path inside the repository relative to its root (so the report reads the same anywhere)."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def report(args: argparse.Namespace) -> str:
    import platform

    import optuna
    import torch

    about = (
        f"Machine: {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}, torch "
        f"{torch.__version__}, optuna {optuna.__version__}. Units run one at a time, in the background "
        "(`/work/wt/bin/bg-run`: idle priority, no CPU lock, paused while anyone asks for quiet): they record "
        "accuracies and epochs, not times, so other jobs on the box slow them but do not change their results. "
        f"Records: `{shown(args.runs)}`. "
        "Continue with `python bench/hpo_peers.py --next` (one missing unit a call), then `--report`."
    )
    return runs.render_report(
        runs.load_runs(args.runs),
        TARGETS,
        budget=args.budget,
        trial_epochs=args.trial_epochs,
        seeds=args.seeds,
        about=about,
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=runs.TASK_ORDER)
    parser.add_argument("--method", choices=list(METHODS))
    parser.add_argument("--seed", type=int)
    parser.add_argument("--next", action="store_true", help="run the first unit not yet recorded")
    parser.add_argument("--report", action="store_true", help="write the aggregated tables (see --report-file)")
    parser.add_argument("--report-file", type=Path, help="default: bench/results/<today, UTC>-hpo_peers.md")
    parser.add_argument("--quick", action="store_true", help="1 seed, a budget of 40, 9-epoch trials, not recorded")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--budget", type=int, default=400, help="training epochs per method and seed")
    parser.add_argument("--trial-epochs", type=int, default=27, help="the most epochs one trial trains")
    parser.add_argument("--runs", type=Path, default=runs.RUNS, help="the JSON-lines file of records")
    parser.add_argument("--cache", default="~/.cache/nbdist/bench", help="where the jet sample is kept")
    args = parser.parse_args(argv)
    one = (args.task, args.method, args.seed)
    if any(v is not None for v in one) and any(v is None for v in one):
        parser.error("one unit needs all of --task, --method and --seed")
    if args.seed is not None and not 0 <= args.seed < args.seeds:
        parser.error(f"--seed must be in 0..{args.seeds - 1} (--seeds {args.seeds})")
    if min(args.budget, args.trial_epochs, args.seeds) < 1:
        parser.error("--budget, --trial-epochs and --seeds must be at least 1")
    if args.quick:
        args.seeds, args.budget, args.trial_epochs = 1, 40, 9
        args.runs = Path(tempfile.mkdtemp(prefix="nbdist-hpo-peers-")) / "runs.jsonl"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        if args.task is not None:
            record_unit(runs.Unit(args.task, args.method, args.seed), args)
        elif args.next:
            missing = runs.missing_units(runs.load_runs(args.runs), args.seeds, args.budget, args.trial_epochs)
            if not missing:
                print(f"every unit is recorded in {args.runs}")
                return NOTHING_LEFT
            record_unit(missing[0], args)
        elif not args.report:  # everything missing (hours), then the report
            for unit in runs.missing_units(runs.load_runs(args.runs), args.seeds, args.budget, args.trial_epochs):
                record_unit(unit, args)
        if args.report or not (args.task or args.next):
            text = report(args)
            if args.quick:
                print(text)
            else:
                path = args.report_file or runs.RESULTS / f"{datetime.now(timezone.utc):%Y-%m-%d}-hpo_peers.md"
                path.write_text(text)
                print(text, f"\nwritten to {path}", sep="\n")
    except runs.RunsFileError as exc:
        print(f"hpo_peers: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
