"""The records of bench/hpo_peers.py: one JSON line per (task, method, seed) unit, the
units still missing, and the aggregated report (not a benchmark itself).

The measurement takes hours of CPU on a small box, so it accumulates across sessions:
each unit appends its record to RUNS when it has finished (a unit killed half-way leaves
nothing), a unit already recorded is skipped, and the report is made from whatever the
file holds, saying which units are still missing. Nothing here imports torch: the tests
exercise it with hand-made records.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# Named after the session that started it; later sessions append to the same file.
RUNS = RESULTS / "2026-11-28-hpo_peers-runs.jsonl"
KEY = ("task", "method", "seed", "budget", "trial_epochs")

# Method names, in the order the units run: the aim's comparison first (nbdist's best
# set-up of the quick run against Optuna's TPE + Hyperband), then the other peers, then
# the other nbdist set-ups.
OURS_FIRST, THEIRS_FIRST = "nbdist-asha-tpe", "optuna-tpe-hyperband"
PEERS = ("optuna-tpe", "random")
NBDIST_OTHERS = ("nbdist-hyperband-bayes", "nbdist-asha-random", "nbdist-bayes")
METHOD_ORDER = (OURS_FIRST, THEIRS_FIRST, *PEERS, *NBDIST_OTHERS)
OPTUNA = (THEIRS_FIRST, "optuna-tpe")
TASK_ORDER = ("digits", "jets")


class RunsFileError(ValueError):
    pass


@dataclass(frozen=True)
class Unit:
    task: str
    method: str
    seed: int

    def __str__(self) -> str:
        return f"--task {self.task} --method {self.method} --seed {self.seed}"


def load_runs(path: Path) -> list[dict]:
    """Every record in `path` (none if it does not exist yet)."""
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RunsFileError(f"{path}:{number} is not a JSON record ({exc.msg}): fix or remove that line") from None
        missing = [k for k in KEY if k not in record]
        if missing:
            raise RunsFileError(f"{path}:{number} lacks {', '.join(missing)}: fix or remove that line")
        records.append(record)
    return records


def append_run(path: Path, record: dict) -> None:
    """One line, written and flushed at once, so a reader never sees half a record."""
    missing = [k for k in KEY if k not in record]
    if missing:
        raise RunsFileError(f"a record needs {', '.join(missing)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(json.dumps(record, sort_keys=True) + "\n")


def key_of(record: dict) -> tuple:
    return tuple(record[k] for k in KEY)


def is_recorded(records: Iterable[dict], unit: Unit, budget: int, trial_epochs: int) -> bool:
    wanted = (unit.task, unit.method, unit.seed, budget, trial_epochs)
    return any(key_of(r) == wanted for r in records)


def plan(seeds: int, tasks: Sequence[str] = TASK_ORDER) -> list[Unit]:
    """All units in the order they should run: per task, the aim's pair seed by seed, then
    the peers, then nbdist's other set-ups."""
    groups = [(OURS_FIRST, THEIRS_FIRST), PEERS, NBDIST_OTHERS]
    return [Unit(task, method, seed) for task in tasks for group in groups for seed in range(seeds) for method in group]


def missing_units(records: list[dict], seeds: int, budget: int, trial_epochs: int) -> list[Unit]:
    return [u for u in plan(seeds) if not is_recorded(records, u, budget, trial_epochs)]


def first_reaching(improvements: Sequence[Sequence[float]], target: float) -> int | None:
    """Epochs consumed when the best accuracy so far first reached `target`.

    `improvements` holds (epochs consumed, accuracy) each time the best so far rose."""
    return next((int(e) for e, acc in improvements if acc >= target), None)


@dataclass
class Row:
    method: str
    seeds: list[int]
    to_target: dict[int, int | None]  # seed -> epochs consumed to the target (None: not in the budget)
    best: dict[int, float]  # seed -> best validation accuracy within the budget

    def reached(self) -> str:
        return f"{sum(v is not None for v in self.to_target.values())}/{len(self.seeds)}"

    def median_to_target(self, budget: int, seeds: Iterable[int] | None = None) -> float:
        """A seed that never reached the target counts as twice the budget."""
        chosen = self.seeds if seeds is None else list(seeds)
        return statistics.median(v if v is not None else 2 * budget for v in (self.to_target[s] for s in chosen))

    def mean_to_target(self) -> float | None:
        hits = [v for v in self.to_target.values() if v is not None]
        return statistics.mean(hits) if hits else None

    def mean_best(self, seeds: Iterable[int] | None = None) -> float:
        chosen = self.seeds if seeds is None else list(seeds)
        return statistics.mean(self.best[s] for s in chosen)


def rows_for(records: list[dict], task: str, target: float, budget: int, trial_epochs: int) -> list[Row]:
    rows = []
    for method in METHOD_ORDER:
        mine = sorted(
            (r for r in records if key_of(r)[:2] == (task, method) and key_of(r)[3:] == (budget, trial_epochs)),
            key=lambda r: r["seed"],
        )
        if mine:
            rows.append(
                Row(
                    method,
                    [r["seed"] for r in mine],
                    {r["seed"]: first_reaching(r["improvements"], target) for r in mine},
                    {r["seed"]: float(r["best_accuracy"]) for r in mine},
                )
            )
    return rows


