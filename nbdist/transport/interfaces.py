"""Where a job talks between its hosts: whether its launch spans several, and this host's
address on the network interface it was told to use. Without MPI (the notebook's kernel
imports it to place the ipyparallel controller), so that importing it starts no MPI."""

from __future__ import annotations

import ipaddress
import os
import socket

import psutil

from nbdist.errors import UserError

__all__ = ["INTERFACE_VARIABLE", "interface_address", "job_interface", "launch_spans_hosts"]

# How many ranks of the launch share this node, and how many there are (Open MPI's
# mpiexec says so); how many nodes the step or the allocation has (srun, sbatch).
LOCAL_SIZE_VARIABLE = "OMPI_COMM_WORLD_LOCAL_SIZE"
WORLD_SIZE_VARIABLE = "OMPI_COMM_WORLD_SIZE"
NODES_VARIABLES = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES")
# The interface between the nodes (launch --interface, or mpiexec --mca btl_tcp_if_include):
# Open MPI hands its MCA parameters to every rank, on every node, in this variable.
INTERFACE_VARIABLE = "OMPI_MCA_btl_tcp_if_include"


def launch_spans_hosts() -> bool:
    """Whether the ranks of this launch run on more than one host, as the launcher says
    (Open MPI: fewer ranks on this node than in all; srun: its node count)."""
    local, size = os.environ.get(LOCAL_SIZE_VARIABLE, ""), os.environ.get(WORLD_SIZE_VARIABLE, "")
    if local.isdigit() and size.isdigit():
        return int(local) < int(size)
    nodes = next((os.environ[v] for v in NODES_VARIABLES if os.environ.get(v, "").isdigit()), "1")
    return int(nodes) > 1


def job_interface() -> str | None:
    """The interface (or subnet) the job's ranks were told to talk over, if any: the first
    of Open MPI's list."""
    given = os.environ.get(INTERFACE_VARIABLE, "").split(",")[0].strip()
    return given or None


def interface_address(interface: str, error: type[UserError] = UserError) -> str:
    """This host's IPv4 address on a network interface (eth0, ib0, ...) or inside a subnet
    (10.1.0.0/16: Open MPI's if_include takes either); `error` says why there is none."""
    interfaces = psutil.net_if_addrs()
    names = ", ".join(sorted(interfaces))
    if "/" in interface:
        try:
            subnet = ipaddress.ip_network(interface, strict=False)
        except ValueError:
            raise error(f"{interface!r} is neither a network interface nor a subnet such as 10.1.0.0/16") from None
        for addresses in interfaces.values():
            for address in addresses:
                if address.family == socket.AF_INET and ipaddress.ip_address(address.address) in subnet:
                    return address.address
        raise error(f"no address of this host ({socket.gethostname()}) is in the subnet {interface}")
    if interface not in interfaces:
        raise error(f"no network interface {interface!r} on this host; choose one of: {names}")
    for address in interfaces[interface]:
        if address.family == socket.AF_INET:
            return address.address
    raise error(f"network interface {interface!r} has no IPv4 address; choose another of: {names}")
