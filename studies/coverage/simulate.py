"""False-verdict rate of the product's verdict interval in null studies shaped like a confirmatory protocol.

Each simulated study is one run of the primary comparison: method A (site models: S seeds x K sites, one model per
site) against a one-model comparator B (FedAvg: one global model per seed, deployed unchanged at every site), every
model scoring the same N external images (the crossed design), endpoint AUC, interval the crossed cluster bootstrap-t
of :func:`hfl_components.stats.paired_crossed` (seeds resampled as clusters, one class-stratified image draw per
replicate shared by every seed and site, 1,000 replicates, fresh draws in every study).

Scores (binormal, per-class variance 1): model m scores image i as

    s = delta_m * y_i + rho * c_i + tau * u_i^(method) + sigma * e_(m, i)

with c_i an image difficulty shared by every model, u_i an image effect of the method shared by all its models and
seeds (one method better on some images: the part of the image noise that seeds do not average away) and e the
model's own noise. A model's separation is delta = delta_0 + a_s + b with a heavy-tailed seed effect a_s
(Student t, 3 df, scaled to sd ``sd_seed``; drawn separately for A and B) and a site effect b ~ N(0, sd_site) (A:
one per site; B: one for its single model). A site model of A and the model of B then have the same distribution of
population AUC Phi(delta / sqrt 2), and the Mann-Whitney AUC is unbiased for it, so the true difference over new
seeds and new images is exactly 0: any "better" or "worse" verdict is false.

The bootstrap is the product's, computed faster: a replicate's per-seed difference mean_k AUC(A[s, k]) - AUC(B[s])
is one bilinear form w_pos' M_s w_neg / (n_pos n_neg) in the replicate's image counts (M_s: the seed's comparison
matrices of positives against negatives, averaged over its sites, minus B's), so one matrix product per study
replaces 2 S K weighted AUCs per replicate. The seed and image draws are the product's own
(:func:`~hfl_components.stats.draw_seed_counts`, :func:`~hfl_components.stats.draw_image_counts`, in
:func:`~hfl_components.stats.paired_crossed`'s order and seeding), and so are the seed combination and the interval
(:func:`~hfl_components.stats.combine_seeds`, :func:`~hfl_components.stats.cluster_t_interval`,
:func:`~hfl_components.stats.verdict`); the first studies are also run through ``paired_crossed`` itself and must
agree to 1e-9.

    python -m studies.coverage.simulate --out studies/coverage/result.json
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
from scipy import stats as st

from hfl_components.stats import (MARGINS, cluster_t_interval, combine_seeds, draw_image_counts, draw_seed_counts,
                                  paired_crossed, seed_t_interval, verdict)

# the product's shape: a confirmatory protocol's primary comparison
SETTING = {
    "seeds": 10,             # S, protocol 3's seeds
    "sites": 6,              # K, --sites 6
    "n_negative": 550,       # the evaluation part's 1,715 images at chest_xray_224's class ratio (883 : 1,887)
    "n_positive": 1165,
    "n_boot": 1000,          # the protocols' replicates
    "alpha": 0.05,
    # score model (per-class variance rho^2 + tau^2 + sigma^2 = 1)
    "delta0": 2.563,         # population AUC Phi(2.563 / sqrt 2) = 0.965, about the deployed models' AUC
    "rho": 0.7071,           # shared image difficulty (rho^2 = 0.5)
    "tau": 0.4472,           # method-specific image effect (tau^2 = 0.2)
    "sigma": 0.5477,         # the model's own noise (sigma^2 = 0.3)
    "sd_seed": 0.144,        # seed effect on delta, heavy-tailed (t, 3 df)
    "seed_df": 3,
    "sd_site": 0.15,         # site effect on delta (A's sites; B's single model)
}
# with these, a seed's difference has sd about 0.26 in delta, i.e. about 0.014 AUC (protocols 2-3: 0.012-0.016)


def draw_study(rng: np.random.Generator, p: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One null study: labels y (N,) (negatives first), scores of A (S, K, N) and of B (S, N)."""
    S, K = p["seeds"], p["sites"]
    y = np.r_[np.zeros(p["n_negative"], np.int64), np.ones(p["n_positive"], np.int64)]
    N = y.size
    c = rng.normal(size=N)
    u_a, u_b = rng.normal(size=N), rng.normal(size=N)

    def seed_effect(shape):
        return p["sd_seed"] * rng.standard_t(p["seed_df"], shape) / np.sqrt(p["seed_df"] / (p["seed_df"] - 2))
    d_a = p["delta0"] + seed_effect((S, 1)) + rng.normal(0, p["sd_site"], (S, K))
    d_b = p["delta0"] + seed_effect((S,)) + rng.normal(0, p["sd_site"], S)
    base = p["rho"] * c
    a = d_a[..., None] * y + base + p["tau"] * u_a + p["sigma"] * rng.normal(size=(S, K, N))
    b = d_b[:, None] * y + base + p["tau"] * u_b + p["sigma"] * rng.normal(size=(S, N))
    return y, a, b


