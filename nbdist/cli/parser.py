"""The command line's parser: every command, its options and their help."""

from __future__ import annotations

import argparse

from nbdist.options import add_arguments, add_study_arguments

__all__ = ["build_parser", "DESCRIPTION", "DEFAULT_RUNS_DIR", "DEFAULT_STORE", "LAUNCHABLE"]

# The first line of `python -m nbdist --help`: the first paragraph of nbdist.cli's docstring.
DESCRIPTION = "`python -m nbdist ...`: the batch command line, with the same options as the magics."
# The store of runs trained with the default --runs-dir (runs) and no --store.
DEFAULT_RUNS_DIR = "runs"
DEFAULT_STORE = f"{DEFAULT_RUNS_DIR}/nbdist.db"
# The commands launch and slurm-script run.
LAUNCHABLE = ("train", "study", "scale", "datasets")
LAUNCHABLE_WORDS = f"{', '.join(LAUNCHABLE[:-1])} or {LAUNCHABLE[-1]}"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser; given the `command` about to run, the study's and the
    scaling study's options are left out unless it is theirs (the registries of searchers
    and the scaling package they need cost every rank of every job its imports)."""
    parser = argparse.ArgumentParser(prog="python -m nbdist", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)

    # add_arguments writes each default into the help itself (the parser's defaults are
    # None, so that a resumed run's saved options are not overridden).
    train = sub.add_parser("train", help="train a model under mpiexec/srun")
    add_arguments(train)

    study = sub.add_parser("study", help="a hyper-parameter study under mpiexec/srun (rank 0 coordinates)")
    if command in (None, "study"):
        from nbdist.hpo import SEARCHERS

        add_study_arguments(study, SEARCHERS)

    scale = sub.add_parser(
        "scale",
        help="a scaling study under mpiexec/srun: calibrate a performance model, measure set-ups and rank "
        "counts, predict to many ranks, recommend a set-up",
    )
    if command in (None, "scale"):
        from nbdist.scaling.options import ScaleOptions

        add_arguments(scale, config=ScaleOptions)

    launch = sub.add_parser(
        "launch",
        help=f"run {LAUNCHABLE_WORDS} on N MPI ranks of this environment's mpiexec, surviving "
        "dead ranks (MPI fault tolerance) and stopping gracefully on SIGTERM/SIGUSR1/Ctrl-C",
        description="Like `mpiexec -n N python -m nbdist COMMAND ...`, with Open MPI's settings for fault "
        "tolerance and, on one node, shared memory only; SIGTERM, SIGUSR1 (SLURM's --signal) and Ctrl-C "
        "stop every rank at a step boundary with a final checkpoint, and the job exits 0.",
    )
    launch.add_argument("-n", "--ranks", type=int, required=True, help="number of MPI ranks")
    launch.add_argument("--hosts", default=None, help="hosts and slots for mpiexec --host, e.g. node1:4,node2:4")
    launch.add_argument("--hostfile", default=None, help="a hostfile for mpiexec --hostfile")
    launch.add_argument(
        "--interface", default=None, help="network interface between nodes (e.g. ib0); one node uses shared memory only"
    )
    launch.add_argument(
        "--stop-grace",
        type=float,
        default=None,
        help="seconds a stopping run may take for its final checkpoint before it is killed (default: 600)",
    )
    launch.add_argument(
        "launched", nargs=argparse.REMAINDER, metavar="COMMAND ...", help=f"{LAUNCHABLE_WORDS} and its options"
    )

    slurm = sub.add_parser(
        "slurm-script",
        help=f"write (or submit) an sbatch script that runs {LAUNCHABLE_WORDS} on a SLURM allocation through launch",
        description="An sbatch script running `python -m nbdist launch -n $SLURM_NTASKS COMMAND ...` with this "
        "Python, mpiexec --bind-to none inside the allocation, and SIGUSR1 before the time limit "
        "(--signal=B:USR1@S) for a final checkpoint; printed, or written with --write.",
    )
    slurm.add_argument("-n", "--ntasks", type=int, required=True, help="MPI ranks (sbatch --ntasks)")
    slurm.add_argument("-N", "--nodes", type=int, default=None, help="nodes the ranks spread over (sbatch --nodes)")
    slurm.add_argument(
        "--interface",
        default=None,
        help="network interface between the nodes (launch --interface), e.g. ib0 or 10.1.0.0/16",
    )
    slurm.add_argument("--partition", default=None, help="sbatch --partition (default: the cluster's)")
    slurm.add_argument("--time", default=None, help="time limit, e.g. 01:30:00 or 2-00 (sbatch --time)")
    slurm.add_argument("--account", default=None, help="sbatch --account")
    slurm.add_argument("--job-name", default=None, help="sbatch --job-name (default: nbdist-COMMAND)")
    slurm.add_argument("--output", default=None, help="the job's output file, e.g. logs/%%x-%%j.out (sbatch --output)")
    slurm.add_argument(
        "--signal-seconds",
        type=int,
        default=None,
        help="seconds before the time limit that the run is told to stop and checkpoint (default: 300)",
    )
    slurm.add_argument(
        "--chdir",
        default=None,
        help="the job's working directory (default: this one; the COMMAND's paths are relative to it)",
    )
    slurm.add_argument("--write", default=None, metavar="FILE", help="write the script to FILE (default: print it)")
    slurm.add_argument("--submit", action="store_true", help="also submit it with sbatch and print the job id")
    slurm.add_argument(
        "--no-setup-check",
        action="store_true",
        help="only parse the nbdist command; by default its set-up is checked here as a launch checks it before "
        "training (the options, the layout on -n ranks, the model file, its data, a study's space, a scaling "
        "study's set-ups and rank counts), with the "
        "model built on this CPU: for a model that builds only on the compute nodes",
    )
    slurm.add_argument(
        "launched",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND ...",
        help=f"{LAUNCHABLE_WORDS} and its options, after --",
    )

    board = sub.add_parser("dashboard", help="serve the live dashboard of a run store (or export one run)")
    board.add_argument("--store", default=None, help=f"the run store (default: {DEFAULT_STORE})")
    board.add_argument(
        "--address",
        default=None,
        help="interface to listen on (default: 127.0.0.1, this machine only; any other needs --insecure)",
    )
    board.add_argument(
        "--insecure",
        action="store_true",
        help="allow an --address beyond loopback, where the token and the runs travel over plain HTTP "
        "(a network you trust; else an SSH tunnel to the default address)",
    )
    board.add_argument("--port", type=int, default=5006, help="port (0: any free port)")
    board.add_argument(
        "--unix-socket",
        default=None,
        metavar="PATH",
        help="listen on this Unix socket instead of a TCP port (behind jupyter-server-proxy)",
    )
    board.add_argument("--prefix", default="", help="URL prefix, e.g. behind a proxy")
    board.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="file holding the token every request must carry, readable only by you (default: "
        "$NBDIST_DASHBOARD_TOKEN, else a random one; the URL printed at start carries it)",
    )
    # Refused with its own message: a token on the command line is visible in `ps` (and
    # without this, argparse would take --token for an abbreviation of --token-file).
    board.add_argument("--token", dest="token_on_command_line", default=None, help=argparse.SUPPRESS)
    board.add_argument("--run", default=None, help="the run to show first (default: the newest)")
    board.add_argument(
        "--study", default=None, help="the study to show (default: the newest); with --export, that study's page alone"
    )
    board.add_argument(
        "--allow-websocket-origin",
        action="append",
        default=None,
        metavar="HOST[:PORT]",
        help="hosts whose pages may open the websocket, e.g. a reverse proxy's (default: this server's own names)",
    )
    board.add_argument(
        "--export",
        default=None,
        metavar="FILE.html",
        help="write the run's dashboard to one HTML file instead of serving",
    )
    board.add_argument(
        "--create",
        action="store_true",
        help="start an empty store when --store does not exist yet (before the first run)",
    )

    store = sub.add_parser("store", help="the run store: import run directories")
    store_sub = store.add_subparsers(dest="action", required=True)
    imports = store_sub.add_parser("import", help="record run directories (finished, stopped or killed) in the store")
    imports.add_argument("run_dirs", nargs="+", help="run directories")
    imports.add_argument("--store", default=DEFAULT_STORE, help=f"the run store (default: {DEFAULT_STORE})")

    layout = sub.add_parser("layout", help="print the rank layout as a tree")
    layout.add_argument("--workers", type=int, default=None, help="workers per master")
    layout.add_argument(
        "--masters", type=int, default=1, help="masters; more than 1 puts sub-masters under a top master"
    )
    layout.add_argument("--procs-per-worker", type=int, default=1, help="MPI processes per worker")
    layout.add_argument("--groups", type=int, default=1, help="a study's trials trained at once (N_G)")
    layout.add_argument("--folds", type=int, default=1, help="a study's folds per trial (N_F)")
    layout.add_argument(
        "--topology",
        default="master-worker",
        choices=("master-worker", "allreduce"),
        help="master-worker (parameter server) or allreduce",
    )
    layout.add_argument("--coordinator", action="store_true", help="add a study coordinator rank")
    layout.add_argument("--ranks", type=int, default=None, help="infer --workers from a rank count")
    layout.add_argument("--json", action="store_true", help="print the layout as JSON")

    datasets = sub.add_parser("datasets", help="make datasets offline (under mpiexec: on every rank)")
    kinds = datasets.add_subparsers(dest="dataset", required=True)
    jets = kinds.add_parser(
        "jet-images", help="boosted top or W jets against QCD jets, Pythia 8 + FastJet, as HDF5 files of eta-phi images"
    )
    jets.add_argument("--out", required=True, help="directory for train_NNN.h5 and val_NNN.h5")
    jets.add_argument(
        "--signal", default="top", choices=("top", "w"), help="the signal jets: boosted top quarks or W bosons"
    )
    jets.add_argument("--events", type=int, default=2000, help="jet images in all, half signal, half QCD")
    jets.add_argument("--files", type=int, default=4, help="training files (validation files in proportion)")
    jets.add_argument("--val-fraction", type=float, default=0.2, help="share of the jets kept for validation")
    jets.add_argument("--pixels", type=int, default=32, help="image side in pixels")
    jets.add_argument("--radius", type=float, default=0.8, help="anti-kt jet radius R (the image spans 2R)")
    jets.add_argument("--pt-min", type=float, default=550.0, help="jet pT window, GeV")
    jets.add_argument("--pt-max", type=float, default=650.0, help="upper end of the jet pT window, GeV")
    jets.add_argument("--eta-max", type=float, default=2.0, help="largest jet |eta|")
    jets.add_argument(
        "--no-underlying-event",
        action="store_true",
        help="switch off multiple parton interactions (about twice as fast)",
    )
    jets.add_argument(
        "--seed", type=int, default=0, help="seed of the sample (each file derives its own from it and its number)"
    )
    jets.add_argument("--overwrite", action="store_true", help="replace other samples' files in --out")
    return parser
