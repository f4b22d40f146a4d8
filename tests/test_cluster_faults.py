"""A notebook kernel's cluster when things die: a real IPython kernel (jupyter_client), a
real cluster of MPI engines started from it, kill -9 of an engine during a job, then of
the kernel itself.

The engines run with Open MPI's fault tolerance on (ULFM: a dead rank no longer makes
mpiexec end the others), as `nbdist.launch.mpi_env()` is to set it: the cluster is then
left with live engines beside the dead one, the case that status and the job's error must
tell apart."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

pytest.importorskip("ipyparallel")
jupyter_client = pytest.importorskip("jupyter_client")
import psutil  # noqa: E402
from conftest import ROOT, listening  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]


class Kernel:
    """A kernel that runs cells and hands back what they printed, or their error."""

    def __init__(self, manager, client):
        self.manager, self.client = manager, client

    @property
    def pid(self) -> int:
        return self.manager.provisioner.process.pid

    def run(self, code: str, timeout: float = 180) -> str:
        out: list[str] = []

        def collect(msg):
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                out.append(f"{msg['content']['ename']}: {msg['content']['evalue']}\n")

        self.client.execute_interactive(code, timeout=timeout, output_hook=collect)
        return "".join(out)

    def value(self, expression: str):
        out = self.run(f"import json\nprint(json.dumps({expression}))")
        assert not out.startswith(("NameError", "AttributeError")), out
        return json.loads(out.strip().splitlines()[-1])


def _an_interface() -> tuple[str, str]:
    """A non-loopback interface with an IPv4 address (the multi-node case), else loopback."""
    import socket

    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return name, address.address
    return "lo", "127.0.0.1"


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    # ipykernel's own kernel spec: this interpreter, `python -m ipykernel_launcher`.
    manager = jupyter_client.KernelManager(kernel_name="python3")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    manager.start_kernel(env=env, cwd=str(tmp_path_factory.mktemp("kernel")))
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        yield Kernel(manager, client)
    finally:
        client.stop_channels()
        if manager.is_alive():
            manager.shutdown_kernel(now=True)
        manager.cleanup_resources()


@pytest.fixture(scope="module")
def cluster_in_kernel(kernel):
    """The cluster, started by `%distnn cluster start` in the kernel, on a named interface."""
    interface, address = _an_interface()
    out = kernel.run(f"import nbdist\n%load_ext nbdist\n%distnn cluster start -n 2 --interface {interface}")
    assert f"controller on {address}" in out, out
    return address


def test_a_dead_engine_ends_the_job_naming_its_rank_and_host(kernel, cluster_in_kernel, tmp_path):
    controller = psutil.Process(kernel.value("nbdist.cluster.current_cluster()._ipp.controller.pid"))
    # The controller listens where the user said (and on loopback, between its own
    # processes), nowhere else: not on every interface.
    sockets = listening([controller, *controller.children(recursive=True)])
    assert cluster_in_kernel in {ip for ip, _ in sockets} <= {cluster_in_kernel, "127.0.0.1"}, sockets

    engines = kernel.value("[[i.rank, i.engine_id, i.host, i.pid] for i in nbdist.cluster.current_cluster().info]")
    kernel.run(
        f"job = nbdist.train('{ROOT}/examples/digits_mlp.py', cluster=nbdist.cluster.current_cluster(), "
        f"epochs=5000, quiet=True, runs_dir={str(tmp_path)!r})"
    )
    deadline = time.monotonic() + 120
    while not kernel.value("len(job.records)"):
        assert time.monotonic() < deadline, "the job never streamed a record"
        time.sleep(0.5)
    rank, engine_id, host, pid = engines[1]
    os.kill(pid, signal.SIGKILL)
    out = kernel.run("job.wait(60)")
    # The job ended (wait raised its error, no TimeoutError), led by the rank that died,
    # though the survivors' MPI calls failed on it first.
    assert out.startswith(f"JobError: rank 1 (engine {engine_id} on {host}, pid {pid}) died: its process is gone"), out
    assert "%distnn cluster start" in out
    status = kernel.run("%distnn cluster status")
    rows = {line.split()[0]: line for line in status.splitlines() if line.startswith("     ")}
    assert rows["1"].rstrip().endswith("dead: its process is gone"), status
    assert rows["0"].rstrip().endswith("alive"), status  # its survivor, still an engine of the cluster
    assert "1 of 2 engines dead (rank 1): heal the cluster with  %distnn cluster start" in status


def test_a_kernel_that_dies_takes_its_cluster_with_it(kernel, cluster_in_kernel):
    cluster_file = kernel.value("nbdist.cluster.current_cluster()._ipp.cluster_file")
    processes = psutil.Process(kernel.pid).children(recursive=True)
    names = {" ".join(p.cmdline()[1:3]) for p in processes}
    assert {"-m ipyparallel.controller", "-m ipyparallel.engine"} <= names and os.path.exists(cluster_file), names
    os.kill(kernel.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:
        left = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, [(p.pid, p.cmdline()) for p in left]  # controller, mpiexec, engines, nannies, watchdogs
    assert not os.path.exists(cluster_file)  # ipcluster list does not show a cluster that is gone
