"""The clinical operating point: temperature fit, the coarse histogram a site sends, and the pooled threshold the
server picks, against values computed by hand."""
from __future__ import annotations

import numpy as np
import pytest


def test_temperature_recovers_a_known_overconfidence_and_lowers_ece():
    from hfl_components.operating_point import apply_temperature, expected_calibration_error, fit_temperature

    rng = np.random.default_rng(0)
    n = 4000
    z = rng.normal(0, 1.5, n)  # true log-odds
    y = (rng.random(n) < 1 / (1 + np.exp(-z))).astype(int)
    over = np.stack([np.zeros(n), 3.0 * z], 1)  # a model three times overconfident
    probs = np.exp(over - over.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    T = fit_temperature(probs, y)
    assert T == pytest.approx(3.0, rel=0.1)
    cal = apply_temperature(probs, T)
    assert expected_calibration_error(cal, y) < 0.5 * expected_calibration_error(probs, y)
    # ranking (hence AUC) unchanged; T = 1 is the identity
    assert np.array_equal(np.argsort(cal[:, 1]), np.argsort(probs[:, 1]))
    assert np.allclose(apply_temperature(probs, 1.0), probs, atol=1e-9)


def test_coarse_histogram_merges_bins_to_the_minimum_count_by_hand():
    from hfl_components.operating_point import coarse_histogram

    grid = [0, 0.25, 0.5, 0.75, 1.0]
    # negatives per fine bin: 3, 1, 0, 1 -> [0, .25): 3; [.25, 1]: 1 + 0 + 1 = 2 (the remainder joins the last bin)
    # positives per fine bin: 0, 1, 1, 4 -> [0, .25): 0 (empty, outside any bin); [.25, .75): 2; [.75, 1]: 4
    p = [0.1, 0.2, 0.05, 0.3, 0.9, 0.3, 0.6, 0.8, 0.85, 0.95, 1.0]
    y = [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    h = coarse_histogram(p, y, grid, min_count=2)
    assert h["classes"]["0"] == {"edges": [0.0, 0.25, 1.0], "counts": [3, 2]}
    assert h["classes"]["1"] == {"edges": [0.0, 0.25, 0.75, 1.0], "counts": [0, 2, 4]}
    # every non-empty bin holds >= min_count images, whatever the scores
    rng = np.random.default_rng(1)
    for _ in range(20):
        h = coarse_histogram(rng.random(37), rng.integers(0, 2, 37), min_count=5)
        for c in h["classes"].values():
            assert sum(c["counts"]) < 5 or all(n == 0 or n >= 5 for n in c["counts"])
            assert len(c["edges"]) == len(c["counts"]) + 1 and c["edges"][0] == 0 and c["edges"][-1] == 1
    small = coarse_histogram([0.2, 0.9], [1, 1], min_count=5)["classes"]["1"]
    assert small == {"edges": [0.0, 1.0], "counts": [2]}  # too few for any bin: one bin over the grid
    with pytest.raises(ValueError, match="min_count"):
        coarse_histogram([0.5], [1], min_count=0)


HAND = [  # two sites' histograms (what they send)
    {"min_count": 2, "classes": {"1": {"edges": [0, 0.5, 0.75, 1], "counts": [2, 3, 5]},
                                 "0": {"edges": [0, 0.25, 0.5, 1], "counts": [6, 2, 2]}}},
    {"min_count": 2, "classes": {"1": {"edges": [0, 0.25, 0.75, 1], "counts": [1, 4, 5]},
                                 "0": {"edges": [0, 0.5, 1], "counts": [7, 3]}}},
]


@pytest.mark.parametrize("target,threshold,sens,spec", [
    # 20 positives. t = .75: 5 + 5 = 10 detected (0.50); t = .5: 8 + 5 = 13 (0.65; site B's [.25, .75) straddles);
    # t = .25: 8 + 9 = 17 (0.85); t = 0: 20 (1.0). Specificity (20 negatives): at t = .25 site A's bins from .25
    # (2 + 2) and site B's [.5, 1] (3) and its straddling [0, .5) (7) count as positive: 14 -> 6 / 20 = 0.30;
    # at t = .5: A's [.5, 1] (2) + B's [.5, 1] (3) -> 15 / 20 = 0.75; at t = 0 every negative is positive.
    (0.90, 0.0, 1.0, 0.0),
    (0.85, 0.25, 0.85, 0.30),
    (0.65, 0.5, 0.65, 0.75),
    (0.50, 0.75, 0.50, 0.75),
])
def test_pooled_threshold_by_hand(target, threshold, sens, spec):
    from hfl_components.operating_point import pooled_threshold

    r = pooled_threshold(HAND, target)
    assert r["threshold"] == threshold and r["sensitivity"] == pytest.approx(sens)
    assert r["specificity"] == pytest.approx(spec) and r["n_positive"] == 20 and r["n_negative"] == 20


def test_pooled_threshold_meets_the_target_on_the_pooled_scores_and_site_values_differ():
    """Pooling histograms of simulated sites: the threshold's true pooled sensitivity (from the raw scores the
    server never sees) reaches the target; a site whose scores are shifted achieves less, and says so."""
    from hfl_components.operating_point import coarse_histogram, federated_operating_point, site_sensitivity

    rng = np.random.default_rng(0)
    sites = {}
    for k, shift in enumerate((0.0, 0.0, -0.15)):
        y = np.r_[np.zeros(100, int), np.ones(100, int)]
        p = np.clip(np.where(y == 1, rng.beta(8, 2, 200), rng.beta(2, 8, 200)) + shift, 0, 1)
        sites[f"site-{k}"] = (p, y)
    reps = {s: {"histogram": coarse_histogram(p, y, min_count=5)} for s, (p, y) in sites.items()}
    op = federated_operating_point(reps, target=0.95)
    allp = np.concatenate([p for p, _ in sites.values()])
    ally = np.concatenate([y for _, y in sites.values()])
    assert op["threshold"] >= 0.3 and site_sensitivity(allp, ally, op["threshold"])["sensitivity"] >= 0.95
    assert op["sensitivity"] <= site_sensitivity(allp, ally, op["threshold"])["sensitivity"]  # a lower bound
    own = {s: site_sensitivity(p, y, op["threshold"])["sensitivity"] for s, (p, y) in sites.items()}
    assert own["site-2"] < min(own["site-0"], own["site-1"])
    assert federated_operating_point({"a": None}) is None


def test_site_report_sends_only_the_histogram_and_scalars():
    from hfl_components.operating_point import site_report

    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 50)
    p1 = np.clip(0.3 * y + 0.5 * rng.random(50), 0.01, 0.99)
    rep = site_report(np.stack([1 - p1, p1], 1), y)
    assert set(rep) == {"temperature", "ece_before", "ece_after", "n_val", "histogram"}
    for c in rep["histogram"]["classes"].values():
        assert all(n == 0 or n >= 5 for n in c["counts"]) and set(c["edges"]) <= {round(0.05 * i, 4) for i in range(21)}
