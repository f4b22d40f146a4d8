"""One loop per role (master, sub-master, worker, allreduce worker, study coordinator and
its groups), using the training services (train/); they talk only through transport/."""
