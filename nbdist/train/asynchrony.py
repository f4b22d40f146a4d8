"""The momentum that asynchrony adds, and what a run corrects for it: the master's
momentum, or where there is none to lower, the lr of each update by its staleness.

Mitliagkas, Zhang, Hadjis and Ré ("Asynchrony begets momentum, with an application to
deep learning", 2016) show that W workers pushing gradients asynchronously to one centre
move it, in expectation, like momentum SGD with momentum 1 - 1/W, on top of any momentum
the master's optimiser has of its own. The total is what matters: at 1 or above the
centre's velocity never decays and training diverges. Hermans and Louppe's GEM paper
(2018) reproduces it: Downpour with a momentum-0.9 master falls apart with more workers.

So, for an asynchronous rule whose master steps with an optimiser (Downpour), the
explicit momentum is lowered by the implicit one, as Mitliagkas et al. prescribe:

    implicit  = 1 - 1/W
    explicit <- max(0, explicit - implicit)

A master optimiser with no momentum of its own (Downpour's default `sgd(lr=0.1)`, or
Adam), or one whose momentum the implicit one exceeds (0.9 at 16 workers: 0.94), has
nothing (left) to lower. From 8 workers (STALE_LR_FROM) the same correction then goes
to its learning rate, in the per-update form that needs no model of the queue: each
update is applied with

    lr / (1 + staleness)

staleness being the updates the master applied since the worker's pull (measured, as
each update is applied). That is the staleness-dependent learning rate of Zhang, Gupta,
Lian and Liu ("Staleness-aware Async-SGD for Distributed Deep Learning", IJCAI 2016: the
lr divided by the staleness) in the form of DynSGD (Jiang et al., SIGMOD 2017), whose
fresh update has staleness 0. The queue model's mean staleness W - 1 gives the factor
1/W, i.e. the step 1 - (1 - 1/W) that cancels the implicit momentum on average, while an
update computed from the current centre (one worker, or workers that take turns) keeps
the whole lr.

A rule whose master adds the workers' updates as they are (ADAG, GEM) has neither a
momentum nor an lr to correct: from 8 workers (COLLAPSE_SEEN_FROM) its updates themselves
are scaled by 1 / (1 + staleness) before they are added, which is DynSGD's rule (Jiang et
al. 2017). As published, both collapsed on the jet images with many workers, and
discounted neither did (bench/results/2026-11-25-convergence.md; why GEM needs it:
nbdist.algorithms.gem). The workers' own momentum is left as it is: correcting it too
stopped ADAG's collapses but slowed it on digits with few workers
(bench/results/2026-11-24-convergence.md).

A rule whose master steps with an outer momentum of its own (DiLoCo's outer Nesterov,
async_local_sgd's delayed one) gets the same lowering, counted in the momentum's own
steps: updated once every P arrivals (P = 1 for DiLoCo, N for async_local_sgd's delayed
Nesterov), the implicit momentum decays over those P arrivals to (1 - 1/W)^P, and

    outer momentum <- max(0, outer momentum - (1 - 1/W)^P)

(at 8 workers, DiLoCo's 0.9 becomes 0.025 and async_local_sgd's 0.556). DiLoCo's
asynchronous step already takes 1/W of each delta, the mean staleness's share, so no lr
is discounted on top. As published (0.9), both fell back to chance on the jet images at
8 and 16 workers (bench/results/2026-11-28-convergence.md).

With `--momentum-correction off` the momentum and lr stay as given, and a set-up whose
total reaches 1 gets a warning that says why and what to use instead. Synchronous rounds
add no momentum (every update is computed from the current centre), and neither does
one worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from nbdist.algorithms import Algorithm
from nbdist.specs import Spec

__all__ = [
    "implicit_momentum",
    "staleness_lr_factor",
    "CorrectedMomentum",
    "corrected_momentum",
    "worker_momentum_warning",
    "stale_updates_note",
    "corrected_outer_momentum",
    "published_gem_warning",
    "Notice",
    "MasterForAsynchrony",
    "optimisers_for_asynchrony",
]

# Workers from which ADAG's centre, taking their steps as they are, collapsed on the jet
# images (not with fewer: there the discount only slowed it); GEM's discount starts here too
# (Algorithm.auto_stale_discount). bench/results/2026-11-24- and 2026-11-25-convergence.md.
COLLAPSE_SEEN_FROM = 8
# Workers from which Downpour's master without momentum collapsed on the jet images without
# the per-update lr correction (with fewer, the correction only slowed it on digits):
# bench/results/2026-11-25-convergence.md.
STALE_LR_FROM = 8
# Workers from which GEM as published (--momentum-correction off) collapsed on the jet
# images (at 8 it held): bench/results/2026-11-25-convergence.md.
GEM_COLLAPSE_SEEN_FROM = 16
# What a master whose lr is discounted by staleness (from STALE_LR_FROM workers) is also
# told: Downpour's early validations on the jet images can still dip to chance, then it
# learns on (bench/results/2026-11-25-convergence.md and 2026-11-26-convergence.md).
EARLY_DIPS = (
    ". The centre's first epochs can still swing: Downpour's validation may fall back to chance once or "
    "twice early on, then learn on (on jet images, bench/results/2026-11-26-convergence.md); gem, adag and "
    "easgd did not, and --synchronous takes no stale step"
)
# The optimiser argument that is a heavy-ball momentum (torch's SGD and RMSprop, Keras'
# SGD and RMSprop); Adam's beta1 averages gradients but its steps are normalised, and
# the analysis does not carry over to it.
MOMENTUM_ARGUMENT = "momentum"


def implicit_momentum(workers: int) -> float:
    """The momentum W asynchronous workers add (0 for one worker)."""
    return 1.0 - 1.0 / max(workers, 1)


def staleness_lr_factor(staleness: int) -> float:
    """What the lr of an update `staleness` versions old is multiplied by, on a master
    with no momentum to lower (Zhang et al. 2016; Jiang et al. 2017)."""
    return 1.0 / (1.0 + max(int(staleness), 0))


def _implicit_source(workers: int) -> str:
    return (
        f"asynchrony with {workers} workers adds a momentum of its own, about 1 - 1/{workers} = "
        f"{implicit_momentum(workers):.2f}"
    )


@dataclass(frozen=True, slots=True)
class CorrectedMomentum:
    spec: Spec  # the optimiser to build
    note: str = ""  # what the user is told at the start (empty: nothing to say)
    warning: bool = False  # the note is a warning: the set-up is known to diverge
    stale_lr: bool = False  # each update's lr is multiplied by staleness_lr_factor


def corrected_momentum(spec: Spec | None, workers: int, synchronous: bool, correction: str) -> CorrectedMomentum | None:
    """The master optimiser `spec` with its momentum corrected for `workers` asynchronous
    workers (or left, with a warning when the total reaches 1); one without momentum
    keeps its spec and gets the per-update lr correction (`stale_lr`).

    Only the master's: the workers' local optimisers (EASGD, ADAG, DynSGD) reach the centre
    through their windows' displacements, not step by step. Correcting ADAG's workers the
    same way stopped its collapses on jets at 8 workers, but made it learn digits more
    slowly at 4 (bench/results/2026-11-24-convergence.md): ADAG's updates get the staleness
    discount instead (optimisers_for_asynchrony)."""
    if spec is None:
        return None
    explicit = float(spec.kwargs.get(MOMENTUM_ARGUMENT, 0.0) or 0.0)
    if synchronous or workers < 2:
        return CorrectedMomentum(spec)
    implicit = implicit_momentum(workers)
    source = _implicit_source(workers)
    if explicit <= 0.0:
        if workers < STALE_LR_FROM:
            return CorrectedMomentum(spec)
        if correction == "off":
            return CorrectedMomentum(
                spec,
                (
                    f"{source} (Mitliagkas et al. 2016), and with --momentum-correction off the lr of the master's "
                    f"{spec.name} is not divided by the updates' staleness: Downpour's default sgd(lr=0.1) so "
                    f"collapsed or never learned on jet images at 8 and 16 workers (bench/results/2026-11-25-"
                    f"convergence.md); drop --momentum-correction off, or use --algorithm gem or --synchronous"
                ),
                warning=True,
            )
        return CorrectedMomentum(
            spec,
            (
                f"{source} (Mitliagkas et al. 2016), and the master's {spec.name} has no momentum to lower: the lr "
                f"of each update is divided by 1 + its staleness (Zhang et al. 2016, Jiang et al. 2017), the whole "
                f"lr for an update from the current centre; --momentum-correction off keeps it as given"
                f"{EARLY_DIPS}"
            ),
            stale_lr=True,
        )
    if correction == "off":
        if explicit + implicit < 1.0:
            return CorrectedMomentum(spec)
        return CorrectedMomentum(
            spec,
            (
                f"{source} (Mitliagkas et al. 2016); with the master's momentum {explicit:g} the total "
                f"{explicit + implicit:.2f} is 1 or more, and training diverges: use --algorithm gem (made for "
                f"this), --synchronous, a momentum below {1.0 / workers:.2g}, or --momentum-correction auto"
            ),
            warning=True,
        )
    corrected = round(max(0.0, explicit - implicit), 6)
    kwargs = {**spec.kwargs, MOMENTUM_ARGUMENT: corrected}
    if corrected == 0.0 and spec.kwargs.get("nesterov"):
        kwargs["nesterov"] = False  # torch's Nesterov needs a momentum
    if corrected == 0.0 and workers >= STALE_LR_FROM:
        # The asynchrony's momentum alone exceeds the master's: lowered to 0, the master
        # has no momentum left, and what exceeds it goes to the lr as for a master that
        # never had any. Without this, Downpour with a momentum master at 16 workers fell
        # back to chance on digits (bench/results/2026-11-26-convergence.md).
        return CorrectedMomentum(
            Spec(spec.name, kwargs),
            (
                f"{source} (Mitliagkas et al. 2016), more than the master's momentum {explicit:g}: it is lowered "
                f"to 0, and the lr of each update is divided by 1 + its staleness (Zhang et al. 2016, Jiang et "
                f"al. 2017) for the rest, as for a master without momentum; --momentum-correction off keeps it "
                f"as given"
            ),
            stale_lr=True,
        )
    return CorrectedMomentum(
        Spec(spec.name, kwargs),
        (
            f"{source} (Mitliagkas et al. 2016): the master's momentum {explicit:g} is lowered to "
            f"{corrected:g} so that the total stays {max(explicit, implicit):.2f}; --momentum-correction "
            f"off keeps it as given"
        ),
    )


def worker_momentum_warning(algorithm: str, spec: Spec | None, workers: int, synchronous: bool) -> str:
    """A warning for a rule whose centre takes the workers' steps as they are (ADAG),
    run asynchronously by many workers whose optimiser has a momentum the
    asynchrony's would take to 1 or more; empty when there is nothing to say."""
    if spec is None or synchronous or workers < COLLAPSE_SEEN_FROM:
        return ""
    explicit = float(spec.kwargs.get(MOMENTUM_ARGUMENT, 0.0) or 0.0)
    implicit = implicit_momentum(workers)
    if explicit + implicit < 1.0:
        return ""
    return (
        f"{algorithm} adds each worker's steps to the centre as they are, and asynchrony with {workers} workers "
        f"adds a momentum of about {implicit:.2f} to the workers' {explicit:g}: the centre can collapse (ADAG "
        f"at 8 workers did on jet images: bench/results/2026-11-24-convergence.md); give the workers a "
        f"momentum below {1.0 / workers:.2g}, e.g. --worker-optimizer "
        f"'sgd(lr=0.05, momentum={round(1.0 / workers / 2, 3):g})', or use --algorithm "
        f"dynsgd (ADAG with a staleness discount: it did not collapse there) or gem, or drop "
        f"--momentum-correction off (the default discounts {algorithm}'s stale updates as DynSGD does)"
    )


