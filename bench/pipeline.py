"""Pipeline model parallelism (--worker-parallel pipeline): 2 and 4 stages vs one process.

The large MLP (~7.9M parameters) of the other benchmarks, batch 256, plain SGD, one torch
thread per rank, on synthetic data: the unsplit model in one process, the same model as
one stage run micro-batch by micro-batch (the cost of micro-batches alone), then cut into 2 and
4 stages on as many ranks (bench/_pipeline_worker.py: nbdist's StageRunner, stage sends
and the flat SGD step of each stage), with GPipe and 1F1B; the one process runs before
and after them, and its faster run is kept. Prints samples/s, its ratio to
the one process, and each configuration's measured bubble (the largest, over the
stages, of the time a stage waited for the others over its step time) against the ideal
(p - 1) / (m + p - 1), and samples per CPU second of all the stages together (the work
pipelining costs, which the load on a shared box does not change much).

What to expect: a pipeline does not make one sample faster; it spreads a model that does
not fit one process over P of them. Its ideal speed-up over one process is P x (1 -
bubble) when each stage has a core; on a machine with fewer free cores than stages the
stages take turns on the cores and the bubble measured includes that.

Usage: python bench/pipeline.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import MLPS, count_params, header, run_mpi, table

from nbdist.train.pipeline_schedule import ideal_bubble

WORKER = str(Path(__file__).resolve().parent / "_pipeline_worker.py")


def measure(ranks: int, micro: int, schedule: str, common: list[str]) -> dict:
    results = run_mpi(ranks, [WORKER, "--micro-batches", str(micro), "--schedule", schedule, *common], timeout=600)
    return {
        "samples_per_s": min(r["samples_per_s"] for r in results),
        "bubble": max(r["bubble"] for r in results),
        # Samples per CPU second of all the stages together: what pipelining costs in
        # work, whatever share of the cores the load leaves the ranks.
        "per_cpu_s": results[0]["samples"] / sum(r["cpu_s"] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    parser.add_argument("--micro-batches", type=int, default=8)
    args = parser.parse_args()
    steps, rounds = ("4", "2") if args.quick else ("10", "3")
    common = ["--model", "large", "--batch-size", "256", "--steps", steps, "--rounds", rounds]
    header(
        f"pipeline stages vs one process: large MLP ({count_params(MLPS['large']) / 1e6:.1f}M parameters), "
        f"batch 256, {args.micro_batches} micro-batches"
    )
    first = measure(1, 0, "gpipe", common)
    # One stage of the whole model through the StageRunner: what cutting a batch into
    # micro-batches costs (smaller matrix products) before any stage sends anything.
    runs = [(1, "gpipe", measure(1, args.micro_batches, "gpipe", common))]
    runs += [
        (stages, schedule, measure(stages, args.micro_batches, schedule, common))
        for stages in (2, 4)
        for schedule in ("gpipe", "1f1b")
    ]
    # The one process again after the pipelines, keeping its faster run (errs against them).
    again = measure(1, 0, "gpipe", common)
    one, one_cpu = (max(first[k], again[k]) for k in ("samples_per_s", "per_cpu_s"))
    rows = [["one process", 1, "-", one, "1.00x", one_cpu, "1.00x", "-", "-"]]
    for stages, schedule, got in runs:
        rows.append(
            [
                f"{stages} stage{'s' if stages > 1 else ''}, {args.micro_batches} micro-batches",
                stages,
                schedule,
                got["samples_per_s"],
                f"{got['samples_per_s'] / one:.2f}x",
                got["per_cpu_s"],
                f"{got['per_cpu_s'] / one_cpu:.2f}x",
                f"{got['bubble']:.2f}",
                f"{ideal_bubble(stages, args.micro_batches):.2f}",
            ]
        )
    table(
        rows,
        [
            "run",
            "ranks",
            "schedule",
            "samples/s",
            "vs one process",
            "samples/CPU s",
            "vs one process",
            "bubble measured",
            "bubble (p-1)/(m+p-1)",
        ],
    )


if __name__ == "__main__":
    main()
