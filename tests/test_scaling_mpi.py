"""`nbdist scale` on real MPI ranks: a short sweep end to end, bad input as one error line
(the bad command lines one after the other in one job, tests/batched_runs.py), and the
simulator replaying a real run's recorded updates."""

from __future__ import annotations

import statistics
from collections import defaultdict

import pytest
from batched_runs import run_many

from nbdist.metrics import read_log
from nbdist.scaling import Calibration, Machine, PerformanceModel, Point, SetUp, Simulator, network
from nbdist.scaling.analysis import machine_of
from nbdist.scaling.store import load_calibration, scale_records
from nbdist.store import RunStore

pytestmark = pytest.mark.mpi

MODEL = "examples/digits_cnn.py"


def test_a_short_sweep_measures_predicts_and_stores_every_point(pyrun, tmp_path):
    store = tmp_path / "nbdist.db"
    done = pyrun(
        ["-m", "nbdist", "launch", "-n", "3", "scale", "--model", MODEL, "--quick", "--setups", "allreduce downpour",
         "--scaling", "weak", "--cores", "2", "--max-ranks", "64", "--runs-dir", str(tmp_path),
         "--store", str(store), "--run-name", "study"],
        timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.output[-4000:]
    out = done.stdout
    for section in ("## Calibration", "## Measured", "## Predicted beside measured", "## Predicted to many ranks"):
        assert section in out
    assert "master saturation (W* = (Z + S) / S, one master): downpour: W* = " in out
    assert "recommended: " in out and "prediction error on samples/s: median" in out
    # Three ranks on two cores: said so, not passed off as a speed-up on three cores.
    assert "oversubscribed: 3 ranks on 2 cores" in out
    with RunStore(store) as opened:
        assert opened.run("study").kind == "scale" and opened.run("study").status == "completed"
        found = scale_records(opened, "study")
        calibration = load_calibration(opened, "study")
    assert calibration.ranks == 3 and calibration.params > 0 and calibration.noise_scale
    measured = {(m["measured"]["label"], m["measured"]["ranks"]) for m in found["measured"]}
    assert measured == {("allreduce", 1), ("allreduce", 2), ("allreduce", 3), ("downpour", 2), ("downpour", 3)}
    for entry in found["measured"]:
        point = entry["measured"]
        assert point["samples_per_s"] > 0 and entry["predicted"]["samples_per_s"] > 0
        assert point["cores"] == min(point["ranks"], 2) and point["oversubscribed"] == (point["ranks"] > 2)
    assert max(p["ranks"] for p in found["predicted"]) == 64
    # The inputs read back predict what the study predicted from them (for the cores the
    # point had: two, less what other processes used meanwhile).
    entry = next(m for m in found["measured"] if m["measured"]["ranks"] == 3 and m["measured"]["label"] == "allreduce")
    point = Point.from_dict(entry["measured"])
    again = PerformanceModel(calibration, machine_of(point, 2, "ib-hdr")).predict(SetUp("allreduce"), 3)
    assert again.samples_per_s == pytest.approx(entry["predicted"]["samples_per_s"], rel=1e-9)
    assert (tmp_path / "study" / "report.md").read_text().startswith("## Calibration")


BAD_INPUT = {
    "ranks-beyond-the-job": (
        ["--model", MODEL, "--ranks", "1,2,4"],
        "--ranks 1,2,4: 4 is more than the 2 MPI ranks of this job",
    ),
    "model-missing": (["--model", "no/such/model.py"], "model file 'no/such/model.py' not found"),
    "setup-typo": (
        ["--model", MODEL, "--setups", "allreduce downpuor"],
        "unknown set-up 'downpuor' (did you mean 'downpour'?)",
    ),
}


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory):
    """Every `scale` of BAD_INPUT, one after the other, in ONE job of 2 ranks: each ends on
    every rank before the first message, so the job goes on to the next."""
    tmp = tmp_path_factory.mktemp("scale-bad")
    argvs = [["scale", *given, "--runs-dir", str(tmp)] for given, _ in BAD_INPUT.values()]
    return dict(zip(BAD_INPUT, run_many(2, argvs, tmp / "runs.json", timeout=120), strict=True))


