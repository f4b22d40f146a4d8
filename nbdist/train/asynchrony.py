"""The momentum that asynchrony adds, and the master momentum corrected for it.

Mitliagkas, Zhang, Hadjis and Ré ("Asynchrony begets momentum, with an application to
deep learning", 2016) show that W workers pushing gradients asynchronously to one centre
move it, in expectation, like momentum SGD with momentum 1 - 1/W, on top of any momentum
the master's optimiser has of its own. The total is what matters: at 1 or above the
centre's velocity never decays and training diverges. Hermans and Louppe's GEM paper
(2018) reproduces it: Downpour with a momentum-0.9 master falls apart with more workers.

So, for an asynchronous rule whose master steps with an optimiser (Downpour), the
explicit momentum is lowered by the implicit one, as Mitliagkas et al. prescribe; and
likewise the workers' optimiser's where the centre takes the workers' local steps as they
are (ADAG, DynSGD: a worker's displacement carries its momentum to the centre):

    implicit  = 1 - 1/W
    explicit <- max(0, explicit - implicit)

With `--momentum-correction off` the momentum stays as given, and a set-up whose total
reaches 1 gets a warning that says why and what to use instead. Synchronous rounds add
no momentum (every update is computed from the current centre), and neither does one
worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from nbdist.specs import Spec

__all__ = ["implicit_momentum", "CorrectedMomentum", "corrected_momentum"]

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


def corrected_momentum(spec: Spec | None, whose: str, workers: int, synchronous: bool,
                       correction: str) -> CorrectedMomentum | None:
    """The optimiser `spec` (`whose`: "master's" or "workers'") whose momentum reaches the
    centre, with that momentum corrected for `workers` asynchronous workers (or left,
    with a warning when the total reaches 1)."""
    if spec is None:
        return None
    explicit = float(spec.kwargs.get(MOMENTUM_ARGUMENT, 0.0) or 0.0)
    if synchronous or workers < 2 or explicit <= 0.0:
        return CorrectedMomentum(spec)
    implicit = implicit_momentum(workers)
    source = f"asynchrony with {workers} workers adds a momentum of its own, about 1 - 1/{workers} = {implicit:.2f}"
    option = "--master-optimizer" if whose == "master's" else "--worker-optimizer"
    if correction == "off":
        if explicit + implicit < 1.0:
            return CorrectedMomentum(spec)
        return CorrectedMomentum(spec, (
            f"{source} (Mitliagkas et al. 2016); with the {whose} momentum {explicit:g} ({option}) the total "
            f"{explicit + implicit:.2f} is 1 or more, and training diverges: use --algorithm gem (made for "
            f"this), --synchronous, a momentum below {1.0 / workers:.2g}, or --momentum-correction auto"),
            warning=True)
    corrected = round(max(0.0, explicit - implicit), 6)
    kwargs = {**spec.kwargs, MOMENTUM_ARGUMENT: corrected}
    if corrected == 0.0 and spec.kwargs.get("nesterov"):
        kwargs["nesterov"] = False  # torch's Nesterov needs a momentum
    return CorrectedMomentum(Spec(spec.name, kwargs), (
        f"{source} (Mitliagkas et al. 2016): the {whose} momentum {explicit:g} ({option}) is lowered to "
        f"{corrected:g} so that the total stays {max(explicit, implicit):.2f}; --momentum-correction "
        f"off keeps it as given"))
