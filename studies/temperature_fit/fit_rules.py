"""Temperature-fit rules for the federated operating point, compared on the `tuning` part (see RESULTS.md here).

For every seed of a finished ``cxr-hfl compare`` folder (``RUNS/seed<k>/ohfl`` and ``RUNS/seed<k>/partition``):
re-score each deployed model on its site's validation split (the product's eval path), fit T under each rule,
build the sites' coarse histograms, pool them into one threshold exactly as the server does
(:func:`hfl_components.operating_point.site_report` steps and :func:`federated_operating_point`), and score every
deployed model at that threshold on the run's stored `tuning`-part predictions
(``ohfl/external/chest_xray_224-tuning/predictions.npz``). Never reads the `evaluation` part.

Usage: python -m studies.temperature_fit.fit_rules RUNS --out results.json [--cache DIR] [--seeds 0,1,2]
(--cache: where the validation scores of the site images are kept between runs; outside the repository.)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from hfl_components import operating_point as opm

EXTERNAL = "chest_xray_224-tuning"
BOUNDS = (0.05, 20.0)
RULES = {"mle": None, "map_s1": 1.0, "map_s05": 0.5, "none": "T=1"}  # value: prior sd of log T
CANDIDATES = ("map_s1", "map_s05")  # in the decision rule's tie order (s = 1 first)


def fit_map_temperature(probs, y, prior_sd: float, bounds: tuple[float, float] = BOUNDS) -> float:
    """MAP temperature under log T ~ Normal(0, prior_sd^2): minimise the summed negative log-likelihood of
    ``apply_temperature(probs, T)`` plus (log T)^2 / (2 prior_sd^2), bounded search over log T (the study's own
    copy, so that it runs on code without the product option)."""
    from scipy.optimize import minimize_scalar

    y = np.asarray(y).astype(int)
    lp = np.log(np.clip(np.asarray(probs, np.float64), 1e-12, 1.0))
    if y.size == 0:
        return 1.0

    def obj(logt):
        z = lp / np.exp(logt)
        z = z - z.max(axis=1, keepdims=True)
        nll = -(z[np.arange(y.size), y] - np.log(np.exp(z).sum(axis=1))).sum()
        return float(nll + logt ** 2 / (2.0 * prior_sd ** 2))

    r = minimize_scalar(obj, bounds=(np.log(bounds[0]), np.log(bounds[1])), method="bounded",
                        options={"xatol": 1e-4})
    return float(np.exp(r.x))


def fit(rule: str, pb: np.ndarray, y: np.ndarray) -> float:
    if rule == "none":
        return 1.0
    if rule == "mle":
        return opm.fit_temperature(pb, y, BOUNDS)
    return fit_map_temperature(pb, y, RULES[rule], BOUNDS)


def validation_scores(run: Path, part: Path) -> dict:
    """{site: {"probs": (N, 2), "y": (N,), "header_temperature"}} of each deployed model on its validation split,
    through the product's eval path (make_site_dataset in eval mode at the model's size and aspect, predict_proba)."""
    import torch

    from chest_xray import make_site_dataset, read_site_manifest
    from hfl_components.models import load_model_file
    from hfl_components.training import predict_proba
    from nvflare_jobs.evaluation import model_aspect

    torch.set_num_threads(1)
    out = {}
    for f in sorted((run / "models").glob("*_deployed.pt")):
        site = f.name.removesuffix("_deployed.pt")
        model, header = load_model_file(f)
        rows = [r for r in read_site_manifest(part / "sites" / f"{site}.csv") if r["split"] == "val"]
        ds = make_site_dataset(rows, int(header.get("input_size") or 64), "eval", aspect=model_aspect(header, run))
        loader = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=False, num_workers=0)
        p, y = predict_proba(model, loader, device=torch.device("cpu"))
        out[site] = {"probs": p.tolist(), "y": y.astype(int).tolist(),
                     "header_temperature": (header.get("operating_point") or {}).get("temperature")}
    return out


def load_external(run: Path) -> tuple[np.ndarray, dict]:
    """Labels (N,) and each deployed model's stored probabilities (N, C) on the tuning part (as the audit reads
    ``predictions.npz``)."""
    npz = run / "external" / EXTERNAL / "predictions.npz"
    with np.load(npz, allow_pickle=False) as z:
        y = np.asarray(z["y"]).astype(int)
        preds = {k.removesuffix("_deployed"): np.asarray(z[k]) for k in z.files if k.endswith("_deployed")}
    return y, preds


def _binary(probs) -> np.ndarray:
    p = np.asarray(probs, np.float64)
    return np.stack([p[:, 0], 1.0 - p[:, 0]], axis=1)


def evaluate_rule(rule: str, val: dict, ext_y: np.ndarray, ext: dict) -> dict:
    """One rule at one seed: the sites' reports (T, histogram of calibrated validation p), the pooled threshold,
    and every deployed model's tuning-part rates at it."""
    reports, temps = {}, {}
    for site, v in sorted(val.items()):
        yb = (np.asarray(v["y"]) > 0).astype(int)
        pb = _binary(v["probs"])
        T = fit(rule, pb, yb)
        cal = opm.apply_temperature(pb, T)
        temps[site] = T
        reports[site] = {"temperature": T, "histogram": opm.coarse_histogram(cal[:, 1], yb)}
    op = opm.federated_operating_point(reports, opm.DEFAULT_TARGET_SENSITIVITY)
    thr = None if op is None else op["threshold"]
    models, tp = {}, [0, 0, 0, 0]  # tp, P, tn, N pooled over models
    for site, T in temps.items():
        m = opm.metrics_at_operating_point(ext[site], ext_y, {"temperature": T, "threshold": thr,
                                                              "target": opm.DEFAULT_TARGET_SENSITIVITY}, n_boot=0)
        row = {"temperature": T, "at_bound": bool(T <= BOUNDS[0] * 1.01 or T >= BOUNDS[1] * 0.99),
               "ece_before": m["ece_before"], "ece_after": m["ece_after"],
               "sensitivity": (m.get("sensitivity") or {}).get("value"),
               "specificity": (m.get("specificity") or {}).get("value")}
        models[site] = row
        if thr is not None:
            tp[0] += round(row["sensitivity"] * m["n_positive"])
            tp[1] += m["n_positive"]
            tp[2] += round(row["specificity"] * m["n_negative"])
            tp[3] += m["n_negative"]
    sens = [r["sensitivity"] for r in models.values()]
    spec = [r["specificity"] for r in models.values()]
    return {"threshold": thr, "unresolved": None if op is None else op.get("unresolved"),
            "validation_pooled_sensitivity_lower": None if op is None else op.get("sensitivity"),
            "pooled_sensitivity": tp[0] / tp[1] if tp[1] else None,
            "pooled_specificity": tp[2] / tp[3] if tp[3] else None,
            "n_models_sensitivity_ge_0.90": sum(s is not None and s >= 0.90 for s in sens),
            "n_models_sensitivity_lt_0.90": sum(s is not None and s < 0.90 for s in sens),
            "n_models_specificity_lt_0.25": sum(s is not None and s < 0.25 for s in spec),
            "n_fits_at_bound": sum(r["at_bound"] for r in models.values()),
            "ece_before_mean": float(np.mean([r["ece_before"] for r in models.values()])),
            "ece_after_mean": float(np.mean([r["ece_after"] for r in models.values()])),
            "models": models}


