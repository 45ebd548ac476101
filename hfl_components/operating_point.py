"""A clinical operating point agreed by the federation: temperature scaling per site, one threshold for a target
sensitivity chosen on pooled coarse histograms.

The rule (each function below is one step):

1. Each site fits the temperature T of its own deployed model on its own validation split
   (:func:`fit_temperature`; Guo et al. 2017, arXiv:1706.04599: one scalar dividing the logits, chosen to minimise
   the negative log-likelihood; it leaves the ranking, hence the AUC, unchanged).
2. Each site sends :func:`coarse_histogram` of its *calibrated* validation p(positive), per class, on one grid that
   every site shares (:func:`log_odds_grid`: equal steps in log-odds, so it resolves p near 0 and 1 as finely as
   near 0.5): adjacent grid bins merged until every non-empty cell holds at least ``min_count`` (k) images of that
   class. What leaves the site: the cell edges (points of the shared grid) and the counts per class and cell.
   Privacy rule: no cell narrower than the whole grid holds 1..k-1 images, so no score can be tied to fewer than
   k images of its class; a cell's edge says at most that one of its >= k images lies within one grid step of it
   (e.g. the lowest-scoring positive lies in the grid step above the first positive edge), never which image.
   A class of fewer than k images is sent as one cell over the whole grid: its count, nothing about any score.
3. The server pools the histograms and picks the largest threshold t on calibrated probability whose pooled
   sensitivity reaches the target (:func:`pooled_threshold`): a cell that straddles t counts against t (its
   positives as missed), so the pooled sensitivity is a lower bound. With k images per cell and P pooled positives
   no cell can be missed while k / P > 1 - target; t is then the lowest positive cell edge of any site, i.e. every
   pooled validation positive is kept above it. Sites whose positives could not be placed (fewer than k) are left
   out of the pooled counts and named. When the pooled counts give no operating point (no placeable positive;
   only t = 0 reaches the target; or the t found calls every validation negative positive) no threshold is set and
   the reason says why (:func:`describe` words it in one line); the deployed models then carry their temperature
   only and predict at argmax, saying so. Each site applies t to its own calibrated model.

Assumption: calibrated probabilities of different sites' models are comparable, i.e. p = 0.7 means the same risk at
every site. Where a site's case mix or model differ, its own sensitivity at t differs from the pooled one; each
site's achieved value on its validation and test splits is therefore reported beside the pooled one
(:func:`site_sensitivity`).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

DEFAULT_TARGET_SENSITIVITY = 0.95
DEFAULT_MIN_COUNT = 5
GRID_STEP = 0.25  # log-odds units between grid edges
GRID_LIMIT = 8.0  # grid edges at log-odds -8 ... 8, i.e. p = 3.4e-4 ... 0.99966, plus 0 and 1


def log_odds_grid(step: float = GRID_STEP, limit: float = GRID_LIMIT) -> tuple[float, ...]:
    """The grid every site bins on (default: 67 edges): 0, sigmoid(-limit), sigmoid(-limit + step), ...,
    sigmoid(limit), 1 (edges rounded to 6 significant digits, identical at every site). Equal steps in log-odds are
    equal steps in a temperature-scaled logit, so the grid resolves calibrated p near 0 and 1, where a screening
    threshold and a sharp model's scores lie, as finely as near 0.5 (a step of 0.25 is about 0.06 in p at 0.5 and
    0.007 at 0.03). The step bounds how precisely a cell edge places the one image next to it.

    Raises:
        ValueError: step <= 0 or limit < step.
    """
    if step <= 0 or limit < step:
        raise ValueError(f"log-odds grid needs step > 0 and limit >= step, got step {step}, limit {limit}")
    z = np.arange(-limit, limit + step / 2, step)
    return (0.0, *(float(f"{v:.6g}") for v in 1.0 / (1.0 + np.exp(-z))), 1.0)


DEFAULT_GRID = log_odds_grid()


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
    spanning the grid: its count only). What this reveals: per class, counts of >= ``min_count`` images per bin,
    and where the non-empty bins start and end (to one grid step: e.g. that one of the >= ``min_count`` images of
    the lowest bin lies in its first grid step), never which image or its score. ``grid``: the shared
    :data:`DEFAULT_GRID` unless a test passes another (every site must use the same one).

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


def _cells(hist: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lower edges, upper edges, counts) of one class's histogram."""
    e = np.asarray(hist["edges"], np.float64)
    return e[:-1], e[1:], np.asarray(hist["counts"], np.int64)


def _placed(hist: dict, min_count: int) -> bool:
    """False for a class sent as one whole-grid cell of fewer than ``min_count`` images: it says how many images
    the class has, not where any of them scores, so no threshold can be checked against it."""
    lo, hi, n = _cells(hist)
    return not (n.size == 1 and 0 < n[0] < min_count)


def _below_bounds(hists: Sequence[dict], t: float) -> tuple[int, int]:
    """(at least, at most) how many images of these histograms score below ``t``: cells entirely below t
    (upper edge <= t) count for both, cells straddling t only for the second."""
    least = most = 0
    for h in hists:
        lo, hi, n = _cells(h)
        least += int(n[hi <= t].sum())
        most += int(n[lo < t].sum())
    return least, most


