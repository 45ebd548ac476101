"""Deprecated names: the paired comparison of site models lives in :mod:`hfl_components.stats`.
``paired_site_bootstrap`` is :func:`hfl_components.stats.paired_nested`."""
from __future__ import annotations

from hfl_components.stats import SITE_METRICS, VERDICTS, site_metric, verdict, weighted_auc
from hfl_components.stats import paired_nested as paired_site_bootstrap

__all__ = ["SITE_METRICS", "VERDICTS", "paired_site_bootstrap", "site_metric", "verdict", "weighted_auc"]
