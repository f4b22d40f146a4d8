"""The nbdist dashboard as a servable Panel app:

    panel serve dashboards/nbdist_dashboard.py --auth-module dashboards/token_auth.py \
        --args --store runs/nbdist.db [--run RUN]

(`python -m nbdist dashboard --store ...` does the same, on localhost, and prints the URL
with its token.) Without the auth module, Panel's server shows the runs to every user
of the machine.
In a notebook, `nbdist.dashboard.dashboard(store=...)` shows the same page inline.
"""

import argparse
import sys

from nbdist.dashboard import dashboard

parser = argparse.ArgumentParser(prog="panel serve dashboards/nbdist_dashboard.py --args")
parser.add_argument("--store", default="runs/nbdist.db", help="the run store (default: runs/nbdist.db)")
parser.add_argument("--run", default=None, help="the run to show first (default: the newest)")
parser.add_argument("--study", default=None, help="the study to show (default: the newest)")
args = parser.parse_args(sys.argv[1:])

dashboard(args.store, run=args.run, study=args.study).servable()
