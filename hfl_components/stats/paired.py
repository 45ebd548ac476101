"""Paired method comparisons with seeds as the unit of training randomness, and the rule that turns them into
verdicts.

Methods A and B run with the same seeds; in seed s, site k of A and site k of B form a pair (same partition). The
paired difference is

    Delta = mean over seeds s of [ mean over the seed's sites k of ( M(A[s, k]) - M(B[s, k]) ) ]

The sites of one seed are *not* independent replicates (OHFL's deployed models descend from one fused model,
prototype sites share their global prototypes), so every interval treats the seed as the cluster.

**Cluster bootstrap** (the resampling scheme). Each replicate draws S seeds with replacement; a drawn seed brings
all its sites with it (Davison & Hinkley 1997, "Bootstrap Methods and their Application", Sec. 3.8, resampling the
top stage of a hierarchy; Field & Welsh 2007, "Bootstrapping clustered data", J. R. Stat. Soc. B 69:369-390).
Images are redrawn as the design says:

* *crossed* (:func:`paired_crossed`; every seed and site scores the same external images): one image draw per
  replicate, shared by every seed, site and method -- the pigeonhole bootstrap of a seeds x images crossed design
  (Owen 2007, "The pigeonhole bootstrap", Ann. Appl. Stat. 1:386-411);
* *nested* (:func:`paired_nested`; each site scores its own test split): images are drawn within each image pool,
  a pool being what several pairs share (a site's own test split is a pool of its own; external images scored by
  several sites are one pool, drawn once per replicate for all of them; Davison & Hinkley 1997, Sec. 3.8; Field
  & Welsh 2007).

Images are drawn within each class, so a replicate keeps the class sizes and an AUC stays defined. Resampling uses
a seeded ``numpy.random.Generator``.

**Intervals** (:mod:`.intervals`). The cluster bootstrap-t interval (``cluster_low``/``cluster_high``): the point
estimate ± t(0.975, S - 1) times the replicates' standard deviation (rescaled by sqrt(S / (S - 1))). The seed-level
Student-t interval of the per-seed differences (``t_low``/``t_high``, ``scipy.stats.t``, df = S - 1): with images
shared across seeds it treats them as fixed (an interval for the difference *on these images*); where every seed has
images of its own, their noise is inside the per-seed values and it is an interval for new seeds and new images.
``ci_low``/``ci_high``, the interval that gives verdicts, is therefore the cluster bootstrap-t when some image pool
spans seeds (every crossed comparison; a nested one with a pool shared across seeds) and the seed-level t-interval
otherwise (including :func:`paired_summaries`, one value per (seed, site)); ``interval`` names it. The choice rests on
the coverage simulation in ``tests/test_stats_coverage.py`` and the product-shaped one in ``studies/coverage``
(``docs/decisions.md``); the plain percentile interval of the same replicates under-covers with few seeds and is not
reported.

**Reporting rule.**

* With fewer than :data:`MIN_SEEDS` seeds no interval is reliable: results carry ``reliable`` False and
  ``verdict`` None, and tables print the per-seed differences instead of an interval (:func:`paired_cell`).
* Verdicts (:func:`verdict`) with a non-inferiority margin delta fixed in advance (:data:`MARGINS`):
  ``better`` (superiority: lower bound > 0), ``not worse`` (non-inferiority: lower bound > -delta),
  ``worse, within the margin`` (upper bound < 0 but lower bound > -delta), ``worse`` (upper bound < 0),
  ``inconclusive`` otherwise. An inconclusive interval is not evidence of equality.
* A table that prints many verdicts marks one primary endpoint and labels the others exploratory
  (:func:`endpoint_label`): their verdicts are not corrected for multiplicity.
"""
from __future__ import annotations

from typing import Any, Hashable, Mapping, Sequence

import numpy as np

from hfl_components.stats.intervals import (cluster_t_interval, combine_seeds, draw_image_counts, draw_seed_counts,
                                            seed_t_interval)
from hfl_components.stats.metrics import PAIRED_METRICS, SITE_METRICS, WeightedAUC, binary_metric_rows

#: fewer seeds than this: no interval is reliable, no verdict
MIN_SEEDS = 5
#: non-inferiority margins delta, fixed in advance, in the metric's units (fractions)
MARGINS = {"auc": 0.02, "balanced_accuracy": 0.03, "accuracy": 0.03, "sensitivity": 0.03, "specificity": 0.03}
VERDICTS = ("better", "not worse", "worse, within the margin", "worse", "inconclusive")
#: how many seeds the rule asks for, in words, for table notes
RULE_TEXT = (f"Intervals and verdicts need at least {MIN_SEEDS} seeds (seeds are the unit of training randomness); "
             f"with fewer, the per-seed differences are shown and no interval is reliable.")


