"""`%distnn` and `%%distnn`: parse the options, call the Python API, nothing else.

    %load_ext nbdist
    %distnn cluster start -n 4
    %%distnn train --algorithm gem --workers 3 --epochs 10
    model = ...                     # the cell body runs on every engine

The train options are the parser of `python -m nbdist train` (nbdist.options), so the
magic, the command line and `nbdist.train(...)` take the same names.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import ArgDecorator, MagicArgumentParser, magic_arguments

from nbdist.hpo import SEARCHERS
from nbdist.options import STUDY_SKIPS, add_arguments, add_study_arguments, options_from_args, study_options_from_args
from nbdist.scaling.options import ScaleOptions

__all__ = ["DistnnMagics", "load_ipython_extension"]


class _commands(ArgDecorator):
    """The sub-commands of %distnn, built on the train options' own parser."""

    subparsers: Any = None  # set when the parser is built: the full help lists each

    def add_to_parser(self, parser: MagicArgumentParser, group: Any) -> None:
        sub = parser.add_subparsers(
            dest="command", metavar="{cluster,train,study,scale,last,stop}", parser_class=MagicArgumentParser
        )
        cluster = sub.add_parser("cluster", help="start, stop or describe the MPI engines")
        actions = cluster.add_subparsers(dest="action", parser_class=MagicArgumentParser)
        start = actions.add_parser(
            "start", help="start MPI engines (or reuse the running cluster, replacing its engines if any is dead)"
        )
        start.add_argument("-n", type=int, default=4, help="number of engines (MPI ranks)")
        start.add_argument(
            "--engines",
            default="mpi",
            choices=("mpi", "slurm"),
            help="launcher: mpiexec here, or a SLURM job (the same as --slurm)",
        )
        start.add_argument(
            "--slurm",
            action="store_true",
            help="submit the engines as a SLURM job (sbatch; mpiexec inside the allocation)",
        )
        start.add_argument("--partition", default=None, help="with --slurm: the partition (sbatch --partition)")
        start.add_argument("--time", default=None, help="with --slurm: the time limit, e.g. 01:00:00")
        start.add_argument("--account", default=None, help="with --slurm: the account to charge")
        start.add_argument("--nodes", type=int, default=None, help="with --slurm: nodes the engines spread over")
        start.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the engines")
        where = start.add_mutually_exclusive_group()
        where.add_argument(
            "--interface",
            default=None,
            help="network interface the controller listens on, for engines on other nodes (default: 127.0.0.1 only)",
        )
        where.add_argument("--ip", default=None, help="address the controller listens on (instead of --interface)")
        attach = actions.add_parser(
            "attach", help="use engines started elsewhere (ipcluster, another notebook); dead engines are replaced"
        )
        attach.add_argument("--cluster-id", default="", help="the cluster's id (ipcluster list)")
        attach.add_argument("--profile", default=None, help="the IPython profile it was started with")
        actions.add_parser("stop", help="stop the engines (an attached cluster: disconnect)")
        actions.add_parser("status", help="engines, ranks, hosts and the layout tree")

        train = sub.add_parser("train", help="train the model the cell defines on every engine")
        add_arguments(train)
        train.add_argument("--block", action="store_true", help="wait for the training to end")
        train.add_argument("--no-progress", action="store_true", help="no live progress line")
        train.add_argument(
            "--dashboard",
            action="store_true",
            help="show the live dashboard (throughput, staleness, loss, timeline) under the cell",
        )

        study = sub.add_parser("study", help="a hyper-parameter study; the cell defines build_model(params)")
        add_study_arguments(study, SEARCHERS)
        study.add_argument("--block", action="store_true", help="wait for the study to end")
        study.add_argument("--no-progress", action="store_true", help="no live lines under the cell")
        study.add_argument(
            "--dashboard",
            action="store_true",
            help="show the study's live dashboard (population, trials, best so far) under the cell",
        )

        scale = sub.add_parser(
            "scale", help="a scaling study on the engines: calibrate, measure set-ups and rank counts, predict"
        )
        add_arguments(scale, config=ScaleOptions)

        sub.add_parser("last", help="the last job started from a cell")
        sub.add_parser("stop", help="stop the last job on every rank")
        _commands.subparsers = sub


def _full_help(parser: MagicArgumentParser) -> str:
    parts = [parser.format_help()]
    for name, child in _commands.subparsers.choices.items():
        parts.append(f"\n%distnn {name}\n" + child.format_help())
    return "\n".join(parts)


def _cell_or_model(cell: str | None, model_file: str | None, command: str, defines: str) -> str | None:
    """The cell body (None when empty); exactly one of it and --model must give the model."""
    if cell is None or not cell.strip():
        if not model_file:
            raise UsageError(
                f"%distnn {command} needs a cell body that defines {defines} "
                f"(%%distnn {command} ...) or --model FILE.py"
            )
        return None
    if model_file:
        raise UsageError("give the model either as the cell body or as --model, not both")
    return cell


def _continued(line: str, cell: str | None) -> tuple[str, str | None]:
    """`%%distnn study --trials 40 \\` goes on on the cell's next line, as in a shell
    (IPython hands a cell magic only its first line)."""
    while cell is not None and line.rstrip().endswith("\\"):
        more, _, rest = cell.partition("\n")
        line, cell = line.rstrip()[:-1] + " " + more.strip(), rest
    return line, cell


def _parse(parser: MagicArgumentParser, line: str) -> argparse.Namespace:
    """The line split as a shell would: quotes group words and are removed, so that
    --space "lr=log(1e-4,1e-1) hidden=int(16,256)" is one value (IPython's own splitting
    keeps the quotes)."""
    try:
        argv = shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"cannot read the options: {exc} (a quote without its pair?)") from None
    return parser.parse_args(argv)


