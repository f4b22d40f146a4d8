"""The commands that run in this process (or on each rank of the mpiexec/srun job that
started it): train, study, scale, layout, dashboard, store and datasets."""

from __future__ import annotations

import argparse
import json

from nbdist.cli.parser import DEFAULT_RUNS_DIR, DEFAULT_STORE
from nbdist.errors import UserError
from nbdist.options import options_from_args, require_model, study_options_from_args
from nbdist.transport.start import start_mpi, world_rank

__all__ = ["world_rank"]


def _train(args: argparse.Namespace) -> int:
    start_mpi()  # before the modules below import mpi4py: a process on its own starts at once
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

    # The study is of the node's CPU cores: its calibration times the model on the host, so
    # the points it measures must not move to a GPU (--device auto would, and every rank
    # would share it). Hidden in this process only, before anything asks torch for one.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    start_mpi()
    from nbdist.scaling.options import ScaleOptions
    from nbdist.scaling.sweep import run_scale

    run_scale(ScaleOptions.from_args(args), say=lambda text: print(text, flush=True))
    return 0


def _study(args: argparse.Namespace) -> int:
    start_mpi()
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
        elif result.furthest is not None:
            print(furthest_line(result.furthest, study.objective, train.epochs), flush=True)
        if result.store:
            store = store_label(result.store)
            print(f"nbdist: trials in {store}: python -m nbdist dashboard --store {store}", flush=True)
    return 0


def furthest_line(far: dict, objective: str, epochs: int) -> str:
    """What a study whose scheduler cut every trial short says in place of its best."""
    return (
        f"nbdist: no trial trained all {epochs} epochs (the scheduler cut each short); the furthest: "
        f"trial {far['number']}, {objective} {far['fom']:.4f} after {far['epochs']} epochs with "
        f"{far['params']} (more --trials let the scheduler take trials further)"
    )


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
        existing_store(args.store, served=False)
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
    start_mpi()
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
    if world_rank() == 0:
        print(f"nbdist: {sample}", flush=True)
    return 0
