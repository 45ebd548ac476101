"""Which grid lets the federated operating point resolve a threshold at the main job's validation sizes?

Compares the pooled-histogram rule (``hfl_components.operating_point.pooled_threshold``, per-class cells of >= 5
images) on the former uniform grid (0.05 steps in p) and on log-odds grids, against the same rule on the raw
pooled validation scores (no histogram, no privacy: the reference), in two settings:

1. ``real``: the validation and test splits of finished main-job runs (each site's deployed model; the temperature
   fitted on its validation split as the sites do). Scores come from ``scores.py`` (never the `evaluation` part of
   chest_xray_224). Held-out = the sites' own test splits.
2. ``sim``: a simulation with a known answer: 6 sites with the main job's validation sizes (5-6 negatives, 8-10
   positives), each site's model binormal with its own separation d' ~ U(1.5, 3.5) (AUC 0.86-0.99) and its own
   miscalibration (raw logit = a * true log-odds, a ~ U(0.5, 3)); the temperature is fitted on the site's validation
   split; the threshold's true sensitivity / specificity are computed on 20,000 new images per class and site.

Usage: python -m studies.operating_point.study sim --reps 300 --seed 0 [--pos-range 4 8 ...]
       python -m studies.operating_point.scores RUN RUN_SCORES.json; python -m studies.operating_point.study real
       RUN_SCORES.json [...]
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from hfl_components.operating_point import (apply_temperature, coarse_histogram, fit_temperature, log_odds_grid,
                                            pooled_threshold)

GRIDS = {"uniform p 0.05": tuple(np.round(np.linspace(0.0, 1.0, 21), 4)),
         "log-odds 1.0 / 8": log_odds_grid(1.0, 8.0), "log-odds 0.5 / 8": log_odds_grid(0.5, 8.0),
         "log-odds 0.25 / 8": log_odds_grid(0.25, 8.0), "log-odds 0.5 / 12": log_odds_grid(0.5, 12.0)}


def raw_threshold(val: list[tuple[np.ndarray, np.ndarray]], target: float) -> float:
    """The same rule on raw pooled scores: the largest score t with pooled validation sensitivity >= target."""
    p = np.concatenate([c for c, _ in val])
    y = np.concatenate([v for _, v in val])
    cands = np.unique(np.r_[0.0, p[y == 1]])
    ok = [t for t in cands if (p[y == 1] >= t).mean() >= target]
    return float(max(ok))


def rates(sets: list[tuple[np.ndarray, np.ndarray]], t: float | None) -> tuple[float, float]:
    """Pooled (sensitivity, specificity) at t over (calibrated p, y) sets; argmax (0.5) when t is None."""
    t = 0.5 if t is None else t
    p = np.concatenate([c for c, _ in sets])
    y = np.concatenate([v for _, v in sets])
    return float((p[y == 1] >= t).mean()), float((p[y == 0] < t).mean())


def evaluate_rules(val, held, target=0.95) -> dict:
    """Each grid's threshold (or None) with the held-out pooled sensitivity / specificity, and the raw reference."""
    out = {}
    former = [coarse_histogram(p, y, GRIDS["uniform p 0.05"], 5) for p, y in val]
    for h in former:  # the former rule: a class of < 5 images (one whole-grid cell) counted as missed, not left out
        h["min_count"] = 1
    r = pooled_threshold(former, target)
    out["former: uniform, small in"] = {"t": r["threshold"], "unresolved": r["unresolved"],
                                        **dict(zip(("sens", "spec"), rates(held, r["threshold"])))}
    for name, grid in GRIDS.items():
        r = pooled_threshold([coarse_histogram(p, y, grid, 5) for p, y in val], target)
        out[name] = {"t": r["threshold"], "unresolved": r["unresolved"], **dict(zip(("sens", "spec"),
                                                                               rates(held, r["threshold"])))}
    t = raw_threshold(val, target)
    out["raw scores (reference)"] = {"t": t, "unresolved": None, **dict(zip(("sens", "spec"), rates(held, t)))}
    return out


def calibrate(probs, y, Tmin=None):
    pb = np.stack([probs[:, 0], 1 - probs[:, 0]], 1)
    T = fit_temperature(pb, y)
    if Tmin is not None:
        T = max(T, Tmin)
    return T


