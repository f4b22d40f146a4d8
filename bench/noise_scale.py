"""How many workers can the jet task use before they cost samples? (a script, not a test)

bench/convergence.py asks 8 workers of batch 32 to reach one worker's accuracy in at most
1.5x its samples. McCandlish et al. ("An Empirical Model of Large-Batch Training", 2018)
say how far that is possible: with steps of B samples, the samples to a given loss grow as
1 + B / B_noise, so W workers of b samples need (1 + W b / B_noise) / (1 + b / B_noise)
times one worker's samples, even synchronously and with the best lr (an asynchronous rule
gets no more from the same samples). The aim at 8 x 32 needs B_noise >= 416.

This script measures the simple noise scale B_simple = tr(Sigma) / |G|^2, their estimate
of B_noise (nbdist/metrics/noise_scale.py), along one-worker runs of `examples/jet_cnn.py`
on the jet sample bench/convergence.py uses (generated once, cached): plain PyTorch, the
workers' default optimiser sgd(lr=0.05, momentum=0.9), batch 32. At each mark of training
samples it takes the squared norms of the mean gradient of 150 batches of 32 and 18 of 256
per pass over the 4,800 jets in random order (`--passes`, default 4), at the current
weights, and gives B_simple with the samples ratio it predicts for 8 and 16 workers of 32.
One worker reaches
98% of its best accuracy within its first 2,400 to 12,000 samples (bench/convergence.py):
the marks after 0 and before 12,000 are the ones the samples ratio is decided on, and the
last line takes the most favourable of them. Each mark pools the seeds (tr(Sigma) and
|G|^2 averaged apart, then divided, as the paper averages them over steps).

Usage: python bench/noise_scale.py [--quick] [--seeds 3] [--marks 0,600,1200,2400] [--passes 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT, header, table
from convergence import jet_sample

from nbdist.metrics.noise_scale import NoiseScale, samples_ratio, simple_noise_scale

JET_MODEL = ROOT / "examples" / "jet_cnn.py"
BATCH, BIG = 32, 256
SMALL_PASS, BIG_PASS = 150, 18  # batches of 32 and of 256 in one pass over the 4,800 training jets
AIM_WORKERS, AIM_RATIO = 8, 1.5
# One worker reaches 98% of its best within its first 2,400-12,000 samples (convergence.py)
EARLY = 12000


def load_jets(train_glob: str, val_glob: str) -> tuple[np.ndarray, np.ndarray]:
    """Every training jet, read as a run reads them (nbdist's HDF5 files, their default keys)."""
    from nbdist.data.files import HDF5Data

    data = HDF5Data(train_glob, val_glob)
    try:
        return data.train_batch(np.arange(data.n_train))
    finally:
        data.close()


def gradient_sq_norms(
    model, loss_fn, x, y, batch: int, batches: int, passes: int, rng: np.random.Generator
) -> list[float]:
    """|mean gradient over a batch|^2 for `batches` batches in each of `passes` passes
    over the data in random order, in training mode (BatchNorm on the batch, as a worker's
    step is) with the BatchNorm statistics left as they were."""
    import torch

    saved = [b.clone() for b in model.buffers()]
    order = np.concatenate([rng.permutation(len(y))[: batch * batches].reshape(batches, batch) for _ in range(passes)])
    norms = []
    for idx in order:
        model.zero_grad(set_to_none=True)
        loss_fn(model(torch.from_numpy(x[idx])), torch.from_numpy(y[idx])).backward()
        norms.append(float(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)))
    with torch.no_grad():
        for b, s in zip(model.buffers(), saved, strict=True):
            b.copy_(s)
    model.zero_grad(set_to_none=True)
    return norms


