"""Metadata baseline: how well do file-level facts alone (size, shape, colour mode, bit depth, file size, format,
DICOM photometric interpretation and manufacturer; :mod:`chest_xray.file_facts`) predict the label?

A model whose AUC is not clearly above this baseline may be reading the acquisition (which scanner, which export,
which class folder was resized how) rather than the lungs. The baseline is a scikit-learn random forest
(Breiman 2001) on the facts, scored by out-of-fold predictions of a stratified k-fold cross-validation, so every
image is scored by a forest that never saw it. Its AUC carries a percentile-bootstrap CI over images resampled
within each class (:mod:`hfl_components.stats`), and a model's margin (model AUC - baseline AUC) carries a paired
CI (both AUCs on the same resampled images; the baseline's out-of-fold scores are not refitted per resample).
Facts that take a single value on every image carry no information and are reported as not applicable (e.g.
every image 224 x 224: the geometric facts), never silently dropped.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from chest_xray.file_facts import CATEGORICAL_FACTS, GEOMETRIC_FACTS, NUMERIC_FACTS

#: Cross-validated metadata AUC at or above which ``site check`` warns that the labels are predictable from files.
WARN_AUC = 0.8
N_FOLDS = 5


def _auc(y: np.ndarray, s: np.ndarray) -> float | None:
    """ROC AUC of scores ``s`` for labels ``y`` (1 positive) by the Mann-Whitney rank sum, ties counted half;
    None when a class is absent (fast enough for bootstraps)."""
    from scipy.stats import rankdata

    y = np.asarray(y).astype(bool)
    n1 = int(y.sum())
    n0 = y.size - n1
    if n1 == 0 or n0 == 0:
        return None
    r = rankdata(np.asarray(s, np.float64))
    return float((r[y].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def bootstrap_aucs(y, scores: Sequence, weights: np.ndarray) -> np.ndarray:
    """AUCs (B, K) of K score vectors (each (N,)) under B image-weight rows ``weights`` (B, N) (bootstrap
    multiplicities, :func:`hfl_components.stats.draw_image_counts`), the same weights for every score vector
    (paired); :class:`hfl_components.stats.WeightedAUC` (Mann-Whitney, ties one half). NaN where a class has no
    weight."""
    from hfl_components.stats import WeightedAUC

    auc = WeightedAUC(np.asarray(y).astype(np.int64), np.stack([np.asarray(s, np.float64) for s in scores]))
    return np.stack([auc(w) for w in np.asarray(weights, np.float64)])


def _draws(y, n_boot: int, seed: int) -> np.ndarray:
    """Class-stratified bootstrap multiplicities (n_boot, N) of the images (every draw keeps both classes)."""
    from hfl_components.stats import draw_image_counts

    return draw_image_counts(np.random.default_rng(seed), int(n_boot), np.asarray(y).astype(int))


def facts_matrix(facts: Sequence[dict[str, Any]]) -> tuple[np.ndarray, list[str], dict[str, str]]:
    """Feature matrix of the facts of N images.

    Numeric facts are used as they are (a missing value -> the median of the others, plus nothing else);
    categorical facts are one-hot encoded (a missing optional DICOM tag is its own category ``absent``). A fact with
    one value on every image (or absent everywhere) is left out and named in the third return value with the
    reason; when every image has the same geometry, the geometric facts are reported together.

    Returns:
        ``X`` (N, F) float64, the F column names (``fact`` or ``fact=value``), ``{fact: why not applicable}``.
    Raises:
        ValueError: no images.
    """
    n = len(facts)
    if n == 0:
        raise ValueError("no images to build metadata features from")
    cols: list[np.ndarray] = []
    names: list[str] = []
    na: dict[str, str] = {}
    for f in NUMERIC_FACTS:
        v = np.array([np.nan if d.get(f) is None else float(d[f]) for d in facts], dtype=np.float64)
        ok = ~np.isnan(v)
        if not ok.any():
            na[f] = "absent from every file"
            continue
        if np.unique(v[ok]).size == 1 and ok.all():
            na[f] = f"the same on every image ({v[0]:g})"
            continue
        v[~ok] = np.median(v[ok])
        cols.append(v)
        names.append(f)
    for f in CATEGORICAL_FACTS:
        vals = ["absent" if d.get(f) is None else str(d[f]) for d in facts]
        levels = sorted(set(vals))
        if len(levels) == 1:
            na[f] = ("absent from every file" if levels[0] == "absent" else f"the same on every image ({levels[0]})")
            continue
        for lv in levels:
            cols.append(np.array([float(x == lv) for x in vals]))
            names.append(f"{f}={lv}")
    if all(g in na for g in GEOMETRIC_FACTS):
        w, h = facts[0].get("width"), facts[0].get("height")
        for g in GEOMETRIC_FACTS:
            na[g] = f"every image is {w} x {h} px"
    X = np.stack(cols, axis=1) if cols else np.zeros((n, 0))
    return X, names, na


def fact_aucs(facts: Sequence[dict[str, Any]], y) -> dict[str, float]:
    """AUC of each numeric fact by itself as a score for class 1, oriented so that it is >= 0.5 (a fact that
    separates the classes in either direction scores high); only facts that vary. Categorical facts: the AUC of the
    share of class 1 within each value (in-sample, an upper bound)."""
    y = np.asarray(y).astype(int)
    out: dict[str, float] = {}
    for f in NUMERIC_FACTS:
        v = np.array([np.nan if d.get(f) is None else float(d[f]) for d in facts])
        ok = ~np.isnan(v)
        if ok.sum() < 2 or np.unique(v[ok]).size < 2:
            continue
        a = _auc(y[ok], v[ok])
        if a is not None:
            out[f] = max(a, 1 - a)
    for f in CATEGORICAL_FACTS:
        vals = np.array(["absent" if d.get(f) is None else str(d[f]) for d in facts])
        if np.unique(vals).size < 2:
            continue
        rate = {lv: y[vals == lv].mean() for lv in np.unique(vals)}
        a = _auc(y, np.array([rate[v] for v in vals]))
        if a is not None:
            out[f] = max(a, 1 - a)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def cross_validated_scores(X: np.ndarray, y, seed: int = 0, folds: int = N_FOLDS) -> np.ndarray:
    """Out-of-fold p(class 1) (N,) of a random forest (100 trees, leaves of >= 3 images) on ``X`` (N, F), stratified
    k-fold with ``min(folds, smallest class count)`` folds, seeded.

    Raises:
        ValueError: fewer than 2 images of either class, or no features.
    """
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.model_selection import StratifiedKFold, cross_val_predict

    y = np.asarray(y).astype(int)
    counts = np.bincount(y, minlength=2)
    if X.shape[1] == 0:
        raise ValueError("no file-level fact varies between the images")
    if counts.min() < 2:
        raise ValueError(f"too few images of one class for cross-validation (class counts {counts.tolist()})")
    k = int(min(folds, counts.min()))
    clf = RandomForestClassifier(n_estimators=100, min_samples_leaf=3, random_state=seed, n_jobs=1)
    cv = StratifiedKFold(n_splits=k, shuffle=True, random_state=seed)
    return cross_val_predict(clf, X, y, cv=cv, method="predict_proba")[:, 1]


def metadata_baseline(facts: Sequence[dict[str, Any]], y, seed: int = 0, n_boot: int = 1000) -> dict[str, Any]:
    """The metadata baseline of N images with binary labels ``y`` (N,) (1 = PNEUMONIA).

    Returns:
        ``{"auc", "ci_low", "ci_high", "n", "features" (columns used), "not_applicable" ({fact: reason}),
        "fact_aucs" (:func:`fact_aucs`), "scores" (N,) out-of-fold p(class 1), "skipped" (None, or why no AUC)}``.
    """
    y = np.asarray(y).astype(int)
    X, names, na = facts_matrix(facts)
    out: dict[str, Any] = {"n": int(len(y)), "features": names, "not_applicable": na,
                           "fact_aucs": fact_aucs(facts, y), "auc": None, "ci_low": None, "ci_high": None,
                           "scores": None, "skipped": None}
    try:
        s = cross_validated_scores(X, y, seed)
    except ValueError as e:
        out["skipped"] = str(e)
        return out
    out["scores"] = s
    out["auc"] = _auc(y, s)
    b = bootstrap_aucs(y, [s], _draws(y, n_boot, seed))[:, 0]
    lo, hi = _pct(b)
    out.update(ci_low=lo, ci_high=hi)
    return out


def _pct(v: np.ndarray, alpha: float = 0.05) -> tuple:
    v = v[np.isfinite(v)]
    if v.size == 0:
        return None, None
    lo, hi = np.percentile(v, [100 * alpha / 2, 100 * (1 - alpha / 2)])
    return float(lo), float(hi)


def auc_margin(y, p_model, meta_scores, n_boot: int = 1000, seed: int = 0) -> dict[str, Any]:
    """A model's AUC, the metadata baseline's, and the margin (model - metadata), each with a 95 % CI from the same
    paired bootstrap over images; ``covers_zero`` when the margin's CI includes 0, ``beats_metadata`` when its
    lower bound is above 0 (only then is the model shown to do better than the file facts; the audit flags every
    other model).

    Args:
        y: (N,) binary labels. p_model: (N,) the model's p(class 1). meta_scores: (N,) the baseline's out-of-fold
            p(class 1) on the same images in the same order.
    """
    y = np.asarray(y).astype(int)
    pm, ps = np.asarray(p_model, np.float64), np.asarray(meta_scores, np.float64)

    boots = bootstrap_aucs(y, [pm, ps], _draws(y, n_boot, seed))
    cis = [_pct(boots[:, 0]), _pct(boots[:, 1]), _pct(boots[:, 0] - boots[:, 1])]
    a, b = _auc(y, pm), _auc(y, ps)
    m = None if a is None or b is None else a - b
    lo, hi = cis[2]
    return {"model_auc": a, "model_ci": list(cis[0]), "metadata_auc": b, "metadata_ci": list(cis[1]),
            "margin": m, "margin_ci": [lo, hi],
            "covers_zero": None if lo is None else bool(lo <= 0.0 <= hi),
            "beats_metadata": None if lo is None else bool(lo > 0.0)}
