"""Schedulers on real ranks (mpiexec): the median pruner stops a run right after the
epoch it judged; ASHA on three groups resumes each promoted trial from its rung's
checkpoint, so no epoch is trained twice; PBT on two groups of two ranks copies a
trial's training state from one group to another over MPI, bit for bit, and a PBT study
killed mid-way resumes; so does a PB2 study, whose bandit's choices and lineage are
recorded; set-ups that cannot work are one clear error."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, kill_when

from nbdist.launch import mpi_env, mpiexec_command
from nbdist.store import RunStore
from nbdist.train.checkpoint import Checkpoints

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]


def _argv(tmp_path, *extra: str, space: str = "lr=log(3e-3,0.5) hidden=int(8,64)") -> list[str]:
    return [
        "-m",
        "nbdist",
        "study",
        "--model",
        "examples/digits_mlp.py",
        "--space",
        space,
        "--searcher",
        "random",
        "--topology",
        "allreduce",
        "--runs-dir",
        str(tmp_path),
        "--seed",
        "1",
        *extra,
    ]


def _epochs_of(store: RunStore, study: str) -> dict[int, list[tuple[int, float]]]:
    """trial -> (epoch, time) of every epoch record of its run (one fold), in the order stored."""
    out = {}
    for run in store.runs(study=study):
        records, _ = store.records(run.id)
        out[run.trial] = [(r["epoch"], r["time"]) for r in records if r["kind"] == "epoch"]
    return out


def test_the_median_pruner_stops_a_run_right_after_the_epoch_it_judged(mpirun, tmp_path):
    done = mpirun(
        3,
        _argv(tmp_path, "--scheduler", "median(warmup_trials=2)", "--epochs", "6", "--trials", "8", "--groups", "2")
        + ["--study-name", "pruned"],
        timeout=300,
    )
    assert done.returncode == 0, done.output[-4000:]
    with RunStore(tmp_path / "nbdist.db") as store:
        trials = store.trials("pruned")
        epochs = _epochs_of(store, "pruned")
        values = {(e["number"], e["epoch"]): e["data"]["value"] for e in store.trial_events("pruned", kind="value")}
    pruned = [t for t in trials if t.state == "pruned"]
    assert pruned and any(t.state == "complete" for t in trials), [(t.number, t.state) for t in trials]
    for t in pruned:
        # Its run trained exactly up to the epoch it was judged on: not one epoch more.
        assert [e for e, _ in epochs[t.number]] == list(range(1, t.epochs + 1)) and t.epochs < 6, t
        assert t.fom == pytest.approx(values[(t.number, t.epochs)])
    assert all([e for e, _ in epochs[t.number]] == list(range(1, 7)) for t in trials if t.state == "complete")


def test_asha_on_three_groups_resumes_promoted_trials_from_their_rung(mpirun, tmp_path):
    done = mpirun(
        4,
        _argv(tmp_path, "--scheduler", "asha(min_epochs=1, reduction=3)", "--epochs", "9", "--trials", "9")
        + ["--groups", "3", "--study-name", "asha"],
        timeout=300,
    )
    assert done.returncode == 0, done.output[-4000:]
    assert "3 groups x 1 fold x 1 worker; random, scheduler asha(min_epochs=1, reduction=3), 9 trials" in done.stdout
    with RunStore(tmp_path / "nbdist.db") as store:
        trials = {t.number: t for t in store.trials("asha")}
        epochs = _epochs_of(store, "asha")
        promoted = store.trial_events("asha", kind="promoted")
        paused = {(e["number"], e["epoch"]): e["time"] for e in store.trial_events("asha", kind="paused")}
        segments = store.trial_events("asha", kind="segment")
    assert len(trials) == 9 and {t.state for t in trials.values()} == {"complete", "stopped"}
    assert {t.epochs for t in trials.values() if t.state == "stopped"} <= {1, 3}
    assert {t.epochs for t in trials.values() if t.state == "complete"} == {9}
    assert promoted, "no trial was promoted"
    for number, t in trials.items():
        # Every epoch of every run was trained once, in order, however many segments it took.
        assert [e for e, _ in epochs[number]] == list(range(1, t.epochs + 1)), (number, epochs[number])
    for event in promoted:
        number, rung = event["number"], event["epoch"]
        assert any(s["number"] == number and s["epoch"] == rung for s in segments)  # a segment started there
        after = [when for e, when in epochs[number] if e == rung + 1]
        # The promoted run went on from its rung's checkpoint: its next epoch came after its pause.
        assert after and after[0] > paused[(number, rung)], (number, rung)


def _pbt_argv(tmp_path, *extra: str) -> list[str]:
    # The smallest population that copies a state between groups of several ranks: two
    # groups of two ranks, the worse half replaced (the quarter of four groups proved no
    # more, on four more ranks per launch).
    return _argv(
        tmp_path,
        "--scheduler",
        "pbt(interval=1, quantile=0.5)",
        "--epochs",
        "2",
        "--groups",
        "2",
        "--workers",
        "2",
        "--keep-checkpoints",
        "10",
        *extra,
        space="lr=log(1e-3,0.3) momentum=real(0.5,0.95)",
    )


def _share(run_dir: Path, label: str, rank: int) -> dict:
    arrays, _ = Checkpoints.read_rank(run_dir / "checkpoints" / label, rank)
    return arrays


def _killed_at_the_first_exploit_and_resumed(tmp_path, n: int, argv: list[str], study: str) -> None:
    """Run a population study, SIGKILL it in the middle of its first exploit (nothing is
    told, nothing is flushed), and resume it to its end."""

    def exploiting() -> bool:
        if not (tmp_path / "nbdist.db").exists():
            return False
        with RunStore(tmp_path / "nbdist.db") as store:
            try:
                return bool(store.trial_events(study, kind="exploit"))
            except Exception:  # the study is not in the store yet
                return False

    kill_when(n, [*argv, "--study-name", study], exploiting, timeout=300, what="no exploit")
    resumed = subprocess.run(
        mpiexec_command(n, [*argv, "--resume-study", study]),
        cwd=ROOT,
        env=mpi_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    assert f"resuming study {study}" in resumed.stdout


def test_pbt_copies_states_between_groups_and_resumes_after_a_kill(tmp_path):
    _killed_at_the_first_exploit_and_resumed(tmp_path, 5, _pbt_argv(tmp_path), "pbt")
    with RunStore(tmp_path / "nbdist.db") as store:
        trials = {t.number: t for t in store.trials("pbt")}
        exploits = store.trial_events("pbt", kind="exploit")
        values = {(e["number"], e["epoch"]): e["data"]["value"] for e in store.trial_events("pbt", kind="value")}
        schedules = {(e["number"], e["epoch"]): e["data"] for e in store.trial_events("pbt", kind="params")}
        runs = {r.trial: Path(r.run_dir) for r in store.runs(study="pbt")}
    assert sorted(trials) == [0, 1] and {(t.state, t.epochs) for t in trials.values()} == {("complete", 2)}
    # One member replaced at the meeting after the first epoch (half of two).
    assert [e["epoch"] for e in exploits] == [1]
    for event in exploits:
        receiver, source, epoch = event["number"], event["data"]["source"], event["epoch"]
        # The source was the best at the meeting, the receiver the worst.
        met = {n: values[(n, epoch)] for n in trials}
        assert source == min(met, key=met.get) and receiver == max(met, key=met.get), (event, met)
        # Its schedule: the source's parameters, moved, from this epoch on.
        assert schedules[(receiver, epoch)] == event["data"]["params"] != event["data"]["previous"]
        for rank in (0, 1):  # both ranks of the group: each took its place's share
            taken = _share(runs[receiver], f"exploit-{epoch:04d}", rank)
            sent = _share(runs[source], f"epoch-{epoch:04d}", rank)
            own = _share(runs[receiver], f"epoch-{epoch:04d}", rank)
            for group in ("model", "opt"):
                for name, array in sent[group].items():
                    assert array.tobytes() == taken[group][name].tobytes(), (receiver, epoch, group, name)
            assert not np.array_equal(own["model"]["params"], taken["model"]["params"])
    last = max(exploits, key=lambda e: e["epoch"])
    assert trials[last["number"]].params == last["data"]["params"]


def test_pb2_chooses_by_its_bandit_records_its_lineage_and_resumes_after_a_kill(tmp_path):
    # The smallest population PB2 serves (two groups of one rank, the worse half replaced),
    # three epochs: meetings after epochs 1 (nothing observed yet) and 2 (the GP's choice).
    argv = _argv(
        tmp_path,
        "--scheduler",
        "pb2(interval=1, quantile=0.5)",
        "--epochs",
        "3",
        "--groups",
        "2",
        space="lr=log(1e-3,0.3) momentum=real(0.5,0.95)",
    )

    _killed_at_the_first_exploit_and_resumed(tmp_path, 3, argv, "pb2")
    from nbdist.dashboard.study.curves import CurveFeed, lineage_columns, lineage_members, schedule_lines
    from nbdist.dashboard.study.data import StudyData

    with RunStore(tmp_path / "nbdist.db") as store:
        trials = {t.number: t for t in store.trials("pb2")}
        exploits = sorted(store.trial_events("pb2", kind="exploit"), key=lambda e: e["epoch"])
        # Each member's value at a meeting (a run that got there before the kill has no
        # 'value' event for it from the resumed job: its pause was read from the store).
        values = {(e["number"], e["epoch"]): e["data"]["value"] for e in store.trial_events("pb2", kind="paused")}
        schedules = {(e["number"], e["epoch"]): e["data"] for e in store.trial_events("pb2", kind="params")}
        data = StudyData(store, "pb2")
        data.poll()
    assert sorted(trials) == [0, 1] and {(t.state, t.epochs) for t in trials.values()} == {("complete", 3)}
    # One member replaced at each meeting: the first drawn within the bounds (nothing
    # observed yet), the second chosen by the GP's upper bound on both members' interval
    # from epoch 1 to 2, which the resumed study observed from the state saved before the kill.
    assert [(e["epoch"], e["data"]["acquisition"]) for e in exploits] == [(1, "uniform"), (2, "ucb")]
    assert exploits[1]["data"]["observations"] == 2
    for event in exploits:
        receiver, source, epoch, params = (
            event["number"],
            event["data"]["source"],
            event["epoch"],
            event["data"]["params"],
        )
        met = {n: values[(n, epoch)] for n in trials}
        assert source == min(met, key=met.get) and receiver == max(met, key=met.get), (event, met)
        assert 1e-3 <= params["lr"] <= 0.3 and 0.5 <= params["momentum"] <= 0.95, params
        assert schedules[(receiver, epoch)] == params
    # The dashboard draws a PB2 study's lineage and schedules as a PBT study's.
    assert data.info.pbt
    feed = CurveFeed()
    feed.add(data.events)
    members = lineage_members(data.events, data.trials, data.info.pbt)
    _, edges = lineage_columns(data.events, members, feed.values)
    assert list(zip(edges["epoch"], edges["source"], edges["receiver"], strict=True)) == [
        (e["epoch"], e["data"]["source"], e["number"]) for e in exploits
    ]
    lines = schedule_lines(data.events, data.trials, members, "lr")
    assert sorted(lines["trial"]) == [0, 1]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--scheduler", "pbt", "--groups", "2"],
            "pbt(quantile=0.25) replaces the bottom 25% of a population of one trial per group: it needs at "
            "least 4 groups, this study has 2",
        ),
        (
            ["--scheduler", "pb2(quantile=0.5)", "--groups", "2"],
            "pb2 changes hyper-parameters while the trials train, and 'hidden' cannot change once a run has started",
        ),
    ],
)
def test_a_scheduler_that_cannot_fit_the_study_is_one_clear_error(mpirun, tmp_path, extra, message):
    done = mpirun(3, _argv(tmp_path, "--epochs", "3", *extra), timeout=120)
    assert done.returncode != 0
    assert message in done.output, done.output[-3000:]
    assert "Traceback" not in done.output


def test_a_multi_objective_optuna_study_reports_its_pareto_front_and_resumes(mpirun, tmp_path):
    from nbdist.dashboard.study.table import group_ranks

    argv = _argv(tmp_path, "--epochs", "2", "--groups", "2", "--objective", "val_acc,params") + [
        "--direction",
        "maximize,minimize",
        "--searcher",
        "optuna(sampler='tpe', n_startup_trials=2)",
    ]
    first = mpirun(3, argv + ["--trials", "3", "--study-name", "mo"], timeout=300)
    assert first.returncode == 0, first.output[-4000:]
    assert "nbdist: Pareto front of val_acc, params (maximize,minimize):" in first.stdout
    resumed = mpirun(3, argv + ["--trials", "5", "--resume-study", "mo"], timeout=300)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert "resuming study mo: 3 trials finished" in resumed.stdout
    with RunStore(tmp_path / "nbdist.db") as store:
        trials = store.trials("mo")
        told = store.study("mo")["searcher_state"]["searcher"]["told"]
        layout = store.study("mo")["options"]["layout"]
    assert group_ranks(layout) == {0: [1], 1: [2]}  # the groups' ranks, for the dashboard's trial table
    assert [t.number for t in trials] == list(range(5)) and {t.state for t in trials} == {"complete"}
    assert len(told) == 5  # the Optuna study went on from the store's three
    for t in trials:
        acc, params = t.values
        assert 0.0 < acc <= 1.0 and params == 75 * t.params["hidden"] + 10  # the MLP's weights and biases
    front = [line for line in resumed.stdout.splitlines() if line.startswith("nbdist:   trial")]
    values = {t.number: t.values for t in trials}
    on_front = {int(line.split()[2]) for line in front}
    for n, (acc, params) in values.items():
        dominated = any(a >= acc and p <= params and (a, p) != (acc, params) for a, p in values.values())
        assert (n in on_front) == (not dominated), (n, values, front)