def real(paths: list[str], tmin: float | None) -> None:
    for path in paths:
        d = json.load(open(path))
        val, held, Ts = [], [], []
        for site, v in sorted(d.items()):
            vp, vy = np.asarray(v["val"]["probs"]), (np.asarray(v["val"]["y"]) > 0).astype(int)
            tp, ty = np.asarray(v["test"]["probs"]), (np.asarray(v["test"]["y"]) > 0).astype(int)
            T = calibrate(vp, vy, tmin)
            Ts.append(round(T, 2))
            cal = lambda p: apply_temperature(np.stack([p[:, 0], 1 - p[:, 0]], 1), T)[:, 1]  # noqa: E731
            val.append((cal(vp), vy))
            held.append((cal(tp), ty))
        print(f"== {path} (T per site {Ts}; T floor {tmin})")
        for name, r in evaluate_rules(val, held).items():
            t = "none/argmax" if r["t"] is None else f"{r['t']:.4g}"  # none: the held-out rates are at argmax
            print(f"  {name:<24} t {t:>9}  test sens {r['sens']:.3f} spec {r['spec']:.3f}"
                  + (f"  [unresolved: {r['unresolved'][:90]}]" if r["unresolved"] else ""))


def simulate_site(rng, n0, n1, n_held=20000, d_range=(1.5, 3.5), a_range=(0.5, 3.0)):
    d, a, prior = rng.uniform(*d_range), rng.uniform(*a_range), np.log(0.62 / 0.38)

    def draw(n, c):
        x = rng.normal(d if c else 0.0, 1.0, n)
        z = a * (d * x - d * d / 2 + prior)
        return np.stack([1 / (1 + np.exp(z)), 1 / (1 + np.exp(-z))], 1), np.full(n, c)
    (v0, y0), (v1, y1) = draw(n0, 0), draw(n1, 1)
    vp, vy = np.r_[v0, v1], np.r_[y0, y1]
    (h0, g0), (h1, g1) = draw(n_held, 0), draw(n_held, 1)
    return vp, vy, np.r_[h0, h1], np.r_[g0, g1]


def sim(reps: int, seed: int, tmin: float | None, d_range, a_range, pos_range) -> None:
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {}
    for _ in range(reps):
        val, held = [], []
        for _s in range(6):
            n0, n1 = int(rng.integers(5, 7)), int(rng.integers(pos_range[0], pos_range[1] + 1))
            vp, vy, hp, hy = simulate_site(rng, n0, n1, 4000, d_range, a_range)
            T = calibrate(vp, vy, tmin)
            cal = lambda p: apply_temperature(np.stack([p[:, 0], 1 - p[:, 0]], 1), T)[:, 1]  # noqa: E731
            val.append((cal(vp), vy))
            held.append((cal(hp), hy))
        for name, r in evaluate_rules(val, held).items():
            rows.setdefault(name, []).append(r)
    print(f"simulation: {reps} replicates, seed {seed}, T floor {tmin}, d' {d_range}, miscalibration {a_range}, "
          f"validation positives per site {pos_range}; true pooled rates on 4,000 new images per class and site")
    print(f"  {'rule':<24} {'no threshold':>12} {'sens median [5%]':>18} {'P(sens<0.90)':>13} {'spec mean':>10}")
    for name, rs in rows.items():
        ok = [r for r in rs if r["t"] is not None]
        sens = np.array([r["sens"] for r in ok]) if ok else np.array([np.nan])
        spec = np.array([r["spec"] for r in ok]) if ok else np.array([np.nan])
        print(f"  {name:<24} {1 - len(ok) / len(rs):>12.3f} {np.median(sens):>9.3f} [{np.percentile(sens, 5):.3f}]"
              f" {np.mean(sens < 0.90):>13.3f} {spec.mean():>10.3f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["sim", "real"])
    ap.add_argument("scores", nargs="*")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--t-floor", type=float, default=None, help="lower bound on the fitted temperature")
    ap.add_argument("--d-range", type=float, nargs=2, default=(1.5, 3.5), help="binormal separation d' per site")
    ap.add_argument("--a-range", type=float, nargs=2, default=(0.5, 3.0), help="raw logit / true log-odds")
    ap.add_argument("--pos-range", type=int, nargs=2, default=(8, 10), help="validation positives per site")
    a = ap.parse_args()
    if a.mode == "sim":
        sim(a.reps, a.seed, a.t_floor, tuple(a.d_range), tuple(a.a_range), tuple(a.pos_range))
    else:
        real(a.scores, a.t_floor)
