"""A synthetic study written through nbdist's run store API, for the study dashboard's
tests: a thousand trials of two objectives (val_loss and params, both minimised), with
learning curves, trials pruned, promoted at rungs and left at a rung, a few failed, and a
PBT population whose members took each other's state at two epochs.

The data says what the views must show: val_loss depends on the learning rate (a bowl
around 10^-2.5) far more than on anything else, so `lr` ranks first in importance; a
bigger hidden layer lowers val_loss a little and raises params, so the two objectives
conflict and the Pareto front has many trials.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nbdist.layout import Layout
from nbdist.store import RunStore

STUDY = "synthetic"
SPACE = "lr=log(0.0001,0.1) hidden=int(8,256) optimizer=cat(adam,sgd,rmsprop) dropout=real(0,0.5)"
EPOCHS = 9
RUNGS = (1, 3)  # ASHA's rungs below the last epoch
PBT_SIZE = 8  # the study's last trials are a PBT population
# (after epoch, source, receiver), as offsets into the population
PBT_EXPLOITS = ((3, 0, 7), (3, 1, 6), (6, 2, 5))


@dataclass
class Synthetic:
    """What was written: the counts and trials the views must show."""

    trials: int = 0
    states: dict[str, int] = field(default_factory=dict)
    values: dict[int, list[float]] = field(default_factory=dict)  # complete trials: [val_loss, params]
    promotions: int = 0
    pruned: int = 0
    members: tuple[int, ...] = ()
    exploits: list[tuple[int, int, int]] = field(default_factory=list)  # (after epoch, source, receiver)


def _state(number: int, members: tuple[int, ...]) -> str:
    if number in members:
        return "complete"
    if number % 50 == 7:
        return "failed"
    return {0: "pruned", 1: "stopped"}.get(number % 5, "complete")


def write_synthetic_study(path: Path, trials: int = 1000, seed: int = 0) -> Synthetic:
    rng = np.random.default_rng(seed)
    members = tuple(range(trials - PBT_SIZE, trials))
    made = Synthetic(trials=trials, members=members)
    made.exploits = [(e, members[s], members[r]) for e, s, r in PBT_EXPLOITS]
    layout = Layout(workers=2, groups=4, folds=1, topology="allreduce", coordinator=True).to_dict()
    events: list[tuple[int, str, int, dict]] = []
    with RunStore(path) as store:
        store.create_study(
            STUDY,
            searcher="random",
            space=SPACE,
            options={"study": {"scheduler": "asha(min_epochs=1, reduction=3)"}, "layout": layout},
            objective="val_loss,params",
            direction="minimize,minimize",
        )
        for number in range(trials):
            params = {
                "lr": float(10 ** rng.uniform(-4, -1)),
                "hidden": int(rng.integers(8, 257)),
                "optimizer": str(rng.choice(["adam", "sgd", "rmsprop"])),
                "dropout": float(rng.uniform(0, 0.5)),
            }
            final = 0.2 + 0.5 * (math.log10(params["lr"]) + 2.5) ** 2 + 0.05 * (1 - params["hidden"] / 256)
            final += 0.005 * float(rng.normal())
            size = float(params["hidden"] * 74 + params["hidden"] * 10)
            state = _state(number, members)
            made.states[state] = made.states.get(state, 0) + 1
            ends = {"complete": EPOCHS, "pruned": 1 + number % 2, "stopped": RUNGS[1], "failed": 0}[state]
            curve = {e: final + 0.6 * math.exp(-(e - 1) / 2.0) for e in range(1, ends + 1)}
            events += [(number, "value", e, {"value": v, "folds": {"0": v}}) for e, v in curve.items()]
            events.append((number, "params", 0, params))
            for rung in RUNGS:
                if rung < ends and state != "pruned":
                    events.append((number, "paused", rung, {"value": curve[rung]}))
                    events.append((number, "promoted", rung, {"to": EPOCHS}))
                    made.promotions += 1
            if state == "pruned":
                events.append((number, "pruned", ends, {"value": curve[ends]}))
                made.pruned += 1
            if state == "stopped":
                events.append((number, "stopped", ends, {"value": curve[ends]}))
            done = state == "complete"
            store.record_trial(
                STUDY,
                number,
                params=params,
                state=state,
                fom=curve[ends] if ends else None,
                fom_std=0.01 if ends else None,
                folds=[curve[ends]] if ends else [],
                generation=number // 100,
                group=number % 4,
                error="the loss became nan" if state == "failed" else None,
                started=1000.0 + number,
                ended=1000.0 + number + ends,
                epochs=ends,
                values=[final, size] if done else None,
            )
            if done:
                made.values[number] = [final, size]
        for epoch, source, receiver in made.exploits:
            taken = {"lr": 0.003 * (1 + epoch / 10), "hidden": 64, "optimizer": "adam", "dropout": 0.1}
            events.append(
                (receiver, "exploit", epoch, {"source": source, "params": taken, "previous": {**taken, "lr": 0.05}})
            )
            events.append((receiver, "params", epoch, taken))
        store.record_trial_events(STUDY, events)
        for number in range(4):  # the first trials' fold runs, as the study's runs name them
            run = f"{STUDY}-trial{number:04d}-fold0"
            store.begin_run(
                run,
                run_dir=None,
                options={},
                layout=Layout.for_world(2, topology="allreduce").to_dict(),
                kind="train",
                study=STUDY,
                trial=number,
            )
            store.end_run(run, "completed")
        store.end_study(STUDY, "completed")
    return made