def pooled_threshold(histograms: Sequence[dict], target: float = DEFAULT_TARGET_SENSITIVITY,
                     names: Sequence[str] | None = None) -> dict:
    """One threshold on calibrated p(positive) for the pooled per-class histograms of several sites.

    Candidates are 0 and every cell edge of any site. For a candidate t a positive counts as detected only when its
    whole cell lies at or above t, so the pooled sensitivity S(t) = 1 - (positives in cells with lower edge < t) / P
    is a lower bound on the pooled validation sensitivity; the largest t with S(t) >= ``target`` is chosen (the
    largest threshold gives the best specificity the histograms allow). Specificity is bracketed the same way:
    [negatives in cells entirely below t, negatives in cells starting below t] / N.

    A consequence of the minimum count k: every non-empty cell holds >= k positives, so a cell can be missed only
    when k / P <= 1 - target (P >= 100 positives for k = 5 and a target of 0.95). Below that the rule keeps every
    validation positive above t, i.e. t is the lowest positive cell edge of any site (the lowest-scoring pooled
    validation positive, floored to the grid): by the order-statistic argument of split-conformal prediction
    (Vovk et al. 2005; Angelopoulos & Bates 2021, arXiv:2107.07511) a new exchangeable positive then scores >= t
    with probability >= 1 - 1 / (P + 1).

    Positives sent as one whole-grid cell of fewer than k images (a site with < k validation positives) cannot be
    placed; they are left out of P and named in ``left_out``. No threshold is set (``threshold`` None, the reason
    in ``unresolved``, the highest candidate in ``candidate``) when no positive can be placed, when only t = 0
    meets the target (positives in the grid's lowest step), or when the chosen t calls every pooled validation
    negative positive (specificity upper bound 0): none of these is an operating point.

    Args:
        histograms: :func:`coarse_histogram` answers; names: one per histogram (sites), for the messages.
    Returns:
        ``{"threshold", "candidate", "unresolved", "target", "sensitivity" (lower bound S), "specificity" (lower
        bound), "specificity_upper", "n_positive" (placed), "n_negative", "n_sites", "left_out"}``.
    Raises:
        ValueError: no histograms.
    """
    if not histograms:
        raise ValueError("no site histograms to pool")
    names = list(names) if names is not None else [f"histogram {i + 1}" for i in range(len(histograms))]
    k = max(int(h.get("min_count", 1)) for h in histograms)
    pos_all = [h["classes"]["1"] for h in histograms]
    keep = [i for i, h in enumerate(pos_all) if _placed(h, k)]
    left_out = [names[i] for i, h in enumerate(pos_all) if i not in keep and int(np.sum(h["counts"]))]
    pos, neg = [pos_all[i] for i in keep], [h["classes"]["0"] for h in histograms]
    n_pos = sum(int(np.sum(h["counts"])) for h in pos)
    n_neg = sum(int(np.sum(h["counts"])) for h in neg)
    cands = sorted({0.0, *(float(e) for h in pos + neg for e in h["edges"])})
    best = max((t for t in cands if n_pos and 1 - _below_bounds(pos, t)[1] / n_pos >= target), default=0.0)
    sens = 1 - _below_bounds(pos, best)[1] / n_pos if n_pos else None
    tn_lo, tn_hi = _below_bounds(neg, best)
    out = {"threshold": float(best), "candidate": float(best), "unresolved": None, "target": float(target),
           "sensitivity": sens, "specificity": tn_lo / n_neg if n_neg else None,
           "specificity_upper": tn_hi / n_neg if n_neg else None, "n_positive": n_pos, "n_negative": n_neg,
           "n_sites": len(histograms), "left_out": left_out, "min_count": k}
    out["unresolved"] = _unresolved(out, pos, [names[i] for i in keep], cands)
    if out["unresolved"]:
        out["threshold"] = None
    return out


def _unresolved(res: dict, pos: list[dict], pos_names: list[str], cands: list[float]) -> str | None:
    """Why the pooled counts give no operating point (see :func:`pooled_threshold`), or None."""
    k, target, n_pos = res["min_count"], res["target"], res["n_positive"]
    if not n_pos:
        return (f"no site sent >= {k} validation positives (the minimum count per cell), so no positive can be "
                "placed on the grid" + (f" ({', '.join(res['left_out'])} sent fewer)" if res["left_out"] else ""))
    if res["candidate"] <= 0.0:
        nxt = min((c for c in cands if c > 0), default=1.0)
        low = [s for s, h in zip(pos_names, pos) if _below_bounds([h], nxt)[1]]
        miss = _below_bounds(pos, nxt)[1]
        return (f"only threshold 0 (every image positive) reaches sensitivity {target:g} on the pooled validation "
                f"counts: {', '.join(low)} have validation positives in cells starting below p = {nxt:.3g}; "
                f"missing them would cost {miss} of {n_pos} positives (cells hold >= {k})")
    if res["specificity_upper"] == 0.0:
        return (f"the highest threshold that reaches sensitivity {target:g} on the pooled validation counts "
                f"(p = {res['candidate']:.3g}) lies below every validation negative of every site: it would call "
                "every image positive")
    return None


def site_sensitivity(p_pos, y, threshold: float) -> dict:
    """A site's own sensitivity and specificity at ``threshold`` (p >= t is positive) on its calibrated p(positive)
    (N,) and binary labels (N,); None where a class is absent."""
    p = np.asarray(p_pos, np.float64)
    y = np.asarray(y).astype(int)
    pos, neg = y == 1, y == 0
    return {"sensitivity": float((p[pos] >= threshold).mean()) if pos.any() else None,
            "specificity": float((p[neg] < threshold).mean()) if neg.any() else None,
            "n_positive": int(pos.sum()), "n_negative": int(neg.sum())}


def add_site_rates(op_record: dict, sites: dict[str, dict]) -> dict:
    """The server's last step: put each site's own rates at the federated threshold (``sites[s]["operating_point"]``,
    what :func:`site_rates_at` returned there) under ``op_record["site_sensitivity"]``, and pool the sites' test
    counts into ``op_record["test"]`` (``{"sensitivity", "specificity", "n_positive", "n_negative", "n_sites"}``:
    detected positives / positives and correctly negative negatives / negatives, summed over sites; None where no
    site has the class). Returns ``op_record``."""
    own = {s: b["operating_point"] for s, b in sites.items() if b.get("operating_point")}
    op_record["site_sensitivity"] = own
    tests = [o["test"] for o in own.values() if isinstance(o.get("test"), dict)]
    npos = sum(int(t["n_positive"]) for t in tests)
    nneg = sum(int(t["n_negative"]) for t in tests)
    tp = sum(round(t["sensitivity"] * t["n_positive"]) for t in tests if t.get("sensitivity") is not None)
    tn = sum(round(t["specificity"] * t["n_negative"]) for t in tests if t.get("specificity") is not None)
    op_record["test"] = {"sensitivity": tp / npos if npos else None, "specificity": tn / nneg if nneg else None,
                         "n_positive": npos, "n_negative": nneg, "n_sites": len(tests)}
    return op_record


def site_rates_at(op: dict, val: tuple, test: tuple | None) -> dict:
    """A site's own answer once the federated threshold ``op`` (``{"threshold", ...}``, threshold None when unset)
    arrives: its temperature-scaled validation (and, given, test) p(positive) and labels, ``(p (N,), y (N,))``
    each, scored at the threshold with :func:`site_sensitivity`; aggregate rates and counts only, like the
    confusion matrix a site already sends. ``{"threshold": None}`` plus nothing else when no threshold was set."""
    t = op.get("threshold")
    if t is None:
        return {"threshold": None}
    out = {"threshold": float(t), **site_sensitivity(val[0], val[1], float(t))}
    if test is not None:
        out["test"] = site_sensitivity(test[0], test[1], float(t))
    return out


def site_rates_line(op: dict) -> str:
    """One line: the pooled test sensitivity at the federated threshold and each site's own validation / test
    sensitivity beside it (from :func:`add_site_rates`)."""
    def f(v):
        return "–" if v is None else f"{v:.2f}"
    own = op.get("site_sensitivity") or {}
    test = op.get("test") or {}
    return (f"  at the threshold: pooled test sensitivity {f(test.get('sensitivity'))} of {test.get('n_positive', 0)}"
            f" positives, specificity {f(test.get('specificity'))}; each site's own validation / test sensitivity: "
            + ", ".join(f"{s} {f(o.get('sensitivity'))} / {f((o.get('test') or {}).get('sensitivity'))}"
                        for s, o in sorted(own.items())))


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
    are left out): :func:`pooled_threshold` (``threshold`` None with the reason in ``unresolved`` when the pooled
    counts give no operating point) plus the sites pooled and the rule's name. None when no site sent one."""
    hs = {s: r["histogram"] for s, r in sorted(reports.items()) if r and r.get("histogram")}
    if not hs:
        return None
    res = pooled_threshold(list(hs.values()), target, names=list(hs))
    return {**res, "sites": list(hs),
            "rule": "largest threshold on calibrated p(positive) whose pooled histogram sensitivity (lower bound) "
                    "reaches the target"}