def decide(per_seed: dict) -> dict:
    """The decision rule of RESULTS.md, fixed before the results."""
    out = {}
    for rule in CANDIDATES:
        passes, spec_low_rule, spec_low_mle, n_ok = {}, 0, 0, 0
        for seed, res in per_seed.items():
            a, b = res["rules"][rule], res["rules"]["mle"]
            ok = (a["threshold"] is not None and b["threshold"] is not None
                  and a["n_models_sensitivity_ge_0.90"] > b["n_models_sensitivity_ge_0.90"]
                  and a["pooled_specificity"] >= b["pooled_specificity"] - 0.05)
            passes[seed] = bool(ok)
            spec_low_rule += a["n_models_specificity_lt_0.25"]
            spec_low_mle += b["n_models_specificity_lt_0.25"]
            n_ok += a["n_models_sensitivity_ge_0.90"]
        out[rule] = {"passes": passes, "n_seeds_passing": sum(passes.values()),
                     "models_specificity_lt_0.25_total": spec_low_rule, "mle_models_specificity_lt_0.25_total":
                     spec_low_mle, "models_sensitivity_ge_0.90_total": n_ok,
                     "qualifies": sum(passes.values()) >= 2 and spec_low_rule <= spec_low_mle}
    q = [r for r in CANDIDATES if out[r]["qualifies"]]
    q.sort(key=lambda r: (-out[r]["n_seeds_passing"], -out[r]["models_sensitivity_ge_0.90_total"],
                          CANDIDATES.index(r)))
    out["adopted"] = q[0] if q else "mle"
    return out


