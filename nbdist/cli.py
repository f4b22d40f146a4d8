"""`python -m nbdist ...`: the batch command line, with the same options as the magics.

    python -m nbdist launch -n 4 train --model examples/digits_mlp.py --algorithm easgd
    python -m nbdist slurm-script -n 8 --time 02:00:00 --write job.sh -- train --model model.py   # sbatch job.sh
    mpiexec -n 4 python -m nbdist train --model examples/digits_mlp.py --algorithm easgd
    python -m nbdist launch -n 4 scale --model examples/digits_cnn.py --quick    # a scaling study
    mpiexec -n 9 python -m nbdist study --model examples/digits_mlp.py --space "lr=log(1e-3,0.3)" --groups 2 --folds 2
    python -m nbdist layout --workers 4 --masters 2
    python -m nbdist dashboard --store runs/nbdist.db        # live, on localhost
    python -m nbdist store import runs/<run>                 # a run directory into the store
    mpiexec -n 4 python -m nbdist datasets jet-images --signal top --events 20000 --out data/jets/

Errors in the user's input print one line, `nbdist: error: ...`, on the first rank only,
and every rank exits with status 2; a failure while training exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

from nbdist.errors import DiskFull, UserError
from nbdist.options import (
    add_arguments,
    add_study_arguments,
    options_from_args,
    require_model,
    study_options_from_args,
)
from nbdist.train.diskspace import disk_full, is_disk_full
from nbdist.transport.faults import RunFailure, ulfm_enabled

__all__ = ["main", "run", "build_parser"]

# How long a rank leaving without MPI_Finalize gives mpiexec to forward its last output.
LAST_WORDS_SECONDS = 0.5
# The store of runs trained with the default --runs-dir (runs) and no --store.
DEFAULT_RUNS_DIR = "runs"
DEFAULT_STORE = f"{DEFAULT_RUNS_DIR}/nbdist.db"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser; given the `command` about to run, the study's and the
    scaling study's options are left out unless it is theirs (the registries of searchers
    and the scaling package they need cost every rank of every job its imports)."""
    parser = argparse.ArgumentParser(prog="python -m nbdist", description=__doc__.split("\n\n")[0])
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
        help="run train, study, scale or datasets on N MPI ranks of this environment's mpiexec, surviving "
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
        "launched", nargs=argparse.REMAINDER, metavar="COMMAND ...", help="train, study or datasets and its options"
    )

    slurm = sub.add_parser(
        "slurm-script",
        help="write (or submit) an sbatch script that runs train, study or datasets on a SLURM "
        "allocation through launch",
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
        "training (the options, the layout on -n ranks, the model file, its data, a study's space), with the "
        "model built on this CPU: for a model that builds only on the compute nodes",
    )
    slurm.add_argument(
        "launched",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND ...",
        help="train, study or datasets and its options, after --",
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


def _world_rank() -> int:
    try:
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_rank()
    except Exception:  # no MPI: a single process is rank 0
        return 0


def _train(args: argparse.Namespace) -> int:
    from nbdist.roles.runner import run_rank
    from nbdist.train.definition import definition_of

    options = require_model(options_from_args(args))
    result = run_rank(options, definition_of(options.model))
    if result is not None:
        final = result.final
        shown = "  ".join(f"{k} {v:.4f}" for k, v in final.items() if k.startswith("val_"))
        print(f"nbdist: {result.stop_reason} in {result.seconds:.1f}s  {shown}", flush=True)
        print(
            f"nbdist: results in {result.run_dir} (final weights {result.weights_path}, "
            f"metric log {result.run_dir / 'metrics'}, checkpoints {result.run_dir / 'checkpoints'})",
            flush=True,
        )
    return 0


def _scale(args: argparse.Namespace) -> int:
    import os
    from dataclasses import fields

    # The study is of the node's CPU cores: its calibration times the model on the host, so
    # the points it measures must not move to a GPU (--device auto would, and every rank
    # would share it). Hidden in this process only, before anything asks torch for one.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from nbdist.scaling.options import ScaleOptions
    from nbdist.scaling.sweep import run_scale

    given = {f.name: getattr(args, f.name) for f in fields(ScaleOptions) if getattr(args, f.name, None) is not None}
    run_scale(ScaleOptions(**given), say=lambda text: print(text, flush=True))
    return 0


def _study(args: argparse.Namespace) -> int:
    from nbdist.hpo.runner import resolve_options
    from nbdist.roles.batch_study import run_study
    from nbdist.store import store_label
    from nbdist.train.definition import definition_of

    study, train = resolve_options(*study_options_from_args(args))
    require_model(train, "build_model(params)")
    result = run_study(study, train, definition_of(train.model))
    if result is not None:
        print(f"nbdist: study {result.study}: {result.reason} in {result.seconds:.1f}s", flush=True)
        if result.pareto:
            names = study.objectives
            print(f"nbdist: Pareto front of {', '.join(names)} ({study.resolved_direction}):", flush=True)
            for row in result.pareto:
                values = ", ".join(f"{n} {v:.4g}" for n, v in zip(names, row["values"], strict=True))
                print(f"nbdist:   trial {row['number']:>3}  {values}  {row['params']}", flush=True)
        elif result.best_params is not None:
            print(f"nbdist: best {study.objective} {result.best_fom:.4f} with {result.best_params}", flush=True)
        if result.store:
            store = store_label(result.store)
            print(f"nbdist: trials in {store}: python -m nbdist dashboard --store {store}", flush=True)
    return 0


LAUNCHABLE = ("train", "study", "scale", "datasets")


def _launch(args: argparse.Namespace) -> int:
    from nbdist.launch import STOP_GRACE, check_interface, launch

    if not args.launched or args.launched[0] not in LAUNCHABLE:
        given = f" (got {args.launched[0]!r})" if args.launched else ""
        raise UserError(
            f"launch runs one of: {', '.join(LAUNCHABLE)}{given}, e.g. python -m nbdist launch -n 4 "
            f"train --model examples/digits_mlp.py"
        )
    if args.ranks < 1:
        raise UserError(f"-n must be at least 1, got {args.ranks}")
    if args.stop_grace is not None and not args.stop_grace > 0:
        raise UserError(
            f"--stop-grace must be a number of seconds above 0 (the time a stopping run has for its final "
            f"checkpoint), got {args.stop_grace:g}"
        )
    if args.interface is not None:
        check_interface(args.interface)
    return launch(
        args.ranks,
        args.launched,
        hosts=args.hosts,
        hostfile=args.hostfile,
        interface=args.interface,
        stop_grace=STOP_GRACE if args.stop_grace is None else args.stop_grace,
    )


def _slurm_script(args: argparse.Namespace) -> int:
    import subprocess

    from nbdist.durable import write_text
    from nbdist.slurm import SIGNAL_SECONDS, BatchScript

    launched = args.launched[1:] if args.launched[:1] == ["--"] else args.launched
    if not launched or launched[0] not in LAUNCHABLE:
        given = f" (got {launched[0]!r})" if launched else ""
        raise UserError(
            f"slurm-script runs one of: {', '.join(LAUNCHABLE)}{given}, after --, e.g. python -m nbdist "
            f"slurm-script -n 4 --time 01:00:00 -- train --model examples/digits_mlp.py"
        )
    command = _check_arguments(launched)
    if args.write:
        _check_can_write(Path(args.write))
    script = BatchScript(
        ntasks=args.ntasks,
        launched=tuple(launched),
        nodes=args.nodes,
        interface=args.interface,
        partition=args.partition,
        time=args.time,
        account=args.account,
        job_name=args.job_name,
        output=args.output,
        signal_seconds=SIGNAL_SECONDS if args.signal_seconds is None else args.signal_seconds,
        workdir=str(Path(args.chdir or ".").resolve()),
    )
    if not args.no_setup_check:
        from nbdist.preflight import check_launched

        for warning in check_launched(command, args.ntasks, Path(script.workdir)):
            print(f"nbdist: warning: {warning}", file=sys.stderr, flush=True)
    text = script.text()
    if args.write:
        try:
            write_text(Path(args.write), text)  # the user's alone, as everything nbdist writes
        except OSError as exc:
            raise UserError(f"--write {args.write}: cannot write the script there ({exc.strerror or exc})") from None
        print(f"nbdist: sbatch script written to {args.write}", flush=True)
    elif not args.submit:
        print(text, end="", flush=True)
    if args.submit:
        sbatch = ["sbatch", "--parsable", *([args.write] if args.write else [])]
        try:
            done = subprocess.run(
                sbatch, input=None if args.write else text, capture_output=True, text=True, timeout=120
            )
        except FileNotFoundError:
            raise UserError(
                "sbatch not found: --submit needs SLURM's commands on PATH (or leave it out and "
                "submit the script where they are)"
            ) from None
        if done.returncode != 0:
            raise UserError(f"sbatch refused the job: {done.stderr.strip() or done.stdout.strip()}")
        print(f"nbdist: submitted batch job {done.stdout.strip().split(';')[0]}", flush=True)
    return 0


def _check_arguments(launched: list[str]) -> argparse.Namespace:
    """Parse an nbdist command line now, so that a bad option fails here and not in the queue."""
    import contextlib
    import io

    from nbdist.store import check_store

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            parsed = build_parser().parse_args(launched)
    except SystemExit as exc:
        if not exc.code:  # --help: printed
            raise
        problem = said.getvalue().strip().splitlines()[-1] if said.getvalue().strip() else "bad arguments"
        raise UserError(f"in the nbdist command after --: {problem.split('error: ', 1)[-1]}") from None
    check_store(getattr(parsed, "store", None))  # a password would be written into the script
    return parsed


def _check_can_write(path: Path) -> None:
    """--write's directory exists and is one (the script is written after the checks)."""
    where = path.parent
    if not where.is_dir():
        problem = "is not a directory" if where.exists() else "does not exist"
        raise UserError(f"--write {path}: the directory {where} {problem}; create it first, or write elsewhere")


def _layout(args: argparse.Namespace) -> int:
    from nbdist.layout import Layout

    options = dict(
        masters=args.masters,
        procs_per_worker=args.procs_per_worker,
        groups=args.groups,
        folds=args.folds,
        topology=args.topology,
        coordinator=args.coordinator,
    )
    if args.ranks is not None:
        layout = Layout.for_world(args.ranks, workers=args.workers, **options)
    else:
        layout = Layout(workers=args.workers or 1, **options)
    print(json.dumps(layout.to_dict(), indent=1) if args.json else layout.tree())
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    from nbdist.dashboard import export_html, serve
    from nbdist.dashboard.access import dashboard_token, token_on_command_line
    from nbdist.dashboard.serve import existing_store
    from nbdist.store import check_store, place_store

    if args.token_on_command_line is not None:
        raise token_on_command_line()
    check_store(args.store)  # a password on the command line, or a bare word
    if args.create and args.store is None:  # before the first run: the runs directory it will use
        args.store = place_store(None, DEFAULT_RUNS_DIR, several_hosts=False)
    args.store = args.store or DEFAULT_STORE
    if args.export:
        existing_store(args.store)
        path = export_html(args.store, args.export, run=args.run, study=args.study)
        print(f"nbdist: dashboard written to {path}")
        return 0
    if args.unix_socket is not None and args.address is not None:
        raise UserError("--unix-socket and --address exclude each other: the server listens on one of them")
    serve(
        args.store,
        address=args.address or "127.0.0.1",
        port=args.port,
        prefix=args.prefix,
        token=dashboard_token(args.token_file),
        unix_socket=args.unix_socket,
        run=args.run,
        study=args.study,
        allow_origin=args.allow_websocket_origin,
        create=args.create,
        insecure=args.insecure,
    )
    return 0


def _store(args: argparse.Namespace) -> int:
    from pathlib import Path

    from nbdist.store import RunStore, check_store, import_run, is_url

    check_store(args.store)
    if not is_url(args.store) and not Path(args.store).exists():  # a new store is fine; a silent new one is not
        print(f"nbdist: creating the run store {args.store}", flush=True)
    with RunStore(args.store) as store:
        for run_dir in args.run_dirs:
            run_id, added = import_run(store, run_dir)
            print(f"nbdist: {run_id}: {store.run(run_id).status}, {added} new records in {store.label}")
    return 0


def _datasets(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    from nbdist.datasets import jet_images

    comm = MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() > 1 else None
    sample = jet_images(
        args.out,
        signal=args.signal,
        events=args.events,
        files=args.files,
        val_fraction=args.val_fraction,
        pixels=args.pixels,
        radius=args.radius,
        pt_range=(args.pt_min, args.pt_max),
        eta_max=args.eta_max,
        underlying_event=not args.no_underlying_event,
        seed=args.seed,
        comm=comm,
        overwrite=args.overwrite,
    )
    if _world_rank() == 0:
        print(f"nbdist: {sample}", flush=True)
    return 0


COMMANDS = {
    "train": _train,
    "study": _study,
    "scale": _scale,
    "launch": _launch,
    "slurm-script": _slurm_script,
    "layout": _layout,
    "dashboard": _dashboard,
    "store": _store,
    "datasets": _datasets,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv and argv[0] in COMMANDS else None).parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except RunFailure as exc:
        # Every rank of the run raises it; the one that recorded it first says it.
        if _reports(exc):
            print(f"nbdist: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except UserError as exc:
        # Raised in a run: the rank that recorded it first says it (a worker's full disk);
        # before one (bad options, every rank alike): rank 0.
        if getattr(exc, "reported_here", _world_rank() == 0):
            print(f"nbdist: error: {exc}", file=sys.stderr, flush=True)
        # A full disk ends the run as a failed rank does (status 1, as on the other ranks).
        return 1 if isinstance(exc, DiskFull) else 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug or a failure inside user code while training
        rank = _world_rank()
        if is_disk_full(exc):  # set-up's own files, before there is a run to report it in
            if rank == 0:
                print(f"nbdist: error: {disk_full(exc)}", file=sys.stderr, flush=True)
            return 1
        # The run's other ranks were told over its control channel and end on their own.
        sys.stderr.write(f"nbdist: rank {rank} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        return 1


def run() -> None:
    """`python -m nbdist` and the `nbdist` command: main(), then exit with its status.

    With MPI fault tolerance on, every rank leaves without MPI_Finalize: after a rank died
    or was removed, finalizing can wait forever for it (1 job in 6 did, here), and it
    must be all ranks or none (a rank that finalizes waits for one that did not). There
    is nothing left to finalize for: the run's files are written and closed, and its last
    messages were received (the run leader waits for every rank's end)."""
    import os

    status = main()
    if ulfm_enabled():
        sys.stdout.flush()
        sys.stderr.flush()
        # mpiexec forwards what a rank wrote as it reads it; a rank that leaves at once can
        # take its last line (the error it reports) with it.
        time.sleep(LAST_WORDS_SECONDS)
        os._exit(status)
    sys.exit(status)


def _reports(failure: RunFailure) -> bool:
    """Whether this rank is the one to print `failure`: the first to record it in the run
    directory, or, before there is one, the lowest rank that did not fail."""
    if failure.reported_here is not None:
        return failure.reported_here
    if failure.run_dir is not None:
        return False
    try:
        from mpi4py import MPI

        size = MPI.COMM_WORLD.Get_size()
    except Exception:  # no MPI: a single process
        return True
    alive = [r for r in range(size) if r not in failure.ranks]
    return bool(alive) and _world_rank() == alive[0]
