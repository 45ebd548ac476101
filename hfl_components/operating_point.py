"""A clinical operating point agreed by the federation: temperature scaling per site, one threshold for a target
sensitivity chosen on pooled coarse histograms.

The rule (each function below is one step):

1. Each site fits the temperature T of its own deployed model on its own validation split
   (:func:`fit_temperature`; Guo et al. 2017, arXiv:1706.04599: one scalar dividing the logits, chosen to minimise
   the negative log-likelihood; it leaves the ranking, hence the AUC, unchanged).
2. Each site sends :func:`coarse_histogram` of its *calibrated* validation p(positive), per class: counts on a fixed
   grid of bin edges, adjacent bins merged until every non-empty bin holds at least ``min_count`` images of that
   class. What leaves the site: the merged bin edges (points of the fixed grid) and the counts per class; no single
   image's score can be read off more precisely than a bin shared with ``min_count - 1`` others.
3. The server pools the histograms and picks the largest threshold t on calibrated probability whose pooled
   sensitivity reaches the target (:func:`pooled_threshold`). A bin that straddles t is counted against t (its
   positives as missed, its negatives as false positives), so the pooled sensitivity and specificity are lower
   bounds. Each site applies t to its own calibrated model.

Assumption: calibrated probabilities of different sites' models are comparable, i.e. p = 0.7 means the same risk at
every site. Where a site's case mix or model differ, its own sensitivity at t differs from the pooled one; each
site's achieved value is therefore reported beside the pooled one (:func:`site_sensitivity`).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

DEFAULT_TARGET_SENSITIVITY = 0.95
DEFAULT_MIN_COUNT = 5
DEFAULT_GRID = tuple(np.round(np.linspace(0.0, 1.0, 21), 4))  # 0.05 steps


def _log_probs(probs) -> np.ndarray:
    p = np.clip(np.asarray(probs, np.float64), 1e-12, 1.0)
    return np.log(p)


def apply_temperature(probs, T: float) -> np.ndarray:
    """Calibrated probabilities (N, C) = softmax(log(probs) / T). Equals softmax(logits / T) for the logits that
    gave ``probs`` (softmax is shift invariant), so stored probabilities are enough."""
    z = _log_probs(probs) / float(T)
    z -= z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def fit_temperature(probs, y, bounds: tuple[float, float] = (0.05, 20.0)) -> float:
    """Temperature T > 0 minimising the mean negative log-likelihood of ``apply_temperature(probs, T)`` for labels
    ``y`` (N,); probs (N, C). Bounded scalar search over log T (scipy). Returns 1.0 for an empty split.

    Raises:
        ValueError: a label outside 0..C-1.
    """
    from scipy.optimize import minimize_scalar

    y = np.asarray(y).astype(int)
    lp = _log_probs(probs)
    if y.size == 0:
        return 1.0
    if y.min() < 0 or y.max() >= lp.shape[1]:
        raise ValueError(f"labels outside 0..{lp.shape[1] - 1}")

    def nll(logt):
        z = lp / np.exp(logt)
        z = z - z.max(axis=1, keepdims=True)
        return float(-(z[np.arange(y.size), y] - np.log(np.exp(z).sum(axis=1))).mean())

    r = minimize_scalar(nll, bounds=(np.log(bounds[0]), np.log(bounds[1])), method="bounded",
                        options={"xatol": 1e-4})
    return float(np.exp(r.x))


def expected_calibration_error(probs, y, n_bins: int = 10) -> float | None:
    """Top-label expected calibration error (Guo et al. 2017): over ``n_bins`` equal-width bins of the predicted
    class's probability, the image-weighted mean |accuracy - mean confidence|. probs (N, C), y (N,); None if N = 0."""
    p = np.asarray(probs, np.float64)
    y = np.asarray(y).astype(int)
    if y.size == 0:
        return None
    conf, pred = p.max(axis=1), p.argmax(axis=1)
    b = np.minimum((conf * n_bins).astype(int), n_bins - 1)
    ece = 0.0
    for k in range(n_bins):
        m = b == k
        if m.any():
            ece += m.mean() * abs((pred[m] == y[m]).mean() - conf[m].mean())
    return float(ece)


