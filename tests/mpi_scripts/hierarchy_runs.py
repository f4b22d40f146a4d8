"""train_many.py with one fault injected, for tests/test_hierarchy_mpi.py.

Usage: mpiexec -n 6 python tests/mpi_scripts/hierarchy_runs.py RUNS.json

In the run named `stop-at-sub-epoch-end` (and only there), the top master begins a stop
exactly when the sub-master's push that ends the second epoch arrives. The sub-master
then holds an epoch that its workers ended but the top master never took: the case that
its stop checkpoint and a resume must get right (a signal hits it only by chance).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_many import run_all

from nbdist.roles import master as mw
from nbdist.roles.master import run as serving
from nbdist.transport import messages as m

RUN = "stop-at-sub-epoch-end"
EPOCH = 1  # the second epoch, counted from 0

read_messages = serving.read_messages  # what serve() calls for each pass
_fired = False  # once: its resume continues in the same directory, in these processes


def _stop_at_sub_epoch_end(me, ready):
    global _fired
    if me.ctx.run_dir.name == RUN and not _fired:
        for i in ready:
            client, header = me.clients[i], me.clients[i].inbox.header
            if (
                client.kind == mw.SUB_MASTER
                and header[m.KIND] == m.UPDATE
                and client.inbox.has(m.EPOCH_END)
                and int(header[m.EPOCH]) == EPOCH
            ):
                me.begin_stop("stopped by the test at the sub-master's epoch end")
                _fired = True
    return read_messages(me, ready)


serving.read_messages = _stop_at_sub_epoch_end

if __name__ == "__main__":
    sys.exit(run_all(sys.argv[1]))