@dataclass(frozen=True, slots=True)
class Notice:
    text: str
    warning: bool  # stderr, even with --quiet; else a note on stdout


def corrected_outer_momentum(algorithm: Algorithm, workers: int, synchronous: bool, correction: str) -> Notice | None:
    """Lower the outer momentum of a rule whose master keeps one (DiLoCo, async_local_sgd)
    by the momentum `workers` asynchronous workers add, in the outer momentum's own steps
    (the module's docstring); or, with --momentum-correction off, warn where the total
    reaches 1. None: nothing changed and nothing to say."""
    held = algorithm.outer_momentum()
    if held is None or synchronous or workers < 2:
        return None
    explicit, every = held
    implicit = implicit_momentum(workers) ** every
    over = f"; over the {every} arrivals between two updates of the outer momentum, {implicit:.2f}" if every > 1 else ""
    source = f"{_implicit_source(workers)}{over} (Mitliagkas et al. 2016)"
    if correction == "off":
        if explicit + implicit < 1.0:
            return None
        return Notice(
            f"{source}; with {algorithm.name}'s outer momentum {explicit:g} the total {explicit + implicit:.2f} "
            f"is 1 or more: asynchronous {algorithm.name} with the published 0.9 fell back to chance on jet images "
            f"at 8 and 16 workers (bench/results/2026-11-28-convergence.md); drop --momentum-correction off, "
            f"give outer_momentum below {max(0.0, 1.0 - implicit):.2g}, or use --synchronous",
            warning=True,
        )
    corrected = round(max(0.0, explicit - implicit), 6)
    if corrected == explicit:
        return None
    algorithm.set_outer_momentum(corrected)
    return Notice(
        f"{source}: {algorithm.name}'s outer momentum {explicit:g} is lowered to {corrected:.3g}; "
        f"--momentum-correction off keeps it as given",
        warning=False,
    )