@pytest.mark.parametrize("name", list(BAD_INPUT))
def test_bad_input_is_one_clear_error_line(bad_input_runs, name):
    done, said = bad_input_runs[name], BAD_INPUT[name][1]
    assert done.returncode == 2, done.output[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("nbdist: error:")]
    assert len(errors) == 1 and said in errors[0], done.stderr
    assert "Traceback" not in done.output


def test_the_simulator_replays_a_real_runs_recorded_updates(pyrun, tmp_path):
    """Each worker's time away from the master (its compute and its messages) and the
    master's service, as a real 2-worker run recorded them, played through the simulator's
    queue and passes: the staleness and the update rate come out as the master recorded."""
    done = pyrun(
        ["-m", "nbdist", "launch", "-n", "3", "train", "--model", MODEL, "--epochs", "8", "--trace-updates",
         "--runs-dir", str(tmp_path), "--run-name", "traced", "--store", "off", "--quiet", "--checkpoint-every", "0"],
        timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.output[-3000:]
    updates = [r for r in read_log(tmp_path / "traced", "update") if r["values"].get("traced")]
    assert len(updates) > 200
    updates = updates[len(updates) // 5 : -len(updates) // 10]  # the steady state
    phases = [r for r in read_log(tmp_path / "traced", "phase") if r["role"] == "master"]
    busy = phases[-1]["values"]["update"] + phases[-1]["values"]["reply"]
    total = sum(1 for _ in read_log(tmp_path / "traced", "update"))
    service = busy / total  # the master's work per update it applied

    by_worker = defaultdict(list)
    for r in updates:
        by_worker[r["values"]["source_rank"]].append(r["time"])
    away = [b - a - service for times in by_worker.values() for a, b in zip(times, times[1:], strict=False)]
    mean_away = statistics.fmean(away)
    # Every recorded time, not 41 quantiles of them: on a loaded box a few of them are
    # many times the mean, and 41 equally weighted points (the largest one of them) gave
    # those a weight they did not have. Replayed for many cycles, so that the simulator's
    # own draws from them do not move its rate.
    spread = sorted(max(a, 0.0) / mean_away for a in away)
    rules = ("downpour",)
    replayed = Calibration(
        model="trace", params=1, state=0, batch_size=32, cores=64, step_s=mean_away, per_sample_s=0.0,
        busy_factor=1.0, spread=spread, allreduce_loop_s=0.0, worker_step_s=dict.fromkeys(rules, 0.0),
        worker_exchange_s=dict.fromkeys(rules, 0.0), p2p_alpha_s=0.0, p2p_beta_s=1e-15, allreduce_alpha_s=0.0,
        allreduce_beta_s=1e-15, apply_s=dict.fromkeys(rules, 0.0), master_fixed_s=service, client_test_s=0.0,
        reply_latency_s=0.0, poll_sleep_s=0.0,
    )  # fmt: skip
    simulated = Simulator(PerformanceModel(replayed, Machine(64, network("ib-hdr")))).run(
        SetUp("master-worker", "downpour"), 3, cycles=4000
    )
    recorded_rate = (len(updates) - 1) / (updates[-1]["time"] - updates[0]["time"])
    recorded_staleness = statistics.fmean(r["values"]["staleness"] for r in updates)
    assert simulated.samples_per_s / 32 == pytest.approx(recorded_rate, rel=0.15)
    # Staleness: the replay's master is always awake, so it serves one update a pass and two
    # workers' mean is W - 1 = 1 whatever the order of their updates. The recorded master
    # (3 ranks on 2 cores: it sleeps between polls, and other processes may hold the cores)
    # applies the updates that came while it woke in one pass and replies after it, which
    # can only make updates fresher: the recorded mean is at most the replay's.
    assert simulated.staleness_mean == pytest.approx(1.0, abs=0.05)
    assert 0 <= recorded_staleness <= simulated.staleness_mean + 0.05
