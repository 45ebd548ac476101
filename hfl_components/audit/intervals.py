"""The audit's interval for a mean change, behind one small function so that it can be re-pointed at the
project's shared statistics module later without touching its callers.

A percentile bootstrap over images (Efron & Tibshirani 1993, ch. 13): images are treated as independent,
which ignores that several images may come from one patient; the intervals are then somewhat too narrow.
"""
from __future__ import annotations

import numpy as np

N_BOOT = 1000


def mean_ci(values, n_boot: int = N_BOOT, seed: int = 0, alpha: float = 0.05) -> dict:
    """Mean of ``values`` (shape (N,)) with a (1 - alpha) percentile-bootstrap CI over the N values.

    Returns ``{"mean", "ci_low", "ci_high", "n"}`` (floats; ``None`` for an empty input).
    """
    v = np.asarray(values, dtype=np.float64).ravel()
    if v.size == 0:
        return {"mean": None, "ci_low": None, "ci_high": None, "n": 0}
    idx = np.random.default_rng(seed).integers(0, v.size, (int(n_boot), v.size))
    lo, hi = np.percentile(v[idx].mean(axis=1), [100 * alpha / 2, 100 * (1 - alpha / 2)])
    return {"mean": float(v.mean()), "ci_low": float(lo), "ci_high": float(hi), "n": int(v.size)}
