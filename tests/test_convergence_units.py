"""bench/convergence.py's study, unit by unit (issue 29): a unit's record survives the
JSON line it is written to, recorded units are skipped in the study's order, and the
report aggregates what is there, with the aim line decided only on all seeds."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import _convergence_report as rep  # noqa: E402
import _convergence_units as units  # noqa: E402

PROTO = units.protocol("jets-top-6000-6", 12, 32, 1200, [])
LOAD = (1.5, 2.5)


def run(rule: str, workers: int, seed: int, accs: list[float], **kw) -> units.Run:
    """A run validated every 1,200 samples with these accuracies."""
    curve = [(1200 * (i + 1), a) for i, a in enumerate(accs)]
    return units.Run(rule, workers, seed, curve=curve, losses={n: 0.5 for n, _ in curve}, **kw)


def record(r: units.Run, proto: dict = PROTO) -> dict:
    return units.to_record(r, proto, wall=12.0, load=LOAD, root=ROOT)


def test_a_record_round_trips_through_its_json_line(tmp_path):
    r = run("gem", 8, 3, [0.55, 0.8, 0.5, 0.9], staleness=Counter({0: 5, 7: 90, 12: 5}), bytes_sent=6000, trained=100)
    path = tmp_path / "units.jsonl"
    units.append(path, record(r))
    (line,) = path.read_text().splitlines()
    back = units.from_record(json.loads(line))
    assert (back.algorithm, back.workers, back.seed) == ("gem", 8, 3)
    assert back.curve == r.curve and back.losses == r.losses and back.staleness == r.staleness
    assert back.collapsed and back.best == 0.9 and back.final == 0.9 and back.bytes_per_sample == 60.0
    saved = json.loads(line)
    assert saved["collapsed"] is True and saved["best"] == 0.9 and saved["load"] == [1.5, 2.5]
    assert saved["staleness_stats"] == {"updates": 100, "mean": 6.9, "at_zero": 0.05, "p99": 12, "max": 12}
    assert saved["wall_s"] == 12.0 and saved["date"].endswith("Z") and saved["commit"]
    assert saved["scheduling"].startswith(("SCHED_IDLE", "normal"))


def test_a_broken_line_is_named_with_its_number(tmp_path):
    path = tmp_path / "units.jsonl"
    units.append(path, record(run("gem", 1, 0, [0.9])))
    with open(path, "a") as fh:
        fh.write('{"rule": "gem", "work\n')
    with pytest.raises(SystemExit, match=r"units.jsonl:2: not a JSON record"):
        list(units.read(path))


def test_recorded_units_are_skipped_in_the_study_order():
    rules = ["downpour", "gem", "allreduce"]
    order = list(units.study_units(rules))
    # every rule at 1 worker for 3 seeds first, then seeds 0-4 at 8 and at 16, then the rest
    assert order[:4] == [("downpour", 1, 0), ("gem", 1, 0), ("allreduce", 1, 0), ("downpour", 1, 1)]
    assert order[9] == ("downpour", 8, 0) and order[24] == ("downpour", 16, 0) and order[39] == ("downpour", 1, 3)
    assert order[60] == ("downpour", 8, 5) and order[-1] == ("allreduce", 16, 9)
    assert len(order) == len(set(order)) == 3 * 3 * units.SEEDS

    done = units.recorded([record(run(rule, 1, seed, [0.9])) for rule in rules for seed in range(3)], PROTO)
    assert units.next_unit(done, rules) == ("downpour", 8, 0)
    done[("downpour", 8, 0)] = record(run("downpour", 8, 0, [0.9]))
    assert units.next_unit(done, rules) == ("gem", 8, 0)


def test_only_the_same_protocol_counts_and_the_newest_record_wins():
    other = units.protocol("jets-top-6000-6", 4, 32, 1200, [])
    old = record(run("gem", 1, 0, [], error="no end within 900 s"))
    new = record(run("gem", 1, 0, [0.91]))
    done = units.recorded([record(run("easgd", 1, 0, [0.9]), other), old], PROTO)
    assert list(done) == [("gem", 1, 0)]
    # a unit cut by its deadline is done unless timeouts are retried, and counts as missing
    assert units.is_done(done[("gem", 1, 0)], retry_timeouts=False)
    assert not units.is_done(done[("gem", 1, 0)], retry_timeouts=True)
    assert units.next_unit(done, ["gem"], retry_timeouts=True) == ("gem", 1, 0)
    assert units.missing(done, ["gem"])[("gem", 1)] == list(range(10))
    done = units.recorded([old, new], PROTO)
    assert done[("gem", 1, 0)]["best"] == 0.91 and units.missing(done, ["gem"])[("gem", 1)] == list(range(1, 10))


def study(seeds: int, *, dip: bool = False) -> dict:
    """Downpour, GEM, DiLoCo and allreduce at 1 and 8 workers: DiLoCo reaches 0.945 at
    8 workers by 2,400 samples sending 1/20 of Downpour's bytes; Downpour dips."""
    runs = []
    for seed in range(seeds):
        for rule in ("downpour", "gem", "diloco", "allreduce"):
            runs.append(run(rule, 1, seed, [0.8, 0.95], bytes_sent=600 * 9600, trained=9600))
        runs.append(run("downpour", 8, seed, [0.7, 0.5 if dip else 0.8, 0.92], bytes_sent=640 * 9600, trained=9600))
        runs.append(run("gem", 8, seed, [0.7, 0.8, 0.93], bytes_sent=640 * 9600, trained=9600))
        runs.append(run("diloco", 8, seed, [0.8, 0.945], bytes_sent=32 * 9600, trained=9600))
        runs.append(run("allreduce", 8, seed, [0.7, 0.8, 0.94], bytes_sent=640 * 9600, trained=9600))
    return units.recorded([record(r) for r in runs], PROTO)