def aim_text(rows: list[Row], budget: int, seeds: int) -> str:
    """The issue's aim: nbdist's best set-up against Optuna's best, on the seeds both ran.
    Medians over different numbers of seeds do not compare: where some set-ups of a side
    have every seed of the plan, the best is chosen among those only."""
    ours = _complete_first([r for r in rows if r.method.startswith("nbdist")], seeds)
    theirs = _complete_first([r for r in rows if r.method in OPTUNA], seeds)
    if not ours or not theirs:
        return "Aim: not yet measurable (it needs an nbdist set-up and an Optuna method with a seed each)."

    def rank(row: Row) -> tuple[float, float]:
        return row.median_to_target(budget), -row.mean_best()

    mine, best_peer = min(ours, key=rank), min(theirs, key=rank)
    common = sorted(set(mine.seeds) & set(best_peer.seeds))
    if not common:
        return f"Aim: {mine.method} and {best_peer.method} have no seed in common yet."
    epochs = mine.median_to_target(budget, common) / best_peer.median_to_target(budget, common)
    accuracy = mine.mean_best(common) / best_peer.mean_best(common)
    provisional = "" if len(common) >= seeds else f" (provisional: {len(common)} of {seeds} seeds)"
    return (
        f"Aim{provisional}, over seeds {', '.join(map(str, common))}: nbdist's best set-up {mine.method} against "
        f"Optuna's best {best_peer.method}: median epochs to target {epochs:.2f}x (aim <= 0.8x: "
        f"{'met' if epochs <= 0.8 else 'not met'}); mean best accuracy {accuracy:.3f}x (aim >= 1: "
        f"{'met' if accuracy >= 1 else 'not met'})."
    )


def _complete_first(rows: list[Row], seeds: int) -> list[Row]:
    """The rows with every one of `seeds` seeds, or all of them where none has."""
    complete = [r for r in rows if len(r.seeds) >= seeds]
    return complete or rows


def markdown_table(rows: list[Row], budget: int) -> str:
    lines = [
        "| method | seeds done | reached target | median epochs to target | mean epochs to target "
        "| mean best accuracy |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        mean = row.mean_to_target()
        lines.append(
            f"| {row.method} | {','.join(map(str, row.seeds))} | {row.reached()} | "
            f"{row.median_to_target(budget):g} | {'-' if mean is None else f'{mean:.1f}'} | {row.mean_best():.4f} |"
        )
    return "\n".join(lines)


def units_table(records: list[dict]) -> str:
    lines = [
        "| task | method | seed | finished (UTC) | commit | wall s | CPU s | load before/after | priority |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        before, after = r.get("load_before", [float("nan")])[0], r.get("load_after", [float("nan")])[0]
        lines.append(
            f"| {r['task']} | {r['method']} | {r['seed']} | {r.get('date', '?')} | {r.get('commit', '?')} | "
            f"{r.get('wall_s', float('nan')):.0f} | {r.get('cpu_s', float('nan')):.0f} | {before:.2f}/{after:.2f} | "
            f"{r.get('priority', '?')} |"
        )
    return "\n".join(lines)


def render_report(
    records: list[dict], targets: dict[str, Sequence[float]], *, budget: int, trial_epochs: int, seeds: int, about: str
) -> str:
    """The dated markdown: the aggregated tables, the aim, every unit that ran, what is missing."""
    mine = [r for r in records if key_of(r)[3:] == (budget, trial_epochs)]
    missing = missing_units(records, seeds, budget, trial_epochs)
    out = [
        f"# hpo_peers: {len(mine)} of {len(plan(seeds))} units recorded",
        "",
        about,
        "",
        how_they_ran(mine),
        "",
        f"Trials of at most {trial_epochs} epochs, a budget of {budget} training epochs per (task, method, seed); "
        "epochs to target are the training epochs the method had consumed, over all its trials, when one first "
        "reached the target validation accuracy; a seed that never reached it counts as twice the budget in the "
        "median, and the mean is over the seeds that reached it.",
    ]
    for task in TASK_ORDER:
        for number, target in enumerate(targets[task]):
            rows = rows_for(mine, task, target, budget, trial_epochs)
            if not rows:
                continue
            label = "the aim's target" if number == 0 else "a stricter target"
            out += ["", f"## {task}, target {target} ({label})", "", markdown_table(rows, budget), ""]
            out.append(aim_text(rows, budget, seeds))
    out += ["", "## The units that ran", "", units_table(mine) if mine else "(none yet)", ""]
    if missing:
        out += [f"## Still missing: {len(missing)} units", ""]
        grouped: dict[tuple[str, str], list[int]] = {}
        for unit in missing:
            grouped.setdefault((unit.task, unit.method), []).append(unit.seed)
        out += [f"- {task} {method}: seeds {', '.join(map(str, s))}" for (task, method), s in grouped.items()]
        out.append("")
    else:
        out += ["## Still missing: none", ""]
    return "\n".join(out)


def how_they_ran(records: list[dict]) -> str:
    """Priorities, loads and what a unit cost, from the records themselves."""
    if not records:
        return "No unit has run yet."
    priorities: dict[str, int] = {}
    for r in records:
        priorities[r.get("priority", "?")] = priorities.get(r.get("priority", "?"), 0) + 1
    loads = [v for r in records for v in (r.get("load_before", [None])[0], r.get("load_after", [None])[0]) if v]
    costs = []
    for task in TASK_ORDER:
        cpu = [r["cpu_s"] for r in records if r["task"] == task and "cpu_s" in r]
        wall = [r["wall_s"] for r in records if r["task"] == task and "wall_s" in r]
        if cpu:
            costs.append(
                f"{task}: median {statistics.median(cpu):.0f} s of CPU (range {min(cpu):.0f}-{max(cpu):.0f}), "
                f"{statistics.median(wall):.0f} s of wall time"
            )
    return (
        "How they ran: "
        + ", ".join(f"{n} at priority {p}" for p, n in priorities.items())
        + (f"; 1-minute load average {min(loads):.2f} to {max(loads):.2f} around them" if loads else "")
        + ". A unit cost "
        + "; ".join(costs)
        + " (one core: torch runs single-threaded)."
    )
