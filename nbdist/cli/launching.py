"""The commands that start a job rather than run one: launch (on N MPI ranks of this
environment's mpiexec) and slurm-script (an sbatch script, checked before it waits in a queue)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nbdist.cli.parser import LAUNCHABLE, build_parser
from nbdist.errors import UserError

__all__: list[str] = []  # its two commands are nbdist.cli's; LAUNCHABLE is the parser's


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
