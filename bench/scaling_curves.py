"""Predicted scaling curves to 1,024 ranks for the docs (a script, not a test).

For the jet CNN (`examples/jet_cnn.py` on a Pythia 8 top-vs-QCD jet sample, generated once
into --cache) and a 10M-parameter MLP (`bench/_mlp10m.py`, on digits): `python -m nbdist
scale` calibrates the performance model on two ranks of this machine (measuring the two
calibration points only), then this script predicts allreduce, master/worker (Downpour) and
2-level sub-masters (the best number of masters at each rank count) to 1,024 ranks on nodes
of --cores-per-node cores, once per network preset, and prints the calibration and the
curves as Markdown (what docs/explanation/performance-model.md shows).

Usage: python bench/scaling_curves.py [--cores-per-node 16] [--networks ib-hdr,ethernet-10g]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT, header  # noqa: E402

from nbdist.scaling.analysis import analyse  # noqa: E402
from nbdist.scaling.options import parse_setups  # noqa: E402
from nbdist.scaling.report import calibration_text, curves_text, goodput_text  # noqa: E402
from nbdist.scaling.store import load_calibration  # noqa: E402
from nbdist.store import RunStore  # noqa: E402

JETS = {"signal": "top", "events": 2000, "files": 4}
SETUPS = "allreduce downpour"
DEADLINE = 590.0


def jet_sample(cache: Path) -> tuple[str, str]:
    out = cache / f"jets-{JETS['signal']}-{JETS['events']}-{JETS['files']}"
    if not (out / "done").exists():
        print(f"   generating the jet sample in {out} (once)", flush=True)
        subprocess.run(
            [sys.executable, "-m", "nbdist", "datasets", "jet-images", "--out", str(out), "--signal", JETS["signal"],
             "--events", str(JETS["events"]), "--files", str(JETS["files"]), "--no-underlying-event", "--overwrite"],
            check=True,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        (out / "done").write_text("ok\n")
    return str(out / "train_*.h5"), str(out / "val_*.h5")


def calibrate(name: str, model: str, extra: list[str], tmp: Path) -> object:
    """The calibration `nbdist scale` measures on two ranks, read back from its store."""
    store = tmp / "nbdist.db"
    command = [sys.executable, "-m", "nbdist", "launch", "-n", "2", "scale", "--model", model, "--ranks", "1,2",
               "--setups", SETUPS, "--scaling", "weak", "--runs-dir", str(tmp), "--store", str(store),
               "--run-name", name, "--max-ranks", "64", *extra]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=DEADLINE)
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
        raise SystemExit(f"calibrating {name} failed")
    with RunStore(store) as opened:
        return load_calibration(opened, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cores-per-node", type=int, default=16)
    parser.add_argument("--networks", default="ib-hdr,ethernet-10g")
    parser.add_argument("--max-ranks", type=int, default=1024)
    parser.add_argument("--target-epochs", type=float, default=10.0)
    parser.add_argument("--cache", default="~/.cache/nbdist/bench")
    args = parser.parse_args()
    header("scaling curves: predicted to many ranks from a two-rank calibration")
    print(f"   {time.strftime('%Y-%m-%d %H:%M')}, nodes of {args.cores_per_node} cores", flush=True)
    train, val = jet_sample(Path(args.cache).expanduser())
    models = {
        "jet CNN (examples/jet_cnn.py)": (str(ROOT / "examples" / "jet_cnn.py"), ["--train", train, "--val", val]),
        "10M-parameter MLP (bench/_mlp10m.py)": (str(ROOT / "bench" / "_mlp10m.py"), []),
    }
    with tempfile.TemporaryDirectory(prefix="nbdist-curves-") as tmp:
        for k, (title, (model, extra)) in enumerate(models.items()):
            cal = calibrate(f"model{k}", model, extra, Path(tmp))
            print(f"\n## {title}\n\n{calibration_text(cal)}")
            for net in args.networks.split(","):
                analysis = analyse(
                    cal,
                    [],
                    parse_setups(SETUPS),
                    cores=cal.cores,
                    cores_per_node=args.cores_per_node,
                    network_name=net,
                    max_ranks=args.max_ranks,
                    target_samples=args.target_epochs * max(1, cal.train_samples),
                )
                print(f"\n### {net}\n\n{curves_text(analysis)}\n")
                print(goodput_text(analysis, args.target_epochs * max(1, cal.train_samples)), flush=True)


if __name__ == "__main__":
    main()