def stale_updates_note(algorithm: str, workers: int) -> str:
    """What a run of a rule whose centre adds the workers' updates as they are (ADAG, GEM)
    is told when its updates get the staleness discount."""
    return (
        f"{_implicit_source(workers)} (Mitliagkas et al. 2016), and {algorithm}'s master adds the workers' "
        f"updates with no momentum to lower: each update is scaled by 1 / (1 + its staleness) before it is "
        f"added (DynSGD's discount, Jiang et al. 2017), whole for an update from the current centre; "
        f"--momentum-correction off adds them as they are"
    )


def published_gem_warning(algorithm: Algorithm, workers: int, synchronous: bool, correction: str) -> str:
    """A warning for GEM as published (--momentum-correction off) with as many workers as
    it was seen to fall apart at; empty when there is nothing to say."""
    if algorithm.name != "gem" or correction != "off" or synchronous or workers < GEM_COLLAPSE_SEEN_FROM:
        return ""
    return (
        f"gem as published, with {workers} asynchronous workers, answers the energy it sees missing from "
        f"every worker at once and a cycle late: at 16 workers on jet images it collapsed (bench/results/"
        f"2026-11-25-convergence.md); drop --momentum-correction off (the default discounts stale updates: "
        f"it did not collapse), or use --synchronous"
    )


