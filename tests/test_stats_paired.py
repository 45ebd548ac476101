"""Paired comparisons of hfl_components.stats: hand-computed differences, the reporting rule (seeds, margins,
verdicts, endpoints), and the resampling scheme (seeds as clusters; one image draw shared where images are shared).
Every case builds its own data (no ../shared/data)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as st

from hfl_components.stats import (MARGINS, MIN_SEEDS, WeightedAUC, endpoint_label, paired_cell, paired_crossed,
                                  paired_nested, paired_summaries, seed_mean_interval, verdict, verdict_cell)

Y4 = np.array([0, 0, 1, 1])


def test_hand_computed_differences():
    a = np.array([[[0.1, 0.2, 0.8, 0.9]]])  # AUC 1, predicts [0,0,1,1]: balanced accuracy 1
    b = np.array([[[0.1, 0.8, 0.2, 0.9]]])  # pairs (neg, pos): (.1,.2) (.1,.9) (.8,.9) right, (.8,.2) wrong: AUC 3/4
    d = paired_crossed(Y4, a, b, "auc", n_boot=0)
    assert (d["a"], d["b"], d["diff"]) == pytest.approx((1.0, 0.75, 0.25))
    assert d["ci_low"] is None and d["verdict"] is None and d["n_pairs"] == 1 and not d["reliable"]
    d = paired_crossed(Y4, a, b, "balanced_accuracy", n_boot=0)
    assert (d["a"], d["b"], d["diff"]) == pytest.approx((1.0, 0.5, 0.5))  # b predicts [0,1,0,1]: TPR 1/2, TNR 1/2
    # two seeds x two sites: the mean over the four pairs
    a2 = np.stack([np.concatenate([a[0], b[0]])] * 2)  # per seed: site 1 = a, site 2 = b
    b2 = np.stack([np.concatenate([b[0], b[0]])] * 2)
    d = paired_crossed(Y4, a2, b2, "auc", n_boot=0, seeds=[7, 9])
    assert d["n_pairs"] == 4 and d["diff"] == pytest.approx(0.125) and d["per_seed"] == {"7": 0.125, "9": 0.125}


def test_identical_methods_give_a_zero_interval_and_not_worse_from_five_seeds():
    rng = np.random.default_rng(1)
    y = np.repeat([0, 1], 30)
    for S, want in ((3, None), (MIN_SEEDS, "not worse")):
        s = rng.random((S, 2, 60))
        for metric in ("auc", "balanced_accuracy"):
            d = paired_crossed(y, s, s.copy(), metric, n_boot=50)
            assert d["diff"] == 0 and d["ci_low"] == 0 and d["ci_high"] == 0 and d["t_low"] == 0
            assert d["verdict"] == want and d["reliable"] is (S >= MIN_SEEDS)


def test_known_positive_shift_is_better_and_its_mirror_worse():
    rng = np.random.default_rng(2)
    y = np.repeat([0, 1], 50)
    good = np.where(y == 1, 0.9, 0.1) + rng.normal(0, 0.02, (5, 2, 100))  # separates perfectly
    poor = 0.5 + 0.3 * (y - 0.5) + rng.normal(0, 0.5, (5, 2, 100))  # weak signal
    d = paired_crossed(y, good, poor, "auc", n_boot=200)
    assert d["a"] == pytest.approx(1.0) and d["ci_low"] > 0 and d["verdict"] == "better" and d["superior"]
    assert paired_cell(d) == (f"{d['diff']:+.3f} (95% CI {d['ci_low']:+.3f} to {d['ci_high']:+.3f}; these images: "
                              f"seed t {d['t_low']:+.3f} to {d['t_high']:+.3f})")
    assert paired_crossed(y, poor, good, "auc", n_boot=200)["verdict"] == "worse"
    assert paired_crossed(y, good, poor, "balanced_accuracy", n_boot=200)["verdict"] == "better"


def test_interval_covers_the_true_difference_of_a_simulated_case():
    """Binormal scores: class-1 scores shifted by mu, unit variance per class (shared image effect + model noise),
    so AUC = Phi(mu / sqrt(2)). A: mu 1.2, B: mu 0.8; true difference Phi(.849) - Phi(.566) = 0.0842."""
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    true = phi(1.2 / math.sqrt(2)) - phi(0.8 / math.sqrt(2))
    rng = np.random.default_rng(3)
    y = np.repeat([0, 1], 400)
    common = rng.normal(0, math.sqrt(0.5), y.size)  # the image's own difficulty, shared by every model

    def scores(mu):
        return mu * y + common + rng.normal(0, math.sqrt(0.5), (5, 2, y.size))
    d = paired_crossed(y, scores(1.2), scores(0.8), "auc", n_boot=300, seed=0)
    assert d["ci_low"] < true < d["ci_high"]
    assert d["ci_high"] - d["ci_low"] < 0.1 and d["verdict"] == "better"


def test_verdict_rule_with_a_margin_and_bad_input():
    assert verdict(0.01, 0.2, 0.02) == "better" and verdict(-0.2, -0.01) == "worse"
    assert verdict(-0.01, 0.1, 0.02) == "not worse" and verdict(-0.03, 0.1, 0.02) == "inconclusive"
    assert verdict(-0.015, -0.001, 0.02) == "worse, within the margin" and verdict(-0.1, -0.03, 0.02) == "worse"
    assert verdict(-0.1, 0.1) == "inconclusive" and verdict(0.0, 0.1) == "inconclusive"
    assert verdict(None, 0.1) is None and verdict(float("nan"), 0.1) is None
    assert MARGINS["auc"] == 0.02 and MARGINS["balanced_accuracy"] == 0.03
    assert endpoint_label(True) == "primary" and endpoint_label(False) == "exploratory"
    with pytest.raises(ValueError, match="seeds, sites"):
        paired_crossed(Y4, np.zeros((1, 1, 4)), np.zeros((1, 2, 4)))
    with pytest.raises(ValueError, match="both classes"):
        paired_crossed(np.zeros(4), np.zeros((1, 1, 4)), np.zeros((1, 1, 4)))
    with pytest.raises(ValueError, match="unknown paired metric"):
        paired_crossed(Y4, np.zeros((1, 1, 4)), np.zeros((1, 1, 4)), "f1", n_boot=0)
    with pytest.raises(ValueError, match="no .seed, site. pairs"):
        paired_nested([], "auc")


def test_summaries_seed_t_interval_by_hand_and_the_fewer_than_five_seeds_rule():
    """Five seeds with two sites each: the per-seed mean differences are 0.1, 0.2, 0.0, 0.3, 0.15; the interval is
    their Student-t interval (df 4), not one over the ten (seed, site) values."""
    per = [0.1, 0.2, 0.0, 0.3, 0.15]
    a = {(s, k): 0.5 + per[s] + (0.05 if k else -0.05) for s in range(5) for k in range(2)}
    b = {(s, k): 0.5 for s in range(5) for k in range(2)}
    d = paired_summaries(a, b, "balanced_accuracy")
    half = st.t.ppf(0.975, 4) * np.std(per, ddof=1) / math.sqrt(5)
    assert d["diff"] == pytest.approx(0.15) and d["n_pairs"] == 10 and d["interval"] == "seed t"
    assert (d["ci_low"], d["ci_high"]) == pytest.approx((0.15 - half, 0.15 + half))
    assert d["verdict"] == "better" and d["margin"] == MARGINS["balanced_accuracy"]
    assert "95% CI" in paired_cell(d) and verdict_cell(d) == "better"
    three = paired_summaries({k: v for k, v in a.items() if k[0] < 3}, b, "balanced_accuracy")
    assert three["verdict"] is None and not three["reliable"] and three["per_seed"] == pytest.approx(
        {"0": 0.1, "1": 0.2, "2": 0.0})
    assert paired_cell(three) == "+0.100; per seed +0.100 / +0.200 / +0.000 (3 seed(s): no reliable interval)"
    assert verdict_cell(three) == "no verdict (3 seed(s) < 5)"
    assert paired_summaries(a, {}, "auc")["diff"] is None
    m = seed_mean_interval(a)
    assert m["mean"] == pytest.approx(0.65) and m["ci_low"] == pytest.approx(0.65 - half)
    assert seed_mean_interval({k: v for k, v in a.items() if k[0] < 2})["ci_low"] is None


def _seed_dominated_crossed(S=5, N=2000, seed=0):
    """Seed s: A is perfect, B wrong on a fraction f_s of each class (f_s spread over seeds, the same two sites):
    the seed-to-seed spread of the difference dwarfs what resampling 2,000 images can move."""
    rng = np.random.default_rng(seed)
    y = np.repeat([0, 1], N // 2)
    fs = np.linspace(0.05, 0.45, S)
    A = np.broadcast_to(np.where(y == 1, 0.9, 0.1), (S, 2, N)).copy()
    B = A.copy()
    for s, f in enumerate(fs):
        for k in range(2):
            wrong = rng.random(N) < f
            B[s, k, wrong] = 1 - B[s, k, wrong]
    return y, A, B


def test_crossed_cluster_interval_carries_the_seed_spread():
    """Seeds are resampled: the cluster interval is about as wide as the seed-level t-interval. Without the seed draw
    (images only) it would be a tenth of that."""
    y, A, B = _seed_dominated_crossed()
    d = paired_crossed(y, A, B, "balanced_accuracy", n_boot=400, seed=1)
    ratio = (d["ci_high"] - d["ci_low"]) / (d["t_high"] - d["t_low"])
    assert 0.8 < ratio < 1.5, ratio
    assert d["ci_low"] < 0.1 and d["ci_high"] > 0.4  # per-seed differences 0.05 .. 0.45, mean 0.25


def test_nested_cluster_interval_carries_the_seed_spread():
    """The same with every (seed, site) scored on its own images (one pool each): seed multiplicities weight the
    replicates. No pool spans seeds, so the image noise is inside the per-seed values and the verdict interval is the
    seed-level t-interval; the cluster interval is kept beside it."""
    y, A, B = _seed_dominated_crossed(seed=2)
    pairs = [{"seed": s, "site": k, "pool": f"{s}/{k}", "ids": np.arange(y.size), "y": y,
              "pa": np.stack([1 - A[s, k], A[s, k]], 1), "pb": np.stack([1 - B[s, k], B[s, k]], 1)}
             for s in range(A.shape[0]) for k in range(2)]
    d = paired_nested(pairs, "balanced_accuracy", n_boot=300, seed=1)
    assert d["interval"] == "seed t" and (d["ci_low"], d["ci_high"]) == (d["t_low"], d["t_high"])
    ratio = (d["cluster_high"] - d["cluster_low"]) / (d["t_high"] - d["t_low"])
    assert 0.8 < ratio < 1.5, ratio
    assert d["n_pairs"] == 10 and d["n_seeds"] == 5
    assert d["diff"] == pytest.approx(np.mean(list(d["per_seed"].values())))


def _anti_correlated_sites(S=5, N=40, seed=0):
    """Two sites scoring the same images: at site 1 A is right everywhere and B only on a set X of images; at site 2
    A is right only on X and B everywhere. Under one shared image draw the two sites' differences cancel exactly
    (d1(w) = -d2(w)), so with identical seeds every replicate is 0; independent draws per site would not cancel."""
    rng = np.random.default_rng(seed)
    y = np.repeat([0, 1], N // 2)
    right = np.eye(2)[y] * 0.8 + 0.1
    wrong = right[:, ::-1]
    X = rng.random(N) < 0.5
    partial = np.where(X[:, None], right, wrong)
    return y, {(s, "site-1"): (right, partial) for s in range(S)} | {(s, "site-2"): (partial, right)
                                                                     for s in range(S)}


def test_shared_external_images_are_drawn_once_for_every_site():
    y, preds = _anti_correlated_sites()
    pairs = [{"seed": s, "site": k, "pool": "ext", "ids": np.arange(y.size), "y": y, "pa": pa, "pb": pb}
             for (s, k), (pa, pb) in preds.items()]
    d = paired_nested(pairs, "balanced_accuracy", n_boot=200)
    assert d["diff"] == pytest.approx(0.0) and d["ci_low"] == pytest.approx(0.0, abs=1e-12)
    assert d["ci_high"] == pytest.approx(0.0, abs=1e-12)
    assert d["interval"] == "cluster bootstrap-t"  # the pool spans seeds
    own = paired_nested([dict(q, pool=(q["seed"], q["site"])) for q in pairs], "balanced_accuracy", n_boot=200)
    assert own["cluster_high"] - own["cluster_low"] > 0.01  # separate pools: the cancellation is lost


def test_proto_external_part_is_one_pool_shared_by_every_site_and_seed():
    """proto_eval.paired scores every site's external images as ids into the one evaluation part."""
    from studies.prototype_methods.proto_eval import paired

    y, preds = _anti_correlated_sites(seed=3)
    ids = np.arange(y.size)
    res = {m: {"external": {key: {"ids": ids, "y": y, "probs": p[j]} for key, p in preds.items()}}
           for j, m in enumerate(("a", "b"))}
    d = paired(res, "a", "b", "external", "balanced_accuracy", n_boot=200)
    assert d["n_seeds"] == 5 and d["n_pairs"] == 10 and d["interval"] == "cluster bootstrap-t"
    assert d["ci_low"] == pytest.approx(0.0, abs=1e-12) and d["ci_high"] == pytest.approx(0.0, abs=1e-12)


