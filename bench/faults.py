"""Failures, injected for real, and what became of each run (a script, not a test).

Each case starts `python -m nbdist launch -n N train ...` (mpiexec with MPI fault
tolerance), waits until it has trained a few epochs, then does to one process what a
user, a node or a batch system would: SIGKILL, SIGSTOP (and SIGCONT once the run went on
without it), SIGTERM; or, in the disk-full case, fills the small file system (a tmpfs
mounted for it, so root only) that holds the run, as another job fills a shared scratch.
It then waits for the job to end, with a deadline: a job still running then counts as
hung (and is killed). Bad input is one case too, and so are
synchronous runs one after the other in one job, where any hang would show.

The table says, per case: runs, how many completed their epochs, how many ended with one
clear error (one `nbdist: error:` line, no traceback) within 10 s of the fault, how many
hung, the samples lost (not trained in their epoch, asynchronous drops), the epochs
trained again after a restart (at most the checkpoint interval) and, for a run restarted
on the ranks left or one that went on without a worker under a sub-master, whether
`--resume` on the job's original size then went on from its last epoch.

Resume anywhere (bench/_resume_anywhere.py), in one job of 6 ranks per part: asynchronous
runs of each rule, whose last checkpoint must be their last epoch and which must resume
exactly there; and runs resumed on more and on fewer ranks (master/worker, sub-masters,
allreduce, pipelines), whose epochs must go on. Then the aim line.

Usage: python bench/faults.py [--runs 3] [--quick] [--sync-runs 50] [--last-runs 20]
       [--only faults|restarts|last-epochs|resized] [--kinds easgd,masters,...]

`--only` runs one part (restarts: the cases that lose a rank and go on, restarted by
--max-restarts or without the dropped worker, each then resumed on its original size); the
aim line then counts that part only. `--kinds` picks the asynchronous runs of the
last-epochs part (each kind is one job of its own).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import header, table
from _fault_cases import CASES, QUICK, Case
from _fault_runs import ERROR_WITHIN, Outcome, run_case, synchronous_in_a_row
from _resume_anywhere import ASYNCHRONOUS, last_epochs, resized

PARTS = ("faults", "restarts", "last-epochs", "resized")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs per case (default 3)")
    p.add_argument("--sync-runs", type=int, default=50, help="synchronous runs in a row (default 50)")
    p.add_argument("--last-runs", type=int, default=20, help="asynchronous runs of each kind (default 20)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="one run of eight cases (disk full too), 10 synchronous runs, 4 of each kind",
    )
    p.add_argument("--only", choices=PARTS, help="one part: " + ", ".join(PARTS) + " (default: all)")
    p.add_argument("--kinds", default=",".join(ASYNCHRONOUS), help="asynchronous kinds for last-epochs")
    p.add_argument(
        "--case",
        metavar="TEXT",
        action="append",
        help="only the fault cases whose name holds TEXT (repeat it for more; e.g. 'disk full'), no synchronous runs",
    )
    args = p.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in ASYNCHRONOUS]
    if unknown:
        p.error(f"--kinds: no kind {', '.join(unknown)}; choose from {', '.join(ASYNCHRONOUS)}")
    parts = [args.only] if args.only else list(PARTS)
    if args.only == "restarts":
        cases = [case for case in CASES if case.resume]
    elif "faults" in parts:
        cases = [CASES[i] for i in QUICK] if args.quick else CASES
    else:
        cases = []
    if args.case:
        cases = [case for case in CASES if any(text in case.name for text in args.case)]
    runs = 1 if args.quick else args.runs
    last_runs = 4 if args.quick else args.last_runs
    header("faults: kill, stop and signal cases under python -m nbdist launch")
    aim = Aim()
    if cases:
        fault_cases(cases, runs, aim)
    if "faults" in parts and not args.case:
        sync_row(10 if args.quick else args.sync_runs, aim)
    if aim.rows:
        table(
            aim.rows,
            [
                "case",
                "runs",
                "completed",
                f"clear error within {ERROR_WITHIN:.0f} s",
                "hung",
                "samples lost (per run)",
                "epochs redone",
                "then resumed on the original size",
            ],
        )
    if "last-epochs" in parts:
        with tempfile.TemporaryDirectory(prefix="nbdist-faults-") as tmp:
            last_rows, aim.last_total, aim.last_good, last_hung = last_epochs(last_runs, kinds, Path(tmp))
        print()
        table(last_rows, ["asynchronous run", "runs", "last checkpoint = last epoch", "resumed exactly there"])
        aim.hangs += int(last_hung)
    if "resized" in parts:
        with tempfile.TemporaryDirectory(prefix="nbdist-faults-") as tmp:
            size_rows, aim.size_total, aim.size_good, size_hung = resized(Path(tmp))
        print()
        table(size_rows, ["resumed on other ranks", "resumes", "went on from their epoch", "val_acc at the end"])
        aim.hangs += int(size_hung)
    print(aim.line())


@dataclass
class Aim:
    """The counts the aim line is made of (a part that did not run counts 0 of 0)."""

    rows: list[list[str]] = field(default_factory=list)
    hangs: int = 0
    async_deaths: int = 0
    async_completed: int = 0
    lost_beyond: int = 0
    restarted: int = 0
    resumed: int = 0
    last_total: int = 0
    last_good: int = 0
    size_total: int = 0
    size_good: int = 0
    errors_expected: int = 0
    errors_clear: int = 0

    def line(self) -> str:
        met = (
            self.hangs == 0
            and self.lost_beyond == 0
            and self.async_completed == self.async_deaths
            and self.resumed == self.restarted
            and self.last_good == self.last_total
            and self.size_good == self.size_total
            and self.errors_clear == self.errors_expected
        )
        return (
            f"\naim: 0 hangs ({self.hangs}), nothing lost beyond the checkpoint interval (runs that redid more "
            f"than one epoch: {self.lost_beyond}), every asynchronous worker death completed "
            f"({self.async_completed} of {self.async_deaths}), every run that lost a rank resumed on its original "
            f"size ({self.resumed} of {self.restarted}), every asynchronous run ended at its last epoch "
            f"and resumed there ({self.last_good} of {self.last_total}), every resume on other ranks went on from "
            f"its epoch ({self.size_good} of {self.size_total}), every run that cannot go on ended with one clear "
            f"line ({self.errors_clear} of {self.errors_expected}): {'met' if met else 'not met'}"
        )


def _ending(out: Outcome) -> str:
    if out.hung:
        return "hung"
    return "completed" if out.completed else "clear error" if out.clear_error else "other"


def fault_cases(cases: list[Case], runs: int, aim: Aim) -> None:
    """Each case `runs` times: a row of the table each, and the aim's counts."""
    for case in cases:
        outcomes = []
        for i in range(runs):
            with tempfile.TemporaryDirectory(prefix="nbdist-faults-") as tmp:
                outcomes.append(run_case(case, Path(tmp)))
            last = outcomes[-1]
            notes = "".join(f"\n    {n!r}" for n in last.notes)
            print(
                f"  {case.name} #{i + 1}: {_ending(last)} ({last.seconds_to_end:.1f} s after the fault){notes}",
                flush=True,
            )
        aim.hangs += sum(o.hung for o in outcomes)
        if case.fault in ("kill", "stop") and case.expect == "complete" and "--max-restarts" not in case.args:
            aim.async_deaths += len(outcomes)
            aim.async_completed += sum(o.completed for o in outcomes)
        if case.expect == "error":
            aim.errors_expected += len(outcomes)
            aim.errors_clear += sum(o.clear_error for o in outcomes)
        aim.lost_beyond += sum(o.epochs_redone > 1 for o in outcomes)  # --checkpoint-every 1 (the default)
        aim.restarted += sum(o.resumed is not None for o in outcomes) + sum(
            case.resume and not o.completed for o in outcomes
        )
        aim.resumed += sum(bool(o.resumed) for o in outcomes)
        aim.rows.append(
            [
                case.name,
                str(len(outcomes)),
                str(sum(o.completed for o in outcomes)),
                str(sum(o.clear_error for o in outcomes)),
                str(sum(o.hung for o in outcomes)),
                ", ".join(str(o.samples_lost) for o in outcomes),
                ", ".join(str(o.epochs_redone) for o in outcomes) if "--max-restarts" in case.args else "-",
                f"{sum(bool(o.resumed) for o in outcomes)} of {len(outcomes)}" if case.resume else "-",
            ]
        )


def sync_row(sync_runs: int, aim: Aim) -> None:
    with tempfile.TemporaryDirectory(prefix="nbdist-faults-") as tmp:
        completed, total, hung, seconds = synchronous_in_a_row(sync_runs, Path(tmp))
    aim.hangs += int(hung)
    aim.rows.append(
        [
            f"synchronous EASGD runs in a row, one job of 3 ranks ({seconds:.0f} s)",
            str(total),
            str(completed),
            "0",
            str(total - completed if hung else 0),
            "-",
            "-",
            "-",
        ]
    )


if __name__ == "__main__":
    main()