def describe(op: dict | None) -> str:
    """One line on the federated operating point (``metrics.json``'s ``operating_point``, also a partial one from an
    older run) for the console, the log and the report."""
    if not op:
        return "operating point: none (no site sent a validation histogram)"
    if op.get("skipped"):
        return f"operating point: none: {op['skipped']}"
    if op.get("rule") == "per-model":
        return (f"operating point: per model, each site's own threshold on its acceptance data (out-of-fold training "
                f"scores + validation) for {len(op.get('sites') or [])} sites; see the acceptance outcomes")
    if op.get("threshold") is None:
        return f"operating point: NO federated threshold: {op.get('unresolved') or 'not recorded why'}"

    def num(v, fmt=".2f"):
        return "n/a" if v is None else format(v, fmt)
    lo, hi = op.get("specificity"), op.get("specificity_upper")
    spec = num(lo) if hi is None or lo is None or abs(hi - lo) < 5e-3 else f"{lo:.2f}-{hi:.2f}"
    left = op.get("left_out") or []
    return (f"operating point: threshold {op['threshold']:.3g} on calibrated p(PNEUMONIA) for target sensitivity "
            f"{num(op.get('target'), 'g')}: pooled validation sensitivity >= {num(op.get('sensitivity'))} of "
            f"{op.get('n_positive', '?')} positives, specificity {spec} of {op.get('n_negative', '?')} negatives "
            f"({op.get('n_sites', '?')} sites"
            + (f"; left out, fewer than {op.get('min_count')} positives: {', '.join(left)}" if left else "") + ")"
            + ("; WARNING: threshold 0 calls every image positive" if op["threshold"] <= 0 else ""))


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
    from its file header; an ``intercept`` of a per-model calibration is applied by :func:`calibrate`): sensitivity
    and specificity of calibrated p(positive) >= threshold, each ``{"value", "ci_low", "ci_high"}`` (percentile
    bootstrap over the images of each class, i.e. class-stratified), the operating-point efficiency
    (:func:`operating_point_efficiency`) and the top-label ECE before and after the calibration (only the ECEs,
    with ``unresolved``, when ``op`` carries no threshold). ``probs`` (N, C) (C > 2: class 0 negative, the rest
    positive), ``y`` (N,) labels (> 0 positive)."""
    p = np.asarray(probs, np.float64)
    yb = (np.asarray(y).astype(int) > 0).astype(int)
    pb = np.stack([p[:, 0], 1.0 - p[:, 0]], axis=1)
    cal = calibrate(pb, op)
    if op.get("threshold") is None:  # the federation set no threshold (``op["unresolved"]`` says why)
        return {"temperature": float(op["temperature"]), "threshold": None, "unresolved": op.get("unresolved"),
                "ece_before": expected_calibration_error(pb, yb), "ece_after": expected_calibration_error(cal, yb)}
    pred = cal[:, 1] >= float(op["threshold"])
    rng = np.random.default_rng(seed)
    return {"temperature": float(op["temperature"]), "threshold": float(op["threshold"]),
            "target_sensitivity": op.get("target"), "n_positive": int(yb.sum()), "n_negative": int((1 - yb).sum()),
            "sensitivity": _rate_ci(pred[yb == 1].astype(float), n_boot, rng),
            "specificity": _rate_ci((~pred[yb == 0]).astype(float), n_boot, rng),
            "ece_before": expected_calibration_error(pb, yb), "ece_after": expected_calibration_error(cal, yb),
            "efficiency": operating_point_efficiency(cal[:, 1], yb, float(op["threshold"])),
            "intercept": float(op.get("intercept") or 0.0)}


# ------------------------------------------------------------------------------------------------------------------
# Per-model operating point (each deployed model its own threshold, chosen on the site's acceptance scores)
# ------------------------------------------------------------------------------------------------------------------
#: Floors the consortium sets for the acceptance check (lower confidence bounds must reach them).
DEFAULT_FLOORS = {"sensitivity": 0.90, "specificity": 0.50}
#: One-sided level of the lower confidence bounds the acceptance check and the threshold rule use.
DEFAULT_CONFIDENCE = 0.95
#: Interval methods: Wilson score (Wilson 1927) and Clopper-Pearson exact (Clopper & Pearson 1934).
INTERVAL_METHODS = ("wilson", "clopper-pearson")
#: Operating-point efficiency is counted only where the achieved sensitivity reaches this.
EFFICIENCY_MIN_SENSITIVITY = 0.93
#: A model whose recall of one class is at most this share "calls (almost) every image" the other class.
DEGENERATE_RECALL = 0.05
#: Prior standard deviations of the calibration fit: log slope ~ N(0, s^2), intercept ~ N(0, s^2) (logit units).
CALIBRATION_PRIOR_SD = (1.0, 1.0)
#: Bounds of the calibration slope a (the inverse temperature), as for :func:`fit_temperature`.
SLOPE_BOUNDS = (0.05, 20.0)
OUT_OF_FOLD_K = 5
_EPS = 1e-6


def logit(p) -> np.ndarray:
    """log(p / (1 - p)) of probabilities (any shape), p clipped to [1e-6, 1 - 1e-6] so that scores of exactly 0 or 1
    stay finite and ordered."""
    q = np.clip(np.asarray(p, np.float64), _EPS, 1.0 - _EPS)
    return np.log(q) - np.log1p(-q)


def _sigmoid(z) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(z, np.float64)))


def positive_probability(probs) -> np.ndarray:
    """p(positive) (N,) from class probabilities (N, C) (class 0 negative, every other class positive) or from
    p(positive) itself (N,)."""
    p = np.asarray(probs, np.float64)
    return 1.0 - p[:, 0] if p.ndim == 2 else p


def _binary(y) -> np.ndarray:
    return (np.asarray(y).astype(int) > 0).astype(int)


def proportion_interval(k: int, n: int, confidence: float = 0.95, method: str = "wilson") -> tuple:
    """Two-sided ``confidence`` interval ``(low, high)`` of a binomial proportion k / n; ``(None, None)`` for n = 0.

    ``wilson``: the score interval (Wilson 1927, J. Am. Stat. Assoc. 22:209); ``clopper-pearson``: the exact
    interval from beta quantiles (Clopper & Pearson 1934, Biometrika 26:404), never narrower than its nominal
    coverage. Both through :meth:`scipy.stats.binomtest.proportion_ci`.

    Raises:
        ValueError: unknown method, k outside 0..n, or confidence outside (0, 1).
    """
    from scipy.stats import binomtest

    if method not in INTERVAL_METHODS:
        raise ValueError(f"unknown interval method {method!r}; expected one of {', '.join(INTERVAL_METHODS)}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    k, n = int(k), int(n)
    if n == 0:
        return None, None
    if not 0 <= k <= n:
        raise ValueError(f"k = {k} outside 0..n = {n}")
    ci = binomtest(k, n).proportion_ci(confidence, "wilson" if method == "wilson" else "exact")
    return float(ci.low), float(ci.high)


def lower_bound(k: int, n: int, confidence: float = DEFAULT_CONFIDENCE, method: str = "wilson") -> float | None:
    """One-sided lower confidence bound of k / n at level ``confidence`` (the lower end of the two-sided interval at
    level 2 confidence - 1); None for n = 0. See :func:`proportion_interval` for the methods and errors."""
    return proportion_interval(k, n, 2.0 * confidence - 1.0, method)[0]


def rate(k: int, n: int, confidence: float = DEFAULT_CONFIDENCE, method: str = "wilson") -> dict:
    """A proportion with its intervals: ``{"value", "k", "n", "ci_low", "ci_high"`` (two-sided, level
    ``confidence``), ``"lower"`` (one-sided lower bound, level ``confidence``), ``"method"}``; values None when
    n = 0."""
    lo, hi = proportion_interval(k, n, confidence, method)
    return {"value": k / n if n else None, "k": int(k), "n": int(n), "ci_low": lo, "ci_high": hi,
            "lower": lower_bound(k, n, confidence, method), "method": method}


def rates_at(p_pos, y, threshold: float, confidence: float = DEFAULT_CONFIDENCE, method: str = "wilson") -> dict:
    """Sensitivity and specificity of the decision ``p >= threshold`` (positive) on p(positive) (N,) and labels (N,)
    (> 0 positive), each a :func:`rate` dict, plus ``positive_share`` (share of images called positive)."""
    p = np.asarray(p_pos, np.float64)
    yb = _binary(y)
    call = p >= float(threshold)
    return {"threshold": float(threshold),
            "sensitivity": rate(int(call[yb == 1].sum()), int((yb == 1).sum()), confidence, method),
            "specificity": rate(int((~call[yb == 0]).sum()), int((yb == 0).sum()), confidence, method),
            "positive_share": float(call.mean()) if call.size else None}


def roc_specificity_at(p_pos, y, sensitivity: float = DEFAULT_TARGET_SENSITIVITY) -> float | None:
    """The specificity the model's own ROC curve gives at ``sensitivity`` on these images: the largest specificity
    of any threshold whose sensitivity is >= ``sensitivity`` (p >= t is positive). None without both classes.

    With P positives sorted ascending, at most m = floor(P (1 - sensitivity)) may be missed; the best threshold is
    the (m + 1)-th lowest positive score, and the specificity is the share of negatives strictly below it.
    """
    p = np.asarray(p_pos, np.float64)
    yb = _binary(y)
    pos, neg = np.sort(p[yb == 1]), p[yb == 0]
    if not pos.size or not neg.size:
        return None
    m = int(np.floor(pos.size * (1.0 - sensitivity) + 1e-9))
    return float((neg < pos[m]).mean())


def operating_point_efficiency(p_pos, y, threshold: float, sensitivity: float = DEFAULT_TARGET_SENSITIVITY,
                               min_sensitivity: float = EFFICIENCY_MIN_SENSITIVITY) -> dict:
    """Operating-point efficiency on one image set: achieved specificity at ``threshold`` divided by the
    specificity the same model's ROC curve gives at ``sensitivity`` on the same images
    (:func:`roc_specificity_at`). Counted only where the achieved sensitivity is >= ``min_sensitivity`` (a
    threshold that buys specificity by missing positives is no efficient operating point): otherwise
    ``efficiency`` is None and ``reason`` says why. Can exceed 1 when the achieved sensitivity lies between
    ``min_sensitivity`` and ``sensitivity``.

    Returns:
        ``{"efficiency", "counted", "reason", "sensitivity", "specificity", "roc_specificity"}`` (rates as floats).
    """
    p = np.asarray(p_pos, np.float64)
    yb = _binary(y)
    if not (yb == 1).any() or not (yb == 0).any():
        return {"efficiency": None, "counted": False, "reason": "needs images of both classes",
                "sensitivity": None, "specificity": None, "roc_specificity": None}
    sens = float((p[yb == 1] >= threshold).mean())
    spec = float((p[yb == 0] < threshold).mean())
    roc = roc_specificity_at(p, yb, sensitivity)
    out = {"efficiency": None, "counted": False, "reason": None, "sensitivity": sens, "specificity": spec,
           "roc_specificity": roc}
    if sens < min_sensitivity - 1e-12:
        out["reason"] = f"achieved sensitivity {sens:.3f} is below {min_sensitivity:g}"
    elif not roc:
        out["reason"] = f"the ROC curve gives specificity 0 at sensitivity {sensitivity:g}"
    else:
        out.update(efficiency=spec / roc, counted=True)
    return out


# --- out-of-fold scores ---------------------------------------------------------------------------------------------
def fold_assignment(labels, groups=None, k: int = OUT_OF_FOLD_K, seed: int = 0) -> np.ndarray:
    """Fold index 0..k-1 (N,) for each image: stratified by label and grouped by ``groups`` (patient ids, so a
    patient's images share a fold), with scikit-learn's ``StratifiedGroupKFold`` (shuffled, ``random_state=seed``).
    k is lowered to the number of groups when there are fewer.

    Raises:
        ValueError: k < 2, fewer than two groups, or ``groups`` of another length.
    """
    from sklearn.model_selection import StratifiedGroupKFold

    y = np.asarray(labels).astype(int)
    g = np.arange(y.size) if groups is None else np.asarray(groups)
    if g.shape[0] != y.size:
        raise ValueError(f"{g.shape[0]} groups for {y.size} labels")
    if k < 2:
        raise ValueError(f"out-of-fold scores need k >= 2 folds, got {k}")
    n_groups = np.unique(g).size
    if n_groups < 2:
        raise ValueError("out-of-fold scores need at least two groups (patients)")
    k = min(int(k), n_groups)
    folds = np.full(y.size, -1, int)
    import warnings

    with warnings.catch_warnings():  # "the least populated class has only m members": fine for small sites
        warnings.simplefilter("ignore", UserWarning)
        for f, (_, held) in enumerate(StratifiedGroupKFold(k, shuffle=True, random_state=seed).split(y, y, g)):
            folds[held] = f
    return folds


def out_of_fold_scores(labels, fit_predict, groups=None, k: int = OUT_OF_FOLD_K, seed: int = 0) -> np.ndarray:
    """Out-of-fold scores over a training split: every image scored by a model that did not train on it.

    For each fold f of :func:`fold_assignment`, ``fit_predict(train_idx, held_idx)`` trains on the images
    ``train_idx`` (the other folds; int arrays into the split) and returns the scores (len(held_idx),) or class
    probabilities (len(held_idx), C) of the images ``held_idx``. A site calls it with a ``fit_predict`` that copies
    the model the deployed model's last training stage started from, repeats that stage on ``train_idx`` and scores
    ``held_idx`` (Stone 1974, J. R. Stat. Soc. B 36:111; the cross-validated scores of Platt 1999). Cost: k
    repetitions of that stage on (k - 1) / k of the split, i.e. (k - 1) times the stage's training.

    Returns:
        scores (N,) or (N, C) in the split's order.
    Raises:
        ValueError: see :func:`fold_assignment`; a ``fit_predict`` answer of the wrong length.
    """
    y = np.asarray(labels).astype(int)
    folds = fold_assignment(y, groups, k, seed)
    out = None
    for f in range(int(folds.max()) + 1):
        held = np.flatnonzero(folds == f)
        s = np.asarray(fit_predict(np.flatnonzero(folds != f), held), np.float64)
        if s.shape[0] != held.size:
            raise ValueError(f"fit_predict returned {s.shape[0]} scores for {held.size} held-out images")
        if out is None:
            out = np.zeros((y.size, *s.shape[1:]))
        out[held] = s
    return out


# --- calibration ------------------------------------------------------------------------------------------------------
def binary_ece(p_pos, y, n_bins: int = 10) -> float | None:
    """ECE of binary p(positive) (N,) and labels (N,) as the reliability diagram shows it
    (:func:`reliability_bins`): over ``n_bins`` equal-width bins of p(positive), the image-weighted mean
    |observed share of positives - mean p| (Naeini et al. 2015, AAAI). None when N = 0. (The top-label ECE of
    :func:`expected_calibration_error` bins max(p, 1 - p) instead, merging the bins of p and 1 - p.)"""
    p = np.clip(np.asarray(p_pos, np.float64), 0.0, 1.0)
    yb = _binary(y)
    if yb.size == 0:
        return None
    b = np.minimum((p * n_bins).astype(int), n_bins - 1)
    return float(sum((b == k).mean() * abs(yb[b == k].mean() - p[b == k].mean())
                     for k in range(n_bins) if (b == k).any()))


def fit_platt(z, y, prior_sd: tuple[float, float] = CALIBRATION_PRIOR_SD,
              slope_bounds: tuple[float, float] = SLOPE_BOUNDS) -> tuple[float, float]:
    """Logistic calibration of the model's logit z (N,): p = sigmoid(a z + b), a > 0, fitted by maximum a
    posteriori with log a ~ N(0, s_a^2) and b ~ N(0, s_b^2) (``prior_sd`` = (s_a, s_b)), a kept in
    ``slope_bounds``. Platt 1999 (Advances in Large Margin Classifiers) fits (a, b) by maximum likelihood; on a
    perfectly separated split that likelihood grows without bound as a grows (the temperature 1 / a runs to its
    bound, see :func:`fit_temperature`). The prior keeps the fit finite and near the identity (a = 1, b = 0) where
    the images say little (a weakly informative prior for logistic regression: Gelman et al. 2008, Ann. Appl.
    Stat. 2:1360). a = 1 / T: with b = 0 this is temperature scaling (Guo et al. 2017, arXiv:1706.04599).

    Returns:
        (a, b). (1.0, 0.0) for an empty split.
    """
    from scipy.optimize import minimize

    z = np.asarray(z, np.float64)
    yb = _binary(y)
    if z.size == 0:
        return 1.0, 0.0
    sa, sb = prior_sd
    lo, hi = np.log(slope_bounds[0]), np.log(slope_bounds[1])

    def objective(theta):
        la, b = theta
        s = np.exp(la) * z + b
        # -log sigmoid(s) for y = 1, -log sigmoid(-s) for y = 0, stably
        nll = np.logaddexp(0.0, -s)[yb == 1].sum() + np.logaddexp(0.0, s)[yb == 0].sum()
        return nll + la ** 2 / (2 * sa ** 2) + b ** 2 / (2 * sb ** 2)

    r = minimize(objective, x0=np.zeros(2), method="L-BFGS-B", bounds=[(lo, hi), (None, None)])
    return float(np.exp(r.x[0])), float(r.x[1])


def calibrate(probs, op: dict) -> np.ndarray:
    """Calibrated class probabilities (N, C) under an operating point's calibration: logits / ``temperature``, plus
    ``intercept`` on the positive side for a binary model (0 when absent: plain temperature scaling, as
    :func:`apply_temperature`). Monotone in p(positive), so the ranking (AUC) is unchanged.

    Raises:
        ValueError: an intercept for a model with more than two classes.
    """
    cal = apply_temperature(probs, float(op.get("temperature", 1.0)))
    b = float(op.get("intercept") or 0.0)
    if b:
        if cal.shape[1] != 2:
            raise ValueError("a calibration intercept applies to binary models only")
        p = _sigmoid(logit(cal[:, 1]) + b)
        cal = np.stack([1 - p, p], 1)
    return cal


def choose_calibration(p_pos, y, k: int = OUT_OF_FOLD_K, seed: int = 0, n_bins: int = 10,
                       prior_sd: tuple[float, float] = CALIBRATION_PRIOR_SD) -> dict:
    """Fit :func:`fit_platt` on p(positive) (N,) and keep it only when it lowers the ECE on images it was not
    fitted on: the k-fold cross-validated ECE of the fitted calibration (each fold calibrated by a fit on the other
    folds) against the ECE of the uncalibrated scores, both on all N images. A calibration that does not lower it
    is dropped (``kind`` "none": temperature 1, intercept 0).

    Returns:
        ``{"kind": "platt" | "none", "temperature": 1 / a, "intercept": b, "ece_raw", "ece_cv", "fitted":
        {"temperature", "intercept"}}`` (``fitted``: the fit on all N images, whether kept or not).
    """
    p = np.asarray(p_pos, np.float64)
    yb = _binary(y)
    z = logit(p)
    a, b = fit_platt(z, yb, prior_sd)
    out = {"kind": "none", "temperature": 1.0, "intercept": 0.0, "ece_raw": binary_ece(p, yb), "ece_cv": None,
           "fitted": {"temperature": 1.0 / a, "intercept": b}}
    if yb.size < 2 * k or min(yb.sum(), (1 - yb).sum()) < 2:
        return out
    folds = fold_assignment(yb, None, k, seed)
    cv = np.zeros_like(p)
    for f in range(int(folds.max()) + 1):
        held = folds == f
        af, bf = fit_platt(z[~held], yb[~held], prior_sd)
        cv[held] = _sigmoid(af * z[held] + bf)
    out["ece_cv"] = binary_ece(cv, yb, n_bins)
    if out["ece_cv"] is not None and out["ece_raw"] is not None and out["ece_cv"] < out["ece_raw"]:
        out.update(kind="platt", temperature=1.0 / a, intercept=b)
    return out


def reliability_bins(p_pos, y, n_bins: int = 10) -> dict:
    """The points of a reliability diagram (DeGroot & Fienberg 1983; Niculescu-Mizil & Caruana 2005): p(positive)
    (N,) in ``n_bins`` equal-width bins; per bin the mean predicted p, the observed share of positives, the count
    and a Wilson 95 % interval of the observed share, plus the binary ECE (:func:`binary_ece`). Empty bins are left
    out. Counts and means only (no image's score), so it may be shown outside the site.

    Returns:
        ``{"n_bins", "edges", "mean_predicted", "observed", "count", "ci_low", "ci_high", "ece", "n"}``.
    """
    p = np.clip(np.asarray(p_pos, np.float64), 0.0, 1.0)
    yb = _binary(y)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    b = np.minimum((p * n_bins).astype(int), n_bins - 1)
    out = {"n_bins": int(n_bins), "edges": [float(e) for e in edges], "mean_predicted": [], "observed": [],
           "count": [], "ci_low": [], "ci_high": [], "ece": binary_ece(p, yb, n_bins), "n": int(yb.size)}
    for i in range(n_bins):
        m = b == i
        if not m.any():
            continue
        k, n = int(yb[m].sum()), int(m.sum())
        lo, hi = proportion_interval(k, n, 0.95, "wilson")
        out["mean_predicted"].append(float(p[m].mean()))
        out["observed"].append(k / n)
        out["count"].append(n)
        out["ci_low"].append(lo)
        out["ci_high"].append(hi)
    return out


# --- threshold and acceptance -------------------------------------------------------------------------------------------
def choose_threshold(p_pos, y, target: float = DEFAULT_TARGET_SENSITIVITY,
                     floor: float = DEFAULT_FLOORS["sensitivity"], confidence: float = DEFAULT_CONFIDENCE,
                     method: str = "wilson") -> dict:
    """The largest threshold on p(positive) (N,) whose sensitivity on these images reaches ``target`` and whose
    one-sided lower confidence bound (:func:`lower_bound`) reaches ``floor``.

    With P positives, the rule allows m misses, m the largest count with (P - m) / P >= target and
    lower_bound(P - m, P) >= floor; the threshold lies in logit space midway between the (m + 1)-th lowest
    positive score and the next lower score of any image, so that the m lowest positives, and no more, fall below
    it. The midpoint is affine equivariant: for calibrated scores a logit + b (a > 0) it is the same decision, so
    choosing on calibrated or on raw scores gives the same images above the threshold. When even m = 0 misses the
    floor (too few positives), m follows the target alone and ``floor_reachable`` is False (the acceptance check
    then refuses on the sensitivity bound). The target is a point estimate on these images and the floor a bound;
    with about 100 positives the bound is the binding one (a few misses at most).

    Returns:
        ``{"threshold" (p), "logit", "misses_allowed", "n_positive", "n_negative", "floor_reachable",
        "target", "floor", "confidence", "method"}``; threshold None without positives.
    """
    p = np.asarray(p_pos, np.float64)
    yb = _binary(y)
    z = logit(p)
    pos = np.sort(z[yb == 1])
    P = int(pos.size)
    out = {"threshold": None, "logit": None, "misses_allowed": None, "n_positive": P,
           "n_negative": int((yb == 0).sum()), "floor_reachable": False, "target": float(target),
           "floor": float(floor), "confidence": float(confidence), "method": method}
    if not P:
        return out
    by_target = int(np.floor(P * (1.0 - target) + 1e-9))
    ok = [m for m in range(by_target + 1) if (lb := lower_bound(P - m, P, confidence, method)) is not None
          and lb >= floor]
    m = max(ok) if ok else by_target
    keep = pos[m]  # the lowest positive that must be called positive
    below = z[z < keep]
    t = 0.5 * (keep + below.max()) if below.size else keep - 1.0
    out.update(threshold=float(_sigmoid(t)), logit=float(t), misses_allowed=int(m), floor_reachable=bool(ok))
    return out


def site_threshold_estimate(p_pos, y, misses_allowed: int) -> dict:
    """What a site sends for the federation's threshold estimate: the Harrell-Davis quantile of its positives'
    logits at level q = (m + 0.5) / P and its standard error (Harrell & Davis 1982, Biometrika 69:635; through
    ``scipy.stats.mstats.hdquantiles`` / ``hdquantiles_sd``). A weighted mean of every positive's score, not any
    one image's score. ``{"logit": None, "se": None}`` with fewer than 3 positives."""
    from scipy.stats.mstats import hdquantiles, hdquantiles_sd

    z = logit(np.asarray(p_pos, np.float64))[_binary(y) == 1]
    if z.size < 3:
        return {"logit": None, "se": None, "n_positive": int(z.size)}
    q = (int(misses_allowed) + 0.5) / z.size
    return {"logit": float(np.asarray(hdquantiles(z, [q]))[0]),
            "se": float(np.asarray(hdquantiles_sd(z, [q]))[0]), "n_positive": int(z.size)}


def federation_estimate(estimates: dict[str, dict]) -> dict | None:
    """The server's random-effects estimate of the threshold logit from the sites' :func:`site_threshold_estimate`
    answers (DerSimonian & Laird 1986, Control. Clin. Trials 7:177): the between-site variance tau^2 by the method
    of moments and the mean mu weighted by 1 / (se^2 + tau^2). Sites without an estimate are left out. None when
    fewer than two sites sent one.

    Returns:
        ``{"mu", "tau2", "n_sites", "sites"}``.
    """
    rows = [(s, e["logit"], e["se"]) for s, e in sorted(estimates.items())
            if e and e.get("logit") is not None and e.get("se")]
    if len(rows) < 2:
        return None
    t = np.array([r[1] for r in rows])
    v = np.maximum(np.array([r[2] for r in rows]) ** 2, 1e-8)
    w = 1.0 / v
    mu_fe = (w * t).sum() / w.sum()
    q = (w * (t - mu_fe) ** 2).sum()
    tau2 = max(0.0, (q - (len(rows) - 1)) / (w.sum() - (w ** 2).sum() / w.sum()))
    ws = 1.0 / (v + tau2)
    return {"mu": float((ws * t).sum() / ws.sum()), "tau2": float(tau2), "n_sites": len(rows),
            "sites": [r[0] for r in rows]}


def shrink_threshold(site_logit: float, site_se: float | None, fed: dict | None) -> float:
    """A site's threshold logit shrunk towards the federation's estimate ``fed`` (:func:`federation_estimate`) by
    precision (the empirical Bayes posterior mean under the random-effects model): (t / se^2 + mu / tau^2) /
    (1 / se^2 + 1 / tau^2). A site with few positives (large se) moves towards mu; with tau^2 = 0 every site takes
    mu; without ``fed`` or se the site's own value is returned."""
    if fed is None or site_se is None or not np.isfinite(site_se) or site_se <= 0:
        return float(site_logit)
    if fed["tau2"] <= 0:
        return float(fed["mu"])
    w_site, w_fed = 1.0 / site_se ** 2, 1.0 / fed["tau2"]
    return float((w_site * site_logit + w_fed * fed["mu"]) / (w_site + w_fed))


def degenerate_reason(p_pos, y, threshold: float, recall_max: float = DEGENERATE_RECALL,
                      names: Sequence[str] = ("NORMAL", "PNEUMONIA")) -> str | None:
    """Why a model calls (almost) every image one class at ``threshold`` (None if it does not): a class whose recall
    is <= ``recall_max``, i.e. the model calls nearly all its images the other class (specificity <= 0.05: "calls
    almost every NORMAL image PNEUMONIA")."""
    r = rates_at(p_pos, y, threshold)
    for key, cls, other in (("specificity", names[0], names[1]), ("sensitivity", names[1], names[0])):
        v = r[key]["value"]
        if v is not None and v <= recall_max:
            return (f"calls almost every {cls} image {other} ({key} {v:.2f} of {r[key]['n']} images at threshold "
                    f"{threshold:.3g})")
    return None


def acceptance_check(p_pos, y, threshold: float | None, floors: dict | None = None,
                     confidence: float = DEFAULT_CONFIDENCE, method: str = "wilson") -> dict:
    """The site acceptance check of a candidate model at its operating point, on the site's acceptance scores
    (calibrated p(positive) (N,), labels (N,)): refused when it has no threshold, when the data lack a class, when
    it calls (almost) every image one class (:func:`degenerate_reason`), or when the one-sided lower confidence
    bound of its sensitivity or specificity is below the consortium's floor (``floors``, default
    :data:`DEFAULT_FLOORS`). Only counts and rates: the outcome may leave the site.

    Returns:
        ``{"accepted": bool, "reason": one line, "floors", "confidence", "method", "sensitivity", "specificity"
        (:func:`rate` dicts), "positive_share"}``.
    """
    floors = {**DEFAULT_FLOORS, **(floors or {})}
    out = {"accepted": False, "reason": "", "floors": floors, "confidence": float(confidence), "method": method,
           "threshold": None if threshold is None else float(threshold), "sensitivity": None,
           "specificity": None, "positive_share": None}
    if threshold is None:
        out["reason"] = "refused: no operating point (no threshold)"
        return out
    r = rates_at(p_pos, y, threshold, confidence, method)
    out.update(sensitivity=r["sensitivity"], specificity=r["specificity"], positive_share=r["positive_share"])
    if not r["sensitivity"]["n"] or not r["specificity"]["n"]:
        out["reason"] = (f"refused: the acceptance data hold {r['sensitivity']['n']} positive and "
                         f"{r['specificity']['n']} negative images; both classes are needed")
        return out
    why = degenerate_reason(p_pos, y, threshold)
    if why:
        out["reason"] = f"refused: {why}"
        return out
    short = [f"{k} lower bound {r[k]['lower']:.3f} < floor {floors[k]:g} ({r[k]['k']}/{r[k]['n']})"
             for k in ("sensitivity", "specificity") if r[k]["lower"] < floors[k]]
    if short:
        out["reason"] = "refused: " + "; ".join(short)
        return out
    out.update(accepted=True, reason=(
        f"accepted: sensitivity {r['sensitivity']['value']:.3f} (lower bound {r['sensitivity']['lower']:.3f} >= "
        f"{floors['sensitivity']:g}), specificity {r['specificity']['value']:.3f} (lower bound "
        f"{r['specificity']['lower']:.3f} >= {floors['specificity']:g}) on {r['sensitivity']['n']} + "
        f"{r['specificity']['n']} images"))
    return out


def site_operating_point(p_pos, y, *, target: float = DEFAULT_TARGET_SENSITIVITY, floors: dict | None = None,
                         confidence: float = DEFAULT_CONFIDENCE, method: str = "wilson", calibrate_scores: bool = True,
                         seed: int = 0) -> dict:
    """A deployed model's own operating point from the site's acceptance scores, in one call.

    ``p_pos`` (N,) or class probabilities (N, C): the model's uncalibrated p(positive) on the site's acceptance
    images (the out-of-fold scores of the training split, :func:`out_of_fold_scores`, plus the deployed model's
    scores of the validation split); ``y`` (N,) labels (> 0 positive). Steps: :func:`choose_calibration` (kept only
    when it lowers the cross-validated ECE); :func:`choose_threshold` on the calibrated scores (target
    sensitivity, sensitivity floor as a lower bound); the rates with intervals there; :func:`acceptance_check`;
    :func:`site_threshold_estimate` for the federation (the only part meant for the server, with the outcome).

    Returns (JSON-safe; the ``temperature`` / ``intercept`` / ``threshold`` / ``target`` keys are what a model file
    header's ``operating_point`` and :func:`calibrate` read):
        ``{"rule": "per-model", "temperature", "intercept", "threshold", "target", "calibration"
        (:func:`choose_calibration`), "choice" (:func:`choose_threshold`), "rates" (:func:`rates_at`),
        "acceptance" (:func:`acceptance_check`), "estimate" (:func:`site_threshold_estimate`), "n_positive",
        "n_negative", "ece_before", "ece_after"}``.
    """
    floors = {**DEFAULT_FLOORS, **(floors or {})}
    p = positive_probability(p_pos)
    yb = _binary(y)
    cal = choose_calibration(p, yb, seed=seed) if calibrate_scores else {
        "kind": "none", "temperature": 1.0, "intercept": 0.0, "ece_raw": binary_ece(p, yb), "ece_cv": None,
        "fitted": None}
    pc = calibrate(np.stack([1 - p, p], 1), cal)[:, 1]
    choice = choose_threshold(pc, yb, target, floors["sensitivity"], confidence, method)
    t = choice["threshold"]
    return {"rule": "per-model", "temperature": float(cal["temperature"]), "intercept": float(cal["intercept"]),
            "threshold": t, "target": float(target), "calibration": cal, "choice": choice,
            "rates": None if t is None else rates_at(pc, yb, t, confidence, method),
            "acceptance": acceptance_check(pc, yb, t, floors, confidence, method),
            "estimate": site_threshold_estimate(pc, yb, choice["misses_allowed"] or 0),
            "n_positive": int(yb.sum()), "n_negative": int((1 - yb).sum()),
            "ece_before": binary_ece(p, yb), "ece_after": binary_ece(pc, yb)}


def apply_federation(op: dict, p_pos, y, fed: dict | None) -> dict:
    """A site's operating point (:func:`site_operating_point`) once the federation's estimate ``fed``
    (:func:`federation_estimate`) arrives: the threshold logit shrunk towards it (:func:`shrink_threshold`), but
    never above the site's own threshold (a higher one would miss more of the site's own acceptance positives than
    its sensitivity floor allows), then the rates and the acceptance check again on the same acceptance scores
    (uncalibrated ``p_pos``, labels ``y``). Returns a new dict with ``threshold``, ``rates``, ``acceptance`` and
    ``federation`` (``{"mu", "tau2", "own_threshold", "shrunk"}``) updated; ``op`` itself unchanged."""
    out = dict(op)
    if op.get("threshold") is None or fed is None:
        out["federation"] = None if fed is None else {**fed, "own_threshold": op.get("threshold"), "shrunk": False}
        return out
    own = float(op["choice"]["logit"])
    t = min(own, shrink_threshold(own, (op.get("estimate") or {}).get("se"), fed))
    p = positive_probability(p_pos)
    pc = calibrate(np.stack([1 - p, p], 1), op)[:, 1]
    floors, conf, method = op["acceptance"]["floors"], op["acceptance"]["confidence"], op["acceptance"]["method"]
    thr = float(_sigmoid(t))
    out.update(threshold=thr, rates=rates_at(pc, y, thr, conf, method),
               acceptance=acceptance_check(pc, y, thr, floors, conf, method),
               federation={"mu": fed["mu"], "tau2": fed["tau2"], "own_threshold": op["threshold"],
                           "shrunk": t < own})
    return out


def summary_for_server(op: dict) -> dict:
    """What leaves the site of :func:`site_operating_point` / :func:`apply_federation`: the threshold estimate for
    the federation, the calibration, the acceptance outcome with its counts and bounds, and the ECE before and
    after. No image's score (the threshold itself lies between two images' scores and stays in the site's model
    file)."""
    acc = op.get("acceptance") or {}

    def counts(r):
        return None if not r else {k: r.get(k) for k in ("value", "k", "n", "ci_low", "ci_high", "lower")}
    return {"rule": op.get("rule"), "estimate": op.get("estimate"), "calibration": (op.get("calibration") or {}).get(
        "kind"), "accepted": acc.get("accepted"), "reason": acc.get("reason"),
        "sensitivity": counts(acc.get("sensitivity")), "specificity": counts(acc.get("specificity")),
        "ece_before": op.get("ece_before"), "ece_after": op.get("ece_after"), "n_positive": op.get("n_positive"),
        "n_negative": op.get("n_negative")}


def header_record(op: dict) -> dict:
    """The compact, JSON-safe operating point a deployed model's file header carries (``save_model_file(...,
    operating_point=header_record(op))``), read back by :func:`calibrate`, :func:`metrics_at_operating_point` and
    ``predict``: rule, temperature, intercept, threshold (calibrated p), target, the acceptance outcome and its
    rates, the ECE before and after calibration."""
    acc = op.get("acceptance") or {}

    def r(v):
        return None if not v else {k: v.get(k) for k in ("value", "k", "n", "ci_low", "ci_high", "lower", "method")}
    return {"rule": op.get("rule", "per-model"), "temperature": float(op["temperature"]),
            "intercept": float(op.get("intercept") or 0.0),
            "threshold": None if op.get("threshold") is None else float(op["threshold"]),
            "target": op.get("target"), "calibration": (op.get("calibration") or {}).get("kind"),
            "accepted": acc.get("accepted"), "reason": acc.get("reason"), "floors": acc.get("floors"),
            "confidence": acc.get("confidence"), "sensitivity": r(acc.get("sensitivity")),
            "specificity": r(acc.get("specificity")), "ece_before": op.get("ece_before"),
            "ece_after": op.get("ece_after"), "n_positive": op.get("n_positive"), "n_negative": op.get("n_negative"),
            "federation": op.get("federation")}


def site_line(site: str, op: dict) -> str:
    """One line per site for the console, the log and the report: threshold, the acceptance data's sensitivity and
    specificity with their lower bounds, and the outcome."""
    acc = op.get("acceptance") or {}
    if op.get("threshold") is None:
        return f"{site}: no operating point ({acc.get('reason') or 'no positives in the acceptance data'})"

    def f(v):
        return "–" if not v or v.get("value") is None else f"{v['value']:.3f} (lower bound {v['lower']:.3f})"
    verdict = "ACCEPTED" if acc.get("accepted") else "REFUSED"
    why = "" if acc.get("accepted") else f": {acc.get('reason', '').removeprefix('refused: ')}"
    return (f"{site}: threshold {op['threshold']:.3g} on calibrated p(PNEUMONIA); acceptance data sensitivity "
            f"{f(acc.get('sensitivity'))}, specificity {f(acc.get('specificity'))}; {verdict}{why}")


def acceptance_summary(outcomes: dict[str, dict]) -> dict:
    """The run's acceptance record (server side) from each site's outcome (``{"outcome", "deployed" ("federated" |
    "local" | None), "federated", "local"`` (:func:`summary_for_server` dicts plus ``oof_seconds``), ``"test"``
    (sensitivity / specificity :func:`rate` dicts on the site's test split, or None)}``): a site refused counts once,
    whatever it then deploys.

    Returns:
        ``{"sites", "accepted", "refused" (site names), "kept_local", "nothing_deployed", "refusal_rate",
        "oof_seconds" (the out-of-fold training cost, summed over sites and candidates), "per_site": {site:
        {"outcome", "deployed", "sensitivity", "specificity" (acceptance data, value and lower bound),
        "test_sensitivity", "test_specificity"}}, "line"}``.
    """
    per, secs = {}, 0.0
    for site, o in sorted(outcomes.items()):
        o = o or {}
        chosen = o.get(o.get("deployed") or "federated") or {}
        for c in ("federated", "local"):
            secs += float((o.get(c) or {}).get("oof_seconds") or 0.0)
        test = o.get("test") or {}
        per[site] = {"outcome": o.get("outcome"), "deployed": o.get("deployed"),
                     **{k: {"value": (chosen.get(k) or {}).get("value"), "lower": (chosen.get(k) or {}).get("lower")}
                        for k in ("sensitivity", "specificity")},
                     "ece_before": chosen.get("ece_before"), "ece_after": chosen.get("ece_after"),
                     "reliability": chosen.get("reliability"),
                     "test_sensitivity": (test.get("sensitivity") or {}).get("value"),
                     "test_specificity": (test.get("specificity") or {}).get("value")}
    refused = [s for s, v in per.items() if v["outcome"] != "accepted"]
    kept = [s for s in refused if per[s]["deployed"] == "local"]
    none = [s for s in refused if per[s]["deployed"] is None]
    n = len(per)
    line = (f"site acceptance: {n - len(refused)} of {n} sites accepted the federated model"
            + (f"; refused: {', '.join(refused)} (kept local: {', '.join(kept) or 'none'}; nothing deployed: "
               f"{', '.join(none) or 'none'})" if refused else "")
            + f"; refusal rate {len(refused) / n:.2f}" if n else "site acceptance: no site answered")
    return {"sites": n, "accepted": n - len(refused), "refused": refused, "kept_local": kept,
            "nothing_deployed": none, "refusal_rate": (len(refused) / n) if n else None, "oof_seconds": secs,
            "per_site": per, "line": line}


def site_decision_columns(block: dict) -> dict:
    """A site's columns beside AUC in the per-site table (``make demo``, ``sites.csv``): test sensitivity and
    specificity at its operating point and the acceptance outcome, from a ``metrics.json`` site block: the
    per-model rule's ``acceptance`` (``{"outcome", "test": {"sensitivity", "specificity"}}``, :func:`rate` dicts)
    or the federated rule's ``operating_point`` (:func:`site_rates_at`). Returns ``{"sensitivity", "specificity",
    "acceptance"}`` (None where the run has none)."""
    acc = block.get("acceptance") if isinstance(block.get("acceptance"), dict) else None
    if acc is not None:
        test = acc.get("test") or {}
        return {"sensitivity": (test.get("sensitivity") or {}).get("value"),
                "specificity": (test.get("specificity") or {}).get("value"), "acceptance": acc.get("outcome")}
    op = block.get("operating_point") if isinstance(block.get("operating_point"), dict) else {}
    test = op.get("test") if isinstance(op.get("test"), dict) else {}
    return {"sensitivity": test.get("sensitivity"), "specificity": test.get("specificity"), "acceptance": None}
