"""The update rule, the optimisers and the compression a run's options name: their
defaults, and one OptionsError for a combination that cannot train. Pure (no MPI, no
model): train/settle.py resolves them on every rank during set-up."""

from __future__ import annotations

from nbdist.algorithms import Algorithm, make_algorithm, rule_class
from nbdist.errors import OptionsError
from nbdist.options import TrainOptions
from nbdist.specs import Spec, parse_spec
from nbdist.transport.compression import make_codec, parse_compression

__all__ = [
    "DEFAULT_WORKER_OPTIMIZER",
    "DEFAULT_MASTER_OPTIMIZER",
    "ALLREDUCE_ALIAS",
    "DEFAULT_GAN_ALGORITHM",
    "DEFAULT_GAN_WORKER_OPTIMIZER",
    "check_gan",
    "check_windows",
    "resolve_rules",
    "resolve_compression",
]

# Workers explore with momentum (GEM's own default is the same); lr 0.05 because 0.1 with
# momentum 0.9 (a step of 1.0 in effect) made 8-worker allreduce collapse on the jet images
# (bench/results/2026-11-24-convergence.md). A Downpour master gets no momentum by default:
# asynchronous updates already act as momentum (train/asynchrony.py), and a momentum-0.9
# master corrected for it learned digits more slowly with few workers (the correction
# assumes staleness W - 1; it is less: the same file).
DEFAULT_WORKER_OPTIMIZER = "sgd(lr=0.05, momentum=0.9)"
DEFAULT_MASTER_OPTIMIZER = "sgd(lr=0.1)"
# What --algorithm may also say for the allreduce topology's rule (the registered "sgd").
ALLREDUCE_ALIAS = "allreduce"
# GANs: EASGD with RMSprop workers, as the 3D calorimeter GAN was trained (see
# gan/training.py for why only rules whose workers send their weights apply).
DEFAULT_GAN_ALGORITHM = "easgd"
DEFAULT_GAN_WORKER_OPTIMIZER = "rmsprop(lr=0.001)"


def check_gan(options: TrainOptions) -> TrainOptions:
    """A GAN's defaults, or one error for a combination that cannot train one."""
    if not options.gan:
        if options.d_steps != 1:
            raise OptionsError("--d-steps applies to GANs: add --gan")
        return options
    if options.topology == "allreduce" or options.procs_per_worker > 1:
        raise OptionsError(
            "--gan trains on the master-worker topology with one process per worker: a GAN step "
            "takes discriminator steps before the generator's gradient, which one gradient reduction "
            f"cannot carry (drop {'--topology allreduce' if options.topology == 'allreduce' else '--procs-per-worker'})"
        )
    if options.sync_batchnorm:
        raise OptionsError(
            "--sync-batchnorm does not apply to --gan: a GAN trains with one process per worker, "
            "whose BatchNorm layers already normalise over its whole batch; drop --sync-batchnorm"
        )
    algorithm = make_algorithm(parse_spec(options.algorithm or DEFAULT_GAN_ALGORITHM, what="--algorithm"))
    if not algorithm.carries_local_steps:
        raise OptionsError(
            f"--gan trains with easgd, adag or dynsgd, whose workers send their weights (generator and "
            f"discriminator together); {algorithm.name} sends gradients, which would leave the "
            f"discriminator untrained"
        )
    # A GAN's val_loss is its discriminator's, which says little about the samples:
    # early stopping and targets watch the samples' distance to the data unless told.
    monitor = "val_mmd" if options.monitor == TrainOptions.monitor else options.monitor
    return options.replace(
        algorithm=options.algorithm or DEFAULT_GAN_ALGORITHM,
        worker_optimizer=options.worker_optimizer or DEFAULT_GAN_WORKER_OPTIMIZER,
        monitor=monitor,
    )


