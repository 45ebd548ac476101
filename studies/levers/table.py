"""The tables of studies/levers/RESULTS.md from the committed ``results_seed<k>.json`` files: per arm and seed the
deployed AUC (mean over sites) and its difference to FedAvg, the global and ensemble AUC, the stacker's probe AUC;
the cost per arm; and the adoption rule's mean gain over FedAvg.

    python -m studies.levers.table
"""
from __future__ import annotations

import json

import numpy as np

from studies.levers.run import ARMS, HERE

RULE = 0.015  # the adoption margin over FedAvg (mean over seeds 0-2, tuning part)


def _f(v, nd=3, sign=False):
    return "–" if v is None else (f"{v:+.{nd}f}" if sign else f"{v:.{nd}f}")


def _seeds() -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in HERE.glob("results_seed*.json")), key=lambda d: d["seed"])


def auc_rows() -> list[str]:
    out = ["| arm | seed | deployed AUC (mean of 4 sites) | per-site deployed AUC | deployed - FedAvg | "
           "global model, zero-shot | site ensemble | stacker probe AUC (cross-fitted) / average's |",
           "|---|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        for d in _seeds():
            r = d["arms"].get(arm) or {}
            if r.get("missing") or r.get("auc") is None:
                out.append(f"| {arm} | {d['seed']} | not run | | | | | |")
                continue
            st = [t.get("stacker") for t in (r.get("teacher") or {}).values() if t.get("stacker")]
            stk = "–" if not st else (f"{_f(st[0]['probe_auc_stacked_cross_fitted'])} / "
                                      f"{_f(st[0]['probe_auc_average'])}")
            sites = " / ".join(_f(v) for _, v in sorted(r["per_site_auc"].items()))
            out.append(f"| {arm} | {d['seed']} | {_f(r['auc'])} | {sites} | {_f(r.get('minus_fedavg'), sign=True)} | "
                       f"{_f(r.get('global_auc'))} | {_f(r.get('ensemble_auc'))} | {stk} |")
    return out


def cost_rows() -> list[str]:
    out = ["| arm | epochs per site | run wall s (mean over seeds) | site compute s per site | server work s | "
           "bytes up per site (MB) | bytes down per site (MB) |", "|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        rs = [d["arms"][arm]["cost"] for d in _seeds() if (d["arms"].get(arm) or {}).get("cost")]
        if not rs:
            continue

        def mean(key, rs=rs):
            v = [c[key] for c in rs if c.get(key) is not None]
            return float(np.mean(v)) if v else None
        # the server's own work: OHFL's fusion + distillation (the stacker's fits included), FedAvg's averaging
        srv = [sum(float((c.get("server_seconds") or {}).get(k) or 0.0)
                   for k in ("fusion_total", "distillation", "aggregation")) for c in rs]
        up = [v["up"] / 1e6 for c in rs for v in (c.get("bytes_per_site") or {}).values()]
        down = [v["down"] / 1e6 for c in rs for v in (c.get("bytes_per_site") or {}).values()]
        out.append(f"| {arm} | {rs[0]['epochs_per_site']} | {_f(mean('wall_seconds'), 0)} | "
                   f"{_f(mean('site_compute_seconds_per_site'), 0)} | {_f(float(np.mean(srv)), 1)} | "
                   f"{_f(float(np.mean(up)) if up else None, 1)} | {_f(float(np.mean(down)) if down else None, 1)} |")
    return out


def rule_lines() -> list[str]:
    out = []
    for arm in ARMS:
        if arm == "fedavg":
            continue
        diffs = {d["seed"]: (d["arms"].get(arm) or {}).get("minus_fedavg") for d in _seeds()}
        have = [v for v in diffs.values() if v is not None]
        if not have:
            continue
        m = float(np.mean(have))
        out.append(f"- {arm}: deployed - FedAvg at seeds {', '.join(str(s) for s, v in diffs.items() if v is not None)}"
                   f" = {' / '.join(_f(v, sign=True) for v in have)}; mean {m:+.3f} "
                   f"({'reaches' if m >= RULE and len(have) >= 3 else 'does not reach'} +{RULE:.3f}"
                   f"{'' if len(have) >= 3 else ', fewer than 3 seeds'})")
    return out


if __name__ == "__main__":
    print("\n".join(auc_rows() + [""] + cost_rows() + [""] + rule_lines()))
