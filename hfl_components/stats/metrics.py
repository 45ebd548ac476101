"""Metrics under image weights (bootstrap multiplicities), vectorised where the bootstrap needs speed.

Every function here takes image weights ``w`` (non-negative; the bootstrap's draw counts, or None = one each) so
that a bootstrap replicate is the same metric computed with different weights. Pure numpy.
"""
from __future__ import annotations

import numpy as np

#: metrics of the binary (pneumonia vs normal) crossed comparison
PAIRED_METRICS = ("auc", "balanced_accuracy")
#: metrics of a site model on its own images (multi-class allowed)
SITE_METRICS = ("balanced_accuracy", "auc")


class WeightedAUC:
    """ROC-AUC of many score rows against fixed labels under changing image weights (bootstrap counts), equal to
    scikit-learn's ``roc_auc_score(y, s, sample_weight=w)`` (the Mann-Whitney form, ties counted one half), but
    vectorised: the rows are sorted once, and each call is O(R N) instead of R scikit-learn calls.

    Args:
        y: (N,) binary labels. scores: (R, N) scores, one row per model.
    """

    def __init__(self, y: np.ndarray, scores: np.ndarray):
        scores = np.asarray(scores, np.float64)
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

    def __call__(self, w: np.ndarray | None = None) -> np.ndarray:
        """AUC of every row, image ``i`` weighted ``w[i]`` (None: 1 each) -> (R,); NaN where a class has no weight."""
        ws = (np.ones(self.order.shape[1]) if w is None else np.asarray(w, dtype=np.float64))[self.order]
        wneg = np.where(self.pos, 0.0, ws)
        wpos = np.where(self.pos, ws, 0.0)
        cum = np.cumsum(wneg, axis=1)
        before = np.take_along_axis(cum, self.start, axis=1) - np.take_along_axis(wneg, self.start, axis=1)
        tied = np.take_along_axis(cum, self.end, axis=1) - before
        num = (wpos * (before + 0.5 * tied)).sum(axis=1)
        den = wpos.sum(axis=1) * wneg.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def binary_metric_rows(metric: str, y: np.ndarray, scores: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    """Metric of every row of ``scores`` (R, N) (probability of the positive class) against binary labels ``y`` (N,),
    images weighted by ``w`` (N,) (None: 1 each) -> (R,).

    ``auc``: ROC-AUC (:class:`WeightedAUC`). ``balanced_accuracy``: mean of sensitivity and specificity of the rule
    p >= 0.5. Raises ValueError for another metric."""
    y = np.asarray(y)
    scores = np.asarray(scores, np.float64)
    if metric == "auc":
        return WeightedAUC(y, scores)(w)
    if metric == "balanced_accuracy":
        w = np.ones(y.shape, dtype=np.float64) if w is None else np.asarray(w, np.float64)
        pred = scores >= 0.5
        pos, neg = (y == 1), (y == 0)
        tpr = (pred[:, pos] * w[pos]).sum(axis=1) / w[pos].sum()
        tnr = ((~pred[:, neg]) * w[neg]).sum(axis=1) / w[neg].sum()
        return 0.5 * (tpr + tnr)
    raise ValueError(f"unknown paired metric {metric!r}; choose one of {', '.join(PAIRED_METRICS)}")


def weighted_auc(pos: np.ndarray, scores: np.ndarray, w: np.ndarray) -> float:
    """ROC-AUC of ``scores`` (N,) for the binary labels ``pos`` (N,) with image weights ``w`` (N,) (Mann-Whitney,
    ties one half), equal to scikit-learn's ``roc_auc_score(pos, scores, sample_weight=w)``; NaN when a side has
    no weight."""
    pos = np.asarray(pos, bool)
    wp, wn = np.asarray(w, np.float64)[pos].sum(), np.asarray(w, np.float64)[~pos].sum()
    if wp <= 0 or wn <= 0:
        return float("nan")
    return float(WeightedAUC(pos.astype(np.int64), np.asarray(scores, np.float64)[None])(w)[0])


def site_metric(metric: str, y: np.ndarray, probs: np.ndarray, w: np.ndarray | None = None) -> float:
    """One site model's metric on its images, images weighted by ``w`` (bootstrap multiplicities; None = 1 each).

    Args:
        metric: ``balanced_accuracy``: mean over classes with weight > 0 of the weighted recall of the argmax
            prediction. ``auc``: mean over classes c with weight on both sides of the one-vs-rest AUC of
            ``probs[:, c]``.
        y: (N,) int class indices. probs: (N, C) class probabilities.

    Returns:
        The metric (a fraction), NaN when undefined.

    Raises:
        ValueError: an unknown metric.
    """
    y = np.asarray(y, np.int64)
    p = np.asarray(probs, np.float64)
    w = np.ones(y.size) if w is None else np.asarray(w, np.float64)
    classes = [c for c in range(p.shape[1]) if w[y == c].sum() > 0]
    if metric == "balanced_accuracy":
        if not classes:
            return float("nan")
        pred = p.argmax(axis=1)
        return float(np.mean([(w[(y == c)] * (pred[y == c] == c)).sum() / w[y == c].sum() for c in classes]))
    if metric == "auc":
        aucs = [weighted_auc(y == c, p[:, c], w) for c in classes]
        aucs = [a for a in aucs if not np.isnan(a)]
        return float(np.mean(aucs)) if aucs else float("nan")
    raise ValueError(f"unknown site metric {metric!r}; choose one of {', '.join(SITE_METRICS)}")