def resolve_rules(options: TrainOptions) -> tuple[Algorithm | None, int, Spec | None, Spec | None]:
    if options.topology == "allreduce":
        spec = parse_spec(options.algorithm or "sgd", what="--algorithm")
        if spec.name != ALLREDUCE_ALIAS and "allreduce" not in rule_class(spec.name).topologies:
            raise OptionsError(
                f"{spec.name} is a master/worker algorithm; the allreduce topology trains with "
                f"synchronous sgd (use --topology master-worker for {spec.name})"
            )
        if options.master_optimizer:
            raise OptionsError("--master-optimizer applies to the master-worker topology; allreduce has no master")
        if options.sync_every not in (None, 1):
            raise OptionsError("--sync-every applies to the master-worker topology; allreduce syncs every batch")
        return (
            None,
            1,
            parse_spec(options.worker_optimizer or DEFAULT_WORKER_OPTIMIZER, what="--worker-optimizer"),
            None,
        )

    algorithm = make_algorithm(parse_spec(options.algorithm or "downpour", what="--algorithm"))
    if options.worker_optimizer and not algorithm.uses_worker_optimizer:
        raise OptionsError(
            f"{algorithm.name} takes no worker optimizer: its workers step with its own lr and "
            f"momentum, e.g. --algorithm 'gem(lr=0.05, momentum=0.9)'"
        )
    if options.master_optimizer and not algorithm.uses_master_optimizer:
        raise OptionsError(
            f"{algorithm.name} takes no master optimizer: its master adds the workers' updates "
            f"to the centre; drop --master-optimizer"
        )
    worker: Spec | None = (
        parse_spec(
            options.worker_optimizer or algorithm.default_worker_optimizer or DEFAULT_WORKER_OPTIMIZER,
            what="--worker-optimizer",
        )
        if algorithm.uses_worker_optimizer
        else None
    )
    master = (
        parse_spec(options.master_optimizer or DEFAULT_MASTER_OPTIMIZER, what="--master-optimizer")
        if algorithm.uses_master_optimizer
        else None
    )
    window = algorithm.sync_window()
    if window is not None and options.sync_every not in (None, window):
        raise OptionsError(
            f"{algorithm.name} syncs every {window} batches (its inner_steps) and --sync-every says "
            f"{options.sync_every}: give one of them"
        )
    sync_every = options.sync_every or window or algorithm.default_sync_every
    if algorithm.name == "downpour" and sync_every == 1:
        # Downpour workers step locally only between pushes; with a push after every
        # batch a worker optimizer would be silently ignored.
        if options.worker_optimizer:
            raise OptionsError(
                "downpour with --sync-every 1 takes no worker optimizer (workers only compute "
                "gradients; the master's is --master-optimizer); use --sync-every > 1 for local steps"
            )
        worker = None
    return algorithm, sync_every, worker, master


def check_windows(algorithm: Algorithm | None, run: TrainOptions) -> None:
    """A rule that sets each worker's window by its speed (async_local_sgd's dynamic_steps)
    needs an asynchronous master. `run`: the whole run's options (under
    --warm-start-epochs, not its synchronous first phase's: the windows adapt after it)."""
    if algorithm is not None and algorithm.adapts_windows and run.synchronous:
        raise OptionsError(
            f"{algorithm.name}(dynamic_steps=True) sets each worker's window by its speed as its updates "
            f"arrive at an asynchronous master, and a --synchronous round waits for every worker anyway; "
            f"drop --synchronous (--warm-start-epochs E gives a synchronous start), or set dynamic_steps=False"
        )


def resolve_compression(options: TrainOptions, algorithm: Algorithm | None) -> Spec | None:
    spec = parse_compression(options.compression)
    if spec is not None and algorithm is not None and algorithm.message_is_weights and make_codec(spec, 2).feedback:
        raise OptionsError(
            f"--compression {spec} sends a part of each message and keeps the rest for the next one: a fit for "
            f"gradients and updates, but {algorithm.name}'s workers send their weights; use fp16 or bf16"
        )
    return spec