def test_the_report_aggregates_the_units_and_decides_the_aim_on_all_seeds():
    rules = ["downpour", "gem", "diloco", "allreduce"]
    text, figures = rep.worker_table(rep.group(study(10, dip=True)), rules, 8, PROTO)
    # gaps in points against each rule's own 1-worker best (0.95)
    assert round(figures["downpour"]["gap"], 1) == 3.0 and round(figures["diloco"]["gap"], 1) == 0.5
    assert figures["downpour"]["collapsed"] == 10 and figures["diloco"]["collapsed"] == 0
    # samples to 98% of allreduce's 1-worker best (0.931): diloco 2,400, allreduce 3,600
    assert figures["diloco"]["vs_allreduce"] == pytest.approx(2 / 3)
    assert figures["diloco"]["saving"] == pytest.approx(20.0)
    # 9,600 samples over 12 epochs, 8 workers at batch 32: a window of at most 4 batches
    assert figures["diloco"]["h"] == 4 and figures["downpour"]["h"] == 1
    # A variant's own window, cut where an epoch ends: 16 workers of 300 samples an epoch
    # take 10 batches, in windows of 4, 4 and 2.
    avg = [run("diloco-avg", 16, 0, [0.9], bytes_sent=0, trained=57600)]
    assert rep.window("diloco-avg", avg, 12, 32) == pytest.approx(10 / 3)
    assert rep.window("diloco-sync", avg, 12, 32) == 10.0
    assert "| diloco | 10/10 | 0.950 | 0.945 | 0.5 |" in text
    assert rep.aim_line(figures, 8) == "aim at 8 workers: met by diloco"
    assert "10 of 10 runs without a warm start, 0 of 0 with" in rep.dips_line(rep.group(study(10, dip=True)), 8)

    _, partial = rep.worker_table(rep.group(study(4)), rules, 8, PROTO)
    assert rep.aim_line(partial, 8) == "aim at 8 workers: not decided; on course so far: diloco (4 of 10 seeds)"


def test_the_report_names_what_is_missing_and_how_to_go_on():
    rules = ["downpour", "gem", "diloco", "allreduce"]
    text = rep.report(study(4), rules, PROTO, intro="# title", continue_with="GO ON")
    assert text.startswith("# title\n\n- Units recorded: 32 (0 ended with an error)")
    assert "- 1 worker(s): seeds 4-9 of every rule" in text
    assert "- 16 worker(s): seeds 0-9 of every rule" in text
    assert "`GO ON`" in text and "## 8 workers" in text and "## 16 workers" not in text


def test_a_bad_unit_is_one_clear_error():
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "convergence.py"), "--unit", "sgd,8,1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        "convergence.py: error: --unit takes RULE,WORKERS,SEED (workers 1 or more), got 'sgd,8,1'; rules: "
        + ", ".join(units.STUDY_RULES)
    )


def test_report_mode_writes_the_tables_from_the_data_file(tmp_path):
    data, out = tmp_path / "units.jsonl", tmp_path / "report.md"
    for rec in study(2).values():
        units.append(data, rec)
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "convergence.py"), "--report", "--data", str(data)]
        + ["--report-out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"wrote {out} from 16 recorded unit(s)"
    text = out.read_text()
    assert "| diloco | 2/10 |" in text and "- 8 worker(s): seeds 2-9 of every rule" not in text
    assert "- 8 worker(s): downpour-warm seeds 0-9" in text
