"""The operating-point endpoints of real OHFL runs on the committed ``tuning`` part of ``chest_xray_224``.

For a comparison folder (``SEED/ohfl`` runs evaluated by ``compare --external ../shared/data/chest_xray_224 --part
tuning``), per seed, from each run's own records only:

* the site acceptance outcomes and refusal rate (``metrics.json`` ``acceptance``, a refused site counted once);
* per deployed model, at its own operating point on the tuning part (``external/chest_xray_224-tuning/
  <site>_deployed.json`` ``operating_point``, written by ``evaluate`` through
  :func:`hfl_components.operating_point.metrics_at_operating_point`): sensitivity and specificity with 95 % Wilson
  intervals from their counts (:func:`hfl_components.operating_point.proportion_interval`), the operating-point
  efficiency (:func:`hfl_components.operating_point.operating_point_efficiency`), ECE before / after;
* pooled sensitivity (every deployed model's hits over its positives, summed), the mean efficiency over the models
  where it is counted, and the issue's per-seed targets as booleans (no verdict: seeds are shown one by one).

``python -m studies.site_operating_point.tuning_endpoints runs/border_default --out studies/site_operating_point``
writes ``tuning_seed<k>.json`` per finished seed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

NAME = "chest_xray_224-tuning"


def _rate(value: float | None, n: int) -> dict:
    from hfl_components.operating_point import proportion_interval

    if value is None or not n:
        return {"value": None, "k": None, "n": n, "ci_low": None, "ci_high": None}
    k = int(round(value * n))
    lo, hi = proportion_interval(k, n, 0.95)
    return {"value": float(value), "k": k, "n": int(n), "ci_low": float(lo), "ci_high": float(hi)}


def endpoints(run: Path, name: str = NAME) -> dict:
    """The endpoints of one run (see the module docstring) on the external set ``name`` (the folder under
    ``RUN/external/``; default the tuning part's); raises FileNotFoundError without metrics.json."""
    met = json.loads((run / "metrics.json").read_text())
    acc = met.get("acceptance") or {}
    models, tp, npos, tn, nneg = {}, 0, 0, 0, 0
    for f in sorted((run / "external" / name).glob("*_deployed.json")):
        r = json.loads(f.read_text())
        op = r.get("operating_point") or {}
        if op.get("threshold") is None:
            models[r["site"]] = {"threshold": None, "unresolved": op.get("unresolved")}
            continue
        sens = _rate(op["sensitivity"]["value"], op["n_positive"])
        spec = _rate(op["specificity"]["value"], op["n_negative"])
        tp, npos = tp + sens["k"], npos + sens["n"]
        if spec["k"] is not None:
            tn, nneg = tn + spec["k"], nneg + spec["n"]
        eff = op.get("efficiency") or {}
        models[r["site"]] = {"threshold": op["threshold"], "temperature": op.get("temperature"),
                             "sensitivity": sens, "specificity": spec, "auc": (r.get("test") or {}).get("auc"),
                             "efficiency": eff.get("efficiency"), "efficiency_counted": eff.get("counted"),
                             "efficiency_reason": eff.get("reason"), "roc_specificity_at_0.95": eff.get("roc_specificity"),
                             "ece_before": op.get("ece_before"), "ece_after": op.get("ece_after"),
                             "acceptance": ((acc.get("per_site") or {}).get(r["site"]) or {}).get("outcome"),
                             "deployed": ((acc.get("per_site") or {}).get(r["site"]) or {}).get("deployed")}
    effs = [m["efficiency"] for m in models.values() if m.get("efficiency") is not None]
    with_op = [m for m in models.values() if m.get("threshold") is not None]
    pooled = tp / npos if npos else None
    refused = len(acc.get("refused") or [])
    return {
        "seed": met.get("seed"), "method": met.get("method"), "part": name.rsplit("-", 1)[-1], "data": name,
        "acceptance": {k: acc.get(k) for k in ("sites", "accepted", "refused", "kept_local", "nothing_deployed",
                                              "refusal_rate", "oof_seconds", "line")},
        "pooled_sensitivity": pooled, "pooled_tp": tp, "pooled_positives": npos,
        "pooled_specificity": tn / nneg if nneg else None, "pooled_tn": tn, "pooled_negatives": nneg,
        "mean_efficiency": float(np.mean(effs)) if effs else None, "n_efficiency_counted": len(effs),
        "n_models": len(models), "models": models,
        "targets": {
            "every_model_sens_0.90_spec_0.50": bool(with_op) and len(with_op) == len(models) and all(
                m["sensitivity"]["value"] >= 0.90 and m["specificity"]["value"] >= 0.50 for m in with_op),
            "refused_at_most_1": refused <= 1, "pooled_sensitivity_0.95": pooled is not None and pooled >= 0.95,
            "mean_efficiency_0.93": bool(effs) and float(np.mean(effs)) >= 0.93},
        "wall_time_s": met.get("wall_time_s")}


def table(folder: Path) -> str:
    """A markdown table of every ``tuning_seed<k>.json`` in ``folder``: one row per seed."""
    lines = ["| seed | refused / sites | pooled sensitivity | mean efficiency (counted) | models with sens >= 0.90 "
             "and spec >= 0.50 | per model sensitivity / specificity / efficiency | out-of-fold cost (s) | simulation wall (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for f in sorted(folder.glob("tuning_seed*.json")):
        e = json.loads(f.read_text())
        ms = [m for m in e["models"].values() if m.get("threshold") is not None]
        ok = sum(m["sensitivity"]["value"] >= 0.90 and m["specificity"]["value"] >= 0.50 for m in ms)
        per = "; ".join(f"{s}: {m['sensitivity']['value']:.3f} / {m['specificity']['value']:.3f} / "
                        + ("-" if m["efficiency"] is None else f"{m['efficiency']:.2f}")
                        for s, m in e["models"].items() if m.get("threshold") is not None)
        a = e["acceptance"]
        eff = "-" if e["mean_efficiency"] is None else f"{e['mean_efficiency']:.3f}"
        lines.append(f"| {e['seed']} | {len(a['refused'] or [])} / {a['sites']} | {e['pooled_sensitivity']:.3f} "
                     f"({e['pooled_tp']}/{e['pooled_positives']}) | {eff} ({e['n_efficiency_counted']}) | "
                     f"{ok} / {e['n_models']} | {per} | {a['oof_seconds']:.0f} | {e['wall_time_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("compare", help="a comparison folder (SEED/ohfl runs evaluated on the tuning part)")
    ap.add_argument("--out", default="studies/site_operating_point")
    ap.add_argument("--table", action="store_true", help="print the markdown table of the JSON files in --out")
    args = ap.parse_args(argv)
    if args.table:
        print(table(Path(args.out)))
        return 0
    for run in sorted(Path(args.compare).glob("seed*/ohfl")):
        if not (run / "metrics.json").is_file() or not (run / "external" / NAME / "summary.json").is_file():
            continue
        e = endpoints(run)
        seed = int(run.parent.name.removeprefix("seed"))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"tuning_seed{seed}.json").write_text(json.dumps(e, indent=1))
        ms = e["models"].values()
        print(f"seed {seed}: refused {len(e['acceptance']['refused'] or [])}/{e['acceptance']['sites']}, pooled sens "
              f"{e['pooled_sensitivity']:.3f}, mean efficiency {e['mean_efficiency']}, per model sens/spec "
              + ", ".join(f"{m['sensitivity']['value']:.3f}/{m['specificity']['value']:.3f}" for m in ms
                          if m.get("threshold") is not None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