def main(argv=None) -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("runs", help="a cxr-hfl compare folder with seed<k>/ohfl and seed<k>/partition")
    a.add_argument("--out", required=True, help="results JSON")
    a.add_argument("--cache", default=None, help="folder for the re-scored validation probabilities")
    a.add_argument("--seeds", default="0,1,2")
    args = a.parse_args(argv)
    runs = Path(args.runs)
    seeds = [int(s) for s in args.seeds.split(",")]
    per_seed = {}
    for seed in seeds:
        run, part = runs / f"seed{seed}" / "ohfl", runs / f"seed{seed}" / "partition"
        if not (run / "external" / EXTERNAL / "predictions.npz").is_file() or not (part / "sites").is_dir():
            print(f"fit_rules: {run}: no {EXTERNAL} predictions or no partition next to it", file=sys.stderr)
            return 2
        cache = Path(args.cache) / f"val_seed{seed}.json" if args.cache else None
        if cache is not None and cache.is_file():
            val = json.loads(cache.read_text())
        else:
            val = validation_scores(run, part)
            if cache is not None:
                cache.parent.mkdir(parents=True, exist_ok=True)
                cache.write_text(json.dumps(val))
        ext_y, ext = load_external(run)
        mle_check = {s: {"header": v["header_temperature"],
                         "refit": opm.fit_temperature(_binary(v["probs"]), (np.asarray(v["y"]) > 0).astype(int))}
                     for s, v in val.items()}
        per_seed[str(seed)] = {
            "n_val": {s: [int((np.asarray(v["y"]) == 0).sum()), int((np.asarray(v["y"]) > 0).sum())]
                      for s, v in val.items()},
            "mle_reproduces_header": all(c["header"] is not None and abs(c["refit"] / c["header"] - 1) < 1e-3
                                         for c in mle_check.values()),
            "mle_check": mle_check,
            "rules": {r: evaluate_rule(r, val, ext_y, ext) for r in RULES}}
        for r, res in per_seed[str(seed)]["rules"].items():
            print(f"seed {seed} {r:8s} t={res['threshold']} sens={res['pooled_sensitivity']} "
                  f"spec={res['pooled_specificity']} n_sens>=.9={res['n_models_sensitivity_ge_0.90']} "
                  f"n_spec<.25={res['n_models_specificity_lt_0.25']} bound={res['n_fits_at_bound']}")
    out = {"data": "chest_xray_224, part tuning (735 images); validation splits of the runs' sites",
           "runs": "cxr-hfl compare, OHFL, chest_xray_original, 6 width sites, 20 local + 10 fine-tuning epochs",
           "bounds": list(BOUNDS), "target_sensitivity": opm.DEFAULT_TARGET_SENSITIVITY,
           "rules": {"mle": "bounded maximum likelihood", "map_s1": "MAP, log T ~ Normal(0, 1)",
                     "map_s05": "MAP, log T ~ Normal(0, 0.5^2)", "none": "T = 1 (reference)"},
           "seeds": per_seed, "decision": decide(per_seed)}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("decision:", out["decision"]["adopted"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
