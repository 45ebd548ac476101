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
    from its file header): sensitivity and specificity of calibrated p(positive) >= threshold, each
    ``{"value", "ci_low", "ci_high"}`` (percentile bootstrap over the images of each class, i.e. class-stratified),
    and the top-label ECE before and after the temperature (only these, with ``unresolved``, when ``op`` carries no
    threshold). ``probs`` (N, C) (C > 2: class 0 negative, the rest
    positive), ``y`` (N,) labels (> 0 positive)."""
    p = np.asarray(probs, np.float64)
    yb = (np.asarray(y).astype(int) > 0).astype(int)
    pb = np.stack([p[:, 0], 1.0 - p[:, 0]], axis=1)
    cal = apply_temperature(pb, float(op["temperature"]))
    if op.get("threshold") is None:  # the federation set no threshold (``op["unresolved"]`` says why)
        return {"temperature": float(op["temperature"]), "threshold": None, "unresolved": op.get("unresolved"),
                "ece_before": expected_calibration_error(pb, yb), "ece_after": expected_calibration_error(cal, yb)}
    pred = cal[:, 1] >= float(op["threshold"])
    rng = np.random.default_rng(seed)
    return {"temperature": float(op["temperature"]), "threshold": float(op["threshold"]),
            "target_sensitivity": op.get("target"), "n_positive": int(yb.sum()), "n_negative": int((1 - yb).sum()),
            "sensitivity": _rate_ci(pred[yb == 1].astype(float), n_boot, rng),
            "specificity": _rate_ci((~pred[yb == 0]).astype(float), n_boot, rng),
            "ece_before": expected_calibration_error(pb, yb), "ece_after": expected_calibration_error(cal, yb)}
