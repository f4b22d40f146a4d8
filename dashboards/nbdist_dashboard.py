"""The nbdist dashboard as a servable Panel app:

    panel serve dashboards/nbdist_dashboard.py --auth-module dashboards/token_auth.py \
        --args --store runs/nbdist.db [--run RUN]

(`python -m nbdist dashboard --store ...` does the same, on localhost, and prints the URL
with its token.) Forgetting the auth module does not show the runs to every user of the
machine: a session whose request does not carry the token ($NBDIST_DASHBOARD_TOKEN, or the
auth module's own) gets a page that says so, and the store is not opened.
In a notebook, `nbdist.dashboard.dashboard(store=...)` shows the same page inline.
"""

import argparse
import os
import sys

import panel as pn

from nbdist.dashboard import dashboard
from nbdist.dashboard.access import TOKEN_ENV, TOKEN_REQUIRED_PAGE, session_has_token

parser = argparse.ArgumentParser(prog="panel serve dashboards/nbdist_dashboard.py --args")
parser.add_argument("--store", default="runs/nbdist.db", help="the run store (default: runs/nbdist.db)")
parser.add_argument("--run", default=None, help="the run to show first (default: the newest)")
parser.add_argument("--study", default=None, help="the study to show (default: the newest)")
args = parser.parse_args(sys.argv[1:])

session = pn.state.curdoc.session_context if pn.state.curdoc is not None else None
if session is None or session_has_token(session.request, os.environ.get(TOKEN_ENV)):  # None: not served
    dashboard(args.store, run=args.run, study=args.study).servable()
else:
    pn.pane.Markdown(TOKEN_REQUIRED_PAGE, name="nbdist-token-required").servable(title="nbdist dashboard")
