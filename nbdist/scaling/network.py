"""Where the ranks run: nodes of some cores, and the network between them.

Within a node the model uses what the probe measured (shared memory). Between nodes it
uses what the probe measured there when the job's ranks span several nodes, else a named
preset: on one node the network between nodes is an assumption the user names
(`--network ib-hdr`). A preset's numbers are
the link's nominal figures (latency of one small MPI message, bandwidth MPI reaches on a
large one, about 90% of the line rate), not measurements: the docs page says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nbdist.specs import unknown_name

__all__ = ["Network", "NETWORKS", "DEFAULT_NETWORK", "MEASURED", "network", "measured_network", "Machine"]


@dataclass(frozen=True, slots=True)
class Network:
    """A link between nodes: `latency_s` per message, `bandwidth` in bytes per second."""

    name: str
    latency_s: float
    bandwidth: float
    help: str

    @property
    def beta_s(self) -> float:
        """Seconds per byte."""
        return 1.0 / self.bandwidth


_GB = 1e9
NETWORKS: dict[str, Network] = {
    n.name: n
    for n in (
        Network("ib-ndr", 1.0e-6, 45 * _GB, "InfiniBand NDR, 400 Gb/s"),
        Network("ib-hdr", 1.3e-6, 22.5 * _GB, "InfiniBand HDR, 200 Gb/s"),
        Network("ib-edr", 1.5e-6, 11.2 * _GB, "InfiniBand EDR, 100 Gb/s"),
        Network("slingshot", 2.0e-6, 22.5 * _GB, "HPE Slingshot, 200 Gb/s"),
        Network("ethernet-100g", 5.0e-6, 11.2 * _GB, "100 Gb/s Ethernet with RoCE"),
        Network("ethernet-25g", 20e-6, 2.8 * _GB, "25 Gb/s Ethernet, TCP"),
        Network("ethernet-10g", 30e-6, 1.12 * _GB, "10 Gb/s Ethernet, TCP"),
        Network("ethernet-1g", 50e-6, 0.112 * _GB, "1 Gb/s Ethernet, TCP"),
    )
}
DEFAULT_NETWORK = "ib-hdr"
MEASURED = "measured"  # --network's name for what the calibration measured between nodes


def network(name: str | Network) -> Network:
    """The preset of that name (a Network as it is), or one error listing the presets."""
    if isinstance(name, Network):
        return name
    try:
        return NETWORKS[name]
    except KeyError:
        raise unknown_name("network preset", name, list(NETWORKS)) from None


def measured_network(alpha_s: float, beta_s: float) -> Network:
    """The link the calibration measured between two of the job's nodes (a ping-pong fitted
    to alpha + bytes x beta), for predictions on more of the same nodes."""
    return Network(MEASURED, alpha_s, 1.0 / beta_s, "measured between two of the job's nodes")


@dataclass(frozen=True, slots=True)
class Machine:
    """Nodes of `cores` cores each, joined by `net`.

    `nodes=None`: as many nodes as the ranks need at one rank per core (a prediction for an
    allocation of whole nodes). `nodes=1`: every rank on this one node, more ranks than
    cores sharing them (the points a sweep measures here). On a node shared with other
    processes, `cores` is what they leave (a fraction too) and `physical` the node's own."""

    cores: float
    net: Network
    nodes: int | None = None
    physical: int | None = None  # the node's own cores, where `cores` is what the ranks get of them

    @property
    def own_cores(self) -> int:
        """The node's cores: what decides whether waiting ranks poll or sleep, and how many
        compute at once (where `cores` counts only the share other processes leave)."""
        return self.physical if self.physical is not None else int(self.cores)

    def sleeps(self, ranks: int) -> bool:
        """Whether the ranks wait by sleeping between polls (more of them than the node's
        cores: --busy-poll auto)."""
        return self.ranks_per_node(ranks) > self.own_cores

    def nodes_for(self, ranks: int) -> int:
        return self.nodes if self.nodes is not None else max(1, math.ceil(ranks / self.own_cores))

    def ranks_per_node(self, ranks: int) -> int:
        """The most ranks any node holds (ranks fill the nodes one after the other)."""
        return math.ceil(ranks / self.nodes_for(ranks))

    def cores_for(self, ranks: int) -> int:
        """The cores the ranks have between them."""
        if self.nodes is None:
            return min(ranks, int(self.nodes_for(ranks) * self.cores))
        return self.nodes * self.own_cores

    def oversubscribed(self, ranks: int) -> bool:
        return self.ranks_per_node(ranks) > self.cores

    def node_of(self, rank: int, ranks: int) -> int:
        return rank // self.ranks_per_node(ranks)

    def describe(self) -> str:
        where = "one node" if self.nodes == 1 else f"{self.nodes} nodes" if self.nodes else "nodes"
        return f"{where} of {self.cores:g} cores, {self.net.name} between nodes"
