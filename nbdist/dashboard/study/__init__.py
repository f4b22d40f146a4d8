"""The study dashboard, to match optuna-dashboard: optimisation history, parallel
coordinates, slice and contour, parameter importances (Optuna's evaluators), learning
curves with pruned and promoted trials marked, the Pareto front, a PBT population's
lineage and hyper-parameter schedules, and a trial table with each trial's runs and ranks.

frames, curves and importance compute what the views show (no Panel, no Bokeh); the
views draw it (trial_views, event_views, table); page puts them on a page and keeps
them up with the run store (data).
"""

from nbdist.dashboard.study.page import IMPORTANCE_EVERY, StudyPage

__all__ = ["StudyPage", "IMPORTANCE_EVERY"]