@dataclass(frozen=True, slots=True)
class MasterForAsynchrony:
    optimizer: Spec | None  # the master optimiser to build (None: the rule has none)
    stale_lr: bool  # each update's lr multiplied by staleness_lr_factor (train/lr.py applies it)
    stale_updates: bool  # the rule scales each update by staleness_lr_factor (discount_stale: ADAG, GEM)
    notices: list[Notice]


def optimisers_for_asynchrony(
    algorithm: Algorithm, master: Spec | None, worker: Spec | None, workers: int, synchronous: bool, correction: str
) -> MasterForAsynchrony:
    """The master optimiser to build (its momentum, or its lr per update, corrected),
    whether a rule that adds the workers' steps as they are discounts stale ones, and what
    the run leader tells the user about either; a rule's outer momentum is lowered on
    `algorithm` itself (corrected_outer_momentum)."""
    fixed = corrected_momentum(master, workers, synchronous, correction)
    notices = [Notice(fixed.note, fixed.warning)] if fixed is not None and fixed.note else []
    outer = corrected_outer_momentum(algorithm, workers, synchronous, correction)
    notices += [outer] if outer is not None else []
    stale_updates = (
        algorithm.auto_stale_discount and correction == "auto" and not synchronous and workers >= COLLAPSE_SEEN_FROM
    )
    if stale_updates:
        notices.append(Notice(stale_updates_note(algorithm.name, workers), warning=False))
    elif algorithm.centre_takes_worker_steps:
        warning = worker_momentum_warning(algorithm.name, worker, workers, synchronous)
        notices += [Notice(warning, warning=True)] if warning else []
    else:
        warning = published_gem_warning(algorithm, workers, synchronous, correction)
        notices += [Notice(warning, warning=True)] if warning else []
    return MasterForAsynchrony(
        fixed.spec if fixed is not None else None, fixed is not None and fixed.stale_lr, stale_updates, notices
    )
