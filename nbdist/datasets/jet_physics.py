"""From Pythia 8 events to jet images: processes, jets, truth matching, images, substructure.

Signal jets come from a hadronically decaying top quark (pp -> ttbar) or W boson
(pp -> W + jet), background jets from QCD 2 -> 2 scattering, at 13 TeV. Jets are
clustered with anti-kt from the visible final-state particles (FastJet), kept in a pT
window and |eta| range; a signal jet must contain its resonance and all of the quarks it
decayed to (within R of the jet axis), as in the usual top-tagging samples.

An image is the jet's constituents' pT in an eta-phi grid of side 2R, after the usual
preprocessing (de Oliveira et al. 2016, "Jet-images -- deep learning edition"): centred on
the pT-weighted centroid, rotated so the principal axis of the pT distribution points
along eta, flipped so that the harder half lies at positive eta and phi, and normalised
to the jet's pT (pixels sum to 1, less what the centring moved out of the 2R square).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Process", "PROCESSES", "JetCuts", "Jet", "JetMaker", "pythia_settings", "image", "nsubjettiness"]

HADRONIC_W = ("24:onMode = off", "24:onIfAny = 1 2 3 4 5")
MAX_BARREN_EVENTS = 5000  # cuts that (almost) no event passes are an error, not a hang


@dataclass(frozen=True)
class Process:
    """A Pythia process and, for a signal, the resonance its jets must contain."""

    name: str
    settings: tuple[str, ...]
    resonance: int | None = None  # PDG id a signal jet is matched to


PROCESSES = {
    "top": Process("top", ("Top:gg2ttbar = on", "Top:qqbar2ttbar = on", *HADRONIC_W), resonance=6),
    "w": Process("w", ("WeakBosonAndParton:qqbar2Wg = on", "WeakBosonAndParton:qg2Wq = on", *HADRONIC_W), resonance=24),
    "qcd": Process("qcd", ("HardQCD:all = on",)),
}


@dataclass(frozen=True)
class JetCuts:
    pt_min: float = 550.0
    pt_max: float = 650.0
    eta_max: float = 2.0
    radius: float = 0.8
    pixels: int = 32


def pythia_settings(process: Process, cuts: JetCuts, seed: int, energy: float = 13000.0) -> list[str]:
    """Every setting given to Pythia (also written into the files, to say what made them)."""
    return [
        f"Beams:eCM = {energy:g}",
        *process.settings,
        # The hard scattering's pT near the window: most events then give a jet in it.
        f"PhaseSpace:pTHatMin = {0.95 * cuts.pt_min:g}",
        f"PhaseSpace:pTHatMax = {1.1 * cuts.pt_max:g}",
        "Random:setSeed = on",
        f"Random:seed = {seed}",
        "Print:quiet = on",
    ]


@dataclass
class Jet:
    image: np.ndarray  # (pixels, pixels) float32: the constituents' pT fractions
    pt: float
    eta: float
    mass: float
    tau21: float
    tau32: float


class JetMaker:
    """One Pythia generator for one process; `jets()` yields the jets that pass the cuts.

    `settings` are all of Pythia's settings (pythia_settings() and any more)."""

    def __init__(self, process: Process, cuts: JetCuts, settings: Sequence[str]):
        import fastjet
        import pythia8mc

        _silence_fastjet_banner(fastjet)
        self.process, self.cuts, self.fastjet = process, cuts, fastjet
        self.settings = list(settings)
        with _quiet_stdout():  # Pythia's banner, even with Print:quiet
            self.pythia = pythia8mc.Pythia("", False)
            for line in self.settings:
                if not self.pythia.readString(line):
                    raise RuntimeError(f"Pythia rejected the setting {line!r}")
            if not self.pythia.init():
                raise RuntimeError(f"Pythia failed to initialise for {process.name}")
        self.antikt = fastjet.JetDefinition(fastjet.antikt_algorithm, cuts.radius)
        self.kt = fastjet.JetDefinition(fastjet.kt_algorithm, 2 * cuts.radius)

    def jets(self) -> Iterator[Jet]:
        """Jets from event after event, for as long as the caller takes them."""
        cuts, fj = self.cuts, self.fastjet
        barren = 0  # events since the last jet that passed
        while True:
            barren += 1
            if barren > MAX_BARREN_EVENTS:
                raise RuntimeError(f"no {self.process.name} jet passed the cuts ({cuts}) in {MAX_BARREN_EVENTS} events")
            if not self.pythia.next():
                continue  # a failed event (rare): Pythia goes on with the next
            event = self.pythia.event
            reach = cuts.eta_max + cuts.radius + 0.5
            particles = [
                fj.PseudoJet(p.px(), p.py(), p.pz(), p.e())
                for p in event
                if p.isFinal() and p.isVisible() and abs(p.eta()) < reach
            ]
            sequence = fj.ClusterSequence(particles, self.antikt)
            resonances = self._resonances() if self.process.resonance else None
            for jet in fj.sorted_by_pt(sequence.inclusive_jets(0.9 * cuts.pt_min))[:2]:
                if not (cuts.pt_min <= jet.pt() <= cuts.pt_max and abs(jet.eta()) <= cuts.eta_max):
                    continue
                if resonances is not None and not any(_contains(jet, r, cuts.radius) for r in resonances):
                    continue
                barren = 0
                yield self._describe(jet)

    def _resonances(self) -> list[list[tuple[float, float]]]:
        """For each decaying resonance of the hard process: (eta, phi) of it and of its quarks."""
        found = []
        process = self.pythia.process
        for i in range(process.size()):
            p = process[i]
            if p.idAbs() != self.process.resonance or p.isFinal():
                continue
            quarks = [process[j] for j in p.daughterListRecursive()]
            quarks = [q for q in quarks if q.isFinal() and 1 <= q.idAbs() <= 5]
            if quarks and all(process[d].idAbs() != p.idAbs() for d in p.daughterList()):
                found.append([(p.eta(), p.phi())] + [(q.eta(), q.phi()) for q in quarks])
        return found

    def _describe(self, jet: Any) -> Jet:
        constituents = list(jet.constituents())
        pt = np.array([c.pt() for c in constituents])
        eta = np.array([c.eta() for c in constituents])
        phi = np.array([c.phi_std() for c in constituents])
        sub = self.fastjet.ClusterSequence(constituents, self.kt)
        taus = nsubjettiness(
            pt,
            np.array([c.rap() for c in constituents]),
            phi,
            [
                [(a.rap(), a.phi_std()) for a in sub.exclusive_jets(n)] if len(constituents) >= n else None
                for n in (1, 2, 3)
            ],
            self.cuts.radius,
        )
        return Jet(
            image(pt, eta, phi, jet.eta(), jet.phi_std(), self.cuts.pixels, self.cuts.radius),
            pt=jet.pt(),
            eta=jet.eta(),
            mass=jet.m(),
            tau21=_ratio(taus[1], taus[0]),
            tau32=_ratio(taus[2], taus[1]),
        )


