from nbdist.cli import run

run()
