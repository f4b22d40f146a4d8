"""How a process starts MPI (nbdist/transport/start.py): a process on its own takes only
self and shared memory for its MPI_Init, keeps a user's choice, and passes neither on;
a launched rank is left to its launcher's settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nbdist.transport import start

pytest.importorskip("mpi4py")

OPENED = "components_open: found loaded component "

CHECK = """
import json, os, subprocess, sys
from nbdist.transport.start import start_mpi, world_rank
rank_before = world_rank()
asked_mpi = "mpi4py.MPI" in sys.modules
start_mpi()
from mpi4py import MPI
child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('OMPI_MCA_btl'))"],
                       capture_output=True, text=True).stdout.strip()
print(json.dumps({"rank_before": rank_before, "asked_mpi": asked_mpi, "size": MPI.COMM_WORLD.Get_size(),
                  "here": os.environ.get("OMPI_MCA_btl"), "child": child}))
"""


def _singleton(**env: str) -> tuple[dict, set[str]]:
    """CHECK in a fresh Python that no launcher started: its figures, and the transports
    (btl components) its MPI_Init opened, from Open MPI's own log."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    clean.update(OMPI_MCA_btl_base_verbose="100", **env)
    done = subprocess.run([sys.executable, "-c", CHECK], env=clean, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    said = done.stdout + done.stderr
    opened = {line.split(OPENED, 1)[1].split()[0] for line in said.splitlines() if OPENED in line}
    return figures, opened


def test_a_process_on_its_own_opens_only_self_and_shared_memory_and_passes_nothing_on():
    figures, opened = _singleton()
    assert opened == {"self", "sm"}  # not libfabric's (ofi), which probes the network
    assert figures["size"] == 1
    assert figures["here"] is None and figures["child"] == "None"
    # Its rank needs no MPI: rank 0, and nothing initialised for the asking.
    assert figures["rank_before"] == 0 and figures["asked_mpi"] is False


def test_a_users_choice_of_transports_is_kept():
    figures, opened = _singleton(OMPI_MCA_btl="self")
    assert opened == {"self"}
    assert figures["here"] == "self" and figures["child"] == "self"


@pytest.mark.parametrize("variable", start.LAUNCHER_VARIABLES)
def test_a_launched_rank_is_known_by_its_launchers_variables(monkeypatch, variable):
    for name in start.LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert not start.launched()
    monkeypatch.setenv(variable, "0")
    assert start.launched()
