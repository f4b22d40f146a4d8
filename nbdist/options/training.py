"""TrainOptions: the options of a training run, each field with its flag and help, and
the checks that need no model."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from nbdist.algorithms import RULES
from nbdist.errors import OptionsError
from nbdist.options.fields import _opt, check_types, flag
from nbdist.options.target import parse_target
from nbdist.store import check_store
from nbdist.transport.compression import CODECS, parse_compression
from nbdist.transport.reducers import REDUCERS

__all__ = [
    "TrainOptions",
    "TOPOLOGIES",
    "MOMENTUM_CORRECTIONS",
    "DEVICES",
    "LR_SCALINGS",
    "PRECISIONS",
    "WORKER_PARALLELS",
    "PIPELINE_SCHEDULES",
    "BUSY_POLLS",
    "DEFAULT_LR_SCALING",
    "allreduce_backends",
]

TOPOLOGIES = ("master-worker", "allreduce")
# What --momentum-correction takes (nbdist.train.asynchrony applies it; the options stay
# free of the training package).
MOMENTUM_CORRECTIONS = ("auto", "off")
DEVICES = ("auto", "cpu", "cuda")
# How the learning rate grows with the number of workers W (train/lr.py). One constant:
# the convergence bench may change the default.
LR_SCALINGS = ("none", "linear", "sqrt")
# What --precision takes (the backends map each to their framework's dtypes).
PRECISIONS = ("fp32", "bf16", "fp16")
# How a worker's --procs-per-worker processes share its work: each a replica of the whole
# model whose gradients they allreduce, or each one pipeline stage of it.
WORKER_PARALLELS = ("allreduce", "pipeline")
PIPELINE_SCHEDULES = ("gpipe", "1f1b")
# The options only --worker-parallel pipeline reads.
PIPELINE_ONLY = ("micro_batches", "pipeline_schedule")
# How a rank waits for its peers (transport/waiting.py): polling without sleeping, or
# between short sleeps; auto picks by whether the node's ranks fit its cores.
BUSY_POLLS = ("auto", "on", "off")
DEFAULT_LR_SCALING = "none"


def allreduce_backends() -> list[str]:
    """What --allreduce-backend takes: auto, then every reducer registered."""
    return ["auto", *REDUCERS.names()]


@dataclass
class TrainOptions:
    model: str | None = _opt(None, "Python file defining build_model() (and optionally loss, metric, data)")
    topology: str = _opt("master-worker", "master-worker (parameter server) or allreduce", choices=TOPOLOGIES)
    algorithm: str | None = _opt(
        None,
        "the update rule, optionally with parameters, e.g. 'easgd(elastic_momentum=0.5)' (--topology "
        "allreduce trains with sgd)",
        registry=RULES,
        listed_default="downpour",
    )
    synchronous: bool = _opt(False, "master waits for every worker before each update (master-worker)")
    warm_start_epochs: int = _opt(
        0,
        "asynchronous master-worker runs: train the first E epochs synchronously, then go asynchronous "
        "(Dean et al. 2012's warm start); a checkpoint on either side of the switch resumes on that side",
    )
    workers: int | None = _opt(None, "workers per master (default: fill the MPI ranks)")
    masters: int = _opt(1, "masters per run; >1 puts sub-masters under a top master")
    procs_per_worker: int = _opt(1, "MPI processes per worker (a worker's gradient is allreduced over them)")
    worker_parallel: str = _opt(
        "allreduce",
        "how a worker's processes share its work: allreduce (each a replica, gradients allreduced) or "
        "pipeline (each one stage of the model file's build_stages(); PyTorch; with --topology allreduce, "
        "stage s of every replica allreduces its gradient with the others)",
        choices=WORKER_PARALLELS,
    )
    micro_batches: int = _opt(4, "pipeline: micro-batches each batch is cut into (--worker-parallel pipeline)")
    pipeline_schedule: str = _opt(
        "1f1b",
        "pipeline: gpipe (every forward, then every backward) or 1f1b "
        "(one forward, one backward: fewer activations held)",
        choices=PIPELINE_SCHEDULES,
    )
    epochs: int = _opt(5, "number of passes over the training data")
    batch_size: int = _opt(32, "samples per batch per worker")
    sync_every: int | None = _opt(None, "batches between a worker's exchanges with its master (default per algorithm)")
    worker_optimizer: str | None = _opt(None, "worker optimizer, e.g. sgd(lr=0.05, momentum=0.9) or adam(lr=1e-3)")
    master_optimizer: str | None = _opt(None, "master optimizer (downpour), e.g. sgd(lr=0.05) or adam(lr=1e-3)")
    momentum_correction: str = _opt(
        "auto",
        "auto: an asynchronous master's momentum is lowered by the 1 - 1/workers that asynchrony adds "
        "(Mitliagkas et al. 2016); where there is no momentum to lower, each update's lr (downpour's default "
        "master) or each update (adag, gem) is divided by 1 + its staleness from 8 workers (Jiang et al. 2017); "
        "diloco's and async_local_sgd's outer momentum is lowered the same way; "
        "off: kept as given (a total of 1 or more gets a warning)",
        choices=MOMENTUM_CORRECTIONS,
    )
    lr_scaling: str = _opt(
        DEFAULT_LR_SCALING,
        "none, linear or sqrt: multiply the learning rate by W or sqrt(W), W the number of workers, where one "
        "step takes the combined gradient of all W (an effective batch W times --batch-size; Goyal et al. 2017): "
        "the allreduce workers' optimizer, the master optimizer of --synchronous downpour, gem's lr with "
        "--synchronous, and the workers' optimizer of --synchronous diloco, whose round averages the W "
        "workers' local steps (with --sync-every 1, sgd, outer_lr=1 and no outer momentum: allreduce's "
        "step). Asynchronous updates and other rules' local steps are not scaled: each comes from one "
        "worker's batch, and the centre already receives W times as many of them",
    )
    warmup_epochs: float = _opt(
        0.0,
        "gradual warm-up over this many epochs (a fraction is fine): the lr rises linearly, step by step, to its "
        "target, starting from the unscaled lr when --lr-scaling raises it (Goyal et al. 2017), else from a "
        "tenth of it; for every optimizer and rule lr, asynchronous masters included",
    )
    worker_lr_schedule: str | None = _opt(
        None,
        "learning-rate schedule of the workers' optimizer (or of a rule's own lr, gem's), stepped per epoch: "
        "a torch.optim.lr_scheduler class by name (Keras: a keras.optimizers.schedules class, its steps being "
        'epochs), e.g. "cosineannealinglr(T_max=20)"; warm-up multiplies on top',
    )
    master_lr_schedule: str | None = _opt(
        None,
        'learning-rate schedule of the master optimizer (downpour), e.g. "steplr(step_size=5, gamma=0.5)"; '
        "like --worker-lr-schedule",
    )
    seed: int = _opt(0, "seed for weights, shuffling and dropout")
    validate_every: int = _opt(1, "validate every N epochs")
    validate_every_samples: int | None = _opt(
        None,
        "also validate every N training samples (counted over all workers, at least --batch-size): "
        "'val' records with samples_seen, for samples-to-accuracy finer than an epoch; early stopping, "
        "--target and the summary keep to the epoch validations",
    )
    early_stopping: int | None = _opt(None, "stop after N validations without improvement of --monitor")
    monitor: str = _opt("val_loss", "metric watched by early stopping: val_loss, val_acc, ...")
    min_delta: float = _opt(0.0, "smallest change of --monitor that counts as an improvement")
    target: str | None = _opt(None, "stop when a condition holds, e.g. 'val_acc > 0.97'")
    checkpoint_every: int = _opt(
        1,
        "write a checkpoint every N epochs (0: only at the end; one is always "
        "written at the end and when the run is stopped)",
    )
    keep_checkpoints: int = _opt(
        3,
        "checkpoints kept on disk, newest first (older ones are deleted); at least 2, "
        "so that a damaged latest checkpoint falls back to the one before",
    )
    resume: str | None = _opt(None, "run directory to resume from its last checkpoint")
    max_restarts: int = _opt(
        0,
        "after a rank fails (allreduce, synchronous runs, a master), restart from the last "
        "checkpoint up to N times, on the surviving ranks",
    )
    peer_timeout: float | None = _opt(
        None,
        "seconds a rank may go without a message from a peer it waits for "
        "before that peer counts as frozen (default: from the measured step "
        "time, at least 60)",
    )
    runs_dir: str = _opt("runs", "where run directories are created")
    store: str | None = _opt(
        None,
        "run store the run is recorded in, for the dashboard: a SQLite file (NAME.db, or a path in a directory "
        "that exists) or postgresql://USER@HOST:PORT/DB, its password in PGPASSWORD, ~/.pgpass or a service "
        "file, never in the URL (default: RUNS_DIR/nbdist.db; 'off' records nothing)",
    )
    run_name: str | None = _opt(None, "name of the run directory (default: time, algorithm, topology)")
    threads: int = _opt(1, "framework threads per rank (torch, TensorFlow)")
    precision: str = _opt(
        "fp32",
        "fp32, bf16 or fp16: what the forward and backward passes compute in (torch.autocast; "
        "Keras' mixed_bfloat16/mixed_float16 policy); weights, gradients and optimizers stay "
        "float32; fp16 scales the loss (steps whose gradient overflows are skipped)",
        choices=PRECISIONS,
    )
    sync_batchnorm: bool = _opt(
        False,
        "synchronised BatchNorm (PyTorch): each BatchNorm layer normalises with the "
        "statistics of the whole batch of the ranks that share one (a worker's "
        "processes with --procs-per-worker > 1, or every allreduce rank), reduced "
        "in the forward pass, their gradients in the backward pass",
    )
    device: str = _opt(
        "auto",
        "where a PyTorch worker's model lives: auto (cuda where torch sees a GPU, else the "
        "CPU with numpy views), cuda (GPU local_rank mod gpus; not yet run on a GPU) or cpu "
        "(the GPU path's tensors and staging, run on the CPU)",
        choices=DEVICES,
    )
    busy_poll: str = _opt(
        "auto",
        "how a rank waits for its peers: on (it polls without sleeping: the shortest reply times and a core "
        "that stays warm, but one busy core per waiting rank), off (it polls between short sleeps that give "
        "the core away) or auto (on where this node's ranks of the launch, times --threads, fit the cores "
        "they may run on, and only while a rank does not wait for its core behind other work; off when "
        "oversubscribed, when the launcher does not say how many ranks share the node, and under "
        "JupyterHub outside a batch job: a login node's idle cores are other people's)",
        choices=BUSY_POLLS,
    )
    bucket_mb: float = _opt(2.0, "allreduce bucket size in MB (gradients reduced while backward runs)")
    compression: str = _opt(
        "none",
        "what gradients and worker-to-master messages travel as, e.g. 'topk(0.01)' (a codec of one "
        "parameter takes it by position too)",
        registry=CODECS,
        listed_default="none",
    )
    allreduce_backend: str = _opt(
        "auto",
        "what reduces the allreduce topology's gradient buckets: auto (nccl where the model is on a GPU, "
        "torch has NCCL and each rank has a GPU of its own, else mpi) or one of the reducers",
        registry=REDUCERS,
    )
    quiet: bool = _opt(False, "print only the final summary")
    trace_updates: bool = _opt(
        False,
        "also record every update the master applies (source rank, staleness, "
        "version) in the run's log; by default a master records one summary per "
        "half second (counts and staleness histogram per worker), so a run's "
        "records stay few whatever its update rate",
    )
    # -- data in files (instead of the model's load_data) --------------------------------
    train: str | None = _opt(
        None,
        "training data: HDF5 files, comma-separated paths or globs, "
        "e.g. 'data/jets/train_*.h5' (replaces the model's load_data)",
    )
    val: str | None = _opt(None, "validation data: HDF5 files or globs, like --train")
    cache_dir: str | None = _opt(
        None,
        "node-local directory each rank copies the files it reads into (removed at the end), e.g. /tmp/nbdist-cache",
    )
    data_keys: str = _opt("features,labels", "names of the features and labels datasets in the HDF5 files")
    gan: bool = _opt(
        False,
        "train a GAN: the model file or cell defines generator and discriminator (or "
        "build_generator() and build_discriminator()) and latent_dim; easgd (default), adag or dynsgd, "
        "worker optimizer rmsprop and --monitor val_mmd by default",
    )
    d_steps: int = _opt(1, "GAN: discriminator steps per generator step")

    # -- validation -----------------------------------------------------------------
    def validate(self) -> TrainOptions:
        check_types(self)
        if self.topology not in TOPOLOGIES:
            raise OptionsError(f"unknown topology {self.topology!r}; choose one of: {', '.join(TOPOLOGIES)}")
        if self.momentum_correction not in MOMENTUM_CORRECTIONS:
            raise OptionsError(
                f"unknown --momentum-correction {self.momentum_correction!r}; choose one of: "
                f"{', '.join(MOMENTUM_CORRECTIONS)}"
            )
        if self.busy_poll not in BUSY_POLLS:
            raise OptionsError(f"unknown --busy-poll {self.busy_poll!r}; choose one of: {', '.join(BUSY_POLLS)}")
        if self.device not in DEVICES:
            raise OptionsError(f"unknown --device {self.device!r}; choose one of: {', '.join(DEVICES)}")
        positive = (
            "epochs",
            "batch_size",
            "masters",
            "procs_per_worker",
            "validate_every",
            "threads",
            "d_steps",
            "micro_batches",
        )
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise OptionsError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("workers", "sync_every", "early_stopping"):
            value = getattr(self, name)
            if value is not None and int(value) < 1:
                raise OptionsError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.validate_every_samples is not None and self.validate_every_samples < self.batch_size:
            raise OptionsError(
                f"--validate-every-samples must be at least one batch (--batch-size "
                f"{self.batch_size}), got {self.validate_every_samples}"
            )
        if self.warm_start_epochs:
            self._check_warm_start()
        if self.checkpoint_every < 0:
            raise OptionsError("--checkpoint-every must be 0 (only at the end) or more")
        if self.keep_checkpoints < 2:
            raise OptionsError(
                f"--keep-checkpoints must be at least 2 (the previous checkpoint is the fallback "
                f"when the latest is damaged), got {self.keep_checkpoints}"
            )
        if self.precision not in PRECISIONS:
            raise OptionsError(f"--precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        if self.gan and self.precision != "fp32":
            raise OptionsError(f"--precision {self.precision} is for models; --gan trains in fp32")
        if self.lr_scaling not in LR_SCALINGS:
            raise OptionsError(f"--lr-scaling {self.lr_scaling!r}: choose one of {', '.join(LR_SCALINGS)}")
        if self.warmup_epochs < 0:
            raise OptionsError(f"--warmup-epochs must be 0 (no warm-up) or more, got {self.warmup_epochs}")
        if self.max_restarts < 0:
            raise OptionsError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        if self.peer_timeout is not None and not self.peer_timeout > 0:
            raise OptionsError(f"--peer-timeout must be a number of seconds above 0, got {self.peer_timeout}")
        run_name = self.run_name
        if run_name is not None and (Path(run_name).name != run_name or run_name in ("", ".", "..")):
            raise OptionsError(
                f"--run-name {run_name!r}: a directory name inside --runs-dir, without '/'; "
                f"give the parent directory with --runs-dir"
            )
        if not self.bucket_mb > 0:
            raise OptionsError(f"--bucket-mb must be above 0, got {self.bucket_mb}")
        parse_compression(self.compression)
        if self.allreduce_backend not in allreduce_backends():
            raise OptionsError(
                f"--allreduce-backend {self.allreduce_backend!r}: choose one of {', '.join(allreduce_backends())}"
            )
        if self.allreduce_backend != "auto" and self.topology != "allreduce":
            raise OptionsError(
                f"--allreduce-backend {self.allreduce_backend} applies to --topology allreduce (a "
                f"worker of several processes reduces its gradient over MPI)"
            )
        if self.min_delta < 0:
            raise OptionsError(
                f"--min-delta must be 0 or more (an improvement by at least this much), got {self.min_delta}"
            )
        if self.target is not None:
            parse_target(self.target)
        check_store(self.store)
        self._validate_files()
        if self.topology == "allreduce" and self.masters != 1:
            raise OptionsError("--masters applies to the master-worker topology; allreduce has no master")
        self._validate_pipeline()
        return self

    def refuse_pipeline_options(self, given: Iterable[str]) -> TrainOptions:
        """These options, or one error where a run without a pipeline was given (`given`:
        the names set on the command line or in the call) options only a pipeline reads.
        validate() sees the values alone, which cannot tell `--micro-batches 4`, the
        default, from nothing."""
        given = set(given)
        named = [flag(name) for name in PIPELINE_ONLY if name in given]
        if named and self.worker_parallel in WORKER_PARALLELS and self.worker_parallel != "pipeline":
            raise OptionsError(
                f"{' and '.join(named)} appl{'y' if len(named) > 1 else 'ies'} to pipeline "
                f"workers: add --worker-parallel pipeline (and --procs-per-worker, one process "
                f"per stage)"
            )
        return self

    def _validate_pipeline(self) -> None:
        if self.worker_parallel not in WORKER_PARALLELS:
            raise OptionsError(
                f"unknown --worker-parallel {self.worker_parallel!r}; choose one of: {', '.join(WORKER_PARALLELS)}"
            )
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise OptionsError(
                f"unknown --pipeline-schedule {self.pipeline_schedule!r}; choose one of: "
                f"{', '.join(PIPELINE_SCHEDULES)}"
            )
        if self.worker_parallel != "pipeline":
            self.refuse_pipeline_options(
                [name for name in PIPELINE_ONLY if getattr(self, name) != getattr(TrainOptions, name)]
            )
            return
        if self.procs_per_worker < 2:
            raise OptionsError(
                "--worker-parallel pipeline needs --procs-per-worker 2 or more: one process per pipeline stage"
            )
        if self.gan:
            raise OptionsError(
                "--gan does not apply to --worker-parallel pipeline: a GAN's generator and "
                "discriminator train in one process per worker"
            )
        if self.precision != "fp32":
            raise OptionsError(
                f"--precision {self.precision} does not apply to --worker-parallel pipeline: its stages "
                f"train in fp32; drop --precision, or train without a pipeline"
            )
        if self.sync_batchnorm:
            # Its processes hold different layers: no two of them normalise the same channels.
            raise OptionsError(
                "--sync-batchnorm does not apply to --worker-parallel pipeline: each process holds "
                "a different stage, so no two share a BatchNorm layer's batch (a stage's BatchNorm "
                "normalises over each micro-batch)"
            )
        if self.batch_size < self.micro_batches:
            raise OptionsError(
                f"--micro-batches {self.micro_batches} cuts a batch into that many parts: "
                f"--batch-size must be at least as large, got {self.batch_size}"
            )

    def _validate_files(self) -> None:
        if self.train and not self.val:
            raise OptionsError("--train needs --val: the HDF5 files to validate on, e.g. --val 'data/val_*.h5'")
        for name in ("val", "cache_dir"):
            if getattr(self, name) and not self.train:
                raise OptionsError(f"{flag(name)} applies to data in files: give --train as well")
        keys = [k.strip() for k in self.data_keys.split(",")]
        if len(keys) != 2 or not all(keys):
            raise OptionsError(
                f"--data-keys takes the features and the labels dataset names, e.g. "
                f"'features,labels'; got {self.data_keys!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise OptionsError(f"unknown option(s): {', '.join(unknown)}")
        return cls(**values)

    def _check_warm_start(self) -> None:
        """A warm start is a synchronous phase before an asynchronous master-worker run."""
        e = self.warm_start_epochs
        if isinstance(e, bool) or int(e) != e or e < 0:
            raise OptionsError(f"--warm-start-epochs must be a whole number of epochs, 0 or more, got {e!r}")
        if self.topology != "master-worker" or self.synchronous:
            raise OptionsError(
                "--warm-start-epochs makes an asynchronous master-worker run synchronous for its first "
                f"epochs; this run is {'synchronous' if self.synchronous else self.topology} throughout: drop it"
            )
        if e >= self.epochs:
            raise OptionsError(
                f"--warm-start-epochs {e} is not shorter than the run (--epochs {self.epochs}): the run "
                f"would never go asynchronous; give fewer warm-start epochs, or --synchronous"
            )

    def replace(self, **changes: Any) -> TrainOptions:
        return dataclasses.replace(self, **changes)
