"""A real SLURM on this machine, for the tests: Debian's `munged`, `slurmctld` and
`slurmd` (`apt-get install slurm-wlm munge`), every file of theirs under one temporary
directory and every daemon in the foreground as a child of the test process.

Two nodes where this machine lets root make a network namespace (`ip netns add`): the
first node is this machine's root namespace, the second a namespace of its own (own
hostname too, `unshare --uts`, so Open MPI's daemons tell the nodes apart) joined to the
first by a veth pair on a private /24 (`addresses`, `subnet`). Partition `debug` (the
default) is the first node alone, partition `two` both nodes; munged's Unix socket is
shared through the file system. Without network namespaces, one node (`two_nodes` False).

The node declares more CPUs than the machine has (`SlurmdParameters=config_overrides`)
and its partition oversubscribes them, so a 4-task job fits on a 2-core box. munged gets
its own key and socket (slurm.conf's `AuthInfo=socket=...`), so no system-wide munge is
needed or disturbed; the ports are free ones picked at start.

    with SlurmCluster(tmp_dir) as slurm:
        job = slurm.sbatch(script)
        slurm.wait_job(job, timeout=120)   # scontrol's JobState, ExitCode, ...
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil

from nbdist.watchdog import take_down

__all__ = ["SlurmCluster", "SlurmMissing", "slurm_missing", "wait_for"]

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "sinfo", "squeue", "scancel", "munge", "unmunge")
INSTALL = "apt-get install slurm-wlm munge"
NETNS_TOOLS = ("ip", "nsenter", "unshare")
KILL_WAIT = 30

# States a job leaves the queue in (scontrol's JobState).
FINISHED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}


class SlurmMissing(RuntimeError):
    pass


def slurm_missing() -> str | None:
    """What is missing to start a SLURM here (and how to install it), or None."""
    absent = [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name) is None]
    if absent:
        return f"SLURM is not installed ({', '.join(absent)} missing): {INSTALL}"
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _free_subnet() -> ipaddress.IPv4Network:
    """A private /24 that no interface here is on (other test runs make theirs too)."""
    taken = {
        ipaddress.ip_interface(f"{a.address}/{a.netmask}").network
        for addresses in psutil.net_if_addrs().values()
        for a in addresses
        if a.family == socket.AF_INET
    }
    for third in [os.getpid() % 200 + offset for offset in range(50)]:
        subnet = ipaddress.ip_network(f"10.77.{third % 250}.0/24")
        if not any(subnet.overlaps(other) for other in taken):
            return subnet
    raise RuntimeError(f"no free 10.77.x.0/24 subnet for the second node: {sorted(map(str, taken))}")


def _remove_orphaned_namespaces() -> None:
    """Namespaces (and their veth pairs) of test runs that were killed before they stopped
    their cluster: `nbd<pid>` whose process is gone. Those of running tests stay."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for name in (line.split()[0] for line in listed.splitlines() if line.strip()):
        if name.startswith("nbd") and name[3:].isdigit() and not psutil.pid_exists(int(name[3:])):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def wait_for(condition, timeout: float, what: str, describe=lambda: ""):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:.0f} s\n{describe()}")
        time.sleep(0.2)


def _described(process: psutil.Process) -> str:
    """The process, with when it started and its parent: a stray found at the end of the
    module is matched to the test that started it by its start time."""
    try:
        started = time.strftime("%H:%M:%S", time.localtime(process.create_time()))
        return f"pid {process.pid} (started {started}, parent {process.ppid()}): {' '.join(process.cmdline())[:400]}"
    except psutil.Error:
        return f"pid {process.pid} (gone)"


