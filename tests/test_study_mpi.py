"""Real studies under mpiexec: rank 0 coordinates, groups of ranks train the trials on
scikit-learn's digits, each trial's folds in parallel; the run store holds it all; a
study killed mid-way resumes and trains only what did not finish."""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from collections import Counter

import pytest
from conftest import ROOT, kill_when

from nbdist.launch import mpi_env, mpiexec_command
from nbdist.store import RunStore

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(400)]

SPACE = "lr=log(3e-3,0.5) hidden=int(8,64)"


def _study_argv(tmp_path, *extra: str) -> list[str]:
    return [
        "-m",
        "nbdist",
        "study",
        "--model",
        "examples/digits_mlp.py",
        "--space",
        SPACE,
        "--searcher",
        "random",
        "--workers",
        "1",
        "--epochs",
        "3",
        "--runs-dir",
        str(tmp_path),
        "--seed",
        "1",
        *extra,
    ]


def _runs_of(store: RunStore, study: str) -> dict[int, list]:
    runs: dict[int, list] = {}
    for run in store.runs(study=study):
        runs.setdefault(run.trial, []).append(run)
    return runs


def _wait_gone(pid: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, f"process {pid} outlived its job"
        time.sleep(0.1)


def test_a_study_on_digits_with_groups_and_folds(mpirun, tmp_path):
    done = mpirun(
        9,
        _study_argv(tmp_path, "--trials", "6", "--groups", "2", "--folds", "2", "--study-name", "digits"),
        timeout=300,
    )
    assert done.returncode == 0, done.output[-4000:]
    assert "9 ranks: 1 coordinator + 2 groups x 2 folds x (1 master + 1 worker)" in done.stdout
    assert "nbdist: study digits: 6 trials done" in done.stdout
    with RunStore(tmp_path / "nbdist.db") as store:
        assert store.study("digits")["status"] == "completed"
        trials = store.trials("digits")
        assert [t.number for t in trials] == list(range(6)) and {t.state for t in trials} == {"complete"}
        assert {t.group for t in trials} == {0, 1}  # both groups trained, at the same time
        runs = _runs_of(store, "digits")
        for t in trials:
            # The trial's figure of merit is the mean over its folds' runs, each recorded whole.
            folds = sorted(runs[t.number], key=lambda r: r.id)
            assert [r.id[-5:] for r in folds] == ["fold0", "fold1"] and {r.status for r in folds} == {"completed"}
            values = [r.final["val_loss"] for r in folds]
            assert t.fom == pytest.approx(statistics.fmean(values), abs=1e-12)
            assert t.fom_std == pytest.approx(statistics.pstdev(values), abs=1e-12)
            assert t.folds == pytest.approx(values)
            for run in folds:
                records, _ = store.records(run.id)
                assert len({r["rank"] for r in records}) == 2  # its master's and its worker's
                assert all(r["trial"] == t.number for r in records)
        foms = [t.fom for t in trials]
        # The search found something clearly better than its worst guess.
        assert min(foms) < 0.7 * max(foms), foms


def test_a_killed_study_resumes_with_only_its_unfinished_trials(tmp_path):
    # GEM: the space's lr is GEM's own (it has no optimiser), and its trials train.
    argv = _study_argv(tmp_path, "--trials", "6", "--groups", "2", "--study-name", "killed", "--algorithm", "gem")

    def two_finished_one_cut_off() -> bool:
        if not (tmp_path / "nbdist.db").exists():
            return False
        with RunStore(tmp_path / "nbdist.db") as store:
            try:
                trials = store.trials("killed")
            except Exception:  # the study row is not written yet
                trials = []
            # Cut off in the middle of a trial: one that is running and whose run has
            # its row (a trial killed before its run began leaves nothing to count).
            started = {r.trial for r in store.runs(study="killed")} if trials else set()
        states = Counter(t.state for t in trials)
        return states["complete"] >= 2 and bool({t.number for t in trials if t.state == "running"} & started)

    kill_when(5, argv, two_finished_one_cut_off, timeout=240, what="no two trials finished")
    with RunStore(tmp_path / "nbdist.db") as store:
        coordinator = store.study("killed")["pid"]
        _wait_gone(coordinator)  # the ranks die a moment after mpiexec
        before = {t.number: t.state for t in store.trials("killed")}
    finished_before = {n for n, s in before.items() if s == "complete"}

    resumed = subprocess.run(
        mpiexec_command(5, _study_argv(tmp_path, "--groups", "2", "--resume-study", "killed", "--algorithm", "gem")),
        cwd=ROOT,
        env=mpi_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    assert f"resuming study killed: {len(finished_before)} trials finished" in resumed.stdout, before
    recovered = int(resumed.stdout.split(" recovered from their runs")[0].split(", ")[-1])
    with RunStore(tmp_path / "nbdist.db") as store:
        trials = store.trials("killed")
        assert [t.number for t in trials] == list(range(6)) and {t.state for t in trials} == {"complete"}
        runs = _runs_of(store, "killed")
        for t in trials:
            completed = [r for r in runs[t.number] if r.status == "completed"]
            # None trained twice to the end; the ones that were cut off left a killed run.
            assert len(completed) == 1, (t.number, [(r.id, r.status) for r in runs[t.number]])
            assert completed[0].options["algorithm"] == f"gem(lr={float(t.params['lr'])!r})", completed[0].options
            assert completed[0].options["worker_optimizer"] is None
            assert t.fom is not None and t.fom < 2.3, t  # val_loss below chance (ln 10 = 2.30): it learnt
            if t.number in finished_before:
                assert len(runs[t.number]) == 1
        # Whatever was cut off mid-training left a killed run (a trial cut off between its
        # runs' end and its record is recovered from those runs instead of trained again).
        killed = [r for rs in runs.values() for r in rs if r.status == "killed"]
        assert len(killed) + recovered >= 1
        assert min(t.fom for t in trials) < 1.0, trials  # the larger lr learn digits well in 3 epochs
