"""Scale you can see before you pay for it: a calibrated performance model, a
discrete-event simulator and the sweep behind `nbdist scale`.

The model (model.py, queueing.py), the simulator (simulator.py), goodput (goodput.py) and
the analysis are pure: no MPI, usable in a notebook kernel on numbers from the store. The
calibration probe (calibrate.py, probes.py), the measured points (points.py) and the sweep
(sweep.py) run on MPI ranks through transport/ and roles/; import them from their modules.
"""

from nbdist.scaling.goodput import Goodput, goodput, samples_needed_ratio
from nbdist.scaling.inputs import Calibration, CalibrationError
from nbdist.scaling.model import PerformanceModel
from nbdist.scaling.network import NETWORKS, Machine, Network, network
from nbdist.scaling.options import ScaleOptions
from nbdist.scaling.setups import Point, SetUp
from nbdist.scaling.simulator import SimResult, Simulator, Stragglers

__all__ = [
    "Calibration",
    "CalibrationError",
    "PerformanceModel",
    "Simulator",
    "SimResult",
    "Stragglers",
    "Machine",
    "Network",
    "NETWORKS",
    "network",
    "SetUp",
    "Point",
    "ScaleOptions",
    "Goodput",
    "goodput",
    "samples_needed_ratio",
]