def test_vectorised_weighted_auc_equals_scikit_learn_with_ties():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(4)
    y = rng.integers(0, 2, 120)
    s = np.round(rng.random((5, 120)), 1)  # many ties
    s[0] = 1.0  # every score tied: AUC 1/2
    fast = WeightedAUC(y, s)
    for w in (np.ones(120), rng.integers(0, 4, 120).astype(float)):
        want = [roc_auc_score(y, row, sample_weight=w) for row in s]
        assert fast(w) == pytest.approx(want, abs=1e-12)
    assert fast(np.ones(120))[0] == pytest.approx(0.5)


# ------------------------------------------------------------------------------------------- half-width by hand
def test_cluster_interval_half_width_by_hand():
    """Five seeds, four replicates 0.10, 0.20, 0.30, 0.60 of the estimate 0.25. By hand: their mean is 0.30, their
    squared deviations 0.04, 0.01, 0, 0.09 sum to 0.14, so sd (ddof 1) = sqrt(0.14 / 3); the plug-in bootstrap
    variance of a mean of S seeds is (S - 1) / S times the unbiased one, undone by sqrt(S / (S - 1)) = sqrt(5 / 4);
    t(0.975, 4) = 2.7764451051977987 (Student t, 4 df). Half-width = t * sqrt(0.14 / 3) * sqrt(5 / 4)."""
    from hfl_components.stats import cluster_t_interval

    t975_4 = 2.7764451051977987
    assert st.t.ppf(0.975, 4) == pytest.approx(t975_4, abs=1e-12)  # the tabulated quantile
    half = t975_4 * math.sqrt(0.14 / 3) * math.sqrt(5 / 4)
    lo, hi = cluster_t_interval(0.25, np.array([0.10, 0.20, 0.30, 0.60]), 5)
    assert float(hi) - 0.25 == pytest.approx(half, abs=1e-9) and 0.25 - float(lo) == pytest.approx(half, abs=1e-9)
    # two seeds: the rescale is sqrt(2), t(0.975, 1) = 12.706204736174698
    lo, hi = cluster_t_interval(0.0, np.array([-0.5, 0.5]), 2)
    assert float(hi) == pytest.approx(12.706204736174698 * math.sqrt(0.5) * math.sqrt(2), abs=1e-9)
    assert float(lo) == pytest.approx(-float(hi), abs=1e-12)