class SlurmCluster:
    """SLURM nodes of `cpus` CPUs declared each: partition `debug` (the first node) and,
    where network namespaces can be made here and `two_nodes`, partition `two` (both)."""

    partition = "debug"
    two_node_partition = "two"

    def __init__(self, root: Path, *, cpus: int = 8, memory_mb: int = 20000, two_nodes: bool = True):
        self.root = Path(root)
        self.cpus = cpus
        self.memory_mb = memory_mb
        self.node = socket.gethostname().split(".")[0]
        self.nodes = [self.node]
        self.second_node = f"{self.node}-ns2"  # in self.nodes once it runs
        self.addresses = {self.node: "127.0.0.1"}  # NodeAddr of each node
        self.subnet: ipaddress.IPv4Network | None = None
        self.netns: str | None = None
        # Why there is one node only (None with two).
        self.one_node_why: str | None = "two_nodes=False" if not two_nodes else None
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.daemons: dict[str, subprocess.Popen] = {}
        self._logs: list = []

    @property
    def two_nodes(self) -> bool:
        return len(self.nodes) == 2

    @property
    def interface(self) -> str | None:
        """The network interface between the two nodes, of one name on both (None on one node)."""
        return self.netns

    # ---------------------------------------------------------------- environment
    @property
    def env(self) -> dict[str, str]:
        """os.environ with SLURM_CONF pointing at this cluster (for sbatch & co)."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        for key in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            del env[key]  # a test run inside a real allocation must not leak its job into ours
        return env

    def command(self, *argv: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}{done.stderr}\n{self.logs()}")
        return done

    # ---------------------------------------------------------------- start / stop
    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 60) -> None:
        missing = slurm_missing()
        if missing:
            raise SlurmMissing(missing)
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        for node in (self.node, self.second_node):
            (self.root / "spool" / node).mkdir(exist_ok=True)
        # munged checks that nobody else can write where its socket and key live.
        os.chmod(self.root, 0o755)
        os.chmod(self.root / "munge", 0o700)
        self._start_munged(timeout)
        if self.one_node_why is None:
            self._make_second_node()
        self._write_conf()
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        wait_for(
            lambda: self.command("scontrol", "ping", check=False, timeout=10).stdout.count("UP"),
            timeout,
            "slurmctld answering scontrol ping",
            self.logs,
        )
        self._spawn(f"slurmd-{self.node}", ["slurmd", "-D", "-N", self.node, "-f", str(self.conf)])
        if self.two_nodes:
            second = self.nodes[1]
            # Its own network namespace and hostname; `hostname` inside the new UTS
            # namespace only, then slurmd in its place (the script's arguments are ours).
            # nsenter, not `ip netns exec`: that remounts /sys, and slurmd wants the cgroup mount.
            self._spawn(
                f"slurmd-{second}",
                [
                    "nsenter",
                    f"--net=/run/netns/{self.netns}",
                    "unshare",
                    "--uts",
                    "sh",
                    "-c",
                    'hostname "$0" && exec "$@"',
                    second,
                    "slurmd",
                    "-D",
                    "-N",
                    second,
                    "-f",
                    str(self.conf),
                ],
            )
        wait_for(self._nodes_idle, timeout, f"idle nodes {', '.join(self.nodes)} in sinfo", self.logs)

    def _make_second_node(self) -> None:
        """A network namespace joined to this one by a veth pair; on failure, one node and
        the reason in `one_node_why`."""
        absent = [tool for tool in NETNS_TOOLS if shutil.which(tool) is None]
        if absent:
            self.one_node_why = f"{', '.join(absent)} missing (apt-get install iproute2 util-linux)"
            return
        _remove_orphaned_namespaces()
        netns = f"nbd{os.getpid()}"
        subnet = _free_subnet()
        first, second = (str(subnet.network_address + i) for i in (1, 2))
        # Both ends of the veth pair have one name, as a cluster's nodes have (ib0 on each):
        # what --interface names is the same on both nodes.
        steps = [
            ["ip", "netns", "add", netns],
            ["ip", "link", "add", netns, "type", "veth", "peer", "name", netns, "netns", netns],
            ["ip", "addr", "add", f"{first}/{subnet.prefixlen}", "dev", netns],
            ["ip", "link", "set", netns, "up"],
            ["ip", "-n", netns, "addr", "add", f"{second}/{subnet.prefixlen}", "dev", netns],
            ["ip", "-n", netns, "link", "set", netns, "up"],
            ["ip", "-n", netns, "link", "set", "lo", "up"],
        ]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                self.one_node_why = f"`{' '.join(step)}` exited {done.returncode}: {done.stderr.strip()}"
                self.netns = netns if step is not steps[0] else None
                self._remove_second_node()
                return
        self.netns, self.subnet = netns, subnet  # netns is also the name of the interface between the nodes
        self.nodes.append(self.second_node)
        self.addresses = dict(zip(self.nodes, (first, second), strict=True))

    def _remove_second_node(self) -> None:
        if self.netns is not None:
            # Deleting the namespace deletes the veth pair with it.
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, timeout=30)
            self.netns = None

    def _start_munged(self, timeout: float) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o400)
        munge = self.root / "munge"
        # --force: munged refuses to run as root without it.
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--seed-file={munge / 'munged.seed'}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
            ],
        )

        def credential_round_trips() -> bool:
            encoded = subprocess.run(["munge", "-n", "-S", str(self.munge_socket)], capture_output=True, timeout=10)
            if encoded.returncode != 0:
                return False
            decoded = subprocess.run(
                ["unmunge", "-S", str(self.munge_socket)], input=encoded.stdout, capture_output=True, timeout=10
            )
            return decoded.returncode == 0 and b"Success" in decoded.stdout

        wait_for(credential_round_trips, timeout, "munge credential round trip", self.logs)

    def _write_conf(self) -> None:
        root = self.root
        lines = [
            "ClusterName=nbdist-test",
            # An address, so no name service is needed; the second node reaches it on the veth.
            f"SlurmctldHost={self.node}({self.addresses[self.node]})",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "ReturnToService=2",
            # Finished jobs stay visible to scontrol for the tests to read their state.
            "MinJobAge=3600",
            # SIGTERM at a job's end, SIGKILL this long after (SLURM's default): time for a
            # run's final checkpoint, and the bound on a process that does not leave.
            f"KillWait={KILL_WAIT}",
            f"StateSaveLocation={root / 'state'}",
            # %n: the node's name, for two slurmd on one machine.
            f"SlurmdSpoolDir={root / 'spool' / '%n'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log' / 'slurmd-%n.log'}",
            "SlurmdParameters=config_overrides",  # more CPUs than the machine has
            *[
                f"NodeName={node} NodeAddr={address} CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN"
                for node, address in self.addresses.items()
            ],
            f"PartitionName={self.partition} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=FORCE:4",
        ]
        if self.two_nodes:
            lines.append(
                f"PartitionName={self.two_node_partition} Nodes={','.join(self.nodes)} MaxTime=INFINITE "
                "State=UP OverSubscribe=FORCE:4"
            )
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.root / "log" / f"{name}.out", "w")
        self._logs.append(out)
        self.daemons[name] = subprocess.Popen(
            argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )

    def _nodes_idle(self) -> bool:
        for name, daemon in self.daemons.items():
            if daemon.poll() is not None:
                raise RuntimeError(f"{name} exited {daemon.returncode}\n{self.logs()}")
        states = self.command("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=10).stdout.split("\n")
        return {line.split()[0]: line.split()[1] for line in states if line.strip()} == dict.fromkeys(
            self.nodes, "idle"
        )

    def stop(self, timeout: float = 30) -> list[str]:
        """Cancel every job, stop every daemon this cluster started (slurmd, slurmctld, then
        munged) and kill any process of its jobs still there; returns what had to be killed
        after the daemons stopped or is still alive (nothing, when all went well)."""
        self._cancel_jobs(timeout)
        for name in (*[f"slurmd-{node}" for node in self.nodes], "slurmctld", "munged"):
            daemon = self.daemons.get(name)
            if daemon is None or daemon.poll() is not None:
                continue
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait(timeout=timeout)
        strays = self._job_processes()
        said = [f"{_described(p)}, killed after the daemons stopped" for p in strays]
        take_down(strays, grace=5)
        self._remove_second_node()
        for log in self._logs:
            log.close()
        self._logs.clear()
        return said + self.left_over()

    def _cancel_jobs(self, timeout: float) -> None:
        ctld = self.daemons.get("slurmctld")
        if ctld is None or ctld.poll() is not None:
            return
        queued = self.command("squeue", "-h", "-o", "%i", check=False, timeout=10).stdout.split()
        if not queued:
            return
        # At once: the tests are over, nobody waits for a final checkpoint.
        self.command("scancel", "--full", "--signal=KILL", *queued, check=False, timeout=10)
        self.command("scancel", *queued, check=False, timeout=10)
        try:
            wait_for(
                lambda: not self.command("squeue", "-h", "-o", "%i", check=False, timeout=10).stdout.split(),
                timeout,
                "empty queue after scancel",
            )
        except TimeoutError:
            pass  # what is left is killed below and reported

    def left_over(self) -> list[str]:
        """The daemons of this cluster and processes of its jobs still alive."""
        alive = [f"{name} (pid {d.pid})" for name, d in self.daemons.items() if d.poll() is None]
        return alive + [_described(p) for p in self._job_processes()]

    def _job_processes(self) -> list[psutil.Process]:
        """Running processes of this cluster's jobs: slurmstepd (it detaches from slurmd)
        writing to our logs, and whatever has our SLURM_CONF in its environment (job
        scripts inherit it from sbatch)."""
        found = []
        for process in psutil.process_iter(["name", "status"]):
            try:
                if process.info["status"] == psutil.STATUS_ZOMBIE or process.pid == os.getpid():
                    continue
                if process.info["name"] == "slurmstepd":
                    if any(f.path.startswith(str(self.root)) for f in process.open_files()):
                        found.append(process)
                elif process.environ().get("SLURM_CONF") == str(self.conf):
                    found.append(process)
            except psutil.Error:
                continue
        return found

    def logs(self) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(errors="replace")
            parts.append(f"--- {path.name} (last 3000 characters)\n{text[-3000:]}")
        return "\n".join(parts)

    # ---------------------------------------------------------------- jobs
    def sbatch(self, script: Path, *options: str, cwd: Path | None = None) -> str:
        """Submit `script`; returns the job id."""
        done = subprocess.run(
            ["sbatch", "--parsable", *options, str(script)],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
            cwd=cwd,
        )
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {script} exited {done.returncode}:\n{done.stdout}{done.stderr}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """scontrol's fields of a job (JobState, ExitCode, StdOut, ...)."""
        text = self.command("scontrol", "show", "job", "-o", job_id).stdout
        fields = {}
        for item in text.split():
            key, _, value = item.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait_job(self, job_id: str, timeout: float, *, states=FINISHED) -> dict[str, str]:
        """Wait until the job is in one of `states` (default: finished); its fields."""
        fields: dict[str, str] = {}

        def reached() -> bool:
            fields.update(self.job(job_id))
            return fields.get("JobState") in states

        wait_for(reached, timeout, f"job {job_id} in {sorted(states)}", lambda: f"{fields}\n{self.logs()}")
        return fields
