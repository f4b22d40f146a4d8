"""ADAG: asynchronous distributed adaptive gradients (J. Hermans, "Distributed Deep
Learning", master's thesis, Maastricht University 2017, chapter "Asynchronous Distributed
Adaptive Gradient"). The update below is that of his reference implementation, dist-keras
(github.com/cerndb/dist-keras): `ADAGWorker` in distkeras/workers.py sends
`(W2 - W1) / communication_window`, and `ADAGParameterServer` in
distkeras/parameter_servers.py does `center_variable + residual`. (The thesis draft in
the project's reference reading names the chapter but leaves it empty.)

Workers take `sync_every` (lambda) local steps with their own optimiser and send the
accumulated displacement normalised by lambda (accumulated gradient normalisation), so
the centre moves by an average step rather than lambda of them. The master adds each
update as it is:

    update   = (x_local - x_pulled) / lambda
    centre  <- centre + update

The normalisation is ADAG's whole answer to staleness: there is no 1/(1 + staleness)
discount (that is DynSGD, nbdist.algorithms.dynsgd). A synchronous round adds the
sample-weighted mean of its updates (one average step, not W of them).

The rule adds the updates as they are unless `discount_stale` is set: then each update
is first scaled by 1 / (1 + staleness), DynSGD's discount. DynSGD always sets it; a run
sets it for ADAG by default from 8 asynchronous workers (the correction
for the momentum asynchrony adds, nbdist.train.asynchrony; `--momentum-correction off`
keeps ADAG as published).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nbdist.algorithms.arrays import Array, zeros_like_buffer
from nbdist.algorithms.base import RULES, Algorithm, RuleState, Update
from nbdist.backends.base import FlatOptimizer


@dataclass(slots=True)
class ADAGWorker(RuleState):
    pulled: Array  # the centre this worker started its window from
    count: int
    sync_every: int


@RULES.register
class ADAG(Algorithm):
    """Workers send their displacement over a window divided by its length; the master
    adds each as it is (Hermans 2017, dist-keras)."""

    name = "adag"
    one_worker_is_plain_training = True
    carries_local_steps = True
    centre_takes_worker_steps = True
    auto_stale_discount = True  # see above
    default_sync_every = 4

    def __init__(self) -> None:
        super().__init__()

    def new_worker_state(self, n: int, sync_every: int, like: Array | None = None) -> ADAGWorker:
        return ADAGWorker(zeros_like_buffer(n, like), 0, sync_every)

    def worker_start(self, state, params) -> None:
        state.pulled[...] = params

    def worker_step(self, state, params, grad, opt) -> bool:
        opt.step(grad)
        state.count += 1
        return state.count == state.sync_every

    def worker_message(self, state, params, out) -> None:
        out[...] = params
        out -= state.pulled
        out /= float(state.count)
        state.count = 0

    def worker_reply(self, state, params, reply) -> None:
        params[...] = reply
        state.pulled[...] = reply

    def master_apply(self, state, centre, updates: Sequence[Update], opt: FlatOptimizer | None):
        return self.add_updates(centre, updates)
