"""Simulation with a known answer: how the per-model operating point rules of
:mod:`hfl_components.operating_point` transfer from a site's acceptance scores to new images.

Each replicate is one "seed" of 6 sites. Site i's model scores are binormal in logit space: NORMAL ~ N(0, 1),
PNEUMONIA ~ N(d_i, s_i) with d_i ~ U(d_lo, d_hi) and s_i ~ U(0.8, 1.25) (unequal variances). The acceptance scores
(out-of-fold + validation) are ``n_pos`` / ``n_neg`` draws from a version of the model whose logits are scaled by
c_i ~ U(1 - mis, 1 + mis) (fold models are not the deployed model); the new images (the tuning part's size, 501 /
234) come from the deployed model, optionally shifted by ``shift`` logits (another acquisition). Per model we record
sensitivity, specificity and operating-point efficiency on the new images, and the acceptance outcome on the
acceptance scores. Usage: ``python -m studies.site_operating_point.simulate [--reps 200] [--seed 0] ...``.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from hfl_components import operating_point as opm

RULES = ("target_only", "target_and_floor", "target_floor_shrunk")


def one_seed(rng, n_pos, n_neg, d_range, mis, shift, n_new=(501, 234), sites=6, calibrate=False):
    models = []
    for _ in range(sites):
        d, s, c = rng.uniform(*d_range), rng.uniform(0.8, 1.25), rng.uniform(1 - mis, 1 + mis)
        npos_i = max(3, int(round(n_pos * rng.uniform(0.6, 1.4))))
        nneg_i = max(3, int(round(n_neg * rng.uniform(0.6, 1.4))))
        acc = np.r_[c * rng.normal(d, s, npos_i), c * rng.normal(0, 1, nneg_i)]
        ya = np.r_[np.ones(npos_i, int), np.zeros(nneg_i, int)]
        new = np.r_[rng.normal(d, s, n_new[0]), rng.normal(0, 1, n_new[1])] + shift
        yn = np.r_[np.ones(n_new[0], int), np.zeros(n_new[1], int)]
        models.append((opm._sigmoid(acc), ya, opm._sigmoid(new), yn))
    out = {r: [] for r in RULES}
    ops = [opm.site_operating_point(pa, ya, calibrate_scores=calibrate) for pa, ya, _, _ in models]
    fed = opm.federation_estimate({str(i): op["estimate"] for i, op in enumerate(ops)})
    for (pa, ya, pn, yn), op in zip(models, ops):
        pc_new = opm.calibrate(np.stack([1 - pn, pn], 1), op)[:, 1]
        pc_acc = opm.calibrate(np.stack([1 - pa, pa], 1), op)[:, 1]
        t_only = opm.choose_threshold(pc_acc, ya, floor=0.0)["threshold"]
        shr = opm.apply_federation(op, pa, ya, fed)
        for rule, t, acc in (("target_only", t_only, opm.acceptance_check(pc_acc, ya, t_only)),
                             ("target_and_floor", op["threshold"], op["acceptance"]),
                             ("target_floor_shrunk", shr["threshold"], shr["acceptance"])):
            e = opm.operating_point_efficiency(pc_new, yn, t)
            out[rule].append({"sens": e["sensitivity"], "spec": e["specificity"], "eff": e["efficiency"],
                              "accepted": acc["accepted"], "n_tp": int((pc_new[yn == 1] >= t).sum())})
    return out


def summarise(reps_out):
    res = {}
    for rule in RULES:
        seeds = [r[rule] for r in reps_out]
        pooled = [sum(m["n_tp"] for m in s) / (501 * len(s)) for s in seeds]
        refused = [sum(not m["accepted"] for m in s) for s in seeds]
        eff = [np.mean([m["eff"] for m in s if m["eff"] is not None] or [np.nan]) for s in seeds]
        deployed_ok = [all(m["sens"] >= 0.90 and m["spec"] >= 0.50 for m in s if m["accepted"]) for s in seeds]
        res[rule] = {"pooled_sens_mean": float(np.mean(pooled)), "P(pooled_sens>=0.95)": float(np.mean(
            np.array(pooled) >= 0.95)), "refused_mean": float(np.mean(refused)),
            "P(refused<=1)": float(np.mean(np.array(refused) <= 1)), "mean_eff": float(np.nanmean(eff)),
            "P(mean_eff>=0.93)": float(np.mean(np.array(eff) >= 0.93)),
            "P(every deployed sens>=.90 & spec>=.50)": float(np.mean(deployed_ok)),
            "share of models counted for efficiency": float(np.mean([m["eff"] is not None for s in seeds
                                                                       for m in s]))}
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-pos", type=int, default=78)
    ap.add_argument("--n-neg", type=int, default=49)
    ap.add_argument("--d-range", type=float, nargs=2, default=(2.0, 3.2))
    ap.add_argument("--mis", type=float, default=0.2)
    ap.add_argument("--shift", type=float, default=0.0)
    ap.add_argument("--calibrate", action="store_true")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    reps = [one_seed(rng, a.n_pos, a.n_neg, tuple(a.d_range), a.mis, a.shift, calibrate=a.calibrate)
            for _ in range(a.reps)]
    print(json.dumps({"settings": vars(a), "results": summarise(reps)}, indent=1))


if __name__ == "__main__":
    main()
