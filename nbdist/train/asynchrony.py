"""The momentum that asynchrony adds, and the master momentum corrected for it.

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

With `--momentum-correction off` the momentum stays as given, and a set-up whose total
reaches 1 gets a warning that says why and what to use instead. Synchronous rounds add
no momentum (every update is computed from the current centre), and neither does one
worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from nbdist.algorithms import Algorithm
from nbdist.specs import Spec

__all__ = ["implicit_momentum", "CorrectedMomentum", "corrected_momentum", "worker_momentum_warning", "Notice",
           "optimisers_for_asynchrony"]

# Workers from which a centre that takes their steps as they are (ADAG) was seen to
# collapse with the workers' default momentum 0.9: every one of 3 seeds at 8 workers on
# the jet images, with lr 0.1 and with 0.05, none at 4 on digits (bench/convergence.py).
COLLAPSE_SEEN_FROM = 8
# The optimiser argument that is a heavy-ball momentum (torch's SGD and RMSprop, Keras'
# SGD and RMSprop); Adam's beta1 averages gradients but its steps are normalised, and
# the analysis does not carry over to it.
MOMENTUM_ARGUMENT = "momentum"


def implicit_momentum(workers: int) -> float:
    """The momentum W asynchronous workers add (0 for one worker)."""
    return 1.0 - 1.0 / max(workers, 1)


@dataclass(frozen=True, slots=True)
class CorrectedMomentum:
    spec: Spec  # the optimiser to build
    note: str = ""  # what the user is told at the start (empty: nothing to say)
    warning: bool = False  # the note is a warning: the set-up is known to diverge


def corrected_momentum(spec: Spec | None, workers: int, synchronous: bool, correction: str) -> CorrectedMomentum | None:
    """The master optimiser `spec` with its momentum corrected for `workers` asynchronous
    workers (or left, with a warning when the total reaches 1).

    Only the master's: the workers' local optimisers (EASGD, ADAG, DynSGD) reach the centre
    through their windows' displacements, not step by step. Correcting ADAG's workers the
    same way stopped its collapses on jets at 8 workers (3 of 3 seeds without, 0 of 3
    with), but made it learn digits more slowly at 4 (0.88 instead of 0.90 after 12
    epochs): not a default without more evidence (bench/convergence.py)."""
    if spec is None:
        return None
    explicit = float(spec.kwargs.get(MOMENTUM_ARGUMENT, 0.0) or 0.0)
    if synchronous or workers < 2 or explicit <= 0.0:
        return CorrectedMomentum(spec)
    implicit = implicit_momentum(workers)
    source = f"asynchrony with {workers} workers adds a momentum of its own, about 1 - 1/{workers} = {implicit:.2f}"
    if correction == "off":
        if explicit + implicit < 1.0:
            return CorrectedMomentum(spec)
        return CorrectedMomentum(spec, (
            f"{source} (Mitliagkas et al. 2016); with the master's momentum {explicit:g} the total "
            f"{explicit + implicit:.2f} is 1 or more, and training diverges: use --algorithm gem (made for "
            f"this), --synchronous, a momentum below {1.0 / workers:.2g}, or --momentum-correction auto"),
            warning=True)
    corrected = round(max(0.0, explicit - implicit), 6)
    kwargs = {**spec.kwargs, MOMENTUM_ARGUMENT: corrected}
    if corrected == 0.0 and spec.kwargs.get("nesterov"):
        kwargs["nesterov"] = False  # torch's Nesterov needs a momentum
    return CorrectedMomentum(Spec(spec.name, kwargs), (
        f"{source} (Mitliagkas et al. 2016): the master's momentum {explicit:g} is lowered to "
        f"{corrected:g} so that the total stays {max(explicit, implicit):.2f}; --momentum-correction "
        f"off keeps it as given"))


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
    return (f"{algorithm} adds each worker's steps to the centre as they are, and asynchrony with {workers} workers "
            f"adds a momentum of about {implicit:.2f} to the workers' {explicit:g}: the centre can collapse (ADAG "
            f"at 8 workers did in 3 of 3 runs on jet images); give the workers a momentum below {1.0 / workers:.2g}, "
            f"e.g. --worker-optimizer 'sgd(lr=0.05, momentum={round(1.0 / workers / 2, 3):g})', or use --algorithm "
            f"dynsgd (ADAG with a staleness discount: it did not collapse there) or gem")


@dataclass(frozen=True, slots=True)
class Notice:
    text: str
    warning: bool  # stderr, even with --quiet; else a note on stdout


def optimisers_for_asynchrony(algorithm: Algorithm, master: Spec | None, worker: Spec | None, workers: int,
                              synchronous: bool, correction: str) -> tuple[Spec | None, list[Notice]]:
    """The master optimiser to build (its momentum corrected) and what the run leader
    tells the user about the momentum of either optimiser."""
    fixed = corrected_momentum(master, workers, synchronous, correction)
    notices = [Notice(fixed.note, fixed.warning)] if fixed is not None and fixed.note else []
    if algorithm.centre_takes_worker_steps:
        warning = worker_momentum_warning(algorithm.name, worker, workers, synchronous)
        notices += [Notice(warning, warning=True)] if warning else []
    return (fixed.spec if fixed is not None else None), notices
