"""Evaluation: predictions, scikit-learn metrics, Youden thresholds and bootstrap CIs.

Every metric dict is JSON-safe: plain ``int``/``float``/``list``/``None``; a metric that is undefined on the given
sample (ROC-AUC with one class present, sensitivity without positives, ...) is ``None``, never NaN.

Class convention (``chest_xray.CLASS_NAMES``): class 0 is NORMAL. Binary task: PNEUMONIA = 1 is the positive class.
Subtype task (NORMAL/BACTERIAL/VIRAL): sensitivity/specificity are those of "pneumonia of any subtype" (class != 0)
against NORMAL, computed from the predicted class.
"""
from __future__ import annotations

import warnings
from typing import Iterable

import numpy as np
import torch
from sklearn.metrics import (
    accuracy_score,
    balanced_accuracy_score,
    confusion_matrix,
    log_loss,
    recall_score,
    roc_auc_score,
    roc_curve,
)
from torch import nn

from hfl_components.training.loop import unpack_batch

SCALAR_METRICS = ("accuracy", "balanced_accuracy", "auc", "sensitivity", "specificity", "log_loss")


def _f(v) -> float | None:
    """Python float, or None for None/NaN/inf."""
    if v is None:
        return None
    v = float(v)
    return v if np.isfinite(v) else None