def margin_for(metric: str, margin: float | None = None) -> float | None:
    """The non-inferiority margin of ``metric``: ``margin`` when given, else :data:`MARGINS` (None if absent)."""
    return float(margin) if margin is not None else MARGINS.get(metric)


def verdict(ci_low: float | None, ci_high: float | None, margin: float | None = None) -> str | None:
    """Verdict of an interval of A - B (one of :data:`VERDICTS`), None without an interval.

    ``better`` when ``ci_low > 0``; with a margin ``delta``: ``not worse`` when ``ci_low > -delta``, ``worse, within
    the margin`` when also ``ci_high < 0``; ``worse`` when ``ci_high < 0``; else ``inconclusive``."""
    if ci_low is None or ci_high is None or not (np.isfinite(ci_low) and np.isfinite(ci_high)):
        return None
    if ci_low > 0:
        return "better"
    if margin is not None and ci_low > -margin:
        return "worse, within the margin" if ci_high < 0 else "not worse"
    if ci_high < 0:
        return "worse"
    return "inconclusive"


def _f(x) -> float | None:
    return None if x is None or not np.isfinite(x) else float(x)


def _result(metric: str, design: str, seeds: list, a_seed: np.ndarray, b_seed: np.ndarray,
            reps: np.ndarray | None, n_boot: int, alpha: float, margin: float | None, shared_images: bool,
            **extra) -> dict[str, Any]:
    """The common result dict from per-seed means of A and B (S,) and the bootstrap replicates of Delta (R,).

    The verdict interval (``ci_low``/``ci_high``) is the cluster bootstrap-t when images are shared across seeds
    (``shared_images``: their sampling variance is in no per-seed value), else the seed-level t-interval (each
    seed's images are its own, their noise is already inside the per-seed values); the cluster bootstrap-t is kept
    as ``cluster_low``/``cluster_high`` either way."""
    d_seed = a_seed - b_seed
    ok = ~np.isnan(d_seed)
    S = int(ok.sum())
    diff, t_lo, t_hi = seed_t_interval(d_seed[ok], alpha) if S else (np.nan, np.nan, np.nan)
    c_lo = c_hi = np.nan
    if reps is not None and S >= 2:
        reps = reps[np.isfinite(reps)]
        c_lo, c_hi = cluster_t_interval(diff, reps, S, alpha) if reps.size > 1 else (np.nan, np.nan)
    if reps is not None and shared_images:
        lo, hi, interval = _f(c_lo), _f(c_hi), "cluster bootstrap-t"
    else:
        lo, hi, interval = _f(t_lo), _f(t_hi), "seed t"
    reliable = S >= MIN_SEEDS
    out = {"metric": metric, "design": design, "n_seeds": S, **extra,
           "a": _f(np.nanmean(a_seed)) if S else None, "b": _f(np.nanmean(b_seed)) if S else None,
           "diff": _f(diff) if S else None,
           "per_seed": {str(s): float(v) for s, v, o in zip(seeds, d_seed, ok) if o},
           "ci_low": lo, "ci_high": hi, "interval": interval, "t_low": _f(t_lo), "t_high": _f(t_hi),
           "cluster_low": _f(c_lo), "cluster_high": _f(c_hi),
           "alpha": alpha, "n_boot": int(n_boot) if reps is not None else 0, "margin": margin,
           "reliable": reliable, "verdict": None, "superior": None, "non_inferior": None,
           "note": None if reliable else f"{S} seed(s) < {MIN_SEEDS}: no interval is reliable, no verdict"}
    if reliable and lo is not None:
        out.update(verdict=verdict(lo, hi, margin), superior=lo > 0,
                   non_inferior=None if margin is None else lo > -margin)
    return out


