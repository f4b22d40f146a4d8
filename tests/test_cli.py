"""The command line as a user meets it: layout trees, help, and the demo end to end."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest


def test_layout_tree_prints_roles_and_ranks(pyrun):
    out = pyrun(["-m", "nbdist", "layout", "--workers", "2", "--masters", "2"], timeout=60)
    assert out.returncode == 0, out.output
    assert "6 ranks" in out.stdout
    assert re.search(r"master 0 \[top master\]\s+rank 0", out.stdout)
    assert re.search(r"master 1 \[sub-master\]\s+rank 3", out.stdout)
    assert len(re.findall(r"worker \d", out.stdout)) == 4


def test_layout_from_rank_count_and_json(pyrun):
    out = pyrun(["-m", "nbdist", "layout", "--ranks", "5", "--json"], timeout=60)
    assert out.returncode == 0, out.output
    tree = json.loads(out.stdout)
    assert tree["n_ranks"] == 5
    assert tree["options"]["workers"] == 4


def test_layout_rank_count_that_does_not_fit(pyrun):
    out = pyrun(["-m", "nbdist", "layout", "--ranks", "5", "--masters", "2"], timeout=60)
    assert out.returncode == 2
    assert "nbdist: error: 5 ranks cannot be laid out" in out.stderr
    assert "Traceback" not in out.output


def test_train_help_lists_every_option(pyrun):
    from dataclasses import fields

    from nbdist.options import TrainOptions

    out = pyrun(["-m", "nbdist", "train", "--help"], timeout=60)
    assert out.returncode == 0
    for f in fields(TrainOptions):
        assert "--" + f.name.replace("_", "-") in out.stdout


@pytest.mark.mpi
def test_demo_runs_every_setup_and_says_where_results_are(pyrun, tmp_path):
    # Each set-up with 2 workers: 8 ranks to start on this small machine instead of 14.
    out = pyrun(["-m", "nbdist.demo", "--epochs", "1", "--workers", "2", "--runs-dir", str(tmp_path)], timeout=300)
    assert out.returncode == 0, out.output
    table = out.stdout.split("=== digits CNN")[-1].split("\n\n")[0]
    rows = [line for line in table.splitlines() if str(tmp_path) in line]
    assert len(rows) == 3
    assert "1 master + 2 workers" in rows[0] and "allreduce, 2 ranks" in rows[2], rows
    assert "=== live dashboard: http://127.0.0.1:" in out.stdout
    for row in rows:
        run_dir = row.split()[-1]
        summary = json.loads(open(f"{run_dir}/summary.json").read())
        assert summary["epochs_run"] == 1
        # One epoch of a CNN on digits is far better than chance (0.1).
        assert summary["final"]["val_acc"] > 0.5
        # Each run's dashboard, as one HTML file, next to its results.
        assert "nbdist-throughput" in open(f"{run_dir}/dashboard.html").read()


# ------------------------------------------------------------------- dashboard input
def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("nbdist: error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_a_mistyped_store_is_an_error_not_a_new_empty_store(tmp_path, capsys):
    from nbdist.cli import main

    typo = tmp_path / "runs" / "nbdist.bd"
    for extra in ([], ["--export", str(tmp_path / "run.html")]):
        assert main(["dashboard", "--store", str(typo), *extra]) == 2
        line = _error_line(capsys)
        assert f"--store {typo}: no such run store" in line and "runs/nbdist.db by default" in line
        assert ("--create" in line) == (not extra)  # a served dashboard may start before the first run
        assert line.endswith("export after a run") == bool(extra)
    assert not typo.exists() and not (tmp_path / "run.html").exists()
    # A directory that holds a store: the store is named.
    from nbdist.store import RunStore

    (tmp_path / "runs").mkdir()  # a store is not made in a directory that does not exist
    RunStore(tmp_path / "runs" / "nbdist.db").close()
    assert main(["dashboard", "--store", str(tmp_path / "runs")]) == 2
    assert f"(it holds one: --store {tmp_path / 'runs' / 'nbdist.db'})" in _error_line(capsys)


@pytest.mark.parametrize("given", [["--token", "seen-in-ps"], ["--token=seen-in-ps"]])
def test_a_token_on_the_command_line_is_refused_with_where_to_put_it(tmp_path, capsys, given):
    from nbdist.cli import main
    from nbdist.store import RunStore

    store = tmp_path / "nbdist.db"
    RunStore(store).close()
    for extra in ([], ["--export", str(tmp_path / "run.html")]):
        assert main(["dashboard", "--store", str(store), *given, *extra]) == 2
        line = _error_line(capsys)
        assert "--token on the command line is visible to every user of this machine (ps)" in line
        assert "NBDIST_DASHBOARD_TOKEN=" in line and "--token-file PATH, chmod 600" in line
        # Not taken for an abbreviation of --token-file.
        assert "seen-in-ps" not in line
    assert not (tmp_path / "run.html").exists()


def test_the_command_line_refuses_a_readable_token_file_before_serving(tmp_path, capsys):
    from nbdist.cli import main
    from nbdist.store import RunStore

    store, token_file = tmp_path / "nbdist.db", tmp_path / "token"
    RunStore(store).close()
    token_file.write_text("seen-by-others")
    token_file.chmod(0o644)
    assert main(["dashboard", "--store", str(store), "--token-file", str(token_file)]) == 2
    assert f"chmod 600 {token_file}" in _error_line(capsys)
    assert main(["dashboard", "--store", str(store), "--unix-socket", str(tmp_path / "s"), "--address", "0.0.0.0"]) == 2
    assert "--unix-socket and --address exclude each other" in _error_line(capsys)


def test_a_study_or_run_not_in_the_store_is_named_with_the_studies_it_holds(tmp_path, capsys):
    from nbdist.cli import main
    from nbdist.store import RunStore

    store = tmp_path / "nbdist.db"
    with RunStore(store) as opened:
        opened.create_study(
            "digits", searcher="random", space="lr=log(1e-3,1)", options={}, objective="val_loss", direction="minimize"
        )
    for extra in ([], ["--export", str(tmp_path / "study.html")]):  # served (before it listens) and exported
        assert main(["dashboard", "--store", str(store), "--study", "digit", "--port", "0", *extra]) == 2
        assert f"no study 'digit' in the store {store} (its studies: digits)" in _error_line(capsys)
        assert main(["dashboard", "--store", str(store), "--run", "nope", "--port", "0", *extra]) == 2
        assert f"no run 'nope' in the store {store}" in _error_line(capsys)
    assert not (tmp_path / "study.html").exists()
    argv = ["study", "--model", "m.py", "--space", "lr=log(1e-3,1)", "--runs-dir", str(tmp_path)]
    assert main([*argv, "--resume-study", "digit"]) == 2  # the same words where a study resumes
    assert f"no study 'digit' in the store {store} (its studies: digits)" in _error_line(capsys)
    # Panel would write study.txt.html instead (readable by others) and leave study.txt empty.
    assert main(["dashboard", "--store", str(store), "--study", "digits", "--export", str(tmp_path / "s.txt")]) == 2
    assert f"--export {tmp_path / 's.txt'}: the dashboard is an HTML page; give a file name ending in .html" in (
        _error_line(capsys)
    )
    assert not list(tmp_path.glob("s.txt*"))


def test_the_dashboard_serves_plain_http_beyond_loopback_only_when_told(tmp_path, capsys):
    from nbdist.cli import main
    from nbdist.dashboard.serve import is_loopback
    from nbdist.store import RunStore

    store = tmp_path / "nbdist.db"
    RunStore(store).close()
    for address in ("0.0.0.0", "::"):
        assert main(["dashboard", "--store", str(store), "--address", address, "--port", "0"]) == 2
        line = _error_line(capsys)
        assert f"--address {address} would serve the dashboard beyond this machine over plain HTTP" in line
        assert "ssh -L 5006:127.0.0.1:5006" in line and "--insecure on a network you trust" in line
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.0.0.2")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.0.2.7") and not is_loopback("no-such-host.invalid")


def test_a_store_password_or_bare_word_is_refused_by_the_dashboard_and_the_import(tmp_path, capsys):
    from nbdist.cli import main

    for command in (["dashboard"], ["dashboard", "--export", str(tmp_path / "x.html")], ["store", "import", "runs/r"]):
        assert main([*command, "--store", "postgresql://me:hunter2@db/nbdist"]) == 2
        line = _error_line(capsys)
        assert "--store postgresql://me:***@db/nbdist holds a password" in line and "hunter2" not in line
        assert main([*command, "--store", "of"]) == 2
        assert "(did you mean 'off'?)" in _error_line(capsys)
    assert not (tmp_path / "x.html").exists() and not Path("of").exists()


@pytest.mark.timeout(120)
def test_a_dashboard_port_in_use_says_so_and_suggests_port_0(tmp_path, capsys):

    from nbdist.cli import main
    from nbdist.store import RunStore

    RunStore(tmp_path / "nbdist.db").close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["dashboard", "--store", str(tmp_path / "nbdist.db"), "--port", str(port)]) == 2
    line = _error_line(capsys)
    assert f"port {port} on 127.0.0.1 is in use" in line and "--port 0 for any free port" in line