@torch.no_grad()
def _collect(model: nn.Module, loader: Iterable, want: str, device=None) -> tuple[np.ndarray, np.ndarray]:
    was_training = model.training
    model.eval()
    if device is None:
        p = next(model.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
    outs, labels = [], []
    try:
        for batch in loader:
            x, y = unpack_batch(batch)
            z = model.features(x.to(device))
            out = z if want == "features" else torch.softmax(model.head(z), dim=1)
            outs.append(out.float().cpu().numpy())
            labels.append(y.numpy())
    finally:
        model.train(was_training)
    if not outs:
        return np.zeros((0, 0), np.float32), np.zeros((0,), np.int64)
    return np.concatenate(outs), np.concatenate(labels).astype(np.int64)


def predict_proba(model: nn.Module, loader: Iterable, device=None) -> tuple[np.ndarray, np.ndarray]:
    """Softmax class probabilities of ``model.head(model.features(x))`` over a whole loader, in eval mode.

    Args:
        model: registry model (``features``/``head``); its train/eval mode is restored afterwards.
        loader: batches as dicts ``{"image", "label"}`` or ``(x, y)`` tuples.

    Returns:
        ``(probs (N, C) float64 rows summing to 1, labels (N,) int64)``; ``(0, 0)`` / ``(0,)`` for an empty loader.
    """
    p, y = _collect(model, loader, "proba", device)
    return p.astype(np.float64), y


def extract_features(model: nn.Module, loader: Iterable, device=None) -> tuple[np.ndarray, np.ndarray]:
    """Features ``z = model.features(x)`` over a whole loader, in eval mode (for prototypes / relation matrices).

    Returns:
        ``(Z (N, d) float32 numpy, y (N,) int64 numpy)``; use ``torch.from_numpy`` for tensors.
    """
    return _collect(model, loader, "features", device)


def _check(y_true, probs, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(y_true).astype(np.int64).reshape(-1)
    p = np.asarray(probs, dtype=np.float64)
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    if y.size == 0:
        return y, p.reshape(0, num_classes)
    if p.ndim != 2 or p.shape != (y.size, num_classes):
        raise ValueError(f"probs must have shape ({y.size}, {num_classes}), got {p.shape}")
    if y.min() < 0 or y.max() >= num_classes:
        raise ValueError(f"labels must lie in [0, {num_classes}), got range [{y.min()}, {y.max()}]")
    return y, p


def predict_labels(probs: np.ndarray, threshold: float | None = None) -> np.ndarray:
    """Predicted classes (N,): argmax, or for binary probs with a ``threshold`` ``p[:, 1] >= threshold``."""
    probs = np.asarray(probs)
    if threshold is not None and probs.shape[1] == 2:
        return (probs[:, 1] >= threshold).astype(np.int64)
    return probs.argmax(axis=1).astype(np.int64)


def _auc_per_class(y: np.ndarray, p: np.ndarray, num_classes: int) -> list[float | None]:
    out = []
    for c in range(num_classes):
        pos = y == c
        if pos.all() or not pos.any():
            out.append(None)  # one-vs-rest AUC undefined without both positives and negatives
        else:
            out.append(_f(roc_auc_score(pos, p[:, c])))
    return out


def _macro_auc(per_class: list[float | None], num_classes: int) -> float | None:
    if num_classes == 2:
        return per_class[1]  # binary: AUC of the positive class (PNEUMONIA)
    defined = [a for a in per_class if a is not None]
    return float(np.mean(defined)) if defined else None


def _sens_spec(cm: np.ndarray) -> tuple[float | None, float | None]:
    """Sensitivity/specificity of class != 0 (positive) vs class 0 (negative) from a CxC confusion matrix."""
    pos_total, neg_total = cm[1:].sum(), cm[0].sum()
    tp = cm[1:, 1:].sum()  # a pneumonia image predicted as any pneumonia class
    tn = cm[0, 0]
    sens = tp / pos_total if pos_total > 0 else None
    spec = tn / neg_total if neg_total > 0 else None
    return _f(sens), _f(spec)


def compute_metrics(y_true, probs, num_classes: int, threshold: float | None = None) -> dict:
    """All evaluation metrics from labels and class probabilities (scikit-learn implementations).

    Args:
        y_true: (N,) int labels in ``[0, num_classes)``.
        probs: (N, C) class probabilities (rows sum to 1).
        num_classes: C >= 2.
        threshold: binary only: predict PNEUMONIA when ``p[:, 1] >= threshold`` (e.g. from
            :func:`choose_threshold` on validation data); default None = argmax. Ignored for C > 2.

    Returns:
        JSON-safe dict: ``n``, ``class_counts`` (list C), ``accuracy``, ``balanced_accuracy`` (mean recall over
        classes present, sklearn), ``auc`` (binary: ROC-AUC of class 1; C > 2: macro mean of the one-vs-rest AUCs
        that are defined, equal to sklearn's ``multi_class="ovr", average="macro"`` when every class is present),
        ``auc_per_class`` (list C, one-vs-rest), ``per_class_recall`` (list C), ``confusion_matrix`` (C x C, rows =
        true, cols = predicted), ``sensitivity``/``specificity`` (PNEUMONIA / any pneumonia subtype positive),
        ``log_loss`` (mean negative log-likelihood, nats), ``threshold`` (used, or None). Undefined values are None.

    Raises:
        ValueError: shape mismatch or labels out of range.
    """
    y, p = _check(y_true, probs, num_classes)
    labels = list(range(num_classes))
    thr = _f(threshold) if (threshold is not None and num_classes == 2) else None
    n = int(y.size)
    if n == 0:
        return {"n": 0, "class_counts": [0] * num_classes, "accuracy": None, "balanced_accuracy": None,
                "auc": None, "auc_per_class": [None] * num_classes, "per_class_recall": [None] * num_classes,
                "confusion_matrix": [[0] * num_classes for _ in labels], "sensitivity": None,
                "specificity": None, "log_loss": None, "threshold": thr}
    pred = predict_labels(p, thr)
    cm = confusion_matrix(y, pred, labels=labels)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "y_pred contains classes not in y_true" etc.: handled as None below
        bal = balanced_accuracy_score(y, pred)
        recall = recall_score(y, pred, labels=labels, average=None, zero_division=np.nan)
        ll = log_loss(y, np.clip(p, 1e-15, 1.0), labels=labels)
    auc_pc = _auc_per_class(y, p, num_classes)
    sens, spec = _sens_spec(cm)
    return {
        "n": n,
        "class_counts": [int(v) for v in np.bincount(y, minlength=num_classes)],
        "accuracy": _f(accuracy_score(y, pred)),
        "balanced_accuracy": _f(bal),
        "auc": _macro_auc(auc_pc, num_classes),
        "auc_per_class": auc_pc,
        "per_class_recall": [_f(r) for r in recall],
        "confusion_matrix": cm.astype(int).tolist(),
        "sensitivity": sens,
        "specificity": spec,
        "log_loss": _f(ll),
        "threshold": thr,
    }


def evaluate(model: nn.Module, loader: Iterable, num_classes: int, threshold: float | None = None,
             device=None) -> dict:
    """Evaluate ``model`` on a loader: :func:`predict_proba` then :func:`compute_metrics` (see there for keys).

    Args:
        model: registry model; put in eval mode for the pass, its mode restored afterwards.
        loader: batches as dicts ``{"image": (B, 1, S, S), "label": (B,)}`` or ``(x, y)`` tuples.
        num_classes: C (2 for binary, 3 for subtype).
        threshold: binary decision threshold on ``p(PNEUMONIA)``; None = argmax.

    Returns:
        JSON-safe metrics dict; undefined metrics are None.
    """
    probs, y = predict_proba(model, loader, device)
    if y.size == 0:
        probs = np.zeros((0, num_classes))
    return compute_metrics(y, probs, num_classes, threshold)


def choose_threshold(y_true, p_pos, default: float = 0.5) -> float:
    """Binary decision threshold maximising Youden's J = sensitivity + specificity - 1 (Youden, Cancer 1950).

    Choose it on a validation split and pass it to :func:`evaluate` on the test split (never choose on test).

    Args:
        y_true: (N,) binary labels, 1 = PNEUMONIA.
        p_pos: (N,) scores / probabilities of class 1.
        default: returned when J is undefined (only one class present, or empty input).

    Returns:
        threshold ``t`` in [0, 1] for the rule ``p_pos >= t`` (the highest such ``t`` among ties; sklearn
        ``roc_curve`` thresholds).
    """
    y = np.asarray(y_true).astype(np.int64).reshape(-1)
    s = np.asarray(p_pos, dtype=np.float64).reshape(-1)
    if y.size != s.size:
        raise ValueError(f"y_true and p_pos differ in length: {y.size} vs {s.size}")
    if y.size == 0 or np.unique(y).size < 2:
        return float(default)
    fpr, tpr, thr = roc_curve(y, s)
    j = tpr - fpr
    best = int(np.argmax(j))
    return float(np.clip(thr[best], 0.0, 1.0))


def _fast_scalars(y: np.ndarray, p: np.ndarray, pred: np.ndarray, num_classes: int) -> dict:
    """Bootstrap-replicate scalars; same definitions as :func:`compute_metrics` (counts via bincount)."""
    cm = np.bincount(y * num_classes + pred, minlength=num_classes * num_classes).reshape(num_classes, num_classes)
    support = cm.sum(axis=1)
    recall = [cm[c, c] / support[c] if support[c] > 0 else None for c in range(num_classes)]
    defined = [r for r in recall if r is not None]
    auc_pc = _auc_per_class(y, p, num_classes)
    sens, spec = _sens_spec(cm)
    py = np.clip(p[np.arange(y.size), y], 1e-15, 1.0)
    return {
        "accuracy": float(np.trace(cm) / y.size),
        "balanced_accuracy": float(np.mean(defined)) if defined else None,
        "auc": _macro_auc(auc_pc, num_classes),
        "sensitivity": sens,
        "specificity": spec,
        "log_loss": float(-np.mean(np.log(py))),
        "per_class_recall": recall,
        "auc_per_class": auc_pc,
    }


def _ci(point, samples: list, alpha: float) -> dict:
    vals = np.asarray([v for v in samples if v is not None], dtype=np.float64)
    if point is None or vals.size == 0:
        return {"value": point, "ci_low": None, "ci_high": None}
    lo, hi = np.percentile(vals, [100 * alpha / 2, 100 * (1 - alpha / 2)])
    return {"value": point, "ci_low": _f(lo), "ci_high": _f(hi)}


def pooled_metrics_with_ci(y_true, probs, num_classes: int, n_boot: int = 1000, seed: int = 0,
                           threshold: float | None = None, stratified: bool = True, alpha: float = 0.05) -> dict:
    """Metrics over a pooled test set with percentile bootstrap confidence intervals (Efron & Tibshirani 1993).

    Each replicate resamples the N images with replacement; ``stratified=True`` (default, as pROC's AUC CIs,
    Robin et al. 2011) resamples within each true class so every replicate keeps the class counts and ROC-AUC stays
    defined. Replicates where a metric is undefined are left out of that metric's interval.

    Args:
        y_true: (N,) int labels; probs: (N, C) class probabilities; num_classes: C.
        n_boot: number of bootstrap replicates (default 1000).
        seed: NumPy ``default_rng`` seed, so intervals repeat.
        threshold: binary decision threshold (see :func:`compute_metrics`).
        alpha: 1 - confidence level (0.05 -> 95% interval from the 2.5th/97.5th percentiles).

    Returns:
        JSON-safe dict: ``n``, ``n_boot``, ``threshold``, ``class_counts``, ``confusion_matrix`` (point values), each of
        :data:`SCALAR_METRICS` as ``{"value", "ci_low", "ci_high"}`` (value from :func:`compute_metrics`), and
        ``per_class_recall`` / ``auc_per_class`` as lists of such dicts. Undefined values/intervals are None.
    """
    point = compute_metrics(y_true, probs, num_classes, threshold)
    y, p = _check(y_true, probs, num_classes)
    out = {"n": point["n"], "n_boot": int(n_boot), "threshold": point["threshold"],
           "class_counts": point["class_counts"], "confusion_matrix": point["confusion_matrix"]}
    boots: list[dict] = []
    if y.size > 0 and n_boot > 0:
        rng = np.random.default_rng(seed)
        pred = predict_labels(p, point["threshold"])
        groups = [np.flatnonzero(y == c) for c in range(num_classes)] if stratified else [np.arange(y.size)]
        groups = [g for g in groups if g.size > 0]
        for _ in range(int(n_boot)):
            idx = np.concatenate([g[rng.integers(0, g.size, g.size)] for g in groups])
            boots.append(_fast_scalars(y[idx], p[idx], pred[idx], num_classes))
    for key in SCALAR_METRICS:
        out[key] = _ci(point[key], [b[key] for b in boots], alpha)
    for key in ("per_class_recall", "auc_per_class"):
        out[key] = [_ci(point[key][c], [b[key][c] for b in boots], alpha) for c in range(num_classes)]
    return out
