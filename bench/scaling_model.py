"""Does the performance model predict what it did not measure? (a script, not a test)

`python -m nbdist scale` calibrates the model on 1-2 ranks (the model's step alone and with
every core busy, messages and a two-rank allreduce, the rules' costs, a lone allreduce rank
and a master serving one worker), then measures every other configuration that fits this
machine, up to --ranks ranks: allreduce (weak and strong scaling), each master/worker
rule, sub-masters, --sync-every and a synchronous master, with more ranks than cores
included (the model treats those as sharing the cores). Each point's prediction comes
from the calibration alone. Per configuration: predicted and measured samples/s and mean
staleness, and the errors; then the aim line.

Usage: python bench/scaling_model.py [--quick] [--ranks 4] [--repeats 2] [--model examples/digits_cnn.py]
       [--setups "easgd gem"] [--runs-dir DIR] [--combine DIR ... [--repredict]]

A sweep too long for one sitting splits by --setups (each part calibrates anew); with
--runs-dir each part's study stays there, and --combine DIR... prints the aim line over
the parts' configurations together (no new measurement); --repredict predicts each of them
anew, from its part's calibration, with the model as it is now (to try a change of the
model against measurements already made).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT, header  # noqa: E402

from nbdist.scaling.analysis import Comparison, between_nodes, machine_of, predicted_point  # noqa: E402
from nbdist.scaling.inputs import Calibration  # noqa: E402
from nbdist.scaling.model import PerformanceModel  # noqa: E402
from nbdist.scaling.report import calibration_text, comparison_text  # noqa: E402
from nbdist.scaling.store import scale_records  # noqa: E402
from nbdist.store import RunStore  # noqa: E402

SETUPS = (
    "allreduce downpour easgd gem adag dynsgd downpour(masters=2) downpour(sync_every=4) downpour(synchronous=True)"
)
QUICK_SETUPS = "allreduce downpour gem downpour(masters=2) downpour(sync_every=4)"
MEDIAN_AIM, WORST_AIM = 0.10, 0.20
DEADLINE = 590.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer set-ups, one run per point")
    parser.add_argument("--ranks", type=int, default=4, help="the largest rank count (default 4: twice 2 cores)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per point, the fastest kept (default 2)")
    parser.add_argument("--model", default=str(ROOT / "examples" / "digits_cnn.py"))
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds each point trains (default 2)")
    parser.add_argument("--setups", default=None, help="the set-ups to measure (default: the script's list)")
    parser.add_argument("--runs-dir", default=None, help="keep the study here (default: a temporary directory)")
    parser.add_argument("--combine", nargs="+", default=None, help="studies kept with --runs-dir: their aim line")
    parser.add_argument("--repredict", action="store_true", help="with --combine: predict anew, by the model as it is")
    args = parser.parse_args()
    if args.combine:
        checking = _repredicted if args.repredict else _checked
        checked = [c for directory in args.combine for c in checking(_records(Path(directory) / "nbdist.db"))]
        print(f"== combined: {', '.join(args.combine)}" + (", predicted anew" if args.repredict else ""))
        print(_breakdown(checked), "\n", sep="")
        _aim(checked)
        return
    repeats = args.repeats or (1 if args.quick else 2)
    header("scaling model: predicted (from a 1-2 rank calibration) vs measured")
    print(f"   {time.strftime('%Y-%m-%d %H:%M')}, up to {args.ranks} ranks, {repeats} run(s) per point", flush=True)
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="nbdist-scaling-") as scratch:
        tmp = args.runs_dir or scratch
        store = str(Path(tmp) / "nbdist.db")
        command = [
            sys.executable,
            "-m",
            "nbdist",
            "launch",
            "-n",
            str(args.ranks),
            "scale",
            "--model",
            args.model,
            "--setups",
            args.setups or (QUICK_SETUPS if args.quick else SETUPS),
            "--repeats",
            str(repeats),
            "--runs-dir",
            tmp,
            "--store",
            store,
            "--run-name",
            "bench",
            "--max-ranks",
            "64",
        ]
        if args.seconds:
            command += ["--seconds", str(args.seconds)]
        if args.quick:
            command += ["--quick"]
        started = time.time()
        done = subprocess.run(command, capture_output=True, text=True, timeout=DEADLINE)
        loads.append(os.getloadavg()[0])
        if done.returncode != 0:
            print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
            raise SystemExit(f"the scaling study failed (exit {done.returncode})")
        found = _records(Path(store))
    print(f"   the study took {time.time() - started:.0f} s; load average {loads[0]:.2f} before, {loads[1]:.2f} after")
    calibration = Calibration.from_dict(found["calibration"][-1])
    print(
        f"   calibrated on {calibration.ranks} ranks ({calibration.cores} cores) in "
        f"{calibration.seconds:.0f} s, with a lone allreduce rank and a master with one worker:\n"
    )
    print(calibration_text(calibration), *calibration.notes, "", sep="\n")
    comparisons = [Comparison.from_dict(entry) for entry in found["measured"]]
    print(comparison_text(comparisons), "\n", sep="")
    print(_breakdown(comparisons), "\n", sep="")
    _aim(_checked(found))


def _records(store: Path) -> dict:
    with RunStore(str(store)) as opened:
        return scale_records(opened, "bench")


def _checked(found: dict) -> list[Comparison]:
    """The measured configurations but the calibration's own."""
    comparisons = [Comparison.from_dict(entry) for entry in found["measured"]]
    return [c for c in comparisons if not (c.measured.extra or {}).get("calibration")]


