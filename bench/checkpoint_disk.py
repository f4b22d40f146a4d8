"""Disk use of a run's checkpoints, this checkout against another (a script, not a test).

    python bench/checkpoint_disk.py                          # this checkout only
    git archive 2e7f709 | tar -x -C /tmp/nbdist-before       # the code before a change
    python bench/checkpoint_disk.py --before /tmp/nbdist-before

Trains the digits MLP (4,810 parameters) on 4 ranks for 30 epochs with a checkpoint
every epoch, with `--topology allreduce` and with master-worker (1 master, 3 workers),
through `python -m nbdist train` of each checkout, and prints what the run directory's
checkpoints (and history.jsonl, where there is one) take: bytes in the files, bytes on
disk (allocated blocks, as `du` counts them), and bytes in the latest checkpoint alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import ROOT, header, table

from nbdist.launch import mpi_env, mpiexec_command

TOPOLOGIES = {"allreduce": ["--topology", "allreduce"], "master-worker": []}


def train(source: Path, runs: Path, name: str, ranks: int, epochs: int, argv: list[str]) -> Path:
    cmd = mpiexec_command(
        ranks,
        [
            "-m",
            "nbdist",
            "train",
            "--model",
            str(ROOT / "examples" / "digits_mlp.py"),
            "--epochs",
            str(epochs),
            "--checkpoint-every",
            "1",
            "--runs-dir",
            str(runs),
            "--run-name",
            name,
            "--store",
            "off",
            "--quiet",
            *argv,
        ],
    )
    env = mpi_env()
    env["PYTHONPATH"] = str(source)  # that checkout's nbdist, whatever is installed
    done = subprocess.run(cmd, cwd=source, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} (in {source}) failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return runs / name


def disk_use(run: Path) -> dict[str, int]:
    files = [p for p in (run / "checkpoints").rglob("*") if p.is_file()]
    if (run / "history.jsonl").exists():
        files.append(run / "history.jsonl")
    stats = [os.stat(p) for p in files]
    kept = [p for p in (run / "checkpoints").iterdir() if p.is_dir() and not p.name.startswith(".")]
    latest = json.loads((run / "checkpoints" / "LATEST.json").read_text())["label"]
    return {
        "checkpoints": len(kept),
        "files": len(files),
        "bytes": sum(s.st_size for s in stats),
        "disk": sum(s.st_blocks * 512 for s in stats),
        "latest": sum(p.stat().st_size for p in (run / "checkpoints" / latest).iterdir()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="another checkout of nbdist to compare with")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    header(f"checkpoint disk use: digits MLP, {args.ranks} ranks, {args.epochs} epochs, a checkpoint every epoch")
    sources = {"this checkout": ROOT} | ({"--before": args.before.resolve()} if args.before else {})
    rows, used = [], {}
    with tempfile.TemporaryDirectory(prefix="nbdist-ckpt-disk-") as tmp:
        for code, source in sources.items():
            for topology, argv in TOPOLOGIES.items():
                run = train(
                    source, Path(tmp) / code.strip("-").replace(" ", "-"), topology, args.ranks, args.epochs, argv
                )
                use = used[code, topology] = disk_use(run)
                rows.append(
                    [
                        code,
                        topology,
                        use["checkpoints"],
                        use["files"],
                        f"{use['bytes'] / 1024:,.0f}",
                        f"{use['disk'] / 1024:,.0f}",
                        f"{use['latest'] / 1024:,.0f}",
                    ]
                )
    table(rows, ["code", "topology", "checkpoints", "files", "KiB in files", "KiB on disk", "KiB in the latest"])
    if args.before:
        for topology in TOPOLOGIES:
            now, then = used["this checkout", topology], used["--before", topology]
            print(
                f"{topology}: {then['bytes'] / now['bytes']:.1f}x fewer bytes, "
                f"{then['disk'] / now['disk']:.1f}x less disk than before"
            )


if __name__ == "__main__":
    main()
