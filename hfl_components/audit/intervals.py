"""Confidence intervals of the audit, behind two small functions so that they can be re-pointed at the project's
shared statistics module later without touching their callers.

Both are percentile bootstraps over images (Efron & Tibshirani 1993, ch. 13): images are treated as independent,
which ignores that several images may come from one patient; the intervals are then somewhat too narrow.
"""
from __future__ import annotations

from typing import Callable

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


def paired_bootstrap(stat: Callable[[np.ndarray], tuple], n: int, n_boot: int = N_BOOT, seed: int = 0,
                     alpha: float = 0.05) -> list[tuple[float, float]]:
    """Percentile CIs of the K statistics ``stat(idx)`` returns for the same resampled image indices ``idx``
    ((n,) ints), so that differences between statistics computed on one resample are paired.

    Replicates where a statistic is None or not finite (e.g. an AUC of a one-class resample) are dropped for that
    statistic. Returns ``[(low, high), ...]`` per statistic; ``(None, None)`` when no replicate was usable.
    """
    rng = np.random.default_rng(seed)
    reps: list[list[float]] = []
    for _ in range(int(n_boot)):
        vals = stat(rng.integers(0, n, n))
        if not reps:
            reps = [[] for _ in vals]
        for k, v in enumerate(vals):
            if v is not None and np.isfinite(v):
                reps[k].append(float(v))
    q = [100 * alpha / 2, 100 * (1 - alpha / 2)]
    return [tuple(float(x) for x in np.percentile(r, q)) if r else (None, None) for r in reps]