def paired_crossed(y, scores_a, scores_b, metric: str = "auc", n_boot: int = 1000, seed: int = 0,
                   alpha: float = 0.05, margin: float | None = None, seeds: Sequence | None = None) -> dict[str, Any]:
    """Paired difference A - B on one shared external image set (crossed design), binary labels.

    Args:
        y: (N,) binary labels (1 = positive) of the shared images; both classes present.
        scores_a, scores_b: (S, K, N) probabilities of the positive class, S seeds x K sites x N images; entry
            ``[s, k]`` of A and of B is one pair.
        metric: ``"auc"`` or ``"balanced_accuracy"`` (rule p >= 0.5), :func:`.metrics.binary_metric_rows`.
        n_boot: cluster-bootstrap replicates (0: only the seed-level interval). seed: seeds the resampling.
        alpha: 1 - confidence level. margin: non-inferiority margin (default :data:`MARGINS`).
        seeds: names of the S seeds (for ``per_seed``); default 0..S-1.

    Returns:
        :func:`_result`'s dict: ``metric, design, n_seeds, n_sites, n_images, n_pairs, a, b, diff, per_seed, ci_low,
        ci_high, interval, t_low, t_high, alpha, n_boot, margin, reliable, verdict, superior, non_inferior, note``.

    Raises:
        ValueError: shapes differ or are not (S, K, N) with N = len(y); y not binary with both classes; unknown
        metric.
    """
    y = np.asarray(y).astype(np.int64).reshape(-1)
    a = np.asarray(scores_a, dtype=np.float64)
    b = np.asarray(scores_b, dtype=np.float64)
    if a.ndim != 3 or a.shape != b.shape or a.shape[2] != y.size:
        raise ValueError(f"scores must both be (seeds, sites, {y.size}) arrays; got {a.shape} and {b.shape}")
    if set(np.unique(y).tolist()) != {0, 1}:
        raise ValueError("y must hold binary labels with both classes present")
    if metric not in PAIRED_METRICS:
        raise ValueError(f"unknown paired metric {metric!r}; choose one of {', '.join(PAIRED_METRICS)}")
    S, K, N = a.shape
    flat = np.concatenate([a.reshape(S * K, N), b.reshape(S * K, N)])
    point = binary_metric_rows(metric, y, flat)
    a_seed = point[: S * K].reshape(S, K).mean(1)
    b_seed = point[S * K:].reshape(S, K).mean(1)
    reps = None
    if n_boot > 0:
        rng = np.random.default_rng(seed)
        m = draw_seed_counts(rng, n_boot, S)
        w = draw_image_counts(rng, n_boot, y)  # one image draw per replicate, shared by every seed and site
        if metric == "auc":
            ev = WeightedAUC(y, flat)
            rows = np.stack([ev(wr) for wr in w])  # (R, 2SK)
        else:
            pred = (flat >= 0.5).astype(np.float64)
            pos, neg = y == 1, y == 0
            tpr = (w[:, pos] @ pred[:, pos].T) / w[:, pos].sum(1, keepdims=True)
            tnr = (w[:, neg] @ (1.0 - pred[:, neg]).T) / w[:, neg].sum(1, keepdims=True)
            rows = 0.5 * (tpr + tnr)
        d = (rows[:, : S * K] - rows[:, S * K:]).reshape(-1, S, K).mean(2)  # (R, S) per-seed differences
        reps = combine_seeds(d, m)
    names = list(seeds) if seeds is not None else list(range(S))
    return _result(metric, "crossed", names, a_seed, b_seed, reps, n_boot, alpha, margin_for(metric, margin), True,
                   n_sites=K, n_images=N, n_pairs=S * K)