def coarse_histogram(p_pos, y, grid: Sequence[float] = DEFAULT_GRID, min_count: int = DEFAULT_MIN_COUNT) -> dict:
    """Per-class histogram of p(positive) (N,) for binary labels ``y`` (N,), safe to send to the server.

    Counts on ``grid`` (bins [e_i, e_{i+1}), the last closed), then, per class, adjacent bins merged left to right
    until each holds >= ``min_count`` images; a remainder under ``min_count`` joins the last non-empty bin; an
    empty stretch outside a bin is a bin of count 0 (a class with fewer than ``min_count`` images in all: one bin
    spanning the grid). What this reveals: per class, counts of >= ``min_count`` images per bin, and where the
    non-empty bins start and end (to one grid step: e.g. that one of the >= ``min_count`` images of the lowest bin
    lies in its first grid step), never which image or its score.

    Returns:
        ``{"min_count": k, "classes": {"0": {"edges": [...], "counts": [...]}, "1": {...}}}`` (JSON-safe; edges are
        grid points, len(edges) = len(counts) + 1).
    Raises:
        ValueError: ``min_count`` < 1, a grid that is not increasing, or labels other than 0/1.
    """
    grid = np.asarray(grid, np.float64)
    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}")
    if grid.ndim != 1 or grid.size < 2 or np.any(np.diff(grid) <= 0):
        raise ValueError("grid must be an increasing list of at least two edges")
    p = np.asarray(p_pos, np.float64)
    y = np.asarray(y).astype(int)
    if y.size and not set(np.unique(y)) <= {0, 1}:
        raise ValueError("coarse_histogram takes binary labels 0/1")
    out = {"min_count": int(min_count), "classes": {}}
    for c in (0, 1):
        fine, _ = np.histogram(np.clip(p[y == c], grid[0], grid[-1]), bins=grid)
        if fine.sum() < min_count:  # too few images for any bin: one bin, nothing about the scores
            out["classes"][str(c)] = {"edges": [float(grid[0]), float(grid[-1])], "counts": [int(fine.sum())]}
            continue
        edges, counts, acc = [float(grid[0])], [], 0
        for i, n in enumerate(fine):
            if acc == 0 and n == 0:  # an empty stretch outside any bin: a bin of count 0
                if counts and counts[-1] == 0:
                    edges[-1] = float(grid[i + 1])
                else:
                    edges.append(float(grid[i + 1]))
                    counts.append(0)
                continue
            acc += int(n)
            if acc >= min_count:
                edges.append(float(grid[i + 1]))
                counts.append(acc)
                acc = 0
        if acc:  # a remainder under min_count joins the last non-empty bin (and the empty ones after it)
            while counts[-1] == 0:
                counts.pop()
                edges.pop()
            counts[-1] += acc
            edges[-1] = float(grid[-1])
        out["classes"][str(c)] = {"edges": edges, "counts": counts}
    return out


def _detected(hist: dict, t: float) -> tuple[int, int]:
    """(count in bins entirely >= t, total) of one class's histogram."""
    e, n = np.asarray(hist["edges"]), np.asarray(hist["counts"])
    return int(n[e[:-1] >= t].sum()), int(n.sum())


def pooled_threshold(histograms: Sequence[dict], target: float = DEFAULT_TARGET_SENSITIVITY) -> dict:
    """One threshold on calibrated p(positive) for the pooled histograms of several sites.

    Candidates are every bin edge of any site (and 0). For a candidate t an image counts as detected only when its
    whole bin lies at or above t, so the pooled sensitivity is a lower bound; the largest t whose lower bound
    reaches ``target`` is chosen (the largest threshold gives the best specificity the histograms allow).

    Returns:
        ``{"threshold", "target", "sensitivity" (pooled lower bound), "specificity" (pooled lower bound: negatives
        in bins entirely below t), "n_positive", "n_negative", "n_sites"}``.
    Raises:
        ValueError: no histograms, or no positive image in any of them.
    """
    if not histograms:
        raise ValueError("no site histograms to pool")
    pos = [h["classes"]["1"] for h in histograms]
    neg = [h["classes"]["0"] for h in histograms]
    n_pos = sum(int(np.sum(h["counts"])) for h in pos)
    n_neg = sum(int(np.sum(h["counts"])) for h in neg)
    if n_pos == 0:
        raise ValueError("no positive image in any site's validation histogram: no sensitivity to target")
    cands = sorted({0.0, *(float(e) for h in pos + neg for e in h["edges"])})
    best = 0.0
    for t in cands:
        if sum(_detected(h, t)[0] for h in pos) / n_pos >= target:
            best = max(best, t)
    sens = sum(_detected(h, best)[0] for h in pos) / n_pos
    fp = sum(_detected(h, best)[0] for h in neg) + sum(  # negatives in bins straddling t count as false positives
        int(np.sum(np.asarray(h["counts"])[(np.asarray(h["edges"][:-1]) < best) & (np.asarray(h["edges"][1:]) > best)]))
        for h in neg)
    spec = (n_neg - fp) / n_neg if n_neg else None
    return {"threshold": float(best), "target": float(target), "sensitivity": float(sens),
            "specificity": None if spec is None else float(spec), "n_positive": n_pos, "n_negative": n_neg,
            "n_sites": len(histograms)}