def test_crossed_cluster_half_width_equals_the_seed_t_half_width_when_images_do_not_matter():
    """Every model separates the classes perfectly, A the right way round and B, at some sites, the wrong way: the
    AUC of every (seed, site) model is exactly 1 or 0 under any class-stratified image draw, so the per-seed
    differences d_s (the share of the seed's sites where B is reversed) are fixed and only the seed draw moves a
    replicate. The cluster bootstrap's replicates then have variance (S - 1) / S * var(d) / S (Davison & Hinkley 1997,
    Sec. 2.3); rescaled by sqrt(S / (S - 1)) the half-width is t(0.975, S - 1) * sd(d) / sqrt(S), the seed-level
    t half-width, computed here by hand from d. Without the rescale it is sqrt(3 / 4) = 0.87 of that at S = 4;
    with 4,000 replicates the Monte Carlo error of the bootstrap sd is about 1 %."""
    S, K = 4, 4
    y = np.repeat([0, 1], 6)
    right = np.where(y == 1, 0.8, 0.2)
    a = np.broadcast_to(right, (S, K, y.size)).copy()
    b = a.copy()
    reversed_sites = [0, 1, 2, 4]  # seed s: B reversed at that many of its 4 sites -> d = 0, 0.25, 0.5, 1
    for s, n in enumerate(reversed_sites):
        b[s, :n] = 1.0 - right
    d_seed = np.array(reversed_sites) / K
    half_by_hand = st.t.ppf(0.975, S - 1) * np.std(d_seed, ddof=1) / math.sqrt(S)
    res = paired_crossed(y, a, b, "auc", n_boot=4000, seed=5)
    assert res["diff"] == pytest.approx(d_seed.mean(), abs=1e-12)
    half = 0.5 * (res["cluster_high"] - res["cluster_low"])
    assert half == pytest.approx(half_by_hand, rel=0.04), (half, half_by_hand)
    assert res["ci_high"] - res["diff"] == pytest.approx(half, abs=1e-12)  # the verdict interval is this one
