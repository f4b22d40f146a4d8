import sys

# The commands whose ranks stop at a step boundary with a checkpoint (and the launcher
# that passes them the signal): a stop that comes while they import is kept, not fatal.
# Every other command (the dashboard, store import) keeps Python's default: it dies.
if sys.argv[1:2] and sys.argv[1] in ("train", "study", "scale", "launch"):
    from nbdist.train.stopping import catch_stop_signals_early

    catch_stop_signals_early()

from nbdist.cli import run  # after the signals are caught

run()
