from nbdist.train.stopping import catch_stop_signals_early

catch_stop_signals_early()  # before the slow imports: a stop that comes now is kept, not fatal

from nbdist.cli import run  # noqa: E402 - after the signals are caught

run()
