"""Paired method comparison on a shared external test set: differences with a joint seeds x images bootstrap CI.

Setting (docs/evaluation.md): every method is run with the same seeds; in each seed every site ends with one deployed
model, and every model is scored on the *same* external images. For two methods A and B the paired difference is

    Delta = mean over seeds s and sites k of [ M(y, p_A[s, k]) - M(y, p_B[s, k]) ]

with M the ROC-AUC (scikit-learn ``roc_auc_score``; in the bootstrap replicates the equal, vectorised
:class:`WeightedAUC`) or the balanced accuracy at the argmax rule (binary: p >= 0.5).
Its 95% CI is a percentile bootstrap that resamples **seeds and images jointly** (Davison & Hinkley 1997, Ch. 3.8,
two-stage resampling): each replicate draws S seeds with replacement and N images with replacement (within each
class, so every replicate keeps both classes and the AUC stays defined), recomputes every (seed, site) metric of both
methods on the same drawn images, and averages the differences over the drawn seeds and all sites. Sites are not
resampled: each site's deployed model is an endpoint of its own.

Verdict: ``better`` when the CI lies above 0, ``worse`` when it lies below 0, else ``no difference detected`` (an
interval that covers 0 is not evidence of equality).
"""
from __future__ import annotations

from typing import Any

import numpy as np
from sklearn.metrics import roc_auc_score

PAIRED_METRICS = ("auc", "balanced_accuracy")
VERDICTS = ("better", "no difference detected", "worse")


class WeightedAUC:
    """ROC-AUC of many score rows against fixed labels under changing image weights (bootstrap counts), equal to
    scikit-learn's ``roc_auc_score(y, s, sample_weight=w)`` (the Mann-Whitney form, ties counted one half), but
    vectorised: the rows are sorted once, and each call is O(R N) instead of R scikit-learn calls.

    Args:
        y: (N,) binary labels. scores: (R, N) scores, one row per model.
    """

    def __init__(self, y: np.ndarray, scores: np.ndarray):
        self.order = np.argsort(scores, axis=1, kind="mergesort")
        s = np.take_along_axis(scores, self.order, axis=1)
        self.pos = (np.asarray(y)[self.order] == 1)
        R, N = s.shape
        new = np.ones((R, N), dtype=bool)
        new[:, 1:] = s[:, 1:] != s[:, :-1]  # first element of each tie group
        idx = np.broadcast_to(np.arange(N), (R, N))
        self.start = np.maximum.accumulate(np.where(new, idx, 0), axis=1)  # first index of each element's group
        end_new = np.ones((R, N), dtype=bool)
        end_new[:, :-1] = new[:, 1:]
        self.end = np.minimum.accumulate(np.where(end_new, idx, N - 1)[:, ::-1], axis=1)[:, ::-1]

    def __call__(self, w: np.ndarray) -> np.ndarray:
        """AUC of every row, image ``i`` weighted ``w[i]`` (R,)."""
        ws = np.asarray(w, dtype=np.float64)[self.order]
        wneg = np.where(self.pos, 0.0, ws)
        wpos = np.where(self.pos, ws, 0.0)
        cum = np.cumsum(wneg, axis=1)
        before = np.take_along_axis(cum, self.start, axis=1) - np.take_along_axis(wneg, self.start, axis=1)
        tied = np.take_along_axis(cum, self.end, axis=1) - before
        num = (wpos * (before + 0.5 * tied)).sum(axis=1)
        return num / (wpos.sum(axis=1) * wneg.sum(axis=1))


def _metric_rows(metric: str, y: np.ndarray, scores: np.ndarray, w: np.ndarray | None) -> np.ndarray:
    """Metric of every row of ``scores`` (R, N) against labels ``y`` (N,), images weighted by counts ``w`` (N,)."""
    if metric == "auc":  # the point estimate: scikit-learn itself
        return np.asarray([roc_auc_score(y, s, sample_weight=w) for s in scores], dtype=np.float64)
    if metric == "balanced_accuracy":
        w = np.ones_like(y, dtype=np.float64) if w is None else w.astype(np.float64)
        pred = scores >= 0.5
        pos, neg = (y == 1), (y == 0)
        tpr = (pred[:, pos] * w[pos]).sum(axis=1) / w[pos].sum()
        tnr = ((~pred[:, neg]) * w[neg]).sum(axis=1) / w[neg].sum()
        return 0.5 * (tpr + tnr)
    raise ValueError(f"unknown paired metric {metric!r}; choose one of {', '.join(PAIRED_METRICS)}")


