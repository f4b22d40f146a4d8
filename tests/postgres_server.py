"""A real PostgreSQL server for the tests: Debian's `postgresql` package, a fresh cluster
in a temporary directory, listening on 127.0.0.1 on a free port with password
authentication (scram), started by `pg_ctl` and stopped (and checked gone) at the end.

As root the server runs as the `postgres` user the package creates (PostgreSQL refuses
to run as root); as anyone else, as that user.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

INSTALL = "apt-get install postgresql (.ci/run does)"
USER, PASSWORD = "nbdist", "s3cret-pw"
START_SECONDS = 60


def _binaries() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


def missing(why: str) -> None:
    """Skip here; fail under CI, which installs everything the tests need."""
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


@dataclass
class Server:
    port: int
    root: Path
    data: Path
    bin: Path
    as_user: list[str]

    def url(self, database: str, *, password: bool = True) -> str:
        secret = f":{PASSWORD}" if password else ""
        return f"postgresql://{USER}{secret}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')  # a test's own constant name
        return self.url(name)

    def pid(self) -> int | None:
        pidfile = self.data / "postmaster.pid"
        return int(pidfile.read_text().split()[0]) if pidfile.exists() else None

    def start(self) -> None:
        """Start the server on its data directory (again) and wait until it answers."""
        log = self.root / "server.log"
        options = f"-p {self.port} -k {self.root / 'sockets'} -c listen_addresses=127.0.0.1 -c fsync=off"
        started = subprocess.run(
            [
                *self.as_user,
                str(self.bin / "pg_ctl"),
                "-D",
                str(self.data),
                "-l",
                str(log),
                "-w",
                "-t",
                str(START_SECONDS),
                "-o",
                options,
                "start",
            ],
            capture_output=True,
            text=True,
            timeout=START_SECONDS + 30,
        )
        assert started.returncode == 0, started.stdout + started.stderr + (log.read_text() if log.exists() else "")
        _wait_ready(self)

    def halt(self) -> None:
        """Stop the server, keeping its data (start() brings it back), and wait it out."""
        pid = self.pid()
        subprocess.run(
            [*self.as_user, str(self.bin / "pg_ctl"), "-D", str(self.data), "stop", "-m", "fast", "-w", "-t", "30"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if pid is not None:
            deadline = time.monotonic() + 30
            while _alive(pid):
                assert time.monotonic() < deadline, f"the PostgreSQL server (pid {pid}) did not stop"
                time.sleep(0.1)

    def stop(self) -> None:
        self.halt()
        shutil.rmtree(self.root, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start() -> Server:
    """A running server, or a skip (a fail under CI) saying how to install one."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        missing("psycopg is not installed: pip install 'nbdist[postgresql]'")
    binaries = _binaries()
    if binaries is None:
        missing(f"PostgreSQL is not installed: {INSTALL}")
    as_user: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="nbdist-pg-"))
    if os.geteuid() == 0:
        import pwd

        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            missing(f"PostgreSQL's 'postgres' user is missing: {INSTALL}")
        os.chown(root, owner.pw_uid, owner.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, sockets = root / "data", root / "sockets"
    pwfile = root / "pw"
    pwfile.write_text(PASSWORD + "\n")
    if as_user:
        os.chown(pwfile, owner.pw_uid, owner.pw_gid)
    made = subprocess.run(
        [
            *as_user,
            str(binaries / "initdb"),
            "-D",
            str(data),
            "-U",
            USER,
            f"--pwfile={pwfile}",
            "--auth=scram-sha-256",
            "--no-sync",
            "-E",
            "UTF8",
            "--locale=C.UTF-8",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    subprocess.run([*as_user, "mkdir", str(sockets)], check=True, timeout=30)
    server = Server(_free_port(), root, data, binaries, as_user)
    server.start()
    return server


def _wait_ready(server: Server) -> None:
    import psycopg

    deadline = time.monotonic() + START_SECONDS
    while True:
        try:
            psycopg.connect(server.url("postgres"), connect_timeout=5).close()
            return
        except psycopg.OperationalError as exc:
            if time.monotonic() > deadline:
                server.stop()
                raise AssertionError(f"PostgreSQL did not accept connections in {START_SECONDS}s: {exc}") from None
            time.sleep(0.2)
