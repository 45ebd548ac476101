"""The privacy / utility table of studies/privacy/RESULTS.md from the committed ``results_seed<k>.json`` files:
per arm and seed the deployed AUC and balanced accuracy on the tuning part, the paired difference to the same
method without dp, the sites' noise multiplier, steps and epsilon (range over sites), and collapsed sites; then,
per dp arm, the seed-level mean paired difference with its 95 % t-interval and the committed rule's verdict
(margin 0.02 AUC, 5 seeds; with fewer seeds no verdict).

    python -m studies.privacy.table
"""
from __future__ import annotations

import json

import numpy as np

from studies.privacy.run import ARMS, HERE


def _fmt(v, nd=3):
    return "–" if v is None else f"{v:.{nd}f}"


#: the committed rule: margin on the paired AUC difference, seeds needed for a verdict, interval level
MARGIN, SEEDS_FOR_VERDICT, LEVEL = 0.02, 5, 0.95


def _seeds() -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in HERE.glob("results_seed*.json")), key=lambda d: d["seed"])


def t_interval(values, level: float = LEVEL) -> tuple[float, float, float]:
    """(mean, low, high): the seed-level Student t-interval of the mean, n - 1 degrees of freedom."""
    from scipy.stats import t as student

    x = np.asarray(values, float)
    half = student.ppf(0.5 + level / 2, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size)
    return float(x.mean()), float(x.mean() - half), float(x.mean() + half)


def summary() -> list[str]:
    """Per dp arm: paired differences (dp minus no dp) of AUC and balanced accuracy over the seeds where both
    arms finished, their means with 95 % t-intervals, seeds with every site collapsed, and the verdict."""
    seeds = _seeds()
    out = ["| arm | seeds | AUC - no DP: mean [95 % t-interval] | balanced accuracy - no DP: mean [95 % t-interval] "
           "| seeds with every site collapsed | verdict (margin 0.02) |", "|---|---|---|---|---|---|"]
    for arm, (method, eps) in ARMS.items():
        if eps is None:
            continue
        pairs = [(d["arms"][arm], d["arms"][method]) for d in seeds
                 if "auc" in (d["arms"].get(arm) or {}) and "auc" in (d["arms"].get(method) or {})]
        if len(pairs) < 2:
            continue
        cells = []
        for key in ("auc", "balanced_accuracy"):
            m, lo, hi = t_interval([a[key] - b[key] for a, b in pairs])
            cells.append(f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]")
        m, lo, _ = t_interval([a["auc"] - b["auc"] for a, b in pairs])
        if len(pairs) < SEEDS_FOR_VERDICT:
            verdict = f"none ({len(pairs)} seeds)"
        else:
            verdict = "not worse" if m >= -MARGIN and lo >= -MARGIN else "worse (fails the margin)"
        n_sites = [len(a.get("per_site_auc", {})) for a, _ in pairs]
        collapsed = sum(len(a["collapsed_sites"]) == k > 0 for (a, _), k in zip(pairs, n_sites))
        out.append(f"| {arm} | {len(pairs)} | {cells[0]} | {cells[1]} | {collapsed} of {len(pairs)} | {verdict} |")
    return out


def rows() -> list[str]:
    seeds = _seeds()
    out = ["| arm | seed | deployed AUC | balanced accuracy | AUC - no DP | noise multiplier | steps | epsilon | "
           "collapsed sites |", "|---|---|---|---|---|---|---|---|---|"]
    for arm, (method, eps) in ARMS.items():
        for d in seeds:
            r = d["arms"].get(arm) or {}
            if r.get("missing") or "auc" not in r:
                out.append(f"| {arm} | {d['seed']} | not run | | | | | | |")
                continue
            base = d["arms"].get(method) or {}
            diff = r["auc"] - base["auc"] if eps is not None and "auc" in base else None
            dps = [v for v in (r.get("dp") or {}).values() if v]
            rng = (lambda k, nd: "–" if not dps else
                   f"{min(v[k] for v in dps):.{nd}f}–{max(v[k] for v in dps):.{nd}f}")
            out.append(f"| {arm} | {d['seed']} | {_fmt(r['auc'])} | {_fmt(r['balanced_accuracy'])} | "
                       f"{'–' if diff is None else f'{diff:+.3f}'} | {rng('noise_multiplier', 2)} | "
                       f"{rng('steps', 0)} | {rng('epsilon', 2)} | {', '.join(r['collapsed_sites']) or 'none'} |")
    return out


if __name__ == "__main__":
    print("\n".join(rows()))
    print()
    print("\n".join(summary()))
