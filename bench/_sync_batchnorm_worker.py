"""The nbdist side of sync_batchnorm.py; run under mpiexec -n N.

Trains examples/digits_cnn.py on the allreduce topology through nbdist.train, alternating
plain BatchNorm and --sync-batchnorm for the given rounds in this one job, and prints
rank 0's per-epoch history of each run (nbdist's own samples/s accounting).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT, emit


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--runs-dir", required=True)
    args = p.parse_args()

    import nbdist

    for round_ in range(args.rounds):
        for synchronised in (False, True):
            result = nbdist.train(
                str(ROOT / "examples" / "digits_cnn.py"),
                topology="allreduce",
                epochs=args.epochs,
                sync_batchnorm=synchronised,
                validate_every=10**6,
                seed=0,
                quiet=True,
                runs_dir=args.runs_dir,
                store="off",
            )
            if result is not None:
                emit({"round": round_, "synchronised": synchronised, "history": result.history})


if __name__ == "__main__":
    main()