def site_sensitivity(p_pos, y, threshold: float) -> dict:
    """A site's own sensitivity and specificity at ``threshold`` (p >= t is positive) on its calibrated p(positive)
    (N,) and binary labels (N,); None where a class is absent."""
    p = np.asarray(p_pos, np.float64)
    y = np.asarray(y).astype(int)
    pos, neg = y == 1, y == 0
    return {"sensitivity": float((p[pos] >= threshold).mean()) if pos.any() else None,
            "specificity": float((p[neg] < threshold).mean()) if neg.any() else None,
            "n_positive": int(pos.sum()), "n_negative": int(neg.sum())}


def site_report(val_probs, val_y, grid: Sequence[float] = DEFAULT_GRID, min_count: int = DEFAULT_MIN_COUNT) -> dict:
    """What one site sends (step 1-2): its temperature, the ECE of its validation split before and after it, and
    the coarse histogram of calibrated p(positive). ``val_probs`` (N, C) of its deployed model (C > 2: class 0 is
    negative, the rest positive); ``val_y`` (N,) labels (> 0 positive)."""
    p = np.asarray(val_probs, np.float64)
    y = (np.asarray(val_y).astype(int) > 0).astype(int)
    pb = np.stack([p[:, 0], 1.0 - p[:, 0]], axis=1)
    T = fit_temperature(pb, y)
    cal = apply_temperature(pb, T)
    return {"temperature": T, "ece_before": expected_calibration_error(pb, y),
            "ece_after": expected_calibration_error(cal, y), "n_val": int(y.size),
            "histogram": coarse_histogram(cal[:, 1], y, grid, min_count)}


def federated_operating_point(reports: dict[str, dict], target: float = DEFAULT_TARGET_SENSITIVITY) -> dict | None:
    """The server's step 3 on the sites' :func:`site_report` answers (``{site: report}``; sites without a histogram
    are left out): :func:`pooled_threshold` plus the sites pooled and the rule's name. None when no site sent one
    or no positive validation image exists."""
    hs = {s: r["histogram"] for s, r in reports.items() if r and r.get("histogram")}
    if not hs:
        return None
    try:
        res = pooled_threshold(list(hs.values()), target)
    except ValueError:
        return None
    return {**res, "sites": sorted(hs), "min_count": max(int(h["min_count"]) for h in hs.values()),
            "rule": "largest threshold on calibrated p(positive) whose pooled histogram sensitivity (lower bound) "
                    "reaches the target"}


def _rate_ci(hits: np.ndarray, n_boot: int, rng, alpha: float = 0.05) -> dict:
    """The mean of 0/1 ``hits`` with a percentile-bootstrap CI over them; None values when empty."""
    if hits.size == 0:
        return {"value": None, "ci_low": None, "ci_high": None}
    out = {"value": float(hits.mean()), "ci_low": None, "ci_high": None}
    if n_boot > 0:
        b = hits[rng.integers(0, hits.size, (int(n_boot), hits.size))].mean(axis=1)
        lo, hi = np.percentile(b, [100 * alpha / 2, 100 * (1 - alpha / 2)])
        out.update(ci_low=float(lo), ci_high=float(hi))
    return out


def metrics_at_operating_point(probs, y, op: dict, n_boot: int = 500, seed: int = 0) -> dict:
    """A deployed model's external results at its operating point ``op`` (``{"temperature", "threshold", ...}``,
    from its file header): sensitivity and specificity of calibrated p(positive) >= threshold, each
    ``{"value", "ci_low", "ci_high"}`` (percentile bootstrap over the images of each class, i.e. class-stratified),
    and the top-label ECE before and after the temperature. ``probs`` (N, C) (C > 2: class 0 negative, the rest
    positive), ``y`` (N,) labels (> 0 positive)."""
    p = np.asarray(probs, np.float64)
    yb = (np.asarray(y).astype(int) > 0).astype(int)
    pb = np.stack([p[:, 0], 1.0 - p[:, 0]], axis=1)
    cal = apply_temperature(pb, float(op["temperature"]))
    pred = cal[:, 1] >= float(op["threshold"])
    rng = np.random.default_rng(seed)
    return {"temperature": float(op["temperature"]), "threshold": float(op["threshold"]),
            "target_sensitivity": op.get("target"), "n_positive": int(yb.sum()), "n_negative": int((1 - yb).sum()),
            "sensitivity": _rate_ci(pred[yb == 1].astype(float), n_boot, rng),
            "specificity": _rate_ci((~pred[yb == 0]).astype(float), n_boot, rng),
            "ece_before": expected_calibration_error(pb, yb), "ece_after": expected_calibration_error(cal, yb)}