def verdict(ci_low: float | None, ci_high: float | None) -> str | None:
    """``better`` (CI above 0) / ``worse`` (CI below 0) / ``no difference detected`` (CI covers 0); None without a
    CI."""
    if ci_low is None or ci_high is None:
        return None
    if ci_low > 0:
        return "better"
    if ci_high < 0:
        return "worse"
    return "no difference detected"


def paired_bootstrap(y, scores_a, scores_b, metric: str = "auc", n_boot: int = 1000, seed: int = 0,
                     alpha: float = 0.05) -> dict[str, Any]:
    """Paired difference A - B of a metric over (seed, site) pairs, with a joint seeds x images bootstrap CI.

    Args:
        y: (N,) binary labels (0 = NORMAL, 1 = PNEUMONIA) of the shared external images; both classes present.
        scores_a, scores_b: (S, K, N) probabilities of the positive class, S seeds x K sites x N images; entry
            ``[s, k]`` of A and of B is one pair (same seed, same site).
        metric: ``"auc"`` (scikit-learn ROC-AUC) or ``"balanced_accuracy"`` (argmax rule, p >= 0.5).
        n_boot: bootstrap replicates (percentile interval).
        seed: seeds the resampling (deterministic).
        alpha: 1 - confidence level (0.05: a 95% CI).

    Returns:
        ``{"metric", "n_seeds", "n_sites", "n_images", "n_pairs", "a", "b", "diff", "ci_low", "ci_high",
        "verdict", "n_boot"}``: ``a``/``b`` the mean metric of each method, ``diff`` = a - b (point estimate on
        the full data), CI bounds of the difference, and :func:`verdict` of it. ``ci_*`` are None with n_boot 0.

    Raises:
        ValueError: shapes differ or are not (S, K, N) with N = len(y); y not binary with both classes.
    """
    y = np.asarray(y).astype(np.int64).reshape(-1)
    a = np.asarray(scores_a, dtype=np.float64)
    b = np.asarray(scores_b, dtype=np.float64)
    if a.ndim != 3 or a.shape != b.shape or a.shape[2] != y.size:
        raise ValueError(f"scores must both be (seeds, sites, {y.size}) arrays; got {a.shape} and {b.shape}")
    if set(np.unique(y).tolist()) != {0, 1}:
        raise ValueError("y must hold binary labels with both classes present")
    S, K, N = a.shape
    flat = np.concatenate([a.reshape(S * K, N), b.reshape(S * K, N)])

    fast = WeightedAUC(y, flat) if metric == "auc" else None

    def per_pair(w):
        m = fast(w) if (fast is not None and w is not None) else _metric_rows(metric, y, flat, w)
        return m[: S * K].reshape(S, K), m[S * K:].reshape(S, K)

    ma, mb = per_pair(None)
    out: dict[str, Any] = {"metric": metric, "n_seeds": S, "n_sites": K, "n_images": N, "n_pairs": S * K,
                           "a": float(ma.mean()), "b": float(mb.mean()), "diff": float((ma - mb).mean()),
                           "ci_low": None, "ci_high": None, "verdict": None, "n_boot": int(n_boot)}
    if n_boot <= 0:
        return out
    rng = np.random.default_rng(seed)
    classes = [np.flatnonzero(y == c) for c in (0, 1)]
    reps = np.empty(n_boot)
    for i in range(n_boot):
        seeds = np.bincount(rng.integers(0, S, S), minlength=S).astype(np.float64)  # seed multiplicities
        w = np.zeros(N)
        for idx in classes:
            np.add.at(w, rng.choice(idx, size=idx.size, replace=True), 1.0)
        da, db = per_pair(w)
        reps[i] = float((seeds[:, None] * (da - db)).sum() / (seeds.sum() * K))
    lo, hi = np.quantile(reps, [alpha / 2, 1 - alpha / 2])
    out.update(ci_low=float(lo), ci_high=float(hi), verdict=verdict(float(lo), float(hi)))
    return out
