"""Deprecated names: the paired comparison lives in :mod:`hfl_components.stats` (seeds as clusters, the reporting
rule). ``paired_bootstrap`` is :func:`hfl_components.stats.paired_crossed`."""
from __future__ import annotations

from hfl_components.stats import PAIRED_METRICS, VERDICTS, WeightedAUC, verdict
from hfl_components.stats import paired_crossed as paired_bootstrap

__all__ = ["PAIRED_METRICS", "VERDICTS", "WeightedAUC", "paired_bootstrap", "verdict"]
