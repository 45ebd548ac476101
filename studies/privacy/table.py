"""The privacy / utility table of studies/privacy/RESULTS.md from the committed ``results_seed<k>.json`` files:
per arm and seed the deployed AUC and balanced accuracy on the tuning part, the paired difference to the same
method without dp, the sites' noise multiplier, steps and epsilon (range over sites), and collapsed sites.

    python -m studies.privacy.table
"""
from __future__ import annotations

import json
from pathlib import Path

from studies.privacy.run import ARMS, HERE


def _fmt(v, nd=3):
    return "–" if v is None else f"{v:.{nd}f}"


def rows() -> list[str]:
    seeds = sorted((json.loads(p.read_text()) for p in HERE.glob("results_seed*.json")), key=lambda d: d["seed"])
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
