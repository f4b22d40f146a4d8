"""Hyper-parameter search: how many evaluations, and how much wall time per trial.

Two halves:

branin    evaluations to within 1% of Branin's minimum (0.397887), at most 30 evaluations,
          over 10 seeds, for
            nbdist bayes        `BayesSearcher` with its defaults, one point at a time
            nbdist bayes N_G=2  the same, asking two points at a time (constant liar), as a
                                study with two groups of ranks does
            skopt gp_minimize   scikit-optimize's own loop with its defaults (the peer)
            nbdist random       `RandomSearcher`
          and the coordinator's CPU time per evaluation of the GP searchers (nbdist's refits
          the kernel from the previous fit and conditions the liars; gp_minimize refits
          from scratch, with restarts, at every point).
groups    wall time per completed trial of a real study on digits under mpiexec with
          N_G = 2 groups vs N_G = 1 (each group 1 master + 1 worker; the same random
          searcher and seed, so the same trials), alternating 1, 2, 1, 2 in the same run.
          On this 2-core machine the two groups share the cores the one group had: the
          ratio shows what running trials side by side saves (set-up, validation and
          exchanges of one trial overlap the training of the other), not more cores.

Usage: python bench/hpo_parallel.py [--quick]   (--quick: 4 seeds instead of 10)
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import aim, aim_at_most, header, table

from nbdist.hpo import BayesSearcher, RandomSearcher
from nbdist.hpo.functions import BRANIN_MIN, BRANIN_SPACE, branin, drive

BUDGET = 30
TARGET = BRANIN_MIN * 1.01


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def to_target(values: list[float]) -> int | None:
    """1-based index of the first value within 1% of the minimum, or None."""
    return next((i + 1 for i, v in enumerate(values) if v <= TARGET), None)


def nbdist_run(make, seed: int, batch: int) -> tuple[int | None, int]:
    values = drive(make(seed), branin, BUDGET, batch=batch, stop=lambda v: v <= TARGET)
    return to_target(values), len(values)


def skopt_run(seed: int) -> tuple[int | None, int]:
    from skopt import gp_minimize
    from threadpoolctl import threadpool_limits

    dims = [(-5.0, 10.0), (0.0, 15.0)]
    # one BLAS thread, as nbdist's searcher uses: threads only spin on matrices this small
    with threadpool_limits(limits=1, user_api="blas"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = gp_minimize(
            lambda x: branin({"x1": x[0], "x2": x[1]}),
            dims,
            n_calls=BUDGET,
            random_state=seed,
            callback=lambda res: res.func_vals[-1] <= TARGET,
        )
    return to_target(list(result.func_vals)), len(result.func_vals)


def branin_half(seeds: int) -> list[list]:
    contenders = {
        "nbdist bayes": lambda seed: nbdist_run(lambda s: BayesSearcher(BRANIN_SPACE, seed=s), seed, 1),
        "nbdist bayes N_G=2": lambda seed: nbdist_run(lambda s: BayesSearcher(BRANIN_SPACE, seed=s), seed, 2),
        "skopt gp_minimize": skopt_run,
        "nbdist random": lambda seed: nbdist_run(lambda s: RandomSearcher(BRANIN_SPACE, seed=s), seed, 1),
    }
    results = {}
    for name, run in contenders.items():
        t0, runs, evaluations = cpu_seconds(), [], 0
        for seed in range(seeds):
            hit, count = run(seed)
            runs.append(hit)
            evaluations += count
        results[name] = (runs, (cpu_seconds() - t0) / evaluations * 1e3)
    peer_runs, peer_cpu = results["skopt gp_minimize"]
    peer_reached = sum(n is not None for n in peer_runs)
    rows = []
    for name, (runs, cpu_ms) in results.items():
        reached = [n for n in runs if n is not None]
        rows.append(
            [
                name,
                f"{len(reached)}/{seeds}",
                len(reached) / max(peer_reached, 1),
                statistics.median(reached) if reached else float("nan"),
                " ".join(str(n) if n is not None else "-" for n in runs),
                cpu_ms,
                cpu_ms / peer_cpu,
            ]
        )
    table(
        rows,
        [
            "searcher",
            "reached in 30",
            "vs gp_minimize",
            "median evals (reached)",
            "evaluations per seed (- = not in 30)",
            "cpu ms/eval",
            "vs gp_minimize",
        ],
    )
    ours_runs, ours_cpu = results["nbdist bayes"]
    aim(
        "seeds where nbdist bayes reaches 1% in 30, vs gp_minimize",
        1.0,
        sum(n is not None for n in ours_runs) / max(peer_reached, 1),
    )
    aim_at_most("nbdist bayes coordinator CPU per evaluation vs gp_minimize", 1.0, ours_cpu / peer_cpu)
    return rows


def study_seconds_per_trial(groups: int, trials: int, runs_dir: str) -> float:
    """A real study under mpiexec; the coordinator's own wall time per completed trial."""
    import re
    import subprocess

    from nbdist.launch import mpi_env, mpiexec_command

    root = Path(__file__).resolve().parent.parent
    argv = [
        "-m",
        "nbdist",
        "study",
        "--model",
        str(root / "examples" / "digits_mlp.py"),
        "--space",
        "lr=log(1e-2,0.5) hidden=int(16,64)",
        "--searcher",
        "random",
        "--trials",
        str(trials),
        "--groups",
        str(groups),
        "--workers",
        "1",
        "--epochs",
        "4",
        "--seed",
        "3",
        "--runs-dir",
        runs_dir,
        "--store",
        "off",
    ]
    done = subprocess.run(
        mpiexec_command(1 + 2 * groups, argv), env=mpi_env(), capture_output=True, text=True, timeout=1800
    )
    match = re.search(r"nbdist: study \S+: (\d+) trials done in ([0-9.]+)s", done.stdout)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"the study with {groups} groups failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return float(match.group(2)) / int(match.group(1))


def groups_half(rounds: int, trials: int) -> None:
    """N_G = 2 vs N_G = 1 wall time per completed trial, same run, best of `rounds` each."""
    import tempfile

    print(
        f"\ngroups: a study of {trials} trials on digits (1 master + 1 worker per group, 4 epochs), "
        f"N_G = 1 vs N_G = 2, {rounds} alternating rounds\n"
    )
    times: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as runs_dir:
        for _ in range(rounds):
            for groups in (1, 2):
                times[groups].append(study_seconds_per_trial(groups, trials, runs_dir))
    one, two = min(times[1]), min(times[2])
    table(
        [
            [f"N_G = {g}", f"{1 + 2 * g}", " ".join(f"{t:.2f}" for t in times[g]), f"{min(times[g]):.2f}"]
            for g in (1, 2)
        ],
        ["groups", "ranks", "s per trial, each round", "best"],
    )
    aim("N_G = 2 vs N_G = 1, trials per second (2 cores shared)", 1.0, one / two)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 seeds instead of 10")
    args = parser.parse_args()
    header("hyper-parameter search: evaluations to 1% of Branin's minimum; N_G = 2 vs 1")
    print(f"branin: evaluations until a value <= {TARGET:.6f} (1% above the minimum), at most {BUDGET}\n")
    branin_half(4 if args.quick else 10)
    groups_half(rounds=1 if args.quick else 2, trials=4 if args.quick else 8)


if __name__ == "__main__":
    main()
