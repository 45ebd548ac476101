"""Resampling draws and intervals at the level where the randomness lives: seeds (training randomness) and images.

All interval functions are vectorised over leading axes, so a coverage simulation can run thousands of studies in
one call (``tests/test_stats_coverage.py``).

* :func:`seed_t_interval`: Student-t interval of the mean of per-seed values (``scipy.stats.t``, df = seeds - 1).
* :func:`cluster_t_interval`: the cluster bootstrap's standard error (seeds resampled as clusters, images as the
  design says; :mod:`.paired`) with the Student-t quantile at df = seeds - 1, the standard error rescaled by
  sqrt(S / (S - 1)) so that its seed part is the usual unbiased one (the plug-in bootstrap variance of a mean of S
  values is (S - 1) / S times it; Davison & Hinkley 1997, Sec. 2.3 and 5.2).
* :func:`percentile_interval`: the plain percentile interval of bootstrap replicates (Efron & Tibshirani 1993,
  Ch. 13). It under-covers with few seeds (its seed part has S - 1 effective degrees of freedom but normal-like
  quantiles and a plug-in variance) and gives no verdict (``docs/decisions.md``).
"""
from __future__ import annotations

import numpy as np
from scipy import stats as _st


def draw_seed_counts(rng: np.random.Generator, n_boot: int, n_seeds: int) -> np.ndarray:
    """Multiplicities of the seeds in ``n_boot`` cluster-bootstrap draws: (n_boot, n_seeds) float64, each row a
    draw of ``n_seeds`` seeds with replacement (row sums = n_seeds)."""
    return rng.multinomial(n_seeds, np.full(n_seeds, 1.0 / n_seeds), size=int(n_boot)).astype(np.float64)


def draw_image_counts(rng: np.random.Generator, n_boot: int, labels: np.ndarray) -> np.ndarray:
    """Multiplicities of the images in ``n_boot`` draws with replacement *within each class* of ``labels`` (N,)
    (so every draw keeps every class and its size; an AUC stays defined): (n_boot, N) float64. Entries < 0 in
    ``labels`` (ids not in the pool) get weight 0."""
    labels = np.asarray(labels)
    w = np.zeros((int(n_boot), labels.size))
    for c in np.unique(labels[labels >= 0]):
        idx = np.flatnonzero(labels == c)
        w[:, idx] = rng.multinomial(idx.size, np.full(idx.size, 1.0 / idx.size), size=int(n_boot))
    return w


def seed_t_interval(per_seed, alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Student-t interval of the mean over the last axis (the seeds), df = seeds - 1 (``scipy.stats.t``).

    Args:
        per_seed: (..., S) one value per seed, e.g. the seed's mean paired difference over its sites.
        alpha: 1 - confidence level.

    Returns:
        ``(mean, low, high)``, each of shape (...); low/high NaN with fewer than 2 seeds.
    """
    v = np.asarray(per_seed, np.float64)
    S = v.shape[-1]
    mean = v.mean(axis=-1)
    if S < 2:
        nan = np.full(mean.shape, np.nan)
        return mean, nan, nan
    half = _st.t.ppf(1 - alpha / 2, S - 1) * v.std(axis=-1, ddof=1) / np.sqrt(S)
    return mean, mean - half, mean + half


def cluster_t_interval(estimate, replicates, n_seeds: int, alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """``estimate ± t(1 - alpha/2, S - 1) · sd(replicates) · sqrt(S / (S - 1))``.

    Args:
        estimate: (...) point estimates. replicates: (..., R) cluster-bootstrap replicates of each.
        n_seeds: S, the number of seed clusters.

    Returns:
        ``(low, high)`` of shape (...); NaN with fewer than 2 seeds.
    """
    est = np.asarray(estimate, np.float64)
    reps = np.asarray(replicates, np.float64)
    if n_seeds < 2:
        nan = np.full(est.shape, np.nan)
        return nan, nan
    se = reps.std(axis=-1, ddof=1) * np.sqrt(n_seeds / (n_seeds - 1))
    half = _st.t.ppf(1 - alpha / 2, n_seeds - 1) * se
    return est - half, est + half


def percentile_interval(replicates, alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """The ``alpha/2`` and ``1 - alpha/2`` quantiles of the replicates (..., R) over the last axis."""
    lo, hi = np.quantile(np.asarray(replicates, np.float64), [alpha / 2, 1 - alpha / 2], axis=-1)
    return lo, hi


def combine_seeds(per_seed_reps: np.ndarray, seed_counts: np.ndarray) -> np.ndarray:
    """A replicate of the mean over seeds: ``sum_s m_s x_s / sum_s m_s`` with seed multiplicities ``m`` (R, S) and
    per-seed values ``x`` (R, S) (each replicate's own image draw) -> (R,). NaN seeds are left out of the mean."""
    x = np.asarray(per_seed_reps, np.float64)
    m = np.asarray(seed_counts, np.float64) * ~np.isnan(x)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (m * np.nan_to_num(x)).sum(axis=-1) / m.sum(axis=-1)
