"""Does communicating less pay on a slow link? (issue 29; a script, not a test)

The tests' 2-node SLURM set-up (tests/slurm_cluster.py: this machine's root network
namespace and a second one, joined by a veth pair) with the veth pair throttled by `tc`'s
token bucket filter on both ends, at each rate of --rates. Each rule trains
`examples/jet_cnn.py` on the jet sample of bench/convergence.py with 2 workers across the
two nodes (one sbatch job per rule and rate, `--nodes 2`; master/worker rules have a
master rank besides), batch 32 per worker, for --epochs epochs. Per rule and rate the
table gives training samples per second (over all workers, from the run's summary: its
epochs' samples over their seconds, start-up left out), the ratio of the slowest rate's to
the fastest's, the bytes the workers handed to MPI per sample, and the bytes that crossed
the veth pair (both ways, counted on its first node's end) per sample.

Usage (root, SLURM and munge installed; hold the CPU lock and ask for quiet):
    python bench/throttled_link.py [--rates 1gbit,100mbit] [--rules diloco,easgd,downpour,allreduce]
        [--epochs 2]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _common import ROOT, header, table
from _convergence_units import jet_sample, rule_options
from slurm_cluster import SlurmCluster, slurm_missing

from nbdist.metrics import read_log

JOB_DEADLINE = 240.0
NAN = float("nan")
RULES = ["diloco", "easgd", "downpour", "allreduce"]
RATE = re.compile(r"^(\d+)(k|m|g)bit$")


def rate_bits(rate: str) -> int:
    match = RATE.match(rate)
    if not match:
        raise SystemExit(f"--rates: {rate!r} is not a rate like 1gbit, 100mbit or 500kbit")
    return int(match[1]) * {"k": 10**3, "m": 10**6, "g": 10**9}[match[2]]


def throttle(slurm: SlurmCluster, rate: str) -> None:
    """A token bucket on both ends of the veth pair: `rate`, a burst of 10 ms of it (at
    least 32 kB; a burst below rate/HZ could not reach the rate), packets queued at most
    100 ms."""
    burst = max(rate_bits(rate) // 8 // 100, 32 * 1024)
    shape = ["qdisc", "replace", "dev", slurm.interface, "root", "tbf", "rate", rate, "burst", str(burst)]
    shape += ["latency", "100ms"]
    for argv in (["tc", *shape], ["tc", "-n", slurm.netns, *shape]):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise SystemExit(f"`{' '.join(argv)}` exited {done.returncode}: {done.stderr.strip()}")


def job(slurm: SlurmCluster, rule: str, rate: str, args: argparse.Namespace, work: Path) -> dict:
    """One sbatch job of `rule` across the two nodes; its samples/s, bytes and placement."""
    name = f"{rule}-{rate}"
    script, output = work / f"{name}.sh", work / f"{name}.out"
    if rule == "allreduce":
        ranks, options = 2, ["--topology", "allreduce"]
    else:
        ranks, options = 3, rule_options(rule)
    train_glob, val_glob = jet_sample(Path(args.cache).expanduser())
    written = subprocess.run(
        [sys.executable, "-m", "nbdist", "slurm-script", "-n", str(ranks), "--nodes", "2"]
        + ["--interface", slurm.interface, "--partition", slurm.two_node_partition, "--time", "10"]
        + ["--job-name", name, "--output", str(output), "--write", str(script), "--"]
        + ["train", "--model", str(ROOT / "examples" / "jet_cnn.py"), "--train", train_glob, "--val", val_glob]
        + ["--epochs", str(args.epochs), "--batch-size", "32", "--seed", "0", "--checkpoint-every", "0"]
        + ["--runs-dir", str(work), "--run-name", name, *options],
        cwd=ROOT,
        env=slurm.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if written.returncode != 0:
        raise SystemExit(f"nbdist slurm-script for {name} failed:\n{written.stdout}{written.stderr}")
    t0, before = time.perf_counter(), psutil.net_io_counters(pernic=True)[slurm.interface]
    fields = slurm.wait_job(slurm.sbatch(script, cwd=ROOT), JOB_DEADLINE)
    wall, after = time.perf_counter() - t0, psutil.net_io_counters(pernic=True)[slurm.interface]
    crossed = after.bytes_sent - before.bytes_sent + after.bytes_recv - before.bytes_recv
    said = output.read_text(errors="replace") if output.exists() else "(no output file)"
    if (fields["JobState"], fields["ExitCode"]) != ("COMPLETED", "0:0"):
        print(f"   {name}: job {fields['JobState']} {fields['ExitCode']}\n{said[-3000:]}", flush=True)
        return {"rule": rule, "rate": rate, "error": fields["JobState"]}
    summary = json.loads((work / name / "summary.json").read_text())
    samples = sum(epoch["samples"] for epoch in summary["history"])
    seconds = sum(epoch["seconds"] for epoch in summary["history"])
    sent = trained = 0
    for record in read_log(work / name, "train"):
        sent += int(record["values"].get("bytes_sent", 0))
        trained += int(record["values"].get("samples", 0))
    result = {
        "rule": rule,
        "rate": rate,
        "samples_per_s": samples / seconds if seconds else float("nan"),
        "bytes_per_sample": sent / trained if trained else float("nan"),
        "val_acc": summary["final"].get("val_acc"),
        "link_bytes_per_sample": crossed / samples if samples else float("nan"),
        "job_s": wall,
    }
    print(
        f"   {name}: {result['samples_per_s']:.0f} samples/s, {result['bytes_per_sample']:.0f} bytes sent / sample, "
        f"{result['link_bytes_per_sample']:.0f} bytes across the link / sample, val acc {result['val_acc']}, "
        f"job {wall:.0f} s",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1gbit,100mbit", help="tc rates of the veth pair, e.g. 1gbit,100mbit")
    parser.add_argument("--rules", default=",".join(RULES), help=f"from {', '.join(RULES)}")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--cache", default="~/.cache/nbdist/bench", help="where the jet sample is kept")
    args = parser.parse_args()
    rates = [r for r in args.rates.split(",") if r]
    for rate in rates:
        rate_bits(rate)
    rules = [r for r in args.rules.split(",") if r]
    unknown = sorted(set(rules) - set(RULES))
    if unknown:
        parser.error(f"unknown rule(s) {', '.join(unknown)}; choose from {', '.join(RULES)}")
    missing = slurm_missing()
    if missing:
        raise SystemExit(f"throttled_link needs SLURM: {missing}")
    header("throttled link: samples/s of each rule across two nodes whose veth pair is throttled")
    print(f"   {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; rates {', '.join(rates)}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="nbdist-throttled-") as tmp:
        with SlurmCluster(Path(tmp) / "slurm") as slurm:
            if not slurm.two_nodes:
                raise SystemExit(f"throttled_link needs two nodes: {slurm.one_node_why}")
            for rate in rates:
                throttle(slurm, rate)
                for rule in rules:
                    results.append(job(slurm, rule, rate, args, Path(tmp)))
    rows = []
    for rule in rules:
        by_rate = {r["rate"]: r for r in results if r["rule"] == rule and "error" not in r}
        speeds = [by_rate[rate]["samples_per_s"] if rate in by_rate else float("nan") for rate in rates]
        sent = [by_rate[rate]["bytes_per_sample"] for rate in rates if rate in by_rate]
        crossed = [by_rate[rate]["link_bytes_per_sample"] for rate in rates if rate in by_rate]
        slowdown = speeds[-1] / speeds[0] if len(speeds) > 1 else 1.0
        rows.append([rule, *speeds, slowdown, sent[0] if sent else NAN, crossed[0] if crossed else NAN])
    print()
    table(
        rows,
        [
            "rule",
            *[f"samples/s at {rate}" for rate in rates],
            f"{rates[-1]} / {rates[0]}",
            "bytes sent / sample",
            "bytes across the link / sample",
        ],
    )
    print("BENCH_JSON " + json.dumps(results))


if __name__ == "__main__":
    main()