def _repredicted(found: dict) -> list[Comparison]:
    """`_checked`'s configurations, each predicted anew from the study's calibration, on the
    node it ran on (less what other processes took of its cores), as the study did."""
    calibration = Calibration.from_dict(found["calibration"][-1])
    network = between_nodes(calibration, None)
    again = []
    for c in _checked(found):
        m = c.measured
        model = PerformanceModel(calibration, machine_of(m, calibration.cores, network))
        again.append(Comparison(m, predicted_point(model, m)))
    return again


def _breakdown(comparisons: list[Comparison]) -> str:
    """Where each configuration's time goes, predicted beside measured: a worker's step (or
    exchange cycle) split into compute, communicate and wait, in ms; the other processes'
    cores and each rank's share of a core while runnable during the measurement."""
    rows = [
        "| set-up | scaling | ranks | batch | samples/s error | step ms pred. | meas. | compute pred. | meas. "
        "| communicate pred. | meas. | wait pred. | meas. | others' cores | ranks' shares |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in comparisons:
        m, p, extra = c.measured, c.predicted, c.measured.extra or {}
        shares = ", ".join("-" if v is None else f"{v:.2f}" for v in extra.get("shares") or [])
        label = m.setup.label + (" (calibration)" if extra.get("calibration") else "")
        times = (p.step_s, m.step_s, p.compute_s, m.compute_s, p.communicate_s, m.communicate_s, p.wait_s, m.wait_s)
        rows.append(
            f"| {label} | {m.scaling} | {m.ranks} | {m.batch} | {c.error:+.0%} | "
            + " | ".join(f"{1e3 * t:.2f}" for t in times)
            + f" | {extra.get('others', 0.0):.2f} | {shares} |"
        )
    return "\n".join(rows)


def _aim(checked: list[Comparison]) -> None:
    errors = [abs(c.error) for c in checked]
    stale_errors = [abs(c.staleness_error) for c in checked if c.staleness_error is not None]
    every = errors + stale_errors
    median, worst = statistics.median(every), max(every)
    print(
        f"{len(checked)} configurations besides the calibration's; samples/s: median error "
        f"{statistics.median(errors):.1%}, worst {max(errors):.1%}; mean staleness: "
        + (
            f"median error {statistics.median(stale_errors):.1%}, worst {max(stale_errors):.1%}"
            if stale_errors
            else "-"
        )
    )
    met = median <= MEDIAN_AIM and worst <= WORST_AIM
    print(
        f"aim median error <= {MEDIAN_AIM:.0%}, worst <= {WORST_AIM:.0%} (samples/s and mean staleness, "
        f"{len(every)} figures): median {median:.1%}, worst {worst:.1%} ({'met' if met else 'not met'})"
    )


if __name__ == "__main__":
    main()
