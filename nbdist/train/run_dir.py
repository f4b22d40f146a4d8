"""The run directory: its name, a fresh one reserved in the run store too, the files
that describe the run, the check that the leader can write there, and the checkpoint a
--resume goes on from."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from nbdist.durable import make_dir, write_json, write_text
from nbdist.errors import OptionsError, UserError
from nbdist.layout import Layout
from nbdist.options import TrainOptions
from nbdist.store import RunStore
from nbdist.train.checkpoint import CheckpointError, Checkpoints, other_model
from nbdist.train.relayout import check_resumable
from nbdist.train.trial import TrialTag

__all__ = [
    "run_name",
    "fresh_dir",
    "write_run_files",
    "check_run_dir_writable",
    "find_resume",
    "check_resumed_model",
]


def run_name(options: TrainOptions) -> str:
    rule = (options.algorithm or ("sgd" if options.topology == "allreduce" else "downpour")).split("(")[0]
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{options.topology}-{rule}"


def check_run_dir_writable(options: TrainOptions) -> None:
    if options.resume:
        _check_writable(Path(options.resume), "--resume")
    else:
        _check_writable(Path(options.runs_dir), "--runs-dir")


def _check_writable(path: Path, flag: str) -> None:
    """Create `path` and a file in it, as the run leader will; one clear error if it cannot
    (a read-only file system, no permission, a file where the directory should be)."""
    try:
        make_dir(path)
        with tempfile.TemporaryFile(dir=path):
            pass
    except (FileExistsError, NotADirectoryError):
        in_the_way = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
        raise OptionsError(f"{flag} {path}: {in_the_way} is a file, not a directory; give a directory") from None
    except OSError as exc:
        raise OptionsError(
            f"{flag} {path}: cannot write there ({exc.strerror or exc}); give a directory you can write to"
        ) from None


def find_resume(options: TrainOptions) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from and those passed over (one line each: damaged, or
    lacking a master's state). Every rank verifies the same files, so every rank picks the
    same checkpoint. The layout may differ from the one that wrote it (train/relayout.py)."""
    if not options.resume:
        return None, []
    run_dir = Path(options.resume)
    if not (run_dir / "options.json").exists():
        raise CheckpointError(f"--resume {options.resume}: not a run directory (no options.json)")
    latest, damaged = Checkpoints(run_dir).latest_intact(check_resumable)
    if latest is None and damaged:
        raise CheckpointError(
            f"--resume {options.resume}: no intact checkpoint is left ({'; '.join(damaged)}); "
            f"start the run afresh without --resume"
        )
    if latest is None:
        raise CheckpointError(f"--resume {options.resume}: the run has no complete checkpoint")
    return latest, damaged


def check_resumed_model(checkpoint: Path, num_params: int) -> None:
    """One error, before the run directory's files are written anew, where the model to
    resume has another number of weights than checkpoint `checkpoint`'s (rank 0's share:
    an allreduce run's first rank, the top master: the whole model). Found only when the
    shares were read, the run had already saved its options with the other model, and
    the --resume that the error advised then failed too."""
    held = Checkpoints.weights_held(checkpoint)
    if held is not None and held != num_params:
        raise other_model(checkpoint, held, 0, num_params)


def fresh_dir(root: Path, name: str, database: str | None, trial: TrialTag | None = None) -> Path:
    """A new run directory named `name`, or name-2, name-3, ...: the first whose name is
    free here and in the run store (which jobs with other runs directories may share: a
    trial trained again by another job of the study must not reuse the first one's row).
    Both are taken atomically: the directory by mkdir, the name by the store's INSERT.
    The reserved row names its study and trial from the start: a job killed before its
    run began still leaves a row the study's views count as the trial's."""
    make_dir(root)
    store = None
    if database is not None:
        try:
            store = RunStore(database)
        except UserError:
            pass  # the recorder reports it, on every rank
    candidate, n = root / name, 1
    try:
        while True:
            try:
                make_dir(candidate, exclusive=True)
                if store is None or store.reserve_run(
                    candidate.name,
                    candidate.resolve(),
                    study=trial.study if trial else None,
                    trial=trial.number if trial else None,
                ):
                    return candidate
                candidate.rmdir()  # another job's run has this name
            except FileExistsError:
                pass
            n += 1
            candidate = root / f"{name}-{n}"
    finally:
        if store is not None:
            store.close()


def write_run_files(run_dir: Path, options: TrainOptions, layout: Layout) -> None:
    # The store as given: --resume reconnects to it (a URL never holds a password: the
    # options refuse one, and libpq finds it in PGPASSWORD, ~/.pgpass or a service file).
    write_json(run_dir / "options.json", options.to_dict())
    write_json(run_dir / "layout.json", layout.to_dict())
    write_text(run_dir / "layout.txt", layout.tree() + "\n")