def one_run(seed: int, marks: list[int], passes: int, x, y) -> dict[int, NoiseScale]:
    """The noise scale at each mark of training samples of one plain one-worker run."""
    import torch

    from nbdist.train.definition import load_model_file

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    definition = load_model_file(JET_MODEL)
    model = definition.build_model()
    loss_fn = definition.loss
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rng = np.random.default_rng(seed)
    measured: dict[int, NoiseScale] = {}
    seen, order = 0, np.empty(0, np.int64)
    for mark in sorted(marks):
        while seen < mark:  # train up to the mark, epoch after epoch of shuffled batches
            if len(order) < BATCH:
                order = rng.permutation(len(y))
            idx, order = order[:BATCH], order[BATCH:]
            opt.zero_grad(set_to_none=True)
            loss_fn(model(torch.from_numpy(x[idx])), torch.from_numpy(y[idx])).backward()
            opt.step()
            seen += BATCH
        small = gradient_sq_norms(model, loss_fn, x, y, BATCH, SMALL_PASS, passes, rng)
        big = gradient_sq_norms(model, loss_fn, x, y, BIG, BIG_PASS, passes, rng)
        measured[mark] = simple_noise_scale(small, BATCH, big, BIG)
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 seed instead of 3")
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument(
        "--marks",
        default="0,600,1200,2400,3600,4800,7200,9600,12000,19200",
        help="training samples at which to measure, comma-separated",
    )
    parser.add_argument("--passes", type=int, default=4, help="passes over the data per measurement")
    parser.add_argument("--cache", default="~/.cache/nbdist/bench", help="where the jet sample is kept")
    args = parser.parse_args()
    seeds = args.seeds or (1 if args.quick else 3)
    marks = sorted({int(m) for m in args.marks.split(",") if m.strip()})
    header("noise scale: how many samples a step of the jet task can use (McCandlish et al. 2018)")
    x, y = load_jets(*jet_sample(Path(args.cache).expanduser()))
    runs = []
    for seed in range(seeds):
        t0 = time.perf_counter()
        runs.append(one_run(seed, marks, args.passes, x, y))
        print(
            f"   seed {seed}: B_simple "
            + "  ".join(f"{m}: {n.b_simple:.0f}" for m, n in runs[-1].items())
            + f"  ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    rows, by_mark = [], {}
    for mark in marks:
        by_mark[mark] = pooled([r[mark] for r in runs])
        rows.append(
            [
                mark,
                round(by_mark[mark]),
                f"{samples_ratio(by_mark[mark], AIM_WORKERS, BATCH):.2f}x",
                f"{samples_ratio(by_mark[mark], 16, BATCH):.2f}x",
            ]
        )
    print()
    print(
        f"== B_simple along a one-worker run (batch {BATCH}, sgd(lr=0.05, momentum=0.9)), {seeds} seed(s) pooled; "
        f"the samples W workers of {BATCH} need over one worker, by the model"
    )
    table(rows, ["training samples", "B_simple", f"{AIM_WORKERS} workers", "16 workers"])
    # (1 + W b / B) / (1 + b / B) <= r  <=>  B >= b (W - r) / (r - 1)
    floor = BATCH * (AIM_WORKERS - AIM_RATIO) / (AIM_RATIO - 1)
    early = [m for m in marks if 0 < m < EARLY]  # trained, and before one worker is at its best
    if early:  # the most favourable point of that phase: the largest noise scale
        best = max(early, key=lambda m: by_mark[m])
        print(
            f"aim samples <= {AIM_RATIO:g}x at {AIM_WORKERS} workers of {BATCH} needs B_noise >= {floor:.0f}; "
            f"the largest B_simple from {early[0]} to {early[-1]} samples: {by_mark[best]:.0f} at {best} "
            f"({samples_ratio(by_mark[best], AIM_WORKERS, BATCH):.2f}x: "
            f"{'within reach' if by_mark[best] >= floor else 'out of reach by the model'})"
        )


def pooled(scales: list[NoiseScale]) -> float:
    """B_simple of several measurements: tr(Sigma) and |G|^2 averaged apart, then divided
    (as the paper averages them: one estimate with |G|^2 near 0 would shoot up alone)."""
    return NoiseScale(
        statistics.fmean(n.gradient_sq for n in scales), statistics.fmean(n.trace_sigma for n in scales)
    ).b_simple


if __name__ == "__main__":
    main()
