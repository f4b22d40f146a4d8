"""The nbdist dashboard's token for `panel serve` (Bokeh's --auth-module hooks): with it
Panel's own server asks every request for the token, as `python -m nbdist dashboard` does.

    panel serve dashboards/nbdist_dashboard.py --auth-module dashboards/token_auth.py \\
        --args --store runs/nbdist.db
    # then open http://localhost:5006/nbdist_dashboard?token=...

The token is $NBDIST_DASHBOARD_TOKEN, else a random one printed here (Panel prints its
URLs without it).
"""

import os

from nbdist.dashboard.access import TOKEN_ENV, TokenAuth, dashboard_token

_auth = TokenAuth(dashboard_token())
if TOKEN_ENV not in os.environ:
    print(f"nbdist: the dashboard's token (add ?token=... to the URL): {_auth.token}", flush=True)
    # The app checks each session's token too (nbdist_dashboard.py): the same one, in this
    # process only (a later change to the environment is not in /proc/PID/environ).
    os.environ[TOKEN_ENV] = _auth.token
get_user = _auth.get_user
login_url = _auth.login_url
login_handler = _auth.login_handler