def _comparison(sp: np.ndarray, sn: np.ndarray) -> np.ndarray:
    """2 x the Mann-Whitney kernel of one model, (P, Q) integers in {0, 1, 2}: 2 where the positive scores higher,
    1 for a tie."""
    return (sp[:, None] > sn[None, :]).astype(np.float32) * 2 + (sp[:, None] == sn[None, :])


def crossed_interval(y, a, b, n_boot: int, seed: int, alpha: float = 0.05) -> dict:
    """What ``paired_crossed(y, a, b repeated over the sites, "auc", n_boot, seed, alpha)`` returns for the interval
    (``diff, ci_low, ci_high, t_low, t_high``), computed through the bilinear form of the module docstring."""
    S, K, N = a.shape
    pos, neg = y == 1, y == 0
    P, Q = int(pos.sum()), int(neg.sum())
    # 2K * (mean_k kernel_A - kernel_B) per seed: integers, exact in float32 products below
    mats = np.empty((S, P, Q), np.float32)
    for s in range(S):
        m = sum(_comparison(a[s, k, pos], a[s, k, neg]) for k in range(K))
        mats[s] = m - K * _comparison(b[s, pos], b[s, neg])
    scale = 2.0 * K * P * Q
    d_point = mats.sum(axis=(1, 2), dtype=np.float64) / scale  # (S,) per-seed differences, every image once
    rng = np.random.default_rng(seed)  # paired_crossed's draws, in its order
    m_counts = draw_seed_counts(rng, n_boot, S)
    w = draw_image_counts(rng, n_boot, y)
    wp, wn = w[:, pos].astype(np.float32), w[:, neg]
    left = (wp @ mats.transpose(1, 0, 2).reshape(P, S * Q)).reshape(n_boot, S, Q)  # exact: integer sums < 2^24
    d_reps = np.einsum("rsq,rq->rs", left.astype(np.float64), wn) / scale  # (R, S)
    reps = combine_seeds(d_reps, m_counts)
    diff, t_lo, t_hi = seed_t_interval(d_point, alpha)
    lo, hi = cluster_t_interval(diff, reps, S, alpha)
    return {"diff": float(diff), "ci_low": float(lo), "ci_high": float(hi), "t_low": float(t_lo),
            "t_high": float(t_hi), "seed_sd": float(np.std(d_point, ddof=1))}


def check_against_product(y, a, b, n_boot: int, seed: int, alpha: float) -> float:
    """Largest absolute difference between :func:`crossed_interval` and ``paired_crossed`` on one study."""
    S, K, N = a.shape
    ref = paired_crossed(y, a, np.repeat(b[:, None], K, axis=1), "auc", n_boot=n_boot, seed=seed, alpha=alpha)
    mine = crossed_interval(y, a, b, n_boot, seed, alpha)
    return max(abs(ref[k] - mine[k]) for k in ("diff", "ci_low", "ci_high", "t_low", "t_high"))


