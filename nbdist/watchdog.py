"""Takes a cluster down with the process that started it (a kernel killed with kill -9).

What ipyparallel offers does not cover this. It starts the controller and `mpiexec` each
in a session of its own (so that the kernel's Ctrl-C does not reach them) and stops them
from an atexit hook, which a killed kernel never runs. The engines do exit when the
controller's heartbeats stop, but only after 50 missed beats (about 3 minutes), and the
controller itself has nothing that watches the kernel: it stays, and its engines keep
answering it. Linux's parent-death signal (PR_SET_PDEATHSIG) would need a hook between
fork and exec in ipyparallel's launchers, and fires when the starting *thread* ends,
which for a kernel is not the kernel's death.

So the cluster starts this script beside each process tree it owns (the controller, the
engines' `mpiexec`): a small process in its own session, so that a kill of the kernel's
process group spares it, that looks at the kernel twice a second. When the kernel is
gone (or a zombie nobody reaped), it sends SIGTERM to the tree it watches, SIGKILL to
what is left two seconds later, and exits. It exits quietly once the tree has ended on
its own (a normal stop). Only psutil is imported, so it costs a few MB and no CPU to
speak of; it runs as a script (`python watchdog.py ...`), not through the nbdist package.

    python nbdist/watchdog.py --parent PID:START_TIME --root PID:START_TIME [--root ...] [--remove FILE]
                              [--scancel JOB_ID]

Engines submitted as a SLURM job have no local process to end: `--scancel` cancels their
job instead (with the SLURM configuration of the environment it was started in).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import psutil

POLL_SECONDS = 0.5
# The tree below the roots is listed again this often, so that a process whose parent
# died first (an engine whose mpiexec was killed) is still taken down.
LIST_SECONDS = 2.0
TERM_SECONDS = 2.0


def start(
    parent: psutil.Process, roots: list[psutil.Process], remove: str | None = None, scancel: str | None = None
) -> subprocess.Popen:
    """Start a watchdog that ends `roots` and their descendants when `parent` dies (and
    cancels the SLURM job `scancel`); it leaves quietly when the roots end first."""
    argv = [sys.executable, os.path.abspath(__file__), "--parent", _ident(parent)]
    for root in roots:
        argv += ["--root", _ident(root)]
    if remove:
        argv += ["--remove", remove]
    if scancel:
        argv += ["--scancel", str(scancel)]
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def _ident(process: psutil.Process) -> str:
    # The start time tells a process from a later one that got the same pid.
    return f"{process.pid}:{process.create_time()!r}"


def _process(ident: str) -> psutil.Process | None:
    pid, _, started = ident.partition(":")
    try:
        process = psutil.Process(int(pid))
        if started and abs(process.create_time() - float(started)) > 0.01:
            return None
        return process
    except psutil.Error:
        return None


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _tree(roots: list[psutil.Process]) -> dict[int, psutil.Process]:
    found: dict[int, psutil.Process] = {}
    for root in roots:
        try:
            found.update({p.pid: p for p in [root, *root.children(recursive=True)]})
        except psutil.Error:
            continue
    return found


def take_down(processes: list[psutil.Process], grace: float = TERM_SECONDS) -> None:
    """SIGTERM, then SIGKILL to whatever is left after `grace` seconds."""
    for process in processes:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(processes, timeout=grace)
    for process in left:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=grace)


def _cancel(job: str | None) -> None:
    if job:
        try:
            subprocess.run(
                ["scancel", job],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired):
            pass


def process_groups(leaders: list[int]) -> list[psutil.Process]:
    """The processes of the process groups that `leaders` (pids of processes started in a
    session of their own: ipyparallel's controller, mpiexec) lead, the leaders' own pids
    left out. A child forked while its leader was being stopped, and orphaned by it (one of
    the controller's schedulers), is no longer below the leader but still in its group."""
    groups, found = set(leaders), []
    for process in psutil.process_iter():
        try:
            if process.pid not in groups and process.pid != os.getpid() and os.getpgid(process.pid) in groups:
                found.append(process)
        except (psutil.Error, OSError):
            continue
    return found


def watch(
    parent: psutil.Process, roots: list[psutil.Process], remove: str | None = None, scancel: str | None = None
) -> bool:
    """Until `parent` dies (then take the tree down and return True) or the roots end (False)."""
    known: dict[int, psutil.Process] = {}
    listed = 0.0
    while True:
        # The parent first: a tree that another watchdog took down as the parent died
        # still leaves this one's SLURM job to cancel.
        if _alive(parent) and not any(_alive(r) for r in roots):
            return False
        if time.monotonic() - listed > LIST_SECONDS:
            known.update(_tree(roots))
            known = {pid: p for pid, p in known.items() if _alive(p)}
            listed = time.monotonic()
        if not _alive(parent):
            _cancel(scancel)
            known.update(_tree(roots))
            known.update({p.pid: p for p in process_groups([r.pid for r in roots])})
            take_down([p for p in known.values() if _alive(p)])
            if remove:
                try:
                    os.remove(remove)
                except OSError:
                    pass
            return True
        time.sleep(POLL_SECONDS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="end a process tree when its parent process dies")
    parser.add_argument("--parent", required=True, help="PID:START_TIME of the process to watch")
    parser.add_argument("--root", action="append", default=[], help="PID:START_TIME of a tree to end")
    parser.add_argument("--remove", default=None, help="a file to remove once the tree is down")
    parser.add_argument("--scancel", default=None, help="a SLURM job to cancel when the parent dies")
    args = parser.parse_args(argv)
    roots = [p for p in map(_process, args.root) if p is not None]
    parent = _process(args.parent)
    if not roots:
        return 0
    if parent is None:  # died before we looked
        _cancel(args.scancel)
        take_down(list(_tree(roots).values()))
        return 0
    watch(parent, roots, args.remove, args.scancel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
