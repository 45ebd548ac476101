"""Paired method comparison (hfl_components.training.paired): hand-computed differences, verdicts, and a CI that
covers the true difference of a simulated binormal case."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hfl_components.training.paired import paired_bootstrap, verdict

Y4 = np.array([0, 0, 1, 1])


def test_hand_computed_differences():
    a = np.array([[[0.1, 0.2, 0.8, 0.9]]])  # AUC 1, predicts [0,0,1,1]: balanced accuracy 1
    b = np.array([[[0.1, 0.8, 0.2, 0.9]]])  # pairs (neg, pos): (.1,.2) (.1,.9) (.8,.9) right, (.8,.2) wrong: AUC 3/4
    d = paired_bootstrap(Y4, a, b, "auc", n_boot=0)
    assert (d["a"], d["b"], d["diff"]) == pytest.approx((1.0, 0.75, 0.25))
    assert d["ci_low"] is None and d["verdict"] is None and d["n_pairs"] == 1
    d = paired_bootstrap(Y4, a, b, "balanced_accuracy", n_boot=0)
    assert (d["a"], d["b"], d["diff"]) == pytest.approx((1.0, 0.5, 0.5))  # b predicts [0,1,0,1]: TPR 1/2, TNR 1/2
    # two seeds x two sites: the mean over the four pairs
    a2 = np.stack([np.concatenate([a[0], b[0]])] * 2)  # per seed: site 1 = a, site 2 = b
    b2 = np.stack([np.concatenate([b[0], b[0]])] * 2)
    d = paired_bootstrap(Y4, a2, b2, "auc", n_boot=0)
    assert d["n_pairs"] == 4 and d["diff"] == pytest.approx(0.125)


def test_identical_methods_give_no_difference_with_a_zero_interval():
    rng = np.random.default_rng(1)
    y = np.repeat([0, 1], 30)
    s = rng.random((3, 2, 60))
    for metric in ("auc", "balanced_accuracy"):
        d = paired_bootstrap(y, s, s.copy(), metric, n_boot=50)
        assert d["diff"] == 0 and d["ci_low"] == 0 and d["ci_high"] == 0
        assert d["verdict"] == "no difference detected"


def test_known_positive_shift_is_better_and_its_mirror_worse():
    rng = np.random.default_rng(2)
    y = np.repeat([0, 1], 50)
    good = np.where(y == 1, 0.9, 0.1) + rng.normal(0, 0.02, (3, 2, 100))  # separates perfectly
    poor = 0.5 + 0.3 * (y - 0.5) + rng.normal(0, 0.5, (3, 2, 100))  # weak signal
    d = paired_bootstrap(y, good, poor, "auc", n_boot=200)
    assert d["a"] == pytest.approx(1.0) and d["ci_low"] > 0 and d["verdict"] == "better"
    assert paired_bootstrap(y, poor, good, "auc", n_boot=200)["verdict"] == "worse"
    assert paired_bootstrap(y, good, poor, "balanced_accuracy", n_boot=200)["verdict"] == "better"


def test_interval_covers_the_true_difference_of_a_simulated_case():
    """Binormal scores: class-1 scores shifted by mu, unit variance per class (shared image effect + model noise),
    so AUC = Phi(mu / sqrt(2)). A: mu 1.2, B: mu 0.8; true difference Phi(.849) - Phi(.566) = 0.0842."""
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    true = phi(1.2 / math.sqrt(2)) - phi(0.8 / math.sqrt(2))
    rng = np.random.default_rng(3)
    y = np.repeat([0, 1], 400)
    common = rng.normal(0, math.sqrt(0.5), y.size)  # the image's own difficulty, shared by every model

    def scores(mu):
        return mu * y + common + rng.normal(0, math.sqrt(0.5), (3, 2, y.size))
    d = paired_bootstrap(y, scores(1.2), scores(0.8), "auc", n_boot=300, seed=0)
    assert d["ci_low"] < true < d["ci_high"]
    assert d["ci_high"] - d["ci_low"] < 0.1 and d["verdict"] == "better"


def test_verdict_rule_and_bad_input():
    assert verdict(0.01, 0.2) == "better" and verdict(-0.2, -0.01) == "worse"
    assert verdict(-0.1, 0.1) == "no difference detected" and verdict(0.0, 0.1) == "no difference detected"
    assert verdict(None, 0.1) is None
    with pytest.raises(ValueError, match="seeds, sites"):
        paired_bootstrap(Y4, np.zeros((1, 1, 4)), np.zeros((1, 2, 4)))
    with pytest.raises(ValueError, match="both classes"):
        paired_bootstrap(np.zeros(4), np.zeros((1, 1, 4)), np.zeros((1, 1, 4)))
    with pytest.raises(ValueError, match="unknown paired metric"):
        paired_bootstrap(Y4, np.zeros((1, 1, 4)), np.zeros((1, 1, 4)), "f1", n_boot=0)


def test_vectorised_weighted_auc_equals_scikit_learn_with_ties():
    from sklearn.metrics import roc_auc_score

    from hfl_components.training.paired import WeightedAUC

    rng = np.random.default_rng(4)
    y = rng.integers(0, 2, 120)
    s = np.round(rng.random((5, 120)), 1)  # many ties
    s[0] = 1.0  # every score tied: AUC 1/2
    fast = WeightedAUC(y, s)
    for w in (np.ones(120), rng.integers(0, 4, 120).astype(float)):
        want = [roc_auc_score(y, row, sample_weight=w) for row in s]
        assert fast(w) == pytest.approx(want, abs=1e-12)
    assert fast(np.ones(120))[0] == pytest.approx(0.5)