def rate(k: int, n: int) -> dict:
    """A share with its exact (Clopper-Pearson) 95 % Monte Carlo interval (``scipy.stats.binomtest``)."""
    ci = st.binomtest(int(k), int(n)).proportion_ci(0.95, method="exact")
    return {"count": int(k), "n": int(n), "rate": k / n, "ci_low": float(ci.low), "ci_high": float(ci.high)}


def run(studies: int, base_seed: int, n_check: int, setting: dict, log=print) -> dict:
    p = dict(setting)
    data_seeds = np.random.SeedSequence(base_seed).spawn(studies)
    rows, worst, t0 = [], 0.0, time.process_time()
    for j in range(studies):
        y, a, b = draw_study(np.random.default_rng(data_seeds[j]), p)
        boot_seed = base_seed * 100_000 + j  # fresh bootstrap draws in every study
        if j < n_check:
            worst = max(worst, check_against_product(y, a, b, p["n_boot"], boot_seed, p["alpha"]))
        r = crossed_interval(y, a, b, p["n_boot"], boot_seed, p["alpha"])
        r["verdict"] = verdict(r["ci_low"], r["ci_high"])
        r["verdict_auc_margin"] = verdict(r["ci_low"], r["ci_high"], MARGINS["auc"])
        rows.append(r)
        if log and (j + 1) % 100 == 0:
            log(f"{j + 1}/{studies} studies, {time.process_time() - t0:.0f} s CPU")
    cpu = time.process_time() - t0
    v = [r["verdict"] for r in rows]
    n = len(rows)
    false = sum(x in ("better", "worse") for x in v)
    seed_t_false = sum(r["t_low"] > 0 or r["t_high"] < 0 for r in rows)
    half = np.array([(r["ci_high"] - r["ci_low"]) / 2 for r in rows])
    t_half = np.array([(r["t_high"] - r["t_low"]) / 2 for r in rows])
    return {
        "question": "false-verdict rate of the crossed cluster bootstrap-t at nominal 5 % in null studies shaped like "
                    "the product's primary comparison",
        "setting": p, "studies": n, "base_seed": base_seed,
        "truth": 0.0,
        "cluster_bootstrap_t": {
            "false_verdict": rate(false, n),
            "better": rate(sum(x == "better" for x in v), n), "worse": rate(sum(x == "worse" for x in v), n),
            "not_worse_at_auc_margin": rate(sum(r["verdict_auc_margin"] in ("not worse", "worse, within the margin")
                                                for r in rows), n),
            "median_half_width": float(np.median(half))},
        "seed_t_against_0": {"false_verdict": rate(seed_t_false, n), "median_half_width": float(np.median(t_half))},
        "calibration": {"median_per_seed_sd_of_difference": float(np.median([r["seed_sd"] for r in rows])),
                        "sd_of_estimate_over_studies": float(np.std([r["diff"] for r in rows], ddof=1)),
                        "mean_estimate": float(np.mean([r["diff"] for r in rows]))},
        "check_against_paired_crossed": {"studies": n_check, "max_abs_difference": worst},
        "cpu_seconds": round(cpu, 1), "numpy": np.__version__, "python": platform.python_version(),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--studies", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=43)
    ap.add_argument("--check", type=int, default=2, help="studies also run through paired_crossed itself")
    ap.add_argument("--seeds", type=int, default=SETTING["seeds"], help="S, seeds per study")
    ap.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    args = ap.parse_args(argv)
    res = run(args.studies, args.seed, args.check, {**SETTING, "seeds": args.seeds})
    if res["check_against_paired_crossed"]["max_abs_difference"] > 1e-9:
        raise SystemExit(f"the fast path disagrees with paired_crossed by "
                         f"{res['check_against_paired_crossed']['max_abs_difference']:.2e}")
    text = json.dumps(res, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
