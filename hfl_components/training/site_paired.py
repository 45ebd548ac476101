"""Paired differences between two methods' *site* models, each site scored on its own images.

Personalised methods (Local, FedProto, FedSAF, FedTopo) end with one model per site, and each site is scored on
images of its own: its test split, or the external evaluation images of the classes it holds. For methods A and B
run with the same seeds, pair ``(s, k)`` is site k in seed s (identical partition), and

    Delta = mean over pairs (s, k) of [ M(y_sk, p_A[s, k]) - M(y_sk, p_B[s, k]) ]

with M the balanced accuracy at the argmax rule (mean recall over the classes present in ``y_sk``, scikit-learn's
``balanced_accuracy_score``) or the macro one-vs-rest ROC-AUC over the classes present (as
:func:`hfl_components.training.compute_metrics`). The 95% CI is a percentile bootstrap that resamples **seeds and
images jointly** (two-stage, Davison & Hinkley 1997, Ch. 3.8), as ``cxr-hfl compare``'s external comparison: each
replicate draws the seeds with replacement and the images with replacement within each class of an image *pool*;
every pair's images carry ids into a pool, so sites that share external images see the same draw, and a site's own
test images are a pool of their own. Sites are not resampled. Verdict wording as ``compare``: ``better`` (CI above
0), ``worse`` (CI below 0), else ``no difference detected``.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

VERDICTS = ("better", "no difference detected", "worse")
SITE_METRICS = ("balanced_accuracy", "auc")


def verdict(ci_low: float | None, ci_high: float | None) -> str | None:
    """``better`` (CI above 0) / ``worse`` (CI below 0) / ``no difference detected`` (CI covers 0); None without
    a CI: :func:`hfl_components.training.paired.verdict`, the wording of ``cxr-hfl compare``."""
    from hfl_components.training.paired import verdict as _verdict

    return _verdict(ci_low, ci_high)


def weighted_auc(pos: np.ndarray, scores: np.ndarray, w: np.ndarray) -> float:
    """ROC-AUC of ``scores`` for the binary labels ``pos`` with image weights ``w`` (Mann-Whitney, ties one half),
    equal to scikit-learn's ``roc_auc_score(pos, scores, sample_weight=w)``; NaN when a side has no weight."""
    pos = np.asarray(pos, bool)
    s = np.asarray(scores, np.float64)
    w = np.asarray(w, np.float64)
    wp, wn = w[pos].sum(), w[~pos].sum()
    if wp <= 0 or wn <= 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    s, p, ww = s[order], pos[order], w[order]
    uniq, start = np.unique(s, return_index=True)
    grp = np.searchsorted(uniq, s)
    neg_w = np.where(p, 0.0, ww)
    neg_per_grp = np.bincount(grp, weights=neg_w, minlength=uniq.size)
    below = np.concatenate([[0.0], np.cumsum(neg_per_grp)[:-1]])
    num = (np.where(p, ww, 0.0) * (below[grp] + 0.5 * neg_per_grp[grp])).sum()
    return float(num / (wp * wn))