def _contains(jet: Any, points: list[tuple[float, float]], radius: float) -> bool:
    eta, phi = jet.eta(), jet.phi_std()
    return all(np.hypot(e - eta, _wrap(p - phi)) < radius for e, p in points)


def _wrap(dphi: Any) -> Any:
    return (dphi + np.pi) % (2 * np.pi) - np.pi


def _ratio(a: float, b: float) -> float:
    return float(a / b) if b > 0 else 0.0


def image(
    pt: np.ndarray, eta: np.ndarray, phi: np.ndarray, jet_eta: float, jet_phi: float, pixels: int, radius: float
) -> np.ndarray:
    """The preprocessed (pixels, pixels) image of one jet's constituents."""
    w = pt / pt.sum()
    x = eta - jet_eta
    y = _wrap(phi - jet_phi)
    x, y = x - w @ x, y - w @ y  # centre on the pT-weighted centroid
    cov = np.array([[w @ (x * x), w @ (x * y)], [w @ (x * y), w @ (y * y)]])
    major = np.linalg.eigh(cov)[1][:, -1]
    angle = np.arctan2(major[1], major[0])
    c, s = np.cos(angle), np.sin(angle)
    x, y = c * x + s * y, -s * x + c * y  # the principal axis now lies along eta
    if w @ (x > 0) < w @ (x < 0):
        x = -x
    if w @ (y > 0) < w @ (y < 0):
        y = -y
    grid, _, _ = np.histogram2d(x, y, bins=pixels, range=[[-radius, radius], [-radius, radius]], weights=w)
    return grid.astype(np.float32)


def nsubjettiness(
    pt: np.ndarray, rap: np.ndarray, phi: np.ndarray, axes: list[list[tuple[float, float]] | None], radius: float
) -> list[float]:
    """tau_N = sum_i pT_i min_k dR(i, axis_k) / (sum_i pT_i R) for each given set of N axes
    (exclusive kt subjets); a jet with fewer than N constituents has tau_N = 0."""
    taus = []
    for ax in axes:
        if not ax:
            taus.append(0.0)
            continue
        a = np.array(ax)
        dr = np.hypot(rap[:, None] - a[None, :, 0], _wrap(phi[:, None] - a[None, :, 1]))
        taus.append(float(pt @ dr.min(axis=1) / (pt.sum() * radius)))
    return taus


_banner_done = False


def _silence_fastjet_banner(fastjet: Any) -> None:
    """FastJet prints its banner to stdout at the first clustering; let that be here, muted."""
    global _banner_done
    if not _banner_done:
        with _quiet_stdout():
            fastjet.ClusterSequence(
                [fastjet.PseudoJet(1.0, 0.0, 0.0, 1.0)], fastjet.JetDefinition(fastjet.antikt_algorithm, 0.4)
            )
        _banner_done = True


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Mute what C++ libraries write to file descriptor 1 (Python's own stdout too)."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no real stdout (some embedded interpreters): nothing to mute
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