@magics_class
class DistnnMagics(Magics):
    def __init__(self, shell: Any):
        super().__init__(shell)
        self.last_job: Any = None

    @magic_arguments()
    @_commands()
    @line_cell_magic
    def distnn(self, line: str, cell: str | None = None) -> Any:
        """Distributed training on an MPI cluster of ipyparallel engines."""
        line, cell = _continued(line, cell)
        args = _parse(self.distnn.parser, line)
        if args.command is None:
            raise UsageError(
                "say what to do: %distnn cluster start | train | study | scale | last | stop  (%distnn? for help)"
            )
        if cell is not None and args.command not in ("train", "study") and cell.strip():
            raise UsageError(f"%%distnn {args.command} takes no cell body; use %distnn {args.command}")
        # A UserError raised from here shows as its one line (UserError._render_traceback_).
        return getattr(self, f"_{args.command}")(args, cell)

    def _cluster(self, args: argparse.Namespace, cell: str | None) -> Any:
        from nbdist import cluster as clusters

        if args.action is None:
            raise UsageError("%distnn cluster start | attach | stop | status")
        running = clusters.running_cluster()
        if args.action == "start":
            if args.slurm:
                args.engines = "slurm"
            if running is not None:
                return self._restart(running, args)
            print(
                f"nbdist: starting {args.n} MPI engines{' as a SLURM job' if args.engines == 'slurm' else ''} ...",
                flush=True,
            )
            started = clusters.Cluster(
                n=args.n,
                engines=args.engines,
                start_timeout=args.timeout,
                interface=args.interface,
                ip=args.ip,
                partition=args.partition,
                time=args.time,
                account=args.account,
                nodes=args.nodes,
            ).start()
            print(started.status())
            return started
        if args.action == "attach":
            if running is not None:
                raise UsageError(f"a cluster is already in use ({running!r}); %distnn cluster stop first")
            attached = clusters.Cluster.attach(cluster_id=args.cluster_id, profile=args.profile)
            print(attached.status())
            return attached
        if args.action == "stop":
            if running is None:
                print("nbdist: no cluster is running")
                return None
            running.stop()
            print("nbdist: cluster stopped" if running.owned else "nbdist: disconnected from the cluster")
            return None
        print(running.status() if running is not None else "nbdist cluster: not running")
        return None

    @staticmethod
    def _restart(running: Any, args: argparse.Namespace) -> Any:
        """`cluster start` on a running cluster: reuse it, or replace its dead engines."""
        if running.engines != args.engines:
            raise UsageError(
                f"a cluster of {running.n} {running.engines} engines is running; %distnn cluster stop first"
            )
        healthy = not running.broken()
        if healthy and running.n == args.n:
            print(f"nbdist: reusing the running cluster ({running.n} engines)")
            return running
        if healthy:
            raise UsageError(
                f"a cluster of {running.n} {running.engines} engines is running; %distnn cluster stop first"
            )
        print(f"nbdist: {running.heal(n=args.n)}", flush=True)
        print(running.status())
        return running

    def _train(self, args: argparse.Namespace, cell: str | None) -> Any:
        from nbdist.api import submit
        from nbdist.cluster import current_cluster

        options = options_from_args(args)
        cell = _cell_or_model(cell, options.model, "train", "the model")
        return self._started(
            submit(current_cluster(), options, cell=cell, block=False, show_progress=not args.no_progress), args
        )

    def _study(self, args: argparse.Namespace, cell: str | None) -> Any:
        from nbdist.api import study, submit_study
        from nbdist.cluster import current_cluster
        from nbdist.hpo.runner import resolve_options

        study_options, train_options = resolve_options(*study_options_from_args(args))
        cell = _cell_or_model(cell, train_options.model, "study", "build_model(params)")
        if cell is None:
            options = {
                **study_options.to_dict(),
                **{k: v for k, v in train_options.to_dict().items() if k not in STUDY_SKIPS},
            }
            handle = study(
                train_options.model, cluster=current_cluster(), show_progress=not args.no_progress, **options
            )
        else:
            handle = submit_study(
                current_cluster(), study_options, train_options, cell=cell, show_progress=not args.no_progress
            )
        return self._started(handle, args)

    def _scale(self, args: argparse.Namespace, cell: str | None) -> Any:
        from dataclasses import fields

        from nbdist.api import scale
        from nbdist.cluster import current_cluster

        given = {f.name: getattr(args, f.name) for f in fields(ScaleOptions) if getattr(args, f.name, None) is not None}
        if not given.get("model"):
            raise UsageError("%distnn scale needs --model FILE.py (each engine loads the model file)")
        return scale(cluster=current_cluster(), **given)

    def _started(self, handle: Any, args: argparse.Namespace) -> Any:
        """A job or a study just started from a cell: remembered, shown, waited for as asked."""
        self.last_job = handle
        if args.dashboard:
            from IPython.display import display

            display(handle.dashboard())
        if args.block:
            handle.wait()
        return handle

    def _last(self, args: argparse.Namespace, cell: str | None) -> Any:
        if self.last_job is None:
            raise UsageError("no job has been started from a cell yet")
        return self.last_job

    def _stop(self, args: argparse.Namespace, cell: str | None) -> Any:
        job = self._last(args, cell)
        job.stop()
        print(f"nbdist: job {job.status}")
        return job


DistnnMagics.distnn.__doc__ = _full_help(DistnnMagics.distnn.parser)


def load_ipython_extension(shell: Any) -> None:
    shell.register_magics(DistnnMagics)
