"""The audit's interval for a mean change, behind one small function: a percentile bootstrap over images through
the project's statistics module (:func:`hfl_components.stats.draw_image_counts`,
:func:`hfl_components.stats.percentile_interval`; Efron & Tibshirani 1993, ch. 13). Images are treated as
independent, which ignores that several images may come from one patient; the intervals are then somewhat too
narrow. One run (one seed) is audited at a time, so there is no seed level to resample.
"""
from __future__ import annotations

import numpy as np

N_BOOT = 1000


def mean_ci(values, n_boot: int = N_BOOT, seed: int = 0, alpha: float = 0.05) -> dict:
    """Mean of ``values`` (shape (N,)) with a (1 - alpha) percentile-bootstrap CI over the N values.

    Returns ``{"mean", "ci_low", "ci_high", "n"}`` (floats; ``None`` for an empty input).
    """
    from hfl_components.stats import draw_image_counts, percentile_interval

    v = np.asarray(values, dtype=np.float64).ravel()
    if v.size == 0:
        return {"mean": None, "ci_low": None, "ci_high": None, "n": 0}
    w = draw_image_counts(np.random.default_rng(seed), int(n_boot), np.zeros(v.size, int))
    lo, hi = percentile_interval(w @ v / v.size, alpha)
    return {"mean": float(v.mean()), "ci_low": float(lo), "ci_high": float(hi), "n": int(v.size)}