def site_metric(metric: str, y: np.ndarray, probs: np.ndarray, w: np.ndarray | None = None) -> float:
    """One site's metric with image weights ``w`` (bootstrap multiplicities; None = 1 each).

    ``balanced_accuracy``: mean over classes with weight > 0 of the weighted recall of the argmax prediction.
    ``auc``: mean over classes c with weight on both sides of the one-vs-rest AUC of ``probs[:, c]``. NaN when
    undefined. Raises ValueError for an unknown metric.
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


def paired_site_bootstrap(pairs: Sequence[dict], metric: str = "balanced_accuracy", n_boot: int = 1000,
                          seed: int = 0, alpha: float = 0.05) -> dict[str, Any]:
    """Paired difference A - B over (seed, site) pairs with a joint seeds x images bootstrap CI.

    Args:
        pairs: one dict per (seed, site): ``seed`` (any hashable), ``ids`` (N,) int ids of its images in
            ``pool`` (a key naming the image pool; pairs with the same pool share draws), ``pool``, ``y`` (N,) int
            labels, ``pa``/``pb`` (N, C) class probabilities of methods A and B on those images.
        metric: ``balanced_accuracy`` or ``auc`` (:func:`site_metric`).
        n_boot: percentile-bootstrap replicates (0: no CI). seed: seeds the resampling. alpha: 0.05 -> 95% CI.

    Returns:
        ``{"metric", "n_pairs", "n_seeds", "a", "b", "diff", "ci_low", "ci_high", "verdict", "n_boot"}``; ``a``/``b``
        mean metric of each method over the pairs where both are defined, ``diff`` their paired mean difference.

    Raises:
        ValueError: no pairs, or a pair's arrays of different lengths.
    """
    if not pairs:
        raise ValueError("no (seed, site) pairs to compare")
    if metric not in SITE_METRICS:
        raise ValueError(f"unknown site metric {metric!r}; choose one of {', '.join(SITE_METRICS)}")
    for q in pairs:
        if not (len(q["ids"]) == len(q["y"]) == len(q["pa"]) == len(q["pb"])):
            raise ValueError(f"pair seed {q.get('seed')} site {q.get('site')}: ids, y, pa, pb differ in length")
    seeds = sorted({q["seed"] for q in pairs}, key=str)
    s_index = np.asarray([seeds.index(q["seed"]) for q in pairs])
    # each pool: size (max id + 1) and the label of every id (for class-stratified draws)
    pools: dict[Any, np.ndarray] = {}
    for q in pairs:
        ids = np.asarray(q["ids"], np.int64)
        lab = pools.setdefault(q["pool"], np.full(0, -1, np.int64))
        if lab.size <= ids.max(initial=-1):
            lab = np.concatenate([lab, np.full(ids.max() + 1 - lab.size, -1, np.int64)])
        lab[ids] = np.asarray(q["y"], np.int64)
        pools[q["pool"]] = lab

    # per pair, what does not change between replicates: argmax correctness, and one sorted two-row AUC evaluator
    # (methods A and B) per class (hfl_components.training.paired.WeightedAUC, equal to scikit-learn's weighted AUC)
    from hfl_components.training.paired import WeightedAUC

    prep = []
    for q in pairs:
        y = np.asarray(q["y"], np.int64)
        pa, pb = np.asarray(q["pa"], np.float64), np.asarray(q["pb"], np.float64)
        C = pa.shape[1]
        ok = np.stack([pa.argmax(1) == y, pb.argmax(1) == y]).astype(np.float64)
        aucs = {c: WeightedAUC((y == c).astype(np.int64), np.stack([pa[:, c], pb[:, c]]))
                for c in range(C) if 0 < (y == c).sum() < y.size} if metric == "auc" else {}
        prep.append((y, C, ok, aucs))

    def pair_metric(i: int, w: np.ndarray | None) -> np.ndarray:
        y, C, ok, aucs = prep[i]
        w = np.ones(y.size) if w is None else w
        wc = np.bincount(y, weights=w, minlength=C)
        if metric == "balanced_accuracy":
            have = wc > 0
            if not have.any():
                return np.full(2, np.nan)
            rec = np.stack([np.bincount(y, weights=w * ok[m], minlength=C) for m in (0, 1)])[:, have] / wc[have]
            return rec.mean(axis=1)
        vals = [ev(w) for c, ev in aucs.items() if wc[c] > 0 and w.sum() - wc[c] > 0]
        return np.mean(vals, axis=0) if vals else np.full(2, np.nan)

    def diffs(weights: dict | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        m = np.stack([pair_metric(i, None if weights is None else weights[q["pool"]][np.asarray(q["ids"], np.int64)])
                      for i, q in enumerate(pairs)])
        return m[:, 0], m[:, 1], m[:, 0] - m[:, 1]

    a, b, d = diffs(None)
    ok = ~np.isnan(d)
    out: dict[str, Any] = {"metric": metric, "n_pairs": int(ok.sum()), "n_seeds": len(seeds),
                           "a": float(a[ok].mean()) if ok.any() else None,
                           "b": float(b[ok].mean()) if ok.any() else None,
                           "diff": float(d[ok].mean()) if ok.any() else None,
                           "ci_low": None, "ci_high": None, "verdict": None, "n_boot": int(n_boot)}
    if n_boot <= 0 or not ok.any():
        return out
    rng = np.random.default_rng(seed)
    reps = []
    for _ in range(int(n_boot)):
        mult = np.bincount(rng.integers(0, len(seeds), len(seeds)), minlength=len(seeds)).astype(np.float64)
        weights = {}
        for key, lab in pools.items():
            w = np.zeros(lab.size)
            for c in np.unique(lab[lab >= 0]):
                idx = np.flatnonzero(lab == c)
                np.add.at(w, rng.choice(idx, size=idx.size, replace=True), 1.0)
            weights[key] = w
        _, _, dr = diffs(weights)
        pw = mult[s_index] * ~np.isnan(dr)
        if pw.sum() > 0:
            reps.append(float(np.nansum(pw * np.nan_to_num(dr)) / pw.sum()))
    lo, hi = np.quantile(reps, [alpha / 2, 1 - alpha / 2])
    out.update(ci_low=float(lo), ci_high=float(hi), verdict=verdict(float(lo), float(hi)))
    return out
