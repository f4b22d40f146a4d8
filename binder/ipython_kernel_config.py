# Copied into the binder user's IPython profile by postBuild: every notebook kernel starts
# with the nbdist extension loaded, so %distnn works without %load_ext.
c = get_config()  # noqa: F821 - provided by IPython when it reads this file
c.InteractiveShellApp.extensions = ["nbdist"]