def paired_nested(pairs: Sequence[dict], metric: str = "balanced_accuracy", n_boot: int = 1000, seed: int = 0,
                  alpha: float = 0.05, margin: float | None = None) -> dict[str, Any]:
    """Paired difference A - B over (seed, site) pairs, each pair scored on images of an image pool.

    Args:
        pairs: one dict per (seed, site): ``seed`` (hashable), ``site``, ``pool`` (a key naming the image pool; pairs
            with the same pool share one image draw per replicate), ``ids`` (N,) int ids of its images in the pool,
            ``y`` (N,) int labels, ``pa``/``pb`` (N, C) class probabilities of methods A and B on those images.
        metric: ``balanced_accuracy`` or ``auc`` (:func:`.metrics.site_metric`'s definitions).
        n_boot: cluster-bootstrap replicates (0: only the seed-level interval). seed: seeds the resampling.
        alpha: 1 - confidence level. margin: non-inferiority margin (default :data:`MARGINS`).

    Returns:
        :func:`_result`'s dict with ``n_pairs`` (pairs where both metrics are defined) and ``n_sites``.

    Raises:
        ValueError: no pairs, a pair's arrays of different lengths, or an unknown metric.
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
    pools: dict[Hashable, np.ndarray] = {}  # pool -> label of every id (-1: no image of any pair)
    for q in pairs:
        ids = np.asarray(q["ids"], np.int64)
        lab = pools.get(q["pool"], np.full(0, -1, np.int64))
        if lab.size <= ids.max(initial=-1):
            lab = np.concatenate([lab, np.full(ids.max() + 1 - lab.size, -1, np.int64)])
        lab[ids] = np.asarray(q["y"], np.int64)
        pools[q["pool"]] = lab

    prep = []  # per pair, what no replicate changes: argmax correctness, one two-row AUC evaluator per class
    for q in pairs:
        y = np.asarray(q["y"], np.int64)
        pa, pb = np.asarray(q["pa"], np.float64), np.asarray(q["pb"], np.float64)
        C = pa.shape[1]
        ok = np.stack([pa.argmax(1) == y, pb.argmax(1) == y]).astype(np.float64)
        aucs = {c: WeightedAUC((y == c).astype(np.int64), np.stack([pa[:, c], pb[:, c]]))
                for c in range(C) if 0 < (y == c).sum() < y.size} if metric == "auc" else {}
        prep.append((y, C, ok, aucs, np.asarray(q["ids"], np.int64)))

    def pair_metric(i: int, w: np.ndarray | None) -> np.ndarray:
        y, C, ok, aucs, _ = prep[i]
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

    def per_seed(m: np.ndarray) -> np.ndarray:
        """(P, 2) pair metrics -> (S, 2) per-seed means over the seed's pairs where both are defined."""
        good = ~np.isnan(m).any(axis=1)
        cnt = np.bincount(s_index[good], minlength=len(seeds)).astype(np.float64)
        tot = np.stack([np.bincount(s_index[good], weights=m[good, j], minlength=len(seeds)) for j in (0, 1)], 1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return tot / cnt[:, None]

    point = np.stack([pair_metric(i, None) for i in range(len(pairs))])
    ps = per_seed(point)
    reps = _nested_replicates(pair_metric, per_seed, pairs, prep, pools, len(seeds), n_boot, seed) if n_boot > 0 \
        else None
    n_ok = int((~np.isnan(point).any(axis=1)).sum())
    spans = any(len({q["seed"] for q in pairs if q["pool"] == key}) > 1 for key in pools)  # a pool across seeds
    return _result(metric, "nested", seeds, ps[:, 0], ps[:, 1], reps, n_boot, alpha, margin_for(metric, margin), spans,
                   n_pairs=n_ok, n_sites=len({q.get("site") for q in pairs}))


def _nested_replicates(pair_metric, per_seed, pairs, prep, pools, n_seeds: int, n_boot: int, seed):
    """:func:`paired_nested`'s bootstrap: per replicate, seeds drawn as clusters and one image draw per pool shared
    by every pair in it; the per-seed differences combined over the drawn seeds."""
    rng = np.random.default_rng(seed)
    m = draw_seed_counts(rng, n_boot, n_seeds)
    draws = {key: draw_image_counts(rng, n_boot, lab) for key, lab in pools.items()}  # one draw per pool
    d = np.empty((int(n_boot), n_seeds))
    for r in range(int(n_boot)):
        mr = np.stack([pair_metric(i, draws[q["pool"]][r][prep[i][4]]) for i, q in enumerate(pairs)])
        sr = per_seed(mr)
        d[r] = sr[:, 0] - sr[:, 1]
    return combine_seeds(d, m)


def paired_summaries(a: Mapping[tuple, float | None], b: Mapping[tuple, float | None], metric: str,
                     alpha: float = 0.05, margin: float | None = None) -> dict[str, Any]:
    """Paired difference A - B from cluster-level summaries only: one metric value per (seed, site) key.

    Without per-image outputs no image draw is possible; the interval is the seed-level t-interval of the per-seed
    mean differences (the image noise of each seed's own test splits is inside the per-seed values).

    Args:
        a, b: ``{(seed, site): value}``; None/NaN values and keys in only one of them are left out.
        metric: the metric's name (for the margin and the record). alpha, margin: as :func:`paired_crossed`.

    Returns:
        :func:`_result`'s dict with ``n_pairs``; ``diff`` None when nothing pairs.
    """
    keys = sorted((k for k in a if k in b and a[k] is not None and b[k] is not None
                   and np.isfinite(a[k]) and np.isfinite(b[k])), key=str)
    seeds = sorted({k[0] for k in keys}, key=str)
    a_seed = np.asarray([np.mean([a[k] for k in keys if k[0] == s]) for s in seeds], np.float64)
    b_seed = np.asarray([np.mean([b[k] for k in keys if k[0] == s]) for s in seeds], np.float64)
    return _result(metric, "summaries", seeds, a_seed, b_seed, None, 0, alpha, margin_for(metric, margin), False,
                   n_pairs=len(keys))


def seed_mean_interval(values: Mapping[tuple, float | None], alpha: float = 0.05) -> dict[str, Any]:
    """Mean of a metric over site models with a seed-level t-interval: ``values`` ``{(seed, site): value}`` are
    averaged within each seed, then over seeds (``scipy.stats.t``, df = seeds - 1).

    Returns:
        ``{"mean", "ci_low", "ci_high", "n_seeds", "per_seed", "reliable"}``; ``ci_*`` None with fewer than
        :data:`MIN_SEEDS` seeds (no reliable interval), ``mean`` None without a value.
    """
    keys = [k for k, v in values.items() if v is not None and np.isfinite(v)]
    seeds = sorted({k[0] for k in keys}, key=str)
    per = np.asarray([np.mean([values[k] for k in keys if k[0] == s]) for s in seeds], np.float64)
    if not seeds:
        return {"mean": None, "ci_low": None, "ci_high": None, "n_seeds": 0, "per_seed": {}, "reliable": False}
    mean, lo, hi = seed_t_interval(per, alpha)
    reliable = len(seeds) >= MIN_SEEDS
    return {"mean": float(mean), "ci_low": _f(lo) if reliable else None, "ci_high": _f(hi) if reliable else None,
            "n_seeds": len(seeds), "per_seed": {str(s): float(v) for s, v in zip(seeds, per)}, "reliable": reliable}


def per_seed_text(d: Mapping, scale: float = 1.0, nd: int = 3) -> str:
    """``"+0.068 / +0.011 / +0.049"``: a result's per-seed differences (times ``scale``), seed order."""
    return " / ".join(f"{scale * v:+.{nd}f}" for v in (d.get("per_seed") or {}).values()) or "–"


def paired_cell(d: Mapping | None, scale: float = 1.0, nd: int = 3, unit: str = "") -> str:
    """A table cell for a paired result: ``Δ (95% CI lo to hi)`` (the result's own level, ``1 - alpha``) when the rule allows an interval (for a cluster
    bootstrap-t interval followed by the seed-level t-interval, ``; these images: seed t lo to hi``), else ``Δ; per
    seed a / b / c (n seeds: no reliable interval)``. ``scale``/``unit``: e.g. 100 and `` pp``."""
    if not d or d.get("diff") is None:
        return "–"
    head = f"{scale * d['diff']:+.{nd}f}{unit}"
    if d.get("reliable") and d.get("ci_low") is not None:
        t = (f"; these images: seed t {scale * d['t_low']:+.{nd}f} to {scale * d['t_high']:+.{nd}f}"
             if d.get("interval") == "cluster bootstrap-t" and d.get("t_low") is not None else "")
        level = f"{100 * (1 - float(d.get('alpha') or 0.05)):g}%"
        return f"{head} ({level} CI {scale * d['ci_low']:+.{nd}f} to {scale * d['ci_high']:+.{nd}f}{t})"
    return f"{head}; per seed {per_seed_text(d, scale, nd)} ({d.get('n_seeds', 0)} seed(s): no reliable interval)"


def verdict_cell(d: Mapping | None) -> str:
    """The verdict with its margin (``not worse (δ 0.02)``), or ``no verdict (n seed(s) < 5)`` for a result the rule
    gives no verdict (also one written without the ``reliable`` flag)."""
    if not d or d.get("diff") is None:
        return "–"
    if not d.get("reliable") or not d.get("verdict"):  # a result written before the rule carries no ``reliable``
        n = d.get("n_seeds")
        return f"no verdict ({'?' if n is None else n} seed(s) < {MIN_SEEDS})" if not d.get("reliable") \
            else "no verdict"
    m = d.get("margin")
    return d["verdict"] + (f" (δ {m:g})" if m is not None and d["verdict"] != "better" else "")


def endpoint_label(is_primary: bool) -> str:
    """``"primary"`` / ``"exploratory"``: a table printing many verdicts names one primary endpoint; the verdicts
    of the others are exploratory (not corrected for multiplicity)."""
    return "primary" if is_primary else "exploratory"
