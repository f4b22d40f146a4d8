"""DynSGD: staleness-dependent learning rate (Jiang, Cui, Zhang & Yu, "Heterogeneity-aware
Distributed Parameter Servers", SIGMOD 2017); dist-keras implements it as
`DynSGDParameterServer` (github.com/cerndb/dist-keras, distkeras/parameter_servers.py).

The master scales each update by how stale it is, so that an update computed from a
centre many versions old counts for less:

    centre  <- centre + update / (1 + staleness)

staleness being the number of updates the master applied between the worker's pull and
this update. The workers are ADAG's (nbdist.algorithms.adag): `sync_every` local steps
with their own optimiser, then the displacement since the pull normalised by the window,
(x_local - x_pulled) / sync_every. (dist-keras' DynSGDWorker sends the displacement
without dividing it; normalised, `--sync-every` does not change the step size, and
DynSGD differs from ADAG in the discount alone: ADAG's `discount_stale`, always set.) A
synchronous round is never stale: it adds the sample-weighted mean of its updates, as ADAG
does.
"""

from __future__ import annotations

from nbdist.algorithms.adag import ADAG
from nbdist.algorithms.base import RULES


@RULES.register
class DynSGD(ADAG):
    """ADAG's workers; the master divides each update by 1 + its staleness (Jiang et al.
    2017)."""

    name = "dynsgd"
    # Its updates are rescaled by staleness: at 8 workers on the jet images it did not
    # collapse where ADAG did (bench/results/2026-11-24-convergence.md), so no warning for
    # its momentum.
    centre_takes_worker_steps = False
    auto_stale_discount = False  # it always discounts
    discount_stale = True
